"""Where a run's files live: every path of the pipeline comes from here.

    models/<preset>/                                   the base model (params.yaml ``model.preset``)
    runs/<env>/warm-<k>/                               a warm-start stage (sft, rft, dpo) before the RL phases
    runs/<env>/phase-<k>/final/                        a curriculum phase's checkpoint (a clean HF folder)
    runs/<env>/phase-<k>/final-state/                  its trainer state (optimizer, RNG, data position)
    runs/<env>/phase-<k>/{intermediate,rollouts,dvclive}/
    runs/<env>/gate-<k>/promotion.json                 phase k's promotion gate: the checkpoint the next phase
                                                       starts from (decision.json: why; retries/retry-<n>/)
    runs/<env>/eval/{metrics,per_item}.json            the evaluation of the base model and every phase
    runs/<env>-fixed-h<h>/phase-0/..., eval/           a fixed-h baseline run and its evaluation
    reports/<env>.html, reports/index.html             the report

Paths are relative to ``root``: with the default ``Path(".")`` they are the strings dvc.yaml holds; with a
working copy's root they are the files on disk.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

RUNS = "runs"
MODELS = "models"
REPORTS = "reports"


def base_model(preset: str, root: Path = Path(".")) -> Path:
    """The base model folder of ``preset`` (built locally, or a hub model materialised by build-model)."""
    return root / MODELS / preset


def report_file(envs: list[str] | str, root: Path = Path(".")) -> Path:
    """``reports/<env>.html`` for one environment, ``reports/index.html`` for several."""
    envs = [envs] if isinstance(envs, str) else envs
    return root / REPORTS / (f"{envs[0]}.html" if len(envs) == 1 else "index.html")


@dataclass(frozen=True)
class Run:
    """One training run of an environment: its curriculum, or the fixed-h baseline at ``fixed_h``."""

    env: str
    fixed_h: int | None = None
    root: Path = Path(".")

    @property
    def name(self) -> str:
        return self.env if self.fixed_h is None else f"{self.env}-fixed-h{self.fixed_h}"

    @property
    def dir(self) -> Path:
        return self.root / RUNS / self.name

    def warm(self, index: int) -> Path:
        """The folder of warm-start stage ``index`` (training.settings.warm): its checkpoint(s) and its training
        episodes."""
        return self.dir / f"warm-{index}"

    def phase(self, index: int) -> Path:
        """The phase folder: intermediate/, final/, dvclive/, rollouts/."""
        return self.dir / f"phase-{index}"

    def final(self, index: int) -> Path:
        return self.phase(index) / "final"

    def state(self, index: int) -> Path:
        """The trainer state beside the final checkpoint (``training.checkpoint.state_folder``)."""
        return self.phase(index) / "final-state"

    def metrics(self, index: int) -> Path:
        return self.phase(index) / "dvclive" / "metrics.json"

    def gate(self, index: int) -> Path:
        """Phase ``index``'s promotion gate (training.evaluation.gate): promotion.json, summary.json, evals/,
        retry-<n>/."""
        return self.dir / f"gate-{index}"

    def promotion(self, index: int) -> Path:
        """What gate ``index`` decided: the checkpoint the next phase starts from (the next phase's dependency)."""
        return self.gate(index) / "promotion.json"

    def gate_summary(self, index: int) -> Path:
        """Gate ``index``'s headline figures (its DVC metric: a short row in `dvc metrics show`)."""
        return self.gate(index) / "summary.json"

    def gate_record(self, index: int) -> Path:
        """Gate ``index``'s whole account: the decision, its figures, each retry."""
        return self.gate(index) / "decision.json"

    def retries(self, index: int) -> Path:
        """Gate ``index``'s retrained phases (``retry-<n>/``, each a phase folder) and their index."""
        return self.gate(index) / "retries"

    def summary(self, index: int) -> Path:
        """The phase's few headline figures (its DVC metric; the per-step detail is ``metrics``)."""
        return self.phase(index) / "summary.json"

    def plots(self, index: int) -> Path:
        return self.phase(index) / "dvclive" / "plots" / "metrics"

    def rollouts(self, index: int) -> Path:
        return self.phase(index) / "rollouts"

    @property
    def eval_dir(self) -> Path:
        return self.dir / "eval"

    @property
    def eval_metrics(self) -> Path:
        return self.eval_dir / "metrics.json"

    @property
    def eval_summary(self) -> Path:
        """Each checkpoint's success, Avg@k and Pass@k (the evaluation's DVC metric; the detail is ``eval_metrics``)."""
        return self.eval_dir / "summary.json"

    @property
    def eval_per_item(self) -> Path:
        return self.eval_dir / "per_item.json"

    def eval_outside(self, model: str) -> Path:
        """The evaluation of an outside model (``scalinginter eval-outside``), named after it."""
        return self.eval_dir / "outside" / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', model)}.json"

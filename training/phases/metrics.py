"""Per-step metrics with dvclive (TSV plots + metrics.json that DVC reads), resumable to a step.

Metric names follow the project's namespaces: ``reward/mean``, ``success/rate``, ``actor/kl``,
``rollout/termination/<reason>``, ``timing_s/gen``, ``perf/tokens_per_s``, ``curriculum/h`` ...
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from dvclive import Live

VSCODE_SIGNALS = ("DVCLIVE_STEP_COMPLETED", "DVCLIVE_ONLY")  # files dvclive writes in .dvc/tmp/exps/run


def truncate_plots(folder: Path, first_step: int) -> None:
    """Drop logged rows at or after ``first_step`` (the steps a resumed run will log again)."""
    for tsv in (folder / "plots" / "metrics").rglob("*.tsv"):
        with tsv.open() as f:
            rows = list(csv.reader(f, delimiter="\t"))
        if rows:
            step_col = rows[0].index("step")
            rows = [rows[0]] + [r for r in rows[1:] if int(r[step_col]) < first_step]
        with tsv.open("w", newline="") as f:
            csv.writer(f, delimiter="\t").writerows(rows)


def check_name(name: str) -> None:
    """Refuse a metric name dvclive cannot plot: a last part ``step`` (``timing_s/step``) shares its column
    name with dvclive's own step column and overwrites it, so the file holds one meaningless column."""
    if name.rsplit("/", 1)[-1] == "step":
        raise ValueError(f"metric {name!r}: a last name part 'step' collides with dvclive's step column; "
                         "rename it (e.g. timing_s/total)")


class Metrics:
    """A dvclive run in ``folder``; ``log(metrics, step)`` writes one step."""

    def __init__(self, folder: Path, resume_at: int | None = None) -> None:
        if resume_at is not None and folder.exists():
            truncate_plots(folder, resume_at)
        self.live = Live(dir=str(folder), resume=resume_at is not None, save_dvc_exp=False, dvcyaml=False)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.live.step = step
        for name, value in sorted(metrics.items()):
            check_name(name)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.live.log_metric(name, float(value))
        self.live.next_step()

    def close(self) -> None:
        """End the run. dvclive's last acts remove the VS Code extension's signal files, shared by every run in
        the working copy (``.dvc/tmp/exps/run/DVCLIVE_STEP_COMPLETED``, ``DVCLIVE_ONLY``), each after checking
        that it exists: another run in the same working copy (a second phase, an xdist worker) may remove it in
        between. That is no failure of this run, whose metrics are written by then."""
        try:
            self.live.end()
        except FileNotFoundError as err:
            if Path(str(err.filename)).name not in VSCODE_SIGNALS:
                raise

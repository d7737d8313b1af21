"""Promotion gates: a phase hands its checkpoint on only if it is not worse than the checkpoint it started from.

After phase ``k`` (stage ``<env>_gate_<k>``), its final checkpoint and its parent (the checkpoint the phase
started from) are evaluated on the same gate items (``data/<env>/gate.json``: never trained on, apart from the
test split), with the evaluation's engine, k, temperature, turn cap (or the phase's own, ``gate.<profile>.cap:
phase``) and context budget (``eval.<profile>``), and
compared paired, per item and sample (bootstrap over items, then over each item's samples). The phase is
promoted when it is not worse than its parent by more than ``gate.<profile>.margin`` (``rule``: on the mean
difference, or on its whole 95% interval). Otherwise, as ``on_reject`` says:

- ``retry``: the phase is trained again (``retry-<n>/``, each a phase folder of its own) from its best
  intra-phase checkpoint (the kept ``intermediate/`` ones and the parent, scored on the gate items) at the
  learning rate times ``lr_factor``**n, up to ``max_retries`` times; the first retry that passes is promoted,
  and when none does, the parent is, and the curriculum goes on from it;
- ``stop``: the parent is promoted and the curriculum ends: later phases train nothing (their ``final/`` is the
  promoted checkpoint, linked, and their summary says so), and their gates pass it on;
- ``mark``: the phase is promoted anyway, and its decision says it was worse.

``promotion.json`` (the next phase's dependency) holds only what the next phase needs (the checkpoint, its hash,
the decision, whether the curriculum stopped), so a changed margin that leaves the decision alone reruns the gate
and nothing after it; ``decision.json`` holds the whole account and ``summary.json`` (the DVC metric) its figures.
Every checkpoint's gate evaluation is kept in ``evals/`` under its hash and the settings, so a killed gate resumes
without sampling twice, and a parent an earlier gate scored (the checkpoint it promoted) is not sampled again.

The mixed run's gate (``mixed_gate_<k>``) samples each of its environments' gate items (``gate.<profile>.items``
of each, tagged ``<env>:<id>``), each at the turn cap clipped to that environment's ``max_h`` as in training and
in its evaluation, and compares the pooled items: a phase that gains in one environment and loses more in
another is rejected.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from envs.files import atomic_write
from envs.paths import project_root
from envs.splits import load_split
from training.checkpoint import folder_hash
from training.evaluation.eval_stage import eval_servers, mixed_caps, test_items
from training.settings.config import (
    MIXED,
    ConfigError,
    GateConfig,
    curriculum_config,
    gate_config,
    load_params,
)
from training.settings.layout import Run
from training.settings.specs import EvalSpec, PhaseSpec, eval_spec, phase_spec, read_promotion

#: what promotion.json keeps (the next phase's dependency): nothing a changed margin moves unless the decision moves
PROMOTION_KEYS = ("checkpoint", "hash", "decision", "stop")


def paired_interval(before: np.ndarray, after: np.ndarray, resamples: int = 2000, level: float = 0.95,
                    seed: int = 0) -> tuple[float, float, float]:
    """(mean of ``after - before``, low, high): ``before`` and ``after`` are items x samples, paired cell by cell
    (the same item, the same sample seed). Each resample draws items, then each drawn item's samples."""
    diff = np.asarray(after, dtype=float) - np.asarray(before, dtype=float)
    if diff.ndim != 2 or diff.size == 0:
        raise ValueError(f"paired outcomes must be items x samples, not shape {diff.shape}")
    n, k = diff.shape
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, n, size=(resamples, n, 1))
    cols = rng.integers(0, k, size=(resamples, n, k))
    means = diff[rows, cols].mean(axis=(1, 2))
    low, high = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(diff.mean()), float(low), float(high)


def decide(before: np.ndarray, after: np.ndarray, config: GateConfig) -> dict[str, Any]:
    """Compare a candidate (``after``) with its parent (``before``) as ``config`` says: the mean difference, its
    95% interval, and whether the candidate passes."""
    diff, low, high = paired_interval(before, after, config.resamples)
    passed = diff >= -config.margin if config.rule == "point" else high >= -config.margin
    return {"parent": float(np.mean(before)), "candidate": float(np.mean(after)), "diff": diff, "ci95": [low, high],
            "margin": config.margin, "rule": config.rule, "passed": bool(passed)}


class GateRun:
    """One gate: its settings, items and servers, and a cache of every checkpoint's gate evaluation."""

    def __init__(self, env: str, index: int, root: Path, url: str, policy_url: str | None,
                 batch_items: Callable[[], int],
                 progress: Callable[[str], None] | None = None, phase_h: int | None = None,
                 spec: EvalSpec | None = None) -> None:
        params = load_params(root / "params.yaml")
        self.env, self.index, self.root, self.url, self.policy_url = env, index, root, url, policy_url
        self.config = gate_config(env, params=params)
        self.spec = spec or eval_spec(env, params)  # sampled as the evaluation stage samples
        if self.config.cap == "phase" and phase_h is not None:  # at the phase's own turn cap
            self.spec = self.spec.model_copy(update={"h": phase_h})
        self.eval, self.h = self.spec.config, self.spec.h
        # each environment's turn cap: the gate's, or for the mixed run the gate's clipped to each one's max_h
        self.caps = mixed_caps(params, None, self.eval, self.h) if env == MIXED else {env: self.h}
        for e in self.caps:
            if not load_split(e, "gate", root / "data"):
                raise ConfigError(f"data/{e}/gate.json holds no items ({e} has none beyond its train and test "
                                  f"splits): set gate.<profile>.envs.{env}.enabled: false in params.yaml")
        # the evaluation's sub-tasks, the gate's own item count (of each environment's, on the mixed run)
        chosen = self.eval.model_copy(update={"items": self.config.items})
        self.parts = {e: [r["item_id"] for r in test_items(e, chosen, "gate", root / "data")] for e in self.caps}
        self.items = (self.parts[env] if env != MIXED
                      else [f"{e}:{i}" for e, ids in self.parts.items() for i in ids])
        self.run = Run(env, root=root)
        self.folder = self.run.gate(index)
        self.progress, self.batch_items = progress, batch_items
        self.episodes = 0  # rollouts sampled by this gate (cached ones not counted)

    def settings(self) -> dict[str, Any]:
        caps = {"caps": self.caps} if self.env == MIXED else {}  # (a single environment's cache keys as before)
        return {"items": self.items, "h": self.h, "k": self.eval.k, "temperature": self.eval.temperature,
                "seed": self.eval.seed, "max_new_tokens": self.eval.max_new_tokens,
                "context_budget": self.eval.context_budget, "engine": self.eval.engine, **caps}

    def outcomes(self, checkpoint: Path) -> np.ndarray:
        """``checkpoint`` on the gate items: items x samples of the gate's metric (from the cache when there)."""
        checkpoint = checkpoint if checkpoint.is_absolute() else self.root / checkpoint
        settings = self.settings()
        digest = folder_hash(checkpoint)
        key = hashlib.sha256(json.dumps([digest, settings], sort_keys=True).encode()).hexdigest()[:16]
        cache = self.folder / "evals" / f"{key}.json"
        # the same checkpoint under the same settings, scored by an earlier gate of the run (its parent, mostly)
        earlier = [p for p in sorted(self.run.dir.glob(f"gate-*/evals/{key}.json")) if p != cache]
        if cache.exists() or earlier:
            data = json.loads((cache if cache.exists() else earlier[0]).read_text())
            if not cache.exists():
                cache.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(cache, json.dumps(data))
        else:
            if self.progress is not None:
                self.progress(f"gate {self.index}: evaluating {checkpoint}")
            result = _sample(self, checkpoint)
            self.episodes += len(self.items) * self.eval.k
            data = {"checkpoint": str(checkpoint.relative_to(self.root)) if checkpoint.is_relative_to(self.root)
                    else str(checkpoint), "hash": digest,
                    "success": [[float(x) for x in result.success[i]] for i in self.items],
                    "reward": [[float(x) for x in result.reward[i]] for i in self.items]}
            cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(cache, json.dumps(data))
        return np.asarray(data[self.config.metric], dtype=float)


def _sample(gate: GateRun, checkpoint: Path) -> Any:
    """``checkpoint``'s episodes on the gate items (an ``EvalResult``): on the mixed run, each environment's items
    on its own servers at its own cap, merged under tagged ids."""
    from envs.urls import ServerUrls
    from training.evaluation.evaluate import evaluate, evaluate_parts

    sampling = gate.spec.sampling()
    if gate.env != MIXED:
        return evaluate(checkpoint, gate.env, gate.url, gate.items, batch_items=gate.batch_items(),
                        policy_url=gate.policy_url, **sampling)
    urls = ServerUrls.parse(gate.url, list(gate.caps))
    sampling = {k: v for k, v in sampling.items() if k not in ("h", "policy_server")}  # each part at its own cap
    return evaluate_parts(checkpoint, {e: (urls.replicas(e), ids, gate.caps[e]) for e, ids in gate.parts.items()},
                          batch_items=gate.batch_items(), **sampling)


def _rel(path: Path, root: Path) -> str:
    path = path if path.is_absolute() else root / path
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def run_gate(env: str, index: int, url: str | None = None, root: Path | None = None, policy_url: str | None = None,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Gate phase ``index`` of ``env``'s run: evaluate, decide, retry if so configured; write promotion.json and
    summary.json; return the summary. ``url``: environment servers that already run (else started here);
    ``policy_url``: a vLLM server for ``eval.engine: vllm`` (else SCALINGINTER_VLLM_URL, else started here)."""
    root = root or project_root()
    params = load_params(root / "params.yaml")
    config = gate_config(env, params=params)
    if not config.enabled:
        raise ConfigError(f"gate.<profile>.enabled is false for {env}: the pipeline has no gate stages for it")
    run = Run(env, root=root)
    spec = phase_spec(env, index, root)
    parent, candidate = spec.init, run.final(index)
    started = time.perf_counter()
    if spec.stopped:  # the curriculum ended at an earlier gate: pass its checkpoint on
        earlier = read_promotion(run.promotion(index - 1))
        summary = {"decision": "passed-on", "stop": True, "checkpoint": earlier["checkpoint"],
                   "note": "the curriculum stopped at an earlier gate; this phase trained nothing"}
        return _write(run, index, {k: earlier[k] for k in ("checkpoint", "hash")} | {"decision": "passed-on",
                                                                                      "stop": True}, summary)
    gate_spec = eval_spec(env, params)
    with eval_servers(env, params, gate_spec.config, url, policy_url, parent) as (base, served, batch):
        gate = GateRun(env, index, root, base, served, batch, progress, phase_h=spec.h, spec=gate_spec)
        before = gate.outcomes(parent)
        first = decide(before, gate.outcomes(candidate), config)
        retries: list[dict[str, Any]] = []
        chosen, decision, stop = candidate, "promoted", False
        if not first["passed"]:
            if config.on_reject == "mark":
                decision = "marked"
            elif config.on_reject == "stop":
                chosen, decision, stop = parent, "stopped", True
            else:
                chosen, decision = parent, "parent"
                start, start_score, scored = _best_start(gate, spec, before)
                candidates = {_rel(folder, root): value for folder, value in scored.items()}
                if not candidates and progress is not None:  # the record says it too: intermediate_scored {}
                    progress(f"gate {index}: no intra-phase checkpoint in {_rel(_phase_out(gate, spec), root)}"
                             "/intermediate (the trainer's scratch space: a phase pulled from the DVC remote has "
                             "none); the retry starts from the parent")
                for n in range(1, config.max_retries + 1):
                    lr = spec.train.lr * config.lr_factor ** n
                    retry = _retry(spec, start, run.retries(index) / f"retry-{n}", lr, base, served, root)
                    verdict = decide(before, gate.outcomes(retry), config)
                    retries.append({"retry": n, "start": _rel(start, root), "start_score": start_score,
                                    "intermediate_scored": candidates, "lr": lr,
                                    "checkpoint": _rel(retry, root)} | verdict)
                    if verdict["passed"]:
                        chosen, decision = retry, f"retry-{n}"
                        break
        episodes = gate.episodes
        settings = gate.settings()
    promotion = {"checkpoint": _rel(chosen, root), "hash": folder_hash(root / chosen), "decision": decision,
                 "stop": stop}
    summary = {"decision": decision, "stop": stop, "checkpoint": promotion["checkpoint"],
               "parent_checkpoint": _rel(parent, root), "phase_checkpoint": _rel(candidate, root),
               "metric": config.metric, **first, "on_reject": config.on_reject, "retries": retries,
               "items": len(settings["items"]), "k": settings["k"], "h": settings["h"],
               "temperature": settings["temperature"], "engine": settings["engine"], "episodes_sampled": episodes,
               **({"caps": settings["caps"]} if "caps" in settings else {}),  # the mixed run's, per environment
               "seconds": round(time.perf_counter() - started, 3)}
    return _write(run, index, promotion, summary)


def _write(run: Run, index: int, promotion: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """promotion.json (the next phase's dependency), decision.json (the whole account) and summary.json (the DVC
    metric: the gate's figures as numbers, 1 when the phase's own checkpoint was promoted)."""
    run.retries(index).mkdir(parents=True, exist_ok=True)
    (run.gate(index) / "evals").mkdir(parents=True, exist_ok=True)
    # each folder lists what it holds (and is never empty, which DVC warns about)
    atomic_write(run.retries(index) / "index.json", json.dumps(summary.get("retries", []), indent=1))
    evals = run.gate(index) / "evals"
    held = sorted(p.name for p in evals.glob("*.json") if p.name != "index.json")
    atomic_write(evals / "index.json", json.dumps(held))
    atomic_write(run.gate_record(index), json.dumps(summary, indent=1))
    headline = {"gate_parent": summary.get("parent"), "gate_phase": summary.get("candidate"),
                "gate_diff": summary.get("diff"),
                "phase_promoted": int(summary["decision"] in ("promoted", "marked"))}
    atomic_write(run.gate_summary(index), json.dumps({k: v for k, v in headline.items() if v is not None}, indent=1))
    atomic_write(run.promotion(index), json.dumps({k: promotion[k] for k in PROMOTION_KEYS}, indent=1))
    return summary


def _phase_out(gate: GateRun, spec: PhaseSpec) -> Path:
    return spec.out if spec.out.is_absolute() else gate.root / spec.out


def _best_start(gate: GateRun, spec: PhaseSpec, parent_scores: np.ndarray) -> tuple[Path, float, dict[Path, float]]:
    """Where a retry starts: the best on the gate items of the parent and the phase's kept intra-phase
    checkpoints (ties go to the parent: the retry then re-trains the whole phase); also each intra-phase
    checkpoint's score (none where the phase's ``intermediate/`` is absent, as on a worker that pulled the phase)."""
    from training.checkpoint import list_checkpoints

    best, score, scored = spec.init, float(np.mean(parent_scores)), {}
    for folder in list_checkpoints(_phase_out(gate, spec) / "intermediate"):
        scored[folder] = value = float(np.mean(gate.outcomes(folder)))
        if value > score:
            best, score = folder, value
    return best, score, scored


def retry_command(spec: PhaseSpec, root: Path) -> list[str]:
    """``train-phase`` for ``spec`` (a retry: the phase's own settings, its start, folder and learning rate), as its
    phase stage runs it (relaunched under torchrun across the pool's ranks and nodes), its paths relative to the
    run's working copy ``root`` (the same on every node). The servers go by environment variable, not in the
    command: a follower node's ranks start their own, as in a phase stage."""
    def rel(path: Path) -> str:
        return str(path.relative_to(root)) if path.is_absolute() and path.is_relative_to(root) else str(path)

    return [sys.executable, "-m", "flows.cli", "train-phase", spec.env, "--phase", str(spec.index), "--h",
            str(spec.h), "--steps", str(spec.steps), "--init", rel(spec.init), "--out", rel(spec.out),
            "--set", f"lr={spec.train.lr!r}", *(["--adaptive"] if spec.adaptive is not None else [])]


def _retry(spec: PhaseSpec, start: Path, out: Path, lr: float, url: str, policy_url: str | None,
           root: Path) -> Path:
    """The phase trained again from ``start`` at ``lr`` into ``out`` (resumed if interrupted): in this process, or,
    where the pool trains on several ranks or nodes (``SCALINGINTER_NPROC``, ``SCALINGINTER_NNODES``), under
    torchrun as the phase itself was (``retry_command``)."""
    from training.phases.phase import run_phase
    from training.placement.devices import launcher_args

    retry = spec.model_copy(update={"init": start, "out": out, "train": spec.train.model_copy(update={"lr": lr})})
    if not launcher_args():
        return run_phase(retry, url, policy_url=policy_url)
    cmd = retry_command(retry, root)  # in the run's working copy, whose params.yaml it reads
    servers = {"SCALINGINTER_ENV_URL": url, **({"SCALINGINTER_VLLM_URL": policy_url} if policy_url else {})}
    code = subprocess.call(cmd, cwd=root, env={**os.environ, "SCALINGINTER_ROOT": str(root), **servers})
    if code != 0:
        raise RuntimeError(f"the retry of phase {spec.index} ended with exit code {code}: {' '.join(cmd)}")
    return out / "final"


def run_result(env: str, root: Path | None = None) -> dict[str, Any]:
    """The checkpoint a gated run hands back: of the checkpoints its gates promoted, the one with the best gate
    score (all are scored on the same gate items and samples; ties go to the later); ``{"checkpoint", "gate",
    "score", "decision"}``. Only scores at the last gate's turn cap compare: with ``gate.cap: phase`` each gate
    samples at its phase's h, so a gate at another cap is left out (at growing caps: the last promotion is handed
    back). Ungated, the last phase's final checkpoint."""
    root = root or project_root()
    params = load_params(root / "params.yaml")
    run = Run(env, root=root)
    phases = curriculum_config(env, params=params).phases()
    if not gate_config(env, params=params).enabled:
        return {"checkpoint": str(run.final(phases[-1].index).relative_to(root)), "gate": None, "score": None,
                "decision": "ungated"}
    rows: list[dict[str, Any]] = []
    for phase in phases:
        summary_path = run.gate_record(phase.index)
        if not summary_path.exists():
            raise ConfigError(f"{summary_path} not found: run the gates first (`dvc repro {env}_gate_{phase.index}`)")
        summary = json.loads(summary_path.read_text())
        if summary["decision"] == "passed-on":
            continue
        chosen = summary["checkpoint"]
        score = next((r["candidate"] for r in summary["retries"] if r["checkpoint"] == chosen), None)
        if score is None:
            score = summary["candidate"] if chosen == summary["phase_checkpoint"] else summary["parent"]
        rows.append({"checkpoint": chosen, "gate": phase.index, "score": score, "decision": summary["decision"],
                     "h": summary.get("h")})
    assert rows  # phase 0's gate always decides
    best: dict[str, Any] | None = None
    for row in rows:
        if row["h"] == rows[-1]["h"] and (best is None or row["score"] >= best["score"]):
            best = row
    assert best is not None
    return {k: v for k, v in best.items() if k != "h"}


def describe(index: int, summary: dict[str, Any]) -> str:
    """One gate's decision as a line: ``gate 1: promoted: 40% -> 45% (+5.0, CI ...; margin 5); hands on ...``."""
    return f"gate {index}: {gate_text(summary)}; hands on {summary['checkpoint']}"


def gate_text(record: dict[str, Any]) -> str:
    """A gate's decision in a few words: ``promoted: 25% -> 31% (+6.2, CI -3.1..+15.6; margin 5)``."""
    if record["decision"] == "passed-on":
        return "passed on (the curriculum stopped earlier)"
    low, high = record["ci95"]
    text = (f"{record['decision']}: {record['parent']:.0%} -> {record['candidate']:.0%} "
            f"({100 * record['diff']:+.1f}, CI {100 * low:+.1f}..{100 * high:+.1f}; margin {100 * record['margin']:g})")
    for r in record.get("retries", []):
        verdict = "passed" if r["passed"] else "failed"
        text += f"; retry {r['retry']} at lr {r['lr']:.2g}: {r['candidate']:.0%} ({verdict})"
    return text

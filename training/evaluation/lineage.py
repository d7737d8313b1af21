"""The lineage of a curriculum: which phase produced each checkpoint, from which parent, with what.

Two records must tell the same story: ``dvc.lock`` (what DVC ran: each phase stage's params and the
md5 of its inputs and outputs) and the checkpoints' own manifests (phase, h, steps, algorithm, parent
hash, own hash, cost). :func:`lineage` reads both and lists every disagreement; the CLI fails on any.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from training.checkpoint import MANIFEST, CheckpointError, folder_hash, read_manifest
from training.evaluation.gate import gate_text
from training.settings.config import base_model_dir, load_params
from training.settings.layout import Run
from training.settings.warm import parse_stage, stage_checkpoints


@dataclass
class PhaseRecord:
    """One phase as both records see it."""

    stage: str
    h: int
    steps: int
    algorithm: str
    parent: str
    own: str
    metrics: dict[str, float] = field(default_factory=dict)
    cost: dict[str, float] = field(default_factory=dict)
    curriculum: dict[str, Any] = field(default_factory=dict)  # trained steps; an adaptive phase's early advance
    guard: list[dict[str, Any]] = field(default_factory=list)  # the collapse guard's trips (training/guard.py)
    summary: str = ""  # a warm-start stage's account of what it trained on (its "trained")

    @property
    def trained(self) -> str:
        """Steps trained, with the reason when an adaptive phase advanced early ("2 of 4: ...") and each trip of
        the collapse guard ("guard: actor/kl=3.2 at step 5, back to 4, lr x0.1"); a warm-start stage's summary."""
        if self.summary:
            return self.summary
        done = self.curriculum.get("trained_steps", self.steps)
        budget = self.curriculum.get("budget", self.steps)
        reason = self.curriculum.get("advanced_early")
        text = f"{done} of {budget}: {reason}" if reason else str(done)
        for e in self.guard:
            then = f"lr x{e['lr_scale']:g}" if e["action"] == "lower_lr" else "phase ended"
            text += (f"; guard: {e['signal']}={e['value']:.3g} at step {e['step']}, back to "
                     f"{e['rolled_back_to']}, {then}")
        return text


def _git_revision(root: Path) -> str:
    done = subprocess.run(["git", "log", "-1", "--format=%h", "--", "dvc.lock"], cwd=root, capture_output=True,
                          text=True)
    return done.stdout.strip() or "uncommitted"


def _metrics(folder: Path) -> dict[str, float]:
    path = folder / "dvclive" / "metrics.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {"reward/mean": data.get("reward", {}).get("mean"), "success/rate": data.get("success", {}).get("rate")}


def _warm_summary(method: str, manifests: list[dict[str, Any]]) -> str:
    last = manifests[-1]
    if method == "rft":
        return "; ".join(f"round {m['round']}: kept {m['kept']} of {m['sampled']}" for m in manifests)
    if method == "dpo":
        return f"{last['pairs']} pairs of {last['items']} items, {last['accuracy_after']:.0%} preferred"
    return f"{last['episodes']} {last.get('source', 'expert')} episodes, loss {last['first_loss']:.3g} -> " \
           f"{last['final_loss']:.3g}"


def _warm_records(env: str, stages: dict[str, Any], root: Path, expected_parent: str | None
                  ) -> tuple[list[PhaseRecord], list[str], str | None]:
    """The warm-start stages (training.settings.warm) as records, checked against dvc.lock: their settings,
    their kind and their chain of parents (an RFT run's rounds each from the last); returns the last checkpoint's
    hash."""
    names = sorted((s for s in stages if s.startswith(f"{env}_warm_")), key=lambda s: int(s.rsplit("_", 1)[1]))
    records, problems = [], []
    for name in names:
        index = int(name.rsplit("_", 1)[1])
        locked = parse_stage(stages[name]["params"]["phases.yaml"][f"{env}.warm_{index}"])
        folder = Run(env, root=root).warm(index)
        try:
            manifests = [read_manifest(c) for c in stage_checkpoints(folder, locked)]
        except CheckpointError as err:
            problems.append(f"{name}: {err} (run `dvc pull` to fetch it)")
            continue
        for m in manifests:
            recorded = dict(m.get("warm_start") or {})
            if recorded.pop("index", None) != index or parse_stage(recorded) != locked:
                problems.append(f"{name}: dvc.lock says {locked.model_dump(exclude_none=True)}, the checkpoint "
                                f"{m.get('round', 'final')} was made with {m.get('warm_start')}")
            if m.get("kind") != locked.method:
                problems.append(f"{name}: the checkpoint was written by {m.get('kind')}, not {locked.method}")
            if expected_parent is not None and m["parent"] != expected_parent:
                problems.append(f"{name}: its parent is {m['parent'][:12]}, but the previous checkpoint is "
                                f"{expected_parent[:12]}")
            expected_parent = m["hash"]
        records.append(PhaseRecord(name, getattr(locked, "h", 0), 0, locked.method, manifests[0]["parent"],
                                   manifests[-1]["hash"], summary=_warm_summary(locked.method, manifests)))
    return records, problems, expected_parent


def lineage(env: str, root: Path) -> tuple[list[PhaseRecord], list[str], str]:
    """(records in order: warm-start stages then phases, disagreements between dvc.lock and the checkpoints,
    git revision)."""
    lock_path = root / "dvc.lock"
    if not lock_path.exists():
        raise FileNotFoundError(f"{lock_path} not found: run `dvc repro` (or pull the run's git history) first")
    stages: dict[str, Any] = yaml.safe_load(lock_path.read_text())["stages"]
    pipeline = root / "dvc.yaml"  # dvc.lock keeps the entries of stages the pipeline no longer has: not part of it
    if pipeline.exists():
        current = set((yaml.safe_load(pipeline.read_text()) or {}).get("stages", {}))
        stages = {name: entry for name, entry in stages.items() if name in current}
    names = sorted((s for s in stages if s.startswith(f"{env}_phase_")), key=lambda s: int(s.rsplit("_", 1)[1]))
    if not names:
        raise LookupError(f"dvc.lock has no {env} phase stages: is {env} in params.yaml pipeline.envs?")
    base = base_model_dir(load_params(root / "params.yaml"), root)
    records, problems, expected_parent = _warm_records(env, stages, root,
                                                       folder_hash(base) if base.exists() else None)
    for name in names:
        index = int(name.rsplit("_", 1)[1])
        locked = stages[name]["params"]["phases.yaml"][f"{env}.phase_{index}"]
        folder = Run(env, root=root).phase(index)
        try:
            manifest = read_manifest(folder / "final")
        except CheckpointError as err:
            problems.append(f"{name}: {err} (run `dvc pull` to fetch it)")
            continue
        summary = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").exists() else {}
        if summary.get("stopped"):  # after a gate that ended the curriculum: the promoted checkpoint, passed on
            records.append(PhaseRecord(name, locked["h"], 0, "-", manifest["hash"], manifest["hash"],
                                       summary=f"nothing: the curriculum stopped; passes on {summary['passed_on']}"))
            records += _gate_record(env, index, stages, root, problems)[:1]
            continue
        record = PhaseRecord(name, manifest["h"], manifest["steps"], manifest["algorithm"], manifest["parent"],
                             manifest["hash"], _metrics(folder), manifest.get("cost", {}),
                             manifest.get("curriculum", {}), manifest.get("guard", {}).get("events", []))
        for key in ("h", "steps", "algorithm"):
            seen = getattr(record, key)
            if locked[key] != seen:
                problems.append(f"{name}: dvc.lock says {key}={locked[key]}, the checkpoint says {seen}")
        if manifest["phase"] != index:
            problems.append(f"{name}: the checkpoint was written by phase {manifest['phase']}")
        if expected_parent is not None and record.parent != expected_parent:
            problems.append(f"{name}: its parent is {record.parent[:12]}, but the previous checkpoint is "
                            f"{expected_parent[:12]}")
        expected_parent = record.own
        records.append(record)
        gate = _gate_record(env, index, stages, root, problems)
        if gate:  # the next phase starts from what the gate promoted
            records.append(gate[0])
            expected_parent = gate[0].own
    return records, problems, _git_revision(root)


def _gate_record(env: str, index: int, stages: dict[str, Any], root: Path, problems: list[str]) -> list[PhaseRecord]:
    """Phase ``index``'s promotion gate (training.evaluation.gate) as a record: parent = the phase's checkpoint,
    hash = the checkpoint it promoted, trained = its decision with its figures; [] when the pipeline has no such
    gate."""
    name = f"{env}_gate_{index}"
    if name not in stages:
        return []
    run = Run(env, root=root)
    path = run.gate_record(index)
    if not path.exists():
        problems.append(f"{name}: {path} is missing (run `dvc pull` to fetch it)")
        return []
    record = json.loads(path.read_text())
    promoted = json.loads(run.promotion(index).read_text())
    if promoted["checkpoint"] != record["checkpoint"]:
        problems.append(f"{name}: promotion.json names {promoted['checkpoint']}, decision.json {record['checkpoint']}")
    phase = read_manifest(run.final(index))["hash"] if (run.final(index) / MANIFEST).exists() else "-"
    return [PhaseRecord(name, record.get("h", 0), 0, "gate", phase, promoted["hash"], summary=gate_text(record))]

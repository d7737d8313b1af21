"""``scalinginter export``: a phase's checkpoint as a folder to hand on, with its evaluation in the model card.

The phase's ``final/`` is already a clean Hugging Face folder with a model card, written when it was trained;
its evaluation comes later (the ``<env>_eval`` stage). The export copies the model, tokenizer and chat
template, writes the card again with the evaluation of that very checkpoint (matched by its hash), and keeps
the training manifest as ``scalinginter_manifest.json`` for provenance.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from envs.paths import project_root
from training.checkpoint import MANIFEST, model_card, read_manifest, replace_folder
from training.evaluation.gate import run_result
from training.settings.config import ConfigError, curriculum_config, load_params
from training.settings.layout import Run


def _last_step(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """dvclive's nested metrics.json flattened to ``reward/mean`` style names."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= _last_step(value, f"{name}/")
        elif isinstance(value, int | float):
            out[name] = float(value)
    return out


def export_result(env: str, out: Path, root: Path | None = None) -> tuple[Path, str]:
    """Write the checkpoint ``env``'s run hands back (training.evaluation.gate.run_result: the best its promotion gates
    promoted, or ungated the last phase's) to ``out``; returns (``out``, what it was)."""
    root = root or project_root()
    result = run_result(env, root)
    run = Run(env, root=root)
    phases = curriculum_config(env, params=load_params(root / "params.yaml")).phases()
    index = next((p.index for p in phases if run.final(p.index) == root / result["checkpoint"]), None)
    if index is not None:
        path, what = export_phase(env, index, out, root), f"phase {index} ({result['decision']})"
    else:  # a retry a gate promoted, or the checkpoint the curriculum started from
        evaluated = json.loads(run.eval_metrics.read_text())["checkpoints"] if run.eval_metrics.exists() else {}
        name = next((n for n, c in evaluated.items() if c.get("path") == result["checkpoint"]), None)
        path, what = _export(run, root / result["checkpoint"], name, None, out), \
            f"{result['checkpoint']} ({result['decision']})"
    if result["gate"] is not None:  # the card says why this checkpoint is the one handed on
        with (path / "README.md").open("a") as card:
            card.write(f"\n## Promotion\n\nWhat the run hands back: `{result['checkpoint']}`, {result['decision']} at "
                       f"promotion gate {result['gate']} (gate score {result['score']:.1%} on the gate items; "
                       f"`scalinginter lineage {env}` shows every gate's decision).\n")
    return path, what


def export_phase(env: str, index: int, out: Path, root: Path | None = None) -> Path:
    """Write phase ``index`` of ``env``'s run to ``out`` (replaced if it exists); returns ``out``. A phase its
    promotion gate rejected (training.evaluation.gate) is refused: the run hands back another checkpoint."""
    root = root or project_root()
    run = Run(env, root=root)
    record = run.gate_record(index)
    if record.exists():  # the phase went through a promotion gate
        decision = json.loads(record.read_text())["decision"]
        if decision not in ("promoted", "marked"):
            raise ConfigError(f"phase {index} of {env} was rejected by its promotion gate ({decision}; {record}): "
                              f"export the run's result instead (`scalinginter export {env} --out DIR`, no --phase)")
    return _export(run, run.final(index), f"phase-{index}", index, out)


def _export(run: Run, final: Path, name: str | None, index: int | None, out: Path) -> Path:
    """``final`` (a checkpoint of ``run``; ``name`` its evaluation's entry, ``index`` its phase) to ``out``."""
    manifest = read_manifest(final, verify=True)
    evaluation = None
    if run.eval_metrics.exists() and name is not None:
        metrics = json.loads(run.eval_metrics.read_text())
        entry = metrics["checkpoints"].get(name)
        if entry is not None and entry.get("hash") != manifest["hash"]:
            raise ConfigError(f"{run.eval_metrics} evaluated another {name} checkpoint: run `dvc repro "
                              f"{run.env}_eval` first")
        if entry is not None:
            evaluation = {**entry, **{k: metrics[k] for k in ("items", "k", "temperature", "h", "seed")}}
    stats = (_last_step(json.loads(run.metrics(index).read_text()))
             if index is not None and run.metrics(index).exists() else {})
    tmp = out.parent / f".tmp-{out.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for name in manifest["files"]:
        if not name.startswith("state/") and name != "README.md":
            shutil.copy2(final / name, tmp / name)
    (tmp / "README.md").write_text(model_card(manifest, stats, evaluation))
    shutil.copy2(final / MANIFEST, tmp / "scalinginter_manifest.json")
    replace_folder(tmp, out)
    return out

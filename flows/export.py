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
from training.config import ConfigError
from training.layout import Run


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


def export_phase(env: str, index: int, out: Path, root: Path | None = None) -> Path:
    """Write phase ``index`` of ``env``'s run to ``out`` (replaced if it exists); returns ``out``."""
    run = Run(env, root=root or project_root())
    final = run.final(index)
    manifest = read_manifest(final, verify=True)
    evaluation = None
    if run.eval_metrics.exists():
        metrics = json.loads(run.eval_metrics.read_text())
        entry = metrics["checkpoints"].get(f"phase-{index}")
        if entry is not None and entry.get("hash") != manifest["hash"]:
            raise ConfigError(f"{run.eval_metrics} evaluated another phase-{index} checkpoint: run `dvc repro "
                              f"{env}_eval` first")
        if entry is not None:
            evaluation = {**entry, **{k: metrics[k] for k in ("items", "k", "temperature", "h", "seed")}}
    stats = _last_step(json.loads(run.metrics(index).read_text())) if run.metrics(index).exists() else {}
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

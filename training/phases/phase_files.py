"""What a phase folder holds besides its checkpoints, and how a resume treats it: the logs a checkpoint carries
(metrics and rollout logs, snapshotted beside it and restored with it), the staging left by a killed write, and
trainer state loaded without unpickling anything but tensors and plain containers.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from envs.paths import pid_alive
from training.checkpoint import CheckpointError

log = logging.getLogger(__name__)

LOGS = "logs"


def snapshot_logs(out_dir: Path, dest: Path) -> None:
    """Copy the phase's metrics (dvclive/) and hard-link its rollout logs into ``dest``, so a resume has them even
    when the phase folder's logs are gone: ``dvc exp run`` checks a stage's outputs out before rerunning it, and
    deletes a persistent output that has no hash yet (a phase killed before its end), so the first steps'
    metrics and rollouts would be lost from the resumed phase."""
    if (out_dir / "dvclive").exists():
        shutil.copytree(out_dir / "dvclive", dest / "dvclive")
    (dest / "rollouts").mkdir(parents=True)
    for log in (out_dir / "rollouts").glob("step-*.jsonl"):
        try:
            os.link(log, dest / "rollouts" / log.name)  # written atomically, never changed in place: a link is safe
        except OSError:
            shutil.copy2(log, dest / "rollouts" / log.name)


def restore_logs(snapshot: Path, out_dir: Path) -> None:
    """Bring back the logs a resumed checkpoint saw: its dvclive/ replaces the phase's (rows of later steps are
    rerun anyway) and the rollout logs missing from the phase folder come back."""
    if not snapshot.is_dir():  # a checkpoint of an older version
        return
    if (snapshot / "dvclive").is_dir():
        shutil.rmtree(out_dir / "dvclive", ignore_errors=True)
        shutil.copytree(snapshot / "dvclive", out_dir / "dvclive")
    (out_dir / "rollouts").mkdir(parents=True, exist_ok=True)
    for log in (snapshot / "rollouts").glob("step-*.jsonl"):
        if not (out_dir / "rollouts" / log.name).exists():
            shutil.copy2(log, out_dir / "rollouts" / log.name)


# a checkpoint's staging folder: .tmp-<name>-<pid>[-state] (one writer) or .tmp-<name> (ranks share it), and the
# folder a replaced checkpoint is moved to, .old-<name>-<pid>
_STAGED_CHECKPOINT = re.compile(r"\.(?:tmp|old)-(?:step-\d+|final)(?:-(\d+))?(?:-state)?")
_STAGED_FILE = re.compile(r"\.tmp-.+-(\d+)")  # a file envs.files.atomic_write was writing: .tmp-<name>-<pid>


def remove_stale_staging(out_dir: Path) -> list[Path]:
    """Remove what a killed write left anywhere in a phase folder: checkpoint staging folders (``.tmp-*``,
    ``.old-*``) and the temporary files of atomic writes (a rollout log's ``.tmp-step-000003.jsonl-<pid>``), except
    those of a live process; returns what was removed."""
    removed = []
    for root, dirs, files in os.walk(out_dir) if out_dir.exists() else []:
        for name, pattern, is_dir in [*((d, _STAGED_CHECKPOINT, True) for d in dirs),
                                      *((f, _STAGED_FILE, False) for f in files)]:
            match = pattern.fullmatch(name) if name.startswith((".tmp-", ".old-")) else None
            if match is None or (match.group(1) and pid_alive(int(match.group(1)))):
                continue
            path = Path(root) / name
            if is_dir:
                shutil.rmtree(path, ignore_errors=True)
                dirs.remove(name)  # not walked into
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.warning("removed %d staging folders and files left by an interrupted write: %s", len(removed),
                    ", ".join(p.name for p in removed))
    return removed


def load_state(path: Path, classes: list[type] | None = None) -> dict[str, Any]:
    """Trainer or optimizer state: tensors, plain containers and the strategy's own state ``classes`` only (a
    checkpoint may come from a remote, and unpickling anything else could run code)."""
    try:
        with torch.serialization.safe_globals(classes or []):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path} holds objects other than tensors and plain containers; refusing to "
                              f"unpickle it (only trainer state written by scalinginter loads): {err}") from err

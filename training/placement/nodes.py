"""A phase across nodes inside a pipeline run: the head announces each launch, followers join it.

On the head node (the one whose flow or ``dvc repro`` runs the stages), ``scalinginter train-phase`` with
``SCALINGINTER_NNODES`` > 1 writes ``rendezvous.json`` into the phase folder before it starts torchrun: the
command's arguments, the rendezvous endpoint and a rendezvous id of its own (so two launches never meet in one
rendezvous), and the number of nodes; it removes the file when the launch ends, however it ends. On every other
node, ``scalinginter follow ENV`` (or the Prefect flow ``follow``, a deployment on that node's work pool) watches the
run's folder (shared storage, which a multi-node phase needs anyway) and starts the same command for each launch
announced, with the announced rendezvous: c10d's rendezvous then meets, and the phase trains across the nodes
exactly as two hand-started launches do. Nothing here imports Prefect or DVC.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from envs.files import atomic_write
from training.placement.devices import NNODES_VAR, RDZV_VAR, training_nodes

#: the head's announcement of a launch, in the phase folder, present while the launch runs
ANNOUNCEMENT = "rendezvous.json"
#: set on a follower's launches: they join the announced rendezvous and announce nothing themselves
FOLLOWER_VAR = "SCALINGINTER_FOLLOWER"
RDZV_ID_VAR = "SCALINGINTER_RDZV_ID"


def is_head() -> bool:
    """Whether this process starts a launch others must join: several nodes, and not a follower's launch."""
    return training_nodes() > 1 and os.environ.get(FOLLOWER_VAR) != "1"


#: the settings every node's launch reads: a follower whose copies differ refuses to join (its ranks would train
#: with other settings than the head's)
SETTINGS_FILES = ("params.yaml", "phases.yaml")


def settings_digest(root: Path) -> str:
    """The sha256 of the settings files in ``root`` (a missing one counts as empty)."""
    digest = hashlib.sha256()
    for name in SETTINGS_FILES:
        digest.update(name.encode() + b"\0" + ((root / name).read_bytes() if (root / name).exists() else b"") + b"\0")
    return digest.hexdigest()


@contextlib.contextmanager
def announced(folder: Path, argv: list[str], root: Path) -> Iterator[str]:
    """Announce a launch of ``train-phase`` with ``argv`` in ``folder`` (the phase folder) for the followers;
    yield its rendezvous id (``SCALINGINTER_RDZV_ID`` when set, so nodes started by hand with the same command
    still meet; else a fresh one, set for this process's torchrun); remove the announcement when the launch
    ends. Each announcement has an id of its own (``launch``), so a follower joins each launch once even when the
    rendezvous id repeats, and the digest of ``root``'s settings files."""
    rdzv_id = os.environ.get(RDZV_ID_VAR) or f"phase-{uuid.uuid4().hex[:12]}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ANNOUNCEMENT
    record = {"argv": argv, "endpoint": os.environ.get(RDZV_VAR, ""), "rdzv_id": rdzv_id, "nnodes": training_nodes(),
              "launch": uuid.uuid4().hex, "settings": settings_digest(root)}
    atomic_write(path, json.dumps(record, indent=1))
    previous = os.environ.get(RDZV_ID_VAR)
    os.environ[RDZV_ID_VAR] = rdzv_id
    try:
        yield rdzv_id
    finally:
        path.unlink(missing_ok=True)
        if previous is None:
            os.environ.pop(RDZV_ID_VAR, None)
        else:
            os.environ[RDZV_ID_VAR] = previous


def join(record: dict[str, Any], cwd: Path) -> int:
    """Run the announced launch on this node (``train-phase`` with the announced arguments, this node's own
    ``SCALINGINTER_NPROC``, devices and environment servers, the announced rendezvous, in ``cwd``, the run's
    working copy); its exit code. A working copy whose settings differ from the head's is refused (exit 2)."""
    if record.get("settings") != settings_digest(cwd):
        print(f"refusing to join: {', '.join(SETTINGS_FILES)} in {cwd} differ from the head's (sync the working "
              "copies: every node trains with the head's settings)")
        return 2
    env = {**os.environ, FOLLOWER_VAR: "1", NNODES_VAR: str(record["nnodes"]), RDZV_VAR: record["endpoint"],
           RDZV_ID_VAR: record["rdzv_id"]}
    return subprocess.call([sys.executable, "-m", "flows.cli", *record["argv"]], cwd=cwd, env=env)


def follow(watch: Path, cwd: Path, launches: int | None = None, idle_timeout_s: float = 3600.0,
           patterns: tuple[str, ...] = (f"**/{ANNOUNCEMENT}",), poll_s: float = 1.0,
           run: Callable[[dict[str, Any], Path], int] = join, log: Callable[[str], None] = print) -> list[dict]:
    """Join every launch announced under ``watch`` (where ``patterns`` match), one after the other, each once.
    Ends after ``launches`` launches, or after ``idle_timeout_s`` seconds without a new announcement (a run's
    phases, gates and retries follow each other within the gates' and evaluations' time: set it above the longest
    pause between two launches). Returns what it joined: each launch's record and exit code. A launch that fails
    here (its head gone before the rendezvous met, say) is logged and the follower goes on watching."""
    joined: list[dict] = []
    served: set[str] = set()
    idle_since = time.monotonic()
    while launches is None or len(joined) < launches:
        pending = []
        for path in sorted({p for pattern in patterns for p in watch.glob(pattern)}):
            with contextlib.suppress(OSError, ValueError, KeyError):  # gone or replaced between listing and reading
                record = json.loads(path.read_text())
                if record["launch"] not in served:
                    pending.append((path, record))
        for path, record in pending:
            served.add(record["launch"])
            log(f"joining {path.parent} (rendezvous {record['rdzv_id']} at {record['endpoint']})")
            code = run(record, cwd)
            joined.append({**record, "folder": str(path.parent), "returncode": code})
            if code != 0:
                log(f"the launch in {path.parent} ended with exit code {code} on this node")
            idle_since = time.monotonic()
            if launches is not None and len(joined) >= launches:
                return joined
        if not pending:
            if time.monotonic() - idle_since > idle_timeout_s:
                log(f"no launch announced under {watch} for {idle_timeout_s:g} s: stopping")
                break
            time.sleep(poll_s)
    return joined

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


@contextlib.contextmanager
def announced(folder: Path, argv: list[str]) -> Iterator[str]:
    """Announce a launch of ``train-phase`` with ``argv`` in ``folder`` (the phase folder) for the followers, with a
    fresh rendezvous id (also set as ``SCALINGINTER_RDZV_ID`` for this process's torchrun); yield the id; remove the
    announcement when the launch ends."""
    rdzv_id = f"phase-{uuid.uuid4().hex[:12]}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ANNOUNCEMENT
    record = {"argv": argv, "endpoint": os.environ.get(RDZV_VAR, ""), "rdzv_id": rdzv_id, "nnodes": training_nodes()}
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
    ``SCALINGINTER_NPROC`` and devices, the announced rendezvous); its exit code."""
    env = {**os.environ, FOLLOWER_VAR: "1", NNODES_VAR: str(record["nnodes"]), RDZV_VAR: record["endpoint"],
           RDZV_ID_VAR: record["rdzv_id"]}
    return subprocess.call([sys.executable, "-m", "flows.cli", *record["argv"]], cwd=cwd, env=env)


def follow(watch: Path, cwd: Path, launches: int | None = None, idle_timeout_s: float = 3600.0,
           done: Callable[[], bool] | None = None, poll_s: float = 1.0,
           run: Callable[[dict[str, Any], Path], int] = join, log: Callable[[str], None] = print) -> list[dict]:
    """Join every launch announced under ``watch`` (the run's folder), one after the other, each once. Ends after
    ``launches`` launches, when ``done()`` says the run has nothing left to train and no launch is announced, or
    after ``idle_timeout_s`` seconds without a new announcement. Returns what it joined: each launch's record
    and exit code. A launch that fails here (its head gone before the rendezvous met, say) is logged and the
    follower goes on watching."""
    joined: list[dict] = []
    served: set[str] = set()
    idle_since = time.monotonic()
    while launches is None or len(joined) < launches:
        pending = []
        for path in sorted(watch.rglob(ANNOUNCEMENT)):
            with contextlib.suppress(OSError, ValueError):  # gone, or being replaced, between listing and reading
                record = json.loads(path.read_text())
                if record["rdzv_id"] not in served:
                    pending.append((path, record))
        for path, record in pending:
            served.add(record["rdzv_id"])
            log(f"joining {path.parent} (rendezvous {record['rdzv_id']} at {record['endpoint']})")
            code = run(record, cwd)
            joined.append({**record, "folder": str(path.parent), "returncode": code})
            if code != 0:
                log(f"the launch in {path.parent} ended with exit code {code} on this node")
            idle_since = time.monotonic()
            if launches is not None and len(joined) >= launches:
                return joined
        if not pending:
            if done is not None and done():
                break
            if time.monotonic() - idle_since > idle_timeout_s:
                log(f"no launch announced under {watch} for {idle_timeout_s:g} s: stopping")
                break
            time.sleep(poll_s)
    return joined

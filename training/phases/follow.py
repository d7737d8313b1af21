"""A follower node of a run's multi-node phases: :func:`training.placement.nodes.follow` over the run's folders
(its phases, its fixed-h baselines' and its gates' retries). What ``scalinginter follow`` and the Prefect flow
``follow`` run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from training.placement.devices import DeviceError, training_nodes
from training.placement.nodes import ANNOUNCEMENT, follow
from training.settings.layout import Run


def follow_run(env: str, root: Path, watch: Path | None = None, launches: int | None = None,
               idle_timeout_s: float = 3600.0, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Join every launch the head announces for ``env``'s run (``runs/<env>`` and its fixed-h baselines: each
    phase, each gate's retry), or anywhere under ``watch``, until ``launches`` were joined or ``idle_timeout_s``
    passed without one."""
    if training_nodes() < 2:
        raise DeviceError("follow joins a phase trained across nodes: set SCALINGINTER_NNODES (2 or more) as on "
                          "the head")
    if watch is not None:
        return follow(watch, root, launches, idle_timeout_s, log=log)
    name = Run(env, root=root).dir.name
    patterns = (f"{name}/phase-*/{ANNOUNCEMENT}", f"{name}-fixed-h*/phase-*/{ANNOUNCEMENT}",
                f"{name}*/gate-*/retries/retry-*/{ANNOUNCEMENT}")
    return follow(root / "runs", root, launches, idle_timeout_s, patterns=patterns, log=log)

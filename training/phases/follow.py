"""A follower node of a run's multi-node phases: :func:`training.placement.nodes.follow` over the run's folder,
until the curriculum's last phase is trained. What ``scalinginter follow`` and the Prefect flow ``follow`` run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from training.placement.devices import DeviceError, training_nodes
from training.placement.nodes import follow
from training.settings.config import ConfigError, curriculum_config, load_params
from training.settings.layout import Run


def follow_run(env: str, root: Path, watch: Path | None = None, launches: int | None = None,
               idle_timeout_s: float = 3600.0, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Join every launch the head announces under ``watch`` (default: ``runs/<env>``) until ``env``'s curriculum
    has its last phase trained, ``launches`` were joined, or ``idle_timeout_s`` passed without one. With
    ``watch`` and no curriculum for ``env`` (ad-hoc launches), only the last two end it."""
    if training_nodes() < 2:
        raise DeviceError("follow joins a phase trained across nodes: set SCALINGINTER_NNODES (2 or more) as on "
                          "the head")
    run, done = Run(env, root=root), None
    try:
        last = run.final(curriculum_config(env, params=load_params(root / "params.yaml")).phases()[-1].index)
        done = (last / "manifest.json").exists
    except ConfigError:
        if watch is None:
            raise
    return follow(watch or run.dir, root, launches, idle_timeout_s, done=done, log=log)

"""One curriculum phase as a typed call: what ``scalinginter train-phase``, its DVC stage and the pipeline's
Prefect task all run, with values (never a command line).

    spec = phase_spec("babyai", 1, Path("."))     # h, steps and folders from phases.yaml, settings from params.yaml
    final = run_phase(spec)                        # starts its own environment server when no URL is given
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from envs.launcher import running_server
from training.config import PhaseSpec
from training.trainer import train_phase


def run_phase(spec: PhaseSpec, url: str | None = None, progress: bool = False) -> Path:
    """Train phase ``spec`` against the server at ``url``, or against a server started here with ``spec.server``
    (and always stopped); resumes an interrupted phase; returns its final checkpoint folder."""
    with contextlib.ExitStack() as stack:
        base = url or stack.enter_context(running_server(spec.env, **spec.server.launch_kwargs()))
        return train_phase(spec.env, spec.index, spec.h, spec.steps, spec.init, spec.out, config=spec.train, url=base,
                           progress=progress, adaptive=spec.adaptive)

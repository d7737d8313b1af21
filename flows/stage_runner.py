"""Run a curriculum phase's DVC stage inside the calling (warm) process when that is equivalent.

``dvc repro <stage>`` costs two interpreter starts per phase: DVC's own, then the stage command's
(``scalinginter train-phase``: torch, transformers and dvclive imports, about 3 s on the reference
machine). When the phase is the only stale stage of its chain, this module does what ``dvc repro`` does,
in the caller's process: it removes the stage's outputs that are not ``persist`` (as DVC does before
running a stage), runs the stage's own command line through the ``scalinginter`` CLI in-process, then
records the result with DVC's commit of that stage, which writes the same dvc.lock entry (deps, params,
outs hashes) and stores the outputs in the DVC cache. In any other case (stale upstream stages, a command
that is not ``scalinginter train-phase``, several processes per phase, or SCALINGINTER_STAGE_SUBPROCESS=1)
it runs ``dvc repro <stage>`` as before.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Literal

Outcome = Literal["skipped", "in_process", "subprocess"]


def run_command(cmd: list[str], root: Path, env: dict[str, str] | None = None) -> str:
    """Run ``cmd`` in ``root``; its stdout, or a RuntimeError carrying the tail of its output."""
    # dvc and the stages' `scalinginter` live beside this interpreter, activated or not
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    done = subprocess.run(cmd, cwd=root, env={**os.environ, "PATH": path, **(env or {})},
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done.stdout


def _in_process_args(cmd: str) -> list[str] | None:
    """The CLI arguments of a ``scalinginter train-phase`` command line; None for any other command."""
    args = shlex.split(cmd)
    if args[:2] != ["scalinginter", "train-phase"] or int(os.environ.get("SCALINGINTER_NPROC", "1")) > 1:
        return None
    return args[1:]


def run_stage(root: Path, stage: str, url: str) -> Outcome:
    """Bring ``stage`` up to date like ``dvc repro <stage>``; train in this process when only it is stale."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        stale = set(repo.status(targets=[stage], with_deps=True))
        if not stale:
            return "skipped"
        (target,) = repo.stage.collect(stage)
        args = _in_process_args(target.cmd) if stale == {stage} else None
        if args is None or os.environ.get("SCALINGINTER_STAGE_SUBPROCESS") == "1":
            output = run_command(["dvc", "repro", stage], root, {"SCALINGINTER_ENV_URL": url})
            return "subprocess" if f"Running stage '{stage}'" in output else "skipped"
        with repo.lock:  # as DVC does before running a stage: persist outs stay, the others go
            target.remove_outs(ignore_remove=False, force=False)
    from flows.cli import app

    cwd = Path.cwd()
    os.chdir(root)  # the stage's paths are relative to the repository, as under dvc repro
    try:
        code = app([*args, "--url", url], standalone_mode=False)
    finally:
        os.chdir(cwd)
    if code:  # the CLI's own error (already printed); DVC records nothing, as for a failed stage
        raise RuntimeError(f"stage {stage} ({target.cmd}) failed with exit code {code}")
    with Repo(str(root)) as repo:
        repo.commit(stage, force=True)
    return "in_process"

"""Run a DVC stage inside the calling (warm) process when that is equivalent to ``dvc repro <stage>``.

``dvc repro <stage>`` costs two interpreter starts per phase: DVC's own, then the stage command's
(``scalinginter train-phase``: torch, transformers and dvclive imports, about 3 s on the reference
machine). When the stage is the only stale one of its chain, :func:`run_stage` does what ``dvc repro``
does, in the caller's process: it removes the stage's outputs that are not ``persist`` (as DVC does before
running a stage), calls ``work`` (the same typed function the stage's command calls, with the values the
stage records as params), then records the result with DVC's commit of that stage, which writes the same
dvc.lock entry (deps, params, outs hashes) and stores the outputs in the DVC cache. In any other case
(stale upstream stages, no ``work``, several processes per phase, or SCALINGINTER_STAGE_SUBPROCESS=1) it
runs ``dvc repro <stage>``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

Outcome = Literal["skipped", "in_process", "subprocess"]


def run_command(cmd: list[str], root: Path, env: dict[str, str] | None = None, secret: bool = False) -> str:
    """Run ``cmd`` in ``root``; its stdout, or a RuntimeError carrying the tail of its output. With ``secret``,
    the values of ``env`` (credentials) are blanked out of whatever is returned or raised."""
    # dvc and the stages' `scalinginter` live beside this interpreter, activated or not
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    done = subprocess.run(cmd, cwd=root, env={**os.environ, "PATH": path, **(env or {})},
                          capture_output=True, text=True)

    def clean(text: str) -> str:
        for value in (env or {}).values() if secret else ():
            text = text.replace(value, "***") if value else text
        return text

    if done.returncode != 0:
        raise RuntimeError(clean(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                                 f"{done.stderr[-4000:]}"))
    return clean(done.stdout)


def server_env(url: str | None, policy_url: str | None = None) -> dict[str, str]:
    """The environment variables that point a stage's command at already running servers."""
    return {**({"SCALINGINTER_ENV_URL": url} if url else {}),
            **({"SCALINGINTER_VLLM_URL": policy_url} if policy_url else {})}


def run_stage(root: Path, stage: str, url: str | None = None, work: Callable[[], object] | None = None,
              policy_url: str | None = None) -> Outcome:
    """Bring ``stage`` up to date like ``dvc repro <stage>``; with ``work``, in this process when only it is stale.
    ``url`` (and ``policy_url``, the vllm engine's server) are the servers it uses, however it runs (none for a
    stage that needs no server: the base model, the report)."""
    from dvc.repo import Repo

    from training.placement.devices import launcher_args

    with Repo(str(root)) as repo:
        stale = set(repo.status(targets=[stage], with_deps=True))
        if not stale:
            return "skipped"
        (target,) = repo.stage.collect(stage)
        in_process = (work is not None and stale == {stage} and not launcher_args()
                      and os.environ.get("SCALINGINTER_STAGE_SUBPROCESS") != "1")
        if not in_process:
            output = run_command(["dvc", "repro", stage], root, server_env(url, policy_url))
            return "subprocess" if f"Running stage '{stage}'" in output else "skipped"
        with repo.lock:  # as DVC does before running a stage: persist outs stay, the others go
            target.remove_outs(ignore_remove=False, force=False)
    assert work is not None
    with contextlib.chdir(root):  # the stage's paths are relative to the repository, as under dvc repro
        work()  # an exception leaves dvc.lock untouched, as a failed stage does
    with Repo(str(root)) as repo:
        repo.commit(stage, force=True)
    return "in_process"

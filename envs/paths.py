"""Where the project's files are: the working copy being run (DVC stages run in one), else the package.

A stage run by ``dvc repro`` in any working copy (a worker's clone, a test's copy) must read that copy's
params.yaml and splits, not the ones beside the installed code. Frozen data that is part of the code
(TextCraft's goal list, SciWorld's task list) stays with the package.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def project_root() -> Path:
    """The working copy being run.

    Under DVC (``DVC_STAGE`` is set for a stage's command) it is the stage's working directory, where DVC runs
    the command: the working copy itself, or the temporary copy of an experiment run with ``--temp`` or from
    the queue. (DVC's ``DVC_ROOT`` names the parent repository there, not the copy being run, so it is not
    used, and neither is ``SCALINGINTER_ROOT``, which a worker's environment may carry into the stage.)
    Otherwise ``$SCALINGINTER_ROOT``, else the current directory when it is a project (params.yaml and
    dvc.yaml), else the installed package's root."""
    cwd = Path.cwd()
    if os.environ.get("DVC_STAGE"):
        return cwd
    if os.environ.get("SCALINGINTER_ROOT"):
        return Path(os.environ["SCALINGINTER_ROOT"])
    if (cwd / "params.yaml").exists() and (cwd / "dvc.yaml").exists():
        return cwd
    return PACKAGE_ROOT


def scratch_dir(prefix: str) -> Path:
    """A new private temp dir ``<prefix><pid>-<random>``, after removing the ones that dead processes left.

    A process killed outright (SIGKILL, the OOM killer, a lost machine) cannot remove its scratch dirs; the
    next process that makes one with the same prefix removes every ``<prefix><pid>-*`` whose pid is gone, so
    such leftovers (a browser profile, a weight-sync checkpoint) do not pile up in /tmp run after run."""
    import shutil
    import tempfile

    base = Path(tempfile.gettempdir())
    for old in base.glob(f"{prefix}*"):
        pid = old.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (this one included; someone else's counts as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True

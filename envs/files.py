"""Writing a file so that readers see the old content or the new, never half of it."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write(path: Path, data: str | bytes) -> Path:
    """Write ``data`` to a temporary file beside ``path``, flush it to disk, then rename it over ``path`` (a
    rename within a folder is atomic on POSIX); the folder is created if missing. Returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path

"""Live environment instances of one server: ids, a lock per instance, a limit and an idle reaper.

Kept apart from HTTP so the rules (ids never reused, limit, reaping only idle unlocked instances,
close exactly once) are easy to read and test.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

from envs.base import Backend, EnvError, Environment

log = logging.getLogger(__name__)


class UnknownInstanceError(EnvError):
    """No live instance has this id (never created, closed, or reaped after idling)."""

    status_code = 404


class InstanceLimitError(EnvError):
    """The server already holds its maximum number of live instances."""

    status_code = 429


class NotResetError(EnvError):
    """The instance has not been reset yet, so it has no task."""

    status_code = 409


@dataclass
class Slot:
    """One live instance and its bookkeeping."""

    env: Environment
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    reset: bool = False
    done: bool = False


#: an environment server's defaults (``env_server`` in params.yaml, ``scalinginter serve``, the launcher): every
#: layer takes them from here
MAX_INSTANCES = 1024  # live instances at once (429 beyond)
IDLE_TTL_S = 600.0  # an instance idle this long is reaped


class InstanceTable:
    """Thread-safe table of live instances."""

    def __init__(self, backend: Backend, max_instances: int = MAX_INSTANCES, idle_ttl_s: float = IDLE_TTL_S
                 ) -> None:
        if max_instances < 1:
            raise ValueError(f"max_instances must be >= 1, got {max_instances}")
        self.backend = backend
        self.max_instances = max_instances
        self.idle_ttl_s = idle_ttl_s
        self._slots: dict[int, Slot] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.reaped = 0

    def __len__(self) -> int:
        return len(self._slots)

    def create(self) -> int:
        """Allocate a new id (never reused) holding a fresh instance."""
        with self._lock:
            if len(self._slots) >= self.max_instances:
                raise InstanceLimitError(
                    f"instance limit reached ({self.max_instances} live); close instances or raise --max-instances"
                )
            idx = next(self._ids)
            self._slots[idx] = Slot(self.backend.new_instance())
        return idx

    @contextmanager
    def use(self, idx: int) -> Iterator[Slot]:
        """Hold instance ``idx``'s lock while a request uses it."""
        slot = self._slots.get(idx)
        if slot is None:
            raise UnknownInstanceError(f"no live instance with id {idx}: create one with POST /create")
        with slot.lock:
            if self._slots.get(idx) is not slot:  # closed or reaped while we waited for the lock
                raise UnknownInstanceError(f"instance {idx} was closed")
            slot.last_used = time.monotonic()
            yield slot
            slot.last_used = time.monotonic()

    def close(self, idx: int) -> None:
        """Close instance ``idx`` (waits for a request in flight on it to finish)."""
        with self.use(idx) as slot:
            with self._lock:
                del self._slots[idx]
            slot.env.close()

    def reap(self, now: float | None = None) -> list[int]:
        """Close instances idle for longer than the TTL; instances busy in a request are skipped."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [i for i, s in self._slots.items() if now - s.last_used > self.idle_ttl_s]
        reaped = []
        for idx in idle:
            slot = self._slots.get(idx)
            if slot is None or not slot.lock.acquire(blocking=False):
                continue
            try:
                if now - slot.last_used > self.idle_ttl_s and self._slots.get(idx) is slot:
                    with self._lock:
                        del self._slots[idx]
                    slot.env.close()
                    reaped.append(idx)
            finally:
                slot.lock.release()
        if reaped:
            self.reaped += len(reaped)
            log.info("reaped %d idle instance(s): %s", len(reaped), reaped)
        return reaped

    def close_all(self) -> None:
        """Close every instance (server shutdown)."""
        for idx in list(self._slots):
            with suppress(UnknownInstanceError):
                self.close(idx)

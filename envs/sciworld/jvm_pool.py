"""ScienceWorld simulator JVMs and a thread-safe pool that reuses them.

ScienceWorld's simulator is a Scala jar driven over py4j. Starting a JVM costs ~1 s and 250-450 MiB, so
the server keeps a bounded pool: an environment instance takes a JVM at its first reset, keeps it (the
JVM holds the episode state) until close, and gives it back for the next instance. Loading a task
replaces the whole simulated world, so a reused JVM gives exactly the first observation a fresh one gives.

The JVM is launched with py4j's ``launch_gateway(javaopts=...)``, so heap and GC flags go on the java
command line of that process only: nothing is written to ``JAVA_TOOL_OPTIONS`` or any other variable
that unrelated child processes would inherit. ``die_on_exit`` ties each JVM to this Python process.

We talk to the jar's ``PythonInterface`` directly instead of through ``scienceworld.ScienceWorldEnv``:
that wrapper cannot take JVM options and, on every step, also fetches the look/inventory text and the
full valid-action list (~0.1 s), which the server never needs.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
from collections.abc import Callable
from typing import Any

from py4j.java_gateway import GatewayParameters, JavaGateway, launch_gateway
from py4j.protocol import Py4JError, Py4JJavaError
from scienceworld.constants import BASEPATH, JAR_PATH

from envs.base import CapacityError, EnvError

DEFAULT_HEAP = "-Xmx384m"
# The heap committed and touched at start (-Xms = -Xmx, AlwaysPreTouch) and the JIT code cache and metaspace
# capped: a JVM's memory is what it holds from its first episode on, not a slope (measured: with the heap growing
# lazily a 30-minute soak grew 24.9 MB over its last 15 minutes; with these, +4.6 MB over the last 15 of 45)
DEFAULT_JAVA_OPTS = "-XX:+UseSerialGC -XX:+AlwaysPreTouch -XX:ReservedCodeCacheSize=64m -XX:MaxMetaspaceSize=128m"


class SimulatorCrashedError(EnvError):
    """The JVM behind an instance died; its episode is lost and the instance must be reset again."""

    status_code = 500


class SimulatorActionError(Exception):
    """The simulator raised a Java exception for one call; the JVM itself is still usable."""


def java_options(heap: str | int = DEFAULT_HEAP, extra: str = DEFAULT_JAVA_OPTS) -> list[str]:
    """The java command-line options for a heap setting ("-Xmx384m", "384m" or 384 = MiB) plus extra flags; the
    initial heap is the maximum (``-Xms``) unless the extra flags set one."""
    heap = str(heap).strip()
    if heap.isdigit():  # a bare number from --option heap=512 means MiB, not bytes
        heap = f"{heap}m"
    if heap and not heap.startswith("-"):
        heap = f"-Xmx{heap}"
    extras = str(extra).split()
    initial = f"-Xms{heap[4:]}" if heap.startswith("-Xmx") and not any(o.startswith("-Xms") for o in extras) else ""
    return [opt for opt in [heap, initial, *extras] if opt]


class SimulatorJVM:
    """One ScienceWorld JVM and its py4j connection. Used by one episode at a time."""

    def __init__(self, javaopts: list[str]) -> None:
        port, proc = launch_gateway(
            classpath=JAR_PATH, javaopts=list(javaopts), die_on_exit=True, cwd=BASEPATH, return_proc=True
        )
        self.proc: subprocess.Popen = proc
        self._gateway = JavaGateway(gateway_parameters=GatewayParameters(auto_field=True, port=port), java_process=proc)
        self._api = self._gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()
        self.loads = 0  # tasks loaded so far: shows reuse in stats and tests

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def alive(self) -> bool:
        """False once the java process has exited (crashed, killed or closed)."""
        return self.proc.poll() is None

    def call(self, method: str, *args: Any) -> Any:
        """Call a ``PythonInterface`` method; a dead JVM raises SimulatorCrashedError."""
        try:
            return getattr(self._api, method)(*args)
        except Py4JJavaError as err:
            raise SimulatorActionError(f"{method}: {err.java_exception}") from err
        except Py4JError as err:
            self._disconnect()
            raise SimulatorCrashedError(
                f"the ScienceWorld JVM (pid {self.pid}) died or stopped answering during {method}: {err}; "
                "reset the instance to start a new episode on a fresh JVM"
            ) from err

    def load(self, task_name: str, variation: int, simplifications: str = "", gold_path: bool = False) -> None:
        """Load (task, variation): the whole world is rebuilt, so earlier episodes leave no trace."""
        self.call("load", task_name, int(variation), simplifications, bool(gold_path))
        self.loads += 1

    def step(self, action: str) -> str:
        return str(self.call("step", action))

    def score(self) -> int:
        """The simulator's task score on AgentGym's scale: 0..100, -100 once the task failed."""
        return round(100 * float(self.call("getScore")))

    def completed(self) -> bool:
        return bool(self.call("getCompleted"))

    def num_moves(self) -> int:
        return int(self.call("getNumMoves"))

    def task_description(self) -> str:
        return str(self.call("getTaskDescription"))

    def max_variations(self, task_name: str) -> int:
        return int(self.call("getTaskMaxVariations", task_name))

    def gold_actions(self) -> list[str]:
        """The gold action sequence; only valid after ``load(..., gold_path=True)``."""
        return [str(a) for a in self.call("getGoldActionSequence")]

    def action_templates(self) -> list[str]:
        return [str(a) for a in self.call("getPossibleActions")]

    def objects(self) -> list[str]:
        return [str(o) for o in self.call("getPossibleObjects")]

    def _disconnect(self) -> None:
        # py4j frees each Java object from a finalizer that reconnects to the JVM; once the JVM is gone
        # that reconnect fails and logs a traceback at GC time (which on CPython 3.11.7 can even corrupt
        # a concurrent ast.parse). Marking the client disconnected makes those finalizers no-ops.
        self._gateway._gateway_client.is_connected = False

    def rss_bytes(self) -> int:
        """Resident memory of the java process (0 once it has exited)."""
        import psutil

        try:
            return int(psutil.Process(self.pid).memory_info().rss)
        except psutil.Error:
            return 0

    def close(self) -> None:
        """Stop the JVM. Closing stdin ends it (py4j's --die-on-broken-pipe); kill it if it lingers."""
        self._disconnect()
        with contextlib.suppress(Exception):
            self._gateway.close()
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


class JVMPool:
    """At most ``max_jvms`` simulator JVMs, started lazily and reused; thread-safe.

    ``acquire`` hands out an idle live JVM (the most recently used, so warm JVMs stay warm), or starts a
    new one while the pool is below its maximum, or raises CapacityError. ``release`` returns a JVM for
    reuse unless it died; ``discard`` drops one that must not be reused. ``shutdown`` stops them all.
    """

    def __init__(
        self, max_jvms: int, javaopts: list[str], launcher: Callable[[list[str]], SimulatorJVM] = SimulatorJVM
    ) -> None:
        if max_jvms < 1:
            raise ValueError(f"max_jvms must be >= 1, got {max_jvms}")
        self.max_jvms = max_jvms
        self.javaopts = list(javaopts)
        self._launcher = launcher
        self._lock = threading.Lock()
        self._idle: list[SimulatorJVM] = []
        self._busy: set[SimulatorJVM] = set()
        self._starting = 0  # slots reserved by JVMs being launched outside the lock
        self._closed = False
        self.launched = 0
        self.discarded = 0

    def acquire(self) -> SimulatorJVM:
        """A JVM for the caller's exclusive use until it is released or discarded."""
        dead: list[SimulatorJVM] = []
        try:
            with self._lock:
                self._check_open()
                while self._idle:
                    jvm = self._idle.pop()
                    if jvm.alive():
                        self._busy.add(jvm)
                        return jvm
                    dead.append(jvm)
                    self.discarded += 1
                if len(self._busy) + self._starting >= self.max_jvms:
                    raise CapacityError(
                        f"all {self.max_jvms} SciWorld JVMs are held by live instances: close finished instances "
                        "or start the server with a larger max_jvms (e.g. --option max_jvms=16)"
                    )
                self._starting += 1
        finally:
            for jvm in dead:
                jvm.close()
        return self._launch()

    def _launch(self) -> SimulatorJVM:
        # Launching takes ~1 s, so it runs outside the lock with its slot reserved in _starting.
        try:
            jvm = self._launcher(self.javaopts)
        except BaseException:
            with self._lock:
                self._starting -= 1
            raise
        with self._lock:
            self._starting -= 1
            self.launched += 1
            closed = self._closed
            if not closed:
                self._busy.add(jvm)
        if closed:  # shut down while this JVM was starting: stop it rather than leak it
            jvm.close()
            self._check_open()
        return jvm

    def _check_open(self) -> None:
        if self._closed:
            raise CapacityError("the SciWorld JVM pool has been shut down (the server is stopping)")

    def release(self, jvm: SimulatorJVM) -> None:
        """Give a JVM back for reuse; a dead one is dropped (and a new one started on demand)."""
        with self._lock:
            self._busy.discard(jvm)
            if jvm.alive() and not self._closed:
                self._idle.append(jvm)
                return
            self.discarded += 1
        jvm.close()

    def discard(self, jvm: SimulatorJVM) -> None:
        """Stop a JVM that must not be reused (crashed or in an unknown state) and free its slot."""
        with self._lock:
            self._busy.discard(jvm)
            self.discarded += 1
        jvm.close()

    def shutdown(self) -> None:
        """Stop every JVM, idle or held; later acquires raise CapacityError."""
        with self._lock:
            self._closed = True
            jvms = [*self._idle, *self._busy]
            self._idle.clear()
            self._busy.clear()
        for jvm in jvms:
            jvm.close()

    def pids(self) -> list[int]:
        """Process ids of the JVMs the pool holds now (idle and busy)."""
        with self._lock:
            return sorted(j.pid for j in [*self._idle, *self._busy])

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "max_jvms": self.max_jvms,
                "idle": len(self._idle),
                "busy": len(self._busy),
                "starting": self._starting,
                "launched": self.launched,
                "discarded": self.discarded,
            }

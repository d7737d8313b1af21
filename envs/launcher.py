"""Start a real environment server in a subprocess on a free localhost port: the one launcher of env servers
(the pipeline, the CLI, the retriever and site helpers, tests, benchmarks, demos)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from envs.client import tls_context
from envs.instances import IDLE_TTL_S, MAX_INSTANCES

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (another process may take it before the server that is
    given it binds it: :func:`launch` starts a server on it and tries another port when that happened)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PortTaken(RuntimeError):
    """The port a server was started on belongs to another process (taken between :func:`free_port` and the bind)."""


def listens_on(proc: subprocess.Popen, port: int) -> bool:
    """Whether ``proc`` or one of its descendants holds the listening TCP socket on ``port``."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for member in tree:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in member.net_connections(kind="tcp")):
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


def _port_of(url: str) -> int | None:
    port = httpx.URL(url).port
    return int(port) if port is not None else None


def _someone_listens(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 60.0,
                 path: str = "/health") -> dict[str, Any]:
    """Poll ``url + path`` until it answers 200; fail early if the server process died. Returns the answer's
    JSON ({} when it is not JSON, e.g. an S3 server's XML at ``path="/"``). With ``proc``, the answer must come
    from ``proc`` (or its children): :class:`PortTaken` when another process holds the port (``proc`` cannot bind
    it), however fast either of them was."""
    deadline = time.monotonic() + timeout_s
    port = _port_of(url)
    heard_another = False  # an answer on the port came from another process (it may have closed it since)
    with httpx.Client(timeout=2.0, verify=tls_context()) as http:  # one client for every poll
        while True:
            if proc is not None and proc.poll() is not None:
                if port is not None and (heard_another or _someone_listens(port)):
                    raise PortTaken(f"port {port} of {url} was held by another process; the server started on it "
                                    f"exited with code {proc.returncode}")
                raise RuntimeError(f"server {url} exited with code {proc.returncode} before becoming healthy")
            try:
                response = http.get(f"{url}{path}")
                mine = proc is None or port is None or listens_on(proc, port)
                heard_another = heard_another or not mine
                if response.status_code == 200:
                    if not mine:
                        raise PortTaken(f"port {port} of {url} answers from another process, not the server "
                                        f"started on it (pid {proc.pid})")
                    try:
                        return response.json()
                    except ValueError:
                        return {}
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server at {url} not healthy ({path}) after {timeout_s:.0f} s")
            time.sleep(0.1)


def start_server(
    env: str,
    *,
    host: str = "127.0.0.1",
    max_instances: int = MAX_INSTANCES,
    idle_ttl_s: float = IDLE_TTL_S,
    token: str | None = None,
    max_body_bytes: int = 64 << 20,
    timeout_s: float = 60.0,
    **backend_options: Any,
) -> tuple[str, subprocess.Popen]:
    """Start ``python -m envs.server ENV`` on a free port and wait until healthy: (url, process). ``host`` is the
    interface it binds (0.0.0.0 also serves other machines); the URL returned is always this machine's."""

    def command(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "envs.server", env, "--host", host, "--port", str(port), "--max-instances",
               str(max_instances), "--idle-ttl", str(idle_ttl_s), "--max-body-bytes", str(max_body_bytes)]
        if token is not None:
            cmd += ["--token", token]
        for key, value in backend_options.items():
            cmd += ["--option", f"{key}={value}"]
        return cmd

    # tied to this process's life: a killed trainer, flow or evaluation never leaves its server (and a SciWorld
    # server's JVMs, which it stops on SIGTERM) running
    return launch(command, timeout_s=timeout_s, stop=stop_server)


def launch(command: Callable[[int], list[str]], *, timeout_s: float = 60.0, path: str = "/health",
           stop: Callable[[subprocess.Popen], None] | None = None, attempts: int = 5,
           **popen: Any) -> tuple[str, subprocess.Popen]:
    """Start ``command(port)`` on a free localhost port, tied to this process's life, and wait until ``url + path``
    answers 200 from it: (url, process). When another process took the port first (:class:`PortTaken`), stop it
    and start it again on another port, up to ``attempts`` times; any other failure stops it and is raised.
    ``stop`` stops a server (default: SIGKILL); ``popen``: more :class:`subprocess.Popen` arguments."""
    popen = {"cwd": ROOT, "env": {**os.environ, "PYTHONPATH": str(ROOT)}, "preexec_fn": _die_with_parent, **popen}
    for attempt in range(1, attempts + 1):
        port = free_port()
        proc = subprocess.Popen(command(port), **popen)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, timeout_s, path=path)
        except PortTaken:
            (stop or _kill)(proc)
            if attempt == attempts:
                raise
            continue
        except BaseException:
            (stop or _kill)(proc)
            raise
        return url, proc
    raise AssertionError("unreachable")  # pragma: no cover


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGTERM when the process that started it dies (no orphaned helpers)."""
    import ctypes

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_helper(module: str, *args: str, timeout_s: float = 120.0) -> tuple[str, subprocess.Popen]:
    """Start ``python -m module --port P *args`` (a helper server such as a retriever) on a free port,
    tied to this process's life; wait until ``/health`` answers; return (url, process)."""
    return launch(lambda port: [sys.executable, "-m", module, "--port", str(port), *args], timeout_s=timeout_s)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT (uvicorn shuts down cleanly, closing every instance), then SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def running_server(env: str, **kwargs: Any) -> Iterator[str]:
    """:func:`start_server` as a context manager: yield the base URL; always stop the server."""
    url, proc = start_server(env, **kwargs)
    try:
        yield url
    finally:
        stop_server(proc)


@contextlib.contextmanager
def running_replicas(env: str, replicas: int = 1, **kwargs: Any) -> Iterator[str]:
    """``replicas`` servers of ``env`` side by side; yields their URLs comma-separated (what a rollout, ``--url``
    and SCALINGINTER_ENV_URL take); always stops every one of them."""
    with contextlib.ExitStack() as stack:
        yield ",".join(stack.enter_context(running_server(env, **kwargs)) for _ in range(replicas))

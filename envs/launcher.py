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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from envs.client import tls_context

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 60.0,
                 path: str = "/health") -> dict[str, Any]:
    """Poll ``url + path`` until it answers 200; fail early if the server process died. Returns the answer's
    JSON ({} when it is not JSON, e.g. an S3 server's XML at ``path="/"``)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0, verify=tls_context()) as http:  # one client for every poll
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server {url} exited with code {proc.returncode} before becoming healthy")
            try:
                response = http.get(f"{url}{path}")
                if response.status_code == 200:
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
    max_instances: int = 1024,
    idle_ttl_s: float = 600.0,
    token: str | None = None,
    max_body_bytes: int = 64 << 20,
    timeout_s: float = 60.0,
    **backend_options: Any,
) -> tuple[str, subprocess.Popen]:
    """Start ``python -m envs.server ENV`` on a free port and wait until healthy: (url, process). ``host`` is the
    interface it binds (0.0.0.0 also serves other machines); the URL returned is always this machine's."""
    port = free_port()
    cmd = [sys.executable, "-m", "envs.server", env, "--host", host, "--port", str(port), "--max-instances",
           str(max_instances), "--idle-ttl", str(idle_ttl_s), "--max-body-bytes", str(max_body_bytes)]
    if token is not None:
        cmd += ["--token", token]
    for key, value in backend_options.items():
        cmd += ["--option", f"{key}={value}"]
    # tied to this process's life: a killed trainer, flow or evaluation never leaves its server (and a SciWorld
    # server's JVMs, which it stops on SIGTERM) running
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=_die_with_parent)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s)
    except BaseException:
        stop_server(proc)
        raise
    return url, proc


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGTERM when the process that started it dies (no orphaned helpers)."""
    import ctypes

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_helper(module: str, *args: str, timeout_s: float = 120.0) -> tuple[str, subprocess.Popen]:
    """Start ``python -m module --port P *args`` (a helper server such as a retriever) on a free port,
    tied to this process's life; wait until ``/health`` answers; return (url, process)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *args], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=_die_with_parent)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return url, proc


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

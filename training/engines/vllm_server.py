"""The vLLM policy server: its own process from its own environment, started, watched and stopped here.

vLLM cannot share a Python environment with Prefect (it pins an older fastapi and transformers), so it runs as
users run it, ``python -m vllm.entrypoints.openai.api_server`` from the environment ``make vllm`` builds
(``.venv-vllm``; ``SCALINGINTER_VLLM_PYTHON`` names another), one server or several replicas on their devices.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from envs.launcher import ROOT, PortTaken, free_port, wait_healthy
from training.engines.engine import EngineError
from training.placement.devices import replica_placement, resolve_device, training_ranks
from training.settings.config import PolicyServerConfig

logger = logging.getLogger(__name__)

SERVED_NAME = "policy"
WORKER_EXTENSION = "training.engines.vllm_worker.WeightLoader"
PORT_ATTEMPTS = 3  # ports tried when another process takes the free one first (envs.launcher.PortTaken)


def vllm_python(must_exist: bool = True) -> Path:
    """The Python of the vLLM environment: ``SCALINGINTER_VLLM_PYTHON`` or ``.venv-vllm`` (``make vllm``); with
    ``must_exist``, a missing one is an error saying how to build it."""
    path = Path(os.environ.get("SCALINGINTER_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
    if must_exist and not path.exists():
        raise EngineError(f"the vllm engine runs vLLM from its own environment, and {path} does not exist: run "
                          "`make vllm` (or set SCALINGINTER_VLLM_PYTHON to that environment's python)")
    return path


#: the adapter ranks a vLLM server can be sized for (``--max-lora-rank``)
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def server_command(model_dir: Path, port: int, config: PolicyServerConfig, max_model_len: int,
                   lora_rank: int | None = None) -> list[str]:
    """The command line of a vLLM server for ``model_dir`` on 127.0.0.1:``port``; with ``lora_rank``, one that
    serves a LoRA adapter of up to that rank on top (loaded and replaced at run time)."""
    cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(model_dir).resolve()),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", config.dtype, "--max-model-len", str(max_model_len), "--seed", "0",
           "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", WORKER_EXTENSION,
           "--gpu-memory-utilization", str(config.gpu_memory_utilization),
           "--enable-scale-out"]  # the token-in/token-out endpoint (/inference/v1/generate) the engine samples from
    if config.enforce_eager:
        cmd.append("--enforce-eager")
    if resolve_device("auto").type == "cpu":
        # vLLM 0.32 on CPU: a seeded request whose prompt is prefilled in chunks crashes the engine core (it rewinds
        # the request's generator, and a CPU generator has no offset: "CPU Generator does not use offset"), which
        # long prompts sent together (SciWorld, late turns) hit at once. Whole-prompt prefills never rewind.
        cmd.append("--no-enable-chunked-prefill")
    if lora_rank is not None:
        fits = [r for r in LORA_RANKS if r >= lora_rank]
        if not fits:
            raise EngineError(f"a vLLM server serves LoRA ranks up to {LORA_RANKS[-1]}, not {lora_rank}")
        cmd += ["--enable-lora", "--max-lora-rank", str(fits[0]), "--max-loras", "1"]
    return cmd + list(config.extra_args)


def server_env(config: PolicyServerConfig, lora: bool = False) -> dict[str, str]:
    """The environment of a vLLM server: this process's, with the dev-mode endpoints the weight sync calls, no
    usage reports, and the CPU settings of ``config`` (its KV cache unless the environment sets one; on a CPU, with
    ``cpu_executor: uni``, the model in the engine core's process, else the cores its worker's threads run on, as
    ``cpu_threads_bind`` says: ``all`` is every core this process may use)."""
    bind = config.cpu_threads_bind
    if bind == "all":
        bind = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1",  # the weight-reload and cache endpoints
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONPATH": str(ROOT),
           "VLLM_CPU_OMP_THREADS_BIND": bind,
           **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if lora else {})}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kv_cache_gb))
    if resolve_device("auto").type == "cpu":
        # vLLM's CPU platform starts a worker process unless V1 multiprocessing is off, which (for the API server,
        # whose engine core is always a process of its own) only keeps the model in the engine core
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if config.cpu_executor == "uni" else "1"
    return env


def start_vllm(model_dir: Path, config: PolicyServerConfig, max_model_len: int,
               lora_rank: int | None = None, replica: int = 0) -> tuple[str, subprocess.Popen]:
    """Start a vLLM server on ``model_dir`` and wait until healthy: (url, process). Its output goes to a log file
    whose tail is in the error when it does not come up. ``lora_rank``: it serves LoRA adapters of up to that
    rank, loaded at run time (the trainer's LoRA weight sync). ``replica``: which of ``config.replicas`` it is (its
    device, or its share of the CPU cores: :func:`training.placement.devices.replica_placement`)."""
    if not (Path(model_dir) / "config.json").exists():
        raise EngineError(f"{model_dir} is not a model folder (no config.json): build it first "
                          "(`scalinginter build-model`, or `dvc repro build_model`)")
    try:
        offset = training_ranks() if config.placement == "own" else 0  # own: the devices after the ranks'
        cores, placed = replica_placement(replica, config.replicas, offset)
    except ValueError as err:
        raise EngineError(f"policy_server.replicas: {err}") from err
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        cmd = server_command(Path(model_dir), port, config, max_model_len, lora_rank)
        env = {**server_env(config, lora=lora_rank is not None), **placed}
        log = tempfile.NamedTemporaryFile(prefix="vllm-", suffix=".log", delete=False)  # noqa: SIM115
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        if cores is not None:  # before the interpreter has started its threads, which inherit it
            os.sched_setaffinity(proc.pid, cores)
        proc.log_path = log.name  # type: ignore[attr-defined]
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, config.startup_timeout_s)
        except PortTaken as err:  # another process bound the free port first: another port
            stop_vllm(proc)
            Path(log.name).unlink(missing_ok=True)
            if attempt < PORT_ATTEMPTS:
                continue
            raise EngineError(f"the vLLM server for {model_dir} found each port it was given taken ({err})") from err
        except BaseException as err:
            tail = Path(log.name).read_text(errors="replace")[-3000:]
            proc.log_path = None  # type: ignore[attr-defined]  # kept: the error names it
            stop_vllm(proc)
            raise EngineError(f"the vLLM server for {model_dir} did not come up ({err}); its log {log.name} "
                              f"ends:\n{tail}") from err
        return url, proc
    raise AssertionError("unreachable")  # pragma: no cover


def stop_vllm(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group (the API server and its engine core), SIGKILL after 30 s."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):  # the engine core, should it outlive the API server
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log = getattr(proc, "log_path", None)
    if log and proc.returncode in (0, -signal.SIGINT, -signal.SIGKILL):  # a server that failed keeps its log
        if _logged_errors(Path(log)):  # the API server exits cleanly even when its engine core has died
            logger.warning("the vLLM server logged errors; its log is kept: %s", log)
        else:
            Path(log).unlink(missing_ok=True)


def _logged_errors(log: Path) -> bool:
    """Whether a vLLM server's log holds an ERROR record or a traceback before its shutdown began (stopping it
    logs the engine core's forced exit as an error)."""
    try:
        text = log.read_text(errors="replace").split("[shutdown]", 1)[0]
    except OSError:
        return False
    return " ERROR " in text or "Traceback (most recent call last)" in text


def start_vllm_replicas(model_dir: Path, config: PolicyServerConfig, max_model_len: int,
                        lora_rank: int | None = None) -> tuple[str, list[subprocess.Popen]]:
    """``config.replicas`` servers of :func:`start_vllm`, started side by side: (their URLs joined by commas, which
    :class:`VLLMEngine` takes, and their processes). If one does not come up, the others are stopped too."""
    with ThreadPoolExecutor(max_workers=config.replicas) as pool:
        started = [pool.submit(start_vllm, model_dir, config, max_model_len, lora_rank, i)
                   for i in range(config.replicas)]
        done = [f.exception() or f.result() for f in started]
    failed = [d for d in done if isinstance(d, BaseException)]
    if failed:
        stop_vllm_all([d[1] for d in done if not isinstance(d, BaseException)])
        raise failed[0]
    return ",".join(url for url, _ in done), [proc for _, proc in done]


def stop_vllm_all(procs: list[subprocess.Popen]) -> None:
    """:func:`stop_vllm` for each server, side by side."""
    with ThreadPoolExecutor(max_workers=max(1, len(procs))) as pool:
        list(pool.map(stop_vllm, procs))


@contextlib.contextmanager
def running_vllm(model_dir: Path, config: PolicyServerConfig, max_model_len: int,
                 lora_rank: int | None = None) -> Iterator[str]:
    """:func:`start_vllm_replicas` as a context manager: yield the URL(s); always stop the servers."""
    url, procs = start_vllm_replicas(model_dir, config, max_model_len, lora_rank)
    try:
        yield url
    finally:
        stop_vllm_all(procs)

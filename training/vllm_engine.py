"""The ``vllm`` engine: a vLLM server, its own process from its own environment, behind ``PolicyEngine``.

    with running_vllm(Path("models/tiny"), PolicyServerConfig(), max_model_len=4096) as url:
        engine = VLLMEngine(url, eos_token_id=tokenizer.eos_token_id)
        engine.generate([prompt_ids], SamplingParams(max_new_tokens=32, seed=0))

vLLM cannot share a Python environment with Prefect (it pins an older fastapi and transformers), so it runs as
users run it, ``python -m vllm.entrypoints.openai.api_server`` from the environment ``make vllm`` builds
(``.venv-vllm``; ``SCALINGINTER_VLLM_PYTHON`` names another). Token ids go in and token ids and log-probs come out:
through vLLM's token-in/token-out endpoint (``POST /inference/v1/generate``, which servers started here offer with
``--enable-scale-out``; nothing is detokenized on the server), else, on any other OpenAI-compatible server,
``POST /v1/completions`` with ``prompt`` as ids, ``return_token_ids`` and ``logprobs``. Nothing is decoded and
re-encoded. The server is started with ``--logprobs-mode processed_logprobs``, so log-probs are taken after
temperature, as the hf engine's and the PPO ratio's are. Each prompt is its own request with its own seed
(derived from the call's seed and the prompt's position; one batched request would give every prompt of a
GRPO group the same sample); vLLM batches the concurrent requests continuously.

Weights reach the server through :class:`WeightSync`: a checkpoint folder is loaded in place
(``POST /collective_rpc`` -> :mod:`training.vllm_worker`), the prefix cache is dropped (its KV blocks were
computed by the old weights), and the server's log-probs of a fixed probe sequence are compared with the
trainer's: a difference above the tolerance is an error, never a silent stale policy. Each sync is a
:class:`WeightVersion` (global step, content hash of the weight files, seconds, probe difference).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import torch

from envs.client import tls_context
from envs.launcher import ROOT, PortTaken, free_port, wait_healthy
from envs.paths import scratch_dir
from training.checkpoint import content_hash, sha256_file
from training.config import PolicyServerConfig
from training.devices import replica_placement, resolve_device, training_ranks
from training.engine import Generation, SamplingParams

logger = logging.getLogger(__name__)

SERVED_NAME = "policy"
WORKER_EXTENSION = "training.vllm_worker.WeightLoader"
PORT_ATTEMPTS = 3  # ports tried when another process takes the free one first (envs.launcher.PortTaken)


class EngineError(RuntimeError):
    """The policy server is unreachable, failed a request, or serves other weights than the trainer's."""


class ServerUnreachable(EngineError):
    """A policy server did not answer at all (after the engine's retries): down, not merely refusing a request."""


def vllm_python() -> Path:
    """The Python of the vLLM environment: ``SCALINGINTER_VLLM_PYTHON`` or ``.venv-vllm`` (``make vllm``)."""
    path = Path(os.environ.get("SCALINGINTER_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
    if not path.exists():
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
    device, or its share of the CPU cores: :func:`training.devices.replica_placement`)."""
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


def _seed(seed: int | None, index: int) -> int | None:
    return None if seed is None else (seed * 1_000_003 + index) % (2**31 - 1)


class VLLMEngine:
    """``PolicyEngine`` over an OpenAI-compatible server that takes token-id prompts (vLLM, or an outside one).

    ``url`` may name several servers of the same weights, joined by commas (``policy_server.replicas``): each
    request goes to the one with the fewest requests in flight, and every control call (weight loads, cache resets)
    to all of them. A replica that stops answering is dropped for good (a warning names it, :attr:`dead` lists it)
    and its requests go to the others with the same seeds, so the samples are those it would have given; weight
    syncs and their checks go to the live ones. With none left, or with one server, it is an :class:`EngineError`.
    ``api_key`` (for an outside server) is sent as a bearer token and never appears in an error or log.
    """

    concurrent = True  # the server batches concurrent requests continuously: each trajectory may call on its own

    def __init__(self, url: str, eos_token_id: int, model: str = SERVED_NAME, api_key: str | None = None,
                 concurrency: int = 64, timeout_s: float = 600.0, retries: int = 2,
                 api: Literal["auto", "generate", "completions"] = "auto") -> None:
        self.urls = [u.strip().rstrip("/") for u in url.split(",") if u.strip()]
        if not self.urls:
            raise EngineError("the vllm engine needs a policy server's URL")
        self.url, self.eos_token_id, self.model = ",".join(self.urls), int(eos_token_id), model
        self.concurrency, self.retries = concurrency, retries
        self.api = api  # auto: the token endpoint when the server's OpenAPI schema lists it (asked once)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.clients = [httpx.Client(base_url=u, headers=headers, timeout=timeout_s, verify=tls_context(),
                                     limits=httpx.Limits(max_connections=concurrency)) for u in self.urls]
        self._in_flight = [0] * len(self.urls)
        self._lock = threading.Lock()
        self.dead: set[int] = set()  # replicas that stopped answering: never asked again

    @property
    def live(self) -> list[int]:
        """The servers still answering, in order."""
        return [i for i in range(len(self.urls)) if i not in self.dead]

    def drop(self, server: int, err: ServerUnreachable) -> None:
        """Stop using ``server``; raise ``err`` if it was the last one (or the only one)."""
        with self._lock:
            self.dead.add(server)
            left = len(self.urls) - len(self.dead)
        if len(self.urls) == 1:
            raise err
        if not left:
            raise EngineError(f"every policy server is down ({', '.join(self.urls)}); the last: {err}") from err
        logger.warning("policy server %s stopped answering: its requests go to the %d other(s) from now on (%s)",
                       self.urls[server], left, err)

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def _least_busy(self) -> int:
        with self._lock:
            live = self.live
            if not live:
                raise EngineError(f"every policy server is down ({', '.join(self.urls)})")
            server = min(live, key=self._in_flight.__getitem__)
            self._in_flight[server] += 1
        return server

    def _done(self, server: int) -> None:
        with self._lock:
            self._in_flight[server] -= 1

    def each_live(self, call: Callable[[int], Any]) -> list[tuple[int, Any]]:
        """``call(server)`` for every live server (in order): (server, answer) pairs; one that no longer answers is
        dropped (:meth:`drop`) and left out."""
        answers = []
        for server in self.live:
            try:
                answers.append((server, call(server)))
            except ServerUnreachable as err:
                self.drop(server, err)
        return answers

    def _post_all(self, path: str, body: dict[str, Any]) -> list[Any]:
        """POST to every live server (in order); their answers."""
        return [answer for _, answer in self.each_live(lambda server: self._post(path, body, server))]

    def _post(self, path: str, body: dict[str, Any], server: int = 0) -> Any:
        url = self.urls[server]
        for attempt in range(self.retries + 1):
            try:
                response = self.clients[server].post(path, json=body)
            except httpx.TransportError as err:
                if attempt == self.retries:
                    raise ServerUnreachable(f"policy server {url} unreachable on POST {path} after "
                                      f"{self.retries + 1} tries: {type(err).__name__}: {err}") from err
                time.sleep(0.5 * 2**attempt)
                continue
            if response.status_code != 200:
                raise EngineError(f"policy server {url}: POST {path} answered {response.status_code}: "
                                  f"{response.text[:500]}")
            if not response.content:
                return None
            try:
                return response.json()
            except ValueError:  # some endpoints answer plain text ("Success: LoRA adapter ... added")
                return response.text
        raise AssertionError("unreachable")

    def _one(self, prompt: list[int], params: SamplingParams, seed: int | None) -> Generation:
        """One prompt's turn from the least busy live server; from another when that one is down."""
        while True:
            server = self._least_busy()
            try:
                return self._ask(server, prompt, params, seed)
            except ServerUnreachable as err:
                self.drop(server, err)
            finally:
                self._done(server)

    def _ask(self, server: int, prompt: list[int], params: SamplingParams, seed: int | None) -> Generation:
        sampling: dict[str, Any] = {"max_tokens": params.max_new_tokens, "temperature": params.temperature,
                                    "top_p": params.top_p, "logprobs": 0, "skip_special_tokens": False,
                                    # the end-of-turn id ends a turn (kept, with its log-prob), as in the hf engine;
                                    # the model's own eos (another id in some configs) does not
                                    "stop_token_ids": [self.eos_token_id], "ignore_eos": True}
        if params.top_k:
            sampling["top_k"] = params.top_k
        if seed is not None:
            sampling["seed"] = seed
        try:
            if self.api == "generate":
                answer = self._post("/inference/v1/generate", {
                    "model": self.model, "token_ids": prompt, "sampling_params": {**sampling, "detokenize": False}},
                    server)
                choice = answer["choices"][0]
                logprobs = [float(x["logprob"]) for x in choice["logprobs"]["content"]]
            else:
                answer = self._post("/v1/completions", {"model": self.model, "prompt": prompt, **sampling,
                                                        "return_token_ids": True}, server)
                choice = answer["choices"][0]
                logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            ids = [int(t) for t in choice["token_ids"]]
        except (KeyError, IndexError, TypeError) as err:
            raise EngineError(f"policy server {self.urls[server]} answered without token ids and log-probs "
                              f"({err!r}); it must accept `return_token_ids` (vLLM >= 0.10)") from err
        if not ids or len(ids) != len(logprobs):
            raise EngineError(f"policy server {self.urls[server]} returned {len(ids)} tokens and {len(logprobs)} "
                              "log-probs for one turn: refusing an empty or misaligned generation")
        return Generation(ids, logprobs, ids[-1] == self.eos_token_id)

    def _choose_api(self) -> None:
        """``auto``: the token endpoint if the server's OpenAPI schema lists it, else the completions endpoint."""
        if self.api != "auto":
            return
        try:
            paths = self.clients[(self.live or [0])[0]].get("/openapi.json").json().get("paths", {})
        except (httpx.HTTPError, ValueError, AttributeError):
            paths = {}
        self.api = "generate" if "/inference/v1/generate" in paths else "completions"

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        self._choose_api()
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(prompts))) as pool:
            futures = [pool.submit(self._one, prompt, params, _seed(params.seed, i))
                       for i, prompt in enumerate(prompts)]
            return [f.result() for f in futures]

    def prompt_logprobs(self, ids: list[int], server: int = 0) -> list[float]:
        """The log-probs (temperature 1) of ``ids[1:]``, each given the ids before it, from the ``server``-th server."""
        answer = self._post("/v1/completions", {"model": self.model, "prompt": ids, "max_tokens": 1,
                                                "temperature": 1.0, "prompt_logprobs": 0}, server)
        rows = answer["choices"][0]["prompt_logprobs"]
        return [float(rows[i][str(ids[i])]["logprob"]) for i in range(1, len(ids))]

    def reset_cache(self) -> None:
        """Drop the prefix cache: its KV blocks were computed by the weights served before."""
        self._post_all("/reset_prefix_cache", {})

    def rpc(self, method: str, **kwargs: Any) -> list[Any]:
        """Call ``method`` of :mod:`training.vllm_worker` on every worker of every server; their answers."""
        answers = self._post_all("/collective_rpc", {"method": method, "kwargs": kwargs})
        return [r for answer in answers if isinstance(answer, dict) for r in answer["results"]]

    def load_weights(self, folder: Path) -> None:
        """Load the HF checkpoint ``folder`` (on the server's file system) in place; drop the prefix cache."""
        self.rpc("load_checkpoint", weights_path=str(Path(folder).resolve()))
        self.reset_cache()

    def load_adapter(self, name: str, folder: Path) -> None:
        """Serve the LoRA adapter in ``folder`` as ``name`` from now on (on top of the loaded weights); the adapter
        served before is unloaded. Needs a server started with LoRA enabled (``start_vllm(lora_rank=...)``)."""
        try:
            self._post_all("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(Path(folder).resolve())})
        except EngineError as err:
            raise EngineError(f"{err}; the policy server must serve LoRA adapters (started with --enable-lora and "
                              "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, as run_phase and the flow start it for "
                              "train.lora)") from err
        previous, self.model = self.model, name
        if previous != SERVED_NAME:
            self._post_all("/v1/unload_lora_adapter", {"lora_name": previous})
        self.reset_cache()


def weights_hash(folder: Path) -> str:
    """Content hash of a model folder's weight files (what a sync loads)."""
    files = sorted(Path(folder).glob("*.safetensors")) or sorted(Path(folder).glob("*.bin"))
    if not files:
        raise EngineError(f"{folder} holds no weight files (*.safetensors)")
    return content_hash({p.name: sha256_file(p) for p in files})


@torch.no_grad()
def probe_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """The trainer's log-probs (temperature 1, the model's own precision) of ``ids[1:]``."""
    from training.losses import token_logprobs

    tensor = torch.tensor([ids], device=next(model.parameters()).device)
    was_training = model.training
    model.eval()
    logprobs = token_logprobs(model(tensor).logits, tensor)[0, 1:]
    model.train(was_training)
    return logprobs.tolist()


def probe_sequence(tokenizer: Any) -> list[int]:
    """A fixed sequence in the policy's own chat format (special tokens included): a prompt and a reply."""
    from training.chat_format import ChatFormat

    chat = ChatFormat(tokenizer)
    return chat.prompt([{"role": "user", "content": "Probe: go to the red ball, then open the yellow door."}]) + \
        chat.reply("go forward, turn left, pick up the key")


def sendable_state(weights: torch.nn.Module | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model's (or a state dict's) tensors as a checkpoint holds them: a tensor shared by two names (tied
    embeddings and output head) once, under its first name (the embeddings)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    state = {}
    items = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
    for name, tensor in items.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            state[name] = tensor.detach()
    return state


def tensors_hash(state: dict[str, torch.Tensor], exact: bool | None = None) -> str:
    """Content hash of the tensors a collective sync sends: names, dtypes, shapes and contents, in order.

    ``exact`` (default: for tensors on the CPU) hashes every byte with SHA-256. Tensors on an accelerator are
    fingerprinted where they lie instead (two position-weighted sums of their words per tensor, brought to the host
    in one copy), so a sync never copies a 7B model to the host just to name its version; any change of a value
    or of the order of values changes the fingerprint."""
    digest = hashlib.sha256()
    sums = []
    for name, tensor in state.items():
        digest.update(f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}\n".encode())
        if exact if exact is not None else tensor.device.type == "cpu":
            digest.update(memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
        else:
            sums.append(_fingerprint(tensor))
    if sums:
        digest.update(str(torch.stack(sums).tolist()).encode())
    return digest.hexdigest()


@torch.no_grad()
def _fingerprint(tensor: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """Sum of a tensor's 32-bit words (bytes when its size is not a multiple of 4) and their sum weighted by
    position, in int64 on the tensor's device (wrapping on overflow), a chunk at a time to bound the memory."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    try:
        words = flat.view(torch.int32) if flat.numel() % 4 == 0 else flat
    except RuntimeError:  # a view whose offset is not 4-byte aligned: its bytes then
        words = flat
    total = torch.zeros(2, dtype=torch.int64, device=tensor.device)
    for start in range(0, words.numel(), chunk):
        values = words[start:start + chunk].to(torch.int64)
        weights = torch.arange(start, start + values.numel(), device=tensor.device, dtype=torch.int64) % 65521 + 1
        total[0] += values.sum()
        total[1] += (values * weights).sum()
    return total


class WeightChannel:
    """The trainer's end (rank 0) of a process group it shares with every worker of a vLLM server (the
    ``collective`` transfer): each sync broadcasts the weights tensor by tensor and the workers load them in place
    as they arrive; nothing is written to disk. gloo between CPU processes (so it runs, and is tested, here), NCCL
    between CUDA devices, HCCL between Ascend NPUs: :func:`training.devices.distributed_backend` of the trainer's
    device. ``host`` is the trainer's address as the server's workers reach it."""

    def __init__(self, engine: VLLMEngine, backend: str, host: str = "127.0.0.1", timeout_s: float = 300.0) -> None:
        import threading

        import torch.distributed as dist

        from training.vllm_worker import open_weight_group

        self.engine, self.backend, self.timeout_s, self.broken = engine, backend, timeout_s, ""
        try:
            workers = len(engine.rpc("weight_group_rank"))
        except EngineError as err:
            if "unreachable" in str(err):
                raise
            raise EngineError(f"{err}; the collective weight transfer needs the server started with "
                              f"--worker-extension-cls {WORKER_EXTENSION} (start_vllm does)") from err
        self.world_size = 1 + workers
        self.store = dist.TCPStore(host, 0, self.world_size, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        opened: dict[str, Any] = {}

        def open_group() -> None:  # blocks until every worker has joined
            try:
                opened["group"] = open_weight_group(backend, self.store, 0, self.world_size, timeout_s)
            except BaseException as err:  # reported below
                opened["error"] = err

        thread = threading.Thread(target=open_group, name="weight-group", daemon=True)
        thread.start()
        engine.rpc("weight_group_join", host=host, port=self.store.port, world_size=self.world_size,
                   backend=backend, timeout_s=timeout_s)
        thread.join(timeout_s)
        if "group" not in opened:
            raise EngineError(f"the weight group with {engine.url}'s {workers} worker(s) did not form "
                              f"({backend}, {host}:{self.store.port}): {opened.get('error', 'timed out')}")
        self.group = opened["group"]

    def send(self, state: dict[str, torch.Tensor]) -> None:
        """Broadcast ``state`` (name -> tensor, in a checkpoint's names) to the server; return once it is loaded."""
        from training.vllm_worker import broadcast

        if self.broken:
            raise EngineError(f"the weight group with {self.engine.url} broke earlier ({self.broken}); restart "
                              "the phase (it resumes from its last checkpoint)")
        gloo = self.backend == "gloo"
        tensors = [(t.cpu() if gloo else t).contiguous() for t in state.values()]
        meta = {"names": list(state), "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                "shapes": [list(t.shape) for t in tensors]}
        with ThreadPoolExecutor(max_workers=1) as pool:
            loaded = pool.submit(self.engine.rpc, "weight_group_receive", **meta)
            works = [broadcast(self.group, t) for t in tensors]  # queued in order; the workers take them in order
            try:
                loaded.result()
            except BaseException as err:
                self.broken = f"{type(err).__name__}: {err}"[:300]
                raise EngineError(f"the policy server {self.engine.url} did not load the broadcast weights: "
                                  f"{err}") from err
            for work in works:
                work.wait()

    def close(self) -> None:
        """Leave the group on the server's side too (a later channel forms a new one)."""
        with contextlib.suppress(EngineError, httpx.HTTPError):
            self.engine.rpc("weight_group_leave")
        self.group = self.store = None


@dataclass(frozen=True)
class WeightVersion:
    """What the server samples from after a sync."""

    step: int
    hash: str
    seconds: float
    probe_max_diff: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class WeightSync:
    """Keeps a vLLM server's weights equal to the trainer's model, verified by a probe after every load."""

    def __init__(self, engine: VLLMEngine, probe_ids: list[int], tolerance: float = 1e-3,
                 adapter_base: Path | None = None, channel: WeightChannel | None = None) -> None:
        if len(probe_ids) < 2:
            raise ValueError("the probe needs at least two tokens")
        self.engine, self.probe_ids, self.tolerance = engine, list(probe_ids), tolerance
        self.adapter_base = adapter_base  # LoRA training: the server keeps these weights, each sync an adapter
        self.channel = channel  # the collective transfer: weights broadcast, never written to disk
        self.workdir = scratch_dir("scalinginter-sync-")
        self.version: WeightVersion | None = None
        self.syncs = 0

    @classmethod
    def serving(cls, url: str, tokenizer: Any, model: torch.nn.Module, folder: Path, step: int = 0,
                tolerance: float = 1e-3, adapter_base: Path | None = None, transport: str = "disk",
                backend: str = "gloo", host: str = "127.0.0.1", state: dict[str, torch.Tensor] | None = None,
                ) -> WeightSync:
        """A sync with the server at ``url`` that serves ``folder`` (``model``'s checkpoint), verified. With
        ``adapter_base`` (``model`` is a peft model training LoRA adapters on those weights): the server loads the
        base once, then ``model``'s adapter in place, and every later sync replaces only the adapter.

        ``transport``: ``disk`` loads checkpoint folders the server reads from the shared file system;
        ``collective`` opens a :class:`WeightChannel` (``backend`` gloo, nccl or hccl; ``host`` the trainer's
        address as the server reaches it) and broadcasts ``model``'s weights (or ``state``, when only this rank
        holds them whole) for every sync, the first included."""
        if transport not in ("disk", "collective"):
            raise ValueError(f"weight transfer {transport!r}: disk or collective")
        engine = VLLMEngine(url, tokenizer.eos_token_id)
        channel = None
        if transport == "collective" and adapter_base is None:  # an adapter is a few MB: it goes by file
            try:
                channel = WeightChannel(engine, backend, host)
            except BaseException:
                engine.close()
                raise
        sync = cls(engine, probe_sequence(tokenizer), tolerance, adapter_base, channel)
        try:
            if adapter_base is not None:
                sync.engine.load_weights(adapter_base)
                sync.push(model, step)
            elif channel is not None:
                sync.push(model, step, state=state)
            else:
                sync.push(model, step, folder=folder)
        except BaseException:  # a first load that fails (or fails its probe) leaves no client, group or files
            sync.close()
            raise
        return sync

    def verify(self, model: torch.nn.Module) -> float:
        """Max abs difference between each live server's and ``model``'s probe log-probs; an error above
        tolerance."""
        local = torch.tensor(probe_logprobs(model, self.probe_ids))
        worst = 0.0
        # a server down since the load is dropped; the others are checked
        for server, served in self.engine.each_live(lambda server: self.engine.prompt_logprobs(self.probe_ids, server)):
            diff = float((torch.tensor(served) - local).abs().max())
            if not diff <= self.tolerance:
                raise EngineError(f"the policy server {self.engine.urls[server]} serves other weights than the "
                                  f"trainer's: probe log-probs differ by {diff:.3g} (tolerance {self.tolerance:g})")
            worst = max(worst, diff)
        return worst

    def push(self, model: torch.nn.Module, step: int, folder: Path | None = None,
             save: Any = None, state: dict[str, torch.Tensor] | None = None) -> WeightVersion:
        """Load ``folder`` (a checkpoint of ``model``'s weights) or, without it, ``model`` saved by ``save(dir)``
        (default ``model.save_pretrained``) into the server; with a :class:`WeightChannel`, broadcast ``state``
        (default: ``model``'s tensors) instead. Verify; return the new version."""
        started = time.perf_counter()
        written = None
        if self.adapter_base is not None:  # LoRA: the adapter alone (a few MB), loaded in place under a new name
            written = self.workdir / f"adapter-{step:06d}-{self.syncs}"
            model.save_pretrained(written)  # a peft model writes its adapter only
            digest = content_hash({p.name: sha256_file(p) for p in written.glob("*.safetensors")})
            self.engine.load_adapter(f"policy-{step}-{self.syncs}", written)
        elif self.channel is not None:
            tensors = sendable_state(model if state is None else state)
            digest = tensors_hash(tensors)
            self.channel.send(tensors)
            self.engine.reset_cache()
        elif folder is None:
            written = folder = self.workdir / f"step-{step:06d}"
            if folder.exists():
                shutil.rmtree(folder)
            (save or (lambda d: model.save_pretrained(d)))(folder)
        if self.adapter_base is None and self.channel is None:
            digest = weights_hash(folder)
            self.engine.load_weights(folder)
        diff = self.verify(model)
        self.version = WeightVersion(step, digest, round(time.perf_counter() - started, 4), diff)
        self.syncs += 1
        for old in self.workdir.iterdir():  # the server has loaded it; only the newest stays
            if old != written:
                shutil.rmtree(old, ignore_errors=True)
        return self.version

    def close(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.channel is not None:
            self.channel.close()
        self.engine.close()

"""The ``vllm`` engine: a vLLM server (``training.engines.vllm_server`` starts one) behind ``PolicyEngine``.

    with running_vllm(Path("models/tiny"), PolicyServerConfig(), max_model_len=4096) as url:
        engine = VLLMEngine(url, eos_token_id=tokenizer.eos_token_id)
        engine.generate([prompt_ids], SamplingParams(max_new_tokens=32, seed=0))

Token ids go in and token ids and log-probs come out: through vLLM's token-in/token-out endpoint
(``POST /inference/v1/generate``, which servers started here offer with ``--enable-scale-out``; nothing is
detokenized on the server), else, on any other OpenAI-compatible server, ``POST /v1/completions`` with ``prompt`` as
ids, ``return_token_ids`` and ``logprobs``. Nothing is decoded and re-encoded. The server is started with
``--logprobs-mode processed_logprobs``, so log-probs are taken after temperature, as the hf engine's and the PPO
ratio's are. Each prompt is its own request with its own seed (derived from the call's seed and the prompt's
position; one batched request would give every prompt of a GRPO group the same sample); vLLM batches the concurrent
requests continuously. Weights reach the server through ``training.engines.weight_sync``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx

from envs.client import tls_context
from training.engines.engine import EngineError, Generation, SamplingParams, ServerUnreachable
from training.engines.vllm_server import SERVED_NAME

logger = logging.getLogger(__name__)

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
        """Call ``method`` of :mod:`training.engines.vllm_worker` on every worker of every server; their answers."""
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

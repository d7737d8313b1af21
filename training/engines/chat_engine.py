"""Any model behind an OpenAI-compatible chat API as a rollout's policy: messages in, text out.

The rollout hands :class:`ChatEngine` each trajectory's messages exactly as the project's own policy sees them
(the environment's instruction, its acknowledgement, the observations and the ReAct replies so far) and gets the
next reply as text; the trajectory keeps that text's ids in the project's tokenizer, so the turn cap and the
context budget count as they do for our checkpoints.

What a paid API needs:

- at most ``concurrency`` requests in flight;
- retries with exponential backoff (or the server's ``Retry-After``) on 429, 5xx, timeouts and dropped
  connections, counted in :attr:`ChatEngine.usage` (``retries``); a request that still fails is an
  :class:`~training.engines.vllm_engine.EngineError` that stops the evaluation, never a failed episode;
- the tokens the server reports (``usage``) summed per run, and the cost at a price per million tokens;
- a response cache (``cache``: a JSONL file, one line per answer, flushed as each arrives) keyed by the model,
  the messages and the sampling settings; a sampled answer's key also holds its seed, derived from the
  evaluation's seed and the trajectory's item and sample index, so the k samples of an item differ and a repeated
  or interrupted evaluation asks for nothing it already has (greedy answers, temperature 0, need no seed).

The API key is sent as a bearer token and never written or logged.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from training.engines.engine import EngineError, SamplingParams

#: statuses worth asking again: rate limits and the server's own failures
RETRYABLE = {408, 409, 425, 429, 500, 502, 503, 504}


@dataclass
class ApiUsage:
    """What one evaluation asked of the API and what it cost."""

    requests: int = 0  # answered by the server in this run (paid)
    cached: int = 0  # answered from the cache (not paid again)
    retries: int = 0  # attempts that failed and were repeated (429, 5xx, timeouts)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def cost(self, price_in: float | None, price_out: float | None) -> float | None:
        """US dollars at ``price_in`` / ``price_out`` per million prompt / completion tokens (None: no price)."""
        if price_in is None and price_out is None:
            return None
        return (self.prompt_tokens * (price_in or 0.0) + self.completion_tokens * (price_out or 0.0)) / 1e6

    def as_dict(self, price_in: float | None = None, price_out: float | None = None) -> dict[str, Any]:
        return {**asdict(self), "price_per_million": {"prompt": price_in, "completion": price_out},
                "cost_usd": self.cost(price_in, price_out)}


class ResponseCache:
    """Answers by key in a JSONL file, each line written and flushed as it arrives (a torn last line, from a kill
    mid-write, is ignored)."""

    def __init__(self, path: Path | None) -> None:
        self.path, self._lock, self._answers = path, threading.Lock(), {}
        if path is not None and path.exists():
            text = path.read_text()
            if text and not text.endswith("\n"):  # a torn last line: the next answer starts a line of its own
                with path.open("a") as f:
                    f.write("\n")
            for line in text.splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self._answers[row["key"]] = row

    def __len__(self) -> int:
        return len(self._answers)

    def get(self, key: str) -> dict[str, Any] | None:
        return self._answers.get(key)

    def put(self, key: str, row: dict[str, Any]) -> None:
        with self._lock:
            self._answers[key] = {"key": key, **row}
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a") as f:
                    f.write(json.dumps(self._answers[key]) + "\n")
                    f.flush()


class ChatEngine:
    """A policy behind ``{base_url}/v1/chat/completions`` under the name ``model`` (see the module docstring)."""

    chat = True  # the rollout sends messages (generate_chat), not token ids

    def __init__(self, base_url: str, model: str, eos_token_id: int, api_key: str | None = None,
                 concurrency: int = 4, retries: int = 5, backoff_s: float = 1.0, timeout_s: float = 120.0,
                 cache: Path | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.url = base_url.rstrip("/") + ("/chat/completions" if base_url.rstrip("/").endswith("/v1")
                                           else "/v1/chat/completions")
        self.model, self.eos_token_id = model, eos_token_id
        self.concurrency, self.retries, self.backoff_s = concurrency, retries, backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=timeout_s)
        self.cache = ResponseCache(cache)
        self.usage = ApiUsage()
        self._lock = threading.Lock()
        self._failed = threading.Event()  # a request failed for good: the others ask nothing more
        self._fatal: EngineError | None = None  # ... and this is why (what generate_chat raises)

    def close(self) -> None:
        self.http.close()

    def request(self, messages: list[dict[str, str]], params: SamplingParams, sample_key: str) -> dict[str, Any]:
        """The request body for one reply: greedy at temperature 0 (no seed); sampled with a seed of its own."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": params.max_new_tokens,
                                "temperature": params.temperature, "top_p": params.top_p}
        if params.temperature > 0:
            digest = hashlib.sha256(f"{params.seed}/{sample_key}".encode()).digest()
            body["seed"] = int.from_bytes(digest[:4], "big") >> 1
        return body

    @staticmethod
    def key(body: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    def generate_chat(self, conversations: list[list[dict[str, str]]], params: SamplingParams,
                      sample_keys: list[str]) -> list[tuple[str, bool]]:
        """The next reply of each conversation, and whether the model ended it (not cut at ``max_new_tokens``);
        ``sample_keys`` tell the samples of one item apart (their seeds)."""
        bodies = [self.request(m, params, k) for m, k in zip(conversations, sample_keys, strict=True)]
        with ThreadPoolExecutor(min(self.concurrency, len(bodies)) or 1) as pool:
            try:
                rows = list(pool.map(self._answer, bodies))
            except EngineError as err:  # the request that failed for good, not one it kept from being sent
                raise (self._fatal or err) from None
        return [(row["text"], row["finished"]) for row in rows]

    def _answer(self, body: dict[str, Any]) -> dict[str, Any]:
        key = self.key(body)
        if (row := self.cache.get(key)) is not None:
            with self._lock:
                self.usage.cached += 1
            return row
        reply = self._post(body)
        choice = reply["choices"][0]
        usage = reply.get("usage") or {}
        row = {"text": choice["message"].get("content") or "", "finished": choice.get("finish_reason") == "stop",
               "prompt_tokens": int(usage.get("prompt_tokens", 0)),
               "completion_tokens": int(usage.get("completion_tokens", 0))}
        with self._lock:
            self.usage.requests += 1
            self.usage.prompt_tokens += row["prompt_tokens"]
            self.usage.completion_tokens += row["completion_tokens"]
        self.cache.put(key, row)
        return row

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._attempts(body)
        except EngineError as err:
            with self._lock:
                if self._fatal is None:
                    self._fatal = err
            self._failed.set()
            raise

    def _attempts(self, body: dict[str, Any]) -> dict[str, Any]:
        for attempt in range(self.retries + 1):
            if self._failed.is_set():
                raise EngineError(f"the chat API at {self.url}: another request failed for good, so this one was "
                                  "not sent")
            wait = self.backoff_s * 2**attempt
            try:
                response = self.http.post(self.url, json=body)
            except (httpx.TimeoutException, httpx.TransportError) as err:
                failure = f"{type(err).__name__}"
            else:
                if response.status_code == 200:
                    return response.json()
                failure = f"answered {response.status_code}: {response.text[:200]}"
                if response.status_code not in RETRYABLE:
                    raise EngineError(f"the chat API at {self.url} {failure} (model {self.model!r})")
                after = response.headers.get("retry-after", "")
                if after.replace(".", "", 1).isdigit():  # seconds (an HTTP date: the backoff instead)
                    wait = float(after)
            if attempt == self.retries:
                raise EngineError(f"the chat API at {self.url} failed {self.retries + 1} times (last: {failure}); "
                                  "answers so far are cached: run the evaluation again to go on")
            with self._lock:
                self.usage.retries += 1
            time.sleep(wait)
        raise AssertionError("unreachable")

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Any:
        raise EngineError("a chat API takes messages, not token ids: the rollout calls generate_chat")

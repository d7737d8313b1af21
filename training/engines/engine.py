"""Policy engines: one interface for generation, so the rollout does not care who samples.

A batch of token-id prompts and sampling parameters go in; the new token ids and their log-probs come
out, each stopping at the chat template's end-of-turn token or at ``max_new_tokens``. The log-prob of a
token is taken under the policy at the sampling temperature (``log_softmax(logits / T)``, before top-k/p
truncation), which is what the PPO ratio needs. ``HFEngine`` runs transformers' ``generate`` with a KV
cache, batched with left padding, on CPU or GPU, and (with a ``prefix_cache_gb``) keeps each sequence's KV after
its turn, so the next turn of a conversation prefills only what was added to it (the reply's last token and the
observation) instead of the whole context again. Another sampler would plug in behind the same interface.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one turn."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    seed: int | None = None  # seeds the sampler for this call (same seed, same tokens on CPU)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Generation:
    """One sampled turn: the new ids (ending with the end-of-turn id when ``finished``) and their log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    finished: bool


class PolicyEngine(Protocol):
    """What the rollout needs from a sampler. An engine with a true ``concurrent`` attribute takes calls from many
    threads at once and batches them itself (a vLLM server): the asynchronous rollout then gives each trajectory
    its own calls instead of batching what is ready."""

    eos_token_id: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Sample one continuation per prompt."""
        ...


def _trim(ids: list[int], logprobs: list[float], eos: int) -> Generation:
    if eos in ids:
        end = ids.index(eos) + 1
        return Generation(ids[:end], logprobs[:end], True)
    return Generation(ids, logprobs, False)


@dataclass
class _Prefix:
    """The KV of one sequence the engine ran (its prompt and its reply but the last token), per layer
    ``(kv_heads, tokens, head_dim)``."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class PrefixCache:
    """The KV of the sequences generated most recently, found again by their tokens: a prompt that starts with a
    cached sequence prefills only the rest. Valid for one version of the weights: any change to a parameter (an
    optimizer step, a load) empties it, as does a switch between train and eval mode. Holds at most ``max_bytes``,
    the least recently stored dropped first; an entry is taken out when a prompt uses it (its next turn stores the
    longer sequence)."""

    def __init__(self, model: torch.nn.Module, max_bytes: int) -> None:
        self.model = model
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, _Prefix] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.reused_tokens = 0
        self._version: tuple = ()
        self._next = 0

    def _weights_version(self) -> tuple:
        return (self.model.training, *((p.data_ptr(), p._version) for p in self.model.parameters()))

    def check_weights(self) -> None:
        """Empty the cache when the weights are not the ones its KV was computed with."""
        version = self._weights_version()
        if version != self._version:
            self.clear()
            self._version = version

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0

    def take(self, prompt: list[int]) -> _Prefix | None:
        """The longest cached sequence that ``prompt`` starts with (at least one token of the prompt left over),
        removed from the cache; None if there is none."""
        best_key, best = None, None
        for key, entry in self.entries.items():
            n = len(entry.tokens)
            if (n < len(prompt) and (best is None or n > len(best.tokens)) and prompt[n - 1] == entry.tokens[-1]
                    and tuple(prompt[:n]) == entry.tokens):
                best_key, best = key, entry
        if best is None:
            self.misses += 1
            return None
        del self.entries[best_key]
        self.nbytes -= best.nbytes
        self.hits += 1
        self.reused_tokens += len(best.tokens)
        return best

    def put(self, entry: _Prefix) -> None:
        size = entry.nbytes
        if size > self.max_bytes:
            return
        self.entries[self._next] = entry
        self._next += 1
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= old.nbytes


class HFEngine:
    """transformers ``generate`` with KV cache, batched, left padding; with ``prefix_cache_gb`` > 0, the KV of
    each sequence kept for its next turn (:class:`PrefixCache`). Only for a model whose parameters hold its
    weights (not DeepSpeed ZeRO-3, whose partitions live elsewhere)."""

    def __init__(self, model: torch.nn.Module, eos_token_id: int, pad_token_id: int, batch_size: int = 64,
                 prefix_cache_gb: float = 0.0) -> None:
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size
        self.prefix_cache = PrefixCache(model, int(prefix_cache_gb * 2**30)) if prefix_cache_gb > 0 else None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if params.seed is not None:
            torch.manual_seed(params.seed)
        prefixes: list[_Prefix | None] = [None] * len(prompts)
        if self.prefix_cache is not None:
            self.prefix_cache.check_weights()
            prefixes = [self.prefix_cache.take(p) for p in prompts]
        # one batch as without the cache (the same rows draw the same random numbers: the same samples), in which
        # a prompt without a cached prefix is prefilled whole
        out: list[Generation] = []
        for start in range(0, len(prompts), self.batch_size):
            out += self._generate_batch(prompts[start:start + self.batch_size], params,
                                        prefixes[start:start + self.batch_size])
        return out

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams,
                        prefixes: list[_Prefix | None]) -> list[Generation]:
        cached = [len(f.tokens) if f is not None else 0 for f in prefixes]
        width_c = max(cached)
        suffixes = [p[c:] for p, c in zip(prompts, cached, strict=True)]
        width_s = max(len(s) for s in suffixes)
        width = width_c + width_s
        # each row: [pad | cached prefix | pad | rest of the prompt], so that every row ends at the last column;
        # positions come from the mask (its running count), as a whole-prompt prefill's would
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, (prompt, c, rest) in enumerate(zip(prompts, cached, suffixes, strict=True)):
            ids[row, width_c - c:width_c] = torch.tensor(prompt[:c], dtype=torch.long)
            mask[row, width_c - c:width_c] = 1
            ids[row, width - len(rest):] = torch.tensor(rest, dtype=torch.long)
            mask[row, width - len(rest):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        past = self._batch_cache(prefixes, width_c) if width_c else None
        greedy = params.temperature == 0
        result = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            **({"cache": past} if past is not None else {}),  # (transformers 5: `cache`, was past_key_values)
            max_new_tokens=params.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy else params.top_k,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        new = result.sequences[:, width:]
        logits = torch.stack(result.logits, dim=1).float()
        if not greedy:
            logits = logits / params.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        out = [_trim(new[i].tolist(), logprobs[i].tolist(), self.eos_token_id) for i in range(len(prompts))]
        if self.prefix_cache is not None:
            self._keep(prompts, out, mask, width, result.cache)
        return out

    def _batch_cache(self, prefixes: list[_Prefix | None], width: int) -> DynamicCache:
        """The cached prefixes as one batch's KV, each row right-aligned in ``width`` columns (zeros before it,
        masked out)."""
        rows = [f for f in prefixes if f is not None]
        layers = []
        for layer in range(len(rows[0].keys)):
            heads, _, dim = rows[0].keys[layer].shape
            keys = rows[0].keys[layer].new_zeros((len(prefixes), heads, width, dim))
            values = torch.zeros_like(keys)
            for row, f in enumerate(prefixes):
                if f is not None:
                    n = len(f.tokens)
                    keys[row, :, width - n:] = f.keys[layer]
                    values[row, :, width - n:] = f.values[layer]
            layers.append((keys, values))
        return DynamicCache(ddp_cache_data=layers, config=self.model.config)

    def _keep(self, prompts: list[list[int]], out: list[Generation], mask: torch.Tensor, width: int,
              cache: DynamicCache) -> None:
        """Store each row's KV: its prompt's columns and its reply's but the last token (never fed forward)."""
        prompt_cols = mask.bool()
        for row, (prompt, g) in enumerate(zip(prompts, out, strict=True)):
            n_reply = len(g.token_ids) - 1
            cols = torch.cat([prompt_cols[row].nonzero().squeeze(-1),
                              torch.arange(width, width + n_reply, device=mask.device)])
            keys = [layer.keys[row][:, cols] for layer in cache.layers]
            values = [layer.values[row][:, cols] for layer in cache.layers]
            self.prefix_cache.put(_Prefix((*prompt, *g.token_ids[:n_reply]), keys, values))  # type: ignore[union-attr]


class ScriptedEngine:
    """A policy that writes given replies: for replaying expert episodes through the rollout machinery.

    ``scripts`` maps each trajectory's initial prompt (token ids) to its replies in order; the engine
    finds the script whose prompt starts the given prompt, and the turn from the number of end-of-turn
    ids after it. Replies are encoded canonically, followed by the end-of-turn id; log-probs are 0.
    """

    def __init__(self, tokenizer: object, scripts: dict[tuple[int, ...], list[str]]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = int(tokenizer.eos_token_id)  # type: ignore[attr-defined]
        self.scripts = scripts
        self._lock = threading.Lock()  # may be called from several threads (an asynchronous rollout)

    def _reply(self, prompt: list[int]) -> str:
        for start, replies in self.scripts.items():
            if tuple(prompt[: len(start)]) == start:
                turn = prompt[len(start):].count(self.eos_token_id) // 2
                if turn >= len(replies):
                    raise IndexError(f"the script has {len(replies)} replies; turn {turn + 1} was asked for")
                return replies[turn]
        raise KeyError("no script starts with this prompt")

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        out = []
        for prompt in prompts:
            with self._lock:
                ids = self.tokenizer(self._reply(prompt), add_special_tokens=False)["input_ids"]  # type: ignore[operator]
            ids = [*ids[: params.max_new_tokens - 1], self.eos_token_id]
            out.append(Generation(ids, [0.0] * len(ids), True))
        return out


class EngineError(RuntimeError):
    """The policy server is unreachable, failed a request, or serves other weights than the trainer's."""


class ServerUnreachable(EngineError):
    """A policy server did not answer at all (after the engine's retries): down, not merely refusing a request."""

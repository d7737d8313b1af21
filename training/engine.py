"""Policy engines: one interface for generation, so the rollout does not care who samples.

A batch of token-id prompts and sampling parameters go in; the new token ids and their log-probs come
out, each stopping at the chat template's end-of-turn token or at ``max_new_tokens``. The log-prob of a
token is taken under the policy at the sampling temperature (``log_softmax(logits / T)``, before top-k/p
truncation), which is what the PPO ratio needs. ``HFEngine`` runs transformers' ``generate`` with a KV
cache, batched with left padding, on CPU or GPU. Another sampler would plug in behind the same interface.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import torch


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


class HFEngine:
    """transformers ``generate`` with KV cache, batched, left padding."""

    def __init__(self, model: torch.nn.Module, eos_token_id: int, pad_token_id: int, batch_size: int = 64) -> None:
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _pad_left(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if params.seed is not None:
            torch.manual_seed(params.seed)
        out: list[Generation] = []
        for start in range(0, len(prompts), self.batch_size):
            out += self._generate_batch(prompts[start:start + self.batch_size], params)
        return out

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        ids, mask = self._pad_left(prompts)
        greedy = params.temperature == 0
        result = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
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
        new = result.sequences[:, ids.shape[1]:]
        logits = torch.stack(result.logits, dim=1).float()
        if not greedy:
            logits = logits / params.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        return [_trim(new[i].tolist(), logprobs[i].tolist(), self.eos_token_id) for i in range(len(prompts))]


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

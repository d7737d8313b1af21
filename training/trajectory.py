"""One trajectory's token bookkeeping: ids, loss mask, sampler log-probs, turns, reward, termination.

Ids are appended exactly as they arrive: the sampled ids of each assistant turn (mask 1, including the
end-of-turn id) and the template/observation ids between turns (mask 0). Nothing is decoded and
re-encoded into the trained tokens. The terminal reward sits on the last assistant token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

# what ended a trajectory: the task (done), one of its budgets (turn cap h, the context clamp, its generated
# tokens, its wall-clock time), or its environment failing
Termination = Literal["done", "turn_cap", "context_cap", "token_cap", "time_cap", "env_error"]
TERMINATIONS: tuple[Termination, ...] = ("done", "turn_cap", "context_cap", "token_cap", "time_cap", "env_error")


@dataclass
class Turn:
    """One assistant turn and what the environment answered."""

    assistant: str
    observation: str
    reward: float
    score: float
    done: bool
    malformed: bool = False  # the reply held no well-formed action: rejected before the environment saw it


@dataclass
class Trajectory:
    """A multi-turn episode as token ids plus per-turn records."""

    item_id: str
    group: int  # index of the item in the batch: the n samples of one item share it (GRPO)
    sample: int
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_length: int = 0
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    reward: float = 0.0
    score: float = 0.0
    success: bool = False
    termination: Termination | None = None
    error: str | None = None
    started: float = 0.0  # perf_counter at its reset (its wall-clock budget runs from here)
    server: int = 0  # which environment server (replica) holds its instance
    tokenizer: str = ""  # fingerprint of the tokenizer and chat template its ids are in (ChatFormat.fingerprint)

    @property
    def valid(self) -> bool:
        """Invalid trajectories (environment failures) are excluded from training and counted."""
        return self.termination != "env_error"

    @property
    def active(self) -> bool:
        return self.termination is None

    def append_prompt(self, ids: list[int]) -> None:
        """Tokens the model reads but does not write (template, instruction, observations)."""
        self.input_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def append_assistant(self, ids: list[int], logprobs: list[float]) -> None:
        """Tokens the model sampled, with the sampler's log-probs."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} sampled ids but {len(logprobs)} log-probs")
        self.input_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs

    @property
    def reward_index(self) -> int:
        """Position of the last assistant token, where the terminal reward is placed (-1 if none)."""
        for i in range(len(self.loss_mask) - 1, -1, -1):
            if self.loss_mask[i]:
                return i
        return -1

    def token_rewards(self) -> list[float]:
        """Per-token rewards: zero everywhere but the terminal reward on the last assistant token."""
        rewards = [0.0] * len(self.input_ids)
        if self.reward_index >= 0:
            rewards[self.reward_index] = self.reward
        return rewards

    def finish(self, termination: Termination, error: str | None = None) -> None:
        self.termination, self.error = termination, error

    def assistant_spans(self) -> list[list[int]]:
        """The loss mask as ``[start, end)`` runs of the agent's tokens."""
        spans: list[list[int]] = []
        for i, m in enumerate(self.loss_mask):
            if m and spans and spans[-1][1] == i:
                spans[-1][1] = i + 1
            elif m:
                spans.append([i, i + 1])
        return spans

    def log_record(self) -> dict[str, Any]:
        """What the rollout log keeps of this trajectory (JSONL, one per line): the conversation, and the token
        ids exactly as sampled with the agent's spans and the tokenizer they are in, so a method training on the
        record later (``training.store``) can use the very tokens instead of re-encoding the text."""
        return {
            "item_id": self.item_id,
            "sample": self.sample,
            "reward": self.reward,
            "score": self.score,
            "success": self.success,
            "turns": len(self.turns),
            "agent_tokens": sum(self.loss_mask),
            "termination": self.termination,
            "error": self.error,
            "server": self.server,
            "conversation": self.messages,
            "turn_records": [asdict(t) for t in self.turns],
            "tokenizer": self.tokenizer,
            "input_ids": self.input_ids,
            "assistant_spans": self.assistant_spans(),
        }

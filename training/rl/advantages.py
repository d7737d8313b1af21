"""Advantage estimators over padded token tensors, aware of the loss mask.

All take ``rewards`` and ``mask`` of shape [B, T]: ``mask`` is 1 exactly on agent (assistant) tokens and
``rewards`` holds the terminal reward on each trajectory's last agent token (see
``Trajectory.token_rewards``). They return advantages of shape [B, T], zero off the mask.

* GRPO: the trajectory score z-scored within the n samples of its item (``std + eps``), or only centred
  (``norm_std`` False, Dr. GRPO); a group whose scores are all equal carries no signal and gets zero advantage
  (counted by the caller).
* RLOO: score minus the mean score of the other samples of the same item.
* REINFORCE++: discounted return over agent tokens only, whitened over all agent tokens of the batch.
* GAE (PPO with a value head): values and rewards only on agent tokens; non-agent positions are skipped,
  so the terminal reward on the last agent token reaches every earlier agent token (the reference code
  multiplies it away).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# step(t, carry, next_value) -> (new carry, new next_value), applied only at agent tokens
Scan = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (0 when the mask is empty)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / std`` over masked positions; zero off the mask."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def _scores(rewards: torch.Tensor) -> torch.Tensor:
    return rewards.sum(dim=-1)


def flat_rows(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """A [B] bool mask of the trajectories whose group is flat: one sample, or every score equal.

    GRPO and RLOO give such a group zero advantage, so its trajectories carry no policy gradient.
    """
    scores = _scores(rewards)
    flat = torch.zeros_like(group, dtype=torch.bool)
    for g in torch.unique(group):
        members = group == g
        s = scores[members]
        flat[members] = bool(s.numel() < 2 or torch.all(s == s[0]))
    return flat


def grpo(rewards: torch.Tensor, mask: torch.Tensor, group: torch.Tensor, eps: float = 1e-6, norm_std: bool = True
         ) -> tuple[torch.Tensor, int]:
    """GRPO advantages and the number of zero-variance groups (which get zero advantage); with ``norm_std`` False
    the score minus its group's mean only (Dr. GRPO: a group of 4 with one success out of 4 is not scaled up)."""
    scores = _scores(rewards)
    adv = torch.zeros_like(scores)
    flat_groups = flat_rows(rewards, group)
    for g in torch.unique(group[~flat_groups]):
        members = group == g
        s = scores[members]
        adv[members] = (s - s.mean()) / (s.std() + eps) if norm_std else s - s.mean()
    return adv[:, None] * mask, len(torch.unique(group[flat_groups]))


def rloo(rewards: torch.Tensor, mask: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: each score minus the mean of the other samples of its item."""
    scores = _scores(rewards)
    adv = torch.zeros_like(scores)
    for g in torch.unique(group):
        members = group == g
        s = scores[members]
        n = s.numel()
        if n > 1:
            adv[members] = s - (s.sum() - s) / (n - 1)
    return adv[:, None] * mask


def _backward_over_mask(values: torch.Tensor, mask: torch.Tensor, step: Scan) -> torch.Tensor:
    """Scan right to left over agent tokens only, carrying state across non-agent positions."""
    out = torch.zeros_like(values)
    carry = torch.zeros(values.shape[0], dtype=values.dtype)
    nxt_value = torch.zeros(values.shape[0], dtype=values.dtype)
    for t in range(values.shape[1] - 1, -1, -1):
        m = mask[:, t].bool()
        new_carry, new_next = step(t, carry, nxt_value)
        carry = torch.where(m, new_carry, carry)
        nxt_value = torch.where(m, new_next, nxt_value)
        out[:, t] = torch.where(m, carry, torch.zeros_like(carry))
    return out


def reinforce_plus_plus(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted return over agent tokens, whitened over all agent tokens of the batch."""
    returns = _backward_over_mask(
        rewards, mask, lambda t, carry, nxt: (rewards[:, t] + gamma * carry, nxt)
    )
    return masked_whiten(returns, mask)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(whitened advantages, returns) of GAE over agent tokens; values after the last one are 0."""

    def step(t: int, carry: torch.Tensor, next_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        return delta + gamma * lam * carry, values[:, t]

    advantages = _backward_over_mask(rewards, mask, step)
    returns = (advantages + values) * mask
    return masked_whiten(advantages, mask), returns

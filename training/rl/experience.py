"""Stage 2 of a training step: trajectories -> padded tensors -> old/reference log-probs -> advantages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.placement.devices import autocast
from training.rl import advantages as adv
from training.rl.losses import policy_forward
from training.trajectory import Trajectory


@dataclass
class Experience:
    """One step's training batch (right-padded to the longest trajectory)."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] 1 on agent tokens
    sampler_logprobs: torch.Tensor  # [B, T]
    rewards: torch.Tensor  # [B, T] terminal reward on the last agent token
    group: torch.Tensor  # [B]
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    flat_groups: int = 0

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor) -> Experience:
        """The rows ``rows`` of every tensor (a mini-batch), trimmed to its longest sequence."""
        width = int(self.attention_mask[rows].sum(-1).max())
        picked = {}
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                value = value[rows]
                picked[name] = value[:, :width] if value.dim() == 2 else value
            else:
                picked[name] = value
        return Experience(**picked)


def collate(trajectories: list[Trajectory], pad_id: int) -> Experience:
    """Right-pad the valid trajectories into tensors, each cut after its last agent token: what follows it (the
    observation the environment answered the last reply with) is never trained on and, the attention being causal,
    changes no trained token's log-prob or value, so no forward or backward pass spends time on it (at the bandit's
    one turn, a quarter of every sequence; TRL's batches likewise end with the completion)."""
    ends = [t.reward_index + 1 if t.reward_index >= 0 else len(t.input_ids) for t in trajectories]
    width = max(ends)

    def pad(rows: list[list], value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([r[:end] + [value] * (width - min(len(r), end)) for r, end in zip(rows, ends, strict=True)],
                            dtype=dtype)

    return Experience(
        input_ids=pad([t.input_ids for t in trajectories], pad_id, torch.long),
        attention_mask=pad([[1] * len(t.input_ids) for t in trajectories], 0, torch.long),
        mask=pad([t.loss_mask for t in trajectories], 0, torch.float),
        sampler_logprobs=pad([t.logprobs for t in trajectories], 0.0, torch.float),
        rewards=pad([t.token_rewards() for t in trajectories], 0.0, torch.float),
        group=torch.tensor([t.group for t in trajectories], dtype=torch.long),
    )


@torch.no_grad()
def sequence_logprobs(model: torch.nn.Module, exp: Experience, temperature: float, micro_batch: int = 8,
                      precision: str = "fp32", chunk: int | None = None) -> torch.Tensor:
    """Per-token log-probs of ``exp.input_ids`` under ``model`` (no grad), in micro-batches (``chunk``: the
    vocabulary projection so many positions at a time, see :func:`training.rl.losses.policy_forward`)."""
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(exp), micro_batch):
        ids = exp.input_ids[start:start + micro_batch].to(device)
        attn = exp.attention_mask[start:start + micro_batch].to(device)
        mask = exp.mask[start:start + micro_batch].to(device)
        with autocast(device, precision):
            out.append(policy_forward(model, ids, attn, mask, temperature, entropy=False, chunk=chunk,
                                      head=model.get_output_embeddings() if chunk else None)[0].cpu())
    return torch.cat(out)


def experience_stats(exp: Experience, weights: torch.Tensor) -> dict[str, float]:
    """What a step's update starts from: how far the trainer's log-probs of the sampled tokens are from the
    sampler's (``actor/sampler_ratio``, the mean of exp(trainer - sampler), must be 1 within numerical noise:
    anything else is a masking, padding or template bug, or a sampler that is not the policy trained), and the
    advantage each token carries on average, by token and under the loss's aggregation ``weights`` (a negative
    one pushes down what the policy does in general: GRPO's groups sum to zero per trajectory, not per token)."""
    mask = exp.mask
    out = {"actor/advantage_token_mean": float(adv.masked_mean(exp.advantages, mask)),
           "actor/advantage_weighted": float((exp.advantages * weights).sum())}
    if exp.old_logprobs is not None and bool(exp.sampler_logprobs.ne(0).any()):  # a scripted engine gives none
        diff = (exp.old_logprobs - exp.sampler_logprobs) * mask
        out |= {"actor/sampler_ratio": float(adv.masked_mean(diff.exp(), mask)),
                "actor/sampler_logprob_absdiff": float(adv.masked_mean(diff.abs(), mask)),
                "actor/sampler_logprob_absdiff_max": float(diff.abs().max())}
    return out


def estimate_advantages(exp: Experience, algorithm: str, gamma: float = 1.0, lam: float = 1.0,
                        values: torch.Tensor | None = None, grpo_norm_std: bool = True) -> None:
    """Fill ``exp.advantages`` (and ``returns`` for GAE) with the chosen estimator."""
    if algorithm == "grpo":
        exp.advantages, exp.flat_groups = adv.grpo(exp.rewards, exp.mask, exp.group, norm_std=grpo_norm_std)
    elif algorithm == "rloo":
        exp.advantages = adv.rloo(exp.rewards, exp.mask, exp.group)
    elif algorithm == "reinforce_pp":
        exp.advantages = adv.reinforce_plus_plus(exp.rewards, exp.mask, gamma)
    elif algorithm == "ppo":
        if values is None:
            raise ValueError("ppo needs the critic's values")
        exp.old_values = values
        exp.advantages, exp.returns = adv.gae(exp.rewards, values, exp.mask, gamma, lam)
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}: choose grpo, rloo, reinforce_pp or ppo")

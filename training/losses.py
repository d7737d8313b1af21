"""Actor and critic losses: masked means over agent tokens only.

Clipped-ratio policy loss (0.2), KL to the frozen reference with the low-variance k3 estimator (clamped
to [-10, 10], as a loss term), entropy bonus, and a clipped value loss for PPO's critic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from training.advantages import masked_mean


@dataclass
class ActorLoss:
    """The actor's loss and its parts (detached parts are for metrics)."""

    loss: torch.Tensor
    pg_loss: float
    pg_clipfrac: float
    kl: float
    entropy: float
    approx_kl: float


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(token t | tokens < t) for every position, shape [B, T] (position 0 gets 0)."""
    logits = logits[:, :-1].float() / temperature
    picked = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution that produced each position, shape [B, T]."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Low-variance KL(pi || ref) estimator per token: exp(ref - logp) - (ref - logp) - 1, clamped."""
    log_ratio = ref_logprobs - logprobs
    return (log_ratio.exp() - log_ratio - 1).clamp(-10, 10)


def actor_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 1e-3,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 1e-3,
) -> ActorLoss:
    """PPO-clip loss + k3 KL to the reference + entropy bonus, each a masked mean over agent tokens."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip, 1 + clip)
    pg_loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    loss = pg_loss
    kl = torch.zeros(())
    if ref_logprobs is not None and kl_coef:
        kl = masked_mean(k3_kl(logprobs, ref_logprobs), mask)
        loss = loss + kl_coef * kl
    ent = masked_mean(entropy, mask) if entropy is not None else torch.zeros(())
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * ent
    return ActorLoss(
        loss=loss,
        pg_loss=float(pg_loss.detach()),
        pg_clipfrac=float(masked_mean((clipped > unclipped).float(), mask)),
        kl=float(kl.detach()),
        entropy=float(ent.detach()),
        approx_kl=float(masked_mean(old_logprobs - logprobs, mask).detach()),
    )


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.2) -> tuple[torch.Tensor, float]:
    """Clipped value loss (PPO) and the clip fraction, over agent tokens."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    losses = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    frac = masked_mean(((clipped - returns) ** 2 > (values - returns) ** 2).float(), mask)
    return 0.5 * masked_mean(losses, mask), float(frac)


def policy_forward(forward: Callable[..., Any], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   mask: torch.Tensor, temperature: float = 1.0, entropy: bool = True, entropy_grad: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs, entropies) of shape [B, T], computing logits only from the first agent token on.

    The prompt before the first agent token of the batch is never trained, so its vocabulary projection
    is skipped (``logits_to_keep``), as TRL does for completions; positions before it are 0. Without an
    entropy bonus (``entropy_grad`` False) the entropy is computed for the metric only, without a graph.
    """
    agent = mask.bool().any(dim=0).nonzero()
    first = int(agent[0]) if len(agent) else input_ids.shape[1] - 1
    first = max(first, 1)
    keep = input_ids.shape[1] - first + 1
    logits = forward(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep, use_cache=False).logits
    logits = logits[:, :-1].float() / temperature
    # gather - logsumexp: the backward never materialises a full log-softmax (TRL's selective_log_softmax)
    picked = logits.gather(-1, input_ids[:, first:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    logprobs = torch.nn.functional.pad(picked, (first, 0))
    if not entropy:
        return logprobs, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        logp = torch.log_softmax(logits if entropy_grad else logits.detach(), dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
    return logprobs, torch.nn.functional.pad(ent, (first, 0))

"""Actor and critic losses over agent tokens only.

Clipped-ratio policy loss (0.2), KL to the frozen reference with the low-variance k3 estimator (clamped
to [-10, 10], as a loss term), entropy bonus, and a clipped value loss for PPO's critic. The actor's terms are
weighted sums over tokens whose weights (``loss_weights``) say how a mini-batch's tokens are aggregated:

* ``token-mean``: every agent token of the mini-batch weighs the same (DAPO, verl's default). In multi-turn
  RL the failing trajectories run to the turn cap and hold most of the tokens, so the update is dominated by
  negative advantages: it lowers the likelihood of what the policy does in general.
* ``seq-mean-token-mean``: each trajectory weighs the same, its tokens averaged (the original GRPO); a group's
  advantages then sum to zero whatever the lengths.
* ``seq-mean-token-sum-norm``: each trajectory's token sum over a constant (Dr. GRPO), so a token's weight
  depends neither on its trajectory's length nor on the batch's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

import torch

from training.rl.advantages import masked_mean
from training.settings.config import LossAggregation


@dataclass
class ActorLoss:
    """The actor's loss and its parts (detached parts are for metrics)."""

    loss: torch.Tensor
    pg_loss: float
    pg_clipfrac: float
    kl: float
    entropy: float
    approx_kl: float


LOSS_AGGREGATIONS: tuple[LossAggregation, ...] = get_args(LossAggregation)


def loss_weights(mask: torch.Tensor, mode: LossAggregation = "token-mean", norm: float = 1.0) -> torch.Tensor:
    """Per-token weights [B, T] of a mini-batch's loss terms (zero off the mask), summing to 1 for the two means;
    ``norm`` is Dr. GRPO's constant (tokens per trajectory) for ``seq-mean-token-sum-norm``."""
    mask = mask.float()
    if mode == "token-mean":
        return mask / mask.sum().clamp(min=1)
    rows = max(mask.shape[0], 1)
    if mode == "seq-mean-token-mean":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1) / rows
    if mode == "seq-mean-token-sum-norm":
        return mask / (norm * rows)
    raise ValueError(f"unknown loss aggregation {mode!r}: choose one of {', '.join(LOSS_AGGREGATIONS)}")


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
    weights: torch.Tensor | None = None,
) -> ActorLoss:
    """PPO-clip loss + k3 KL to the reference + entropy bonus, each a sum over agent tokens with ``weights``
    (:func:`loss_weights`; default the token mean of this batch). The reported parts are token means."""
    weights = loss_weights(mask) if weights is None else weights
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip, 1 + clip)
    per_token = torch.maximum(unclipped, clipped)
    pg_loss = masked_mean(per_token, mask)
    loss = (per_token * weights).sum()
    kl = torch.zeros(())
    if ref_logprobs is not None and kl_coef:
        per_token_kl = k3_kl(logprobs, ref_logprobs)
        kl = masked_mean(per_token_kl, mask)
        loss = loss + kl_coef * (per_token_kl * weights).sum()
    ent = masked_mean(entropy, mask) if entropy is not None else torch.zeros(())
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * (entropy * weights).sum()
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
                   mask: torch.Tensor, temperature: float = 1.0, entropy: bool = True, entropy_grad: bool = True,
                   chunk: int | None = None, head: torch.nn.Module | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs, entropies) of shape [B, T], computing logits only from the first agent token on.

    The prompt before the first agent token of the batch is never trained, so its vocabulary projection
    is skipped (``logits_to_keep``), as TRL does for completions; positions before it are 0. Without an
    entropy bonus (``entropy_grad`` False) the entropy is computed for the metric only, without a graph.

    ``chunk``: the vocabulary projection ``head`` (the model's output embeddings), the log-probs and the entropy
    are computed ``chunk`` positions at a time from the final hidden states, each chunk recomputed in the backward
    pass instead of kept: a long context's [T, vocabulary] logits (and their float32 copies, the log-softmax and
    its exponential the entropy keeps) never exist whole, only one chunk's at a time. The same values (within
    float rounding of the chunked matmul) and gradients.
    """
    agent = mask.bool().any(dim=0).nonzero()
    first = int(agent[0]) if len(agent) else input_ids.shape[1] - 1
    first = max(first, 1)
    if chunk is not None:
        if head is None:
            raise ValueError("chunked log-probs need the model's output embeddings (head)")
        out = forward(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1, use_cache=False,
                      output_hidden_states=True)
        hidden = out.hidden_states[-1][:, first - 1:-1]  # the final (normed) states that predict tokens first..T-1
        pieces = [_head_chunk(head, hidden[:, s:s + chunk], input_ids[:, first + s:first + s + chunk], temperature,
                              entropy, entropy_grad) for s in range(0, hidden.shape[1], chunk)]
        logprobs = torch.nn.functional.pad(torch.cat([p[0] for p in pieces], dim=1), (first, 0))
        if not entropy:
            return logprobs, None
        return logprobs, torch.nn.functional.pad(torch.cat([p[1] for p in pieces], dim=1), (first, 0))
    keep = input_ids.shape[1] - first + 1
    logits = forward(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep, use_cache=False).logits
    logits = logits[:, :-1].float() / temperature
    return _picked_and_entropy(logits, input_ids[:, first:], first, entropy, entropy_grad)


def _picked_and_entropy(logits: torch.Tensor, targets: torch.Tensor, first: int, entropy: bool, entropy_grad: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` and (when asked) the entropies from float32 ``logits``, left-padded by ``first``."""
    # gather - logsumexp: the backward never materialises a full log-softmax (TRL's selective_log_softmax)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    logprobs = torch.nn.functional.pad(picked, (first, 0))
    if not entropy:
        return logprobs, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        logp = torch.log_softmax(logits if entropy_grad else logits.detach(), dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
    return logprobs, torch.nn.functional.pad(ent, (first, 0))


def _head_chunk(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of :func:`policy_forward`'s chunked path: (log-probs, entropies or zeros) of its positions; with
    a graph, checkpointed (its logits recomputed in the backward pass, not kept)."""
    def run(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head(states).float() / temperature
        picked, ent = _picked_and_entropy(logits, targets, 0, entropy, entropy_grad)
        return picked, ent if ent is not None else torch.zeros_like(picked)

    if not torch.is_grad_enabled():
        return run(hidden)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(run, hidden, use_reentrant=False)

"""Stages 2 and 3 of a training step (``training.phases.trainer``): the experience prepared for the update (old and
reference log-probs, advantages) and the actor's (and PPO's critic's) mini-batch updates. A part of
:class:`training.phases.trainer.PhaseTrainer`, which holds the model, reference, optimizer and strategy these read.
"""

from __future__ import annotations

from typing import Any

import torch

from training.placement.devices import autocast
from training.rl.advantages import masked_mean
from training.rl.critic import ValueModel, explained_variance, sequence_values
from training.rl.experience import Experience, estimate_advantages, sequence_logprobs
from training.rl.losses import actor_loss, loss_weights, policy_forward, value_loss
from training.settings.config import TrainConfig


class PolicyUpdate:
    """Prepares a step's experience and updates the actor on it (mixed into ``PhaseTrainer``)."""

    config: TrainConfig
    device: torch.device
    model: Any
    reference: Any
    critic: ValueModel | None
    critic_optimizer: torch.optim.Optimizer | None
    optimizer: Any
    strategy: Any

    def _has_signal(self, exp: Experience) -> bool:
        """Whether any trajectory of this step, on any rank, has a non-zero advantage."""
        signal = torch.tensor([float(bool((exp.advantages * exp.mask).abs().sum() > 0))], device=self.device)
        if self.strategy.world_size > 1:  # every rank must take the same decision, or the all-reduces desync
            import torch.distributed as dist

            dist.all_reduce(signal)
        return bool(signal.item() > 0)

    def prepare(self, exp: Experience) -> Experience:
        cfg = self.config
        if cfg.old_logprobs == "recompute" and self._updates_once(exp):
            # the batch's one optimizer step starts from the weights that would recompute them: the update's own
            # forward pass gives them (detached), as TRL does when one update follows each generation
            exp.old_logprobs = None
        elif cfg.old_logprobs == "recompute":
            exp.old_logprobs = sequence_logprobs(self.model, exp, cfg.temperature, cfg.micro_batch_size, cfg.precision,
                                                 cfg.logprob_chunk)
        else:
            exp.old_logprobs = exp.sampler_logprobs
        if self.reference is not None:
            exp.ref_logprobs = sequence_logprobs(self.reference, exp, cfg.temperature, cfg.micro_batch_size,
                                                  cfg.precision, cfg.logprob_chunk)
            if cfg.kl_in_reward:
                exp.rewards = exp.rewards - cfg.kl_coef * (exp.old_logprobs - exp.ref_logprobs) * exp.mask
        values = None
        if self.critic is not None:
            values = sequence_values(self.critic, exp.input_ids, exp.attention_mask, cfg.micro_batch_size)
        estimate_advantages(exp, cfg.algorithm, cfg.gamma, cfg.lam, values=values, grpo_norm_std=cfg.grpo_norm_std)
        return exp

    def _updates_once(self, exp: Experience) -> bool:
        """Whether the update takes one optimizer step on the whole batch (one epoch, one mini-batch) and nothing
        reads the old log-probs before it (a KL penalty in the reward does)."""
        cfg = self.config
        return cfg.ppo_epochs == 1 and len(exp) <= cfg.mini_batch_size and not cfg.kl_in_reward

    def update(self, exp: Experience, step: int) -> dict[str, float]:
        """ppo_epochs passes of mini-batch updates; returns averaged actor metrics."""
        cfg = self.config
        self.model.train()
        sums: dict[str, float] = {}
        updates = 0
        for epoch in range(cfg.ppo_epochs):
            shuffle = torch.Generator().manual_seed(cfg.seed * 7919 + step * 31 + epoch)
            order = torch.randperm(len(exp), generator=shuffle)
            for start in range(0, len(exp), cfg.mini_batch_size):
                parts = self._mini_batch(exp.select(order[start:start + cfg.mini_batch_size]))
                for key, value in parts.items():
                    sums[key] = sums.get(key, 0.0) + value
                updates += 1
        out = {key: value / max(updates, 1) for key, value in sums.items()}
        return out | {"actor/lr": self.optimizer.param_groups[0]["lr"]}

    def _mini_batch(self, mb: Experience) -> dict[str, float]:
        cfg = self.config
        total_tokens = mb.mask.sum().clamp(min=1)
        weights = loss_weights(mb.mask, cfg.loss_agg, cfg.max_new_tokens)  # over the whole mini-batch
        parts = {"actor/pg_loss": 0.0, "actor/pg_clipfrac": 0.0, "actor/kl": 0.0, "actor/entropy": 0.0,
                 "actor/approx_kl": 0.0}
        sampler = [0.0, 0.0, 0.0]  # old log-probs from this forward: sum exp(old - sampler), sum |old - sampler|, max
        for start in range(0, len(mb), cfg.micro_batch_size):
            rows = torch.arange(start, min(start + cfg.micro_batch_size, len(mb)))
            micro = mb.select(rows)
            ids = micro.input_ids.to(self.device)
            mask = micro.mask.to(self.device)
            with autocast(self.device, cfg.precision):
                logprobs, entropy = policy_forward(self.strategy.forward, ids, micro.attention_mask.to(self.device),
                                                   mask, cfg.temperature, entropy_grad=cfg.entropy_coef != 0,
                                                   chunk=cfg.logprob_chunk, head=self.model.get_output_embeddings())
            if micro.old_logprobs is None:  # one optimizer step on the batch: the weights it starts from give them
                old = logprobs.detach()
                diff = ((old - micro.sampler_logprobs.to(self.device)) * mask).float().cpu()
                sampler = [sampler[0] + float(diff.exp()[micro.mask.bool()].sum()),
                           sampler[1] + float(diff.abs().sum()), max(sampler[2], float(diff.abs().max()))]
            else:
                old = micro.old_logprobs.to(self.device)
            loss = actor_loss(
                logprobs, old,
                micro.advantages.to(self.device), mask, clip=cfg.clip,
                ref_logprobs=None if cfg.kl_in_reward or micro.ref_logprobs is None
                else micro.ref_logprobs.to(self.device),
                kl_coef=cfg.kl_coef, entropy=entropy, entropy_coef=cfg.entropy_coef,
                weights=weights[rows, :mask.shape[1]].to(self.device))
            share = float(mask.sum() / total_tokens)  # the reported parts are token means of the mini-batch
            self.strategy.backward(loss.loss, last_micro_batch=start + cfg.micro_batch_size >= len(mb))
            for key, value in (("actor/pg_loss", loss.pg_loss), ("actor/pg_clipfrac", loss.pg_clipfrac),
                               ("actor/kl", loss.kl), ("actor/entropy", loss.entropy),
                               ("actor/approx_kl", loss.approx_kl)):
                parts[key] += value * share
        grad_norm = self.strategy.step()
        if mb.old_logprobs is None and bool(mb.sampler_logprobs.ne(0).any()):  # a scripted engine gives none
            # what training.rl.experience.experience_stats reports when the old log-probs come before the update
            parts |= {"actor/sampler_ratio": float(sampler[0] / total_tokens),
                      "actor/sampler_logprob_absdiff": float(sampler[1] / total_tokens),
                      "actor/sampler_logprob_absdiff_max": float(sampler[2])}
        if self.critic is not None:
            parts |= self._critic_update(mb)
        return parts | {"actor/grad_norm": float(grad_norm)}

    def _critic_update(self, mb: Experience) -> dict[str, float]:
        """One clipped value-loss step of the critic on a mini-batch (GAE returns as targets)."""
        assert self.critic is not None and self.critic_optimizer is not None
        mask = mb.mask.to(self.device)
        returns = mb.returns.to(self.device)
        with autocast(self.device, self.config.precision):
            values = self.critic(mb.input_ids.to(self.device), mb.attention_mask.to(self.device)).float()
        loss, clipfrac = value_loss(values, mb.old_values.to(self.device), returns, mask, self.config.clip)
        self.critic_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.config.grad_clip)
        self.critic_optimizer.step()
        return {"critic/value_loss": float(loss.detach()), "critic/vf_clipfrac": clipfrac,
                "critic/values_mean": float(masked_mean(values.detach(), mask)),
                "critic/returns_mean": float(masked_mean(returns, mask)),
                "critic/vf_explained_var": explained_variance(values.detach(), returns, mask)}

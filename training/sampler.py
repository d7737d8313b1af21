"""The sampler, built in one place: the engine a policy's episodes are generated with (``hf`` in this process, or
a vLLM server kept in step with the policy by a :class:`~training.engines.vllm_engine.WeightSync`) and the rollout
settings of a training phase. The trainer, the evaluation and RFT's sampling all take theirs from here; and how a
training phase samples each step (:class:`PhaseSampling`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from training.engines.engine import HFEngine, PolicyEngine
from training.placement.devices import distributed_backend
from training.rollouts.rollout import RolloutConfig, RolloutResult
from training.settings.config import PolicyServerConfig, TrainConfig

log = logging.getLogger(__name__)


@dataclass
class Sampler:
    """An engine, and the weight sync that keeps a served one in step with the policy (None for ``hf`` and on the
    ranks that do not sync)."""

    engine: PolicyEngine
    sync: Any = None

    @property
    def prefix_cache(self) -> Any:
        """The hf engine's KV cache kept between turns (None for a served model)."""
        return getattr(self.engine, "prefix_cache", None)

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()


def build_sampler(model: torch.nn.Module, tokenizer: Any, source: Path, *, policy_url: str | None = None,
                  server: PolicyServerConfig | None = None, device: torch.device | str = "cpu",
                  prefix_cache_gb: float = 0.0, step: int = 0, adapter_base: Path | None = None,
                  state: dict[str, torch.Tensor] | None = None, syncs: bool = True) -> Sampler:
    """The sampler of ``model`` (whose checkpoint is ``source``). Without ``policy_url``: the hf engine on the
    model itself, with a prefix cache of ``prefix_cache_gb``. With it: the vLLM server there, loaded with the very
    weights of ``source`` (or, with ``adapter_base``, that base and the model's LoRA adapter) as ``server`` says
    (weight transfer, probe tolerance) and verified by the probe before the first rollout; ``state`` is what a
    collective transfer sends when only this rank holds the weights whole. ``syncs=False`` (a rank other than the
    one that keeps the server in step) only samples from the server."""
    if policy_url is None:
        return Sampler(HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                prefix_cache_gb=prefix_cache_gb))
    from training.engines.vllm_engine import VLLMEngine
    from training.engines.weight_sync import WeightSync

    if not syncs:
        return Sampler(VLLMEngine(policy_url, tokenizer.eos_token_id))
    server = server or PolicyServerConfig()
    sync = WeightSync.serving(policy_url, tokenizer, model, Path(source), step, server.probe_tolerance,
                              adapter_base=adapter_base, transport=server.weight_transfer,
                              backend=distributed_backend(torch.device(device)), host=server.weight_transfer_host,
                              state=state)
    return Sampler(sync.engine, sync)


def train_rollout_config(config: TrainConfig) -> RolloutConfig:
    """A training phase's rollout settings, from its train settings."""
    return RolloutConfig(
        n_samples=config.n_samples, max_new_tokens=config.max_new_tokens, context_budget=config.context_budget,
        max_trajectory_tokens=config.max_trajectory_tokens, max_trajectory_seconds=config.max_trajectory_seconds,
        mode=config.rollout_mode, async_batch=config.async_batch, temperature=config.temperature, top_p=config.top_p,
        seed=config.seed)


class EnvironmentFailure(RuntimeError):
    """Every trajectory of a step failed in the environment, also after retries."""


class PhaseSampling:
    """Stage 1 of a phase's step: its rollout (retried when every trajectory hit an environment error), the next
    step's rollout prefetched (``max_staleness: 1``) and the vLLM server's weights synced after an update (mixed
    into ``training.phases.trainer.PhaseTrainer``, which holds the rollout, the data stream and the weight sync)."""

    def _served(self) -> dict[str, Any]:
        """The weight version the vLLM server holds now, for the rollout log (nothing with the hf engine)."""
        return {"weights": self.sync.version.as_dict()} if self.sync and self.sync.version else {}

    def _prefetch(self, step: int) -> None:
        """Start ``step``'s rollout on a worker thread, sampled by the server from the weights it holds now (the
        update that follows changes only the trainer's copy; the next sync waits for this rollout)."""
        from concurrent.futures import ThreadPoolExecutor

        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="rollout-prefetch")
        items = self.data.take(self.config.batch_items)[self.strategy.rank::self.strategy.world_size]
        served = self._served()
        self.prefetched = (step, self._prefetcher.submit(self._rollout, items, step), served)

    def _drop_prefetched(self) -> None:
        """Wait for and forget a prefetched rollout (the phase ends or rolls back); its items are given back."""
        if self.prefetched is not None:
            _, future, _ = self.prefetched
            self.prefetched = None
            future.exception()  # wait: its environment instances are closed by the rollout itself
            self.data.position -= self.config.batch_items
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
            self._prefetcher = None

    def _rollout(self, items: list[str], step: int) -> RolloutResult:
        """The step's rollout; one whose every trajectory hit an environment error is retried with backoff, then
        stops the phase (its last checkpoint resumes it): a dead server never yields a step of zeros."""
        result = self.rollout.run(items, self.h, step=step)
        for attempt in range(self.config.failed_rollout_retries):
            if result.valid and not result.failed_envs:
                break
            log.warning("step %d: every trajectory hit an environment error; rolling out again in %d s", step,
                        2**attempt)
            time.sleep(2**attempt)
            result = self.rollout.run(items, self.h, step=step)
        first = next((t.error for t in result.trajectories if t.error), "no trajectories")
        if result.failed_envs:  # a mixed run never trains on the other environments alone
            raise EnvironmentFailure(
                f"step {step}: every trajectory of {', '.join(result.failed_envs)} hit environment errors in "
                f"{self.config.failed_rollout_retries + 1} tries (first: {first}); servers: {self.rollout.url}. "
                "The phase stops (it does not train on the other environments alone); rerun it to resume")
        if not result.valid:
            raise EnvironmentFailure(
                f"step {step}: all {len(result.trajectories)} trajectories hit environment errors in "
                f"{self.config.failed_rollout_retries + 1} tries (first: {first}); the environment server at "
                f"{self.rollout.url} is failing. The phase stops; rerun it to resume from its last checkpoint")
        return result

    def _sync_policy(self) -> dict[str, float]:
        """vllm engine: push the actor's weights to the server if an update changed them (rank 0; the other ranks
        wait for it); the served version."""
        if self.config.engine != "vllm":
            return {}
        if self.prefetched is not None:  # never change the server's weights under a rollout in flight
            self.prefetched[1].exception()
        if self.stale:
            weights = self.strategy.gather_weights()  # every rank takes part (ZeRO-3); None: the model holds them
            if self.sync is not None:
                self.sync.push(self.model, self.global_step, save=lambda folder: self._save_weights(folder, weights),
                               state=weights)
            self.strategy.barrier()  # no rank samples before the server has the new weights
            self.stale = False
        if self.sync is None:
            return {}
        version = self.sync.version
        assert version is not None
        return {"engine/sync_s": version.seconds, "engine/probe_max_diff": version.probe_max_diff,
                "engine/weights_step": float(version.step), "engine/syncs": float(self.sync.syncs)}

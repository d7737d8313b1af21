"""The sampler, built in one place: the engine a policy's episodes are generated with (``hf`` in this process, or
a vLLM server kept in step with the policy by a :class:`~training.vllm_engine.WeightSync`) and the rollout
settings of a training phase. The trainer, the evaluation and RFT's sampling all take theirs from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from training.config import PolicyServerConfig, TrainConfig
from training.devices import distributed_backend
from training.engine import HFEngine, PolicyEngine
from training.rollout import RolloutConfig


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
    from training.vllm_engine import VLLMEngine
    from training.weight_sync import WeightSync

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

"""The trainer's configuration: one frozen pydantic model, validated up front."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrainConfig(BaseModel):
    """Everything one curriculum phase needs besides its h and step count."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    algorithm: Literal["grpo", "rloo", "reinforce_pp", "ppo"] = "grpo"
    strategy: Literal["torch", "deepspeed"] = Field("torch", description="who applies the loss to the weights: "
                                                    "plain torch, or DeepSpeed ZeRO over SCALINGINTER_NPROC ranks")
    zero_stage: int = Field(2, ge=1, le=3, description="DeepSpeed ZeRO stage (deepspeed strategy)")
    device: str = Field("cpu", description="auto, cpu, cuda[:N] or npu[:N]")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16 autocasts the forward passes (weights and optimizer stay float32)")
    seed: int = 0
    # data
    split: str = "train"
    sub_tasks: list[str] | None = Field(None, description="train only on these sub-tasks (e.g. ['GoTo'])")
    items: list[str] | None = Field(None, description="train on exactly these item ids instead of the split "
                                    "(e.g. a curriculum's easy items); recorded with the checkpoint's config")
    batch_items: int = Field(4, ge=1, description="items per training step")
    n_samples: int = Field(4, ge=1, description="trajectories per item (the GRPO group)")
    # rollout
    max_new_tokens: int = Field(48, ge=1)
    context_budget: int = Field(2048, ge=16)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of the rollouts (1.0: the full distribution)")
    # update
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = 0.01
    mini_batch_size: int = Field(8, ge=1, description="trajectories per optimizer step")
    micro_batch_size: int = Field(8, ge=1, description="trajectories per forward/backward")
    ppo_epochs: int = Field(1, ge=1, description="passes over the step's mini-batches")
    clip: float = 0.2
    kl_coef: float = 1e-3
    kl_in_reward: bool = Field(False, description="subtract kl_coef * KL from rewards instead of a loss term")
    entropy_coef: float = 1e-3
    grad_clip: float = 1.0
    skip_flat_steps: bool = Field(False, description="a step whose advantages are all zero (every group flat) "
                                  "makes no update; otherwise (verl's behaviour) Adam steps full-size along the "
                                  "KL and entropy terms alone, which can wreck a small SFT'd policy")
    drop_flat_groups: bool = Field(False, description="GRPO/RLOO: leave the flat groups (every sample of the "
                                   "item scored the same, so zero advantage) out of stage 2 and the update, as "
                                   "DAPO's dynamic sampling does: the step's compute and its token-mean loss go to "
                                   "the groups that carry a signal; a step with none makes no update")
    old_logprobs: Literal["sampler", "recompute"] = "recompute"
    gamma: float = 1.0
    lam: float = 1.0
    critic_lr: float = 1e-5
    # checkpoints
    save_every: int = Field(1, ge=1, description="write an intra-phase checkpoint every N steps")
    keep_checkpoints: int = Field(2, ge=1)
    log_rollouts: bool = True

    @model_validator(mode="after")
    def _batches(self) -> TrainConfig:
        if self.items is not None and (not self.items or self.sub_tasks):
            raise ValueError("items lists the item ids to train on: give a non-empty list, and no sub_tasks with "
                             "it (filter the list itself)")
        if self.drop_flat_groups and self.algorithm not in ("grpo", "rloo"):
            raise ValueError(f"drop_flat_groups applies to grpo and rloo, whose flat groups have zero advantage; "
                             f"{self.algorithm} gives them a signal: set drop_flat_groups false")
        if self.drop_flat_groups and self.kl_in_reward:
            raise ValueError("drop_flat_groups decides on the outcome rewards, which kl_in_reward changes per "
                             "token: use the KL loss (kl_in_reward false) with drop_flat_groups")
        if self.drop_flat_groups and self.strategy == "deepspeed":
            raise ValueError("drop_flat_groups leaves each rank a different number of trajectories, so the "
                             "ranks' gradient all-reduces would not line up: use it with the torch strategy")
        if self.strategy == "deepspeed" and self.zero_stage == 3:
            raise ValueError("train_phase samples with the HF engine from full weights, which ZeRO-3 partitions: "
                             "use zero_stage 1 or 2 (ZeRO-3 is checked by training.strategy_check)")
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError(f"mini_batch_size {self.mini_batch_size} must be a multiple of micro_batch_size "
                             f"{self.micro_batch_size}")
        return self

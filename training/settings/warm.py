"""Phase types besides RL: the methods a curriculum may run before its first RL phase (params.yaml
``curriculum.<env>.profiles.<profile>.warm_start``), each a DVC stage ``<env>_warm_<k>`` whose checkpoint the next
one starts from, so a curriculum can be SFT -> RFT -> GRPO phases with one lineage.

    warm_start:
      - {method: sft, items: 32, epochs: 3}              # expert episodes (or `recorded: [files]`)
      - {method: rft, items: 32, rounds: 2, k: 4, h: 6}  # sample -> keep successes -> SFT, per round
      - {method: dpo, items: 32, k: 4, h: 6, beta: 0.1}  # a success against a failure of the same item

Stage ``k`` writes ``runs/<env>/warm-<k>/``: the checkpoint (``final/``, or an RFT run's ``round-<r>/`` folders,
the last being its checkpoint), the episodes it trained on in the rollout log's JSONL record (``episodes.jsonl``,
``round-<r>.jsonl``, ``final.pairs.jsonl``), and the stage's settings in each manifest (``warm_start``), which
the lineage compares with dvc.lock. ``lora_r`` > 0 trains LoRA adapters of that rank (merged on export).
:func:`training.warmstart.methods.run_warm_stage` runs a stage; this module holds only its settings (what params.yaml
and the curriculum read).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

#: the phase types a warm start may use
METHODS = ("sft", "rft", "dpo")

#: the hf engine's prefix cache, a setting of whatever samples: RL phases, evaluation, RFT and DPO sampling
PREFIX_CACHE_GB = 1.0
GROUP_BY_LENGTH_HELP = ("batches of episodes of similar length (shuffled within windows of 16 batches, then the "
                        "batches shuffled): less padding, the same episodes each epoch, a different batch mix")
PREFIX_CACHE_HELP = ("hf engine: GiB of KV kept from each sequence's turn, so that the next turn of its conversation "
                     "prefills only the tokens added since (0: the whole context again each turn; the same tokens and "
                     "log-probs within float rounding)")


class _Method(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    items: int = Field(32, ge=1, description="the first N items of the split (its stratified order)")
    split: Literal["train", "warm"] = Field("train", description="whose items: the training split, or the warm split "
                                            "(data/<env>/warm.json: BabyAI's demonstration items beyond every other "
                                            "split; empty elsewhere)")
    sub_tasks: list[str] | None = Field(None, description="only items of these sub-tasks")
    max_turns: int | None = Field(None, ge=1, description="only items the expert solves within this many turns (the "
                                  "first `items` such items: every method of a warm start then sees the same ones)")
    epochs: int = Field(3, ge=1, description="passes over the stage's training data")
    lora_r: int = Field(0, ge=0, description="train LoRA adapters of this rank only (0: every weight)")
    seed: int = Field(0, description="seed of the stage's data order and sampling")


class StageSampling(BaseModel):
    """How a sampling warm-start stage (RFT, DPO) samples its episodes (``training.warmstart.rft.RFTConfig``
    takes each field by name)."""

    k: int = Field(4, ge=1, description="episodes sampled per item")
    h: int = Field(6, ge=1, description="turn cap of the sampled episodes")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the episodes")
    max_new_tokens: int = Field(64, ge=1, description="tokens per assistant turn")
    context_budget: int = Field(2048, ge=16, description="tokens per sampled episode, prompt and every turn (an "
                                "episode that would grow past it ends, cut: context_cap)")
    batch_items: int = Field(8, ge=1, description="items rolled out at once")
    prefix_cache_gb: float = Field(PREFIX_CACHE_GB, ge=0, description=PREFIX_CACHE_HELP)


class SFTStage(_Method):
    """Supervised fine-tuning on expert episodes of ``items`` training items, or on the successful episodes
    recorded in ``recorded`` (JSONL files or folders: a phase's rollouts/, RFT rounds, DPO pairs)."""

    method: Literal["sft"] = Field(description="the stage's method")
    recorded: list[str] | None = Field(None, description="recorded episode files instead of expert episodes")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate")
    batch_size: int = Field(8, ge=1, description="episodes per optimizer step")
    max_tokens: int = Field(2048, ge=16, description="longest episode trained on (longer ones left out, counted)")
    group_by_length: bool = Field(False, description=GROUP_BY_LENGTH_HELP)
    expert: str = Field("default", description="who plays the expert episodes: the environment's own expert, or one "
                        "it offers by name (BabyAI: sighted, GoTo missions in its high-level actions)")

    @field_validator("recorded", mode="before")
    @classmethod
    def _one_file(cls, value: object) -> object:
        """One file or folder (``--set recorded=path``) is a list of one."""
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _recorded_or_expert(self) -> SFTStage:
        """``items``, ``sub_tasks``, ``max_turns``, ``split`` and ``expert`` choose expert episodes: beside
        ``recorded`` (every successful episode of its files) they would be ignored, so they are an error."""
        chosen = [name for name in ("items", "sub_tasks", "max_turns", "split", "expert")
                  if getattr(self, name) != type(self).model_fields[name].default]
        if self.recorded and chosen:
            raise ValueError(f"{', '.join(chosen)} choose expert episodes, and recorded trains on every successful "
                             "episode of its files: give one or the other")
        return self


class RFTStage(_Method, StageSampling):
    """Rejection sampling (AgentEvol-style): ``rounds`` of sample k per item -> keep successes -> SFT."""

    method: Literal["rft"] = Field(description="the stage's method")
    rounds: int = Field(2, ge=1, description="rounds; the pipeline runs each as its own stage (and evaluates it)")
    round: int = Field(0, ge=0, description="the first round's index (set by the pipeline for each round's stage)")
    keep: Literal["all", "shortest"] = Field("all", description="every successful episode, or each item's shortest")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate of each round's SFT")


class DPOStage(_Method, StageSampling):
    """DPO on the policy's own episodes: each item's successes against its failures."""

    method: Literal["dpo"] = Field(description="the stage's method")
    beta: float = Field(0.1, gt=0, description="DPO's beta: how far from the reference the preference may pull")
    lr: float = Field(5e-5, gt=0, description="AdamW learning rate")
    batch_pairs: int = Field(8, ge=1, description="pairs per update")
    max_pairs_per_item: int = Field(4, ge=1, description="at most this many pairs of one item")


WarmStage = Annotated[SFTStage | RFTStage | DPOStage, Field(discriminator="method")]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(WarmStage)


def parse_stage(row: dict[str, Any]) -> SFTStage | RFTStage | DPOStage:
    """A phases.yaml / params.yaml row as its typed stage (a ValidationError names the bad field)."""
    return _ADAPTER.validate_python(row)


def checkpoint_of(folder: Path, stage: SFTStage | RFTStage | DPOStage) -> Path:
    """The checkpoint stage ``folder`` ends with: an RFT run's last round, else ``final``."""
    return stage_checkpoints(folder, stage)[-1]


def stage_checkpoints(folder: Path, stage: SFTStage | RFTStage | DPOStage) -> list[Path]:
    """Every checkpoint the stage writes, in order (an RFT run's rounds; one otherwise)."""
    if isinstance(stage, RFTStage):
        return [folder / f"round-{r}" for r in range(stage.round, stage.round + stage.rounds)]
    return [folder / "final"]


def pipeline_stages(stages: list[SFTStage | RFTStage | DPOStage]) -> list[SFTStage | RFTStage | DPOStage]:
    """The warm start as the pipeline's stages: an RFT entry of R rounds becomes R one-round stages (each its own
    DVC stage, checkpoint and evaluation), the others stay as they are."""
    out: list[SFTStage | RFTStage | DPOStage] = []
    for stage in stages:
        if isinstance(stage, RFTStage) and stage.rounds > 1:
            out += [stage.model_copy(update={"rounds": 1, "round": stage.round + r}) for r in range(stage.rounds)]
        else:
            out.append(stage)
    return out

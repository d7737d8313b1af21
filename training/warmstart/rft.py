"""Rejection-sampling fine-tuning (AgentEvol-style self-improvement): rounds of sample k episodes per item with
the current policy -> keep the successful ones (all, or each item's shortest) -> SFT on them -> the next round
samples from the result.

    rft(Path("models/tiny"), Path("runs/rft"), "babyai", url, items, RFTConfig(rounds=2, k=4, h=6))

Each round is a checkpoint ``round-<r>/`` (its manifest: kind ``rft``, the parent it sampled from, how many
episodes were sampled and kept, the sampling success rate) with the kept episodes beside it in
``round-<r>.jsonl`` (the rollout log's record of each: item, reward, turns, termination, conversation, and the
sampling policy's hash), so the lineage
says what each round trained on. A finished round is not redone: a rerun continues after the last one.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from envs.files import atomic_write
from training.checkpoint import MANIFEST, folder_hash, read_manifest
from training.model import load_policy
from training.placement.devices import resolve_device
from training.rollouts.rollout import Rollout, RolloutConfig
from training.sampler import build_sampler
from training.settings.config import SFTConfig
from training.settings.warm import PREFIX_CACHE_GB, PREFIX_CACHE_HELP
from training.trajectory import Trajectory
from training.warmstart.sft import sft

log = logging.getLogger(__name__)


class RFTConfig(BaseModel):
    """Settings of a rejection-sampling run."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rounds: int = Field(2, ge=1, description="sample -> keep -> SFT rounds, each from the last one's policy")
    k: int = Field(4, ge=1, description="episodes sampled per item each round")
    h: int = Field(6, ge=1, description="turn cap of the sampled episodes")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (greedy would give k equal episodes)")
    max_new_tokens: int = Field(64, ge=1, description="tokens per assistant turn")
    context_budget: int = Field(2048, ge=16, description="tokens per sampled episode, prompt and every turn")
    keep: Literal["all", "shortest"] = Field("all", description="every successful episode, or each item's "
                                             "shortest (fewest turns) one")
    batch_items: int = Field(8, ge=1, description="items rolled out at once")
    prefix_cache_gb: float = Field(PREFIX_CACHE_GB, ge=0, description=PREFIX_CACHE_HELP)
    seed: int = 0
    sft: SFTConfig = SFTConfig()


@dataclass
class Sampled:
    """A sampling run's episodes and how many prompt tokens the prefix cache spared the prefill."""

    trajectories: list[Trajectory]
    prefix_reused_tokens: int = 0


def select(trajectories: list[Trajectory], keep: str) -> list[Trajectory]:
    """The successful trajectories, all or each item's shortest (fewest turns, then fewest tokens)."""
    won = [t for t in trajectories if t.valid and t.success]
    if keep == "all":
        return won
    best: dict[str, Trajectory] = {}
    for t in won:
        if t.item_id not in best or (len(t.turns), len(t.input_ids)) < (len(best[t.item_id].turns),
                                                                         len(best[t.item_id].input_ids)):
            best[t.item_id] = t
    return [best[i] for i in sorted(best)]


def sample(policy: Path, env: str, url: str, items: list[str], config: RFTConfig, round_: int) -> Sampled:
    """``config.k`` episodes per item from ``policy`` at temperature ``config.temperature`` (each later turn
    prefilling only what the turn before added, with ``config.prefix_cache_gb`` > 0)."""
    model, tokenizer = load_policy(policy, resolve_device(config.sft.device))
    model.eval()
    sampler = build_sampler(model, tokenizer, policy, prefix_cache_gb=config.prefix_cache_gb)
    rollout = Rollout(env, url, sampler.engine, tokenizer, RolloutConfig(
        n_samples=config.k, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
        context_budget=config.context_budget, seed=config.seed * 1000 + round_))
    out: list[Trajectory] = []
    for start in range(0, len(items), config.batch_items):
        out += rollout.run(items[start:start + config.batch_items], config.h, step=round_).trajectories
    cache = sampler.prefix_cache
    return Sampled(out, cache.reused_tokens if cache is not None else 0)


def _comparable(settings: dict[str, Any]) -> dict[str, Any]:
    """RFT settings without what may change between the runs of one chain: the number of rounds, the prefix
    cache's size and the device."""
    sft_settings = settings.get("sft")
    return {**settings, "rounds": None, "prefix_cache_gb": None,
            **({"sft": {**sft_settings, "device": None}} if isinstance(sft_settings, dict) else {})}


def rft(init: Path, out: Path, env: str, url: str, items: list[str], config: RFTConfig,
        progress: bool = False, record: dict[str, Any] | None = None, first_round: int = 0) -> list[Path]:
    """Run (or continue) ``config.rounds`` rounds from ``init`` into ``out/round-<r>``; the rounds' checkpoints.
    ``record`` adds to each round's manifest. A finished round is reused only if it was made with these settings,
    from ``init``'s chain, on these items. ``first_round``: the index of the first round (a pipeline runs each
    round as its own stage; the index names its folder and seeds its sampling)."""
    if not items:
        raise ValueError("rejection sampling got no items: give the item ids to sample on")
    out.mkdir(parents=True, exist_ok=True)
    policy, rounds = Path(init), []
    for r in range(first_round, first_round + config.rounds):
        folder = out / f"round-{r}"
        if (folder / MANIFEST).exists():  # done in an earlier run: verified, then the next round starts from it
            done = read_manifest(folder, verify=True)
            # the same settings but the number of rounds (a run may go on for more), the prefix cache (speed, the
            # same episodes within float rounding) and the device (placement), from this chain, on these items; the
            # recorded settings read back through the model, so a setting added since takes its default
            try:
                recorded = RFTConfig.model_validate(done.get("rft") or {}).model_dump(mode="json")
            except ValidationError:
                recorded = done.get("rft") or {}
            made = {"rft": _comparable(recorded), "parent": done.get("parent"), "items": done.get("items")}
            wanted = {"rft": _comparable(config.model_dump(mode="json")), "parent": folder_hash(policy),
                      "items": items}
            if made != wanted:
                differ = ", ".join(k for k in made if made[k] != wanted[k])
                raise ValueError(f"{folder} was made with other settings ({differ} differ): remove {out} to start "
                                 "over, or write this run to another folder")
            policy = folder
            rounds.append(folder)
            continue
        run = sample(policy, env, url, items, config, r)
        sampled = run.trajectories
        errors = sum(1 for t in sampled if not t.valid)
        if errors == len(sampled):
            first = next((t.error for t in sampled if t.error), "?")
            raise RuntimeError(f"round {r}: all {len(sampled)} episodes hit environment errors (first: {first}); "
                               f"is the {env} server at {url} up?")
        kept = select(sampled, config.keep)
        rate = sum(1 for t in sampled if t.valid and t.success) / max(1, len(sampled) - errors)
        if not kept:
            raise ValueError(f"round {r}: none of the {len(sampled)} episodes sampled from {policy} succeeded (h="
                             f"{config.h}, k={config.k}): sample more (k, items), raise h, or warm-start with SFT")
        parent = folder_hash(policy)
        atomic_write(out / f"round-{r}.jsonl", "".join(
            json.dumps({"env": env, "round": r, "h": config.h, "policy": parent, **t.log_record()}) + "\n"
            for t in kept))
        log.info("round %d: kept %d of %d episodes (sampling success %.1f%%)", r, len(kept), len(sampled), 100 * rate)
        fields: dict[str, Any] = {"kind": "rft", "round": r, "env": env, "h": config.h,
                                  "rft": config.model_dump(mode="json"), "items": items, "sampled": len(sampled),
                                  "kept": len(kept), "env_errors": errors, "sample_success": rate,
                                  "sample_prefix_reused_tokens": run.prefix_reused_tokens,
                                  "kept_file": f"round-{r}.jsonl", **(record or {})}
        sft(policy, folder, [t.log_record() for t in kept], config.sft, progress=progress,
            record=fields)
        policy = folder
        rounds.append(folder)
    return rounds

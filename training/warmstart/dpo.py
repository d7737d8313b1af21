"""Direct preference optimisation on agent episodes: pairs of a successful and a failed episode of the same item,
the DPO loss on the assistant tokens only, against the frozen starting policy as the reference.

    pairs = preference_pairs(sample(policy, env, url, items, RFTConfig(k=4, h=6), 0).trajectories)
    dpo(policy, Path("runs/dpo"), pairs, DPOConfig(beta=0.1))

A pair's log-probability is the sum over the tokens the agent wrote (the loss mask a rollout records: never
the instruction or the observations). The checkpoint's manifest (kind ``dpo``) records the pairs, beta and the
loss and preference accuracy before and after; the pairs it trained on are written beside it
(``<out>.pairs.jsonl``) with the sampling policy's hash.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from envs.files import atomic_write
from training.checkpoint import MANIFEST, folder_hash, read_manifest
from training.lora import LoraSettings, with_lora
from training.model import load_policy
from training.placement.devices import resolve_device
from training.rl.experience import collate
from training.rl.losses import token_logprobs
from training.trajectory import Trajectory
from training.warmstart.sft import save_policy


class DPOConfig(BaseModel):
    """Settings of a DPO run."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    beta: float = Field(0.1, gt=0, description="strength of the preference against the reference")
    epochs: int = Field(3, ge=1)
    lr: float = Field(5e-5, gt=0)
    batch_pairs: int = Field(8, ge=1, description="pairs per update")
    max_pairs_per_item: int = Field(4, ge=1, description="at most this many pairs of one item")
    seed: int = 0
    device: str = "cpu"
    lora: LoraSettings | None = Field(None, description="train LoRA adapters only (merged into the checkpoint)")


def preference_pairs(trajectories: list[Trajectory], max_per_item: int = 4,
                     seed: int = 0) -> list[tuple[Trajectory, Trajectory]]:
    """(chosen, rejected) pairs: each item's successful episodes against its failed ones (valid episodes only,
    at most ``max_per_item`` pairs an item, chosen at random with ``seed``)."""
    rng = random.Random(seed)
    by_item: dict[str, tuple[list[Trajectory], list[Trajectory]]] = {}
    for t in trajectories:
        if t.valid:
            by_item.setdefault(t.item_id, ([], []))[0 if t.success else 1].append(t)
    pairs = []
    for item in sorted(by_item):
        won, lost = by_item[item]
        candidates = [(w, lo) for w in won for lo in lost]
        rng.shuffle(candidates)
        pairs += candidates[:max_per_item]
    return pairs


def _sequence_logprob(model: torch.nn.Module, trajectories: list[Trajectory], pad_id: int,
                      device: torch.device) -> torch.Tensor:
    """Sum of log-probs over each trajectory's agent tokens, shape [B]."""
    batch = collate(trajectories, pad_id)
    ids = batch.input_ids.to(device)
    logits = model(input_ids=ids, attention_mask=batch.attention_mask.to(device)).logits
    return (token_logprobs(logits, ids) * batch.mask.to(device)).sum(-1)


def margins(model: torch.nn.Module, reference: torch.nn.Module, pairs: list[tuple[Trajectory, Trajectory]],
            pad_id: int, device: torch.device) -> torch.Tensor:
    """Each pair's DPO margin (policy minus reference log-ratio of chosen over rejected), no grad."""
    with torch.no_grad():
        out = []
        for start in range(0, len(pairs), 8):
            chunk = pairs[start:start + 8]
            chosen, rejected = [c for c, _ in chunk], [r for _, r in chunk]
            out.append((_sequence_logprob(model, chosen, pad_id, device)
                        - _sequence_logprob(reference, chosen, pad_id, device))
                       - (_sequence_logprob(model, rejected, pad_id, device)
                          - _sequence_logprob(reference, rejected, pad_id, device)))
        return torch.cat(out)


def dpo(init: Path, out: Path, pairs: list[tuple[Trajectory, Trajectory]], config: DPOConfig,
        progress: bool = False, record: dict[str, Any] | None = None,
        provenance: dict[str, Any] | None = None) -> Path:
    """Train ``init`` on ``pairs`` with the DPO loss against ``init`` itself; write the checkpoint ``out``.
    ``provenance`` (where the pairs came from: the sampling policy's hash, the environment, h) is kept with each
    pair in the pairs file."""
    if not pairs:
        raise ValueError("DPO got no preference pairs: it needs items with both a successful and a failed episode "
                         "(sample more per item, or at a turn cap where some episodes succeed)")
    device = resolve_device(config.device)
    if (Path(init) / MANIFEST).exists():
        read_manifest(Path(init), verify=True)
    model, tokenizer = load_policy(init, device)
    reference, _ = load_policy(init, device)
    reference.eval().requires_grad_(False)
    pad = tokenizer.pad_token_id
    if config.lora is not None:
        model = with_lora(model, config.lora)
    model.eval()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr)
    rng = random.Random(config.seed)
    losses = []
    model.train()
    for _ in tqdm(range(config.epochs), desc="dpo", disable=not progress):
        order = list(range(len(pairs)))
        rng.shuffle(order)
        for start in range(0, len(order), config.batch_pairs):
            chunk = [pairs[i] for i in order[start:start + config.batch_pairs]]
            chosen, rejected = [c for c, _ in chunk], [r for _, r in chunk]
            with torch.no_grad():
                ref = (_sequence_logprob(reference, chosen, pad, device)
                       - _sequence_logprob(reference, rejected, pad, device))
            pol = _sequence_logprob(model, chosen, pad, device) - _sequence_logprob(model, rejected, pad, device)
            loss = -torch.nn.functional.logsigmoid(config.beta * (pol - ref)).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(float(loss.detach()))
    model.eval()
    after = margins(model, reference, pairs, pad, device)
    atomic_write(out.parent / f"{out.name}.pairs.jsonl", "".join(
        json.dumps({"item_id": c.item_id, **(provenance or {}),
                    "chosen": c.log_record(), "rejected": r.log_record()}) + "\n"
        for c, r in pairs))

    fields = {"kind": "dpo", "parent": folder_hash(init), "config": config.model_dump(), "pairs": len(pairs),
              "items": len({c.item_id for c, _ in pairs}), "first_loss": losses[0], "final_loss": losses[-1],
              "accuracy_after": float((after > 0).float().mean()), "mean_margin_after": float(after.mean()),
              "pairs_file": f"{out.name}.pairs.jsonl", **(record or {})}
    return save_policy(out, model, tokenizer, config.lora, fields)

"""Supervised fine-tuning on stored trajectories, through the same mask machinery as RL.

Optional warm start from expert episodes (this project's smoke runs use it so a tiny random model can
act at all); the paper-scale presets keep the paper's rule: no SFT warm-up. Conversations are the
rollout's message lists, tokenised exactly as a rollout tokenises them (``ChatFormat.conversation``); the loss
covers exactly the assistant turns the agent wrote, never the instruction's acknowledgement, template or
observation tokens.

    scalinginter sft babyai --init models/tiny --out runs/babyai/sft --episodes 64
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from envs.corpus import played_episode
from envs.local import local_client
from envs.registry import spec_class
from envs.splits import item_index, load_split
from training.chat_format import ChatFormat, opening_messages
from training.checkpoint import MANIFEST, STATE, folder_hash, read_manifest, write_checkpoint
from training.lora import save_lora, with_lora
from training.model import load_policy
from training.placement.devices import resolve_device
from training.rl.experience import collate
from training.rl.losses import token_logprobs
from training.settings.config import SFTConfig
from training.store import recorded_trajectory, training_conversation
from training.trajectory import Trajectory

log = logging.getLogger(__name__)


def expert_conversations(env: str, item_ids: list[str], count: int | None = None,
                         max_turns: int | None = None) -> list[list[dict[str, str]]]:
    """The rollout-format message list of an expert episode on each item (played in-process); with ``max_turns``,
    only the items the expert solves within that many replies, in order, until ``count`` are found."""
    return list(expert_episodes(env, item_ids, count, max_turns).values())


def expert_episodes(env: str, item_ids: list[str], count: int | None = None, max_turns: int | None = None,
                    expert: str = "default", backend: Any = None) -> dict[str, list[dict[str, str]]]:
    """``{item_id: messages}`` of :func:`expert_conversations`, played by the environment's expert ``expert``
    (``envs.registry.expert``) on ``backend`` (default: the environment's own); an episode the expert fails is
    left out (logged)."""
    start = spec_class(env).conversation_start
    client = local_client(env, backend)
    out: dict[str, list[dict[str, str]]] = {}
    failed = 0
    try:
        for item in item_ids:
            if count is not None and len(out) >= count:
                break
            texts, solved = played_episode(env, client, item_index(item), expert)
            failed += not solved
            if not solved or (max_turns is not None and (len(texts) - 1) // 2 > max_turns):
                continue
            messages = opening_messages(start, texts[0])
            for reply, observation in zip(texts[1::2], texts[2::2], strict=True):
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": observation}]
            out[item] = messages[:-1]  # the episode ends with the agent's last reply
    finally:
        client.close()
        client.backend.shutdown()
    if failed:
        log.info("%s's %s expert failed %d of the items it played: left out", env, expert, failed)
    return out


def to_trajectory(messages: list[dict[str, str]], tokenizer: Any, group: int = 0) -> Trajectory:
    """Token ids and loss mask of a conversation, token for token as a rollout of it would be (the same prompt,
    the same turn layout); only the agent's replies after the prompt are trained, never the instruction's
    acknowledgement. Needs no generation tags in the chat template."""
    prompt_messages = 4 if messages and messages[0]["role"] == "system" else 3
    if len(messages) <= prompt_messages or messages[prompt_messages]["role"] != "assistant":
        raise ValueError("an SFT conversation is the instruction, its acknowledgement and the first observation, "
                         "then at least one assistant reply")
    t = Trajectory(item_id="sft", group=group, sample=0)
    t.input_ids, t.loss_mask = ChatFormat(tokenizer).conversation(messages, prompt_messages)
    t.logprobs = [0.0] * len(t.input_ids)
    return t


def sft(init: Path, out: Path, conversations: list[list[dict[str, str]] | dict[str, Any]], config: SFTConfig,
        progress: bool = False, record: dict[str, Any] | None = None) -> Path:
    """Fine-tune ``init`` on ``conversations`` (message lists, or recorded episodes of ``training.store``: their
    own token ids when they are in this tokenizer, else their conversation re-encoded); write an atomic checkpoint
    to ``out``; return it. ``record`` adds to (or overrides, e.g. ``kind``) the manifest's fields."""
    device = resolve_device(config.device)
    if (Path(init) / MANIFEST).exists():  # a checkpoint or a base model written here: verified before it is loaded
        read_manifest(Path(init), verify=True)
    model, tokenizer = load_policy(init, device)
    chat = ChatFormat(tokenizer)
    examples, exact = [], 0
    for i, episode in enumerate(conversations):
        if isinstance(episode, dict):  # a recorded episode: the very tokens it was sampled as, when they can be
            recorded = recorded_trajectory(episode, chat, i)
            exact += recorded is not None
            examples.append(recorded or to_trajectory(training_conversation(episode), tokenizer, i))
        else:
            examples.append(to_trajectory(episode, tokenizer, i))
    if not examples:
        raise ValueError("SFT got no conversations: give at least one expert episode")
    lengths = [len(e.input_ids) for e in examples]
    examples = [e for e in examples if len(e.input_ids) <= config.max_tokens]
    dropped = len(lengths) - len(examples)
    if not examples:
        raise ValueError(f"all {len(lengths)} SFT episodes are longer than max_tokens={config.max_tokens} (shortest "
                         f"{min(lengths)} tokens): raise max_tokens or train on shorter episodes")
    if dropped:
        log.warning("SFT leaves out %d of %d episodes longer than max_tokens=%d (longest %d tokens)", dropped,
                    len(lengths), config.max_tokens, max(lengths))
    if config.lora is not None:
        model = with_lora(model, config.lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr)
    rng = random.Random(config.seed)
    model.train()
    losses = []
    padded = 0
    for _ in tqdm(range(config.epochs), desc="sft", disable=not progress):
        for rows in epoch_batches([len(e.input_ids) for e in examples], config.batch_size, rng,
                                  config.group_by_length):
            batch = collate([examples[i] for i in rows], tokenizer.pad_token_id)
            padded += batch.input_ids.numel()
            ids = batch.input_ids.to(device)
            logits = model(input_ids=ids, attention_mask=batch.attention_mask.to(device)).logits
            mask = batch.mask.to(device)
            loss = -(token_logprobs(logits, ids) * mask).sum() / mask.sum().clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(float(loss.detach()))

    fields = {"kind": "sft", "parent": folder_hash(init), "config": config.model_dump(), "episodes": len(examples),
              "episodes_over_max_tokens": dropped,
              "recorded_token_ids": exact, "final_loss": losses[-1], "first_loss": losses[0],
              "padded_share": round(1 - config.epochs * sum(len(e.input_ids) for e in examples) / padded, 4),
              **(record or {})}
    return save_policy(out, model, tokenizer, config.lora, fields)


def epoch_batches(lengths: list[int], batch_size: int, rng: random.Random, group_by_length: bool = False,
                  window: int = 16) -> list[list[int]]:
    """One epoch's batches of example indices: a shuffled order cut into batches; with ``group_by_length``, each
    window of ``window`` batches of that order sorted by length before it is cut, and the batches then shuffled
    (every example once per epoch either way; batches of like lengths pad less)."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    if not group_by_length:
        return [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    span = batch_size * window
    batches = []
    for w in range(0, len(order), span):
        part = sorted(order[w:w + span], key=lambda i: lengths[i])
        batches += [part[s:s + batch_size] for s in range(0, len(part), batch_size)]
    rng.shuffle(batches)
    return batches


def save_policy(out: Path, model: Any, tokenizer: Any, lora: Any, record: dict[str, Any]) -> Path:
    """A fine-tuned policy as an exported checkpoint (atomic, with ``record`` in its manifest): the merged
    weights and the adapter in lora/ when ``lora`` trained adapters; a later RL phase keeps close to it (its
    own reference)."""
    def write(tmp: Path) -> None:
        if lora is not None:
            save_lora(model, tmp)
        else:
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save({"global_step": 0, "reference": str(out)}, tmp / STATE)

    write_checkpoint(out, write, record, export=True)
    return out


def sft_items(env: str, count: int, split: str = "train", sub_tasks: list[str] | None = None) -> list[str]:
    """The first ``count`` items of a split (optionally of some sub-tasks) to warm-start on."""
    rows = [r for r in load_split(env, split) if not sub_tasks or r["sub_task"] in sub_tasks]
    return [r["item_id"] for r in rows[:count]]

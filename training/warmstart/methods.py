"""Running a warm-start stage (:mod:`training.settings.warm`): SFT, rejection sampling or DPO from a checkpoint
into the stage's folder, with the stage's settings in every manifest it writes (``warm_start``).

    run_warm_stage("babyai", 0, parse_stage({"method": "sft", "items": 64}), Path("models/tiny"),
                   Path("runs/babyai/warm-0"))
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from envs.files import atomic_write
from envs.launcher import running_replicas
from training.chat_format import ChatFormat
from training.checkpoint import folder_hash
from training.lora import lora_of_rank
from training.placement.devices import placement, resolve_device
from training.settings.config import ServerConfig, SFTConfig
from training.settings.warm import DPOStage, RFTStage, SFTStage, StageSampling
from training.store import read_episodes
from training.warmstart.dpo import DPOConfig, dpo, preference_pairs
from training.warmstart.rft import RFTConfig, rft, sample
from training.warmstart.sft import expert_episodes, sft, sft_items, to_trajectory


def run_warm_stage(env: str, index: int, stage: SFTStage | RFTStage | DPOStage, init: Path, out: Path,
                   url: str | None = None, server: ServerConfig | None = None, progress: bool = False,
                   device: str | None = None) -> Path:
    """Run warm-start stage ``index`` of ``env`` from ``init`` into the folder ``out``; returns its checkpoint.
    Sampling methods use the environment server at ``url``, or servers started here with ``server`` (a
    ``ServerConfig``) and always stopped; SFT on expert episodes plays them in-process. The model (training and
    sampling) goes on ``device``, by default where the work pool places it (``SCALINGINTER_DEVICE``, cpu by
    default). The pipeline's stages and the CLI's ``sft``, ``rft`` and ``dpo`` commands all run through here."""
    device = device or placement()
    resolve_device(device)  # a device that is not here: an error before any work
    record = {"warm_start": {"index": index, **stage.model_dump()}}
    out.mkdir(parents=True, exist_ok=True)
    lora = lora_of_rank(stage.lora_r)
    sft_config = SFTConfig(epochs=stage.epochs, lr=stage.lr, seed=stage.seed, lora=lora, device=device,
                           **({"batch_size": stage.batch_size, "max_tokens": stage.max_tokens,
                                 "group_by_length": stage.group_by_length}
                              if isinstance(stage, SFTStage) else {}))
    if isinstance(stage, SFTStage):
        return _sft_stage(env, stage, init, out, sft_config, record, progress)
    ids = list(_items(env, stage)) if stage.max_turns else sft_items(env, stage.items, stage.split, stage.sub_tasks)
    if not ids:
        raise ValueError(f"warm start {index} ({stage.method}): the {env} {stage.split} split has no items of "
                         f"sub-tasks {stage.sub_tasks}")
    with contextlib.ExitStack() as stack:
        if url is None:
            if server is None:
                raise ValueError(f"warm start {index} ({stage.method}) samples episodes: give an environment server "
                                 "URL or the server settings to start one")
            url = stack.enter_context(running_replicas(env, **server.launch_kwargs()))
        # how RFT and DPO sample: the stage's sampling settings, one builder (the SFT settings: the device)
        sampling = RFTConfig(**{name: getattr(stage, name) for name in StageSampling.model_fields}, seed=stage.seed,
                             sft=sft_config)
        if isinstance(stage, RFTStage):
            config = sampling.model_copy(update={"rounds": stage.rounds, "keep": stage.keep})
            return rft(init, out, env, url, ids, config, progress=progress, record=record,
                       first_round=stage.round)[-1]
        config = DPOConfig(beta=stage.beta, epochs=stage.epochs, lr=stage.lr, batch_pairs=stage.batch_pairs,
                           max_pairs_per_item=stage.max_pairs_per_item, seed=stage.seed, lora=lora, device=device)
        sampled = sample(init, env, url, ids, sampling, 0)
        pairs = preference_pairs(sampled.trajectories, config.max_pairs_per_item, config.seed)
    record["sample_prefix_reused_tokens"] = sampled.prefix_reused_tokens
    return dpo(init, out / "final", pairs, config, progress=progress, record=record,
               provenance={"policy": folder_hash(init), "env": env, "h": stage.h})


def _items(env: str, stage: SFTStage | RFTStage | DPOStage) -> dict[str, list[dict[str, str]]]:
    """The stage's items with their expert episodes: the first ``items`` of its split (of ``sub_tasks``) that the
    expert (``expert``: SFT's choice, else the environment's own) solves, within ``max_turns`` where set."""
    candidates = sft_items(env, 10**9, stage.split, stage.sub_tasks)  # played in order until `items` succeed
    episodes = expert_episodes(env, candidates, stage.items, stage.max_turns, getattr(stage, "expert", "default"))
    if len(episodes) < stage.items:
        raise ValueError(f"the {env} {stage.split} split has only {len(episodes)} items (sub-tasks {stage.sub_tasks}) "
                         f"the expert solves within {stage.max_turns} turns, not {stage.items}: lower items or "
                         "raise max_turns")
    return episodes


def _sft_stage(env: str, stage: SFTStage, init: Path, out: Path, config: Any, record: dict[str, Any],
               progress: bool) -> Path:
    if stage.recorded:
        records, sources = read_episodes([Path(p) for p in stage.recorded])
        if not records:
            read = ", ".join(s["path"] for s in sources) or "no .jsonl file"
            raise ValueError(f"no successful episode in the recorded files {stage.recorded} (read: {read}): give "
                             "files that hold some (a phase's rollouts/, an RFT round-<r>.jsonl, DPO pairs)")
        conversations: list[Any] = records  # their own token ids where they are in this tokenizer
        record = {**record, "source": "recorded", "sources": sources}
    else:
        episodes = _items(env, stage)
        conversations = list(episodes.values())
        # the expert episodes in the store's record, so any method can train on them again and the lineage says which
        chat = ChatFormat(AutoTokenizer.from_pretrained(str(init)))
        lines = []
        for item, messages in episodes.items():
            t = to_trajectory(messages, chat.tokenizer)
            lines.append(json.dumps({"env": env, "item_id": item, "source": "expert", "success": True,
                                     "conversation": messages, "tokenizer": chat.fingerprint,
                                     "input_ids": t.input_ids, "assistant_spans": t.assistant_spans()}) + "\n")
        atomic_write(out / "episodes.jsonl", "".join(lines))
        record = {**record, "source": "expert", "episodes_file": "episodes.jsonl"}
    return sft(init, out / "final", conversations, config, progress=progress, record=record)

"""Recorded episodes as training data: every method writes its episodes in the rollout log's JSONL record
(item, reward, success, turns, termination, the whole conversation): RL phases (``<phase>/rollouts/``), RFT
rounds (``round-<r>.jsonl``, with the sampling policy's hash) and DPO pairs (``<out>.pairs.jsonl``, each line
a chosen and a rejected record). :func:`read_episodes` reads any of them back, so SFT (``scalinginter sft
--from PATH``) can train on any recorded experience, and the checkpoint's manifest names the files and their
sha256 (the lineage says which).

Each record also holds its token ids exactly as the policy sampled them, the agent's spans and the fingerprint of
the tokenizer they are in (``ChatFormat.fingerprint``): :func:`recorded_trajectory` trains on those very tokens
when the learner's tokenizer is the same, and re-encodes the conversation otherwise (another model family)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from training.chat_format import ChatFormat
from training.checkpoint import sha256_file
from training.trajectory import Trajectory


def _files(paths: Iterable[Path]) -> list[Path]:
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            out += sorted(path.rglob("*.jsonl"))
        elif path.is_file():
            out.append(path)
        else:
            raise FileNotFoundError(f"no recorded episodes at {path}: give JSONL files or folders of them (a phase's "
                                    "rollouts/, an RFT round-<r>.jsonl, a DPO <out>.pairs.jsonl)")
    return out


def read_episodes(paths: Iterable[Path], successful: bool | None = True) -> tuple[list[dict[str, Any]],
                                                                                   list[dict[str, str]]]:
    """The episode records in ``paths`` (files or folders), only the successful ones by default (``None``: all),
    and the sources read: ``[{path, sha256}]``. A line that is not an episode record is an error naming it."""
    records, sources = [], []
    for file in _files(paths):
        sources.append({"path": str(file), "sha256": sha256_file(file)})
        for number, line in enumerate(file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            episodes = [row["chosen"], row["rejected"]] if "chosen" in row else [row]
            for episode in episodes:
                if not isinstance(episode.get("conversation"), list):
                    raise ValueError(f"{file}:{number} is not a recorded episode (no conversation)")
                if successful is None or bool(episode.get("success")) == successful:
                    records.append(episode)
    return records, sources


def training_conversation(record: dict[str, Any]) -> list[dict[str, str]]:
    """An episode's conversation up to its last reply (the final observation is not trained on)."""
    messages = [{"role": m["role"], "content": m["content"]} for m in record["conversation"]]
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    return messages


def recorded_trajectory(record: dict[str, Any], chat: ChatFormat, group: int = 0) -> Trajectory | None:
    """The record's own token ids up to its last agent token, with the agent's spans as the loss mask, when they
    are in ``chat``'s tokenizer; None when the record has none or another tokenizer's (re-encode it then)."""
    ids, spans = record.get("input_ids"), record.get("assistant_spans")
    if not ids or not spans or record.get("tokenizer") != chat.fingerprint:
        return None
    end = spans[-1][1]
    t = Trajectory(item_id=str(record.get("item_id", "recorded")), group=group, sample=0, tokenizer=chat.fingerprint)
    t.input_ids = list(ids[:end])
    t.loss_mask = [0] * end
    for start, stop in spans:
        t.loss_mask[start:stop] = [1] * (stop - start)
    t.logprobs = [0.0] * end
    return t

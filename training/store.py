"""Recorded episodes as training data: every method writes its episodes in the rollout log's JSONL record
(item, reward, success, turns, termination, the whole conversation): RL phases (``<phase>/rollouts/``), RFT
rounds (``round-<r>.jsonl``, with the sampling policy's hash) and DPO pairs (``<out>.pairs.jsonl``, each line
a chosen and a rejected record). :func:`read_episodes` reads any of them back, so SFT (``scalinginter sft
--from PATH``) can train on any recorded experience, and the checkpoint's manifest names the files and their
sha256 (the lineage says which)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from training.checkpoint import sha256_file


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

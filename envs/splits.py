"""Deterministic task splits: ``data/<env>/{train,test,gate,warm}.json``.

Each split is a JSON list of ``{"item_id": "<env>_<idx>", "sub_task": <label>}`` sorted by index. The
test items are a seeded sample of the index space stratified by sub-task (so every sub-task is in the
test set in proportion), the training items a seeded sample of ``n_train`` of the rest. Sizes follow AgentGym
where known (BabyAI 810/90, TextCraft 374/100, SciWorld 2120/200).

The gate items (``gate.json``, the promotion gates' own held-out items, ``training.evaluation.gate``) are up to
:data:`GATE_ITEMS` items that neither split holds, stratified the same way: those the environment has beyond
its train and test items, or, where the split's index space is set here (BabyAI's generated levels), the
indices after it. An environment with no item to spare (WebArena's 33 tasks) has an empty gate split.

The warm items (``warm.json``) are demonstration items for a warm start (``split: warm`` of a warm-start stage,
``training.settings.warm``): :data:`WARM_ITEMS` indices after the gate's, where the environment generates items without
end (BabyAI's levels), so a warm start can learn from many more expert episodes than the training split holds
without touching an evaluated item. Every other environment has an empty warm split.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

from envs.files import atomic_write
from envs.paths import project_root


def data_dir() -> Path:
    """The working copy's ``data/`` folder (see ``envs.paths``)."""
    return project_root() / "data"

# env -> (size of the index space the split draws from, n_train, n_test); None = the backend's num_items.
SPLIT_SIZES: dict[str, tuple[int | None, int, int]] = {
    "babyai": (900, 810, 90),
    "textcraft": (None, 374, 100),
    "sciworld": (None, 2120, 200),
    "deepsearch": (None, 2386, 350),  # of 2,800 questions: 64 left for the gate split
    "webarena": (None, 21, 12),
    "bandit": (64, 48, 16),
}
#: the warm split's size where the environment's items never run out (BabyAI)
WARM_ITEMS = 4000

#: the most gate items a split offers (``gate.<profile>.items`` takes the first N of them, stratified)
GATE_ITEMS = 64


def item_index(item_id: str) -> int:
    """The integer data_idx of an item id such as ``"textcraft_12"``."""
    head, _, tail = item_id.rpartition("_")
    if not head or not tail.isdigit():
        raise ValueError(f"item id {item_id!r} is not of the form '<env>_<index>'")
    return int(tail)


def make_split(env: str, labels: list[str], n_train: int, n_test: int, seed: int = 0) -> dict[str, list[dict]]:
    """Split indices ``0..len(labels)-1`` (``labels[i]`` = sub-task of index i) into train and test."""
    if n_train + n_test > len(labels):
        raise ValueError(f"{env}: {n_train} + {n_test} items requested but only {len(labels)} exist")
    rng = random.Random(f"{env}-split-{seed}")
    by_label: dict[str, list[int]] = defaultdict(list)
    for idx, label in enumerate(labels):
        by_label[label].append(idx)
    test: list[int] = []
    for label in sorted(by_label):
        share = round(n_test * len(by_label[label]) / len(labels))
        test += rng.sample(by_label[label], min(share, len(by_label[label])))
    rest = sorted(set(range(len(labels))) - set(test))
    rng.shuffle(test)
    test = sorted(test[:n_test] if len(test) >= n_test else test + rng.sample(rest, n_test - len(test)))
    rest = sorted(set(range(len(labels))) - set(test))
    train = sorted(rng.sample(rest, n_train))

    def rows(indices: list[int]) -> list[dict]:
        return [{"item_id": f"{env}_{i}", "sub_task": labels[i]} for i in indices]

    return {"train": rows(train), "test": rows(test)}


def gate_split(env: str, labels: dict[int, str], n_gate: int = GATE_ITEMS, seed: int = 0) -> list[dict]:
    """Up to ``n_gate`` of the indices in ``labels`` (``{index: sub-task}``, none of them in a train or test
    split), a seeded sample stratified by sub-task, sorted by index."""
    rng = random.Random(f"{env}-gate-{seed}")
    by_label: dict[str, list[int]] = defaultdict(list)
    for idx in sorted(labels):
        by_label[labels[idx]].append(idx)
    picked: list[int] = []
    for label in sorted(by_label):
        share = max(1, round(n_gate * len(by_label[label]) / len(labels)))
        picked += rng.sample(by_label[label], min(share, len(by_label[label])))
    rng.shuffle(picked)
    return [{"item_id": f"{env}_{i}", "sub_task": labels[i]} for i in sorted(picked[:n_gate])]


def write_splits(env: str, backend: Any, out_dir: Path | None = None, seed: int = 0) -> dict[str, Path]:
    """Compute the splits of ``env`` from its backend's sub-task labels and write them as JSON."""
    out_dir = out_dir if out_dir is not None else data_dir()
    size, n_train, n_test = SPLIT_SIZES[env]
    if size is None:  # the environment's own items: the gate takes from those no split holds
        size = backend.num_items
        spare = range(size, size)
    else:  # a space set here: the gate takes the indices after it (as far as the environment has items)
        end = size + GATE_ITEMS if backend.num_items is None else min(backend.num_items, size + GATE_ITEMS)
        spare = range(size, end)
    labels = [backend.sub_task(i) for i in range(size)]
    split = make_split(env, labels, n_train, n_test, seed)
    taken = {item_index(r["item_id"]) for rows in split.values() for r in rows}
    left = {i: labels[i] for i in range(size) if i not in taken} | {i: backend.sub_task(i) for i in spare}
    split["gate"] = gate_split(env, left, seed=seed) if left else []
    start = size + GATE_ITEMS  # after every index the splits and the gate draw from
    split["warm"] = [{"item_id": f"{env}_{i}", "sub_task": backend.sub_task(i)}
                     for i in range(start, start + WARM_ITEMS)] if backend.num_items is None else []
    paths = {}
    for name, rows in split.items():
        path = out_dir / env / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(rows, indent=0) + "\n")
        paths[name] = path
    return paths


def load_split(env: str, split: str, folder: Path | None = None) -> list[dict]:
    """Read ``data/<env>/<split>.json``; a missing file names the command that writes it."""
    path = (folder if folder is not None else data_dir()) / env / f"{split}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run `scalinginter splits {env}` to write it")
    return json.loads(path.read_text())

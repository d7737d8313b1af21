"""Task splits: deterministic, disjoint, stratified, sized like AgentGym's, labelled with sub-tasks."""

from __future__ import annotations

from collections import Counter

import pytest

from envs.splits import SPLIT_SIZES, item_index, load_split, make_split


def test_make_split_is_deterministic_disjoint_and_stratified() -> None:
    labels = ["a"] * 600 + ["b"] * 300 + ["c"] * 100
    first, again = make_split("toy", labels, 800, 100), make_split("toy", labels, 800, 100)
    assert first == again
    train = {item_index(r["item_id"]) for r in first["train"]}
    test = {item_index(r["item_id"]) for r in first["test"]}
    assert len(train) == 800 and len(test) == 100 and not train & test
    assert Counter(r["sub_task"] for r in first["test"]) == {"a": 60, "b": 30, "c": 10}
    assert make_split("toy", labels, 800, 100, seed=1) != first


def test_make_split_refuses_too_many_items() -> None:
    with pytest.raises(ValueError, match="only 10 exist"):
        make_split("toy", ["a"] * 10, 8, 5)


@pytest.mark.parametrize("env", sorted(SPLIT_SIZES))
def test_committed_splits_have_agentgym_sizes_and_labels(env: str) -> None:
    _, n_train, n_test = SPLIT_SIZES[env]
    train, test = load_split(env, "train"), load_split(env, "test")
    assert (len(train), len(test)) == (n_train, n_test)
    ids = [r["item_id"] for r in train + test]
    assert len(set(ids)) == len(ids) and all(i.startswith(f"{env}_") for i in ids)
    assert all(r["sub_task"] for r in train + test)
    assert len({r["sub_task"] for r in test}) >= (1 if env == "bandit" else 4)


def test_item_index_rejects_malformed_ids() -> None:
    assert item_index("textcraft_12") == 12
    with pytest.raises(ValueError, match="<env>_<index>"):
        item_index("textcraft")


@pytest.mark.parametrize("env", sorted(set(SPLIT_SIZES) - {"bandit"}))
def test_the_committed_splits_are_what_the_splits_stage_writes_and_the_warm_split_holds_no_other_item(
        env: str, tmp_path) -> None:
    from envs.registry import load_backend
    from envs.splits import WARM_ITEMS, write_splits

    write_splits(env, load_backend(env), tmp_path)
    for split in ("train", "test", "gate", "warm"):
        assert load_split(env, split, tmp_path) == load_split(env, split), split
    warm = [item_index(r["item_id"]) for r in load_split(env, "warm")]
    others = {item_index(r["item_id"]) for s in ("train", "test", "gate") for r in load_split(env, s)}
    if env == "babyai":  # generated levels without end: indices after every other split's
        assert len(warm) == WARM_ITEMS and min(warm) > max(others)
        assert Counter(r["sub_task"] for r in load_split(env, "warm"))["GoTo"] > 1000
    else:
        assert warm == []

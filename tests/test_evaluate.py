"""Bootstrap intervals used by the evaluation and the learning benchmark."""

from __future__ import annotations

import pytest
import torch

from training.evaluation.evaluate import EvalResult, bootstrap_ci, paired_difference_ci


def test_bootstrap_ci_brackets_the_mean_and_narrows_with_more_data() -> None:
    small = [1.0, 0.0] * 10
    large = [1.0, 0.0] * 500
    low_s, high_s = bootstrap_ci(small)
    low_l, high_l = bootstrap_ci(large)
    assert low_s < 0.5 < high_s and low_l < 0.5 < high_l
    assert high_l - low_l < (high_s - low_s) / 3
    assert bootstrap_ci([1.0] * 7) == (1.0, 1.0)
    assert bootstrap_ci(small, seed=3) == bootstrap_ci(small, seed=3)


def test_paired_difference_sees_a_consistent_gain_that_unpaired_intervals_hide() -> None:
    # 40 items, half hard (never solved) and half easy; training adds 5 solved hard items
    before = [0.0] * 20 + [1.0] * 20
    after = [1.0] * 5 + [0.0] * 15 + [1.0] * 20
    diff, low, high = paired_difference_ci(before, after)
    assert diff == pytest.approx(5 / 40) and 0 < low <= diff <= high
    # the same pairs reversed are a significant loss
    assert paired_difference_ci(after, before)[2] < 0
    with pytest.raises(ValueError, match="differ in length"):
        paired_difference_ci([1.0], [1.0, 0.0])


def test_eval_result_metrics() -> None:
    result = EvalResult(success={"a": [True, False], "b": [False, False]}, reward={"a": [1.0, 0.5], "b": [0.0, 0.2]})
    assert result.success_rate == 0.25 and result.pass_at_k == 0.5
    assert result.avg_at_k == pytest.approx((0.75 + 0.1) / 2)
    assert result.item_success() == [0.5, 0.0]


def test_evaluation_is_reproducible_same_checkpoint_same_seed_same_numbers(env_server, bandit_warm_start) -> None:
    from envs.splits import load_split
    from training.evaluation.evaluate import evaluate_checkpoints

    items = load_split("bandit", "test")[:8]
    url = env_server("bandit")

    def run(seed: int) -> dict:
        models = {"first": bandit_warm_start, "again": bandit_warm_start}
        return evaluate_checkpoints(models, "bandit", url, items, h=2, k=4, temperature=1.0, max_new_tokens=12,
                                    seed=seed, batch_items=4)

    one, two = run(seed=3), run(seed=3)
    assert one == two
    first, again = one["checkpoints"]["first"], one["checkpoints"]["again"]
    assert {k: v for k, v in first.items() if k != "path"} == {k: v for k, v in again.items() if k != "path"}
    rewards = [r for item in first["per_item"].values() for r in item["reward"]]
    assert 0 < sum(rewards) < len(rewards)  # the samples really vary, so equality above means something
    other = run(seed=4)["checkpoints"]["first"]["per_item"]
    assert other != first["per_item"]  # and the seed matters


def test_the_prefix_cache_changes_no_outcome_and_skips_the_repeated_prefill(env_server, tiny_model_dir) -> None:
    from envs.splits import load_split
    from training.evaluation.evaluate import evaluate_checkpoints

    items = load_split("babyai", "test")[:3]

    def run(prefix_cache_gb: float) -> dict:
        return evaluate_checkpoints({"base": tiny_model_dir}, "babyai", env_server("babyai"), items, h=3, k=2,
                                    temperature=1.0, max_new_tokens=8, seed=0, prefix_cache_gb=prefix_cache_gb)

    whole, cached = run(0.0)["checkpoints"]["base"], run(0.5)["checkpoints"]["base"]
    assert cached["per_item"] == whole["per_item"]
    # each later turn prefilled only what the turn before added
    assert cached["prefix_reused_tokens"] > 0 and whole["prefix_reused_tokens"] == 0


def test_evaluation_takes_trainings_context_budget_and_the_placements_device(env_server, bandit_warm_start,
                                                                              monkeypatch) -> None:
    from envs.splits import load_split
    from training.evaluation.evaluate import evaluate
    from training.placement.devices import DeviceError
    from training.settings.config import eval_config, load_params, train_config

    params = load_params()
    assert eval_config("babyai", "smoke", params).context_budget == train_config("babyai", "smoke",
                                                                                 params=params).context_budget
    params["eval"]["smoke"]["context_budget"] = 512
    assert eval_config("babyai", "smoke", params).context_budget == 512
    monkeypatch.setenv("SCALINGINTER_DEVICE", "cuda:0")  # a work pool's placement reaches evaluation too
    assert eval_config("babyai", "smoke", params).device == "cuda:0"

    items, url = [r["item_id"] for r in load_split("bandit", "test")[:4]], env_server("bandit")
    roomy = evaluate(bandit_warm_start, "bandit", url, items, h=1, k=2, temperature=1.0, max_new_tokens=12)
    assert sum(map(sum, roomy.success.values())) > 0
    # a budget under the prompt's length ends every trajectory before it can act: the budget is really used
    tight = evaluate(bandit_warm_start, "bandit", url, items, h=1, k=2, temperature=1.0, max_new_tokens=12,
                     context_budget=16)
    assert sum(map(sum, tight.success.values())) == 0
    if not torch.cuda.is_available():  # the device is really used: the model is loaded onto it
        with pytest.raises(DeviceError, match="CUDA is not available"):
            evaluate(bandit_warm_start, "bandit", url, items, h=1, k=1, device="cuda")


def _run(per_checkpoint: dict[str, list[int]]) -> tuple[dict, dict]:
    """An evaluation's metrics and per-item records with these per-item successes (reward = success)."""
    from training.evaluation.evaluate import _summary

    checkpoints, per_item = {}, {}
    for name, wins in per_checkpoint.items():
        checkpoints[name] = _summary([[bool(w)] for w in wins], [[float(w)] for w in wins])
        per_item[name] = {f"i{k}": {"success": [bool(w)], "reward": [float(w)]} for k, w in enumerate(wins)}
    return {"items": len(next(iter(per_checkpoint.values()))), "k": 1, "checkpoints": checkpoints}, per_item


def test_the_closing_line_says_when_training_moved_nothing_and_where_learning_is_shown() -> None:
    from training.evaluation.evaluate import LEARNING_DOC, closing_line

    evaluation, per_item = _run({"base": [0] * 8, "phase-0": [0] * 8, "phase-1": [0] * 8})
    line = closing_line(evaluation, per_item)
    assert "base 0% [0%-0%]" in line and "phase-1 vs base: success +0.0 points" in line
    assert "no measurable change" in line and LEARNING_DOC in line


def test_the_closing_line_compares_the_last_phase_with_the_warm_start_paired() -> None:
    from training.evaluation.evaluate import closing_line, training_effect

    wins = [1] * 30 + [0] * 30
    better = [1] * 50 + [0] * 10  # the same items, 20 more solved
    evaluation, per_item = _run({"base": [0] * 60, "warm-0-sft": wins, "phase-0": better})
    effect = training_effect(evaluation["checkpoints"], per_item)
    assert effect["start"] == "warm-0-sft" and effect["verdict"] == "improved"
    assert effect["success"]["diff"] == pytest.approx(20 / 60) and effect["success"]["ci95"][0] > 0
    line = closing_line(evaluation, per_item)
    assert "warm-0-sft 50%" in line and "phase-0 vs warm-0-sft: success +33.3 points" in line
    assert "improved" in line and "too small" not in line
    evaluation, per_item = _run({"base": better, "phase-0": wins})
    worse = training_effect(evaluation["checkpoints"], per_item)
    assert worse["verdict"] == "worse" and worse["success"]["ci95"][1] < 0


def test_eval_sub_tasks_choose_the_test_and_gate_items_and_an_unknown_one_names_the_key() -> None:
    from envs.splits import load_split
    from training.evaluation.eval_stage import test_items
    from training.settings.config import ConfigError, EvalConfig

    every = test_items("babyai", EvalConfig(items=12))
    assert len({r["sub_task"] for r in every}) > 1  # round-robin over the sub-tasks
    goto = test_items("babyai", EvalConfig(sub_tasks=["GoTo"]))
    assert goto == [r for r in load_split("babyai", "test") if r["sub_task"] == "GoTo"] and len(goto) == 25
    assert [r["item_id"] for r in test_items("babyai", EvalConfig(items=5, sub_tasks=["GoTo"]))] == \
        [r["item_id"] for r in goto[:5]]
    gate = test_items("babyai", EvalConfig(items=4, sub_tasks=["GoTo", "Open"]), "gate")
    assert len(gate) == 4 and {r["sub_task"] for r in gate} == {"GoTo", "Open"}
    with pytest.raises(ConfigError, match=r"eval.<profile>.envs.babyai.sub_tasks \['Fly'\]"):
        test_items("babyai", EvalConfig(sub_tasks=["Fly"]))


def test_the_chat_answer_cache_survives_a_line_torn_by_a_kill(tmp_path) -> None:
    from training.engines.chat_engine import ResponseCache

    path = tmp_path / "cache.jsonl"
    path.write_text('{"key": "a", "text": "x"}\n{"key": "b", "te')  # killed mid-write
    ResponseCache(path).put("c", {"text": "y"})
    again = ResponseCache(path)
    assert again.get("a")["text"] == "x" and again.get("c")["text"] == "y" and again.get("b") is None

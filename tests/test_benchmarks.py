"""`make bench`'s page: a partial rerun (--only) replaces its own rows and keeps the others, their dates and the
note."""

from __future__ import annotations

import pytest

from benchmarks.run_all import existing, write


def test_the_benchmarks_page_reads_back_what_it_wrote(tmp_path) -> None:
    rows = [{"name": f"bench {i}", "figure": f"{i} steps/s<br>more", "target": ">= 1", "command": f"python b{i}.py",
             "date": f"2026-12-0{i + 1}", "seconds": str(i), "load": "1.0 -> 1.1"} for i in range(3)]
    page = tmp_path / "benchmarks.md"
    write(rows, page, "Ran beside the study.")
    again, note = existing(page)
    assert again == rows and note == "Ran beside the study."
    write(rows, page)
    assert existing(page) == (rows, "")


def test_a_page_from_before_the_date_column_gives_its_rows_the_pages_date(tmp_path) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nWritten by `make bench` on 2026-12-03: x86_64.\n\n"
                    "| benchmark | figure | target | command | seconds | load |\n|---|---|---|---|---|---|\n"
                    "| bench | 5 steps/s | >= 1 | `python b.py` | 7 | 0.1 -> 0.2 |\n")
    rows, _ = existing(page)
    assert rows == [{"name": "bench", "figure": "5 steps/s", "target": ">= 1", "command": "python b.py",
                     "date": "2026-12-03", "seconds": "7", "load": "0.1 -> 0.2"}]


def test_the_seed_and_item_interval_is_wider_than_the_items_alone_when_seeds_disagree() -> None:
    from benchmarks.grpo_ablation import seed_item_ci
    from training.evaluation.evaluate import paired_difference_ci

    # three seeds' paired differences on the same 200 items: +10, +10 and -6 points
    diffs = [[1.0] * 20 + [0.0] * 180, [1.0] * 20 + [0.0] * 180, [-1.0] * 12 + [0.0] * 188]
    mean, low, high = seed_item_ci(diffs)
    assert mean == pytest.approx(28 / 600)
    pooled = [sum(col) / 3 for col in zip(*diffs, strict=True)]
    _, item_low, item_high = paired_difference_ci([0.0] * 200, pooled)
    assert low < item_low and high > item_high  # the seed spread is in the interval, not hidden by averaging
    assert seed_item_ci([[1.0] * 50]) == (1.0, 1.0, 1.0)


def test_the_shipped_guard_trips_on_the_studys_collapse_and_on_none_of_its_healthy_runs() -> None:
    """benchmarks/guard_replay.py feeds the curriculum study's logged steps through the guard as params.yaml ships
    it: the one collapse (fixed h=20 seed 0, its context budget cutting 30 of 32 trajectories) trips it by the cut
    share, a context-budget cut counting as a cut; the seven healthy runs do not; the guard before (turn-cap cuts
    alone, a reward drop of 0.5) misses the collapse."""
    import json

    from benchmarks.guard_replay import STUDY, replay, shipped_config, step_stats, table

    rows = table(shipped_config())
    assert len(rows) == 8
    tripped = {r["run"]: r["trip"] for r in rows if r["trip"] is not None}
    assert list(tripped) == ["fixed-20-s0"]
    assert tripped["fixed-20-s0"]["signal"] == "rollout/truncated_share" and tripped["fixed-20-s0"]["step"] == 15
    assert step_stats({"reward": 0.1, "done": 2, "context_cap": 30})["rollout/termination/context_cap"] == 30
    collapse = json.loads((STUDY / "fixed-20-s0.json").read_text())["train"]["rows"]
    turn_cap_only = [{k: v for k, v in r.items() if k != "context_cap"} | (
        {"done": r.get("done", 0) + r.get("context_cap", 0)} if "reward" in r else {}) for r in collapse]
    assert replay(turn_cap_only, shipped_config().model_copy(update={"max_reward_drop": 0.5})) is None
    # the windowed reward's fall alone trips on the collapse too, and on no healthy run
    reward_only = shipped_config().model_copy(update={"max_truncated_rise": None})
    assert [r["run"] for r in table(reward_only) if r["trip"]] == ["fixed-20-s0"]

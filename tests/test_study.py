"""The curriculum study's machinery (benchmarks/curriculum_study.py): each arm a DVC experiment of its own
workspace, resumable, its figures collected and summarised; the report's "Curriculum study" section in Chromium."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.curriculum_report import markdown, summarise
from benchmarks.curriculum_study import PARAMS, PARAMS_V2, run

SMALL = {**PARAMS,
         "task": {"max_expert_turns": 2, "sft_items": 16, "eval_items": 12, "curve_items": 6},
         "warm": {"epochs": 1, "lr": 1.0e-3, "batch_size": 8},
         "pilot": {"caps": [1, 2], "items": 6},
         "train": {**PARAMS["train"], "batch_items": 2, "n_samples": 2, "mini_batch_size": 4, "micro_batch_size": 4,
                   "save_every": 1},
         "eval": {"h": 2, "batch_items": 12, "curve_items": 6}}
SPECS = {"fixed-1": {"schedule": [[1, 2]], "adaptive": False},
         "grow": {"schedule": [[1, 1], [2, 1]], "adaptive": False}}


def test_each_arm_is_a_dvc_experiment_with_its_figures_and_a_rerun_skips_what_is_done(tmp_path, tiny_model_dir,
                                                                                       monkeypatch) -> None:
    monkeypatch.setenv("SCALINGINTER_STUDY_BASE", str(tiny_model_dir))  # the stages' DVC subprocesses read it
    workspace, docs = tmp_path / "ws", tmp_path / "docs"
    run(workspace, [0], list(SPECS), docs=docs, params=SMALL, specs=SPECS)
    dvc = str(Path(sys.executable).parent / "dvc")
    shown = json.loads(subprocess.run([dvc, "exp", "show", "--json"], cwd=workspace, capture_output=True, text=True,
                                      check=True).stdout)
    exps = {e["name"]: e for row in shown for e in (row.get("experiments") or []) for e in e["revs"]}
    assert {"fixed-1-s0", "grow-s0"} <= set(exps)
    params = exps["grow-s0"]["data"]["params"]["params.yaml"]["data"]["arm"]
    assert params["schedule"] == [[1, 1], [2, 1]] and params["name"] == "grow"
    metrics = exps["grow-s0"]["data"]["metrics"]
    assert any(path.endswith("eval.json") for path in metrics)
    for key in ("fixed-1-s0", "grow-s0"):
        figures = json.loads((docs / f"{key}.json").read_text())
        assert figures["train"]["steps"] == 2 and len([r for r in figures["train"]["rows"] if "step" in r]) == 2
        assert len(figures["eval"]["held_out"]["per_item"]) == 12
        assert figures["lineage"]["warm"] and figures["lineage"]["train"]
    grow = json.loads((docs / "grow-s0.json").read_text())
    assert [r["h"] for r in grow["train"]["rows"] if "step" in r] == [1, 2]
    assert len(grow["eval"]["curve"]) == 1  # the first phase's end, on the curve items
    warm = json.loads((docs / "warm.json").read_text())
    assert set(warm["by_cap"]) == {"1", "2"} and warm["held_out"]["items"] == 12
    before = (docs / "grow-s0.json").read_text()
    run(workspace, [0], list(SPECS), docs=docs, params=SMALL, specs=SPECS)  # resumes: nothing left to run
    assert (docs / "grow-s0.json").read_text() == before
    summary = summarise(docs)
    assert [r["arm"] for r in summary["table"]] == ["fixed-1", "grow"]
    assert "| grow | 1 | 2 |" in markdown(summary)


def test_the_redone_study_evaluates_sampled_beside_greedy_and_draws_its_curve_from_the_kept_checkpoints(
        tmp_path, tiny_model_dir, monkeypatch) -> None:
    """Issue 46's study (``--study v2``): the final policy greedy and sampled at T = 1 on the held-out items, the
    warm start the same, and a curve point for every checkpoint kept every ``save_every`` steps; the training's
    context budget reaches the evaluation."""
    monkeypatch.setenv("SCALINGINTER_STUDY_BASE", str(tiny_model_dir))
    small = {**PARAMS_V2, "task": SMALL["task"], "warm": SMALL["warm"], "pilot": SMALL["pilot"],
             "train": {**PARAMS_V2["train"], "batch_items": 2, "n_samples": 2, "mini_batch_size": 4,
                       "micro_batch_size": 4, "save_every": 1, "context_budget": 1024},
             "eval": {**PARAMS_V2["eval"], "h": 2, "batch_items": 12, "curve_items": 6}}
    specs = {"fixed-2": {"schedule": [[2, 3]], "adaptive": False}}
    docs = tmp_path / "docs"
    run(tmp_path / "ws", [0], ["fixed-2"], docs=docs, params=small, specs=specs)
    figures = json.loads((docs / "fixed-2-s0.json").read_text())
    evaluation = figures["eval"]
    assert len(evaluation["held_out"]["per_item"]) == len(evaluation["sampled"]["per_item"]) == 12
    # steps 1 and 2 kept (step 3 is the final): two curve points at their own steps, on the curve items
    assert [(p["global_step"], p["items"]) for p in evaluation["curve"]] == [(1, 6), (2, 6)]
    warm = json.loads((docs / "warm.json").read_text())
    assert warm["sampled"]["items"] == warm["held_out"]["items"] == 12
    manifest = json.loads((tmp_path / "ws/arms/fixed-2-s0/phases/phase-0/final/manifest.json").read_text())
    assert manifest["config"]["context_budget"] == 1024
    # the curve's points are the kept checkpoints' weights, without their optimizer state (SmolLM2's would be ~1 GB
    # a point), each verified and naming the checkpoint it was copied from
    from training.checkpoint import read_manifest

    points = sorted((tmp_path / "ws/arms/fixed-2-s0/phases/phase-0/curve").iterdir())
    assert [p.name for p in points] == ["step-000001", "step-000002"]
    for point in points:
        assert not list(point.glob("optimizer_rank*.pt")) and not (point / "trainer_state.pt").exists()
        assert read_manifest(point, verify=True)["weights_of"]


def _fake_arm(docs: Path, arm: str, seed: int, per_item: dict[str, int], tokens: float) -> None:
    rows = [{"phase": 0, "step": s, "h": 2, "success": 0.1 * s, "tokens": tokens / 4, "cumulative_tokens": tokens *
             (s + 1) / 4, "seconds": 1.0, "turns": 1.5, "done": 3.0, "turn_cap": 1.0, "context_cap": 0.0}
            for s in range(4)] + [{"phase": 0, "global_step": 4, "success": 0.5, "items": 10}]  # a held-out row
    held = {"success": sum(per_item.values()) / len(per_item), "ci": [0.1, 0.9], "items": len(per_item),
            "turns_mean": 2.0, "termination": {"done": len(per_item)}, "by_expert_turns": {"expert_1_turns": 0.5},
            "per_item": per_item}
    docs.mkdir(parents=True, exist_ok=True)
    (docs / f"{arm}-s{seed}.json").write_text(json.dumps({
        "arm": arm, "seed": seed, "train": {"steps": 4, "generated_tokens": tokens, "wall_seconds": 10.0, "rows": rows},
        "eval": {"curve": [{"phase": 0, "global_step": 2, "success": 0.4}], "held_out": held}}))


def test_the_summary_pairs_items_and_prices_the_tokens(tmp_path) -> None:
    docs = tmp_path / "docs"
    items = [f"babyai_{i}" for i in range(40)]
    warm = {i: int(n < 10) for n, i in enumerate(items)}
    (tmp_path / "docs").mkdir()
    (docs / "warm.json").write_text(json.dumps({"by_cap": {"2": {"success": 0.25, "ci": [0.1, 0.4], "turns_mean": 2,
                                                                  "termination": {}, "seconds": 1}},
                                                "held_out": {"success": 0.25, "ci": [0.1, 0.4], "items": 40,
                                                             "by_expert_turns": {}, "per_item": warm}}))
    for seed in (0, 1):
        _fake_arm(docs, "scaling", seed, {i: int(n < 30) for n, i in enumerate(items)}, 600.0)
        _fake_arm(docs, "fixed-20", seed, {i: int(n < 20) for n, i in enumerate(items)}, 1000.0)
    summary = summarise(docs)
    rows = {r["arm"]: r for r in summary["table"]}
    assert rows["scaling"]["success"] == pytest.approx(0.75) and rows["fixed-20"]["success"] == pytest.approx(0.5)
    assert rows["scaling"]["vs_warm"][0] == pytest.approx(0.5) and rows["scaling"]["vs_warm"][1] > 0
    [pair] = [p for p in summary["pairs"] if (p["a"], p["b"]) == ("scaling", "fixed-20")]
    assert pair["diff"] == pytest.approx(0.25) and pair["ci"][0] > 0
    assert summary["cost_ratio_scaling_vs_fixed_large"] == pytest.approx(0.6)
    text = markdown(summary)
    assert "0.60x the rollout tokens" in text and "+25.0" in text
    # per phase, both seeds' steps together: length and what ended the trajectories (held-out rows left out)
    assert "| ScalingInter 2/6/10 | 0 (h=2) | 8 | 1.50 | 75.0% | 25.0% | 0.0% |" in text


@pytest.mark.browser
def test_the_report_draws_the_curriculum_study(tmp_path) -> None:
    from playwright.sync_api import sync_playwright

    from tests.test_report import CHROMIUM, FLAGS
    from training.evaluation.report import render, report_data

    test_the_summary_pairs_items_and_prices_the_tokens(tmp_path)
    data = report_data(["babyai"])
    data["study"] = {**summarise(tmp_path / "docs"), "statement": "What was shown: a test."}
    page_file = tmp_path / "report.html"
    page_file.write_text(render(data))
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(page_file.as_uri())
        assert page.is_visible("#study")
        charts = page.locator("#study-charts svg")
        assert charts.count() == 3
        for i in range(3):
            assert charts.nth(i).locator("polyline").count() == 2  # one line per arm
        assert page.locator("#study-table tr").count() == 3
        assert "0.60x" in page.text_content("#study-cost")
        assert page.text_content("#study-statement") == "What was shown: a test."
        browser.close()
    assert errors == []

"""The HTML report in a real headless Chromium: explorer vectors A and B, bar widths, no console errors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from envs.launcher import ROOT
from training.evaluation.report import render, report_data

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run"]


def _eval(success: list[float]) -> dict:
    names = ["base"] + [f"phase-{i}" for i in range(len(success) - 1)]
    return {"env": "babyai", "h": 6, "k": 2, "temperature": 1.0, "seed": 0, "items": 10, "max_new_tokens": 24,
            "checkpoints": {n: {"success": s, "success_ci95": [max(0, s - 0.1), min(1, s + 0.1)], "avg_at_k": s,
                                "pass_at_k": s, "items": 10, "hash": "ab" * 32,
                                "sub_tasks": {"GoTo": {"items": 10, "success": s}}}
                            for n, s in zip(names, success, strict=True)}}


@pytest.fixture
def page_file(tmp_path) -> tuple[Path, dict]:
    data = report_data(["babyai"])
    data["results"]["babyai"]["eval"] = _eval([0.1, 0.2, 0.3, 0.45])  # this project's rows: every checkpoint
    data["results"]["babyai"]["outside"] = {"gpt-x": {"model": "gpt-x", "api": "chat", "success": 0.6,
                                                      "success_ci95": [0.5, 0.7], "items": 10}}
    path = tmp_path / "report.html"
    path.write_text(render(data))
    return path, data


@pytest.mark.browser
def test_report_in_headless_chromium(page_file, tmp_path) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (make test installs it)")
    from playwright.sync_api import sync_playwright

    path, data = page_file
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: None if r.url.startswith("file:") else errors.append(f"network: {r.url}"))
        page.goto(path.as_uri())
        # curriculum explorer: vectors A and B through the controls
        vectors = (("deepsearch", 1, 1, 100, 350, "4"), ("textcraft", 2, 2, 150, 400, "6"))
        for env, h1, dh, every, t, expected in vectors:
            page.select_option("#env", env)
            for control, value in (("h1", h1), ("dh", dh), ("every", every), ("t", t)):
                page.fill(f"#{control}-num", str(value))
            assert page.text_content("#h-value") == expected
            assert page.input_value(f"#{'t'}") == str(t)  # slider follows the number box
        assert "cap 4" not in page.text_content("#cap")  # the cap follows the environment (TextCraft 20)
        # bars: width = value % of the 0-100 axis, sorted high to low, per tab
        for env in ("webarena", "deepsearch", "textcraft", "babyai", "sciworld"):
            page.click(f"#tabs button[data-env={env}]")
            bars = page.eval_on_selector_all(
                "#bars .bar", "els => els.map(e => [Number(e.dataset.value), e.getBoundingClientRect().width, "
                "e.parentElement.getBoundingClientRect().width, e.dataset.label])")
            paper = data["paper"]["overall"][env]
            expected = sorted([*paper.values(), *([10.0, 20.0, 30.0, 45.0, 60.0] if env == "babyai" else [])],
                              reverse=True)
            assert [round(b[0], 2) for b in bars] == [round(v, 2) for v in expected]
            for value, width, track, label in bars:
                assert width / track == pytest.approx(value / 100, abs=0.005), label
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        shutil.copy(tmp_path / "report.png", Path(os.environ.get("SCALINGINTER_SCREENSHOT", tmp_path / "copy.png")))
        page.click("#tabs button[data-env=babyai]")
        outside = page.locator("#bars .bar-row", has_text="gpt-x (outside model, chat API, measured here)")
        assert outside.locator(".num").text_content() == "60.00 [50-70]"
        # the environment section lists every checkpoint
        assert page.locator("#env-babyai table").first.locator("tr").count() == 5
        browser.close()
    assert (tmp_path / "report.png").stat().st_size > 10_000
    assert errors == []


def test_report_embeds_the_paper_numbers_and_escapes_script_tags(tmp_path) -> None:
    data = report_data(["babyai"])
    assert data["paper"]["overall"]["babyai"]["ScalingInter-7B"] == 96.67
    data["results"]["babyai"]["lineage"]["error"] = "</script><script>alert(1)</script>"
    html = render(data)
    blob = html.split("const DATA = ", 1)[1].split(";\n", 1)[0]
    assert "</script>" not in blob and json.loads(blob)["results"]["babyai"]["lineage"]["error"].startswith("</")


def test_the_report_takes_every_outside_models_evaluation_and_not_its_answer_cache(tmp_path) -> None:
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    folder = tmp_path / "runs" / "babyai" / "eval" / "outside"
    folder.mkdir(parents=True)
    (folder / "gpt-x.json").write_text(json.dumps({"model": "gpt-x", "api": "chat", "success": 0.25,
                                                   "success_ci95": [0.1, 0.4], "items": 6}))
    (folder / "gpt-x.cache.jsonl").write_text('{"key": "k", "text": "Action: turn left"}\n')
    outside = report_data(["babyai"], tmp_path)["results"]["babyai"]["outside"]
    assert list(outside) == ["gpt-x"] and outside["gpt-x"]["success"] == 0.25


def test_every_door_of_the_report_writes_the_same_spec(monkeypatch, tmp_path) -> None:
    """One door per stage kind: the report command (what the DVC stage ``<env>_report`` runs) and the Prefect task
    write the report of the same spec; an unknown environment is refused by name, before anything is written."""
    from typer.testing import CliRunner

    import tasks.pipeline
    import training.evaluation.report as report_module
    from flows.cli import app
    from training.settings.config import ConfigError
    from training.settings.specs import report_spec

    written = []
    monkeypatch.setattr(report_module, "write_report", lambda spec: written.append(spec) or spec.out)
    monkeypatch.setattr(tasks.pipeline, "run_stage", lambda root, stage, work=None, **kw: work())
    monkeypatch.chdir(tmp_path)  # the task's stage runs in the working copy it is given (here: the cwd)
    monkeypatch.setattr(tasks.pipeline, "project_root", lambda: tmp_path)
    monkeypatch.setattr("envs.paths.project_root", lambda: tmp_path)
    done = CliRunner().invoke(app, ["report", "babyai"])
    assert done.exit_code == 0, done.output
    tasks.pipeline.build_report.fn("babyai")
    assert len(written) == 2
    cli, task = written
    assert cli.envs == task.envs == ["babyai"]
    assert cli.out.resolve() == task.out.resolve() == (tmp_path / "reports/babyai.html").resolve()
    assert report_spec(["babyai", "mixed"], tmp_path).out == tmp_path / "reports/index.html"
    with pytest.raises(ConfigError, match=r"unknown environment.*babyia"):
        report_spec(["babyia"], tmp_path)
    done = CliRunner().invoke(app, ["report", "babyia"])
    assert done.exit_code != 0 and "babyia" in done.output and len(written) == 2
    with pytest.raises(ConfigError, match="no run under"):
        report_spec(None, tmp_path)

"""One policy over several environments (issue 20): a two-phase mixed curriculum over BabyAI, TextCraft and
Deep Search with the tiny policy; per-environment metrics and caps, evaluation per environment, lineage; a
failing environment stops the phase instead of training on the others alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from envs.launcher import ROOT, start_server, stop_server
from envs.splits import load_split
from envs.urls import ServerUrls
from training.checkpoint import checkpoint_hash, read_manifest
from training.evaluation.evaluate import evaluate
from training.phases.data import MixedData
from training.phases.mixed import allocation, shares
from training.phases.trainer import PhaseTrainer, train_phase
from training.sampler import EnvironmentFailure
from training.settings.config import MixShare, TrainConfig

ENVS = "babyai,textcraft,deepsearch"
CONFIG = TrainConfig(batch_items=4, n_samples=2, max_new_tokens=8, lr=1e-4, mini_batch_size=8, micro_batch_size=4,
                     failed_rollout_retries=1,
                     mix={"babyai": MixShare(weight=2, sub_tasks=["GoTo"]), "textcraft": MixShare(max_h=3)})


def test_items_are_split_by_weight_every_step_and_bad_mixes_are_refused() -> None:
    assert allocation({"babyai": 2, "textcraft": 1, "deepsearch": 1}, 4) == {"babyai": 2, "textcraft": 1,
                                                                             "deepsearch": 1}
    assert allocation({"a": 1, "b": 3}, 10) == {"a": 3, "b": 7}
    data = MixedData(ENVS.split(","), CONFIG)
    first, second = data.take(4), data.take(4)
    assert [i.split(":")[0] for i in first] == ["babyai", "babyai", "textcraft", "deepsearch"]
    assert first != second and data.position == 8
    again = MixedData(ENVS.split(","), CONFIG, position=4)  # a resumed run takes the same next step
    assert again.take(4) == second
    with pytest.raises(ValueError, match="raise batch_items to at least 3"):
        allocation({"a": 1, "b": 1, "c": 1}, 2)
    with pytest.raises(ValueError, match=r"train.mix names \['sciworld'\]"):
        shares(["babyai"], TrainConfig(mix={"sciworld": MixShare()}))
    with pytest.raises(ValueError, match="no environment server URL for deepsearch"):
        ServerUrls.parse("babyai=http://a;textcraft=http://b", ENVS.split(","))


def test_the_three_forms_of_server_urls_parse_into_one_value_and_back() -> None:
    envs = ENVS.split(",")
    one = ServerUrls.parse(" http://a:1/ , http://b:2", ["babyai"])  # replicas of one environment
    assert one.replicas() == ("http://a:1", "http://b:2") and one.text() == "http://a:1,http://b:2"
    assert ServerUrls.parse("babyai=http://a:1", ["babyai"]).replicas("babyai") == ("http://a:1",)
    assert ServerUrls.parse(["http://a:1"], ["babyai"]) == ServerUrls.parse("http://a:1", ["babyai"])
    mixed = ServerUrls.parse("textcraft=http://t:1;babyai=http://a:1,http://a:2;deepsearch=http://d:1", envs)
    assert mixed.replicas("babyai") == ("http://a:1", "http://a:2") and list(mixed.servers) == envs
    assert ServerUrls.parse(mixed.text(), envs) == mixed  # the text a subprocess is given reads back the same
    assert ServerUrls.parse({"babyai": "http://a:1", "textcraft": ["http://t:1"], "deepsearch": "http://d:1"},
                            envs).replicas("textcraft") == ("http://t:1",)
    with pytest.raises(ValueError, match="a mixed run takes ENV=URL pairs"):
        ServerUrls.parse("http://a:1", envs)
    with pytest.raises(ValueError, match="'webarena=http://w:1'"):
        ServerUrls.parse("babyai=http://a;webarena=http://w:1", envs)
    with pytest.raises(ValueError, match="no environment server URL for babyai"):
        ServerUrls.parse(" , ", ["babyai"])
    with pytest.raises(ValueError, match="name one"):
        mixed.replicas()



def test_settings_of_the_other_kind_of_run_are_refused_before_any_work(tmp_path) -> None:
    """A mixed run's mix on one environment, one environment's sub_tasks or items on a mixed run: an error naming
    them, raised before a server is asked or a folder written (they were accepted and ignored)."""
    nowhere = "http://127.0.0.1:9"  # no server: the check comes first
    with pytest.raises(ValueError, match=r"train.mix \(babyai\) shares the steps of a mixed run.*babyai alone"):
        train_phase("babyai", 0, 2, 1, tmp_path / "no-model", tmp_path / "single", url=nowhere,
                    config=TrainConfig(mix={"babyai": MixShare(max_h=3, sub_tasks=["GoTo"])}))
    with pytest.raises(ValueError, match=r"train.sub_tasks chooses one environment's items.*train.mix.<env>"):
        train_phase(ENVS, 0, 2, 1, tmp_path / "no-model", tmp_path / "mixed", url=nowhere,
                    config=TrainConfig(batch_items=3, sub_tasks=["GoTo"]))
    with pytest.raises(ValueError, match=r"train.items chooses one environment"):
        train_phase(ENVS, 0, 2, 1, tmp_path / "no-model", tmp_path / "mixed", url=nowhere,
                    config=TrainConfig(batch_items=3, items=["babyai-0"]))
    assert not (tmp_path / "single").exists() and not (tmp_path / "mixed").exists()


def _metrics(phase: Path) -> dict:
    return json.loads((phase / "dvclive" / "metrics.json").read_text())


@pytest.mark.slow
def test_a_two_phase_mixed_curriculum_over_three_environments(env_server, tiny_model_dir, tmp_path) -> None:
    urls = {e: env_server(e) for e in ENVS.split(",")}
    final0 = train_phase(ENVS, 0, 2, 2, tiny_model_dir, tmp_path / "phase-0", config=CONFIG, url=urls)
    final1 = train_phase(ENVS, 1, 4, 2, final0, tmp_path / "phase-1", config=CONFIG,
                         url=";".join(f"{e}={u}" for e, u in urls.items()))  # the CLI's form
    # lineage: one policy, phase 1 starts from phase 0's final
    m0, m1 = read_manifest(final0), read_manifest(final1)
    assert m1["parent"] == checkpoint_hash(final0) and (m1["env"], m1["h"], m1["global_step"]) == (ENVS, 4, 4)
    assert m1["config"]["mix"]["textcraft"]["max_h"] == 3 and m0["phase_first_step"] == 0
    # per-environment metrics and caps: textcraft's h is clipped to its own cap of 3 in phase 1
    metrics = _metrics(tmp_path / "phase-1")
    for env in ENVS.split(","):
        assert {"reward", "success", "turns", "rollout", "env", "curriculum"} <= set(metrics[env]), env
        assert "termination" in metrics[env]["rollout"] and "errors" in metrics[env]["env"]
    assert (metrics["babyai"]["curriculum"]["h"], metrics["textcraft"]["curriculum"]["h"],
            metrics["deepsearch"]["curriculum"]["h"]) == (4, 3, 4)
    assert _metrics(tmp_path / "phase-0")["textcraft"]["curriculum"]["h"] == 2
    rows = [json.loads(line) for line in (tmp_path / "phase-1" / "rollouts" / "step-000002.jsonl").open()]
    assert sorted({r["item_id"].split(":")[0] for r in rows}) == sorted(ENVS.split(","))
    assert max(r["turns"] for r in rows if r["item_id"].startswith("textcraft:")) <= 3
    # evaluation per environment, of the one final policy
    for env, url in urls.items():
        ids = [r["item_id"] for r in load_split(env, "test")[:2]]
        result = evaluate(final1, env, url, ids, h=2, max_new_tokens=8)
        assert set(result.success) == set(ids), env


def test_a_failing_environment_stops_the_mixed_phase_naming_it(env_server, tiny_model_dir, tmp_path) -> None:
    url, proc = start_server("textcraft")
    urls = {"babyai": env_server("babyai"), "textcraft": url, "deepsearch": env_server("deepsearch")}
    try:
        trainer = PhaseTrainer(ENVS, 0, 2, 2, tiny_model_dir, tmp_path, CONFIG, urls)
    finally:
        stop_server(proc)  # textcraft's server dies; babyai's and deepsearch's answer
    with pytest.raises(EnvironmentFailure, match=r"every trajectory of textcraft hit environment errors in 2 tries"
                                                 r".*does not train on the other environments alone"):
        trainer.run()
    assert not (tmp_path / "final").exists()


@pytest.mark.slow
def test_the_cli_trains_a_mixed_phase_on_servers_it_starts_and_stops(tiny_model_dir, tmp_path) -> None:
    cmd = [sys.executable, "-m", "flows.cli", "train-phase", "babyai,textcraft", "--h", "2", "--steps", "1",
           "--init", str(tiny_model_dir), "--out", str(tmp_path / "p"), "--set", "batch_items=2", "--set",
           "n_samples=2", "--set", "max_new_tokens=8", "--set", "mini_batch_size=4", "--set", "micro_batch_size=4",
           "--set", 'mix={"babyai": {"sub_tasks": ["GoTo"]}, "textcraft": {"max_h": 1}}']
    env = {k: v for k, v in os.environ.items() if k != "SCALINGINTER_ENV_URL"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = _metrics(tmp_path / "p")
    assert (metrics["babyai"]["curriculum"]["h"], metrics["textcraft"]["curriculum"]["h"]) == (2, 1)
    assert read_manifest(tmp_path / "p" / "final")["env"] == "babyai,textcraft"
    bad = subprocess.run([*cmd[:4], "babyai,textcraf", *cmd[5:]], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown environment 'textcraf'" in bad.stdout + bad.stderr


@pytest.mark.slow
@pytest.mark.browser
def test_the_main_job_runs_a_mixed_curriculum_over_three_environments(tmp_path) -> None:
    """`scalinginter run --env babyai,textcraft,deepsearch`: the pipeline's mixed run (two one-step phases), its
    servers provisioned and torn down by the flow, evaluated per environment, reported, lineage intact."""
    from tests.test_pipeline import _sh, _workspace

    work = _workspace(tmp_path, envs="babyai", one_step_phases=1)  # and its evaluation: 2 items x 1 sample
    cmd = [str(Path(sys.executable).parent / "scalinginter"), "run", "--env", "babyai,textcraft,deepsearch",
           "--profile", "smoke", "--record", "none"]
    environ = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect"),
               "COLUMNS": "200"}
    environ.pop("SCALINGINTER_ENV_URL", None)
    done = subprocess.run(cmd, cwd=work, env=environ, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "done: 2 phases" in done.stdout
    manifest = read_manifest(work / "runs/mixed/phase-1/final")
    assert manifest["env"] == ENVS and manifest["parent"] == checkpoint_hash(work / "runs/mixed/phase-0/final")
    assert manifest["config"]["mix"]["deepsearch"]["max_h"] == 4  # its own cap, from curriculum.deepsearch.cap
    evaluation = json.loads((work / "runs/mixed/eval/metrics.json").read_text())
    assert set(evaluation["envs"]) == set(ENVS.split(","))
    for checkpoint in evaluation["checkpoints"].values():
        assert set(checkpoint["sub_tasks"]) == set(ENVS.split(","))  # each environment's own figures
    lock = (work / "dvc.lock").read_text()
    assert "mixed_phase_1" in lock and "mixed.envs" in lock  # the mixture is a param of the phases
    report = (work / "reports/mixed.html").read_text()
    assert "textcraft/success/rate" in report
    _renders_without_errors(work / "reports/mixed.html")
    assert "disagreement" not in _sh(work, "scalinginter", "lineage", "mixed")


def _renders_without_errors(path: Path) -> None:
    """The report in headless Chromium: no console or page errors, each environment's curves drawn."""
    from playwright.sync_api import sync_playwright

    from tests.test_report import CHROMIUM, FLAGS

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(path.as_uri())
        text = page.text_content("body") or ""
        browser.close()
    assert errors == []
    assert all(f"{e}/success/rate" in text for e in ENVS.split(",")), text[:2000]

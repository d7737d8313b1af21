"""The Prefect flow on the embedded API: the whole smoke curriculum, killed mid-phase and rerun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_pipeline import _ran, _sh, _workspace


def _phase_locks(work: Path) -> dict:
    import yaml

    from training.evaluation.lineage import lineage

    stages = yaml.safe_load((work / "dvc.lock").read_text())["stages"]
    records, problems, _ = lineage("babyai", work)
    assert problems == []
    # deps, params and the checkpoints' own hashes (their weights: manifests and dvclive files hold timings); the
    # splits, the base model and the evaluation whole (their outputs hold no timings)
    phases = {name: ([d for d in entry["deps"] if not d["path"].endswith("/final")], entry["params"])
              for name, entry in stages.items() if name.startswith("babyai_phase_")}
    evaluation = stages["babyai_eval"]
    whole = {name: stages[name] for name in ("splits@babyai", "build_model")}
    return phases, whole, ([d for d in evaluation["deps"] if not d["path"].endswith("/final")],
                           evaluation["params"], evaluation["outs"]), \
        [(r.stage, r.h, r.steps, r.parent, r.own) for r in records]


def _flow_cmd() -> list[str]:
    return [str(Path(sys.executable).parent / "scalinginter"), "run", "--env", "babyai", "--profile", "smoke"]


@pytest.mark.slow
def test_flow_runs_the_curriculum_and_a_killed_run_resumes(tmp_path) -> None:
    work = _workspace(tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect"), "COLUMNS": "200"}
    proc = subprocess.Popen(_flow_cmd(), cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    target = work / "runs/babyai/phase-1/intermediate/step-000003/manifest.json"  # inside phase 1 (steps 2..3)
    deadline = time.monotonic() + 1200  # ~1.5 min quiet
    while not target.exists():
        assert proc.poll() is None, "the flow ended before it could be killed"
        assert time.monotonic() < deadline, f"no {target.relative_to(work)} within 1200 s"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # the flow, its dvc repro and its training process
    proc.wait()
    assert not (work / "runs/babyai/phase-1/final").exists()
    done = subprocess.run(_flow_cmd(), cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "done: 3 phases" in done.stdout
    log = done.stdout + done.stderr
    assert "babyai_phase_0: up to date" in log and "babyai_phase_1: trained" in log  # finished phases skipped
    assert (work / "runs/babyai/eval/metrics.json").exists() and (work / "reports/babyai.html").exists()
    assert f"report: {work / 'reports/babyai.html'}" in done.stdout.splitlines()
    rows = (work / "runs/babyai/phase-1/dvclive/plots/metrics/reward/mean.tsv").read_text().splitlines()[1:]
    assert [r.split("\t")[0] for r in rows] == ["2", "3"]  # phase 1 resumed at step 3, logged once each
    assert "disagreement" not in _sh(work, "scalinginter", "lineage", "babyai")
    # every stage ran in the flow's process and was recorded by dvc commit (the splits, the base model and phase 0
    # in the killed run): plain DVC agrees with them
    # each phase went through its promotion gate, in the flow's process, and the run says what it hands back
    assert "gate 2: promoted:" in log and "the run hands back runs/babyai/" in done.stdout
    for stage in ("babyai_phase_2: trained", "babyai_gate_2: gated", "babyai_eval: ran", "babyai_report: ran"):
        assert f"{stage} (in process" in log, log[-3000:]
    for stage in ("splits@babyai", "build_model"):
        assert f"{stage}: up to date" in log
    assert "up to date" in _sh(work, "dvc", "status", "--with-deps", "babyai_report")
    assert not _ran(_sh(work, "dvc", "repro", "babyai_report"))
    # the README's `scalinginter eval` and `scalinginter export` on the finished run: the evaluation again gives the
    # stage's numbers bit for bit (so DVC still finds the pipeline up to date), and the export is the hand-back
    metrics = (work / "runs/babyai/eval/metrics.json").read_bytes()
    assert "metrics: runs/babyai/eval/metrics.json" in _sh(work, "scalinginter", "eval", "babyai")
    assert (work / "runs/babyai/eval/metrics.json").read_bytes() == metrics
    assert "up to date" in _sh(work, "dvc", "status", "--with-deps", "babyai_report")
    exported = _sh(work, "scalinginter", "export", "babyai", "--out", str(tmp_path / "final"))
    assert (tmp_path / "final/config.json").exists() and "## Promotion" in (tmp_path / "final/README.md").read_text()
    assert f"to {tmp_path / 'final'}" in exported and "exported babyai" in exported
    plain = _workspace(tmp_path, name="plain")  # (its splits run too where the committed lock is stale for them)
    assert {"build_model", "babyai_phase_2", "babyai_eval"} <= set(_ran(_sh(plain, "dvc", "repro", "babyai_eval")))
    assert _phase_locks(work) == _phase_locks(plain)  # same deps, params and bitwise equal outputs
    history = subprocess.run(["git", "log", "--format=%s"], cwd=work, capture_output=True, text=True).stdout
    assert "scalinginter babyai (smoke): 3 phases" in history

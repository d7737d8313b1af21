"""`prefect deployment run scalinginter/babyai` against a real local Prefect server and process worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from envs.launcher import PortTaken, free_port, wait_healthy
from tests.test_pipeline import _sh, _workspace

BIN = Path(sys.executable).parent


def _stop(proc: subprocess.Popen, signals: tuple[int, ...]) -> None:
    """Send each signal in turn (the worker ignores SIGTERM and stops after two SIGINTs); kill if still alive."""
    for sig in signals:
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # under 2x load; the steps below have their own, smaller budgets and clear messages
def test_prefect_deployment_run_babyai_end_to_end(tmp_path) -> None:
    # three one-step phases: this test is about the deployment path (server, worker, pull step, lineage
    # commit); the smoke run itself is tested once, in test_flow
    work = _workspace(tmp_path, one_step_phases=3)
    # the remotes a fresh worker starts from: git (a bare origin) and DVC (a storage folder)
    origin, store = tmp_path / "origin.git", tmp_path / "dvc-store"
    _sh(work, "dvc", "remote", "add", "-d", "store", str(store))
    _sh(work, "git", "commit", "-qam", "DVC remote")
    _sh(tmp_path, "git", "clone", "-q", "--bare", str(work), str(origin))
    _sh(work, "git", "remote", "add", "origin", str(origin))
    port = free_port()
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1", "COLUMNS": "200",
           "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "1",
           "SCALINGINTER_ROOT": str(work), "SCALINGINTER_GIT_URL": str(origin)}  # both read at deploy time
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, *cmd: str) -> subprocess.Popen:
        out = (logs / f"{name}.log").open("w")
        # the worker finds its working copy through the pull steps, not through the deploying copy's variables
        own = {k: v for k, v in env.items() if k not in ("SCALINGINTER_ROOT", "SCALINGINTER_GIT_URL")}
        return subprocess.Popen([str(BIN / "prefect"), *cmd], cwd=tmp_path if name == "worker" else work,
                                env=own if name == "worker" else env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def prefect(*cmd: str, timeout: float = 300) -> str:
        try:
            done = subprocess.run([str(BIN / "prefect"), *cmd], cwd=work, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as err:
            worker_log = logs / "worker.log"
            raise AssertionError(f"prefect {' '.join(cmd)} did not finish within {timeout:.0f} s; worker log:\n"
                                 f"{worker_log.read_text()[-3000:] if worker_log.exists() else '(no worker)'}"
                                 ) from err
        assert done.returncode == 0, f"prefect {' '.join(cmd)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout + done.stderr

    for attempt in range(3):  # another process may take the free port before the server binds it
        server = start("server", "server", "start", "--host", "127.0.0.1", "--port", str(port))
        try:
            wait_healthy(f"http://127.0.0.1:{port}/api", server, 180)  # ~15 s quiet
            break
        except PortTaken:
            _stop(server, (signal.SIGINT, signal.SIGTERM))
            if attempt == 2:
                raise
            port = free_port()
            env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
        except (RuntimeError, TimeoutError) as err:
            _stop(server, (signal.SIGINT, signal.SIGTERM))
            raise AssertionError(f"the Prefect server: {err}\n{(logs / 'server.log').read_text()[-3000:]}") from err
    worker = None
    try:
        prefect("work-pool", "create", "scalinginter-cpu", "--type", "process")
        deployed = prefect("--no-prompt", "deploy", "--all")
        for name in ("babyai", "textcraft", "sciworld", "webarena", "deepsearch", "babyai-from-git"):
            assert f"scalinginter/{name}" in deployed
        assert "scalinginter-follow/follow" in deployed  # the other nodes of a multi-node run (tests/test_strategy.py)
        worker = start("worker", "worker", "start", "--pool", "scalinginter-cpu")
        # deployment parameters reach DVC as params: the override lands in params.yaml and dvc.lock
        run = prefect("deployment", "run", "scalinginter/babyai", "-p", "profile=smoke", "-p",
                      'overrides={"train.smoke.lr": 2e-05}', "--watch", timeout=1200)  # ~2 min quiet
        assert "Completed" in run, run[-3000:]
        # a fresh worker: clone from git, dvc pull, rerun what another setting touches (the evaluation's seed:
        # the pulled checkpoints are up to date, so the phases do not train again), record the lineage in both remotes
        run = prefect("deployment", "run", "scalinginter/babyai-from-git", "-p", 'overrides={"eval.smoke.seed": 7}',
                      "--watch", timeout=1200)
        assert "Completed" in run, run[-3000:]
        worker_log = (logs / "worker.log").read_text()
        # the flow's own progress shows, not a transformers bar per checkpoint load and save
        assert "Loading weights" not in worker_log and "Writing model shards" not in worker_log, worker_log[-3000:]
        second = worker_log.split("Running 3 deployment pull step(s)", 1)
        assert len(second) == 2, worker_log[-3000:]
        for k in range(3):  # its phases came from the DVC remote
            assert f"babyai_phase_{k}: up to date" in second[1], second[1][-3000:]
    finally:
        if worker is not None:
            _stop(worker, (signal.SIGINT, signal.SIGINT))
        _stop(server, (signal.SIGINT, signal.SIGTERM))
    # the run happened in the deployed working copy: checkpoints, evaluation, report, lineage commit
    assert (work / "runs/babyai/phase-2/final/manifest.json").exists()
    assert (work / "runs/babyai/eval/metrics.json").exists() and (work / "reports/babyai.html").exists()
    history = subprocess.run(["git", "log", "--format=%s"], cwd=work, capture_output=True, text=True).stdout
    assert "scalinginter babyai (smoke): 3 phases" in history
    assert json.loads((work / "runs/babyai/phase-2/final/manifest.json").read_text())["config"]["lr"] == 2e-05
    locked = yaml.safe_load((work / "dvc.lock").read_text())["stages"]["babyai_phase_0"]["params"]["params.yaml"]
    assert float(locked["train.smoke"]["lr"]) == 2e-05
    committed = subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=work, capture_output=True, text=True).stdout
    assert "lr: 2.0e-05" in committed or "lr: 2e-05" in committed  # the lineage commit holds the setting
    # what the fresh worker left, seen from a third working copy with nothing but the two remotes
    third = tmp_path / "third"
    _sh(tmp_path, "git", "clone", "-q", str(origin), str(third))
    assert yaml.safe_load((third / "params.yaml").read_text())["eval"]["smoke"]["seed"] == 7
    _sh(third, "dvc", "pull")
    assert json.loads((third / "runs/babyai/phase-2/final/manifest.json").read_text())["config"]["lr"] == 2e-05
    evaluated = yaml.safe_load((third / "dvc.lock").read_text())["stages"]["babyai_eval"]  # evaluated again
    assert evaluated["params"]["params.yaml"]["eval.smoke"]["seed"] == 7
    first = yaml.safe_load((work / "dvc.lock").read_text())["stages"]["babyai_eval"]
    assert evaluated["outs"] != first["outs"] and evaluated["deps"] == first["deps"]  # same checkpoints
    assert "disagreement" not in _sh(third, "scalinginter", "lineage", "babyai")

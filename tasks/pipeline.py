"""The ScalingInter pipeline's Prefect tasks."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from prefect import task

from envs.paths import project_root
from envs.testing import start_server, stop_server
from flows.stage_runner import run_command, run_stage
from training.checkpoint import read_manifest


def _run(cmd: list[str], env: dict[str, str] | None = None) -> str:
    return run_command(cmd, project_root(), env)


@task(retries=3, retry_delay_seconds=[2, 5, 15])
def provision_env_server(env: str, options: dict[str, str | int] | None = None) -> tuple[str, int]:
    """Start the environment server (health-checked); returns (url, pid)."""
    url, proc = start_server(env, **(options or {}))
    _servers[proc.pid] = proc
    return url, proc.pid


_servers: dict[int, subprocess.Popen] = {}


@task
def teardown_env_server(pid: int) -> None:
    """Stop a server started by :func:`provision_env_server`."""
    proc = _servers.pop(pid, None)
    if proc is not None:
        stop_server(proc)


@task
def run_phase(env: str, index: int, url: str) -> dict:
    """Run (or skip, if up to date) the DVC stage of one phase against the provisioned server; in this warm
    process when only that stage is stale (``flows.stage_runner``), else through ``dvc repro``."""
    stage = f"{env}_phase_{index}"
    started = time.perf_counter()
    outcome = run_stage(project_root(), stage, url)
    seconds = time.perf_counter() - started
    manifest = read_manifest(project_root() / "runs" / env / f"phase-{index}" / "final")
    metrics_file = project_root() / "runs" / env / f"phase-{index}" / "dvclive" / "metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
    return {"stage": stage, "ran": outcome != "skipped", "how": outcome, "h": manifest["h"],
            "steps": manifest["steps"], "hash": manifest["hash"], "parent": manifest["parent"],
            "reward": metrics.get("reward", {}).get("mean"), "success": metrics.get("success", {}).get("rate"),
            "wall_seconds": manifest.get("cost", {}).get("wall_seconds"), "stage_seconds": round(seconds, 3)}


@task
def evaluate_run(env: str, url: str) -> dict:
    """Run (or skip, if up to date) the evaluation stage: base model and every phase checkpoint."""
    _run(["dvc", "repro", f"{env}_eval"], env={"SCALINGINTER_ENV_URL": url})
    return json.loads((project_root() / "runs" / env / "eval" / "metrics.json").read_text())


@task
def build_report(env: str) -> Path:
    """Run (or skip) the report stage; returns the HTML page."""
    _run(["dvc", "repro", f"{env}_report"])
    return project_root() / "reports" / f"{env}.html"


@task
def version(env: str, message: str) -> str:
    """Commit the run's lineage (dvc.lock) to git, and push artifacts when a DVC remote is configured."""
    root = project_root()
    if not (root / ".git").exists():
        return "not a git repository: nothing committed"
    _run(["git", "add", "dvc.lock", "phases.yaml", "dvc.yaml"])
    staged = subprocess.run(["git", "diff", "--cached", "--quiet"], cwd=root).returncode != 0
    if staged:
        _run(["git", "-c", "user.name=scalinginter", "-c", "user.email=pipeline@scalinginter.local", "commit",
              "-m", message])
    remotes = _run(["dvc", "remote", "list"]).strip()
    if remotes:
        _run(["dvc", "push"])
    return ("committed" if staged else "lineage unchanged") + (", pushed to the DVC remote" if remotes else "")

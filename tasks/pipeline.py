"""The ScalingInter pipeline's Prefect tasks."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from prefect import task

from envs.launcher import start_server, stop_server
from envs.paths import project_root
from tasks.stages import Outcome, run_command, run_stage
from training.checkpoint import read_manifest
from training.phases.phase import run_phase as train_one_phase
from training.settings.config import PolicyServerConfig, ServerConfig, base_model_dir, load_params
from training.settings.layout import Run
from training.settings.specs import phase_spec, warm_spec
from training.settings.warm import checkpoint_of


def _run(cmd: list[str], env: dict[str, str] | None = None, secret: bool = False) -> str:
    return run_command(cmd, project_root(), env, secret)


#: the Prefect Secret block that may hold the S3 remote's credentials (JSON: aws_access_key_id,
#: aws_secret_access_key, optionally aws_session_token)
S3_SECRET_BLOCK = "scalinginter-s3"


def remote_credentials() -> dict[str, str]:
    """Credentials for DVC's S3 remote as AWS_* variables of the dvc commands only: from the Prefect Secret block
    named by ``SCALINGINTER_S3_SECRET`` (default ``scalinginter-s3``) when it exists, else none (DVC then takes
    the environment's AWS_* variables or its own ``config.local``). They never reach a log or an artifact."""
    from prefect.blocks.system import Secret

    name = os.environ.get("SCALINGINTER_S3_SECRET", S3_SECRET_BLOCK)
    try:
        value = Secret.load(name).get()
    except ValueError:  # no such block
        return {}
    if isinstance(value, str):
        value = json.loads(value)
    missing = {"aws_access_key_id", "aws_secret_access_key"} - set(value)
    if missing:
        raise ValueError(f"Prefect Secret block {name!r} lacks {', '.join(sorted(missing))}")
    return {key.upper(): str(value[key]) for key in ("aws_access_key_id", "aws_secret_access_key",
                                                      "aws_session_token") if value.get(key)}


def push_artifacts() -> bool:
    """``dvc push`` to the configured DVC remote (credentials from :func:`remote_credentials`); False when no
    remote is configured."""
    if not _run(["dvc", "remote", "list"]).strip():
        return False
    _run(["dvc", "push"], env=remote_credentials(), secret=True)
    return True


def _say(stage: str, outcome: Outcome, verb: str = "ran") -> None:
    """Log how ``stage`` came up to date (``babyai_phase_1: trained (in process, recorded by dvc commit)``)."""
    how = {"in_process": f"{verb} (in process, recorded by dvc commit)", "subprocess": f"{verb} (dvc repro)"}
    print(f"{stage}: {how.get(outcome, 'up to date')}")


#: the servers the provision tasks started, by pid, with the function that stops each
_servers: dict[int, tuple[subprocess.Popen, Callable[[subprocess.Popen], None]]] = {}


@task(retries=3, retry_delay_seconds=[2, 5, 15])
def provision_env_server(env: str, server: ServerConfig) -> tuple[str, list[int]]:
    """Start ``env_server.replicas`` environment servers (health-checked) with params.yaml's ``env_server``;
    returns (their URLs comma-separated, their pids)."""
    kwargs = server.launch_kwargs()
    replicas = kwargs.pop("replicas")
    urls, pids = [], []
    try:
        for _ in range(replicas):
            url, proc = start_server(env, **kwargs)
            _servers[proc.pid] = (proc, stop_server)
            urls.append(url)
            pids.append(proc.pid)
    except BaseException:
        for pid in pids:
            proc, stop = _servers.pop(pid)
            stop(proc)
        raise
    return ",".join(urls), pids


@task
def write_data_splits(env: str) -> None:
    """Bring ``env``'s task splits (stage ``splits@<env>``) up to date, in this process when only they are stale."""
    from envs.registry import load_backend
    from envs.splits import write_splits

    seed = int(load_params(project_root() / "params.yaml").get("splits", {}).get("seed", 0))

    def work() -> None:
        backend = load_backend(env)
        try:
            write_splits(env, backend, seed=seed)
        finally:
            backend.shutdown()

    _say(f"splits@{env}", run_stage(project_root(), f"splits@{env}", work=work))


@task
def build_base_model() -> Path:
    """Bring the base model stage up to date (``build_model``: in this process when only it is stale, as
    :func:`run_phase` does); returns the model folder."""
    from training.model import build_base

    root = project_root()
    params = load_params(root / "params.yaml")
    folder = base_model_dir(params)  # models/<model.preset>, relative, as the stage writes it
    seed = int(params.get("model", {}).get("seed", 0))
    _say("build_model", run_stage(root, "build_model", work=lambda: print(build_base(folder.name, folder, seed))))
    return root / folder


@task(retries=3, retry_delay_seconds=[2, 5, 15])
def provision_policy_server(model_dir: Path, server: PolicyServerConfig, max_model_len: int,
                            lora_rank: int | None = None) -> tuple[str, list[int]]:
    """Start the vllm engine's servers (``server.replicas``, health-checked) on ``model_dir``; returns (their URLs
    comma-separated, their pids). Each phase and the evaluation load their own weights into them and verify them
    with the probe before sampling; with ``lora_rank`` (train.lora) a phase keeps its starting weights there and
    syncs its adapters in place."""
    from training.engines.vllm_server import start_vllm_replicas, stop_vllm

    url, procs = start_vllm_replicas(model_dir, server, max_model_len, lora_rank)
    for proc in procs:
        _servers[proc.pid] = (proc, stop_vllm)
    return url, [proc.pid for proc in procs]


@task
def teardown_server(pid: int) -> None:
    """Stop a server started by :func:`provision_env_server` or :func:`provision_policy_server`."""
    entry = _servers.pop(pid, None)
    if entry is not None:
        proc, stop = entry
        stop(proc)


@task
def run_phase(env: str, index: int, url: str, policy_url: str | None = None) -> dict:
    """Run (or skip, if up to date) the DVC stage of one phase against the provisioned servers; in this warm
    process when only that stage is stale (:mod:`tasks.stages`), else through ``dvc repro``."""
    stage = f"{env}_phase_{index}"
    started = time.perf_counter()
    outcome = run_stage(project_root(), stage, url, policy_url=policy_url,
                        work=lambda: train_one_phase(phase_spec(env, index, Path(".")), url, policy_url=policy_url))
    _say(stage, outcome, "trained")
    seconds = time.perf_counter() - started
    run = Run(env, root=project_root())
    manifest = read_manifest(run.final(index))
    metrics = json.loads(run.metrics(index).read_text()) if run.metrics(index).exists() else {}
    return {"stage": stage, "ran": outcome != "skipped", "how": outcome, "h": manifest["h"],
            "steps": manifest["steps"], "hash": manifest["hash"], "parent": manifest["parent"],
            "reward": metrics.get("reward", {}).get("mean"), "success": metrics.get("success", {}).get("rate"),
            "wall_seconds": manifest.get("cost", {}).get("wall_seconds"), "stage_seconds": round(seconds, 3)}


@task
def gate_phase(env: str, index: int, url: str, policy_url: str | None = None) -> dict:
    """Run (or skip, if up to date) phase ``index``'s promotion gate (stage ``<env>_gate_<index>``,
    training.evaluation.gate) against the provisioned servers; returns its summary (decision and figures)."""
    from training.evaluation.gate import run_gate

    stage = f"{env}_gate_{index}"
    _say(stage, run_stage(project_root(), stage, url, policy_url=policy_url,
                          work=lambda: run_gate(env, index, url=url, root=Path("."), policy_url=policy_url,
                                                progress=print)), "gated")
    return json.loads(Run(env, root=project_root()).gate_record(index).read_text())


@task
def run_warm_stage(env: str, index: int, url: str) -> dict:
    """Run (or skip, if up to date) warm-start stage ``index`` (sft, rft or dpo before the RL phases) as its DVC
    stage, against the provisioned environment server."""
    from training.warmstart.methods import run_warm_stage as run_one

    stage = f"{env}_warm_{index}"

    def work() -> None:
        spec, init, out = warm_spec(env, index, Path("."))
        run_one(env, index, spec, init, out, url)

    started = time.perf_counter()
    outcome = run_stage(project_root(), stage, url, work=work)
    _say(stage, outcome, "trained")
    spec, _, folder = warm_spec(env, index, project_root())
    manifest = read_manifest(checkpoint_of(folder, spec))
    return {"stage": stage, "ran": outcome != "skipped", "how": outcome, "h": manifest.get("h", "-"),
            "steps": "-", "hash": manifest["hash"], "parent": manifest["parent"],
            "reward": None, "success": manifest.get("sample_success"),
            "wall_seconds": None, "stage_seconds": round(time.perf_counter() - started, 3)}


@task
def evaluate_run(env: str, url: str, policy_url: str | None = None) -> dict:
    """Run (or skip, if up to date) the evaluation stage, base model and every phase checkpoint, against the
    provisioned servers; in this process when only it is stale (:mod:`tasks.stages`), else by ``dvc repro``."""
    from training.evaluation.eval_stage import run_eval

    _say(f"{env}_eval", run_stage(project_root(), f"{env}_eval", url, policy_url=policy_url,
                                  work=lambda: run_eval(env, url=url, root=Path("."), policy_url=policy_url,
                                                        progress=lambda name: print(f"evaluating {name} ..."))))
    return json.loads(Run(env, root=project_root()).eval_metrics.read_text())


@task
def build_report(env: str) -> Path:
    """Run (or skip) the report stage, in this process when only it is stale; returns the HTML page."""
    from training.evaluation.report import write_report
    from training.settings.specs import report_spec

    _say(f"{env}_report", run_stage(project_root(), f"{env}_report",
                                    work=lambda: write_report(report_spec([env], Path(".")))))
    return report_spec([env], project_root()).out


Record = Literal["commit", "exp", "none"]


@task
def version(message: str, record: Record = "commit", push: bool = True) -> str:
    """Record the run's lineage: ``commit`` commits dvc.lock (with params.yaml, phases.yaml, dvc.yaml) on the
    current branch as git's configured author; ``exp`` saves it as a DVC experiment (``dvc exp save``) and
    leaves the branch alone; ``none`` records nothing. With ``push``, artifacts go to the DVC remote and the
    commit (or experiment) to the git remote, where those are configured. A push that fails (a remote that moved
    on, is unreachable, or refuses) does not fail the run, whose lineage is recorded here: the answer says what
    was not pushed and how to push it."""
    root = project_root()
    if record == "none":
        return "lineage not recorded (record: none); dvc.lock holds it"
    if not (root / ".git").exists():
        return "not a git repository: lineage not recorded"
    done = []
    if record == "exp":
        _run(["dvc", "exp", "save", "--force", "--message", message])
        done.append("saved as a DVC experiment")
    else:
        _run(["git", "add", "dvc.lock", "phases.yaml", "dvc.yaml", "params.yaml"])
        if subprocess.run(["git", "diff", "--cached", "--quiet"], cwd=root).returncode == 0:
            done.append("lineage unchanged")
        else:
            _run(["git", "commit", "-m", message])  # git's own author; a missing one is git's error, shown
            done.append("committed")
    if push:
        try:
            if push_artifacts():
                done.append("artifacts pushed to the DVC remote")
        except RuntimeError as err:
            done.append(f"NOT pushed to the DVC remote ({_first_line(err)}): run `dvc push` when it is reachable")
        remotes = _run(["git", "remote"]).split()
        if remotes:  # the first one (origin, as a clone names it)
            try:
                if record == "exp":
                    _run(["dvc", "exp", "push", remotes[0], "--rev", "HEAD"])  # the experiments of this commit
                else:
                    _run(["git", "push", remotes[0], "HEAD"])
                done.append(f"pushed to the git remote {remotes[0]}")
            except RuntimeError as err:
                how = "dvc exp push" if record == "exp" else "git pull --rebase && git push"
                done.append(f"NOT pushed to the git remote {remotes[0]} ({_first_line(err)}): `{how}` when ready")
    return ", ".join(done)


def _first_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    rejected = [line for line in lines if "rejected" in line or "error" in line.lower()]
    return (rejected or lines or ["failed"])[0][:200]

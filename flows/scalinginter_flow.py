"""The ScalingInter pipeline as a Prefect flow: provision -> one task per phase -> evaluate -> report -> version.

    scalinginter run --env sciworld --profile smoke       # on Prefect's embedded API, no server needed

Each phase task runs that phase's DVC stage, so the flow and plain ``dvc repro`` leave the same lineage:
in the flow's warm process when it is the only stale stage (then recorded with ``dvc commit``, see
``tasks.stages``), else by ``dvc repro <env>_phase_<k>``. Phases that are up to date are skipped,
and an interrupted phase resumes from its intra-phase checkpoint. Evaluation and the report are DVC
stages too. The environment server is provisioned once (with retries and a health check) and always torn down;
so is the vLLM server when ``train`` or ``eval`` samples with the ``vllm`` engine (started on the base model;
each phase and the evaluation load their own weights into it and verify them with the probe). The data splits
and the base model stage run first, so that on a first run too every later stage (warm start, phases, evaluation,
report) is the only stale one of its chain when its turn comes, and runs in the flow's process.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from envs.paths import project_root
from envs.urls import ServerUrls
from flows.dvc_pipeline import set_params
from flows.dvc_pipeline import write as write_pipeline
from tasks.pipeline import (
    Record,
    build_base_model,
    build_report,
    evaluate_run,
    gate_phase,
    provision_env_server,
    provision_policy_server,
    run_phase,
    run_warm_stage,
    teardown_server,
    version,
    write_data_splits,
)
from training.evaluation.evaluate import closing_line
from training.evaluation.gate import describe, run_result
from training.preflight import plan, require
from training.settings.config import (
    MIXED,
    ConfigError,
    curriculum_config,
    eval_config,
    gate_config,
    load_params,
    mixed_components,
    mixed_envs,
    policy_server_config,
    server_config,
    train_config,
)
from training.settings.layout import Run
from training.settings.warm import pipeline_stages


def _markdown(env: str, profile: str, rows: list[dict[str, Any]], evaluation: dict[str, Any], report: Path,
              closing: str, gates: list[str] | None = None) -> str:
    lines = [f"# scalinginter: {env} ({profile})", "",
             "| phase | h | steps | ran | reward/mean | success/rate | checkpoint | parent | wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['stage']} | {row['h']} | {row['steps']} | {'yes' if row['ran'] else 'up to date'} | "
                     f"{row['reward']} | {row['success']} | `{row['hash'][:12]}` | `{row['parent'][:12]}` | "
                     f"{row['wall_seconds']} |")
    if gates:
        lines += ["", "Promotion gates:", "", *(f"- {line}" for line in gates)]
    k = evaluation["k"]
    lines += ["", f"Evaluation on {evaluation['items']} test items (k={k}, T={evaluation['temperature']}, "
              f"h={evaluation['h']}):", "", f"| checkpoint | success | 95% CI | Avg@{k} | Pass@{k} |",
              "|---|---|---|---|---|"]
    for name, c in evaluation["checkpoints"].items():
        low, high = c["success_ci95"]
        lines.append(f"| {name} | {c['success']:.1%} | {low:.1%}-{high:.1%} | {c['avg_at_k']:.3f} | "
                     f"{c['pass_at_k']:.1%} |")
    lines += ["", closing, "", f"Report: `{report}`"]
    return "\n".join(lines)


@flow(name="scalinginter", log_prints=True)
def scalinginter(env: str = "babyai", profile: str = "smoke", overrides: dict[str, Any] | None = None,
                 record: Record = "commit", push: bool = True, env_urls: list[str] | None = None) -> dict[str, Any]:
    """Train ``env``'s whole ScalingInter curriculum under ``profile``; return the phase table.

    ``overrides`` sets params.yaml keys (dotted, e.g. ``{"train.smoke.lr": 2e-5}``) before the run, as
    ``dvc exp run -S`` does, so they reach dvc.lock; ``profile`` is ``curriculum.profile``. ``record`` says how
    the lineage is kept (``commit``, ``exp`` or ``none``, see ``tasks.pipeline.version``); ``push`` sends it to
    the remotes. ``env_urls`` (a deployment parameter) are environment servers that already run, replicas on this
machine or others: the run uses them instead of starting ``env_server.replicas`` of its own. One run at a time
holds the working copy (a second fails at once, naming the holder)."""
    root = project_root()
    overrides = dict(overrides or {})
    names = mixed_envs(env) if env != MIXED else [env]
    if len(names) > 1:  # one policy over several environments: the pipeline's mixed run, on these
        env, overrides["mixed.envs"] = MIXED, names
    if env == MIXED:
        listed = list(overrides.get("pipeline.envs") or load_params(root / "params.yaml").get("pipeline", {})
                      .get("envs", []))
        overrides["pipeline.envs"] = listed + [MIXED] * (MIXED not in listed)
    with working_copy_lock(root):
        changed = set_params({"curriculum.profile": profile, **overrides}, root)
        for key, old in changed.items():
            print(f"params.yaml: {key} set (was {old!r})")
        params = load_params(root / "params.yaml")
        if env not in params.get("pipeline", {}).get("envs", []):
            raise ConfigError(f"{env} is not in params.yaml pipeline.envs: add it (or pass overrides "
                              f"{{'pipeline.envs': [...]}})")
        # the preflight, on this machine: a run that cannot fit it is refused before any stage runs
        for finding in require(plan(env, profile, "here", params=params)):
            print(f"preflight {finding}")
        for path in write_pipeline(root):
            print(f"regenerated {path.name} from params.yaml")
        return _run(env, profile, params, record, push, env_urls)


def _run(env: str, profile: str, params: dict[str, Any], record: Record, push: bool,
         env_urls: list[str] | None = None) -> dict[str, Any]:
    curriculum = curriculum_config(env, profile, params)
    phases = curriculum.phases()
    components = mixed_components(env, params)  # [env], or the environments of the mixed run
    # first, so that each later stage is the only stale one of its chain and runs in this process
    for e in components:
        write_data_splits(e)
    base = build_base_model()
    if env_urls:  # servers that already run (other machines): used as they are, never torn down here
        given = env_urls if len(components) == 1 else ";".join(env_urls)  # replicas, or ENV=URL pairs
        url, pids = ServerUrls.parse(given, components).text(), []  # an error names what is missing, before work
    elif len(components) == 1:
        url, pids = provision_env_server(env, server_config(env, params))
    else:  # each environment's own servers, passed on as ENV=URL pairs
        urls, pids = {}, []
        try:
            for e in components:
                urls[e], started = provision_env_server(e, server_config(e, params))
                pids += started
        except BaseException:
            for pid in pids:
                teardown_server(pid)
            raise
        url = ServerUrls.parse(urls, components).text()
    policy_url, policy_pids = None, []
    try:
        train, evaluation = train_config(env, profile, params=params), eval_config(env, profile, params)
        if "vllm" in (train.engine, evaluation.engine):  # one server for the run, loaded with each phase's weights
            server = policy_server_config(params)
            length = max(server.max_len(train.context_budget, train.max_new_tokens),
                         server.max_len(evaluation.budget, evaluation.max_new_tokens))
            policy_url, policy_pids = provision_policy_server(base, server, length,
                                                              train.lora.r if train.lora is not None else None)
        rows, warm, gates = [], [], []
        gated = gate_config(env, profile, params).enabled
        for k, stage in enumerate(pipeline_stages(curriculum.warm_start)):  # sft / rft rounds / dpo before the RL
            print(f"warm start {k}: {stage.method}")
            warm.append(run_warm_stage(env, k, url))
        for phase in phases:
            print(f"phase {phase.index}: h={phase.h}, steps {phase.first_step}..{phase.last_step}")
            started = time.perf_counter()
            rows.append(run_phase(env, phase.index, url, policy_url))
            rows[-1]["task_seconds"] = round(time.perf_counter() - started, 3)  # with Prefect's own share
            if gated:  # the next phase starts from what the gate promotes
                gates.append(describe(phase.index, gate_phase(env, phase.index, url, policy_url)))
                print(gates[-1])
        results = evaluate_run(env, url, policy_url)
    finally:
        for pid in pids:
            teardown_server(pid)
        for pid in policy_pids:
            teardown_server(pid)
    report = build_report(env)
    print(version(f"scalinginter {env} ({profile}): {len(phases)} phases", record, push))
    run = Run(env, root=project_root())
    closing = closing_line(results, json.loads(run.eval_per_item.read_text()))
    if gated:
        result = run_result(env, project_root())
        closing += (f"\nthe run hands back {result['checkpoint']} (promoted at gate {result['gate']}: "
                    f"{result['decision']}, gate score {result['score']:.1%})")
    create_markdown_artifact(_markdown(env, profile, warm + rows, results, report, closing, gates),
                             key=f"scalinginter-{env}", description=f"ScalingInter curriculum of {env}")
    print(closing)
    print(f"checkpoints: {run.dir}/phase-*/final\nmetrics:     {run.dir}/phase-*/dvclive (dvc plots show), "
          f"{run.eval_metrics}\nlineage:     scalinginter lineage {env}\nreport:      {report}")
    return {"warm_start": warm, "phases": rows, "gates": gates, "evaluation": results, "report": str(report),
            "closing": closing}


@flow(name="scalinginter-follow", log_prints=True)
def follow(env: str = "sciworld", idle_timeout_s: float = 3600.0) -> list[dict[str, Any]]:
    """On each node but the head of a multi-node run (a worker there, with the same ``SCALINGINTER_NNODES`` and
    the run folder shared): join every phase, baseline and retry the head's flow launches across nodes, until no
    launch has come for ``idle_timeout_s`` (``training.placement.nodes``: the head announces each launch in its
    phase folder, this starts the same command with the announced rendezvous). Fails when a launch failed here."""
    from training.phases.follow import follow_run

    joined = follow_run(env, project_root(), idle_timeout_s=idle_timeout_s)
    failed = [j["folder"] for j in joined if j["returncode"] != 0]
    if failed:
        raise RuntimeError(f"launches that failed on this node: {', '.join(failed)}")
    return joined


@contextlib.contextmanager
def working_copy_lock(root: Path) -> Iterator[None]:
    """Hold ``root``'s run lock: two runs in one working copy would share its dvc.lock, git index and run
    folders. Released when the run ends, also by a killed process (the OS drops the lock)."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(root / ".dvc" / "tmp" / "scalinginter-run.lock"))
    (root / ".dvc" / "tmp").mkdir(parents=True, exist_ok=True)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ConfigError(f"another scalinginter run holds the working copy {root} (lock {lock.lock_file}): "
                          "wait for it, or run in another working copy (a clone)") from None
    try:
        yield
    finally:
        lock.release()

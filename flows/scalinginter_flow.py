"""The ScalingInter pipeline as a Prefect flow: provision -> one task per phase -> evaluate -> report -> version.

    scalinginter run --env sciworld --profile smoke       # on Prefect's embedded API, no server needed

Each phase task runs that phase's DVC stage, so the flow and plain ``dvc repro`` leave the same lineage:
in the flow's warm process when it is the only stale stage (then recorded with ``dvc commit``, see
``flows.stage_runner``), else by ``dvc repro <env>_phase_<k>``. Phases that are up to date are skipped,
and an interrupted phase resumes from its intra-phase checkpoint. Evaluation and the report are DVC
stages too. The environment server is provisioned once (with retries and a health check) and always torn down.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from envs.paths import project_root
from flows.pipeline import write as write_pipeline
from tasks.pipeline import build_report, evaluate_run, provision_env_server, run_phase, teardown_env_server, version
from training.config import ConfigError, curriculum_config, load_params


def _markdown(env: str, profile: str, rows: list[dict[str, Any]], evaluation: dict[str, Any], report: Path) -> str:
    lines = [f"# scalinginter: {env} ({profile})", "",
             "| phase | h | steps | ran | reward/mean | success/rate | checkpoint | parent | wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['stage']} | {row['h']} | {row['steps']} | {'yes' if row['ran'] else 'up to date'} | "
                     f"{row['reward']} | {row['success']} | `{row['hash'][:12]}` | `{row['parent'][:12]}` | "
                     f"{row['wall_seconds']} |")
    k = evaluation["k"]
    lines += ["", f"Evaluation on {evaluation['items']} test items (k={k}, T={evaluation['temperature']}, "
              f"h={evaluation['h']}):", "", f"| checkpoint | success | 95% CI | Avg@{k} | Pass@{k} |",
              "|---|---|---|---|---|"]
    for name, c in evaluation["checkpoints"].items():
        low, high = c["success_ci95"]
        lines.append(f"| {name} | {c['success']:.1%} | {low:.1%}-{high:.1%} | {c['avg_at_k']:.3f} | "
                     f"{c['pass_at_k']:.1%} |")
    lines += ["", f"Report: `{report}`"]
    return "\n".join(lines)


@flow(name="scalinginter", log_prints=True)
def scalinginter(env: str = "sciworld", profile: str = "smoke") -> dict[str, Any]:
    """Train ``env``'s whole ScalingInter curriculum under ``profile``; return the phase table."""
    params = load_params()
    if params["curriculum"].get("profile") != profile:
        raise ConfigError(f"dvc.yaml is generated for profile {params['curriculum'].get('profile')!r}: set "
                          f"curriculum.profile: {profile} in params.yaml (then `scalinginter pipeline`)")
    if env not in params.get("pipeline", {}).get("envs", []):
        raise ConfigError(f"{env} is not in params.yaml pipeline.envs: add it, then run `scalinginter pipeline`")
    for path in write_pipeline():
        print(f"regenerated {path.name} from params.yaml")
    phases = curriculum_config(env, profile, params).phases()
    options = params.get("env_server", {}).get("backend_options", {}).get(env) or {}
    url, pid = provision_env_server(env, options)
    try:
        rows = []
        for phase in phases:
            print(f"phase {phase.index}: h={phase.h}, steps {phase.first_step}..{phase.last_step}")
            started = time.perf_counter()
            rows.append(run_phase(env, phase.index, url))
            rows[-1]["task_seconds"] = round(time.perf_counter() - started, 3)  # with Prefect's own share
            how = {"in_process": "trained (in process, recorded by dvc commit)", "subprocess": "trained (dvc repro)"}
            print(f"{rows[-1]['stage']}: {how.get(rows[-1]['how'], 'up to date')}")
        evaluation = evaluate_run(env, url)
    finally:
        teardown_env_server(pid)
    report = build_report(env)
    print(version(env, f"scalinginter {env} ({profile}): {len(phases)} phases"))
    run = project_root() / "runs" / env
    create_markdown_artifact(_markdown(env, profile, rows, evaluation, report), key=f"scalinginter-{env}",
                             description=f"ScalingInter curriculum of {env}")
    print(f"checkpoints: {run}/phase-*/final\nmetrics:     {run}/phase-*/dvclive (dvc plots show), "
          f"{run}/eval/metrics.json\nlineage:     scalinginter lineage {env}\nreport:      {report}")
    return {"phases": rows, "evaluation": evaluation, "report": str(report)}

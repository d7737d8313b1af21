"""The commands that read what a run made: ``lineage``, ``export``, ``eval``, ``eval-outside`` and ``report``."""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli_common import EnvArg, app, check_env, console, fail


@app.command()
def lineage(env: EnvArg) -> None:
    """Print the chain of phases of ENV from dvc.lock and the checkpoints; fail if the two disagree."""
    from rich.table import Table

    from envs.paths import project_root
    from training.evaluation.lineage import lineage as read_lineage

    try:
        records, problems, revision = read_lineage(env, project_root())
    except (FileNotFoundError, LookupError) as err:
        fail(str(err))
    from rich import box

    # whole in an 80-column terminal: the env in the title, not in every stage name; 8-character hashes (as git's
    # short ones); the free-text column (what a stage trained, the guard's trips) wraps, the others never do
    table = Table(title=f"{env} lineage (dvc.lock at git {revision})", box=box.SIMPLE_HEAD, show_edge=False,
                  padding=(0, 1, 0, 0),
                  caption="reward: mean training reward, success: training success rate, of the last step")
    for name in ("stage", "h", "steps", "algo", "parent", "hash", "reward", "success", "wall s"):
        table.add_column(name, no_wrap=True, justify="right" if name in ("h", "steps", "wall s") else "left")
    table.add_column("trained", overflow="fold", min_width=7)
    for r in records:
        fmt = {k: "-" if v is None else f"{v:.3f}" for k, v in r.metrics.items()}
        wall = r.cost.get("wall_seconds")
        table.add_row(r.stage.removeprefix(f"{env}_"), str(r.h), str(r.steps), r.algorithm, r.parent[:8], r.own[:8],
                      fmt.get("reward/mean", "-"), fmt.get("success/rate", "-"),
                      "-" if wall is None else f"{float(wall):.0f}", r.trained)
    console.print(table)
    from training.evaluation.gate import run_result
    from training.settings.config import ConfigError

    try:
        result = run_result(env, project_root())
        if result["gate"] is not None:
            console.print(f"the run hands back {result['checkpoint']} ({result['decision']} at gate {result['gate']}, "
                          f"gate score {result['score']:.1%})")
    except ConfigError as err:
        problems.append(str(err))
    if problems:
        for problem in problems:
            console.print(f"[red]disagreement:[/red] {problem}")
        raise typer.Exit(1)


@app.command()
def export(
    env: EnvArg,
    out: Annotated[str, typer.Option(help="folder to write (replaced if it exists)")],
    phase: Annotated[int | None, typer.Option(help="phase index (default: the run's result: with promotion gates "
                                                   "the best checkpoint they promoted, else the last phase's)")]
    = None,
) -> None:
    """Export a checkpoint to hand on: the HF model folder with a model card that includes its evaluation. A phase
    its promotion gate rejected is refused."""
    from pathlib import Path

    from flows.export import export_phase, export_result
    from training.checkpoint import CheckpointError
    from training.settings.config import ConfigError

    check_env(env)
    try:
        if phase is None:
            path, what = export_result(env, Path(out))
        else:
            path, what = export_phase(env, phase, Path(out)), f"phase {phase}"
    except (ConfigError, CheckpointError) as err:
        fail(str(err))
    console.print(f"exported {env} {what} to {path}")


@app.command("eval")
def eval_cmd(
    env: EnvArg,
    profile: Annotated[str | None, typer.Option(help="params.yaml profile (default: curriculum.profile)")] = None,
    url: Annotated[str | None, typer.Option(envvar="SCALINGINTER_ENV_URL",
                                            help="environment server URL, or comma-separated replicas "
                                                 "(default: start env_server.replicas)")] = None,
    baseline: Annotated[int | None, typer.Option(help="evaluate the fixed-h baseline run with this h")] = None,
) -> None:
    """Evaluate the base model and every phase checkpoint of ENV: Avg@k, Pass@k, success, per sub-task."""
    from rich.table import Table

    from training.evaluation.eval_stage import run_eval
    from training.settings.config import ConfigError
    from training.settings.layout import Run

    check_env(env)
    try:
        result = run_eval(env, profile, url, progress=lambda name: console.print(f"evaluating {name} ..."),
                          baseline=baseline)
    except ConfigError as err:
        fail(str(err))
    table = Table("checkpoint", "success", "95% CI", f"Avg@{result['k']}", f"Pass@{result['k']}",
                  title=f"{env}: {result['items']} test items, k={result['k']}, T={result['temperature']}, "
                        f"h={result['h']}, seed {result['seed']}")
    for name, c in result["checkpoints"].items():
        low, high = c["success_ci95"]
        table.add_row(name, f"{c['success']:.1%}", f"{low:.1%}-{high:.1%}", f"{c['avg_at_k']:.3f}",
                      f"{c['pass_at_k']:.1%}")
    console.print(table)
    console.print(f"metrics: {Run(env, baseline).eval_metrics}")


@app.command("eval-outside")
def eval_outside_cmd(
    env: EnvArg,
    policy_url: Annotated[str, typer.Option(help="the outside model's OpenAI-compatible server (base URL)")],
    model: Annotated[str, typer.Option(help="the model's name on that server")],
    tokenizer: Annotated[str | None, typer.Option(help="folder (or hub id) of the served model's own tokenizer "
                                                       "(--api completions); with --api chat it only counts the "
                                                       "context budget (default: the project's base model)")] = None,
    api: Annotated[str, typer.Option(help="completions: token-id prompts (vLLM, SGLang); chat: any OpenAI-"
                                          "compatible /v1/chat/completions (messages in, text out)")] = "completions",
    concurrency: Annotated[int, typer.Option(help="chat: requests in flight at most")] = 4,
    retries: Annotated[int, typer.Option(help="chat: repeats of a request answered 429/5xx or timed out")] = 5,
    price_in: Annotated[float | None, typer.Option(help="chat: US dollars per million prompt tokens")] = None,
    price_out: Annotated[float | None, typer.Option(help="chat: US dollars per million completion tokens")] = None,
    profile: Annotated[str | None, typer.Option(help="params.yaml profile (default: curriculum.profile)")] = None,
    url: Annotated[str | None, typer.Option(envvar="SCALINGINTER_ENV_URL",
                                            help="environment server URL, or comma-separated replicas "
                                                 "(default: start env_server.replicas)")] = None,
) -> None:
    """Evaluate an outside model on ENV with the items and metrics of ``scalinginter eval``. Its API key comes from
    SCALINGINTER_API_KEY (or OPENAI_API_KEY), never from the command line, and is never logged. With ``--api chat``
    its answers are cached (runs/ENV/eval/outside/MODEL.cache.jsonl): a repeated or interrupted evaluation pays
    for no answer twice."""
    from pathlib import Path

    from training.engines.engine import EngineError
    from training.evaluation.eval_stage import run_outside_eval
    from training.evaluation.evaluate import ChatSettings
    from training.settings.config import ConfigError, base_model_dir, load_params
    from training.settings.layout import Run

    check_env(env)
    if api not in ("completions", "chat"):
        fail(f"--api {api!r}: completions or chat")
    if tokenizer is None and api == "completions":
        fail("--api completions lays the prompts out with the served model's own chat template: give --tokenizer")
    chat = ChatSettings(concurrency=concurrency, retries=retries, price_in=price_in, price_out=price_out) \
        if api == "chat" else None
    try:
        counting = Path(tokenizer) if tokenizer else base_model_dir(load_params())
        result = run_outside_eval(env, policy_url, model, counting, profile, url, chat=chat)
    except (ConfigError, EngineError, ValueError) as err:
        fail(str(err))
    low, high = result["success_ci95"]
    console.print(f"{model} on {env}: success {result['success']:.1%} (95% CI {low:.1%}-{high:.1%}), "
                  f"Avg@{result['k']} {result['avg_at_k']:.3f}, Pass@{result['k']} {result['pass_at_k']:.1%} over "
                  f"{result['items']} items")
    if "usage" in result:
        u = result["usage"]
        cost = "" if u["cost_usd"] is None else f", ${u['cost_usd']:.4f}"
        console.print(f"API: {u['requests']} requests ({u['cached']} answered from the cache, {u['retries']} "
                      f"retries), {u['prompt_tokens']} prompt + {u['completion_tokens']} completion tokens{cost}")
    console.print(f"metrics: {Run(env).eval_outside(model)}")


@app.command()
def report(
    envs: Annotated[list[str] | None, typer.Argument(help="environments (default: every one with results)")] = None,
    out: Annotated[str | None, typer.Option(help="HTML file (default reports/<env>.html or reports/index.html)")]
    = None,
) -> None:
    """Write the self-contained HTML report: curriculum explorer, Overall bars, curves, lineage, cost."""
    from pathlib import Path

    from envs.paths import project_root
    from training.evaluation.report import write_report
    from training.settings.config import ConfigError
    from training.settings.specs import report_spec

    try:
        spec = report_spec(envs, project_root(), Path(out) if out else None)
    except ConfigError as err:
        fail(str(err))
    path = write_report(spec)
    console.print(f"report: {path}")

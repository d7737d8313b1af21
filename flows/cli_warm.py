"""The warm-start commands: ``warm-stage`` (one stage of a curriculum, as its DVC stage runs it) and ``sft``,
``rft`` and ``dpo`` (one stage of the settings given), all through :func:`training.warmstart.methods.run_warm_stage`.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from pydantic import BaseModel

from flows.cli_common import DeviceOpt, EnvArg, app, check_env, console, device_here, fail, pairs
from training.settings.warm import PREFIX_CACHE_HELP, DPOStage, RFTStage, SFTStage


def _default(stage: type[BaseModel], name: str) -> Any:
    """The warm-start stage's own default for ``name``: the command and params.yaml cannot disagree."""
    return stage.model_fields[name].default


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
    from training.settings.config import ConfigError, load_params, server_config
    from training.settings.specs import warm_spec
    from training.warmstart.methods import run_warm_stage

    check_env(env)
    root = project_root()
    try:
        stage, start, folder = warm_spec(env, index, root)
        server = server_config(env, load_params(root / "params.yaml"))
    except ConfigError as err:
        fail(str(err))
    try:
        path = run_warm_stage(env, index, stage, Path(init) if init else start, Path(out) if out else folder, url,
                              server, progress=True)
    except (ValueError, RuntimeError, OSError) as err:
        fail(str(err))
    console.print(f"warm start {index} ({stage.method}) done: {path}")

def _warm_command(env: str, method: str, init: str | None, out: str, device: str, url: str | None = None,
                  sets: list[str] | None = None, **settings: object) -> list:
    """The CLI's warm-start commands: ``settings`` (None: the stage's default), then ``sets`` (``--set
    field=value``, any field of the stage's settings, as params.yaml's ``warm_start`` takes it), as a warm-start
    stage of ``method``, run by the pipeline's own :func:`training.warmstart.methods.run_warm_stage` into the
    stage folder ``out``; returns the checkpoints it wrote."""
    from pathlib import Path

    from training.settings.config import base_model_dir, load_params, server_config
    from training.settings.warm import parse_stage, stage_checkpoints
    from training.warmstart.methods import run_warm_stage

    check_env(env)
    device_here(device)
    params = load_params()
    try:
        given = {k: v for k, v in settings.items() if v is not None}
        stage = parse_stage({"method": method, **given, **pairs(sets or [])})
    except ValueError as err:
        fail(str(err))
    try:
        run_warm_stage(env, 0, stage, Path(init) if init else base_model_dir(params), Path(out), url,
                       server_config(env, params), progress=True, device=device)
    except (ValueError, RuntimeError, OSError) as err:
        fail(str(err))
    return stage_checkpoints(Path(out), stage)


SUB_TASK_HELP = "only these sub-tasks (repeatable)"
LORA_HELP = "train LoRA adapters of this rank only (0: every weight); the checkpoint holds the merged weights and " \
            "the adapter in lora/"
ENV_URL_HELP = "environment server URL (default: start one)"
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", help="any setting of the stage, field=value as params.yaml's warm_start takes it (repeatable; after the "
                  "options above): e.g. split=warm, max_turns=4, expert=sighted, group_by_length=true")]


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
    epochs: Annotated[int, typer.Option(help="passes over the episodes")] = _default(SFTStage, "epochs"),
    lr: Annotated[float, typer.Option(help="learning rate")] = _default(SFTStage, "lr"),
    max_tokens: Annotated[int, typer.Option(help="longest episode trained on (longer ones are left out, counted)")]
    = _default(SFTStage, "max_tokens"),
    lora_r: Annotated[int, typer.Option(help=LORA_HELP)] = _default(SFTStage, "lora_r"),
    from_: Annotated[list[str] | None, typer.Option("--from", help="train on the successful episodes recorded in "
                                                    "these JSONL files or folders (a phase's rollouts/, RFT rounds, "
                                                    "DPO pairs) instead of expert episodes (repeatable)")] = None,
    device: DeviceOpt = "cpu",
    set_: SetOpt = None,
) -> None:
    """Warm-start a policy by SFT on expert episodes, or on recorded successful episodes (--from): a warm-start
    stage (``method: sft``) run as the pipeline runs one."""
    from training.checkpoint import read_manifest

    try:  # --set recorded=... is --from by another name: the same check, and no default expert items beside it
        recorded = from_ or pairs(set_ or []).get("recorded")
        if from_ and "recorded" in pairs(set_ or []):
            fail("--from and --set recorded= both name recorded episodes: give one of them")
    except ValueError as err:
        fail(str(err))
    if recorded and (episodes is not None or sub_task):
        fail("--episodes and --sub-task choose expert episodes; --from (or --set recorded=) trains on every "
             "successful episode of its files: give one or the other")
    expert_items = None if recorded else 64 if episodes is None else episodes
    [path] = _warm_command(env, "sft", init, out, device, sets=set_, items=expert_items,
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
    rounds: Annotated[int, typer.Option(help="sample -> keep successes -> SFT rounds")] = _default(RFTStage, "rounds"),
    k: Annotated[int, typer.Option(help="episodes sampled per item each round")] = _default(RFTStage, "k"),
    h: Annotated[int, typer.Option(help="turn cap of the sampled episodes")] = _default(RFTStage, "h"),
    items: Annotated[int, typer.Option(help="first N items of the training split")] = _default(RFTStage, "items"),
    sub_task: Annotated[list[str] | None, typer.Option(help=SUB_TASK_HELP)] = None,
    keep: Annotated[str, typer.Option(help="all successful episodes, or each item's shortest")]
    = _default(RFTStage, "keep"),
    temperature: Annotated[float, typer.Option(help="sampling temperature")] = _default(RFTStage, "temperature"),
    max_new_tokens: Annotated[int, typer.Option(help="tokens per assistant turn")]
    = _default(RFTStage, "max_new_tokens"),
    epochs: Annotated[int, typer.Option(help="SFT passes over each round's kept episodes")]
    = _default(RFTStage, "epochs"),
    lr: Annotated[float, typer.Option(help="SFT learning rate")] = _default(RFTStage, "lr"),
    url: Annotated[str | None, typer.Option(envvar="SCALINGINTER_ENV_URL", help=ENV_URL_HELP)] = None,
    lora_r: Annotated[int, typer.Option(help=LORA_HELP)] = _default(RFTStage, "lora_r"),
    prefix_cache_gb: Annotated[float, typer.Option(help=PREFIX_CACHE_HELP)] = _default(RFTStage, "prefix_cache_gb"),
    device: DeviceOpt = "cpu",
    set_: SetOpt = None,
) -> None:
    """Rejection-sampling fine-tuning (AgentEvol-style): rounds of sampling K episodes per item, keeping the
    successful ones and SFT on them; a rerun continues after the last finished round. A warm-start stage
    (``method: rft``) run as the pipeline runs one."""
    from training.checkpoint import read_manifest

    folders = _warm_command(env, "rft", init, out, device, url, set_, rounds=rounds, k=k, h=h, items=items,
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
    k: Annotated[int, typer.Option(help="episodes sampled per item to make pairs")] = _default(DPOStage, "k"),
    h: Annotated[int, typer.Option(help="turn cap of the sampled episodes")] = _default(DPOStage, "h"),
    items: Annotated[int, typer.Option(help="first N items of the training split")] = _default(DPOStage, "items"),
    sub_task: Annotated[list[str] | None, typer.Option(help=SUB_TASK_HELP)] = None,
    beta: Annotated[float, typer.Option(help="DPO beta")] = _default(DPOStage, "beta"),
    epochs: Annotated[int, typer.Option(help="passes over the pairs")] = _default(DPOStage, "epochs"),
    lr: Annotated[float, typer.Option(help="learning rate")] = _default(DPOStage, "lr"),
    max_new_tokens: Annotated[int, typer.Option(help="tokens per assistant turn")]
    = _default(DPOStage, "max_new_tokens"),
    url: Annotated[str | None, typer.Option(envvar="SCALINGINTER_ENV_URL", help=ENV_URL_HELP)] = None,
    lora_r: Annotated[int, typer.Option(help=LORA_HELP)] = _default(DPOStage, "lora_r"),
    prefix_cache_gb: Annotated[float, typer.Option(help=PREFIX_CACHE_HELP)] = _default(DPOStage, "prefix_cache_gb"),
    device: DeviceOpt = "cpu",
    set_: SetOpt = None,
) -> None:
    """DPO on the policy's own episodes: sample K per item, pair each item's successes with its failures, train
    on the assistant tokens against the frozen starting policy. A warm-start stage (``method: dpo``) run as the
    pipeline runs one."""
    from training.checkpoint import read_manifest

    [path] = _warm_command(env, "dpo", init, out, device, url, set_, k=k, h=h, items=items, sub_tasks=sub_task or None,
                           beta=beta, epochs=epochs, lr=lr, max_new_tokens=max_new_tokens, lora_r=lora_r,
                           prefix_cache_gb=prefix_cache_gb)
    m = read_manifest(path)
    console.print(f"DPO on {m['pairs']} pairs of {m['items']} items: loss {m['first_loss']:.3f} -> "
                  f"{m['final_loss']:.3f}, {m['accuracy_after']:.0%} of pairs preferred the right way -> {path}")

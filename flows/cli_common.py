"""What every ``scalinginter`` command shares: the Typer app, the console, the argument types and the checks that
fail a command with a clear message before any work. The commands are in ``flows.cli`` (set-up, stages, the run),
``flows.cli_warm`` (warm starts) and ``flows.cli_results`` (evaluation, report, lineage, export).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from envs.registry import SERVED, TESTING, UnknownEnvironmentError
from training.settings.config import MIXED

app = typer.Typer(add_completion=False, no_args_is_help=True, help="ScalingInter-RL agent training pipeline.")
console = Console()

EnvArg = Annotated[str, typer.Argument(help=f"environment: one of {', '.join(SERVED)}")]
DeviceOpt = Annotated[str, typer.Option(envvar="SCALINGINTER_DEVICE", help="where the model trains and samples: "
                                        "cpu, cuda[:N], npu[:N] or auto (a work pool's SCALINGINTER_DEVICE)")]


def fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(2)


def check_envs(env: str) -> list[str]:
    """The environments of ``env`` (one, or several joined by commas), each checked."""
    from training.settings.config import mixed_envs

    try:
        envs = mixed_envs(env)
    except ValueError as err:
        fail(str(err))
    for name in envs:
        check_env(name)
    return envs


def check_env(env: str) -> None:
    if env == MIXED:  # the pipeline's run of one policy over params.yaml mixed.envs
        return
    if env not in SERVED and env not in TESTING:
        fail(str(UnknownEnvironmentError(f"unknown environment {env!r}: choose one of {', '.join(SERVED)}")))

def profile() -> str:
    from training.settings.config import load_params

    return str(load_params().get("curriculum", {}).get("profile", "smoke"))

def device_here(name: str) -> str:
    """``name`` if that device is here, else a clear error before any work."""
    from training.placement.devices import DeviceError, resolve_device

    try:
        resolve_device(name)
    except DeviceError as err:
        fail(str(err))
    return name

def pairs(pairs: list[str]) -> dict[str, object]:
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

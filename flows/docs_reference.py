"""The documentation site's reference pages, generated from the code so that they cannot drift from it: the CLI
from the Typer app (``scalinginter --help`` of every command), every setting of params.yaml from the settings
models' fields and descriptions. ``mkdocs_hooks.py`` adds them to the site at build time
(``reference/cli.md``, ``reference/settings.md``); ``python -m flows.docs_reference cli|settings`` prints one.
"""

from __future__ import annotations

import sys
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


def cli_markdown() -> str:
    """Every ``scalinginter`` command with its arguments, options, defaults and environment variables."""
    import typer
    from typer.cli import get_docs_for_click

    from flows.cli import app

    command = typer.main.get_command(app)
    text = get_docs_for_click(obj=command, ctx=typer.Context(command), name="scalinginter",
                              title="Command line: `scalinginter`")
    return (text.rstrip() + "\n\n---\nGenerated from the Typer app (`flows/cli.py` and the modules it loads) when "
            "the site is built.\n")


def _sections() -> list[tuple[str, str, type[BaseModel]]]:
    """(where in params.yaml, title, model) for every settings model a user writes."""
    from training.guard import GuardConfig
    from training.lora import LoraSettings
    from training.settings.config import (
        EvalConfig,
        GateConfig,
        MixShare,
        OutsideModel,
        PolicyServerConfig,
        ServerConfig,
        TrainConfig,
    )
    from training.settings.curriculum import AdaptiveRule, CurriculumConfig
    from training.settings.warm import DPOStage, RFTStage, SFTStage

    return [
        ("curriculum.<env>.profiles.<profile>", "The curriculum of one environment and profile", CurriculumConfig),
        ("curriculum.<env>.profiles.<profile>.adaptive", "The adaptive curriculum's rule", AdaptiveRule),
        ("curriculum.<env>.profiles.<profile>.warm_start[] (method: sft)", "Warm start: SFT", SFTStage),
        ("curriculum.<env>.profiles.<profile>.warm_start[] (method: rft)", "Warm start: RFT", RFTStage),
        ("curriculum.<env>.profiles.<profile>.warm_start[] (method: dpo)", "Warm start: DPO", DPOStage),
        ("train", "The RL trainer (every phase)", TrainConfig),
        ("train.guard", "The collapse guard", GuardConfig),
        ("train.lora", "LoRA adapters", LoraSettings),
        ("train.mix.<env>", "One environment's share of a mixed run", MixShare),
        ("eval", "Evaluation", EvalConfig),
        ("eval.outside[]", "An outside model evaluated beside the checkpoints", OutsideModel),
        ("gate", "The promotion gate between phases", GateConfig),
        ("env_server", "The environment servers the pipeline starts", ServerConfig),
        ("policy_server", "The vLLM policy server (train.engine: vllm)", PolicyServerConfig),
    ]


def _type(kind: Any) -> str:
    """A field's annotation as a reader writes it: ``int | None``, ``'fixed' | 'adaptive'``, ``list[SFTStage]``."""
    origin, args = get_origin(kind), get_args(kind)
    if origin is Annotated:
        return _type(args[0])
    if origin in (Union, types.UnionType):
        return " | ".join(_type(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type(a) for a in args)}]"
    return "None" if kind is type(None) else getattr(kind, "__name__", str(kind))


def _default(info: FieldInfo) -> str:
    if info.default is PydanticUndefined:
        return "*required*" if info.default_factory is None else f"`{_shown(info.default_factory())}`"
    return f"`{_shown(info.default)}`"


def _shown(value: Any) -> str:
    if isinstance(value, BaseModel):
        return "{…}"
    return repr(value) if not isinstance(value, str) else value or "''"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def settings_markdown() -> str:
    """One table per settings model: each setting's type, default and description, under its params.yaml key."""
    lines = ["# Settings reference", "",
             "Every setting of `params.yaml`, from the settings models' own fields (their types, defaults and "
             "descriptions): this page is generated when the site is built, so it cannot drift from the code. "
             "A setting that changes results is a DVC param of the stages that read it, so it reaches `dvc.lock`. "
             "Machine placement comes from environment variables instead: [Environment variables](../environment.md).",
             ""]
    for where, title, model in _sections():
        lines += [f"## {title}", "", f"`{where}` · `{model.__module__}.{model.__name__}`", ""]
        doc = (model.__doc__ or "").strip()
        if doc and not doc.startswith(("Usage docs:", "A base class")):
            lines += [" ".join(doc.split("\n\n")[0].split()), ""]
        lines += ["| setting | type | default | what it does |", "|---|---|---|---|"]
        for name, info in model.model_fields.items():
            lines.append(f"| `{name}` | `{_cell(_type(info.annotation))}` | {_cell(_default(info))} | "
                         f"{_cell(info.description or '')} |")
        lines.append("")
    return "\n".join(lines)


PAGES = {"reference/cli.md": cli_markdown, "reference/settings.md": settings_markdown}


def main(argv: list[str]) -> None:
    which = {"cli": "reference/cli.md", "settings": "reference/settings.md"}
    if len(argv) != 1 or argv[0] not in which:
        raise SystemExit(f"usage: python -m flows.docs_reference {'|'.join(which)}")
    print(PAGES[which[argv[0]]]())


if __name__ == "__main__":
    main(sys.argv[1:])

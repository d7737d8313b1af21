"""Names of the environments and where their server and client classes live (imported lazily, so a
client never imports a simulator)."""

from __future__ import annotations

import importlib
from typing import Any

from envs.base import Backend
from envs.client import AsyncBaseEnvClient, BaseEnvClient

ENVIRONMENTS: tuple[str, ...] = ("babyai", "textcraft", "sciworld", "webarena", "deepsearch")
SERVED: tuple[str, ...] = ("babyai", "textcraft", "sciworld", "deepsearch", "webarena")
#: Environments for testing the machinery itself, served like the others but not part of the paper.
TESTING: tuple[str, ...] = ("bandit",)


class UnknownEnvironmentError(ValueError):
    """The name is not one of the served environments."""


def _check(name: str) -> None:
    if name not in SERVED and name not in TESTING:
        raise UnknownEnvironmentError(
            f"unknown environment {name!r}: choose one of {', '.join(SERVED)}"
            + (" (not implemented yet)" if name in ENVIRONMENTS else "")
        )


def _attr(module: str, attr: str) -> Any:
    return getattr(importlib.import_module(module), attr)


def load_backend(name: str, **options: Any) -> Backend:
    """Create the server-side backend of environment ``name`` (``envs.<name>.backend.Backend``)."""
    _check(name)
    return _attr(f"envs.{name}.backend", "Backend")(**options)


def client_class(name: str) -> type[BaseEnvClient]:
    """The synchronous client class of environment ``name`` (``envs.<name>.client.Client``)."""
    _check(name)
    return _attr(f"envs.{name}.client", "Client")


def spec_class(name: str) -> type:
    """The prompt-and-parsing mixin of environment ``name`` (``envs.<name>.client.Spec``)."""
    _check(name)
    return _attr(f"envs.{name}.client", "Spec")


def async_client_class(name: str) -> type[AsyncBaseEnvClient]:
    """The asynchronous client class of environment ``name`` (``envs.<name>.client.AsyncClient``)."""
    _check(name)
    return _attr(f"envs.{name}.client", "AsyncClient")


def expert(name: str, which: str = "default") -> Any:
    """The expert episode runner ``solve(client, data_idx) -> StepOutput`` of environment ``name``: its own
    (``default``), or another it offers as ``solve_<which>`` in ``envs/<name>/expert.py`` (BabyAI: ``sighted``)."""
    _check(name)
    if which == "default":
        return _attr(f"envs.{name}.expert", "solve")
    module = importlib.import_module(f"envs.{name}.expert")
    if not hasattr(module, f"solve_{which}"):
        offered = ["default", *(n.removeprefix("solve_") for n in dir(module) if n.startswith("solve_"))]
        raise ValueError(f"{name} has no expert {which!r}: it offers {', '.join(offered)}")
    return getattr(module, f"solve_{which}")


#: the backend option that bounds an environment's live instances (one JVM / browser context each)
CAPACITY_OPTIONS: dict[str, str] = {"sciworld": "max_jvms", "webarena": "max_contexts"}


def backend_capacity(name: str, options: dict[str, Any]) -> int | None:
    """The live instances one server of ``name`` holds at once with backend ``options`` (its pool option, else
    the backend's own default), read from the settings alone, nothing started; None: bounded only by the
    server's ``max_instances``."""
    import inspect

    _check(name)
    option = CAPACITY_OPTIONS.get(name)
    if option is None:
        return None
    if option in options:
        return int(options[option])
    return int(inspect.signature(_attr(f"envs.{name}.backend", "Backend")).parameters[option].default)

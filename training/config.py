"""Reading params.yaml into validated configs (one frozen pydantic model per concern)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from envs.paths import project_root
from training.config_train import TrainConfig
from training.curriculum import AdaptiveRule, CurriculumConfig
from training.layout import Run, base_model


class ConfigError(ValueError):
    """params.yaml is missing something or holds a bad value; the message names the key."""


class _Loader(yaml.SafeLoader):
    """YAML as DVC reads it (1.2 floats): ``1e-5`` is a number, as it is to ``dvc exp run -S`` and ruamel,
    not the string PyYAML's 1.1 rules make of it."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*(?:\.[\d_]*)?|\.\d+)[eE][-+]?\d+$|^[-+]?(?:\d[\d_]*\.[\d_]*|\.\d+)$"
               r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"),
    list("-+0123456789."))


def load_params(path: Path | None = None) -> dict[str, Any]:
    """The parsed params.yaml of the working copy (``envs.paths.project_root``)."""
    path = path if path is not None else project_root() / "params.yaml"
    if not path.exists():
        raise ConfigError(f"{path} not found: run from the project root or pass the params file")
    return parse_params(path.read_text())


def parse_params(text: str) -> dict[str, Any]:
    """params.yaml's text parsed as DVC parses it (YAML 1.2 floats; a safe loader)."""
    return yaml.load(text, Loader=_Loader) or {}


def curriculum_config(env: str, profile: str | None = None, params: dict[str, Any] | None = None) -> CurriculumConfig:
    """The curriculum of ``env`` under ``profile`` (default: ``curriculum.profile`` in params.yaml)."""
    params = load_params() if params is None else params
    section = params.get("curriculum", {})
    if env not in section:
        known = sorted(k for k in section if k != "profile")
        raise ConfigError(f"params.yaml has no curriculum for {env!r}: known {', '.join(known)}")
    profile = profile or section.get("profile", "smoke")
    profiles = section[env].get("profiles", {})
    if profile not in profiles:
        raise ConfigError(f"curriculum.{env}.profiles has no {profile!r}: choose one of {', '.join(profiles)}")
    try:
        return CurriculumConfig(cap=section[env]["cap"], **profiles[profile])
    except ValidationError as err:
        raise ConfigError(f"curriculum.{env}.profiles.{profile} in params.yaml: {err}") from err


def _profile_values(params: dict[str, Any], key: str, env: str, profile: str | None) -> tuple[str, dict[str, Any]]:
    """(profile, ``<key>.<profile>`` of params.yaml overlaid with its ``envs.<env>`` overrides)."""
    profile = profile or params.get("curriculum", {}).get("profile", "smoke")
    section = dict(params.get(key, {}).get(profile) or {})
    if not section:
        raise ConfigError(f"params.yaml has no {key}.{profile} section")
    per_env = (section.pop("envs", None) or {}).get(env, {})
    return profile, {**section, **per_env}


def train_config(env: str, profile: str | None = None, overrides: dict[str, Any] | None = None,
                 params: dict[str, Any] | None = None) -> TrainConfig:
    """``train.<profile>`` of params.yaml, then ``train.<profile>.envs.<env>``, then ``overrides``."""
    params = load_params() if params is None else params
    profile, values = _profile_values(params, "train", env, profile)
    try:
        return TrainConfig(**{**values, **(overrides or {})})
    except ValidationError as err:
        raise ConfigError(f"train.{profile} (env {env}) in params.yaml, with overrides {overrides}: {err}") from err


class EvalConfig(BaseModel):
    """How ``scalinginter eval`` samples: the same for every checkpoint of a run."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    items: int | None = Field(None, ge=1, description="first N test items (stratified split order); None: all")
    k: int = Field(1, ge=1, description="samples per item (Avg@k, Pass@k)")
    temperature: float = Field(1.0, ge=0, description="0 is greedy (then k must be 1)")
    max_new_tokens: int = Field(48, ge=1)
    seed: int = 0
    batch_items: int = Field(4, ge=1, description="items rolled out at once")
    h: int | None = Field(None, ge=1, description="turn cap; None: the last curriculum phase's h")
    context_budget: int | None = Field(None, ge=16, description="tokens per trajectory; None: the training "
                                       "profile's context_budget, so evaluation sees what training saw")
    device: str = Field("cpu", description="auto, cpu, cuda[:N] or npu[:N] (SCALINGINTER_DEVICE wins: placement)")


def eval_config(env: str, profile: str | None = None, params: dict[str, Any] | None = None) -> EvalConfig:
    """``eval.<profile>`` of params.yaml, then ``eval.<profile>.envs.<env>``."""
    params = load_params() if params is None else params
    profile, values = _profile_values(params, "eval", env, profile)
    if values.get("context_budget") is None:
        values["context_budget"] = train_config(env, profile, params=params).context_budget
    if os.environ.get("SCALINGINTER_DEVICE"):  # machine placement, from a work pool's job variables
        values["device"] = os.environ["SCALINGINTER_DEVICE"]
    try:
        config = EvalConfig(**values)
    except ValidationError as err:
        raise ConfigError(f"eval.{profile} (env {env}) in params.yaml: {err}") from err
    if config.temperature == 0 and config.k != 1:
        raise ConfigError(f"eval.{profile}: temperature 0 (greedy) gives k identical samples; set k: 1")
    return config


class ServerConfig(BaseModel):
    """An environment server the pipeline starts itself (params.yaml ``env_server``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    host: str = Field("127.0.0.1", description="interface to bind; 0.0.0.0 also serves other machines")
    max_instances: int = Field(1024, ge=1, description="live instances at once (429 beyond)")
    idle_ttl_s: float = Field(600.0, gt=0, description="idle instances are reaped after this many seconds")
    options: dict[str, str | int | float | bool] = Field(default_factory=dict,
                                                         description="the environment's backend options")

    def launch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``envs.launcher.start_server``."""
        return {"host": self.host, "max_instances": self.max_instances, "idle_ttl_s": self.idle_ttl_s,
                **self.options}


def server_config(env: str, params: dict[str, Any] | None = None) -> ServerConfig:
    """``env_server`` of params.yaml with ``env_server.backend_options.<env>`` as the options."""
    params = load_params() if params is None else params
    section = dict(params.get("env_server") or {})
    options = (section.pop("backend_options", None) or {}).get(env) or {}
    try:
        return ServerConfig(**section, options=options)
    except ValidationError as err:
        raise ConfigError(f"env_server in params.yaml (env {env}): {err}") from err


def base_model_dir(params: dict[str, Any], root: Path = Path(".")) -> Path:
    """The base model every run starts from: ``models/<model.preset>``."""
    return base_model(str(params.get("model", {}).get("preset", "tiny")), root)


class PhaseSpec(BaseModel):
    """Everything one phase's training needs, as values: what its DVC stage records as params and deps."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)
    env: str
    index: int
    h: int
    steps: int
    init: Path
    out: Path
    train: TrainConfig
    server: ServerConfig
    adaptive: AdaptiveRule | None = None  # the curriculum's adaptive mode (never on its last phase)


def phase_spec(env: str, index: int, root: Path, fixed_h: int | None = None) -> PhaseSpec:
    """Phase ``index`` of ``env``'s run in the working copy at ``root``: its h and steps from phases.yaml (the
    values its stage records), its settings from params.yaml, its folders from :mod:`training.layout`.
    ``fixed_h``: the fixed-h baseline run instead (one phase at that h for the curriculum's total steps)."""
    params = load_params(root / "params.yaml")
    profile = params.get("curriculum", {}).get("profile", "smoke")
    run = Run(env, fixed_h, root)
    adaptive = None
    if fixed_h is None:
        table = _phases_file(root).get(env, {})
        if f"phase_{index}" not in table:
            raise ConfigError(f"phases.yaml has no {env}.phase_{index}: run `scalinginter pipeline`")
        row = table[f"phase_{index}"]
        h, steps = int(row["h"]), int(row["steps"])
        init = base_model_dir(params, root) if index == 0 else run.final(index - 1)
        adaptive = adaptive_rule(env, index, profile, params)
    else:
        h, steps, init = fixed_h, curriculum_config(env, profile, params).total_steps, base_model_dir(params, root)
    return PhaseSpec(env=env, index=index, h=h, steps=steps, init=init, out=run.phase(index),
                     train=train_config(env, profile, params=params), server=server_config(env, params),
                     adaptive=adaptive)


def adaptive_rule(env: str, index: int, profile: str | None = None, params: dict[str, Any] | None = None
                  ) -> AdaptiveRule | None:
    """The rule that may end curriculum phase ``index`` early: the curriculum's ``adaptive`` settings in adaptive
    mode, except on the last phase (whose h cannot grow); None otherwise."""
    curriculum = curriculum_config(env, profile, params)
    if curriculum.mode != "adaptive" or index >= len(curriculum.phases()) - 1:
        return None
    return curriculum.adaptive


def _phases_file(root: Path) -> dict[str, Any]:
    path = root / "phases.yaml"
    if not path.exists():
        raise ConfigError(f"{path} not found: run `scalinginter pipeline`")
    return yaml.safe_load(path.read_text()) or {}


"""Reading params.yaml into validated configs (one frozen pydantic model per concern)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from envs.paths import project_root
from training.config_train import TrainConfig
from training.curriculum import CurriculumConfig


class ConfigError(ValueError):
    """params.yaml is missing something or holds a bad value; the message names the key."""


def load_params(path: Path | None = None) -> dict[str, Any]:
    """The parsed params.yaml of the working copy (``envs.paths.project_root``)."""
    path = path if path is not None else project_root() / "params.yaml"
    if not path.exists():
        raise ConfigError(f"{path} not found: run from the project root or pass the params file")
    return yaml.safe_load(path.read_text()) or {}


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


def eval_config(env: str, profile: str | None = None, params: dict[str, Any] | None = None) -> EvalConfig:
    """``eval.<profile>`` of params.yaml, then ``eval.<profile>.envs.<env>``."""
    params = load_params() if params is None else params
    profile, values = _profile_values(params, "eval", env, profile)
    try:
        config = EvalConfig(**values)
    except ValidationError as err:
        raise ConfigError(f"eval.{profile} (env {env}) in params.yaml: {err}") from err
    if config.temperature == 0 and config.k != 1:
        raise ConfigError(f"eval.{profile}: temperature 0 (greedy) gives k identical samples; set k: 1")
    return config

"""Reading params.yaml into validated configs (one frozen pydantic model per concern)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

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


def train_config(env: str, profile: str | None = None, overrides: dict[str, Any] | None = None,
                 params: dict[str, Any] | None = None) -> TrainConfig:
    """``train.<profile>`` of params.yaml, then ``train.<profile>.envs.<env>``, then ``overrides``."""
    params = load_params() if params is None else params
    profile = profile or params.get("curriculum", {}).get("profile", "smoke")
    section = dict(params.get("train", {}).get(profile) or {})
    if not section:
        raise ConfigError(f"params.yaml has no train.{profile} section")
    per_env = (section.pop("envs", None) or {}).get(env, {})
    try:
        return TrainConfig(**{**section, **per_env, **(overrides or {})})
    except ValidationError as err:
        raise ConfigError(f"train.{profile} (env {env}) in params.yaml, with overrides {overrides}: {err}") from err

"""The doors from settings to a stage's spec: one builder per stage kind, used by the CLI, the Prefect tasks, the
DVC stages and the benchmarks alike. A phase: :func:`phase_spec` (the pipeline's) and :func:`build_phase_spec` (what
both it and ``train-phase`` call); a warm start: :func:`warm_spec`; how checkpoints are sampled for a score:
:func:`eval_spec`, the one the evaluation stage and the promotion gates both take (the gate's own settings, its
items and margin, from :func:`~training.settings.config.gate_config`); the report: :func:`report_spec`.
Placement (``SCALINGINTER_DEVICE``) is applied inside them, once (``training.settings.config.train_config``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from training.settings.config import (
    MIXED,
    ConfigError,
    EvalConfig,
    PolicyServerConfig,
    ServerConfig,
    TrainConfig,
    base_model_dir,
    curriculum_config,
    eval_config,
    gate_config,
    load_params,
    mixed_components,
    policy_server_config,
    server_config,
    train_config,
)
from training.settings.curriculum import AdaptiveRule
from training.settings.layout import Run, report_file


def start_checkpoint(env: str, params: dict[str, Any], root: Path = Path("."), profile: str | None = None) -> Path:
    """What the first RL phase (and a fixed-h baseline) starts from: the last warm-start stage's checkpoint
    (``curriculum.<env>.profiles.<profile>.warm_start``), else the base model."""
    from training.settings.warm import checkpoint_of, pipeline_stages

    stages = pipeline_stages(curriculum_config(env, profile, params).warm_start) \
        if env in params.get("curriculum", {}) else []
    if not stages:
        return base_model_dir(params, root)
    return checkpoint_of(Run(env, root=root).warm(len(stages) - 1), stages[-1])


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
    servers: dict[str, ServerConfig] = {}  # a mixed run's (env a,b,c) server settings per environment (else server)
    policy_server: PolicyServerConfig = PolicyServerConfig()  # the vllm engine's server (train.engine: vllm)
    adaptive: AdaptiveRule | None = None  # the curriculum's adaptive mode (never on its last phase)
    stopped: bool = False  # a promotion gate ended the curriculum before this phase: it trains nothing


def phase_spec(env: str, index: int, root: Path, fixed_h: int | None = None) -> PhaseSpec:
    """Phase ``index`` of ``env``'s run in the working copy at ``root``: its h and steps from phases.yaml (the
    values its stage records), its settings from params.yaml, its folders from :mod:`training.settings.layout`.
    ``fixed_h``: the fixed-h baseline run instead (one phase at that h for the curriculum's total steps)."""
    params = load_params(root / "params.yaml")
    profile = params.get("curriculum", {}).get("profile", "smoke")
    run = Run(env, fixed_h, root)
    if fixed_h is None:
        table = _phases_file(root).get(env, {})
        if f"phase_{index}" not in table:
            raise ConfigError(f"phases.yaml has no {env}.phase_{index}: run `scalinginter pipeline`")
        row = table[f"phase_{index}"]
        h, steps = int(row["h"]), int(row["steps"])
        init = start_checkpoint(env, params, root, profile) if index == 0 else previous_checkpoint(env, index, root,
                                                                                                  params)
    else:  # from the same start as the curriculum, so the two compare fairly
        h, steps = fixed_h, curriculum_config(env, profile, params).total_steps
        init = start_checkpoint(env, params, root, profile)
    return build_phase_spec(env, index, h, steps, init, run.phase(index), params, profile,
                            adaptive=fixed_h is None, root=root)


def build_phase_spec(env: str, index: int, h: int, steps: int, init: Path, out: Path, params: dict[str, Any],
                     profile: str | None = None, overrides: dict[str, Any] | None = None, adaptive: bool = True,
                     root: Path = Path(".")) -> PhaseSpec:
    """The one builder of a phase's spec from settings: the pipeline's (:func:`phase_spec`) and the CLI's
    ``train-phase``. ``init``: a checkpoint, or a promotion gate's promotion.json (its checkpoint; a gate that
    ended the curriculum makes the phase train nothing); ``adaptive``: the curriculum's adaptive rule applies
    (in adaptive mode, never on the last phase); ``overrides``: TrainConfig fields over params.yaml's."""
    from training.placement.devices import training_nodes

    components = mixed_components(env, params)  # the mixed run trains on its environments, joined by commas
    train = train_config(env, profile, overrides, params)
    if train.engine == "vllm" and training_nodes() > 1:  # each node's ranks would sample from a server never synced
        raise ConfigError(f"train.engine vllm across nodes (SCALINGINTER_NNODES={training_nodes()}) is not "
                          f"supported: set train.<profile>.envs.{env}.engine: hf, or train the phase on one node")
    return PhaseSpec(env=",".join(components), index=index, h=h, steps=steps, init=resolve_init(init, root),
                     stopped=stopped(init, root), out=out, train=train,
                     server=server_config(env, params),
                     servers={e: server_config(e, params) for e in components} if len(components) > 1 else {},
                     policy_server=policy_server_config(params),
                     adaptive=adaptive_rule(env, index, profile, params) if adaptive else None)


def read_promotion(path: Path) -> dict[str, Any]:
    """A promotion gate's promotion.json (training.evaluation.gate); a missing one names the stage that writes it."""
    if not path.exists():
        gate = path.parent.name.replace("gate-", "")
        raise ConfigError(f"{path} not found: run the promotion gate of phase {gate} first "
                          f"(`dvc repro <env>_gate_{gate}`, or `scalinginter gate ENV --phase {gate}`)")
    return json.loads(path.read_text())


def resolve_init(init: Path, root: Path = Path(".")) -> Path:
    """A phase's ``--init``: a checkpoint folder, or a gate's promotion.json (the checkpoint it promoted)."""
    if init.name == "promotion.json":
        return root / read_promotion(init if init.is_absolute() else root / init)["checkpoint"]
    return init


def previous_checkpoint(env: str, index: int, root: Path, params: dict[str, Any]) -> Path:
    """What phase ``index`` > 0 starts from: the previous phase's gate's promotion.json (params.yaml ``gate``;
    :func:`resolve_init` reads the checkpoint it names), or, ungated, the previous phase's final checkpoint."""
    run = Run(env, root=root)
    return run.promotion(index - 1) if gate_config(env, params=params).enabled else run.final(index - 1)


def stopped(init: Path, root: Path = Path(".")) -> bool:
    """Whether ``init`` is a gate's promotion.json that ended the curriculum (``gate.on_reject: stop``)."""
    return init.name == "promotion.json" and bool(read_promotion(init if init.is_absolute() else root / init)["stop"])


def warm_spec(env: str, index: int, root: Path) -> tuple[Any, Path, Path]:
    """Warm-start stage ``index`` of ``env``'s run in the working copy at ``root``: (its typed settings from
    phases.yaml, the checkpoint it starts from, its folder)."""
    from training.settings.warm import checkpoint_of, parse_stage

    table = _phases_file(root).get(env, {})
    if f"warm_{index}" not in table:
        raise ConfigError(f"phases.yaml has no {env}.warm_{index}: add the stage to curriculum.{env}.profiles."
                          "<profile>.warm_start in params.yaml and run `scalinginter pipeline`")
    run = Run(env, root=root)
    init = (base_model_dir(load_params(root / "params.yaml"), root) if index == 0
            else checkpoint_of(run.warm(index - 1), parse_stage(table[f"warm_{index - 1}"])))
    try:
        stage = parse_stage(table[f"warm_{index}"])
    except ValidationError as err:
        raise ConfigError(f"phases.yaml {env}.warm_{index}: {err}") from err
    return stage, init, run.warm(index)


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


class EvalSpec(BaseModel):
    """How checkpoints are sampled for a score (the evaluation stage's and every promotion gate's): the
    evaluation's settings, the turn cap and the policy server (``engine: vllm``)."""

    model_config = ConfigDict(frozen=True)
    env: str
    config: EvalConfig
    h: int
    policy_server: PolicyServerConfig

    @field_validator("config")
    @classmethod
    def _budget_resolved(cls, config: EvalConfig) -> EvalConfig:
        config.budget  # noqa: B018 (refuses an unresolved budget, with the door to use)
        return config

    def sampling(self) -> dict[str, Any]:
        """``training.evaluation.evaluate``'s sampling arguments (the items, servers and batch size: the caller's)."""
        c = self.config
        return {"h": self.h, "k": c.k, "temperature": c.temperature, "max_new_tokens": c.max_new_tokens,
                "seed": c.seed, "context_budget": c.context_budget, "device": c.device,
                "policy_server": self.policy_server, "prefix_cache_gb": c.prefix_cache_gb}


def eval_spec(env: str, params: dict[str, Any], profile: str | None = None) -> EvalSpec:
    """``env``'s evaluation under ``profile`` (default: ``curriculum.profile``): ``eval.<profile>`` with its
    placement, and the turn cap, the curriculum's last h unless ``eval.h`` sets one (the same cap for the
    curriculum and its baselines, so runs compare)."""
    config = eval_config(env, profile, params)
    h = config.h or curriculum_config(env, profile, params).phases()[-1].h
    return EvalSpec(env=env, config=config, h=h, policy_server=policy_server_config(params))


class ReportSpec(BaseModel):
    """The report of a working copy: which environments' results it draws and the HTML file it writes."""

    model_config = ConfigDict(frozen=True)
    envs: list[str]
    out: Path
    root: Path


def report_spec(envs: list[str] | None, root: Path, out: Path | None = None) -> ReportSpec:
    """The report stage's spec: ``envs`` (default: every environment with a run under ``root``), each a known
    environment, written to ``out`` (default ``reports/<env>.html`` for one, ``reports/index.html`` for several)."""
    from envs.registry import ENVIRONMENTS

    known = (*ENVIRONMENTS, MIXED)  # the mixed run (one policy over several environments) has its report too
    if envs:
        unknown = [e for e in envs if e not in known]
        if unknown:
            raise ConfigError(f"unknown environment(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    else:
        envs = [e for e in known if Run(e, root=root).dir.exists()]
        if not envs:
            raise ConfigError(f"no run under {root / 'runs'} to report: run the pipeline first (`make run`)")
    return ReportSpec(envs=envs, out=out or report_file(envs, root), root=root)

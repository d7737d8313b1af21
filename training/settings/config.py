"""The one home of settings: params.yaml read in one place into validated, frozen pydantic models (the trainer's
``TrainConfig``, ``EvalConfig``, the environment servers' ``ServerConfig``, the curriculum's ``CurriculumConfig``
from ``training.settings.curriculum``), and the ``PhaseSpec`` a phase is trained from."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from envs.instances import IDLE_TTL_S, MAX_INSTANCES
from envs.paths import project_root
from training.guard import GuardConfig
from training.lora import LoraSettings
from training.placement.devices import placement
from training.settings.curriculum import CurriculumConfig
from training.settings.layout import base_model
from training.settings.warm import GROUP_BY_LENGTH_HELP, PREFIX_CACHE_GB, PREFIX_CACHE_HELP


class ConfigError(ValueError):
    """params.yaml is missing something or holds a bad value; the message names the key."""


class MixShare(BaseModel):
    """One environment's part in a mixed run (``train.mix.<env>``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    weight: float = Field(1.0, gt=0, description="its share of each step's items (by weight, at least one item)")
    max_h: int | None = Field(None, ge=1, description="its own turn cap: the phase's h clipped to it")
    sub_tasks: list[str] | None = Field(None, description="its items from these sub-tasks only")


#: how a mini-batch's tokens weigh in the policy loss (``training.rl.losses.loss_weights``)
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class TrainConfig(BaseModel):
    """Everything one curriculum phase needs besides its h and step count."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    algorithm: Literal["grpo", "rloo", "reinforce_pp", "ppo"] = Field(
        "grpo", description="the advantage estimator: GRPO (group-normalised), RLOO (leave-one-out), REINFORCE++ "
        "(batch-normalised returns) or PPO (GAE with a critic)")
    engine: Literal["hf", "vllm"] = Field("hf", description="who samples the rollouts: transformers' generate in "
                                          "this process, or a vLLM server fed the new weights after every update")
    strategy: Literal["torch", "deepspeed"] = Field("torch", description="who applies the loss to the weights: "
                                                    "plain torch, or DeepSpeed ZeRO over SCALINGINTER_NPROC ranks")
    zero_stage: int = Field(2, ge=1, le=3, description="DeepSpeed ZeRO stage (deepspeed strategy)")
    device: str = Field("cpu", description="auto, cpu, cuda[:N] or npu[:N]")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16 autocasts the forward passes (weights and optimizer stay float32)")
    seed: int = Field(0, description="seed of the item order, the sampling and the initialisation of new parts")
    # data
    split: str = Field("train", description="the split whose items train (data/<env>/<split>.json)")
    sub_tasks: list[str] | None = Field(None, description="train only on these sub-tasks (e.g. ['GoTo'])")
    mix: dict[str, MixShare] = Field(default_factory=dict, description="a mixed run's environments (--env a,b,c): "
                                     "each one's weight, turn cap and sub-tasks; weight 1, no cap where unnamed")
    items: list[str] | None = Field(None, description="train on exactly these item ids instead of the split "
                                    "(e.g. a curriculum's easy items); recorded with the checkpoint's config")
    batch_items: int = Field(4, ge=1, description="items per training step")
    n_samples: int = Field(4, ge=1, description="trajectories per item (the GRPO group)")
    # rollout
    max_new_tokens: int = Field(48, ge=1, description="tokens per assistant turn")
    context_budget: int = Field(2048, ge=16, description="tokens per trajectory, prompt and every "
                                "turn: a trajectory that would pass it ends, cut off")
    prefix_cache_gb: float = Field(PREFIX_CACHE_GB, ge=0, description=PREFIX_CACHE_HELP)
    max_trajectory_tokens: int | None = Field(None, ge=1, description="generated tokens per trajectory, all its "
                                              "turns together (None: no bound beyond h and the context clamp)")
    max_trajectory_seconds: float | None = Field(None, gt=0, description="wall-clock seconds per trajectory from "
                                                 "its reset, checked after each turn (None: unbounded)")
    rollout_mode: Literal["lockstep", "async"] = Field("lockstep", description="lockstep: rounds of one batched "
                                                       "generation and one batched step; async: each trajectory "
                                                       "moves on its own, generations batched by what is ready, "
                                                       "trajectories admitted as environment instances free (a step "
                                                       "may then hold more than the servers' capacity)")
    async_batch: int | None = Field(None, ge=1, description="async: most trajectories per generation call (None: "
                                    "all that are ready)")
    max_staleness: int = Field(0, ge=0, le=1, description="1: generate step t+1's rollout (on the vLLM server, "
                               "with the weights before step t's update) while step t updates; 0: on-policy")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollouts")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of the rollouts (1.0: the full distribution)")
    # update
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate of the policy")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay")
    mini_batch_size: int = Field(8, ge=1, description="trajectories per optimizer step")
    micro_batch_size: int = Field(8, ge=1, description="trajectories per forward/backward")
    ppo_epochs: int = Field(1, ge=1, description="passes over the step's mini-batches")
    logprob_chunk: int | None = Field(None, ge=1, description="compute the vocabulary projection, log-probs and "
                                      "entropy this many positions at a time, each chunk recomputed in the backward "
                                      "pass: a long context's [tokens x vocabulary] logits never exist whole (None: "
                                      "all positions at once)")
    gradient_checkpointing: bool = Field(False, description="recompute each layer's activations in the backward "
                                         "pass instead of keeping them: a long context's activations shrink from "
                                         "every layer's to one layer's, for ~1/3 more update time (same losses)")
    clip: float = Field(0.2, gt=0, description="PPO's clip range of the probability ratio")
    loss_agg: LossAggregation = Field("token-mean", description="how a mini-batch's tokens are weighed in the "
                                      "loss: token-mean (each token the same), seq-mean-token-mean (each trajectory "
                                      "the same) or seq-mean-token-sum-norm (each trajectory's token sum over "
                                      "max_new_tokens, Dr. GRPO); see training.rl.losses")
    kl_coef: float = Field(1e-3, ge=0, description="weight of the KL to the reference model (0: no reference pass)")
    kl_in_reward: bool = Field(False, description="subtract kl_coef * KL from rewards instead of a loss term")
    entropy_coef: float = Field(1e-3, ge=0, description="weight of the entropy bonus")
    grad_clip: float = Field(1.0, gt=0, description="clip the gradient's global norm to this")
    skip_flat_steps: bool = Field(False, description="a step whose advantages are all zero (every group flat) "
                                  "makes no update; otherwise (verl's behaviour) Adam steps full-size along the "
                                  "KL and entropy terms alone, which can wreck a small SFT'd policy")
    drop_flat_groups: bool = Field(False, description="GRPO/RLOO: leave the flat groups (every sample of the "
                                   "item scored the same, so zero advantage) out of stage 2 and the update, as "
                                   "DAPO's dynamic sampling does: the step's compute and its token-mean loss go to "
                                   "the groups that carry a signal; a step with none makes no update")
    grpo_norm_std: bool = Field(True, description="GRPO: divide each group's centred scores by their std (False: "
                                "centred only, as Dr. GRPO)")
    old_logprobs: Literal["sampler", "recompute"] = Field(
        "recompute", description="PPO's old log-probs: the sampler's, or the trainer's own at the step's weights "
        "(a forward pass of their own, left out when one optimizer step takes the whole batch: the update's own "
        "forward pass gives them then)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount of the returns (reinforce_pp, ppo)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE's lambda (ppo)")
    critic_lr: float = Field(1e-5, gt=0, description="AdamW learning rate of the critic (ppo)")
    lora: LoraSettings | None = Field(None, description="train LoRA adapters only (the base weights stay as they "
                                      "were); checkpoints hold the merged weights and the adapter in lora/")
    # checkpoints
    save_every: int = Field(1, ge=1, description="write an intra-phase checkpoint every N steps")
    keep_checkpoints: int = Field(2, ge=1, description="intra-phase checkpoints kept (the newest ones)")
    log_rollouts: bool = Field(True, description="write every step's trajectories to the phase's rollouts/ (JSONL)")
    guard: GuardConfig = Field(default_factory=GuardConfig, description="the collapse guard: signals watched per "
                               "step, and the rollback when one trips (training/guard.py)")
    failed_rollout_retries: int = Field(2, ge=0, description="a step whose every trajectory hit an environment "
                                        "error is rolled out again this many times (backoff 1, 2, 4 ... s), then "
                                        "the phase stops with an error (never a step of made-up zeros)")

    @model_validator(mode="after")
    def _batches(self) -> TrainConfig:
        if self.items is not None and (not self.items or self.sub_tasks):
            raise ValueError("items lists the item ids to train on: give a non-empty list, and no sub_tasks with "
                             "it (filter the list itself)")
        if self.drop_flat_groups and self.algorithm not in ("grpo", "rloo"):
            raise ValueError(f"drop_flat_groups applies to grpo and rloo, whose flat groups have zero advantage; "
                             f"{self.algorithm} gives them a signal: set drop_flat_groups false")
        if self.drop_flat_groups and self.kl_in_reward:
            raise ValueError("drop_flat_groups decides on the outcome rewards, which kl_in_reward changes per "
                             "token: use the KL loss (kl_in_reward false) with drop_flat_groups")
        if self.drop_flat_groups and self.strategy == "deepspeed":
            raise ValueError("drop_flat_groups leaves each rank a different number of trajectories, so the "
                             "ranks' gradient all-reduces would not line up: use it with the torch strategy")
        if self.lora is not None and self.strategy != "torch":
            raise ValueError("lora trains adapters with the torch strategy; DeepSpeed ZeRO shards full weights: set "
                             "strategy torch or lora null")
        if self.strategy == "deepspeed" and self.zero_stage == 3:
            raise ValueError("train_phase samples with the HF engine from full weights, which ZeRO-3 partitions: "
                             "use zero_stage 1 or 2 (ZeRO-3 is checked by training.strategy_check)")
        if self.max_staleness and (self.engine != "vllm" or self.old_logprobs != "sampler"
                                   or self.strategy != "torch"):
            raise ValueError("max_staleness 1 overlaps the next rollout with this update: it needs engine vllm (the "
                             "server keeps the older weights while the trainer changes its own), old_logprobs "
                             "sampler (the ratio against the log-probs the sampler used) and the torch strategy")
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError(f"mini_batch_size {self.mini_batch_size} must be a multiple of micro_batch_size "
                             f"{self.micro_batch_size}")
        return self


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


#: the pipeline's name for its run of one policy over several environments (params.yaml ``mixed.envs``)
MIXED = "mixed"


def mixed_components(env: str, params: dict[str, Any]) -> list[str]:
    """The environments ``env`` trains on: ``mixed.envs`` for the pipeline's ``mixed`` run, the names of a
    comma-joined ``env`` (``babyai,textcraft``), else ``[env]``."""
    if env == MIXED:
        names = list((params.get(MIXED) or {}).get("envs") or [])
        if len(names) < 2 or len(set(names)) != len(names):
            raise ConfigError(f"params.yaml mixed.envs must list two or more distinct environments, not {names}")
        return names
    return mixed_envs(env)


def mixed_envs(env: str) -> list[str]:
    """The environments of ``env`` (one name, or several joined by commas), in order, each once."""
    names = [e.strip() for e in env.split(",") if e.strip()]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"environments {env!r}: give one or more distinct names joined by commas")
    return names


def train_config(env: str, profile: str | None = None, overrides: dict[str, Any] | None = None,
                 params: dict[str, Any] | None = None) -> TrainConfig:
    """``train.<profile>`` of params.yaml, then ``train.<profile>.envs.<env>``, then ``overrides``; the device
    where a work pool places the work (``SCALINGINTER_DEVICE``: :func:`training.placement.devices.placement`) wins."""
    params = load_params() if params is None else params
    components = mixed_components(env, params)
    profile, values = _profile_values(params, "train", MIXED if len(components) > 1 else env, profile)
    values = {**values, **(overrides or {})}
    values["device"] = placement(values.get("device", "cpu"))
    if len(components) > 1:  # each environment keeps its own cap: curriculum.<env>.cap unless mix sets max_h
        caps = {e: (params.get("curriculum", {}).get(e) or {}).get("cap") for e in components}
        mix = {e: dict(v) for e, v in (values.get("mix") or {}).items()}
        for e, cap in caps.items():
            if cap is not None:
                mix.setdefault(e, {}).setdefault("max_h", cap)
        values["mix"] = mix
    try:
        return TrainConfig(**values)
    except ValidationError as err:
        raise ConfigError(f"train.{profile} (env {env}) in params.yaml, with overrides {overrides}: {err}") from err


class SFTConfig(BaseModel):
    """Supervised warm start settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    epochs: int = Field(3, ge=1)
    lr: float = Field(1e-3, gt=0)
    batch_size: int = Field(8, ge=1)
    max_tokens: int = Field(2048, ge=16, description="longest episode trained on, in tokens; longer ones are left "
                            "out and counted (a batch's logits take batch x tokens x vocabulary floats)")
    group_by_length: bool = Field(False, description=GROUP_BY_LENGTH_HELP)
    seed: int = 0
    device: str = "cpu"
    lora: LoraSettings | None = Field(None, description="train LoRA adapters only (merged into the checkpoint)")


class OutsideModel(BaseModel):
    """A model behind an OpenAI-compatible API, evaluated beside the run's checkpoints (its key comes from
    SCALINGINTER_API_KEY or OPENAI_API_KEY, never from params.yaml)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(description="the model's name on the server (e.g. gpt-4o)")
    url: str = Field(description="the server's base URL (e.g. https://api.openai.com/v1)")
    api: Literal["chat", "completions"] = Field("chat", description="chat: messages in, text out (any chat API); "
                                                "completions: token-id prompts (vLLM, SGLang), needs tokenizer")
    tokenizer: str | None = Field(None, description="completions: the served model's own tokenizer folder")
    concurrency: int = Field(4, ge=1, description="chat: requests in flight at most")
    retries: int = Field(5, ge=0, description="chat: repeats of a request answered 429/5xx or timed out")
    price_in: float | None = Field(None, ge=0, description="chat: US dollars per million prompt tokens")
    price_out: float | None = Field(None, ge=0, description="chat: US dollars per million completion tokens")

    @model_validator(mode="after")
    def _tokenizer_for_completions(self) -> OutsideModel:
        if self.api == "completions" and not self.tokenizer:
            raise ValueError(f"outside model {self.name}: api completions lays prompts out with the served model's "
                             "own chat template: give its tokenizer folder")
        return self


class EvalConfig(BaseModel):
    """How ``scalinginter eval`` samples: the same for every checkpoint of a run."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    items: int | None = Field(None, ge=1, description="first N test items (stratified split order); None: all")
    sub_tasks: list[str] | None = Field(None, description="only test items of these sub-tasks (e.g. ['GoTo']; the "
                                        "promotion gate's items too); None: every sub-task")
    k: int = Field(1, ge=1, description="samples per item (Avg@k, Pass@k)")
    temperature: float = Field(1.0, ge=0, description="0 is greedy (then k must be 1)")
    max_new_tokens: int = Field(48, ge=1, description="tokens per assistant turn")
    seed: int = Field(0, description="seed of the sampling")
    batch_items: int = Field(4, ge=1, description="items rolled out at once")
    h: int | None = Field(None, ge=1, description="turn cap; None: the last curriculum phase's h")
    context_budget: int | None = Field(None, ge=16, description="tokens per trajectory; None: the training "
                                       "profile's context_budget, so evaluation sees what training saw")
    device: str = Field("cpu", description="auto, cpu, cuda[:N] or npu[:N] (SCALINGINTER_DEVICE wins: placement)")
    engine: Literal["hf", "vllm"] = Field("hf", description="who samples: transformers' generate, or a vLLM server "
                                          "loaded with each checkpoint in turn (verified by the probe)")
    prefix_cache_gb: float = Field(PREFIX_CACHE_GB, ge=0, description=PREFIX_CACHE_HELP)
    outside: list[OutsideModel] = Field(default_factory=list, description="models behind an API the evaluation "
                                        "stage also evaluates on the same items (`scalinginter eval-outside`)")

    @property
    def budget(self) -> int:
        """The context budget, resolved (:func:`eval_config` takes the training profile's when it is not set)."""
        if self.context_budget is None:
            raise ValueError("the evaluation's context_budget is unresolved: read the settings with eval_config(), "
                             "which takes the training profile's when eval.<profile>.context_budget is not set")
        return self.context_budget


def eval_config(env: str, profile: str | None = None, params: dict[str, Any] | None = None) -> EvalConfig:
    """``eval.<profile>`` of params.yaml, then ``eval.<profile>.envs.<env>``."""
    params = load_params() if params is None else params
    profile, values = _profile_values(params, "eval", env, profile)
    if values.get("context_budget") is None:
        values["context_budget"] = train_config(env, profile, params=params).context_budget
    values["device"] = placement(values.get("device", "cpu"))  # machine placement, from a work pool
    try:
        config = EvalConfig(**values)
    except ValidationError as err:
        raise ConfigError(f"eval.{profile} (env {env}) in params.yaml: {err}") from err
    if config.temperature == 0 and config.k != 1:
        raise ConfigError(f"eval.{profile}: temperature 0 (greedy) gives k identical samples; set k: 1")
    return config


class GateConfig(BaseModel):
    """A promotion gate at every phase boundary (params.yaml ``gate.<profile>``; ``training.evaluation.gate``): the
    phase's final checkpoint against its parent on the gate items, sampled as the evaluation samples (its engine, k,
    temperature, turn cap and context budget)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    enabled: bool = Field(True, description="false: every phase hands its final checkpoint on, ungated")
    items: int | None = Field(16, ge=1, description="first N gate items (data/<env>/gate.json, stratified order); "
                              "None: all")
    metric: Literal["success", "reward"] = Field("success", description="what is compared, per item and sample")
    margin: float = Field(0.05, ge=0, description="how much worse than its parent a phase may score and still be "
                          "promoted (0.05: 5 points of success)")
    rule: Literal["point", "interval"] = Field(
        "point", description="point: promoted when the mean paired difference is >= -margin; interval: promoted "
        "unless the whole 95% interval lies below -margin (rejects only a fall the gate items show)")
    on_reject: Literal["retry", "stop", "mark"] = Field(
        "retry", description="retry: train the phase again from its best intra-phase checkpoint at lr x lr_factor "
        "(max_retries times; then the parent is promoted); stop: promote the parent and end the curriculum; "
        "mark: promote the phase anyway, marked")
    max_retries: int = Field(1, ge=1, le=5, description="on_reject retry: trainings again before the "
                             "parent is promoted")
    lr_factor: float = Field(0.1, gt=0, lt=1, description="on_reject retry: the learning rate's factor")
    resamples: int = Field(2000, ge=100, description="bootstrap resamples of the interval")
    cap: Literal["final", "phase"] = Field(
        "final", description="the turn cap of the gate's episodes: final: the evaluation's (the last phase's h: what "
        "the run is for, so every phase is judged where the run ends); phase: the phase's own h (a phase at a small h "
        "judged where it trained; the parent is then scored again at each gate's cap)")


def gate_config(env: str, profile: str | None = None, params: dict[str, Any] | None = None) -> GateConfig:
    """``gate.<profile>`` of params.yaml, then ``gate.<profile>.envs.<env>``; no section: no gate."""
    params = load_params() if params is None else params
    profile = profile or params.get("curriculum", {}).get("profile", "smoke")
    if not (params.get("gate") or {}).get(profile):
        return GateConfig(enabled=False)
    _, values = _profile_values(params, "gate", env, profile)
    try:
        config = GateConfig(**values)
    except ValidationError as err:
        raise ConfigError(f"gate.{profile} (env {env}) in params.yaml: {err}") from err
    return config


class ServerConfig(BaseModel):
    """An environment server the pipeline starts itself (params.yaml ``env_server``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    host: str = Field("127.0.0.1", description="interface to bind; 0.0.0.0 also serves other machines")
    max_instances: int = Field(MAX_INSTANCES, ge=1, description="live instances at once (429 beyond)")
    idle_ttl_s: float = Field(IDLE_TTL_S, gt=0, description="idle instances are reaped after this many seconds")
    replicas: int = Field(1, ge=1, le=64, description="servers of the environment started side by side; rollouts "
                          "spread their trajectories over them by capacity and survive losing one")
    options: dict[str, str | int | float | bool] = Field(default_factory=dict,
                                                         description="the environment's backend options")

    def launch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``envs.launcher.start_server``."""
        return {"host": self.host, "max_instances": self.max_instances, "idle_ttl_s": self.idle_ttl_s,
                "replicas": self.replicas, **self.options}


def server_config(env: str, params: dict[str, Any] | None = None) -> ServerConfig:
    """``env_server`` of params.yaml with ``env_server.backend_options.<env>`` as the options."""
    params = load_params() if params is None else params
    section = dict(params.get("env_server") or {})
    options = (section.pop("backend_options", None) or {}).get(env) or {}
    try:
        return ServerConfig(**section, options=options)
    except ValidationError as err:
        raise ConfigError(f"env_server in params.yaml (env {env}): {err}") from err


class PolicyServerConfig(BaseModel):
    """The vLLM server of the ``vllm`` engine (params.yaml ``policy_server``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the served weights' dtype")
    max_model_len: int | None = Field(None, ge=16, description="tokens per sequence; None: the context budget plus "
                                      "one turn's new tokens")
    probe_tolerance: float = Field(1e-3, gt=0, description="max abs difference of the server's and the trainer's "
                                   "log-probs of the probe sequence after a weight sync (1e-3 holds in float32)")
    enforce_eager: bool = Field(False, description="true: no compilation (torch.compile on CPU, CUDA graphs on GPU): "
                                "the server starts sooner (~25 s on 2 CPU cores) and decodes slower (~1.3x here)")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="share of a GPU the server may take (the "
                                          "trainer shares it)")
    cpu_kv_cache_gb: int = Field(1, ge=1, description="KV cache of a CPU server in GiB (VLLM_CPU_KVCACHE_SPACE)")
    cpu_threads_bind: str = Field(
        "auto", pattern=r"^(auto|all|nobind|[0-9][0-9,\-|]*)$",
        description="with cpu_executor: mp, the cores a CPU server's worker threads run on "
        "(VLLM_CPU_OMP_THREADS_BIND): `auto` (vLLM's: "
        "one core kept for its scheduler and API server), `all` (every core this process may use: on a small "
        "machine faster for a real model, slower for the tiny one), `nobind`, or a CPU list such as `0-3`")
    cpu_executor: Literal["uni", "mp"] = Field(
        "uni", description="where a CPU server's model runs: `uni` in its engine core's process (no worker process, "
        "so no shared-memory queue between them, whose readers spin for a second after every message and took a "
        "core from the environments and the trainer: lock-step SciWorld rollouts ~2.4x faster on 2 cores); `mp` in a "
        "worker process of its own, vLLM's CPU default, the one `cpu_threads_bind` binds")
    startup_timeout_s: float = Field(300.0, gt=0, description="seconds the server may take to answer /health")
    extra_args: list[str] = Field(default_factory=list, description="more `vllm serve` arguments")
    replicas: int = Field(1, ge=1, description="servers of the policy side by side (data parallel, as OpenRLHF's "
                          "vllm_num_engines): each on its own GPU (NPU), or on a CPU its own share of the cores; "
                          "requests go to the least busy, every weight sync reaches them all")
    placement: Literal["shared", "own"] = Field(
        "shared", description="where a GPU/NPU server runs: `shared` on the training ranks' devices (the first "
        "replicas' share gpu_memory_utilization of a rank's device), `own` on devices of its own after the ranks' "
        "(SCALINGINTER_NPROC ranks on devices 0..N-1, the replicas on N, N+1 ...); no effect on a CPU")
    weight_transfer: Literal["disk", "collective"] = Field(
        "disk", description="how a weight sync reaches the server: `disk` saves a checkpoint folder it loads in "
        "place (a file system both see); `collective` broadcasts the tensors over a process group of the trainer "
        "and the server's workers (gloo on CPU, NCCL on CUDA, HCCL on Ascend), nothing written")
    weight_transfer_host: str = Field("127.0.0.1", description="collective transfer: the trainer's address as the "
                                      "server's workers reach it")

    @model_validator(mode="after")
    def _replicas_sync_by_disk(self) -> PolicyServerConfig:
        if self.replicas > 1 and self.weight_transfer == "collective":
            raise ValueError(f"replicas: {self.replicas} sync their weights by disk (each loads the same checkpoint "
                             "folder); the collective transfer forms one group with one server's workers: set "
                             "weight_transfer: disk, or replicas: 1")
        return self

    @model_validator(mode="after")
    def _bind_needs_a_worker(self) -> PolicyServerConfig:
        if self.cpu_executor == "uni" and self.cpu_threads_bind != "auto":
            raise ValueError(f"cpu_threads_bind: {self.cpu_threads_bind} binds the threads of a CPU server's worker "
                             "process, which only cpu_executor: mp has (uni runs the model in the engine core, whose "
                             "threads vLLM leaves unbound): set cpu_executor: mp, or cpu_threads_bind: auto")
        return self

    def max_len(self, context_budget: int, max_new_tokens: int) -> int:
        return self.max_model_len or context_budget + max_new_tokens


def policy_server_config(params: dict[str, Any] | None = None) -> PolicyServerConfig:
    """``policy_server`` of params.yaml (defaults when absent)."""
    params = load_params() if params is None else params
    try:
        return PolicyServerConfig(**(params.get("policy_server") or {}))
    except ValidationError as err:
        raise ConfigError(f"policy_server in params.yaml: {err}") from err


def base_model_dir(params: dict[str, Any], root: Path = Path(".")) -> Path:
    """The base model every run starts from: ``models/<model.preset>``."""
    return base_model(str(params.get("model", {}).get("preset", "tiny")), root)

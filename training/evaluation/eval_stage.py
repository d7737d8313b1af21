"""The evaluation stage (``<env>_eval``, ``scalinginter eval``): the base model and every checkpoint of a run on
the same test items.

Writes ``runs/<env>/eval/metrics.json`` (DVC metrics: Avg@k, Pass@k and success rate with 95% bootstrap
CIs, overall and per sub-task, for each checkpoint) and ``per_item.json`` (every sample's success and
reward, for paired comparisons). Sampling settings come from params.yaml ``eval.<profile>``. The stage's
command, the CLI and the Prefect flow (in its own process, ``tasks.pipeline.evaluate_run``) all call
:func:`run_eval`; :mod:`training.evaluation.evaluate` does the sampling and the statistics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from envs.client import server_capacity
from envs.files import atomic_write
from envs.launcher import running_replicas
from envs.paths import project_root
from envs.splits import load_split
from training.checkpoint import read_manifest
from training.engines.vllm_server import running_vllm
from training.evaluation.evaluate import ChatSettings, evaluate_checkpoints, evaluate_mixed_checkpoints
from training.settings.config import (
    MIXED,
    ConfigError,
    OutsideModel,
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
from training.settings.layout import Run
from training.settings.specs import EvalSpec, eval_spec, read_promotion


def checkpoints(env: str, profile: str | None = None, root: Path | None = None, baseline: int | None = None
                ) -> dict[str, Path]:
    """``{"base": models/<preset>, "warm-0-sft": .../final, "phase-0": .../final, ...}``: every checkpoint of the
    run, in order: the base model, each warm-start stage's (training.settings.warm), each phase's (of the
    fixed-h baseline run when ``baseline`` is its h)."""
    from training.settings.warm import checkpoint_of, pipeline_stages

    root = root or project_root()
    params = load_params(root / "params.yaml")
    curriculum = curriculum_config(env, profile, params)
    phases = curriculum.phases()
    out = {"base": base_model_dir(params, root)}
    for k, stage in enumerate(pipeline_stages(curriculum.warm_start)):
        out[f"warm-{k}-{stage.method}"] = checkpoint_of(Run(env, root=root).warm(k), stage)
    if baseline is not None:
        out[f"fixed-h{baseline}"] = Run(env, baseline, root).final(0)
        stage = f"{env}_fixed_h{baseline}"
    else:
        gated = gate_config(env, profile, params).enabled
        for phase in phases:
            out[f"phase-{phase.index}"] = Run(env, root=root).final(phase.index)
            promotion = Run(env, root=root).promotion(phase.index)
            if gated and promotion.exists():  # a retry its gate promoted is one of the run's too
                decision = read_promotion(promotion)
                if decision["decision"].startswith("retry-"):
                    out[f"gate-{phase.index}-{decision['decision']}"] = root / decision["checkpoint"]
        stage = f"{env}_phase_{len(phases) - 1}"
    missing = [f"{name} ({path})" for name, path in out.items() if not (path / "config.json").exists()]
    if missing:
        raise ConfigError(f"checkpoints not found: {', '.join(missing)}; train them first "
                          f"(`dvc repro {stage}`{'' if baseline else f' or `scalinginter run --env {env}`'})")
    return out


def stratified_head(records: list[dict[str, Any]], n: int | None) -> list[dict[str, Any]]:
    """The first ``n`` records taken round-robin over sub-tasks (every sub-task shows up early); all if None."""
    if n is None or n >= len(records):
        return records
    groups: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(record.get("sub_task", "all"), []).append(record)
    out: list[dict[str, Any]] = []
    while len(out) < n:
        for group in groups.values():
            if group and len(out) < n:
                out.append(group.pop(0))
    return out


def test_items(env: str, config: Any, split: str = "test", data: Path | None = None) -> list[dict[str, Any]]:
    """The items ``config`` (an ``EvalConfig``) evaluates from ``split``: its ``sub_tasks`` only (all when None),
    then the first ``items`` of them round-robin over sub-tasks."""
    rows = load_split(env, split, data)
    if config.sub_tasks:
        rows = [r for r in rows if r.get("sub_task") in config.sub_tasks]
        if not rows:
            raise ConfigError(f"eval.<profile>.envs.{env}.sub_tasks {config.sub_tasks}: the {env} {split} split holds "
                              f"no item of these sub-tasks; name ones data/{env}/{split}.json has, or remove it")
    return stratified_head(rows, config.items)


def run_eval(env: str, profile: str | None = None, url: str | None = None, root: Path | None = None,
             progress: Callable[[str], None] | None = None, baseline: int | None = None,
             policy_url: str | None = None) -> dict[str, Any]:
    """Evaluate every checkpoint of ``env``'s run (or of its fixed-h ``baseline``); write metrics.json and
    per_item.json; return the metrics. ``url``: environment servers that already run (else started here);
    ``policy_url``: a vLLM server that already runs, for ``engine: vllm`` (else ``SCALINGINTER_VLLM_URL``, else
    started here on the first checkpoint)."""
    root = root or project_root()
    params = load_params(root / "params.yaml")
    spec = eval_spec(env, params, profile)
    config = spec.config
    folders = checkpoints(env, profile, root, baseline)
    if env == MIXED:
        result = _run_mixed_eval(params, profile, spec, url, folders, progress)
    else:
        result = _run_single_eval(env, params, spec, url, folders, progress, policy_url)
    for name, folder in folders.items():
        manifest = folder / "manifest.json"
        result["checkpoints"][name]["hash"] = read_manifest(folder)["hash"] if manifest.exists() else None
        result["checkpoints"][name]["path"] = str(folder.relative_to(root))
    if config.outside and baseline is None and env != MIXED:  # models behind an API, on the same items
        result["outside"] = run_outside_models(env, profile, url, root)
    run = Run(env, baseline, root)
    run.eval_dir.mkdir(parents=True, exist_ok=True)
    per_item = {name: c.pop("per_item") for name, c in result["checkpoints"].items()}
    _write(run.eval_per_item, per_item)
    _write(run.eval_metrics, result)
    _write(run.eval_summary, eval_summary(result))
    return result


def run_outside_models(env: str, profile: str | None = None, url: str | None = None, root: Path | None = None
                       ) -> dict[str, dict[str, Any]]:
    """Every model of ``eval.<profile>.outside`` (params.yaml) through :func:`run_outside_eval`, by name."""
    root = root or project_root()
    params = load_params(root / "params.yaml")
    return {m.name: run_outside_eval(env, m.url, m.name, Path(m.tokenizer) if m.tokenizer else
                                     base_model_dir(params, root), profile, url, root, chat=_chat_settings(m))
            for m in eval_config(env, profile, params).outside}


def _chat_settings(model: OutsideModel) -> ChatSettings | None:
    return ChatSettings(concurrency=model.concurrency, retries=model.retries, price_in=model.price_in,
                        price_out=model.price_out) if model.api == "chat" else None


def eval_summary(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The evaluation's headline: each checkpoint's success, Avg@k and Pass@k, so that `dvc metrics show` reads as
    one short row (the per-sub-task detail stays in metrics.json, the report and the plots)."""
    return {name: {key: c[key] for key in ("success", "avg_at_k", "pass_at_k") if key in c}
            for name, c in result["checkpoints"].items()}


def _run_single_eval(env: str, params: dict[str, Any], spec: EvalSpec, url: str | None,
                     folders: dict[str, Path], progress: Callable[[str], None] | None,
                     policy_url: str | None = None) -> dict[str, Any]:
    items = test_items(env, spec.config)
    first = next(iter(folders.values()))
    with eval_servers(env, params, spec.config, url, policy_url, first) as (base, served, batch):
        return evaluate_checkpoints(folders, env, base, items, batch_items=batch(), progress=progress,
                                    policy_url=served, **spec.sampling())


def mixed_caps(params: dict[str, Any], profile: str | None, config: Any, h: int) -> dict[str, int]:
    """The mixed run's turn cap per environment: the run's ``h`` clipped to each one's ``max_h`` (as in training),
    for sampling as ``config`` (an EvalConfig) says; what the mixed run cannot sample is refused here, once."""
    if config.engine == "vllm":
        raise ConfigError("the mixed run evaluates with the hf engine only (eval.<profile>.envs.mixed.engine: hf)")
    if config.sub_tasks:
        raise ConfigError("the mixed run evaluates every sub-task of each environment: remove "
                          "eval.<profile>.envs.mixed.sub_tasks")
    caps = {e: s.max_h for e, s in train_config(MIXED, profile, params=params).mix.items()}
    return {e: min(h, caps.get(e) or h) for e in mixed_components(MIXED, params)}


@contextlib.contextmanager
def eval_servers(env: str, params: dict[str, Any], config: Any, url: str | None, policy_url: str | None,
                 first: Path) -> Iterator[tuple[str, str | None, Callable[[], int]]]:
    """(environment URL, vLLM URL or None, how many items to roll out at once) for sampling as ``config`` (an
    EvalConfig) says: the servers given, else started here on ``first`` and stopped after (the evaluation stage and the
    promotion gates). The vLLM server is the one ``engine: vllm`` loads each checkpoint into. The mixed run: each
    of its environments' servers, as ``env=URL;...`` text, and the configured batch."""
    from envs.urls import ServerUrls

    with contextlib.ExitStack() as stack:
        if env == MIXED:
            envs = mixed_components(MIXED, params)
            started = {} if url else {e: stack.enter_context(running_replicas(e, **server_config(e, params)
                                                                              .launch_kwargs())) for e in envs}
            yield ServerUrls.parse(url or started, envs).text(), None, lambda: config.batch_items
            return
        base = url or stack.enter_context(running_replicas(env, **server_config(env, params).launch_kwargs()))
        @functools.cache
        def batch_items() -> int:  # asked when sampling starts (a run answered from a cache asks no server)
            # k live instances per item; a simulator or browser pool bounds how many items run at once
            capacity = server_capacity(base)
            return config.batch_items if not capacity else max(1, min(config.batch_items, capacity // config.k))

        served = None
        if config.engine == "vllm":  # one server, loaded with each checkpoint in turn
            server = policy_server_config(params)
            served = policy_url or os.environ.get("SCALINGINTER_VLLM_URL") or stack.enter_context(
                running_vllm(first, server, server.max_len(config.context_budget, config.max_new_tokens)))
        yield base, served, batch_items


def _run_mixed_eval(params: dict[str, Any], profile: str | None, spec: EvalSpec, url: str | None,
                    folders: dict[str, Path], progress: Callable[[str], None] | None) -> dict[str, Any]:
    """The mixed run's checkpoints on every environment's own test items, each at the run's h clipped to that
    environment's cap (as in training)."""
    from envs.urls import ServerUrls

    config = spec.config
    caps = mixed_caps(params, profile, config, spec.h)
    with eval_servers(MIXED, params, config, url, None, next(iter(folders.values()))) as (base, _, _):
        urls = ServerUrls.parse(base, list(caps))
        parts = {e: (urls.replicas(e), stratified_head(load_split(e, "test"), config.items), h)
                 for e, h in caps.items()}
        # the spec's sampling, each environment at its own h (in parts), on this process's hf engine
        sampling = {k: v for k, v in spec.sampling().items() if k not in ("h", "policy_server")}
        return evaluate_mixed_checkpoints(folders, parts, batch_items=config.batch_items, progress=progress,
                                          **sampling)


def run_outside_eval(env: str, policy_url: str, model: str, tokenizer_dir: Path, profile: str | None = None,
                     url: str | None = None, root: Path | None = None, chat: ChatSettings | None = None
                     ) -> dict[str, Any]:
    """Evaluate an outside model on the items, seed, k, temperature and h our checkpoints are evaluated with
    (params.yaml ``eval.<profile>``); the API key comes from SCALINGINTER_API_KEY (or OPENAI_API_KEY) and is
    never written anywhere. ``chat``: through an OpenAI-compatible chat API, its answers cached in
    ``runs/<env>/eval/outside/<model>.cache.jsonl`` unless ``chat.cache`` names another file. Writes and returns
    ``runs/<env>/eval/outside/<model>.json``."""
    from training.evaluation.evaluate import evaluate_outside, summarise

    root = root or project_root()
    params = load_params(root / "params.yaml")
    spec = eval_spec(env, params, profile)  # the items, seed, k, temperature and h the checkpoints get
    config, h = spec.config, spec.h
    items = test_items(env, config)
    key = os.environ.get("SCALINGINTER_API_KEY") or os.environ.get("OPENAI_API_KEY")
    path = Run(env, root=root).eval_outside(model)
    if chat is not None and chat.cache is None:
        chat = dataclasses.replace(chat, cache=path.with_suffix(".cache.jsonl"))
    with contextlib.ExitStack() as stack:
        base = url or stack.enter_context(running_replicas(env, **server_config(env, params).launch_kwargs()))
        # the spec's sampling but for where the model runs (the outside server) and its prefix cache
        sampling = {k: v for k, v in spec.sampling().items() if k not in ("device", "policy_server", "prefix_cache_gb")}
        result = evaluate_outside(policy_url, model, tokenizer_dir, env, base, [r["item_id"] for r in items],
                                  batch_items=config.batch_items, api_key=key, chat=chat, **sampling)
    out = {"env": env, "model": model, "server": policy_url, "api": "chat" if chat else "completions",
           "h": h, "k": config.k, "temperature": config.temperature, "seed": config.seed, "items": len(items),
           **summarise(result, {r["item_id"]: r.get("sub_task", "all") for r in items})}
    out.pop("per_item")
    if result.api is not None:
        out["usage"] = result.api
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, out)
    return out


def _write(path: Path, data: Any) -> None:
    atomic_write(path, json.dumps(data, indent=1))

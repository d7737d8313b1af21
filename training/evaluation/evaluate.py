"""Evaluation of a policy on a task split: success and reward per item, with bootstrap CIs.

Avg@k is the mean normalised reward over k samples per item; Pass@k the share of items with at least
one success among k samples; success rate the share of trajectories that meet the environment's own
success criterion. Greedy evaluation is temperature 0 with k = 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from envs.urls import ServerUrls
from training.checkpoint import MANIFEST, read_manifest
from training.model import load_policy
from training.placement.devices import resolve_device
from training.rollouts.rollout import Rollout, RolloutConfig
from training.sampler import build_sampler
from training.settings.config import PolicyServerConfig


def bootstrap_ci(values: list[float], resamples: int = 2000, level: float = 0.95, seed: int = 0
                 ) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean."""
    if not values:
        return (0.0, 0.0)
    rng = np.random.default_rng(seed)
    data = np.asarray(values, dtype=float)
    means = data[rng.integers(0, len(data), size=(resamples, len(data)))].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(low), float(high)


def paired_difference_ci(before: list[float], after: list[float], resamples: int = 2000, level: float = 0.95,
                         seed: int = 0) -> tuple[float, float, float]:
    """(mean difference, low, high): percentile bootstrap of ``after - before`` over paired items.

    Resampling items (not outcomes) keeps each item's before and after together, so the interval reflects
    the change on the same tasks; an interval above 0 means a significant improvement at ``level``.
    """
    if len(before) != len(after):
        raise ValueError(f"paired samples differ in length: {len(before)} vs {len(after)}")
    diff = [b - a for a, b in zip(before, after, strict=True)]
    low, high = bootstrap_ci(diff, resamples, level, seed)
    return float(np.mean(diff)) if diff else 0.0, low, high


@dataclass
class EvalResult:
    """Per-item outcomes of an evaluation."""

    success: dict[str, list[bool]]
    reward: dict[str, list[float]]
    turns: dict[str, list[int]] = field(default_factory=dict)  # per item, per sample: turns taken
    termination: dict[str, list[str]] = field(default_factory=dict)  # per item, per sample: what ended it
    generated_tokens: int = 0
    prefix_reused_tokens: int = 0  # hf engine: prompt tokens whose KV came from the conversation's last turn
    api: dict[str, Any] | None = None  # a chat API's requests, cache hits, retries, tokens and cost

    @property
    def success_rate(self) -> float:
        flat = [s for v in self.success.values() for s in v]
        return sum(flat) / max(len(flat), 1)

    def success_ci(self) -> tuple[float, float]:
        return bootstrap_ci([float(np.mean(v)) for v in self.success.values()])

    def item_success(self) -> list[float]:
        """Per-item success rate, in item order (for paired comparisons)."""
        return [float(np.mean(v)) for v in self.success.values()]

    @property
    def avg_at_k(self) -> float:
        return float(np.mean([np.mean(v) for v in self.reward.values()])) if self.reward else 0.0

    @property
    def pass_at_k(self) -> float:
        return float(np.mean([any(v) for v in self.success.values()])) if self.success else 0.0


def evaluate(model_dir: Path, env: str, url: ServerUrls | str | Sequence[str], item_ids: list[str], h: int, k: int = 1,
             temperature: float = 0.0, max_new_tokens: int = 48, seed: int = 0, batch_items: int = 4,
             context_budget: int = 8192, device: str = "cpu", policy_url: str | None = None,
             policy_server: PolicyServerConfig | None = None, prefix_cache_gb: float = 0.0) -> EvalResult:
    """Roll out ``k`` samples per item at turn cap ``h`` (and at most ``context_budget`` tokens, as in training)
    with the model on ``device``, and collect success and reward. With ``policy_url`` (the vllm engine), the vLLM
    server there is loaded with ``model_dir`` (as ``policy_server.weight_transfer`` says) and verified against it
    by the probe, then samples."""
    if (Path(model_dir) / MANIFEST).exists():  # a checkpoint: verified (once per process) before it is loaded
        read_manifest(Path(model_dir), verify=True)
    torch_device = resolve_device(device)
    model, tokenizer = load_policy(model_dir, torch_device)
    model.eval()
    sampler = build_sampler(model, tokenizer, Path(model_dir), policy_url=policy_url, server=policy_server,
                            device=torch_device, prefix_cache_gb=prefix_cache_gb)
    config = RolloutConfig(n_samples=k, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                           context_budget=context_budget)
    try:
        result = _collect(Rollout(env, url, sampler.engine, tokenizer, config), item_ids, h, batch_items)
        cache = sampler.prefix_cache
        result.prefix_reused_tokens = cache.reused_tokens if cache is not None else 0
        return result
    finally:
        sampler.close()


def _collect(rollout: Rollout, item_ids: list[str], h: int, batch_items: int) -> EvalResult:
    out = EvalResult({i: [] for i in item_ids}, {i: [] for i in item_ids}, {i: [] for i in item_ids},
                     {i: [] for i in item_ids})
    for start in range(0, len(item_ids), batch_items):  # a batch at a time: servers bound live instances
        result = rollout.run(item_ids[start:start + batch_items], h)
        errors = [t for t in result.trajectories if not t.valid]
        if errors:
            raise RuntimeError(f"{len(errors)} evaluation trajectories hit environment errors "
                               f"(first: {errors[0].error}); evaluation results would be biased")
        out.generated_tokens += result.generated_tokens
        for t in result.trajectories:
            out.success[t.item_id].append(t.success)
            out.reward[t.item_id].append(t.reward)
            out.turns[t.item_id].append(len(t.turns))
            out.termination[t.item_id].append(str(t.termination))
    return out


def evaluate_outside(policy_url: str, model: str, tokenizer_dir: Path, env: str, url: str, item_ids: list[str],
                     h: int, k: int = 1, temperature: float = 0.0, max_new_tokens: int = 48, seed: int = 0,
                     batch_items: int = 4, context_budget: int = 8192, api_key: str | None = None,
                     chat: ChatSettings | None = None) -> EvalResult:
    """An outside model at ``policy_url`` under the name ``model``, on the same rollout and metrics as our
    checkpoints. Without ``chat``: a server that takes token-id prompts (vLLM, SGLang), the prompts laid out with the
    chat template of ``tokenizer_dir`` (the served model's own tokenizer). With ``chat``: any OpenAI-compatible chat
    API (messages in, text out; ``training.engines.chat_engine``), ``tokenizer_dir`` then only counting the context
    budget (the project's tokenizer will do); its requests, cache hits, retries, tokens and cost in the result's
    ``api``. ``api_key`` is sent as a bearer token and never logged."""
    from transformers import AutoTokenizer

    from training.engines.vllm_engine import VLLMEngine

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), padding_side="left")
    engine: Any
    if chat is None:
        engine = VLLMEngine(policy_url, tokenizer.eos_token_id, model=model, api_key=api_key)
    else:
        from training.engines.chat_engine import ChatEngine

        engine = ChatEngine(policy_url, model, tokenizer.eos_token_id, api_key=api_key, concurrency=chat.concurrency,
                            retries=chat.retries, backoff_s=chat.backoff_s, timeout_s=chat.timeout_s,
                            cache=chat.cache)
    config = RolloutConfig(n_samples=k, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                           context_budget=context_budget)
    try:
        result = _collect(Rollout(env, url, engine, tokenizer, config), item_ids, h, batch_items)
    finally:
        engine.close()
    if chat is not None:
        result.api = engine.usage.as_dict(chat.price_in, chat.price_out)
    return result


@dataclass(frozen=True)
class ChatSettings:
    """How a chat API is asked (``scalinginter eval-outside --api chat``)."""

    concurrency: int = 4
    retries: int = 5
    backoff_s: float = 1.0
    timeout_s: float = 120.0
    cache: Path | None = None  # the response cache's JSONL file
    price_in: float | None = None  # US dollars per million prompt tokens
    price_out: float | None = None  # ... per million completion tokens


def _summary(success: list[list[bool]], reward: list[list[float]]) -> dict[str, Any]:
    """Avg@k, Pass@k and success rate of a set of items, each with its 95% bootstrap CI."""
    per_item_success = [float(np.mean(s)) for s in success]
    per_item_reward = [float(np.mean(r)) for r in reward]
    per_item_pass = [float(any(s)) for s in success]
    out: dict[str, Any] = {"items": len(success)}
    for name, values in (("success", per_item_success), ("avg_at_k", per_item_reward), ("pass_at_k", per_item_pass)):
        low, high = bootstrap_ci(values)
        out[name] = round(float(np.mean(values)), 6) if values else 0.0
        out[f"{name}_ci95"] = [round(low, 6), round(high, 6)]
    return out


def summarise(result: EvalResult, sub_tasks: dict[str, str]) -> dict[str, Any]:
    """Overall and per-sub-task metrics of one evaluation (``sub_tasks`` maps item id to its sub-task)."""
    items = list(result.success)
    out = _summary([result.success[i] for i in items], [result.reward[i] for i in items])
    groups: dict[str, list[str]] = {}
    for item in items:
        groups.setdefault(sub_tasks.get(item, "all"), []).append(item)
    out["sub_tasks"] = {name: _summary([result.success[i] for i in group], [result.reward[i] for i in group])
                        for name, group in sorted(groups.items())}
    out["per_item"] = {i: {"success": result.success[i], "reward": result.reward[i]} for i in items}
    return out


def evaluate_checkpoints(checkpoints: dict[str, Path], env: str, url: str, items: list[dict[str, Any]], h: int,
                         k: int, temperature: float, max_new_tokens: int, seed: int, batch_items: int = 4,
                         progress: Callable[[str], None] | None = None, context_budget: int = 8192,
                         device: str = "cpu", policy_url: str | None = None,
                         policy_server: PolicyServerConfig | None = None, prefix_cache_gb: float = 0.0
                         ) -> dict[str, Any]:
    """Evaluate each named checkpoint on the same items with the same seed: the metrics a report shows.

    ``items`` are split records (``item_id`` and ``sub_task``). Every checkpoint sees the same items,
    samples and seed, so differences between checkpoints are paired and the numbers are reproducible.
    """
    sub_tasks = {r["item_id"]: r.get("sub_task", "all") for r in items}
    ids = [r["item_id"] for r in items]
    out: dict[str, Any] = {"env": env, "h": h, "k": k, "temperature": temperature, "seed": seed,
                           "max_new_tokens": max_new_tokens, "context_budget": context_budget, "items": len(ids),
                           "engine": "hf" if policy_url is None else "vllm", "checkpoints": {}}
    for name, folder in checkpoints.items():
        if progress is not None:
            progress(name)
        result = evaluate(folder, env, url, ids, h=h, k=k, temperature=temperature, max_new_tokens=max_new_tokens,
                          seed=seed, batch_items=batch_items, context_budget=context_budget, device=device,
                          policy_url=policy_url, policy_server=policy_server, prefix_cache_gb=prefix_cache_gb)
        out["checkpoints"][name] = ({"path": str(folder)} | summarise(result, sub_tasks)
                                    | {"prefix_reused_tokens": result.prefix_reused_tokens})
    return out


def evaluate_parts(folder: Path, parts: dict[str, tuple[Any, list[str], int]], **sampling: Any) -> EvalResult:
    """:func:`evaluate` of one policy over several environments: ``parts`` maps each environment to (its servers,
    its item ids, its turn cap); the results merged under ``<env>:<item_id>`` (the mixed run's evaluation and its
    promotion gates)."""
    merged = EvalResult({}, {})
    for env, (url, ids, h) in parts.items():
        result = evaluate(folder, env, url, ids, h=h, **sampling)
        for field_name in ("success", "reward", "turns", "termination"):
            getattr(merged, field_name).update({f"{env}:{i}": v for i, v in getattr(result, field_name).items()})
        merged.generated_tokens += result.generated_tokens
        merged.prefix_reused_tokens += result.prefix_reused_tokens
    return merged


def evaluate_mixed_checkpoints(checkpoints: dict[str, Path], parts: dict[str, tuple[str, list[dict[str, Any]], int]],
                               k: int, temperature: float, max_new_tokens: int, seed: int, batch_items: int = 4,
                               progress: Callable[[str], None] | None = None, context_budget: int = 8192,
                               device: str = "cpu", prefix_cache_gb: float = 0.0) -> dict[str, Any]:
    """:func:`evaluate_checkpoints` for one policy over several environments: ``parts`` maps each environment to
    (its server URL, its test items, its turn cap). Each checkpoint is evaluated on every environment; the
    summary pools all items (tagged ``<env>:<id>``) and its ``sub_tasks`` are the environments, so each
    environment's own success, CI, Avg@k and Pass@k sit beside the mixed figures."""
    out: dict[str, Any] = {"env": ",".join(parts), "h": max(h for _, _, h in parts.values()), "k": k,
                           "temperature": temperature, "seed": seed, "max_new_tokens": max_new_tokens,
                           "context_budget": context_budget, "items": sum(len(i) for _, i, _ in parts.values()),
                           "engine": "hf", "envs": {e: {"h": h, "items": len(i)} for e, (_, i, h) in parts.items()},
                           "checkpoints": {}}
    for name, folder in checkpoints.items():
        if progress is not None:
            progress(name)
        merged = evaluate_parts(folder, {env: (url, [r["item_id"] for r in items], h)
                                         for env, (url, items, h) in parts.items()},
                                k=k, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                                batch_items=batch_items, context_budget=context_budget, device=device,
                                prefix_cache_gb=prefix_cache_gb)
        sub_tasks = {f"{env}:{r['item_id']}": env for env, (_, items, _) in parts.items() for r in items}
        out["checkpoints"][name] = ({"path": str(folder)} | summarise(merged, sub_tasks)
                                    | {"prefix_reused_tokens": merged.prefix_reused_tokens})
    return out


#: where the project's measured learning results are (the closing line points there when smoke scale shows none)
LEARNING_DOC = "docs/learning.md"


def training_effect(checkpoints: dict[str, Any], per_item: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the phases did to the policy they started from, on the evaluation's items: the first checkpoint
    (``base``, or the last warm-start stage when there is one) against the last, per-item success and reward
    paired (bootstrap over items), and a verdict: ``improved`` / ``worse`` when the success or reward interval
    lies above / below 0, else ``no measurable change``."""
    names = list(checkpoints)
    start = next((n for n in reversed(names) if n.startswith("warm")), names[0])
    end = names[-1]
    out: dict[str, Any] = {"start": start, "end": end}
    for metric in ("success", "reward"):
        items = [i for i in per_item.get(start, {}) if i in per_item.get(end, {})]
        before = [float(np.mean(per_item[start][i][metric])) for i in items]
        after = [float(np.mean(per_item[end][i][metric])) for i in items]
        diff, low, high = paired_difference_ci(before, after) if items else (0.0, 0.0, 0.0)
        out[metric] = {"diff": diff, "ci95": [low, high], "items": len(items)}
    lows = [out[m]["ci95"][0] for m in ("success", "reward")]
    highs = [out[m]["ci95"][1] for m in ("success", "reward")]
    out["verdict"] = ("improved" if max(lows) > 0 and min(highs) >= 0 else "worse" if min(highs) < 0 and
                      max(lows) <= 0 else "mixed" if max(lows) > 0 else "no measurable change")
    return out


def closing_line(evaluation: dict[str, Any], per_item: dict[str, dict[str, Any]]) -> str:
    """The main job's last word: each checkpoint's success (95% CI) and mean reward, then what training did to the
    policy it started from, with its paired interval; a run too small to move it says so and where the measured
    learning curves are, instead of a row of equal percentages."""
    parts = []
    for name, c in evaluation["checkpoints"].items():
        low, high = c.get("success_ci95", [c["success"], c["success"]])
        parts.append(f"{name} {c['success']:.0%} [{low:.0%}-{high:.0%}] r={c['avg_at_k']:.3f}")
    effect = training_effect(evaluation["checkpoints"], per_item)
    s, r = effect["success"], effect["reward"]
    change = (f"{effect['end']} vs {effect['start']}: success {100 * s['diff']:+.1f} points (95% CI "
              f"{100 * s['ci95'][0]:+.1f} to {100 * s['ci95'][1]:+.1f}), reward {r['diff']:+.3f} "
              f"({r['ci95'][0]:+.3f} to {r['ci95'][1]:+.3f}) on {s['items']} items: {effect['verdict']}")
    if effect["verdict"] != "improved":
        change += (f" (a smoke run is too small to show learning; what RL does at a measurable scale, with "
                   f"intervals: {LEARNING_DOC})")
    return (f"success on {evaluation['items']} test items (k={evaluation['k']}): " + " -> ".join(parts)
            + f"\n{change}")

"""Evaluation of a policy on a task split: success and reward per item, with bootstrap CIs.

Avg@k is the mean normalised reward over k samples per item; Pass@k the share of items with at least
one success among k samples; success rate the share of trajectories that meet the environment's own
success criterion. Greedy evaluation is temperature 0 with k = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.engine import HFEngine
from training.model import load_policy
from training.rollout import Rollout, RolloutConfig


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


def evaluate(model_dir: Path, env: str, url: str, item_ids: list[str], h: int, k: int = 1,
             temperature: float = 0.0, max_new_tokens: int = 48, seed: int = 0, batch_items: int = 4
             ) -> EvalResult:
    """Roll out ``k`` samples per item at turn cap ``h`` and collect success and reward."""
    model, tokenizer = load_policy(model_dir)
    model.eval()
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    config = RolloutConfig(n_samples=k, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                           context_budget=8192)
    rollout = Rollout(env, url, engine, tokenizer, config)
    success: dict[str, list[bool]] = {i: [] for i in item_ids}
    reward: dict[str, list[float]] = {i: [] for i in item_ids}
    for start in range(0, len(item_ids), batch_items):  # a batch at a time: servers bound live instances
        result = rollout.run(item_ids[start:start + batch_items], h)
        errors = [t for t in result.trajectories if not t.valid]
        if errors:
            raise RuntimeError(f"{len(errors)} evaluation trajectories hit environment errors "
                               f"(first: {errors[0].error}); evaluation results would be biased")
        for t in result.trajectories:
            success[t.item_id].append(t.success)
            reward[t.item_id].append(t.reward)
    return EvalResult(success, reward)

"""One policy over several environments: each step's items drawn from every environment by weight, each
environment rolled out at its own turn cap, the trajectories trained on together by one optimizer.

A mixed run names its environments joined by commas (``"babyai,textcraft,deepsearch"``); its items are tagged
``<env>:<item_id>``. The phase's h is each environment's h clipped to that environment's ``max_h``
(:class:`training.settings.config.MixShare`), so the phase boundaries are shared and every environment keeps its
own cap.
An environment whose every trajectory of a step failed fails the step (retried, then the phase stops naming it):
the run never trains on the other environments alone without saying so.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from envs.urls import ServerUrls
from training.rollouts.rollout import Rollout, RolloutResult, rollout_stats
from training.settings.config import MixShare, TrainConfig

SEP = ":"


def tag(env: str, item_id: str) -> str:
    return f"{env}{SEP}{item_id}"


def untag(item: str) -> tuple[str, str]:
    env, _, item_id = item.partition(SEP)
    return env, item_id


def shares(envs: Sequence[str], config: TrainConfig) -> dict[str, MixShare]:
    """Each environment's share: from ``config.mix`` (weight, cap, sub-tasks), weight 1 where it names none; a
    share for an environment not in the run is an error naming it."""
    unknown = sorted(set(config.mix) - set(envs))
    if unknown:
        raise ValueError(f"train.mix names {unknown}, which this run does not train on ({', '.join(envs)}): "
                         "remove them or add them to --env")
    return {e: config.mix.get(e, MixShare()) for e in envs}


def check_scope(envs: Sequence[str], config: TrainConfig) -> None:
    """Settings of the other kind of run are an error, not ignored: ``mix`` shares a mixed run's steps between its
    environments, ``sub_tasks`` and ``items`` choose one environment's items."""
    if len(envs) == 1 and config.mix:
        raise ValueError(f"train.mix ({', '.join(sorted(config.mix))}) shares the steps of a mixed run between its "
                         f"environments, and this run trains on {envs[0]} alone: remove it (here sub_tasks is "
                         "train.sub_tasks and the cap is the curriculum's)")
    chosen = [name for name in ("sub_tasks", "items") if getattr(config, name)]
    if len(envs) > 1 and chosen:
        raise ValueError(f"train.{' and train.'.join(chosen)} choose{'s' if len(chosen) == 1 else ''} one "
                         f"environment's items, and this run mixes {', '.join(envs)}: give each environment's "
                         "sub-tasks as train.mix.<env>.sub_tasks")


def allocation(weights: Mapping[str, float], n: int) -> dict[str, int]:
    """``n`` items per step split by ``weights`` (largest remainder, ties in order), every environment at least
    one: the same counts every step, so a data position is enough state."""
    if n < len(weights):
        raise ValueError(f"batch_items={n} cannot give each of the {len(weights)} environments an item per step: "
                         f"raise batch_items to at least {len(weights)}")
    total = sum(weights.values())
    rest = n - len(weights)
    exact = {e: rest * w / total for e, w in weights.items()}
    counts = {e: 1 + int(x) for e, x in exact.items()}
    left = n - sum(counts.values())
    for e in sorted(exact, key=lambda e: -(exact[e] - int(exact[e])))[:left]:
        counts[e] += 1
    return counts


class MixedRollout:
    """One :class:`Rollout` per environment behind ``run(items, h)``, as the trainer calls a single one."""

    def __init__(self, rollouts: Mapping[str, Rollout], caps: Mapping[str, int | None]) -> None:
        self.rollouts, self.caps = dict(rollouts), dict(caps)
        self.url = "; ".join(f"{e}={r.url}" for e, r in self.rollouts.items())

    def h_for(self, env: str, h: int) -> int:
        cap = self.caps.get(env)
        return min(h, cap) if cap else h

    def run(self, item_ids: Sequence[str], h: int, step: int = 0, progress: bool = False) -> RolloutResult:
        by_env: dict[str, list[str]] = {}
        for item in item_ids:
            env, item_id = untag(item)
            if env not in self.rollouts:
                raise ValueError(f"item {item!r} names no environment of this run ({', '.join(self.rollouts)})")
            by_env.setdefault(env, []).append(item_id)
        started = time.perf_counter()
        merged = RolloutResult([])
        stats: dict[str, float] = {}
        offset = 0
        for env, ids in by_env.items():
            part = self.rollouts[env].run(ids, self.h_for(env, h), step=step, progress=progress)
            for t in [*part.trajectories, *part.failed_attempts]:
                t.item_id = tag(env, t.item_id)
                t.group += offset  # GRPO groups stay apart across environments
            offset = 1 + max((t.group for t in part.trajectories), default=offset - 1)
            merged.trajectories += part.trajectories
            merged.failed_attempts += part.failed_attempts
            merged.seconds_generating += part.seconds_generating
            merged.seconds_in_env += part.seconds_in_env
            merged.generated_tokens += part.generated_tokens
            stats |= {f"{env}/{k}": v for k, v in rollout_stats(part).items()
                      if not k.startswith(("timing_s/", "perf/"))}
            stats[f"{env}/curriculum/h"] = float(self.h_for(env, h))
            if not part.valid:
                merged.failed_envs.append(env)
        merged.seconds_total = time.perf_counter() - started
        merged.stats = rollout_stats(merged) | stats
        return merged


def mixed_rollout(envs: Sequence[str], urls: ServerUrls, engine: Any, tokenizer: Any, rollout_config: Any,
                  config: TrainConfig) -> MixedRollout:
    """A :class:`MixedRollout` over ``envs``, each at its servers in ``urls``."""
    caps = {e: s.max_h for e, s in shares(envs, config).items()}
    return MixedRollout({e: Rollout(e, urls.replicas(e), engine, tokenizer, rollout_config) for e in envs}, caps)

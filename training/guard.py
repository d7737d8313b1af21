"""The collapse guard: per-step signals that precede a collapse of RL training, and what a trip does.

A policy trained with a too-large step, or let loose on a larger turn cap, can fall apart within a few dozen
steps (every reply ``!!!!``; AgentGym-RL's TextCraft schedule did, 25-75 steps after entering its largest cap).
Before it does, the signals move: the KL to the reference and the gradient norm jump, the entropy falls, the
share of malformed replies and of trajectories cut off by the cap rises, the reward falls from its best. The
trainer hands each step's metrics to :class:`Guard`; when one crosses its threshold (params.yaml
``train.<profile>.guard``) the phase rolls back to its last good intra-phase checkpoint and either goes on with
a lower learning rate or ends there, as configured. Each trip is a :class:`GuardEvent` in the phase folder's
``guard.json`` and in the manifest of every checkpoint written after it.

Replaying a phase from its events gives the same run: the learning rate of step ``s`` is ``lr * lr_factor**n``
with ``n`` the number of events that rolled back to a step at or before ``s``, and sampling is seeded per step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

EVENTS = "guard.json"


class GuardConfig(BaseModel):
    """Thresholds of the collapse guard (null switches a signal off) and what a trip does."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    enabled: bool = Field(True, description="false: no signal is watched")
    max_kl: float | None = Field(1.0, gt=0, description="actor/kl, the KL to the reference per token")
    max_grad_norm: float | None = Field(1.0e3, gt=0, description="actor/grad_norm before clipping")
    baseline_steps: int = Field(2, ge=1, description="the phase's first steps set the baseline of the relative "
                                "signals below (which are not watched before it exists)")
    min_entropy_ratio: float | None = Field(0.1, gt=0, lt=1, description="trip when actor/entropy falls below this "
                                            "share of its baseline")
    max_invalid_rise: float | None = Field(0.5, gt=0, le=1, description="trip when the share of malformed replies "
                                           "(rollout/invalid_actions) rises this far above its baseline")
    max_truncated_rise: float | None = Field(0.43, gt=0, le=1, description="trip when the share of trajectories "
                                             "cut off (by the turn cap, the context budget or the token budget) rises "
                                             "this far above its baseline")
    max_reward_drop: float | None = Field(0.34, gt=0, description="trip when reward/mean, averaged over "
                                          "reward_window steps, falls this far below its best such average")
    reward_window: int = Field(3, ge=1, description="steps averaged by max_reward_drop")
    action: Literal["lower_lr", "end_phase"] = Field("lower_lr", description="after a rollback: go on with the "
                                                     "learning rate times lr_factor, or end the phase there")
    lr_factor: float = Field(0.1, gt=0, lt=1, description="lower_lr: the learning rate's factor after a rollback")
    max_retries: int = Field(2, ge=0, description="lower_lr trips per phase; the next one ends the phase")


#: how a trajectory can be cut short (training/trajectory.py TERMINATIONS): the turn cap, the context budget, the
#: per-episode token budget. A collapse can show as context cuts alone (the curriculum study's fixed h=20 seed 0:
#: its replies grew until the 2,048-token budget ended the episodes, while turn-cap cuts stayed flat)
CUTS = ("turn_cap", "context_cap", "token_cap")


class GuardEvent(BaseModel):
    """One trip: when, which signal, its value and threshold, and what was done."""

    model_config = ConfigDict(extra="forbid")
    step: int  # the global step whose metrics tripped
    signal: str
    value: float
    threshold: float
    action: Literal["lower_lr", "end_phase"]
    rolled_back_to: int  # the global step of the checkpoint the phase went on from (its first step: the start)
    lr_scale: float  # the learning rate's factor from rolled_back_to on


class GuardTrip(Exception):
    """Raised by the trainer when a step's metrics trip the guard; carries the event (its rollback not chosen)."""

    def __init__(self, step: int, signal: str, value: float, threshold: float) -> None:
        super().__init__(f"step {step}: {signal} = {value:.4g} (threshold {threshold:.4g})")
        self.step, self.signal, self.value, self.threshold = step, signal, value, threshold


class Guard:
    """Watches a phase's per-step metrics; ``history`` (one row per step) is all its state, kept in checkpoints."""

    def __init__(self, config: GuardConfig, history: list[dict[str, float]] | None = None) -> None:
        self.config = config
        self.history = [dict(r) for r in history or []]

    def check(self, step: int, stats: dict[str, float]) -> GuardTrip | None:
        """Record the step's signals; the trip they cause, if any."""
        cfg = self.config
        valid = stats.get("rollout/trajectories", 0.0) - stats.get("env/errors", 0.0)
        row = {"kl": stats.get("actor/kl"), "grad_norm": stats.get("actor/grad_norm"),
               "entropy": stats.get("actor/entropy"), "invalid": stats.get("rollout/invalid_actions"),
               "truncated": sum(stats.get(f"rollout/termination/{cut}", 0.0) for cut in CUTS) / valid
               if valid > 0 else None,
               "reward": stats.get("reward/mean")}
        row = {k: float(v) for k, v in row.items() if v is not None and math.isfinite(float(v))}
        self.history.append(row)
        if not cfg.enabled:
            return None
        for name, limit in (("actor/kl", cfg.max_kl), ("actor/grad_norm", cfg.max_grad_norm)):
            value = stats.get(name)
            if limit is not None and value is not None and (not math.isfinite(value) or value > limit):
                return GuardTrip(step, name, float(value), limit)
        if len(self.history) <= cfg.baseline_steps:
            return None
        base = self.history[: cfg.baseline_steps]

        def baseline(key: str) -> float | None:
            values = [r[key] for r in base if key in r]
            return sum(values) / len(values) if values else None

        entropy, b = row.get("entropy"), baseline("entropy")
        if cfg.min_entropy_ratio is not None and entropy is not None and b and entropy < cfg.min_entropy_ratio * b:
            return GuardTrip(step, "actor/entropy", entropy, cfg.min_entropy_ratio * b)
        for key, name, rise in (("invalid", "rollout/invalid_actions", cfg.max_invalid_rise),
                                ("truncated", "rollout/truncated_share", cfg.max_truncated_rise)):
            value, b = row.get(key), baseline(key)
            if rise is not None and value is not None and b is not None and value > b + rise:
                return GuardTrip(step, name, value, b + rise)
        rewards = [r["reward"] for r in self.history if "reward" in r]
        w = cfg.reward_window
        if cfg.max_reward_drop is not None and len(rewards) >= 2 * w:
            windows = [sum(rewards[i:i + w]) / w for i in range(len(rewards) - w + 1)]
            best = max(windows[:-1])
            if windows[-1] < best - cfg.max_reward_drop:
                return GuardTrip(step, "reward/mean (window)", windows[-1], best - cfg.max_reward_drop)
        return None


def lr_scale(events: list[GuardEvent], step: int, factor: float) -> float:
    """The learning rate's factor at ``step``: one ``factor`` per lower_lr event that rolled back to it or before."""
    return factor ** sum(1 for e in events if e.action == "lower_lr" and e.rolled_back_to <= step)


def read_events(out_dir: Path, identity: dict[str, Any]) -> list[GuardEvent]:
    """The guard's events of this very run of the phase (same parent, h, steps, config); another run's are
    removed (its checkpoints are too)."""
    path = out_dir / EVENTS
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        if data.get("identity") != json.loads(json.dumps(identity)):
            path.unlink()
            return []
        return [GuardEvent(**e) for e in data["events"]]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        from training.checkpoint import CheckpointError

        raise CheckpointError(f"{path} is corrupt ({err}); it records the collapse guard's rollbacks of this phase: "
                              "restore it, or delete the phase folder to train the phase again") from err


def write_events(out_dir: Path, identity: dict[str, Any], events: list[GuardEvent]) -> None:
    from envs.files import atomic_write

    atomic_write(out_dir / EVENTS, json.dumps({"identity": identity, "events": [e.model_dump() for e in events]},
                                              indent=1) + "\n")

"""The ScalingInter-RL curriculum: a cap h on interaction turns that grows phase by phase.

Pure functions over immutable data, no scheduler state (the reference's mutable scheduler is off by one
on resume). Steps t count from 0. The closed form of the paper's seed page:

    h(t) = min(h1 + delta_h * floor(t / every), cap)

where a step t that is an exact multiple of ``every`` (the paper's Delta) already belongs to the next
phase. Explicit schedules, a list of (h, steps) like the public code's BabyAI [6, 13, 20] x 100, expand
into the same :class:`Phase` list. Modes: ``scaling_inter`` (recurrence or list), ``fixed`` (the paper's
baselines) and ``adaptive`` (this project's extension, off by default: advance h when the share of
trajectories cut off by the turn cap, or a success plateau, passes a threshold).

    >>> horizon(350, h1=1, delta_h=1, every=100, cap=4)   # vector A (Deep Search)
    4
    >>> horizon(400, h1=2, delta_h=2, every=150, cap=20)  # vector B (TextCraft)
    6
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from training.settings.warm import WarmStage

Mode = Literal["scaling_inter", "fixed", "adaptive"]


@dataclass(frozen=True)
class Phase:
    """One curriculum phase: steps ``first_step..last_step`` (inclusive) train with turn cap ``h``."""

    index: int
    h: int
    first_step: int
    last_step: int

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step + 1


def horizon(t: int, h1: int, delta_h: int, every: int, cap: int) -> int:
    """``h(t) = min(h1 + delta_h * floor(t / every), cap)`` for training step ``t >= 0``."""
    if t < 0:
        raise ValueError(f"training step t must be >= 0, got {t}")
    _check_recurrence(h1, delta_h, every, cap)
    return min(h1 + delta_h * (t // every), cap)


def _check_recurrence(h1: int, delta_h: int, every: int, cap: int) -> None:
    if h1 < 1 or delta_h < 0 or every < 1 or cap < 1:
        raise ValueError(f"need h1 >= 1, delta_h >= 0, every >= 1, cap >= 1; got {h1=}, {delta_h=}, {every=}, {cap=}")


def recurrence_phases(h1: int, delta_h: int, every: int, cap: int, total_steps: int) -> list[Phase]:
    """The phases of the closed form over ``total_steps`` steps; once h reaches the cap, one last phase."""
    _check_recurrence(h1, delta_h, every, cap)
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    phases: list[Phase] = []
    first = 0
    while first < total_steps:
        h = horizon(first, h1, delta_h, every, cap)
        last = total_steps - 1 if h == cap or delta_h == 0 else min(first + every, total_steps) - 1
        phases.append(Phase(len(phases), h, first, last))
        first = last + 1
    return phases


def schedule_phases(schedule: Sequence[tuple[int, int]], cap: int | None = None) -> list[Phase]:
    """Expand an explicit list of (h, steps) into phases; h must not decrease nor pass ``cap``."""
    if not schedule:
        raise ValueError("the schedule is empty: give at least one (h, steps) pair")
    phases: list[Phase] = []
    first = 0
    for h, steps in schedule:
        if h < 1 or steps < 1:
            raise ValueError(f"schedule entry (h={h}, steps={steps}): both must be >= 1")
        if phases and h < phases[-1].h:
            raise ValueError(f"schedule decreases h ({phases[-1].h} -> {h}): ScalingInter only grows the cap")
        if cap is not None and h > cap:
            raise ValueError(f"schedule h={h} is above the environment's cap {cap}")
        phases.append(Phase(len(phases), h, first, first + steps - 1))
        first += steps
    return phases


def fixed_phases(h: int, total_steps: int) -> list[Phase]:
    """The fixed-turn baseline: one phase at ``h`` for all steps."""
    return schedule_phases([(h, total_steps)])


def phase_at(phases: Sequence[Phase], t: int) -> Phase:
    """The phase that training step ``t`` belongs to."""
    for phase in phases:
        if phase.first_step <= t <= phase.last_step:
            return phase
    raise ValueError(f"step {t} is outside the curriculum (steps 0..{phases[-1].last_step})")


class AdaptiveRule(BaseModel):
    """This project's extension: advance h early when the current cap is visibly too tight."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    truncated_share: float = Field(0.5, ge=0, le=1, description="advance when this share of trajectories hit h")
    plateau_steps: int = Field(20, ge=1, description="advance when success has not improved for this many steps")
    plateau_tolerance: float = Field(0.01, ge=0, description="an improvement smaller than this is no improvement")
    min_steps: int = Field(10, ge=1, description="stay at least this many steps at each h")


def adaptive_advance(rule: AdaptiveRule, truncated_shares: Sequence[float], success_rates: Sequence[float]) -> bool:
    """Whether to advance h, given the per-step stats observed since h last changed (oldest first)."""
    if len(success_rates) < rule.min_steps:
        return False
    if truncated_shares and truncated_shares[-1] >= rule.truncated_share:
        return True
    if len(success_rates) <= rule.plateau_steps:
        return False
    best_before = max(success_rates[: -rule.plateau_steps])
    return max(success_rates[-rule.plateau_steps :]) < best_before + rule.plateau_tolerance


class CurriculumConfig(BaseModel):
    """One environment's curriculum, as written in params.yaml."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    mode: Mode = Field("scaling_inter", description="scaling_inter: h grows phase by phase (h1, delta_h, every, "
                       "or schedule); fixed: one phase at fixed_h; adaptive: h advances early by the adaptive rule")
    cap: int = Field(ge=1, description="the environment's maximum number of turns (paper, Appendix B)")
    total_steps: int = Field(ge=1, description="training steps over the whole curriculum")
    h1: int | None = Field(None, ge=1, description="first phase's turn cap (recurrence form)")
    delta_h: int | None = Field(None, ge=0, description="growth of h per phase (recurrence form)")
    every: int | None = Field(None, ge=1, description="steps per phase, the paper's Delta (recurrence form)")
    schedule: list[tuple[int, int]] | None = Field(None, description="explicit (h, steps) list instead")
    fixed_h: int | None = Field(None, ge=1, description="turn cap of the fixed baseline")
    adaptive: AdaptiveRule = Field(AdaptiveRule(), description="mode adaptive: when h advances before its phase ends")
    warm_start: list[WarmStage] = Field(default_factory=list, description="phases of other types (sft, rft, dpo) "
                                        "before the first RL phase, in order, each from the last "
                                        "(training.settings.warm)")

    @model_validator(mode="after")
    def _one_form(self) -> CurriculumConfig:
        recurrence = (self.h1, self.delta_h, self.every)
        if self.mode == "fixed" and self.fixed_h is None:
            raise ValueError("mode 'fixed' needs fixed_h")
        if self.mode != "fixed" and self.schedule is None and None in recurrence:
            raise ValueError(f"mode {self.mode!r} needs either schedule or all of h1, delta_h, every")
        if self.schedule is not None and any(v is not None for v in recurrence):
            raise ValueError("give either schedule or h1/delta_h/every, not both")
        return self

    def phases(self) -> list[Phase]:
        """The planned phases (for ``adaptive``, the plan its early advances may shorten)."""
        if self.mode == "fixed":
            return fixed_phases(min(self.fixed_h or 1, self.cap), self.total_steps)
        if self.schedule is not None:
            phases = schedule_phases(self.schedule, self.cap)
            if phases[-1].last_step + 1 != self.total_steps:
                raise ValueError(f"schedule covers {phases[-1].last_step + 1} steps but total_steps is "
                                 f"{self.total_steps}: make them agree")
            return phases
        return recurrence_phases(self.h1, self.delta_h, self.every, self.cap, self.total_steps)  # type: ignore[arg-type]

"""The ScalingInter curriculum: the paper's vectors, and properties of every phase plan."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from flows.cli import app
from training.settings.config import curriculum_config
from training.settings.curriculum import (
    AdaptiveRule,
    CurriculumConfig,
    adaptive_advance,
    horizon,
    phase_at,
    recurrence_phases,
    schedule_phases,
)


def test_paper_vectors_a_and_b() -> None:
    assert horizon(350, h1=1, delta_h=1, every=100, cap=4) == 4  # A: Deep Search
    assert horizon(400, h1=2, delta_h=2, every=150, cap=20) == 6  # B: TextCraft


def test_a_step_on_a_multiple_of_every_belongs_to_the_next_phase() -> None:
    assert horizon(99, 2, 2, 100, 20) == 2 and horizon(100, 2, 2, 100, 20) == 4
    phases = recurrence_phases(2, 2, 100, 20, 300)
    assert phase_at(phases, 99).index == 0 and phase_at(phases, 100).index == 1


def test_public_babyai_schedule_expands_to_three_phases() -> None:
    phases = schedule_phases([(6, 100), (13, 100), (20, 100)], cap=20)
    assert [(p.h, p.first_step, p.last_step) for p in phases] == [(6, 0, 99), (13, 100, 199), (20, 200, 299)]


@pytest.mark.parametrize(
    ("schedule", "message"),
    [([(10, 5), (5, 5)], "decreases"), ([(30, 5)], "above the environment's cap"), ([], "empty"),
     ([(3, 0)], ">= 1")],
)
def test_bad_schedules_are_refused_with_a_reason(schedule: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        schedule_phases(schedule, cap=20)


def test_config_requires_exactly_one_form() -> None:
    with pytest.raises(ValueError, match="either schedule or"):
        CurriculumConfig(cap=20, total_steps=10)
    with pytest.raises(ValueError, match="not both"):
        CurriculumConfig(cap=20, total_steps=10, h1=1, delta_h=1, every=5, schedule=[(2, 10)])
    with pytest.raises(ValueError, match="total_steps"):
        CurriculumConfig(cap=20, total_steps=10, schedule=[(2, 5)]).phases()
    fixed = CurriculumConfig(mode="fixed", cap=20, total_steps=10, fixed_h=30).phases()
    assert [(p.h, p.steps) for p in fixed] == [(20, 10)]  # never above the cap


recurrences = st.tuples(
    st.integers(1, 10), st.integers(0, 5), st.integers(1, 50), st.integers(1, 30), st.integers(1, 400)
)


@given(recurrences)
def test_recurrence_phases_cover_steps_and_agree_with_the_closed_form(args: tuple[int, ...]) -> None:
    h1, delta_h, every, cap, total = args
    phases = recurrence_phases(h1, delta_h, every, cap, total)
    assert phases[0].first_step == 0 and phases[-1].last_step == total - 1
    for before, after in itertools.pairwise(phases):
        assert after.first_step == before.last_step + 1  # no gap, no overlap
        assert after.h > before.h  # monotone, and consecutive phases differ
    for t in range(total):
        h = horizon(t, h1, delta_h, every, cap)
        assert phase_at(phases, t).h == h <= cap
        if t > 0:
            assert h >= horizon(t - 1, h1, delta_h, every, cap)
    assert all(p.first_step % every == 0 for p in phases)  # boundaries sit exactly on multiples of every


@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 50)), min_size=1, max_size=6))
def test_schedule_phases_cover_their_steps(schedule: list[tuple[int, int]]) -> None:
    schedule = sorted(schedule)
    phases = schedule_phases(schedule, cap=20)
    assert sum(p.steps for p in phases) == sum(s for _, s in schedule)
    assert all(b.first_step == a.last_step + 1 for a, b in itertools.pairwise(phases))


def test_adaptive_rule_advances_on_truncation_or_plateau_only() -> None:
    rule = AdaptiveRule(truncated_share=0.5, plateau_steps=3, min_steps=2)
    assert not adaptive_advance(rule, [0.9], [0.1])  # too early
    assert adaptive_advance(rule, [0.1, 0.6], [0.1, 0.2])  # most trajectories hit the cap
    assert not adaptive_advance(rule, [0.1] * 5, [0.1, 0.2, 0.3, 0.4, 0.5])  # still improving
    assert adaptive_advance(rule, [0.1] * 6, [0.1, 0.5, 0.5, 0.5, 0.5, 0.5])  # plateau


@pytest.mark.parametrize("env", ["babyai", "textcraft", "sciworld", "webarena", "deepsearch"])
@pytest.mark.parametrize("profile", ["paper", "smoke"])
def test_every_configured_curriculum_is_valid_and_within_the_cap(env: str, profile: str) -> None:
    config = curriculum_config(env, profile)
    phases = config.phases()
    assert phases[-1].last_step + 1 == config.total_steps
    assert all(p.h <= config.cap for p in phases)
    assert config.cap == {"webarena": 15, "deepsearch": 4}.get(env, 20)  # Appendix B


def test_cli_prints_the_vectors_and_the_phase_table() -> None:
    runner = CliRunner()
    a = runner.invoke(app, ["curriculum", "--cap", "4", "--h1", "1", "--delta-h", "1", "--every", "100", "--t", "350"])
    b = runner.invoke(app, ["curriculum", "--cap", "20", "--h1", "2", "--delta-h", "2", "--every", "150", "--t", "400"])
    assert a.output.strip().endswith("= 4") and b.output.strip().endswith("= 6")
    table = runner.invoke(app, ["curriculum", "babyai", "--profile", "paper"])
    assert table.exit_code == 0 and "13" in table.output and "199" in table.output
    bad = runner.invoke(app, ["curriculum", "babyai", "--profile", "nope"])
    assert bad.exit_code == 2 and "paper" in bad.output

"""The collapse guard: each signal trips at its threshold, an induced collapse (a learning rate 1000x too high) is
rolled back and recorded in the manifest and the lineage, the replay is bitwise the same run, and a healthy run
never trips."""

from __future__ import annotations

import json

import pytest

from training.checkpoint import read_manifest
from training.evaluation.lineage import PhaseRecord
from training.guard import Guard, GuardConfig, GuardEvent, lr_scale
from training.phases.trainer import train_phase
from training.settings.config import TrainConfig

HEALTHY = {"actor/kl": 0.01, "actor/grad_norm": 5.0, "actor/entropy": 1.0, "rollout/invalid_actions": 0.1,
           "rollout/trajectories": 8.0, "env/errors": 0.0, "rollout/termination/turn_cap": 2.0, "reward/mean": 0.6}


def _feed(guard: Guard, rows: list[dict[str, float]]):
    trips = [guard.check(step, row) for step, row in enumerate(rows)]
    return [t for t in trips if t is not None]


@pytest.mark.parametrize(("change", "signal"), [
    ({"actor/kl": 3.0}, "actor/kl"),
    ({"actor/kl": float("nan")}, "actor/kl"),
    ({"actor/grad_norm": 5e3}, "actor/grad_norm"),
    ({"actor/entropy": 0.05}, "actor/entropy"),
    ({"rollout/invalid_actions": 0.7}, "rollout/invalid_actions"),
    ({"rollout/termination/turn_cap": 7.0}, "rollout/truncated_share"),
    ({"rollout/termination/context_cap": 7.0}, "rollout/truncated_share"),  # cut by the context budget: a cut too
    ({"reward/mean": 0.0}, "reward/mean (window)"),
])
def test_each_signal_trips_at_its_threshold_and_not_below(change: dict, signal: str) -> None:
    config = GuardConfig(reward_window=1)
    trips = _feed(Guard(config), [HEALTHY] * 4 + [HEALTHY | change])
    assert [t.signal for t in trips] == [signal] and trips[0].step == 4
    assert _feed(Guard(config), [HEALTHY] * 5) == []
    assert _feed(Guard(config.model_copy(update={"enabled": False})), [HEALTHY] * 4 + [HEALTHY | change]) == []


def test_relative_signals_wait_for_their_baseline() -> None:
    """An untrained policy's replies are all malformed from the start: no rise, no trip; and nothing relative is
    judged before the baseline steps exist."""
    broken = HEALTHY | {"rollout/invalid_actions": 1.0, "actor/entropy": 0.01}
    assert _feed(Guard(GuardConfig()), [broken] * 6) == []
    assert _feed(Guard(GuardConfig(baseline_steps=3)), [HEALTHY, HEALTHY | {"actor/entropy": 0.01}]) == []


def test_the_learning_rate_of_a_step_counts_the_rollbacks_at_or_before_it() -> None:
    events = [GuardEvent(step=5, signal="actor/kl", value=3, threshold=1, action="lower_lr", rolled_back_to=4,
                         lr_scale=0.1),
              GuardEvent(step=9, signal="actor/kl", value=3, threshold=1, action="lower_lr", rolled_back_to=8,
                         lr_scale=0.01)]
    assert [lr_scale(events, s, 0.1) for s in (0, 3, 4, 7, 8, 20)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])


BANDIT = TrainConfig(batch_items=4, n_samples=2, max_new_tokens=16, lr=1e-4, mini_batch_size=8, micro_batch_size=8,
                     save_every=1, keep_checkpoints=3, log_rollouts=False)


def test_a_healthy_run_never_trips(env_server, bandit_warm_start, tmp_path) -> None:
    final = train_phase("bandit", 0, 1, 4, bandit_warm_start, tmp_path / "p", url=env_server("bandit"),
                        config=BANDIT)
    manifest = read_manifest(final)
    assert manifest["guard"] == {"events": [], "lr_scale": 1.0}
    assert not (tmp_path / "p" / "guard.json").exists()
    assert json.loads((tmp_path / "p" / "dvclive" / "metrics.json").read_text())["guard"]["trips"] == 0


def test_an_induced_collapse_is_rolled_back_recorded_and_replayed_exactly(env_server, bandit_warm_start,
                                                                          tmp_path) -> None:
    """A learning rate 1000x too high wrecks the policy in one update; the guard trips on the next step, the
    phase rolls back to the last checkpoint before it and goes on at a tenth of the rate (once; then it ends the
    phase). The events are in guard.json, the final manifest and the lineage's row; a second run from scratch
    takes the same path to the same weights."""
    url = env_server("bandit")
    config = BANDIT.model_copy(update={"lr": 0.1, "guard": GuardConfig(max_retries=1)})
    final = train_phase("bandit", 0, 1, 4, bandit_warm_start, tmp_path / "p", url=url, config=config)
    manifest = read_manifest(final)
    events = manifest["guard"]["events"]
    assert events, "the guard did not trip on a learning rate 1000x too high"
    first = events[0]
    assert first["step"] >= 1 and first["rolled_back_to"] <= first["step"] - 1
    assert first["action"] == "lower_lr" and first["lr_scale"] == pytest.approx(0.1)
    assert first["value"] > first["threshold"] or first["value"] != first["value"]
    assert all(e["action"] == "end_phase" for e in events[1:])  # max_retries 1: a second trip ends the phase
    assert json.loads((tmp_path / "p" / "guard.json").read_text())["events"] == events
    row = PhaseRecord("bandit_phase_0", 1, 4, "grpo", manifest["parent"], manifest["hash"],
                      curriculum=manifest["curriculum"], guard=events)
    assert f"guard: {first['signal']}" in row.trained and f"back to {first['rolled_back_to']}" in row.trained
    replay = train_phase("bandit", 0, 1, 4, bandit_warm_start, tmp_path / "q", url=url, config=config)
    assert read_manifest(replay)["guard"]["events"] == events
    assert (replay / "model.safetensors").read_bytes() == (final / "model.safetensors").read_bytes()


def test_end_phase_keeps_the_last_good_checkpoint_as_the_phase_result(env_server, bandit_warm_start,
                                                                       tmp_path) -> None:
    config = BANDIT.model_copy(update={"lr": 0.1, "guard": GuardConfig(action="end_phase")})
    final = train_phase("bandit", 0, 1, 4, bandit_warm_start, tmp_path / "p", url=env_server("bandit"),
                        config=config)
    manifest = read_manifest(final)
    [event] = manifest["guard"]["events"]
    assert event["action"] == "end_phase" and manifest["curriculum"]["ended_by_guard"] is True
    assert manifest["global_step"] == event["rolled_back_to"] < 4
    if event["rolled_back_to"] == 0:  # back to the phase's start: its result is the start
        assert (final / "model.safetensors").read_bytes() == (bandit_warm_start / "model.safetensors").read_bytes()

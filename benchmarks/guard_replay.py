"""Replay the collapse guard (training/guard.py) over the curriculum study's logged training runs.

    python benchmarks/guard_replay.py                        # the shipped settings (params.yaml train.paper.guard)
    python benchmarks/guard_replay.py --set max_truncated_rise=0.5

Each run of ``docs/curriculum-study/<arm>-s<seed>.json`` logged, per step, its mean training reward and how
its 32 trajectories ended (done, the turn cap, the context budget ...). Its steps are fed, phase by phase (each
phase a fresh guard, as the trainer has), through :class:`training.guard.Guard` with the signals those logs
carry (the reward and the cut share; the KL, entropy and gradient norm were not logged by the study). Prints a
table: each run, whether the study called it a collapse, and the guard's first trip (step, signal, value,
threshold). The study saw one collapse, fixed h = 20 seed 0 (its reward fell from 0.67 to 0.06 while the context
budget cut up to 30 of its 32 trajectories); the guard must trip there and on none of the other runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` when run as a script

from training.guard import CUTS, Guard, GuardConfig, GuardTrip
from training.trajectory import TERMINATIONS

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "docs" / "curriculum-study"
#: the runs the study itself called collapses (docs/curriculum-study.md)
COLLAPSES = {"fixed-20-s0"}


def shipped_config() -> GuardConfig:
    """The guard of params.yaml's paper profile, the one a user's run has."""
    from training.settings.config import load_params

    return GuardConfig(**load_params()["train"]["paper"]["guard"])


def step_stats(row: dict[str, Any]) -> dict[str, float]:
    """A logged step's row as the trainer's per-step metrics the guard reads."""
    trajectories = sum(float(row.get(k, 0.0)) for k in TERMINATIONS)
    stats = {"reward/mean": float(row["reward"]), "rollout/trajectories": trajectories,
             "env/errors": float(row.get("env_error", 0.0))}
    return stats | {f"rollout/termination/{cut}": float(row.get(cut, 0.0)) for cut in CUTS}


def replay(rows: list[dict[str, Any]], config: GuardConfig) -> GuardTrip | None:
    """The first trip over a run's logged steps (a fresh guard per phase), or None."""
    guards: dict[int, Guard] = {}
    for row in rows:
        if "reward" not in row:  # a phase's closing record, not a step
            continue
        guard = guards.setdefault(int(row.get("phase", 0)), Guard(config))
        trip = guard.check(int(row["step"]), step_stats(row))
        if trip is not None:
            return trip
    return None


def table(config: GuardConfig, folder: Path = STUDY) -> list[dict[str, Any]]:
    """One row per logged run: its name, whether it collapsed, the guard's first trip."""
    out = []
    for path in sorted(folder.glob("*-s[0-9]*.json")):
        rows = json.loads(path.read_text())["train"]["rows"]
        trip = replay(rows, config)
        out.append({"run": path.stem, "collapse": path.stem in COLLAPSES,
                    "trip": None if trip is None else {"step": trip.step, "signal": trip.signal,
                                                       "value": round(trip.value, 3),
                                                       "threshold": round(trip.threshold, 3)}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", action="append", default=[], help="a guard setting KEY=VALUE instead of the shipped")
    args = parser.parse_args()
    changes = {k: float(v) for k, v in (pair.split("=", 1) for pair in args.set)}
    config = shipped_config().model_copy(update=changes)
    print("| run | study's verdict | guard's first trip |")
    print("|---|---|---|")
    for row in table(config):
        t = row["trip"]
        below = t is not None and t["signal"] in ("actor/entropy", "reward/mean (window)")  # a fall, not a rise
        trip = "none" if t is None else (f"step {t['step']}: {t['signal']} {t['value']} {'<' if below else '>'} "
                                         f"{t['threshold']}")
        print(f"| {row['run']} | {'collapse' if row['collapse'] else 'healthy'} | {trip} |")


if __name__ == "__main__":
    main()

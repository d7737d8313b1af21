"""In-process BabyAI step throughput, and how a step's time splits between minigrid and the text layer.

    python benchmarks/babyai_inprocess.py [--steps 50000] [--episodes 40] [--seed 0]

Plays random *valid* primitive actions ("turn left", "turn right", and "move forward" when the action
list offers it) on ``--episodes`` instances spread over the 40 levels, resetting finished episodes
(reset time is reported separately, not counted as steps). Each instance's minigrid ``step`` is
timed on its own, so ``text`` = whole ``BabyAIEnv.step`` minus minigrid: action parsing, validity,
the description and the action list. Target: text well under 0.2 ms per step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from envs.babyai.backend import LEVELS, BabyAIEnv, Backend


class _Timed:
    """Accumulates the time spent in the wrapped callable."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.total = fn, 0.0

    def __call__(self, *args: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            self.total += time.perf_counter() - t


def _reset(env: BabyAIEnv, data_idx: int, timer: _Timed) -> None:
    env.reset(data_idx)
    minigrid_env = env.minigrid  # timed separately: minigrid's own step
    if not isinstance(minigrid_env.step, _Timed):  # type: ignore[union-attr]
        minigrid_env.step = _Timed(type(minigrid_env).step.__get__(minigrid_env))  # type: ignore[union-attr]
    minigrid_env.step.total = 0.0  # type: ignore[union-attr]
    timer.total = 0.0


def run(steps: int, episodes: int, seed: int) -> dict[str, float]:
    """Step ``steps`` times round-robin over ``episodes`` instances; timings in microseconds."""
    backend, rng = Backend(), random.Random(seed)
    envs = [backend.new_instance() for _ in range(episodes)]
    next_idx, minigrid_s, total, resets, reset_s = episodes, 0.0, [], 0, 0.0
    dummy = _Timed(lambda: None)
    for i, env in enumerate(envs):
        _reset(env, i, dummy)
    for n in range(steps):
        env = envs[n % episodes]
        choices = [a for a in env.available_actions() if a in ("turn left", "turn right", "move forward")]
        action = rng.choice(choices)
        before = env.minigrid.step.total  # type: ignore[union-attr]
        t = time.perf_counter()
        result = env.step(action)
        total.append(time.perf_counter() - t)
        minigrid_s += env.minigrid.step.total - before  # type: ignore[union-attr]
        if result.done:
            t = time.perf_counter()
            _reset(env, next_idx, dummy)
            reset_s += time.perf_counter() - t
            resets, next_idx = resets + 1, next_idx + 1
    whole = sum(total)
    return {
        "steps_per_s": steps / whole,
        "step_us": whole / steps * 1e6,
        "median_step_us": statistics.median(total) * 1e6,
        "minigrid_us": minigrid_s / steps * 1e6,
        "text_us": (whole - minigrid_s) / steps * 1e6,
        "resets": resets,
        "reset_ms": reset_s / max(resets, 1) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50_000)
    parser.add_argument("--episodes", type=int, default=len(LEVELS), help="instances, level = index % 40")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    r = run(args.steps, args.episodes, args.seed)
    print(f"in-process: {r['steps_per_s']:.0f} steps/s over {args.steps} steps, {args.episodes} episodes "
          f"({r['resets']} resets, {r['reset_ms']:.2f} ms each, not counted)")
    print(f"per step: {r['step_us']:.1f} us mean ({r['median_step_us']:.1f} us median) = "
          f"minigrid {r['minigrid_us']:.1f} us + text {r['text_us']:.1f} us")


if __name__ == "__main__":
    main()

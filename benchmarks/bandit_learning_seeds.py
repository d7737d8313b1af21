"""The bandit learning test over many training seeds: how far from a knife edge does it sit?

    python benchmarks/bandit_learning_seeds.py [--seeds 0-7] [--algorithms grpo,rloo,reinforce_pp,ppo]
                                               [--lr 3e-4] [--steps 12]

Builds the test's tiny model and its 50/50 SFT warm start once, evaluates the warm start, then trains
each algorithm from it with each seed (other samples, other data order) using the test's settings
(``tests/test_learning.py``) and evaluates the result as the test does: success over 16 items x 8
samples at T 1.0, and the paired change over items with its 95% bootstrap interval. ``--lr 1e-3
--steps 16`` shows the setting the test used to have: it learns, then collapses.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def seeds(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-")
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=seeds, default=seeds("0-7"))
    parser.add_argument("--algorithms", default="grpo,rloo,reinforce_pp,ppo")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--steps", type=int, default=None, help="default: the test's")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)  # as in the tests: bitwise reproducible
    from envs.launcher import running_server
    from envs.splits import load_split
    from tests.conftest import build_bandit_warm_start, build_test_model
    from tests.test_learning import EVAL, STEPS, bandit_config
    from training.evaluation.evaluate import evaluate, paired_difference_ci
    from training.phases.trainer import train_phase

    steps = args.steps or STEPS
    scratch = Path(tempfile.mkdtemp(prefix="bandit-seeds-"))
    warm = build_bandit_warm_start(build_test_model(scratch / "tiny"), scratch / "sft")
    with running_server("bandit") as url:
        test = [r["item_id"] for r in load_split("bandit", "test")]
        before = evaluate(warm, "bandit", url, test, **EVAL)
        print(f"warm start: success {before.success_rate:.3f}; lr {args.lr}, {steps} steps")
        print("algorithm     seed  after   paired change (95% CI)   seconds")
        for algorithm in args.algorithms.split(","):
            finals = []
            for seed in args.seeds:
                started = time.perf_counter()
                final = train_phase("bandit", 0, 1, steps, warm, scratch / f"{algorithm}-{seed}", url=url,
                                    config=bandit_config(algorithm, seed, args.lr))
                after = evaluate(final, "bandit", url, test, **EVAL)
                gain, low, high = paired_difference_ci(before.item_success(), after.item_success())
                finals.append(after.success_rate)
                print(f"{algorithm:<12} {seed:>5}  {after.success_rate:.3f}   {gain:+.3f} ({low:+.3f} to {high:+.3f})"
                      f"     {time.perf_counter() - started:.0f}", flush=True)
            print(f"{algorithm}: after {min(finals):.3f}-{max(finals):.3f} over {len(finals)} seeds")


if __name__ == "__main__":
    main()

"""The other training methods measured: rejection sampling (RFT) and DPO from the bandit's 50/50 warm start.

    python benchmarks/methods.py [--rounds 1] [--k 4] [--items 16]

Builds the tests' tiny model and its 50/50 SFT warm start (the policy picks either door), then from it: one or
more RFT rounds (sample k per item on the first training items, keep the successes, SFT on them) and DPO (the
same samples paired success against failure), with and without LoRA. Each result is evaluated on the held-out
test items (16 x 8 samples at T 1.0, the learning test's evaluation) with its 95% bootstrap interval, and the
paired change against the warm start over items. Every bandit item shows the same prompt, so greedy decoding
answers all of them alike (0% or 100%, also printed); the sampled success is the policy's preference for the
right door.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--items", type=int, default=8, help="training items sampled")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from envs.launcher import running_server
    from envs.splits import load_split
    from tests.conftest import build_bandit_warm_start, build_test_model
    from tests.test_learning import EVAL
    from training.evaluation.evaluate import evaluate, paired_difference_ci
    from training.lora import LoraSettings
    from training.settings.config import SFTConfig
    from training.warmstart.dpo import DPOConfig, dpo, preference_pairs
    from training.warmstart.rft import RFTConfig, rft, sample

    scratch = Path(tempfile.mkdtemp(prefix="methods-"))
    warm = build_bandit_warm_start(build_test_model(scratch / "tiny"), scratch / "sft")
    train = [r["item_id"] for r in load_split("bandit", "train")][: args.items]
    sampling = RFTConfig(rounds=args.rounds, k=args.k, h=1, max_new_tokens=16,
                         sft=SFTConfig(epochs=3, lr=1e-3, batch_size=8))
    lora = LoraSettings(r=8, alpha=16)
    with running_server("bandit") as url:
        test = [r["item_id"] for r in load_split("bandit", "test")]
        before = evaluate(warm, "bandit", url, test, **EVAL)
        greedy = {"h": 1, "k": 1, "temperature": 0.0, "max_new_tokens": 16}
        before_greedy = evaluate(warm, "bandit", url, test, **greedy).success_rate
        low, high = before.success_ci()
        print(f"held-out: {len(test)} items x {EVAL['k']} samples at T {EVAL['temperature']}; training: "
              f"{len(train)} items x k={args.k}")
        print(f"warm start            success {before.success_rate:6.1%} (95% CI {low:.1%}-{high:.1%}); greedy "
              f"{before_greedy:.0%}")
        def pairs() -> list:
            return preference_pairs(sample(warm, "bandit", url, train, sampling, 0).trajectories)

        runs = {
            "RFT": lambda out: rft(warm, out, "bandit", url, train, sampling)[-1],
            "RFT + LoRA r=8": lambda out: rft(warm, out, "bandit", url, train, sampling.model_copy(
                update={"sft": sampling.sft.model_copy(update={"lora": lora, "lr": 5e-3})}))[-1],
            "DPO": lambda out: dpo(warm, out, pairs(), DPOConfig()),
            "DPO + LoRA r=8": lambda out: dpo(warm, out, pairs(), DPOConfig(lora=lora, lr=2e-3)),
        }
        for name, run in runs.items():
            started = time.perf_counter()
            folder = run(scratch / name.replace(" ", "_").replace("+", "").replace("=", ""))
            seconds = time.perf_counter() - started
            after = evaluate(folder, "bandit", url, test, **EVAL)
            low, high = after.success_ci()
            change, c_low, c_high = paired_difference_ci(before.item_success(), after.item_success())
            after_greedy = evaluate(folder, "bandit", url, test, **greedy).success_rate
            print(f"{name:<21} success {after.success_rate:6.1%} (95% CI {low:.1%}-{high:.1%}); paired change "
                  f"{change:+.1%} ({c_low:+.1%} to {c_high:+.1%}); greedy {after_greedy:.0%}; {seconds:.0f} s")


if __name__ == "__main__":
    main()

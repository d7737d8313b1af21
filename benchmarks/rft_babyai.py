"""Rejection sampling on BabyAI GoTo from the curriculum study's SFT warm start, measured greedy on its 500
held-out items.

    python benchmarks/rft_babyai.py [--rounds 1] [--items 64] [--k 4] [--lr 2e-4] [--epochs 2]

Needs the study's workspace (``python benchmarks/curriculum_study.py pilot`` builds it: runs/curriculum-study,
its ``warm`` checkpoint, ``items.json``) and the warm start's evaluation (docs/curriculum-study/warm.json). Samples
k episodes per item on the first ``--items`` of the study's GRPO items at the evaluation cap (h=10), keeps the
successful ones, fine-tunes on them (their very tokens), and evaluates the result exactly as the study evaluates
its arms (greedy, h=10, every held-out item): success with its 95% CI, the paired change against the warm start
over items, success by how many turns the expert needs, and the rollout tokens spent. Writes
docs/methods-babyai.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STUDY = ROOT / "runs" / "curriculum-study"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--items", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "methods-babyai.json")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(2)
    from envs.files import atomic_write
    from envs.launcher import running_server
    from training.checkpoint import read_manifest
    from training.config import SFTConfig
    from training.evaluate import evaluate, paired_difference_ci
    from training.rft import RFTConfig, rft

    items = json.loads((STUDY / "items.json").read_text())
    warm_eval = json.loads((ROOT / "docs" / "curriculum-study" / "warm.json").read_text())["held_out"]
    held, turns = items["held_out"], {k: int(v) for k, v in items["held_out_expert_turns"].items()}
    train = items["grpo"][: args.items]
    config = RFTConfig(rounds=args.rounds, k=args.k, h=10, max_new_tokens=24, batch_items=16,
                       sft=SFTConfig(epochs=args.epochs, lr=args.lr, batch_size=8))
    # beside the study workspace, never inside it (its git and DVC state); one folder per setting
    out_dir = ROOT / "runs" / f"rft-babyai-{args.rounds}r-{args.items}x{args.k}-lr{args.lr:g}-e{args.epochs}"
    started = time.perf_counter()
    with running_server("babyai") as url:
        rounds = rft(STUDY / "warm", out_dir, "babyai", url, train, config, progress=True)
        train_s = time.perf_counter() - started
        result = evaluate(rounds[-1], "babyai", url, held, h=10, max_new_tokens=24, batch_items=50)
    before = [float(warm_eval["per_item"][i]) for i in held]
    after = [float(result.success[i][0]) for i in held]
    change, low, high = paired_difference_ci(before, after)
    ci = result.success_ci()
    by_turns = {}
    for n in sorted(set(turns.values())):
        chosen = [i for i in held if turns[i] == n]
        by_turns[f"expert_{n}_turns"] = {"warm": sum(before[held.index(i)] for i in chosen) / len(chosen),
                                         "rft": sum(after[held.index(i)] for i in chosen) / len(chosen),
                                         "items": len(chosen)}
    manifests = [read_manifest(r) for r in rounds]
    summary = {"warm_success": warm_eval["success"], "rft_success": result.success_rate, "rft_ci": list(ci),
               "paired_change": change, "paired_ci": [low, high], "items": len(held), "by_expert_turns": by_turns,
               "rounds": [{k: m[k] for k in ("round", "sampled", "kept", "sample_success", "recorded_token_ids")}
                          for m in manifests],
               "settings": {"train_items": len(train), **config.model_dump(mode="json")},
               "sampling_and_sft_seconds": round(train_s, 1), "eval_generated_tokens": result.generated_tokens}
    atomic_write(args.out, json.dumps(summary, indent=1))
    print(f"warm start {warm_eval['success']:.1%} -> RFT {result.success_rate:.1%} (95% CI {ci[0]:.1%}-{ci[1]:.1%}) "
          f"on {len(held)} held-out items, greedy, h=10; paired change {change:+.1%} ({low:+.1%} to {high:+.1%})")
    for m in manifests:
        print(f"round {m['round']}: kept {m['kept']} of {m['sampled']} (sampling success {m['sample_success']:.1%})")
    for name, row in by_turns.items():
        print(f"{name}: {row['warm']:.1%} -> {row['rft']:.1%} ({row['items']} items)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

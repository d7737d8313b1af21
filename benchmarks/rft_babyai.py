"""Rejection sampling on BabyAI GoTo from the curriculum study's SFT warm start, measured greedy on its 500
held-out items.

    python benchmarks/rft_babyai.py [--rounds 1] [--items 64] [--k 4] [--lr 2e-4] [--epochs 2] [--keep all]
    python benchmarks/rft_babyai.py --task goto-h1 --items 256 --k 8    # the learning benchmark's task, h=1

Needs the study's workspace (``python benchmarks/curriculum_study.py pilot`` builds it: runs/curriculum-study,
its ``warm`` checkpoint, ``items.json``) and the warm start's evaluation (docs/curriculum-study/warm.json). Samples
k episodes per item on the first ``--items`` of the study's GRPO items at the evaluation cap (h=10), keeps the
successful ones, fine-tunes on them (their very tokens), and evaluates the result exactly as the study evaluates
its arms (greedy, h=10, every held-out item): success with its 95% CI, the paired change against the warm start
over items, success by how many turns the expert needs, and the rollout tokens spent. Writes
docs/methods-babyai.json.

``--task goto-h1``: the task of benchmarks/learning_babyai.py instead (GoTo with the target in view, one turn;
its SFT warm start built once into runs/rft-babyai-h1/warm, evaluated here on 900 held-out items); writes
docs/methods-babyai-goto-h1.json. ``--task study-h1``: that one-turn task from the study's warm start (RFT on the
study's GRPO items the expert solves in one turn); docs/methods-babyai-study-h1.json.
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


def study_task() -> tuple[Path, list[str], list[str], int, dict[str, float], dict[str, int]]:
    """The curriculum study's task: its warm start, GRPO items, 500 held-out items at h=10, the warm start's
    greedy success per item (docs/curriculum-study/warm.json) and the expert's turns per held-out item."""
    items = json.loads((STUDY / "items.json").read_text())
    warm_eval = json.loads((ROOT / "docs" / "curriculum-study" / "warm.json").read_text())["held_out"]
    held = items["held_out"]
    turns = {k: int(v) for k, v in items["held_out_expert_turns"].items()}
    return STUDY / "warm", items["grpo"], held, 10, {i: float(warm_eval["per_item"][i]) for i in held}, turns


def goto_h1_task() -> tuple[Path, list[str], list[str], int, None, dict[str, int]]:
    """The learning benchmark's task (benchmarks/learning_babyai.py, where GRPO gained +3.6 points): GoTo items
    whose target is in view (the expert solves them in one turn), its SFT warm start (4 epochs on the expert's
    episodes of the first 3,400 pool items; built once into runs/rft-babyai-h1/warm), 900 held-out items."""
    from benchmarks import tiny_model
    from benchmarks.learning_babyai import solvable
    from envs.registry import load_backend
    from training.warmstart.sft import SFTConfig, sft

    backend = load_backend("babyai")
    pool = [f"babyai_{i}" for i in range(2000, 50_000) if backend.sub_task(i) == "GoTo"]
    held_out = [f"babyai_{i}" for i in [*range(900, 2000), *range(50_000, 60_000)] if backend.sub_task(i) == "GoTo"]
    episodes = solvable(pool[:3400], 1)
    warm = ROOT / "runs" / "rft-babyai-h1" / "warm"
    if not (warm / "manifest.json").exists():
        sft(tiny_model(), warm, list(episodes.values()), SFTConfig(epochs=4, lr=1e-3, batch_size=8),
            progress=True)
    test = list(solvable(held_out[:9000], 1))[:900]
    return warm, list(solvable(pool[3400:6000], 1)), test, 1, None, dict.fromkeys(test, 1)


def study_h1_task() -> tuple[Path, list[str], list[str], int, None, dict[str, int]]:
    """The study's warm start on the one-turn task (GoTo with the target in view, h=1): RFT on the study's GRPO
    items the expert solves in one turn, evaluated on the 900 held-out one-turn items of ``goto-h1``."""
    from benchmarks.learning_babyai import solvable
    from envs.registry import load_backend

    backend = load_backend("babyai")
    held_out = [f"babyai_{i}" for i in [*range(900, 2000), *range(50_000, 60_000)] if backend.sub_task(i) == "GoTo"]
    test = list(solvable(held_out[:9000], 1))[:900]
    grpo = json.loads((STUDY / "items.json").read_text())["grpo"]
    return STUDY / "warm", list(solvable(grpo[:2000], 1)), test, 1, None, dict.fromkeys(test, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["study", "goto-h1", "study-h1"], default="study")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--items", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--keep", choices=["all", "shortest"], default="all")
    parser.add_argument("--out", type=Path, default=None, help="default docs/methods-babyai[-<task>].json")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(2)
    from envs.files import atomic_write
    from envs.launcher import running_server
    from training.checkpoint import read_manifest
    from training.evaluation.evaluate import evaluate, paired_difference_ci
    from training.settings.config import SFTConfig
    from training.warmstart.rft import RFTConfig, rft

    tasks = {"study": study_task, "goto-h1": goto_h1_task, "study-h1": study_h1_task}
    warm, pool, held, h, before_items, turns = tasks[args.task]()
    out_json = args.out or ROOT / "docs" / ("methods-babyai.json" if args.task == "study"
                                            else f"methods-babyai-{args.task}.json")
    train = pool[: args.items]
    config = RFTConfig(rounds=args.rounds, k=args.k, h=h, max_new_tokens=24, batch_items=16, keep=args.keep,
                       sft=SFTConfig(epochs=args.epochs, lr=args.lr, batch_size=8))
    # beside the study workspace, never inside it (its git and DVC state); one folder per setting
    task = "" if args.task == "study" else f"{args.task}-"
    keep = "" if args.keep == "all" else f"-{args.keep}"
    setting = f"{args.rounds}r-{args.items}x{args.k}-lr{args.lr:g}-e{args.epochs}{keep}"
    out_dir = ROOT / "runs" / f"rft-babyai-{task}{setting}"
    started = time.perf_counter()
    with running_server("babyai", idle_ttl_s=7200) as url:
        if before_items is None:
            start = evaluate(warm, "babyai", url, held, h=h, max_new_tokens=24, batch_items=50)
            before_items = {i: float(start.success[i][0]) for i in held}
        rounds = rft(warm, out_dir, "babyai", url, train, config, progress=True)
        train_s = time.perf_counter() - started
        result = evaluate(rounds[-1], "babyai", url, held, h=h, max_new_tokens=24, batch_items=50)
    before = [before_items[i] for i in held]
    after = [float(result.success[i][0]) for i in held]
    warm_success = sum(before) / len(before)
    change, low, high = paired_difference_ci(before, after)
    ci = result.success_ci()
    by_turns = {}
    for n in sorted(set(turns.values())):
        chosen = [i for i in held if turns[i] == n]
        by_turns[f"expert_{n}_turns"] = {"warm": sum(before_items[i] for i in chosen) / len(chosen),
                                         "rft": sum(float(result.success[i][0]) for i in chosen) / len(chosen),
                                         "items": len(chosen)}
    manifests = [read_manifest(r) for r in rounds]
    summary = {"task": args.task, "h": h, "warm_success": warm_success, "rft_success": result.success_rate,
               "rft_ci": list(ci), "paired_change": change, "paired_ci": [low, high], "items": len(held),
               "by_expert_turns": by_turns,
               "rounds": [{k: m[k] for k in ("round", "sampled", "kept", "sample_success", "recorded_token_ids")}
                          for m in manifests],
               "settings": {"train_items": len(train), **config.model_dump(mode="json")},
               "sampling_and_sft_seconds": round(train_s, 1), "eval_generated_tokens": result.generated_tokens}
    atomic_write(out_json, json.dumps(summary, indent=1))
    print(f"warm start {warm_success:.1%} -> RFT {result.success_rate:.1%} (95% CI {ci[0]:.1%}-{ci[1]:.1%}) "
          f"on {len(held)} held-out items, greedy, h={h}; paired change {change:+.1%} ({low:+.1%} to {high:+.1%})")
    for m in manifests:
        print(f"round {m['round']}: kept {m['kept']} of {m['sampled']} (sampling success {m['sample_success']:.1%})")
    for name, row in by_turns.items():
        print(f"{name}: {row['warm']:.1%} -> {row['rft']:.1%} ({row['items']} items)")
    print(f"wrote {out_json}")


if __name__ == "__main__":
    main()

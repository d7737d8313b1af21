"""Rollout throughput: 64 concurrent BabyAI trajectories with the tiny model on CPU.

    python benchmarks/rollout_throughput.py [--model models/tiny] [--trajectories 64] [--h 4]

Prints trajectories/s, generated tokens/s, the share of wall time spent waiting on the environment
server (target <= 10%), and the engine's tokens/s against bare ``model.generate`` on the same batch of
prompts (target >= 0.8x). Builds the tiny model into a temporary folder when --model does not exist.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from envs.launcher import running_server
from envs.splits import load_split
from training.engines.engine import HFEngine, SamplingParams
from training.model import load_policy
from training.rollouts.rollout import Rollout, RolloutConfig
from training.settings.warm import PREFIX_CACHE_GB

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` when run as a script


def bare_generate_tokens_per_s(model: torch.nn.Module, tokenizer: Any, prompts: list[list[int]], new: int) -> float:
    """tokens/s of one plain ``model.generate`` call on left-padded prompts (same sampling settings)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(0)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=True, temperature=1.0,
                         top_p=1.0, top_k=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    seconds = time.perf_counter() - start
    generated = out[:, width:]
    tokens = 0
    for row in generated.tolist():
        tokens += row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--h", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prefix-cache-gb", type=float, default=PREFIX_CACHE_GB,
                        help="the hf engine's prefix cache (train/eval prefix_cache_gb; 0: whole prefills)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    from benchmarks import tiny_model

    folder = tiny_model(args.model)
    model, tokenizer = load_policy(folder)
    model.eval()
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, prefix_cache_gb=args.prefix_cache_gb)
    items = [r["item_id"] for r in load_split("babyai", "train")[: args.trajectories // 4]]
    config = RolloutConfig(n_samples=4, max_new_tokens=args.max_new_tokens, context_budget=8192, seed=0)
    with running_server("babyai") as url:
        rollout = Rollout("babyai", url, engine, tokenizer, config)
        rollout.run(items[:2], h=1)  # warm-up: the first generate() of a process costs ~2 s
        result = rollout.run(items, h=args.h, progress=True)
        prompts = [t.input_ids[: t.prompt_length] for t in result.trajectories]
    n = len(result.trajectories)
    print(f"{n} trajectories, h={args.h}: {result.seconds_total:.2f} s wall, "
          f"{n / result.seconds_total:.2f} trajectories/s, {result.generated_tokens / result.seconds_total:.0f} "
          f"generated tokens/s, env share {result.seconds_in_env / result.seconds_total:.1%} "
          f"(generation {result.seconds_generating:.2f} s, env {result.seconds_in_env:.2f} s)")
    if engine.prefix_cache is not None:
        print(f"prefix cache {args.prefix_cache_gb} GiB: {engine.prefix_cache.reused_tokens} prompt tokens not "
              "prefilled again")
    sent = sum(1 for t in result.trajectories for turn in t.turns if not turn.observation.startswith("Error"))
    print(f"turns that reached the server: {sent}; terminations: "
          f"{ {k.split('/')[-1]: int(v) for k, v in result.stats.items() if k.startswith('rollout/termination')} }")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, seed=0)
    start = time.perf_counter()
    gens = engine.generate(prompts, params)
    engine_rate = sum(len(g.token_ids) for g in gens) / (time.perf_counter() - start)
    bare_rate = bare_generate_tokens_per_s(model, tokenizer, prompts, args.max_new_tokens)
    print(f"engine {engine_rate:.0f} tokens/s vs bare model.generate {bare_rate:.0f} tokens/s on the same "
          f"{len(prompts)} prompts: {engine_rate / bare_rate:.2f}x")


if __name__ == "__main__":
    main()

"""Does GRPO learn? BabyAI GoTo levels at small h with the tiny model, warm-started by SFT.

    python benchmarks/learning_babyai.py [--sft-items 600] [--sft-epochs 3] [--steps 30] [--lr 2e-4] [--h 3]

1. Warm start: SFT on the successful expert episodes of GoTo items (the training split's, then indices >=
   2000, which no split holds), deliberately short (3 epochs): the policy then solves some items always,
   some never and many sometimes, so GRPO's groups are mixed and carry a signal. The expert here is a
   high-level one (read the goal, take the visible "go to <target>" action, else turn), so episodes are
   a few turns long and fit a CPU budget.
2. Greedy evaluation (temperature 0) of the warm start on held-out GoTo items (the test split's, then
   indices >= 900, which no split holds).
3. GRPO for --steps steps at turn cap h from the warm start; greedy evaluation again.
Prints success before and after with 95% bootstrap confidence intervals, and the paired bootstrap
interval of the change (same items before and after).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import torch

from envs.babyai.client import Spec
from envs.local import local_client
from envs.registry import load_backend
from envs.splits import item_index, load_split
from envs.testing import running_server
from training.config_train import TrainConfig
from training.evaluate import evaluate, paired_difference_ci
from training.sft import SFTConfig, sft
from training.trainer import train_phase

GOAL = re.compile(r"Your goal: go to (?:the|a) (.+)")


def goto_reply(first_observation: str, observation: str) -> str:
    """The high-level expert: go to the goal object when it is visible, otherwise turn left."""
    target = GOAL.search(first_observation).group(1).split()
    actions = json.loads(observation[observation.index("Available actions: ") + len("Available actions: "):])
    for action in actions:
        words = action.split()
        if action.startswith("go to ") and all(w in words for w in target):
            return f"Thought: the {' '.join(target)} is in sight.\nAction: {action}"
    return "Thought: I do not see it yet.\nAction: turn left"


def expert_conversations(items: list[str], max_turns: int) -> list[list[dict[str, str]]]:
    """Successful high-level expert episodes, in the rollout's message format."""
    client = local_client("babyai")
    human, gpt = Spec.conversation_start
    out = []
    for item in items:
        first = client.reset(item_index(item)).observation
        messages = [{"role": "user", "content": human["value"]}, {"role": "assistant", "content": gpt["value"]},
                    {"role": "user", "content": first}]
        observation = first
        for _ in range(max_turns):
            reply = goto_reply(first, observation)
            step = client.step(reply)
            messages.append({"role": "assistant", "content": reply})
            if step.done:
                if step.success:
                    out.append(messages)
                break
            observation = step.observation
            messages.append({"role": "user", "content": observation})
    client.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--sft-items", type=int, default=600, help="GoTo items the expert plays for SFT")
    parser.add_argument("--warm", default=None, help="reuse this warm-start folder instead of running SFT")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--h", type=int, default=3)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--eval-items", type=int, default=200)
    parser.add_argument("--n-samples", type=int, default=8, help="trajectories per item (the GRPO group)")
    parser.add_argument("--batch-items", type=int, default=8, help="items per GRPO step")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling of the rollouts")
    parser.add_argument("--sft-epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="learning-"))
    started = time.perf_counter()
    # BabyAI's index space is unbounded: indices 900-1999 (held-out evaluation) and >= 2000 (more SFT
    # episodes) are in neither split
    backend = load_backend("babyai")
    train = [r["item_id"] for r in load_split("babyai", "train") if r["sub_task"] == "GoTo"]
    train += [f"babyai_{i}" for i in range(2000, 10_000) if backend.sub_task(i) == "GoTo"]
    test = [r["item_id"] for r in load_split("babyai", "test") if r["sub_task"] == "GoTo"]
    test += [f"babyai_{i}" for i in range(900, 2000) if backend.sub_task(i) == "GoTo"][: args.eval_items - len(test)]
    if args.warm:
        warm = Path(args.warm)
    else:
        conversations = expert_conversations(train[: args.sft_items], args.h)
        warm = sft(Path(args.model), work / "sft", conversations,
                   SFTConfig(epochs=args.sft_epochs, lr=1e-3, batch_size=8))
        print(f"SFT on {len(conversations)} expert episodes ({time.perf_counter() - started:.0f} s)")
    with running_server("babyai") as url:
        before = evaluate(warm, "babyai", url, test, h=args.h, max_new_tokens=24, batch_items=32)
        config = TrainConfig(batch_items=args.batch_items, n_samples=args.n_samples, max_new_tokens=24, lr=args.lr,
                             temperature=args.temperature, top_p=args.top_p, sub_tasks=["GoTo"],
                             mini_batch_size=16, micro_batch_size=8, log_rollouts=False, save_every=args.steps,
                             skip_flat_steps=True)
        final = train_phase("babyai", 0, args.h, args.steps, warm, work / "grpo", config=config, url=url,
                            progress=True)
        after = evaluate(final, "babyai", url, test, h=args.h, max_new_tokens=24, batch_items=32)
    for name, result in (("warm start (SFT)", before), (f"after {args.steps} GRPO steps", after)):
        low, high = result.success_ci()
        print(f"{name:>24}: greedy success {result.success_rate:.1%} on {len(test)} held-out GoTo items "
              f"(95% CI {low:.1%}-{high:.1%})")
    diff, low, high = paired_difference_ci(before.item_success(), after.item_success())
    verdict = "significant" if low > 0 else "not significant"
    print(f"{'change':>24}: {diff:+.1%} (paired bootstrap 95% CI {low:+.1%} to {high:+.1%}: {verdict})")
    print(f"total {time.perf_counter() - started:.0f} s; artifacts in {work} (the warm start: --warm {warm})")


if __name__ == "__main__":
    main()

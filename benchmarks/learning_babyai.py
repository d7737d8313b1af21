"""Does GRPO learn? BabyAI GoTo at small h with the tiny model, warm-started by SFT.

    python benchmarks/learning_babyai.py [--h 1] [--sft-items 3400] [--steps 80] [--batch-items 32] [--lr 2e-4]
                                         [--warm DIR]

About 65 minutes on 2 CPU cores: SFT ~13, GRPO ~40, the two evaluations ~2 each; --warm skips the SFT.

The task: GoTo items that the high-level expert (read the goal, take the visible "go to <target>" action,
else turn) solves within h turns; at the default h=1 these are the items whose target is in view at the
start (about a third of GoTo). The agent must pick, among the listed "go to ..." actions, the one the
goal names: copy the goal's colour and type into its action. Items outside the cap carry no signal for
GRPO and no information for the evaluation, so they are left out of both.

1. Warm start: SFT (--sft-epochs, 4) on the expert's episodes of the first --sft-items GoTo items of a pool that
   no split holds (indices 2000-49999). Deliberately short: the policy then solves some items always,
   some never and many sometimes, so GRPO's groups are mixed and carry a signal.
2. Greedy evaluation (temperature 0) of the warm start on held-out items (indices 900-1999, then
   50000 on; in neither split nor the pool).
3. GRPO for --steps steps at turn cap h from the warm start, on the rest of the pool's items (each seen
   once): the flat groups (all samples right, or all wrong) are dropped from the update, so its compute
   and its token-mean loss go to the groups that carry a signal. Greedy evaluation again on the same
   held-out items.
Prints success before and after with 95% bootstrap confidence intervals, and the paired bootstrap
interval of the change (same items before and after). With --sft-colours the warm start sees only the
goals of some colours, and the held-out items are also reported split by seen and unseen colours.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from envs.babyai.client import Spec
from envs.babyai.expert import GOTO_GOAL, sighted_reply
from envs.launcher import running_server
from envs.local import LocalEnvClient, local_client
from envs.registry import load_backend
from envs.splits import item_index
from training.evaluation.evaluate import EvalResult, evaluate, paired_difference_ci
from training.phases.trainer import train_phase
from training.settings.config import TrainConfig
from training.warmstart.sft import SFTConfig, sft

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` when run as a script

GOAL = GOTO_GOAL
COLOURS = ("red", "green", "blue", "purple", "yellow", "grey")


def goal_colour(episode: list[dict[str, str]]) -> str | None:
    """The colour word of the episode's goal ("go to the red ball" -> "red"), None if it names none."""
    words = GOAL.search(episode[2]["content"]).group(1).split()
    return words[0] if words[0] in COLOURS else None


def expert_episode(client: LocalEnvClient, item: str, max_turns: int) -> list[dict[str, str]] | None:
    """The sighted expert's episode on ``item`` (``envs.babyai.expert.sighted_reply``) in the rollout's message
    format, or None if it fails."""
    human, gpt = Spec.conversation_start
    first = client.reset(item_index(item)).observation
    messages = [{"role": "user", "content": human["value"]}, {"role": "assistant", "content": gpt["value"]},
                {"role": "user", "content": first}]
    observation = first
    for _ in range(max_turns):
        reply = sighted_reply(first, observation)
        step = client.step(reply)
        messages.append({"role": "assistant", "content": reply})
        if step.done:
            return messages if step.success else None
        observation = step.observation
        messages.append({"role": "user", "content": observation})
    return None


def solvable(items: list[str], max_turns: int) -> dict[str, list[dict[str, str]]]:
    """The items the expert solves within ``max_turns`` turns, each with its episode."""
    client = local_client("babyai")
    try:
        episodes = {item: expert_episode(client, item, max_turns) for item in items}
    finally:
        client.close()
    return {item: e for item, e in episodes.items() if e is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--h", type=int, default=1, help="turn cap of the task, the SFT episodes and GRPO")
    parser.add_argument("--sft-items", type=int, default=3400, help="GoTo items of the pool the expert plays for SFT")
    parser.add_argument("--sft-epochs", type=int, default=4)
    parser.add_argument("--sft-colours", default=",".join(COLOURS),
                        help="SFT only on the episodes whose goal has one of these colours (comma-separated); the "
                             "evaluation then reports the seen and unseen colours apart")
    parser.add_argument("--warm", default=None, help="reuse this warm-start folder instead of running SFT")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--eval-items", type=int, default=900)
    parser.add_argument("--n-samples", type=int, default=8, help="trajectories per item (the GRPO group)")
    parser.add_argument("--batch-items", type=int, default=32, help="items per GRPO step")
    parser.add_argument("--mini-batch", type=int, default=32, help="trajectories per optimizer step")
    parser.add_argument("--old-logprobs", choices=["sampler", "recompute"], default="sampler",
                        help="PPO's old log-probs: the sampler's (one forward pass less per step) or recomputed")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling of the rollouts")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts")
    parser.add_argument("--drop-flat-groups", action=argparse.BooleanOptionalAction, default=True,
                        help="update on the mixed groups only (DAPO's dynamic sampling)")
    parser.add_argument("--ppo-epochs", type=int, default=1, help="passes over each step's mini-batches")
    parser.add_argument("--seed", type=int, default=0, help="GRPO's seed (sampling, data order)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="learning-"))
    started = time.perf_counter()
    # BabyAI's index space is unbounded; the splits draw from 0-899. Indices 2000-49999 are the training
    # pool (the first --sft-items for SFT, the rest for GRPO); 900-1999, then 50000 on, are held out.
    backend = load_backend("babyai")
    pool = [f"babyai_{i}" for i in range(2000, 50_000) if backend.sub_task(i) == "GoTo"]
    held_out = [f"babyai_{i}" for i in [*range(900, 2000), *range(50_000, 60_000)] if backend.sub_task(i) == "GoTo"]
    seen: set[str | None] = set(args.sft_colours.split(","))
    if not seen <= set(COLOURS):
        parser.error(f"--sft-colours: {sorted(seen - set(COLOURS))} are not BabyAI colours {COLOURS}")
    seen.add(None)  # a goal that names no colour ("go to the ball") is never held back
    sft_episodes = {item: e for item, e in solvable(pool[: args.sft_items], args.h).items()
                    if goal_colour(e) in seen}
    grpo_items = list(solvable(pool[args.sft_items:], args.h))
    test_episodes = dict(list(solvable(held_out[: 10 * args.eval_items], args.h).items())[: args.eval_items])
    test = list(test_episodes)
    subsets = {"all": test}
    if seen != {*COLOURS, None}:
        subsets["seen colours"] = [i for i in test if goal_colour(test_episodes[i]) in seen]
        subsets["unseen colours"] = [i for i in test if goal_colour(test_episodes[i]) not in seen]
    print(f"task: GoTo items the expert solves within h={args.h} turns; {len(sft_episodes)} SFT episodes, "
          f"{len(grpo_items)} GRPO items, {len(test)} held-out items")
    if args.warm:
        warm = Path(args.warm)
    else:
        from benchmarks import tiny_model

        warm = sft(tiny_model(args.model), work / "sft", list(sft_episodes.values()),
                   SFTConfig(epochs=args.sft_epochs, lr=1e-3, batch_size=8), progress=True)
        print(f"SFT on {len(sft_episodes)} expert episodes ({time.perf_counter() - started:.0f} s)")
    with running_server("babyai") as url:
        before = evaluate(warm, "babyai", url, test, h=args.h, max_new_tokens=24, batch_items=32)
        config = TrainConfig(items=grpo_items, batch_items=args.batch_items, n_samples=args.n_samples,
                             max_new_tokens=24, lr=args.lr, temperature=args.temperature, top_p=args.top_p,
                             mini_batch_size=args.mini_batch, micro_batch_size=16, log_rollouts=False,
                             save_every=args.steps, skip_flat_steps=True, drop_flat_groups=args.drop_flat_groups,
                             ppo_epochs=args.ppo_epochs, old_logprobs=args.old_logprobs, seed=args.seed)
        final = train_phase("babyai", 0, args.h, args.steps, warm, work / "grpo", config=config, url=url,
                            progress=True)
        after = evaluate(final, "babyai", url, test, h=args.h, max_new_tokens=24, batch_items=32)
    for subset, items in subsets.items():
        if subset != "all":
            print(f"-- held-out items whose goal colour SFT {'saw' if subset == 'seen colours' else 'never saw'}:")
        for name, result in (("warm start (SFT)", before), (f"after {args.steps} GRPO steps", after)):
            part = EvalResult(success={i: result.success[i] for i in items}, reward={})
            low, high = part.success_ci()
            print(f"{name:>24}: greedy success {part.success_rate:.1%} on {len(items)} held-out items "
                  f"(95% CI {low:.1%}-{high:.1%})")
        diff, low, high = paired_difference_ci([float(before.success[i][0]) for i in items],
                                               [float(after.success[i][0]) for i in items])
        verdict = "significant" if low > 0 else "not significant"
        print(f"{'change':>24}: {diff:+.1%} (paired bootstrap 95% CI {low:+.1%} to {high:+.1%}: {verdict})")
    print(f"total {time.perf_counter() - started:.0f} s; artifacts in {work} (the warm start: --warm {warm}; "
          f"GRPO metrics: {work / 'grpo' / 'dvclive'})")


if __name__ == "__main__":
    main()

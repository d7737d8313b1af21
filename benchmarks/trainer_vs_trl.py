"""Trainer tokens/s (forward + backward + optimizer step over agent tokens) against TRL's GRPOTrainer.

    pip install trl            # not a project dependency; installs beside the project without conflicts
    python benchmarks/trainer_vs_trl.py [--model models/tiny] [--batch 16] [--prompt 512] [--completion 128]

Same model, same batch of token ids (prompt + completion, loss on the completion), same loss settings
(clip 0.2, k3 KL to a reference 1e-3, GRPO advantages), one process on the CPU, at the same precision: fp32,
then bf16 autocast (TRL's default ``bf16=True``; this project's ``precision: bf16``). TRL's gradient
checkpointing default is turned off for the comparison (this project has none). TRL has no entropy
bonus, so this project's trainer is timed both with TRL's loss and with the paper's (entropy 1e-3).
For TRL the batch goes through ``GRPOTrainer.compute_loss`` (its training path after generation); for
this project through the trainer's update (``policy_forward`` + ``actor_loss`` + AdamW step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from training.model import load_policy
from training.placement.devices import autocast
from training.rl.advantages import masked_mean
from training.rl.losses import actor_loss, policy_forward, token_logprobs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` when run as a script


def batch(vocab: int, rows: int, prompt: int, completion: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "prompt_ids": torch.randint(3, vocab, (rows, prompt), generator=g),
        "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (rows, completion), generator=g),
        "completion_mask": torch.ones(rows, completion, dtype=torch.long),
        "advantages": torch.randn(rows, generator=g),
    }


def ours(model_dir: str, data: dict[str, torch.Tensor], entropy_coef: float, bf16: bool) -> Callable[[], None]:
    """One update of this project's trainer on the batch (policy_forward + actor_loss + AdamW)."""
    model, _ = load_policy(model_dir)
    ref, _ = load_policy(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.cat([data["prompt_ids"], data["completion_ids"]], 1)
    mask = torch.cat([torch.zeros_like(data["prompt_mask"]), data["completion_mask"]], 1).float()
    with torch.no_grad():
        old = token_logprobs(model(input_ids=ids).logits, ids)
        ref_lp = token_logprobs(ref(input_ids=ids).logits, ids)
    assert torch.isfinite(masked_mean(old, mask))
    adv = data["advantages"][:, None] * mask
    model.train()

    def step() -> None:
        with autocast(torch.device("cpu"), "bf16" if bf16 else "fp32"):
            logprobs, entropy = policy_forward(model, ids, torch.ones_like(ids), mask,
                                               entropy_grad=entropy_coef != 0)
        loss = actor_loss(logprobs, old, adv, mask, ref_logprobs=ref_lp, entropy=entropy,
                          entropy_coef=entropy_coef).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def trl(model_dir: str, data: dict[str, torch.Tensor], bf16: bool) -> Callable[[], None]:
    """One update through TRL's ``GRPOTrainer.compute_loss`` + AdamW on the same batch."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = load_policy(model_dir)
    rows, completion = data["completion_ids"].shape
    config = GRPOConfig(output_dir="/tmp/trl-bench", per_device_train_batch_size=rows, num_generations=rows,
                        max_completion_length=completion, beta=1e-3, epsilon=0.2, learning_rate=1e-6,
                        use_cpu=True, report_to=[], logging_steps=10**9, save_strategy="no", loss_type="bnpo",
                        bf16=bf16, gradient_checkpointing=False)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
                          train_dataset=Dataset.from_dict({"prompt": ["x"] * rows}), processing_class=tokenizer)
    inputs = dict(data)
    with torch.no_grad():
        ids = torch.cat([data["prompt_ids"], data["completion_ids"]], 1)
        logits = trainer.ref_model(input_ids=ids).logits if trainer.ref_model is not None else model(ids).logits
        inputs["ref_per_token_logps"] = token_logprobs(logits, ids)[:, -completion:]
    inputs["num_items_in_batch"] = data["completion_mask"].sum()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() in a real run
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model.train()

    def step() -> None:
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def timed(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--completion", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(2)
    from benchmarks import tiny_model

    args.model = str(tiny_model(args.model))
    model, _ = load_policy(args.model)
    data = batch(model.config.vocab_size, args.batch, args.prompt, args.completion)
    tokens = float(data["completion_mask"].sum())
    print(f"batch {args.batch} x (prompt {args.prompt} + completion {args.completion}) tokens, tiny model, CPU, "
          f"agent tokens/s (median of {args.repeats} interleaved rounds):")
    for bf16 in (False, True):
        steps = {"same": ours(args.model, data, 0.0, bf16), "bonus": ours(args.model, data, 1e-3, bf16),
                 "trl": trl(args.model, data, bf16)}
        times: dict[str, list[float]] = {name: [] for name in steps}
        # interleaved rounds: drift in the machine's speed (other processes, thermal) hits all three alike
        for round_ in range(args.warmup + args.repeats):
            for name, step in steps.items():
                seconds = timed(step)
                if round_ >= args.warmup:
                    times[name].append(seconds)
        same_loss, with_bonus, theirs = (tokens / statistics.median(times[n]) for n in ("same", "bonus", "trl"))
        precision = "bf16 autocast" if bf16 else "fp32"
        print(f"  [{precision}] scalinginter, TRL's loss (no entropy bonus): {same_loss:6.0f}  "
              f"{same_loss / theirs:.2f}x")
        print(f"  [{precision}] scalinginter, paper's loss (entropy 1e-3)  : {with_bonus:6.0f}  "
              f"{with_bonus / theirs:.2f}x")
        print(f"  [{precision}] TRL GRPOTrainer.compute_loss               : {theirs:6.0f}")


if __name__ == "__main__":
    main()

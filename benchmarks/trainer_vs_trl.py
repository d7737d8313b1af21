"""Trainer tokens/s (forward + backward + optimizer step over agent tokens) against TRL's GRPOTrainer.

    pip install trl            # not a project dependency; installs beside the project without conflicts
    python benchmarks/trainer_vs_trl.py [--model models/tiny] [--batch 16] [--prompt 512] [--completion 128]

Same model, same batch of token ids (prompt + completion, loss on the completion), same loss settings
(clip 0.2, k3 KL to a reference 1e-3, GRPO advantages), one process on the CPU. TRL has no entropy
bonus, so this project's trainer is timed both with TRL's loss and with the paper's (entropy 1e-3).
For TRL the batch goes through ``GRPOTrainer.compute_loss`` (its training path after generation); for
this project through the trainer's update (``policy_forward`` + ``actor_loss`` + AdamW step).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from training.advantages import masked_mean
from training.losses import actor_loss, policy_forward, token_logprobs
from training.model import load_policy


def batch(vocab: int, rows: int, prompt: int, completion: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "prompt_ids": torch.randint(3, vocab, (rows, prompt), generator=g),
        "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (rows, completion), generator=g),
        "completion_mask": torch.ones(rows, completion, dtype=torch.long),
        "advantages": torch.randn(rows, generator=g),
    }


def ours(model_dir: str, data: dict[str, torch.Tensor], repeats: int, entropy_coef: float) -> float:
    model, _ = load_policy(model_dir)
    ref, _ = load_policy(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.cat([data["prompt_ids"], data["completion_ids"]], 1)
    mask = torch.cat([torch.zeros_like(data["prompt_mask"]), data["completion_mask"]], 1).float()
    with torch.no_grad():
        old = token_logprobs(model(input_ids=ids).logits, ids)
        ref_lp = token_logprobs(ref(input_ids=ids).logits, ids)
    adv = data["advantages"][:, None] * mask
    times = []
    model.train()
    for _ in range(repeats):
        start = time.perf_counter()
        logprobs, entropy = policy_forward(model, ids, torch.ones_like(ids), mask, entropy_grad=entropy_coef != 0)
        loss = actor_loss(logprobs, old, adv, mask, ref_logprobs=ref_lp, entropy=entropy,
                          entropy_coef=entropy_coef).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    assert torch.isfinite(masked_mean(old, mask))
    return float(mask.sum()) / statistics.median(times)


def trl(model_dir: str, data: dict[str, torch.Tensor], repeats: int) -> float:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = load_policy(model_dir)
    rows, completion = data["completion_ids"].shape
    config = GRPOConfig(output_dir="/tmp/trl-bench", per_device_train_batch_size=rows, num_generations=rows,
                        max_completion_length=completion, beta=1e-3, epsilon=0.2, learning_rate=1e-6,
                        use_cpu=True, report_to=[], logging_steps=10**9, save_strategy="no", loss_type="bnpo")
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
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return float(data["completion_mask"].sum()) / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--completion", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, _ = load_policy(args.model)
    data = batch(model.config.vocab_size, args.batch, args.prompt, args.completion)
    same_loss = ours(args.model, data, args.repeats, entropy_coef=0.0)
    with_bonus = ours(args.model, data, args.repeats, entropy_coef=1e-3)
    theirs = trl(args.model, data, args.repeats)
    print(f"batch {args.batch} x (prompt {args.prompt} + completion {args.completion}) tokens, tiny model, CPU:")
    print(f"  scalinginter, TRL's loss (no entropy bonus) : {same_loss:8.0f} agent tokens/s  "
          f"{same_loss / theirs:.2f}x")
    print(f"  scalinginter, paper's loss (entropy 1e-3)   : {with_bonus:8.0f} agent tokens/s  "
          f"{with_bonus / theirs:.2f}x")
    print(f"  TRL GRPOTrainer.compute_loss                : {theirs:8.0f} agent tokens/s")


if __name__ == "__main__":
    main()

"""Check that a strategy trains like the torch strategy: same seed, same batch, same losses.

    python -m training.strategy_check --model models/tiny --strategy torch
    torchrun --nproc_per_node 2 -m training.strategy_check --model models/tiny --strategy deepspeed --zero 2

A fixed synthetic batch (seeded; every sequence the same length and mask, so every rank holds the same
number of agent tokens) is split evenly across ranks; each step prints the batch's loss (averaged over
ranks) as a JSON line. With data parallelism the update equals the one-process update on the whole batch. After
the last step the weights are gathered (every rank takes part: ZeRO-3 partitions them), written by rank 0 as a model
folder and read back; the line carries their norm, which must equal the torch strategy's.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from training.model import load_policy
from training.placement.strategy import exit_rank, make_strategy
from training.rl.losses import actor_loss, token_logprobs


def synthetic_batch(vocab: int, rows: int = 8, length: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    mask = torch.zeros(rows, length)
    mask[:, length // 2:] = 1.0
    advantages = torch.randn(rows, 1, generator=g) * mask
    return {"input_ids": ids, "mask": mask, "advantages": advantages}


def weights_norm(state: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in state.values())))


def run(model_dir: str, strategy_name: str, zero: int, steps: int, lr: float) -> tuple[list[float], float | None]:
    torch.manual_seed(0)
    model, _ = load_policy(model_dir)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    strategy = make_strategy(strategy_name, model, optimizer, grad_clip=1.0, zero_stage=zero, micro_batch_size=1)
    batch = synthetic_batch(model.config.vocab_size)
    with torch.no_grad():
        old = token_logprobs(model(input_ids=batch["input_ids"]).logits, batch["input_ids"])
    rows = torch.arange(strategy.rank, len(batch["input_ids"]), strategy.world_size)
    losses = []
    for _ in range(steps):
        ids = batch["input_ids"][rows]
        logits = strategy.model(input_ids=ids).logits
        loss = actor_loss(token_logprobs(logits, ids), old[rows], batch["advantages"][rows], batch["mask"][rows],
                          entropy=None).loss
        strategy.backward(loss, last_micro_batch=True)
        strategy.step()
        value = loss.detach().clone()
        if strategy.world_size > 1:
            torch.distributed.all_reduce(value)
            value /= strategy.world_size
        losses.append(float(value))
    weights = strategy.gather_weights()  # a collective under ZeRO-3: every rank calls it
    norm = None
    if strategy.rank == 0:
        with tempfile.TemporaryDirectory() as folder:
            strategy.save_model(Path(folder), weights)
            norm = weights_norm(load_file(Path(folder) / "model.safetensors"))
    if strategy.world_size > 1:
        strategy.barrier()
    return losses, norm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--strategy", default="torch", choices=["torch", "deepspeed"])
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    losses, norm = run(args.model, args.strategy, args.zero, args.steps, args.lr)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"strategy": args.strategy, "zero": args.zero, "losses": losses, "weights_norm": norm}))
    exit_rank()  # under torchrun: leave the group and end before the interpreter's shutdown


if __name__ == "__main__":
    main()

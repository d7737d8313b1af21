"""Check that a backend trains like the torch backend: same seed, same batch, same losses.

    python -m training.backend_check --model models/tiny --backend torch
    torchrun --nproc_per_node 2 -m training.backend_check --model models/tiny --backend deepspeed --zero 2

A fixed synthetic batch (seeded; every sequence the same length and mask, so every rank holds the same
number of agent tokens) is split evenly across ranks; each step prints the batch's loss (averaged over
ranks) as a JSON line. With data parallelism the update equals the one-process update on the whole batch.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from training.backends import make_backend
from training.losses import actor_loss, token_logprobs
from training.model import load_policy


def synthetic_batch(vocab: int, rows: int = 8, length: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    mask = torch.zeros(rows, length)
    mask[:, length // 2:] = 1.0
    advantages = torch.randn(rows, 1, generator=g) * mask
    return {"input_ids": ids, "mask": mask, "advantages": advantages}


def run(model_dir: str, backend_name: str, zero: int, steps: int, lr: float) -> list[float]:
    torch.manual_seed(0)
    model, _ = load_policy(model_dir)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    backend = make_backend(backend_name, model, optimizer, grad_clip=1.0, zero_stage=zero, micro_batch_size=1)
    batch = synthetic_batch(model.config.vocab_size)
    with torch.no_grad():
        old = token_logprobs(model(input_ids=batch["input_ids"]).logits, batch["input_ids"])
    rows = torch.arange(backend.rank, len(batch["input_ids"]), backend.world_size)
    losses = []
    for _ in range(steps):
        ids = batch["input_ids"][rows]
        logits = backend.model(input_ids=ids).logits
        loss = actor_loss(token_logprobs(logits, ids), old[rows], batch["advantages"][rows], batch["mask"][rows],
                          entropy=None).loss
        backend.backward(loss, last_micro_batch=True)
        backend.step()
        value = loss.detach().clone()
        if backend.world_size > 1:
            torch.distributed.all_reduce(value)
            value /= backend.world_size
        losses.append(float(value))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--backend", default="torch", choices=["torch", "deepspeed"])
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    losses = run(args.model, args.backend, args.zero, args.steps, args.lr)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"backend": args.backend, "zero": args.zero, "losses": losses}))


if __name__ == "__main__":
    main()

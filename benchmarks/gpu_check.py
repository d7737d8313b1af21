"""GPU check: one short phase's worth of work on CUDA (or an NPU) in bf16 with a Qwen2.5-0.5B-shaped random-init
policy and the hf engine. Needs only torch and transformers (what a GPU machine's image has): it uses the
project's engine and loss code, not its environment servers.

    bash benchmarks/gpu_check.sh            # python benchmarks/gpu_check.py --steps 4

Each step: 64 prompts x 128 new tokens sampled with ``HFEngine`` (the rollout's engine), then a GRPO-style update
(PPO-clip loss with the project's ``policy_forward`` / ``actor_loss``, AdamW, bf16 autocast, float32 weights)
over the sampled sequences in micro-batches of 8. Prints one JSON line: generation tokens/s, training tokens/s,
peak memory, the preflight's estimate of it for the same shape and settings (by part), and the device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


SHAPES = {  # Qwen2.5-0.5B's shape; a tiny one for a CPU smoke test of this script
    "qwen2.5-0.5b": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14},
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4},
}


def training_estimate(config: dict, device: torch.device, args: argparse.Namespace) -> tuple[int, dict[str, float]]:
    """The preflight's memory estimate (``training.preflight.memory_estimate``) for this check's training: one
    process, float32 weights and AdamW, bf16 autocast, micro-batches of prompt + new tokens, an entropy term, no
    reference; printed beside the measured peak, so a GPU run says how far the estimate is off. Returns the
    weights the preflight counts for the shape, and the estimate by part (GiB)."""
    from training.preflight import ModelShape, Plan, Pool, memory_estimate
    from training.settings.config import EvalConfig, PolicyServerConfig, TrainConfig

    train = TrainConfig(micro_batch_size=args.micro_batch, context_budget=max(16, args.prompt_tokens),
                        max_new_tokens=args.new_tokens, precision="bf16", kl_coef=0.0, entropy_coef=1e-3)
    memory = (torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else 1.0)
    pool = Pool(name="here", kind=device.type if device.type in ("cuda", "npu") else "cpu", devices=1,
                memory_gib=memory)
    shape = ModelShape.from_config(config, "gpu_check")
    return shape.parameters, memory_estimate(Plan(env="gpu_check", profile="gpu_check", train=train,
                                                  evaluation=EvalConfig(), servers={},
                                                  policy_server=PolicyServerConfig(), model=shape, nproc=1, pool=pool))


def main() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from training.engines.engine import HFEngine, SamplingParams
    from training.placement.devices import autocast, resolve_device
    from training.rl.losses import actor_loss, policy_forward

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()

    device = resolve_device(args.device)
    if device.type == "cpu":
        print("warning: no accelerator found; running on CPU (slow, and not what this check is for)", file=sys.stderr)
    torch.manual_seed(0)
    shape = SHAPES[args.shape]
    config = Qwen2Config(**shape, num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
                         eos_token_id=shape["vocab_size"] - 1, pad_token_id=shape["vocab_size"] - 2)
    model = Qwen2ForCausalLM(config).to(device)  # float32 weights and optimizer, bf16 autocast: as the trainer
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    engine = HFEngine(model, config.eos_token_id, config.pad_token_id, batch_size=args.prompts)
    gen_tokens = train_tokens = 0
    gen_s = train_s = 0.0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.steps):
        seeded = torch.Generator().manual_seed(step)
        prompts = torch.randint(0, config.vocab_size - 2, (args.prompts, args.prompt_tokens), generator=seeded).tolist()
        model.eval()
        started = time.perf_counter()
        with autocast(device, "bf16"):
            turns = engine.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0,
                                                            seed=step))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        gen_s += time.perf_counter() - started if step else 0.0  # step 0 warms up
        gen_tokens += sum(len(t.token_ids) for t in turns) if step else 0
        width = args.prompt_tokens + max(len(t.token_ids) for t in turns)
        ids = torch.full((args.prompts, width), config.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        old = torch.zeros(args.prompts, width)
        for row, (prompt, turn) in enumerate(zip(prompts, turns, strict=True)):
            seq = prompt + turn.token_ids
            ids[row, :len(seq)] = torch.tensor(seq)
            mask[row, len(prompt):len(seq)] = 1
            old[row, len(prompt):len(seq)] = torch.tensor(turn.logprobs)
        attention = (torch.arange(width)[None, :] < torch.tensor([args.prompt_tokens + len(t.token_ids)
                                                                   for t in turns])[:, None]).long()
        advantages = torch.randn(args.prompts, 1).expand(-1, width) * mask
        model.train()
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for start in range(0, args.prompts, args.micro_batch):
            rows = slice(start, start + args.micro_batch)
            with autocast(device, "bf16"):
                logprobs, entropy = policy_forward(model, ids[rows].to(device), attention[rows].to(device),
                                                   mask[rows].to(device))
            loss = actor_loss(logprobs, old[rows].to(device), advantages[rows].to(device), mask[rows].to(device),
                              entropy=entropy, kl_coef=0.0)
            (loss.loss * args.micro_batch / args.prompts).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_s += time.perf_counter() - started if step else 0.0
        train_tokens += int(attention.sum()) if step else 0
    counted, estimate = training_estimate(config.to_dict(), device, args)
    out = {"device": str(device), "name": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
           "parameters": sum(p.numel() for p in model.parameters()), "steps_timed": args.steps - 1,
           "generation_tokens_per_s": round(gen_tokens / max(gen_s, 1e-9), 1),
           "training_tokens_per_s": round(train_tokens / max(train_s, 1e-9), 1),
           "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda"
           else None, "preflight_parameters": counted,
           "preflight_estimate_gib": round(sum(estimate.values()), 2),
           "preflight_parts_gib": {k: round(v, 3) for k, v in estimate.items() if v}, "torch": torch.__version__}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""One GRPO step end to end, this project's trainer against TRL's GRPOTrainer (issue 51).

    make trl                                      # TRL's own venv, .venv-trl (not a project dependency)
    python benchmarks/grpo_step_vs_trl.py [--steps 6] [--blocks 2] [--core 1]

One optimizer step on each side: 8 prompts x 8 samples (the bandit environment's opening, rendered by the
project's chat format), <= 64 new tokens at temperature 1.0, KL 1e-3 to the starting model, AdamW lr 1e-6, fp32,
one thread, the project's tiny policy (``models/tiny``, built by the project's builder). This side:
``PhaseTrainer.train_step`` (the rollout against a real bandit server, the reference's log-probs, the update);
TRL's side: ``GRPOTrainer.train`` (its generation, reward, reference log-probs and update). Each side runs in its
own process pinned to one core (``taskset``), in blocks of ``--steps`` steps, alternating sides ``--blocks``
times; a block's first step (the warm-up) is left out and the median step of the rest reported, with its split:
rollout (generation and scoring), reference forward, old log-probs (none on either side at TRL-matched settings:
one update per generation uses the sampler's / the current log-probs), update.

This project's trainer is timed twice: at TRL-matched settings (no entropy bonus, the sampler's log-probs as the
old ones, no weight decay, every group updated) and at its defaults (entropy bonus 1e-3, old log-probs
recomputed, weight decay 0.01). Trained tokens/s = completion tokens in the batch / the step's wall time.
Prints one line per side and the ratios; ``--json`` writes every step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
PROMPTS, SAMPLES, NEW_TOKENS, LR, KL = 8, 8, 64, 1e-6, 1e-3
SPLIT = ("rollout", "reference", "old_logprobs", "update")


def _timed(real: Callable[..., Any], charge: Callable[[tuple, float], None]) -> Callable[..., Any]:
    """``real``, calling ``charge(its positional arguments, seconds it took)`` after each call."""
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            charge(args, time.perf_counter() - started)
    return wrapped


def _ours(model: str, steps: int, matched: bool) -> list[dict[str, float]]:
    """``steps`` calls of ``PhaseTrainer.train_step`` on the bandit environment; each step's wall time, split and
    trained tokens."""
    import torch

    sys.path.insert(0, str(ROOT))
    import training.rl.update as update_module
    from envs.launcher import running_server
    from training.phases.trainer import PhaseTrainer
    from training.settings.config import TrainConfig

    torch.set_num_threads(1)
    spent = {"reference": 0.0, "old_logprobs": 0.0}

    def charge(args: tuple, seconds: float) -> None:
        spent["reference" if args[0] is trainer.reference else "old_logprobs"] += seconds

    update_module.sequence_logprobs = _timed(update_module.sequence_logprobs, charge)
    settings = {"batch_items": PROMPTS, "n_samples": SAMPLES, "max_new_tokens": NEW_TOKENS, "temperature": 1.0,
                "kl_coef": KL, "lr": LR, "mini_batch_size": PROMPTS * SAMPLES, "micro_batch_size": PROMPTS * SAMPLES,
                "drop_flat_groups": False, "skip_flat_steps": False, "log_rollouts": False, "save_every": 10**6,
                "guard": {"enabled": False}}
    if matched:
        settings |= {"entropy_coef": 0.0, "old_logprobs": "sampler", "weight_decay": 0.0}
    rows = []
    with running_server("bandit") as url, tempfile.TemporaryDirectory() as out:
        trainer = PhaseTrainer("bandit", 0, 1, steps, Path(model), Path(out), config=TrainConfig(**settings), url=url)
        for step in range(steps):
            spent.update(reference=0.0, old_logprobs=0.0)
            started = time.perf_counter()
            stats = trainer.train_step(step)
            wall = time.perf_counter() - started
            prep = stats.get("timing_s/prep", 0.0)
            rows.append({"wall": wall, "rollout": stats["timing_s/gen"], "reference": spent["reference"],
                         "old_logprobs": spent["old_logprobs"],
                         "update": stats.get("timing_s/update", 0.0) + prep - sum(spent.values()),
                         "tokens": stats["perf/tokens_per_s"] * stats["timing_s/update"]})
    return rows


def _trl(model: str, steps: int, prompt: str) -> list[dict[str, float]]:
    """``steps`` steps of TRL's ``GRPOTrainer`` (run with .venv-trl's python); each step's wall time and split."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")

    def reward(completions: list[str], **_: object) -> list[float]:  # the bandit's: the right door pays 1
        return [float(c.strip().lower().endswith("right")) for c in completions]

    config = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-step-"), per_device_train_batch_size=PROMPTS * SAMPLES,
                        num_generations=SAMPLES, max_completion_length=NEW_TOKENS, temperature=1.0, beta=KL,
                        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, use_cpu=True,
                        report_to=[], logging_steps=10**9, save_strategy="no", max_steps=steps, seed=0,
                        gradient_checkpointing=False, bf16=False, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": [prompt] * (PROMPTS * steps)}))
    spent = {name: 0.0 for name in SPLIT} | {"tokens": 0.0}

    def charge_logps(args: tuple, seconds: float) -> None:
        if args[0] is trainer.ref_model:
            spent["reference"] += seconds
        elif not torch.is_grad_enabled():
            spent["old_logprobs"] += seconds

    def charge_rollout(_: tuple, seconds: float) -> None:
        spent["rollout"] += seconds

    trainer._get_per_token_logps_and_entropies = _timed(trainer._get_per_token_logps_and_entropies, charge_logps)
    trainer._generate_and_score_completions = _timed(trainer._generate_and_score_completions, charge_rollout)
    rows: list[dict[str, float]] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_: object, **__: object) -> None:
            spent.update({name: 0.0 for name in spent})
            self.started = time.perf_counter()

        def on_step_end(self, *_: object, **__: object) -> None:
            wall = time.perf_counter() - self.started
            rollout = spent["rollout"] - spent["reference"] - spent["old_logprobs"]
            rows.append({"wall": wall, "rollout": rollout, "reference": spent["reference"],
                         "old_logprobs": spent["old_logprobs"], "tokens": spent["tokens"],
                         "update": wall - spent["rollout"]})

    # the completion mask is known once the batch is generated: count it where the loss gets it
    real_prepare = trainer._prepare_inputs

    def prepare(*args: object, **kwargs: object) -> dict:
        inputs = real_prepare(*args, **kwargs)
        spent["tokens"] += float(inputs["completion_mask"].sum())
        return inputs
    trainer._prepare_inputs = prepare
    trainer.add_callback(Clock())
    trainer.train()
    return rows


def _worker(args: argparse.Namespace) -> None:
    if args.side == "trl":
        rows = _trl(args.model, args.steps, args.prompt)
    else:
        rows = _ours(args.model, args.steps, matched=args.side == "ours-matched")
    print("ROWS " + json.dumps(rows), flush=True)


def bandit_prompt() -> str:
    """The rollout's first prompt on the bandit: its opening messages in the project's chat format, as text."""
    from envs.bandit.backend import OBSERVATION
    from envs.registry import spec_class
    from training.chat_format import ChatFormat, opening_messages
    from training.model import load_policy

    _, tokenizer = load_policy(str(_model()))
    return ChatFormat(tokenizer).render(opening_messages(spec_class("bandit").conversation_start, OBSERVATION),
                                        generation_prompt=True)


def _model() -> Path:
    sys.path.insert(0, str(ROOT))
    from benchmarks import tiny_model

    return tiny_model()


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="steps per block (the first is a warm-up)")
    parser.add_argument("--blocks", type=int, default=2, help="blocks per side, the sides alternating")
    parser.add_argument("--core", type=int, default=1, help="the one core every side is pinned to")
    parser.add_argument("--json", type=Path, default=None, help="write every step here")
    parser.add_argument("--side", choices=["ours-matched", "ours-defaults", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--prompt", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        return _worker(args)
    if not TRL_PYTHON.exists():
        raise SystemExit(f"{TRL_PYTHON} is missing: `make trl` builds TRL's own venv (not a project dependency)")
    model, prompt = str(_model()), bandit_prompt()
    pythons = {"ours-matched": sys.executable, "ours-defaults": sys.executable, "trl": str(TRL_PYTHON)}
    steps: dict[str, list[dict[str, float]]] = {side: [] for side in pythons}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    for block in range(args.blocks):
        for side, python in pythons.items():
            command = ["taskset", "-c", str(args.core), python, __file__, "--side", side, "--model", model,
                       "--steps", str(args.steps), "--prompt", prompt]
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{side} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            rows = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("ROWS "))[5:])
            steps[side] += [r | {"block": block} for r in rows[1:]]  # the block's first step warms up
    trl_rate = _median(steps["trl"], "tokens") / _median(steps["trl"], "wall")
    print(f"one step = {PROMPTS} prompts x {SAMPLES} samples, <= {NEW_TOKENS} new tokens, fp32, one core; median of "
          f"{args.blocks} x {args.steps - 1} steps per side:")
    for side, rows in steps.items():
        rate = _median(rows, "tokens") / _median(rows, "wall")
        split = ", ".join(f"{name} {_median(rows, name):.2f}" for name in SPLIT)
        ratio = "" if side == "trl" else f"  {rate / trl_rate:.2f}x TRL"
        print(f"{side:14s}: {rate:6.0f} trained tokens/s, step {_median(rows, 'wall'):.2f} s ({split} s){ratio}")
    if args.json:
        args.json.write_text(json.dumps(steps, indent=1) + "\n")


if __name__ == "__main__":
    main()

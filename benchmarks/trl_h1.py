"""TRL's GRPOTrainer beside this project's trainer on the single-turn case (BabyAI GoTo, turn cap h=1).

Both start from the same warm start, train on the same GRPO items in the same order, with the same group
size (4), items per step (8, so 32 completions and one optimizer step per step), learning rate, number of
steps, sampling temperature (1.0, no top-k/top-p), completion cap (24 tokens), PPO clip 0.2, k3 KL to the warm
start (1e-3), entropy bonus 1e-3 and gradient clipping 1.0; each is then evaluated greedily by this project's
``evaluate`` on the same held-out items. TRL is not a project dependency: it lives in its own venv.

    python3 -m venv .venv-trl
    .venv-trl/bin/pip install torch==2.13.0
    .venv-trl/bin/pip install trl transformers datasets accelerate numpy minigrid gymnasium httpx pydantic torch==2.13.0
    .venv-trl/bin/pip install -e . --no-deps torch==2.13.0
    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/trl_h1.py [--steps 40] [--lr 2e-5] [--held 200] [--tag T]

``--tag`` names a run (default from the learning rate, e.g. ``lr-2e-04``, with ``-s<steps>``/``-seed<seed>`` when
those differ from 40/0). Prep (items, warm start) is shared by all tags under runs/trl-h1. The stages trainer, trl,
eval and plot write to runs/trl-h1/<tag>/ and docs/learning/trl-h1/<tag>/, except the first run (lr 2e-5, 40
steps, seed 0, default tag), whose outputs stay directly under runs/trl-h1/ and docs/learning/trl-h1/.

Stages (``--stage``; ``all`` runs them in this order, each skipped when its output exists):
  prep     (project venv) the items and the warm start: SFT (2 epochs, lr 1e-3, batch 8) of models/tiny on the
           expert's episodes of the first --sft-episodes h=1 GoTo items of the pool (indices 2000-49999); the GRPO
           items are the next steps x 8 h=1 items of the pool, in the order this project's DataStream takes them;
           the held-out items are the first --held h=1 GoTo items of 900-1999, then 50000 on.
  trainer  (project venv) ``training.phases.trainer.train_phase`` at h=1 -> runs/trl-h1/trainer.
  trl      (runs itself with .venv-trl/bin/python) ``trl.GRPOTrainer`` -> runs/trl-h1/trl/final; the prompt is the
           chat-template rendering of the rollout's opening (instruction, acknowledgement, first observation)
           with the generation prompt, given as a plain string; the reward is the BabyAI outcome of the reply
           (1.0 on success, else 0.0), from an in-process environment.
  eval     (project venv) greedy success of the warm start and both final models on the held-out items.
  plot     (project venv) curves.svg: both per-step sampled success curves on the same axes, and held-out greedy
           success of the warm start and both final models with the paired 95% CIs of the change.
Writes docs/learning/trl-h1/[<tag>/]{warm,trainer,trl}.json (per-step curves, per-item held-out greedy success)
and curves.svg.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "trl-h1"
DOCS = ROOT / "docs" / "learning" / "trl-h1"
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
sys.path.insert(0, str(ROOT))  # `benchmarks` when run as a script


def default_tag(args: argparse.Namespace) -> str:
    mantissa, exponent = f"{args.lr:e}".split("e")
    tag = f"lr-{mantissa.rstrip('0').rstrip('.')}e{exponent}"
    if args.steps != 40:
        tag += f"-s{args.steps}"
    if args.seed != 0:
        tag += f"-seed{args.seed}"
    return tag


def out_dirs(args: argparse.Namespace) -> tuple[Path, Path]:
    """(runs folder, docs folder) of the stages trainer, trl, eval and plot for this tag."""
    if args.tag == default_tag(args) and (args.lr, args.steps, args.seed) == (2e-5, 40, 0):
        return RUNS, DOCS  # the first run, kept where it was written
    return RUNS / args.tag, DOCS / args.tag


def _items(args: argparse.Namespace) -> dict:
    """The shared prep's items; it fixed the GRPO items for its --steps, so a later run may not take more."""
    data = json.loads((RUNS / "items.json").read_text())
    if len(data["grpo_order"]) < args.steps * 8:
        raise SystemExit(f"runs/trl-h1/items.json holds {len(data['grpo_order'])} GRPO items, fewer than "
                         f"--steps {args.steps} x 8")
    return data


def _write(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def _threads() -> None:
    import torch

    torch.set_num_threads(1)


def train_config(items: list[str], args: argparse.Namespace):
    from training.settings.config import TrainConfig

    return TrainConfig(items=items, batch_items=8, n_samples=4, lr=args.lr, max_new_tokens=24, temperature=1.0,
                       mini_batch_size=32, micro_batch_size=16, skip_flat_steps=True, drop_flat_groups=False,
                       log_rollouts=False, kl_coef=1e-3, entropy_coef=1e-3, save_every=args.steps, seed=args.seed)


def stage_prep(args: argparse.Namespace) -> None:
    """Items, rendered prompts and the warm start (cached under runs/trl-h1)."""
    from benchmarks import tiny_model
    from benchmarks.learning_babyai import solvable
    from envs.babyai.client import Spec
    from envs.local import local_client
    from envs.registry import load_backend
    from envs.splits import item_index
    from training.chat_format import ChatFormat, opening_messages
    from training.model import load_policy
    from training.phases.data import DataStream
    from training.warmstart.sft import SFTConfig, sft

    items_file = RUNS / "items.json"
    if not items_file.exists():
        backend = load_backend("babyai")
        need_pool = args.sft_episodes + args.steps * 8

        def first_solvable(indices: range | list[int], count: int) -> dict[str, list[dict[str, str]]]:
            found: dict[str, list[dict[str, str]]] = {}
            chunk: list[str] = []
            for i in indices:
                if backend.sub_task(i) != "GoTo":
                    continue
                chunk.append(f"babyai_{i}")
                if len(chunk) == 200:
                    found |= solvable(chunk, 1)
                    chunk = []
                    if len(found) >= count:
                        break
            if len(found) < count and chunk:
                found |= solvable(chunk, 1)
            return dict(list(found.items())[:count])

        pool = first_solvable(range(2000, 50_000), need_pool)
        pool_items = list(pool)
        sft_items, grpo_items = pool_items[: args.sft_episodes], pool_items[args.sft_episodes:]
        held = list(first_solvable([*range(900, 2000), *range(50_000, 60_000)], args.held))
        # the order this project's trainer takes them in (DataStream: seeded shuffle of config.items)
        order = DataStream("babyai", train_config(grpo_items, args)).take(args.steps * 8)
        _, tokenizer = load_policy(tiny_model())
        chat = ChatFormat(tokenizer)
        client = local_client("babyai")
        prompts = {}
        try:
            for item in grpo_items:
                first = client.reset(item_index(item)).observation
                messages = opening_messages(Spec.conversation_start, first)
                text = chat.render(messages, generation_prompt=True)
                # TRL tokenizes a plain-string prompt with the tokenizer's default special tokens: same ids?
                assert tokenizer(text)["input_ids"] == chat.prompt(messages), "prompt ids differ"
                prompts[item] = text
        finally:
            client.close()
        _write(items_file, {"sft": sft_items, "grpo": grpo_items, "grpo_order": order, "held_out": held,
                            "prompts": prompts, "sft_episodes": [pool[i] for i in sft_items]})
        print(f"items: {len(sft_items)} SFT, {len(grpo_items)} GRPO, {len(held)} held out", flush=True)
    warm = RUNS / "warm"
    if not (warm / "config.json").exists():
        data = json.loads(items_file.read_text())
        started = time.perf_counter()
        sft(tiny_model(), warm, data["sft_episodes"], SFTConfig(epochs=2, lr=1e-3, batch_size=8))
        print(f"warm start: SFT on {len(data['sft_episodes'])} episodes, {time.perf_counter() - started:.0f} s",
              flush=True)


def stage_trainer(args: argparse.Namespace) -> None:
    from benchmarks.curriculum_study import _dvclive_rows
    from envs.launcher import running_server
    from training.phases.trainer import train_phase

    data = _items(args)
    runs, _ = out_dirs(args)
    out = runs / "trainer"
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with running_server("babyai") as url:
        final = train_phase("babyai", 0, 1, args.steps, RUNS / "warm", out, config=train_config(data["grpo"], args),
                            url=url, progress=True)
    wall = time.perf_counter() - started
    rows = [{"step": int(r["step"]), "reward": r.get("reward/mean"), "success": r.get("success/rate"),
             "skipped": r.get("actor/skipped", 0.0), "kl": r.get("actor/kl"), "entropy": r.get("actor/entropy"),
             "seconds": r.get("timing_s/total")} for r in _dvclive_rows(out / "dvclive")]
    _write(runs / "trainer_curve.json", {"final": str(final), "wall_seconds": wall, "rows": rows})


def stage_trl(args: argparse.Namespace) -> None:
    """Runs in .venv-trl: TRL's GRPOTrainer on the same items, in the same order."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from envs.local import local_client
    from envs.splits import item_index

    data = _items(args)
    order = data["grpo_order"]
    dataset = Dataset.from_dict({"prompt": [data["prompts"][i] for i in order], "item": order})
    client = local_client("babyai")
    curve: list[dict[str, object]] = []

    def babyai_outcome(prompts: list[str], completions: list[str], item: list[str], **_: object) -> list[float]:
        """1.0 when the reply, stepped in the item's environment, solves it; else 0.0."""
        out, shaped = [], []
        for name, reply in zip(item, completions, strict=True):
            client.reset(item_index(name))
            step = client.step(reply)
            out.append(1.0 if step.success else 0.0)
            shaped.append(float(step.reward))
        curve.append({"step": len(curve), "items": list(dict.fromkeys(item)), "reward": sum(out) / len(out),
                      "success": sum(out) / len(out), "env_reward": sum(shaped) / len(shaped),
                      "flat_groups": sum(len(set(out[g:g + 4])) == 1 for g in range(0, len(out), 4))})
        return out

    logs: list[dict[str, float]] = []

    class Keep(TrainerCallback):
        def on_log(self, _args, state, _control, logs_=None, **kwargs):
            entry = kwargs.get("logs") or logs_
            if entry:
                logs.append({"step": state.global_step, **{k: float(v) for k, v in entry.items()
                                                           if isinstance(v, (int, float))}})

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(str(RUNS / "warm"), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(RUNS / "warm"), padding_side="left")
    runs, _ = out_dirs(args)
    out = runs / "trl"
    config = GRPOConfig(
        output_dir=str(out), use_cpu=True, seed=args.seed, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0,
        per_device_train_batch_size=32, gradient_accumulation_steps=1, num_generations=4, steps_per_generation=1,
        num_iterations=1, shuffle_dataset=False, max_completion_length=24, temperature=1.0, top_p=1.0, top_k=0,
        beta=1e-3, epsilon=0.2, loss_type="dapo", scale_rewards="group", entropy_coef=1e-3,
        bf16=False, fp16=False, gradient_checkpointing=False, report_to="none", logging_steps=1,
        save_strategy="no", dataloader_num_workers=0, log_completions=False, disable_dropout=True)
    trainer = GRPOTrainer(model=model, reward_funcs=babyai_outcome, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Keep()])
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    client.close()
    trainer.save_model(str(out / "final"))
    tokenizer.save_pretrained(str(out / "final"))
    expected = [list(dict.fromkeys(order[s * 8:(s + 1) * 8])) for s in range(args.steps)]
    assert [c["items"] for c in curve] == expected, "TRL took the items in another order"
    _write(runs / "trl_curve.json", {"trl_version": trl.__version__, "wall_seconds": wall, "rows": curve,
                                     "trl_logs": logs, "final": str(out / "final")})


def stage_eval(args: argparse.Namespace) -> None:
    from envs.launcher import running_server
    from training.evaluation.evaluate import evaluate, paired_difference_ci

    data = json.loads((RUNS / "items.json").read_text())
    held = data["held_out"]
    runs, docs = out_dirs(args)
    models = {"warm": RUNS / "warm", "trainer": runs / "trainer" / "final", "trl": runs / "trl" / "final"}
    results = {}
    with running_server("babyai") as url:
        for name, folder in models.items():
            started = time.perf_counter()
            result = evaluate(folder, "babyai", url, held, h=1, max_new_tokens=24, batch_items=50)
            results[name] = {i: bool(result.success[i][0]) for i in held}
            print(f"{name}: greedy success {result.success_rate:.1%} on {len(held)} held-out items "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    common = {"env": "babyai", "h": 1, "tag": args.tag, "steps": args.steps, "lr": args.lr, "seed": args.seed,
              "group": 4,
              "items_per_step": 8, "max_new_tokens": 24, "held_out_items": held, "grpo_item_order": data["grpo_order"]}
    warm = [float(results["warm"][i]) for i in held]
    _write(docs / "warm.json", common | {"model": "warm start: SFT of models/tiny, 2 epochs, lr 1e-3, batch 8",
                                         "sft_episodes": len(data["sft"]), "held_out_success": results["warm"],
                                         "held_out_success_rate": sum(warm) / len(warm)})
    for name, curve_file in (("trainer", "trainer_curve.json"), ("trl", "trl_curve.json")):
        curve = json.loads((runs / curve_file).read_text())
        after = [float(results[name][i]) for i in held]
        diff, low, high = paired_difference_ci(warm, after)
        _write(docs / f"{name}.json", common | {
            "trainer": ("training.phases.trainer.train_phase" if name == "trainer"
                        else f"trl.GRPOTrainer {curve['trl_version']}"),
            "wall_seconds_train": curve["wall_seconds"], "curve": curve["rows"],
            **({"trl_logs": curve["trl_logs"]} if name == "trl" else {}),
            "held_out_success": results[name], "held_out_success_rate": sum(after) / len(after),
            "paired_difference_vs_warm": {"mean": diff, "ci95": [low, high]}})
        print(f"{name}: {sum(warm) / len(warm):.1%} -> {sum(after) / len(after):.1%}, paired change {diff:+.1%} "
              f"(95% CI {low:+.1%} to {high:+.1%})", flush=True)
    a, b = [float(results["trainer"][i]) for i in held], [float(results["trl"][i]) for i in held]
    diff, low, high = paired_difference_ci(a, b)
    print(f"trl - trainer: {diff:+.1%} (95% CI {low:+.1%} to {high:+.1%})", flush=True)


def _svg_text(x: float, y: float, text: str, size: int = 12, anchor: str = "start", extra: str = "") -> str:
    from html import escape

    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" {extra}>'
            f"{escape(text)}</text>")


def stage_plot(args: argparse.Namespace) -> None:
    """docs/.../curves.svg: per-step success of both trainers, and held-out greedy success before/after.

    matplotlib is not in the project venv, so this is a hand-made SVG.
    """
    _, docs = out_dirs(args)
    warm = json.loads((docs / "warm.json").read_text())
    runs = {name: json.loads((docs / f"{name}.json").read_text()) for name in ("trainer", "trl")}
    colors = {"trainer": "#1f77b4", "trl": "#d62728"}
    labels = {"trainer": "this project (train_phase)", "trl": runs["trl"]["trainer"]}
    width, height = 960, 450
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             _svg_text(width / 2, 22, f"BabyAI GoTo, h=1, one warm start: lr {args.lr:g}, {args.steps} steps, "
                       f"8 items x 4 samples per step (tag {args.tag})", 14, "middle", 'font-weight="bold"')]

    # left panel: per-step sampled success (training reward), raw and 5-step running mean
    left, top, w, h = 60, 50, 520, 300
    steps = max(len(r["curve"]) for r in runs.values())
    def xy(step: float, value: float) -> tuple[float, float]:
        return left + w * step / max(steps - 1, 1), top + h * (1 - value)
    parts.append(f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#444"/>')
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        _, y = xy(0, tick)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + w}" y2="{y:.1f}" stroke="#ddd"/>')
        parts.append(_svg_text(left - 6, y + 4, f"{tick:.2f}", 11, "end"))
    for tick in range(0, steps, 5):
        x, _ = xy(tick, 0)
        parts.append(_svg_text(x, top + h + 16, str(tick), 11, "middle"))
    parts.append(_svg_text(left + w / 2, top + h + 34, "step", 12, "middle"))
    parts.append(_svg_text(16, top + h / 2, "sampled success (= reward) per step", 12, "middle",
                           f'transform="rotate(-90 16 {top + h / 2})"'))
    for k, (name, run) in enumerate(runs.items()):
        values = [(r["step"], r["success"]) for r in run["curve"] if r.get("success") is not None]
        points = " ".join("{:.1f},{:.1f}".format(*xy(s, v)) for s, v in values)
        parts.append(f'<polyline points="{points}" fill="none" stroke="{colors[name]}" stroke-width="1" '
                     'stroke-opacity="0.45"/>')
        smooth = [(s, sum(v for _, v in values[max(0, i - 4):i + 1]) / len(values[max(0, i - 4):i + 1]))
                  for i, (s, _) in enumerate(values)]
        points = " ".join("{:.1f},{:.1f}".format(*xy(s, v)) for s, v in smooth)
        parts.append(f'<polyline points="{points}" fill="none" stroke="{colors[name]}" stroke-width="2.5"/>')
        mean = sum(v for _, v in values) / len(values)
        y = top + h + 56 + 16 * k
        parts.append(f'<line x1="{left + 10}" y1="{y - 4}" x2="{left + 34}" y2="{y - 4}" stroke="{colors[name]}" '
                     'stroke-width="2.5"/>')
        parts.append(_svg_text(left + 40, y, f"{labels[name]}: mean {mean:.3f} over {len(values)} steps", 11))
    parts.append(_svg_text(left + 10, top + h + 88, "thin: per step (32 samples); thick: 5-step running mean", 10))

    # right panel: held-out greedy success of the warm start and both finals, paired 95% CI of the change
    left2, w2 = 660, 260
    n = len(warm["held_out_items"])
    rates = {"warm": warm["held_out_success_rate"], **{k: r["held_out_success_rate"] for k, r in runs.items()}}
    top_rate = min(1.0, max(0.25, (max(rates.values()) // 0.25 + 1) * 0.25))
    def y2(value: float) -> float:
        return top + h * (1 - value / top_rate)
    parts.append(f'<rect x="{left2}" y="{top}" width="{w2}" height="{h}" fill="none" stroke="#444"/>')
    for i in range(round(top_rate / 0.05) + 1):
        tick = i * 0.05
        if i % 2 == 0:
            parts.append(f'<line x1="{left2}" y1="{y2(tick):.1f}" x2="{left2 + w2}" y2="{y2(tick):.1f}" '
                         'stroke="#ddd"/>')
            parts.append(_svg_text(left2 - 6, y2(tick) + 4, f"{tick:.0%}", 11, "end"))
    parts.append(_svg_text(left2 + w2 / 2, top - 8, f"held-out greedy success ({n} items)", 12, "middle"))
    bar = 56
    for i, name in enumerate(("warm", "trainer", "trl")):
        x = left2 + 30 + i * 80
        rate = rates[name]
        parts.append(f'<rect x="{x}" y="{y2(rate):.1f}" width="{bar}" height="{top + h - y2(rate):.1f}" '
                     f'fill="{colors.get(name, "#888")}" fill-opacity="0.75"/>')
        parts.append(_svg_text(x + bar / 2, y2(rate) - 5, f"{rate:.1%}", 12, "middle"))
        parts.append(_svg_text(x + bar / 2, top + h + 16, {"warm": "warm start"}.get(name, name), 11, "middle"))
        if name != "warm":
            change = runs[name]["paired_difference_vs_warm"]
            low, high = change["ci95"]
            parts.append(_svg_text(x + bar / 2, top + h + 32, f"{change['mean']:+.1%}", 11, "middle"))
            parts.append(_svg_text(x + bar / 2, top + h + 46, f"[{low:+.1%}, {high:+.1%}]", 10, "middle"))
    parts.append(_svg_text(left2 + w2 / 2, top + h + 62, "paired change vs warm start, 95% CI", 10, "middle"))
    parts.append("</svg>")
    out = docs / "curves.svg"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts) + "\n")
    print(f"wrote {out.relative_to(ROOT)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=["all", "prep", "trainer", "trl", "eval", "plot"], default="all")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--held", type=int, default=200)
    parser.add_argument("--sft-episodes", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", help="run name (default: from --lr, --steps and --seed, e.g. lr-2e-04)")
    args = parser.parse_args()
    args.tag = args.tag or default_tag(args)
    if args.stage == "plot":
        stage_plot(args)
        return
    _threads()
    if args.stage != "all":
        {"prep": stage_prep, "trainer": stage_trainer, "trl": stage_trl, "eval": stage_eval}[args.stage](args)
        return
    stage_prep(args)
    runs, _ = out_dirs(args)
    if not (runs / "trainer_curve.json").exists():
        stage_trainer(args)
    if not (runs / "trl_curve.json").exists():
        flags = ["--steps", str(args.steps), "--lr", str(args.lr), "--held", str(args.held),
                 "--sft-episodes", str(args.sft_episodes), "--seed", str(args.seed), "--tag", args.tag]
        subprocess.run([str(TRL_PYTHON), __file__, "--stage", "trl", *flags], check=True,
                       env=os.environ | {"OMP_NUM_THREADS": "1"})
    stage_eval(args)
    stage_plot(args)


if __name__ == "__main__":
    main()

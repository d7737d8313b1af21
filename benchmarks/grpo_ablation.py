"""Issue 45: why multi-turn GRPO falls below its SFT warm start, measured arm by arm; and the positive control.

    python benchmarks/grpo_ablation.py prepare                  # the curriculum study's items and warm start
    python benchmarks/grpo_ablation.py run --h 4 --steps 24 --arms base,lr-5e-5 --seeds 0   # missing ones only
    python benchmarks/grpo_ablation.py report                   # docs/learning.md's ablation table, from the JSONs
    python benchmarks/grpo_ablation.py control --arms ARM --h 6 --steps 100 --seeds 0,1,2 --eval-items 1000
    python benchmarks/grpo_ablation.py control-report --arms ARM --h 6 --steps 100   # the positive control
    python benchmarks/grpo_ablation.py --env textcraft control --arms ARM --h 10 --steps 60 --seeds 0,1,2

With ``--env textcraft`` (the second environment of the positive control) the task is TextCraft depth 2-3: SFT on
the expert's episodes of every train-split goal, GRPO on the train split's depth-2 and depth-3 goals (reshuffled
each pass), held-out items the test and gate splits' depth-2 and depth-3 goals (123: TextCraft has 544 goals in
all); workspace runs/grpo-ablation-textcraft/, JSONs in docs/learning/textcraft/.

The task, the items and the warm start are the curriculum study's (``benchmarks/curriculum_study.py``: BabyAI
GoTo items the expert solves within 4 turns; SFT on 1,200 expert episodes, 2 epochs at lr 1e-3). Every arm
trains at one fixed turn cap ``--h`` from that warm start, on the same GRPO items in the same order (the data
stream's seed), for the same steps (8 items x 4 samples each), and differs from ``base`` (the study's trainer
settings) in the named settings only (``ARMS``). Each is then evaluated at the same cap on the same held-out
items, greedy and sampled at temperature 1.0 (one sample per item, a fixed seed), and compared with the warm
start on the same items (paired bootstrap over items; over seeds and items when an arm has several seeds).
Its training curve (reward, KL to the reference, entropy, the trainer/sampler log-prob ratio at the start of
each update, the advantage each token carries) comes from the phase's dvclive metrics.

Each (arm, seed, h, steps) is one JSON in docs/learning/ (committed as it comes), so ``run`` resumes and
reruns nothing; a killed training phase resumes from its last checkpoint (runs/grpo-ablation/).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` when run as a script

from benchmarks.curriculum_study import PARAMS, _dvclive_rows, stage_items, stage_warm

ROOT = Path(__file__).resolve().parents[1]
ENV = "babyai"
DOCS = ROOT / "docs" / "learning"
CONTROL = DOCS / "control"
WORKSPACE = ROOT / "runs" / "grpo-ablation"

#: the study's trainer settings (lr 2e-4, token-mean loss, std-normalised groups, KL 1e-3, entropy bonus 1e-3)
BASE: dict[str, Any] = {k: v for k, v in PARAMS["train"].items() if k != "guard"} | {"guard": {"enabled": False}}

#: TextCraft: what differs from BabyAI's task (the longest expert reply is 72 tokens; depth 2-3 goals take the
#: expert a median of 5 and 9 turns)
#: TextCraft's warm start is SFT in rounds of ``warm.epochs`` epochs, each continuing the last one's checkpoint (a
#: fresh optimizer, the episodes shuffled again): ``--warm-epochs 4`` is two rounds, in ``warm-e2/`` then ``warm-e4/``
TEXTCRAFT = {"sub_tasks": ["depth2", "depth3"], "max_new_tokens": 80,
             "warm": {"epochs": 2, "lr": 1.0e-3, "batch_size": 8, "group_by_length": True}, "variants": 8}
#: the warm start's name in the JSONs of its evaluation (BabyAI's is the study's; TextCraft's first one, 4 epochs
#: over one episode per train goal, has the untagged ``warm-h10-n123.json``) and the checkpoint GRPO starts from
WARM_TAG = ""
WARM = WORKSPACE / "warm"


def use_env(env: str, warm_epochs: int = 4) -> None:
    """Point the module's workspace and JSON folders at ``env``'s task (BabyAI's are the defaults); TextCraft's
    warm start is the one of ``warm_epochs`` epochs."""
    global ENV, DOCS, CONTROL, WORKSPACE, BASE, WARM_TAG, WARM
    if env == "babyai":
        return
    if env != "textcraft":
        raise SystemExit(f"--env {env}: this benchmark has babyai and textcraft")
    ENV, DOCS, WORKSPACE = env, ROOT / "docs" / "learning" / env, ROOT / "runs" / f"grpo-ablation-{env}"
    per_round = TEXTCRAFT["warm"]["epochs"]
    if warm_epochs < per_round or warm_epochs % per_round:
        raise SystemExit(f"--warm-epochs {warm_epochs}: TextCraft's warm start trains in rounds of {per_round} epochs")
    CONTROL = DOCS / f"control-e{warm_epochs}"
    BASE = BASE | {"max_new_tokens": TEXTCRAFT["max_new_tokens"]}
    WARM_TAG = f"reshuffled{TEXTCRAFT['variants']}-e{warm_epochs}-"
    WARM = WORKSPACE / f"warm-e{warm_epochs}"

#: each arm: what it changes from BASE
ARMS: dict[str, dict[str, Any]] = {
    "base": {},
    "lr-5e-5": {"lr": 5e-5},
    "lr-1e-5": {"lr": 1e-5},
    "seq-mean": {"loss_agg": "seq-mean-token-mean"},
    "dr-grpo": {"loss_agg": "seq-mean-token-sum-norm", "grpo_norm_std": False},
    "no-std": {"grpo_norm_std": False},
    "no-kl-no-entropy": {"kl_coef": 0.0, "entropy_coef": 0.0},
    "kl-0.05": {"kl_coef": 0.05},
    "seq-mean-lr-5e-5": {"loss_agg": "seq-mean-token-mean", "lr": 5e-5},
    "seq-mean-lr-5e-5-n8": {"loss_agg": "seq-mean-token-mean", "lr": 5e-5, "n_samples": 8},
}


def prepare() -> Path:
    """The study's items.json and warm start in the workspace (built once)."""
    WORKSPACE.mkdir(parents=True, exist_ok=True)
    os.chdir(WORKSPACE)
    if ENV == "textcraft":
        return _prepare_textcraft()
    if not Path("items.json").exists():
        stage_items(PARAMS)
    if not (Path("warm") / "config.json").exists():
        stage_warm(PARAMS)
    return WORKSPACE


def _prepare_textcraft() -> Path:
    import random

    from envs.splits import load_split
    from training.settings.config import SFTConfig
    from training.warmstart.sft import expert_episodes, sft

    if not Path("items.json").exists():
        train = load_split("textcraft", "train")
        grpo_pool = [r["item_id"] for r in train if r["sub_task"] in TEXTCRAFT["sub_tasks"]]
        rng, grpo = random.Random(0), []
        for _ in range(8):  # passes over the pool, each in its own order: enough for 8 x 60 steps of 8 items
            grpo += rng.sample(grpo_pool, len(grpo_pool))
        held = [r["item_id"] for split in ("test", "gate") for r in load_split("textcraft", split)
                if r["sub_task"] in TEXTCRAFT["sub_tasks"]]
        data = {"sft": expert_episodes("textcraft", [r["item_id"] for r in train]), "grpo": grpo, "held_out": held}
        Path("items.json").write_text(json.dumps(data))
    if not Path("sft-reshuffled.json").exists():
        train = [r["item_id"] for r in load_split("textcraft", "train")]
        episodes = [e for v in range(TEXTCRAFT["variants"])
                    for e in expert_episodes("textcraft", train, backend=_reshuffled_backend(v)).values()]
        Path("sft-reshuffled.json").write_text(json.dumps(episodes))
    per_round, start = TEXTCRAFT["warm"]["epochs"], None
    for epochs in range(per_round, int(WARM.name.removeprefix("warm-e")) + 1, per_round):
        folder = Path(f"warm-e{epochs}")
        if not (folder / "config.json").exists():
            from benchmarks.curriculum_study import base_model

            episodes, seed = json.loads(Path("sft-reshuffled.json").read_text()), epochs - per_round
            random.Random(seed).shuffle(episodes)
            shutil.rmtree(folder, ignore_errors=True)
            sft(start or base_model(), folder, episodes, SFTConfig(**TEXTCRAFT["warm"] | {"seed": seed}),
                progress=True)
        start = folder
    return WORKSPACE


def _reshuffled_backend(variant: int) -> Any:
    """TextCraft's backend with every goal's recipe lines drawn again: variant 0 shows each goal as the
    environment does; variant v > 0 draws its distractors and their order with a generator of its own. The SFT
    data thus shows each train goal among several sets of lines, so that the policy learns to read the item
    names off the observation rather than to recall one text per goal (one episode per goal, 4 epochs, gave a
    policy that fetched the same items whatever the goal: 0 of 123 held-out goals)."""
    from envs.textcraft.backend import Backend

    return Backend(variant=variant)


def _evaluate(model: Path, url: str, items: list[str], h: int, temperature: float) -> list[float]:
    from training.evaluation.evaluate import evaluate

    result = evaluate(model, ENV, url, items, h=h, temperature=temperature, seed=1234,
                      max_new_tokens=BASE["max_new_tokens"], batch_items=50, context_budget=BASE.get(
                          "context_budget", 2048), prefix_cache_gb=1.0)
    return [float(result.success[i][0]) for i in items]


def warm_eval(url: str, items: list[str], h: int, sampled: bool = True) -> dict[str, list[float] | None]:
    """The warm start's per-item success at ``h`` (greedy and sampled), kept in docs/learning/."""
    path = DOCS / f"warm-{WARM_TAG}h{h}-n{len(items)}.json"
    if path.exists():
        return json.loads(path.read_text())
    out = {"greedy": _evaluate(WARM, url, items, h, 0.0),
           "sampled": _evaluate(WARM, url, items, h, 1.0) if sampled else None}
    DOCS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out) + "\n")
    return out


def held_out(count: int) -> list[str]:
    """The first ``count`` held-out items: the study's 500, then more of the same kind (GoTo items of the held-out
    indices that the expert solves within 4 turns, in index order), found once and kept in the workspace."""
    data = json.loads((WORKSPACE / "items.json").read_text())
    items = list(data["held_out"])
    if count <= len(items) or ENV != "babyai":  # TextCraft: every held-out goal there is
        return items[:count]
    extra = WORKSPACE / f"held_out_{count}.json"
    if not extra.exists():
        from benchmarks.learning_babyai import solvable
        from envs.registry import load_backend

        backend = load_backend("babyai")
        held = [f"babyai_{i}" for i in [*range(900, 2000), *range(50_000, 70_000)] if backend.sub_task(i) == "GoTo"]
        last = held.index(items[-1])
        more: list[str] = []
        for start in range(last + 1, len(held), 500):
            more += list(solvable(held[start:start + 500], PARAMS["task"]["max_expert_turns"]))
            if len(items) + len(more) >= count:
                break
        extra.write_text(json.dumps(items + more[:count - len(items)]))
    return json.loads(extra.read_text())


def run_arm(arm: str, seed: int, h: int, steps: int, eval_items: int, url: str, docs: Path | None = None,
            sampled: bool = True) -> Path:
    """Train and evaluate one arm at one seed (nothing when its JSON exists)."""
    from training.phases.trainer import train_phase
    from training.settings.config import TrainConfig

    docs = DOCS if docs is None else docs
    out = docs / f"{arm}-h{h}-t{steps}-s{seed}.json"
    if out.exists():
        return out
    data = json.loads((WORKSPACE / "items.json").read_text())
    held = held_out(eval_items)
    config = TrainConfig(items=data["grpo"], seed=seed, log_rollouts=False, skip_flat_steps=True,
                         drop_flat_groups=True, **(BASE | ARMS[arm]))
    folder = WORKSPACE / ("arms" if docs == DOCS else docs.name) / f"{arm}-h{h}-t{steps}-s{seed}"
    trained = WORKSPACE / "arms" / folder.name
    if docs != DOCS and not folder.exists() and (trained / "final").exists():  # the ablation trained it already
        shutil.copytree(trained, folder)
    started = time.perf_counter()
    final = train_phase(ENV, 0, h, steps, WARM, folder, config=config, url=url, progress=True)
    train_s = time.perf_counter() - started
    if docs != DOCS and (DOCS / out.name).exists():  # trained by the ablation: its time is the training's
        train_s = json.loads((DOCS / out.name).read_text())["train_seconds"]
    keys = ("reward/mean", "success/rate", "actor/kl", "actor/entropy", "actor/sampler_ratio",
            "actor/sampler_logprob_absdiff", "actor/advantage_token_mean", "actor/advantage_weighted",
            "actor/grad_norm", "turns/mean", "actor/skipped")
    rows = [{"step": int(r["step"]), **{k: r.get(k) for k in keys}} for r in _dvclive_rows(folder / "dvclive")]
    result = {"arm": arm, "changes": ARMS[arm], "seed": seed, "h": h, "steps": steps, "items": held,
              "train_seconds": round(train_s, 1), "curve": rows,
              "greedy": _evaluate(final, url, held, h, 0.0),
              "sampled": _evaluate(final, url, held, h, 1.0) if sampled else None}
    docs.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result) + "\n")
    return out


def seed_item_ci(diffs: list[list[float]], resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high) of a paired difference over seeds and items: each resample draws seeds, then items
    (the same items for every drawn seed), so the interval holds the seed-to-seed spread as well as the items'."""
    data = np.asarray(diffs, dtype=float)  # [seeds, items]
    rng = np.random.default_rng(seed)
    s, n = data.shape
    means = [data[rng.integers(0, s, s)][:, rng.integers(0, n, n)].mean() for _ in range(resamples)]
    low, high = np.quantile(means, [0.025, 0.975])
    return float(data.mean()), float(low), float(high)


def table(h: int, steps: int) -> list[dict[str, Any]]:
    """One row per arm with runs at (h, steps): success and paired change to the warm start, greedy and sampled;
    the curve's last KL, entropy, sampler ratio and advantage means."""
    rows = []
    for arm in ARMS:
        runs = [json.loads(p.read_text()) for p in sorted(DOCS.glob(f"{arm}-h{h}-t{steps}-s*.json"))]
        if not runs:
            continue
        warm = warm_eval_cached(h, len(runs[0]["items"]))
        row: dict[str, Any] = {"arm": arm, "changes": ARMS[arm], "seeds": [r["seed"] for r in runs]}
        for mode in ("greedy", "sampled"):
            row[mode] = float(np.mean([np.mean(r[mode]) for r in runs]))
            row[f"warm_{mode}"] = float(np.mean(warm[mode])) if warm else None
            if warm:
                row[f"{mode}_diff"] = seed_item_ci([np.subtract(r[mode], warm[mode]).tolist() for r in runs])
        tail = [c for r in runs for c in r["curve"][-4:]]
        for key in ("actor/kl", "actor/entropy", "actor/sampler_ratio", "actor/advantage_token_mean",
                    "actor/advantage_weighted", "reward/mean"):
            vals = [c[key] for c in tail if c.get(key) is not None]
            row[key] = float(np.mean(vals)) if vals else None
        first = [c.get("reward/mean") for r in runs for c in r["curve"][:4] if c.get("reward/mean") is not None]
        row["reward_first4"] = float(np.mean(first)) if first else None
        row["train_seconds"] = float(np.mean([r["train_seconds"] for r in runs]))
        rows.append(row)
    return rows


def warm_eval_cached(h: int, n: int) -> dict[str, list[float]] | None:
    path = DOCS / f"warm-{WARM_TAG}h{h}-n{n}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _fmt_diff(d: list[float] | None) -> str:
    return "" if not d else f"{100 * d[0]:+.1f} ({100 * d[1]:+.1f} to {100 * d[2]:+.1f})"


def report(h: int, steps: int) -> str:
    lines = ["| arm | changes | seeds | greedy | vs warm (95% CI) | sampled T=1 | vs warm (95% CI) | reward first 4 "
             "-> last 4 steps | KL | entropy | sampler ratio | adv/token | adv weighted | train s |",
             "|" + "---|" * 14]
    for r in table(h, steps):
        def f(x: float | None, fmt: str = ".3f") -> str:
            return "" if x is None else format(x, fmt)
        lines.append(
            f"| {r['arm']} | {json.dumps(r['changes']) if r['changes'] else 'the study'} | {len(r['seeds'])} | "
            f"{r['greedy']:.1%} | {_fmt_diff(r.get('greedy_diff'))} | {r['sampled']:.1%} | "
            f"{_fmt_diff(r.get('sampled_diff'))} | {f(r['reward_first4'], '.2f')} -> {f(r['reward/mean'], '.2f')} | "
            f"{f(r['actor/kl'], '.4f')} | {f(r['actor/entropy'])} | {f(r['actor/sampler_ratio'], '.4f')} | "
            f"{f(r['actor/advantage_token_mean'])} | {f(r['actor/advantage_weighted'])} | {r['train_seconds']:.0f} |")
    return "\n".join(lines)


def control_report(arm: str, h: int, steps: int) -> str:
    """The positive control: each seed's held-out success against the warm start's on the same items (greedy and
    sampled), then all seeds pooled with an interval over seeds and items."""
    runs = [json.loads(p.read_text()) for p in sorted(CONTROL.glob(f"{arm}-h{h}-t{steps}-s*.json"))]
    if not runs:
        return f"no runs of {arm} at h={h}, {steps} steps in {CONTROL}"
    warm = warm_eval_cached(h, len(runs[0]["items"]))
    if warm is None:
        return "the warm start's evaluation is missing"
    warm_sampled = f"{np.mean(warm['sampled']):.1%}" if warm.get("sampled") else "(not run)"
    lines = [f"| seed | greedy | vs warm {np.mean(warm['greedy']):.1%} (95% CI) | sampled T=1 | vs warm "
             f"{warm_sampled} (95% CI) | train reward first 10 -> last 10 steps | train s |",
             "|---|---|---|---|---|---|---|"]
    for r in [*runs, None]:
        group = runs if r is None else [r]
        cells = []
        for mode in ("greedy", "sampled"):
            if warm.get(mode) is None or any(g.get(mode) is None for g in group):
                cells += ["not run", ""]
                continue
            diff = seed_item_ci([np.subtract(g[mode], warm[mode]).tolist() for g in group])
            cells += [f"{np.mean([np.mean(g[mode]) for g in group]):.1%}", _fmt_diff(list(diff))]
        curve = [[c["reward/mean"] for c in g["curve"] if c.get("reward/mean") is not None] for g in group]
        first, last = np.mean([c[:10] for c in curve]), np.mean([c[-10:] for c in curve])
        name = f"all {len(runs)} (seeds x items)" if r is None else str(r["seed"])
        lines.append(f"| {name} | {' | '.join(cells)} | {first:.2f} -> {last:.2f} | "
                     f"{np.mean([g['train_seconds'] for g in group]):.0f} |")
    return f"{arm} at h={h}, {steps} steps, {len(runs[0]['items'])} held-out items\n\n" + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["prepare", "run", "report", "control", "control-report"])
    parser.add_argument("--env", default="babyai", choices=["babyai", "textcraft"])
    parser.add_argument("--warm-epochs", type=int, default=4, help="TextCraft: the warm start's SFT epochs")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--h", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--eval-items", type=int, default=300)
    parser.add_argument("--sampled", action=argparse.BooleanOptionalAction, default=True,
                        help="also evaluate sampled at temperature 1.0 (one sample per item)")
    args = parser.parse_args()
    use_env(args.env, args.warm_epochs)
    if args.command == "report":
        print(report(args.h, args.steps))
        return
    if args.command == "control-report":
        print(control_report(args.arms, args.h, args.steps))
        return
    import torch

    torch.set_num_threads(1)
    prepare()
    if args.command == "prepare":
        return
    from envs.launcher import running_server

    held = held_out(args.eval_items)
    with running_server(ENV, idle_ttl_s=7200) as url:
        warm_eval(url, held, args.h, args.sampled)
        for seed in [int(s) for s in args.seeds.split(",")]:
            for arm in args.arms.split(","):
                print(run_arm(arm, seed, args.h, args.steps, args.eval_items, url,
                              CONTROL if args.command == "control" else DOCS, args.sampled), flush=True)


if __name__ == "__main__":
    main()

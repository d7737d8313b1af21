"""Issue 18's study: ScalingInter against fixed turn caps, on BabyAI GoTo with the tiny policy; each arm a DVC
experiment of its own workspace, resumable at every level.

    python benchmarks/curriculum_study.py pilot              # warm start, and its greedy success by turn cap
    python benchmarks/curriculum_study.py run [--seeds 0,1]  # every arm x seed not done yet, one DVC experiment each
    python benchmarks/curriculum_study.py report             # docs/curriculum-study.md from the finished arms
    python benchmarks/curriculum_study.py status             # what is done, what is left
    python benchmarks/curriculum_study.py --study v2 run --arms fixed-10 --seeds 0   # issue 46's redone study

The workspace (``--workspace``, default runs/curriculum-study) is a git + DVC project of its own, written here:
its params.yaml holds the task, the warm start, the trainer settings and the arm; its dvc.yaml the stages
``items`` (the task's items), ``warm`` (SFT on the expert's episodes), ``pilot`` (the warm start's greedy success
by turn cap, kept cap by cap), ``warm_eval`` (the warm start on every held-out item at ``eval.h``), ``train`` (the
arm's phases, one after the other, each resuming where a kill left it) and ``eval`` (the arm's final policy,
greedy, on the held-out items, and its phase boundaries on a subset for the curves).
``dvc exp run -n <arm>-s<seed> -S arm.…`` runs one arm; ``dvc exp show`` in the workspace lists them with their
params and metrics. The stages' commands call this file's ``stage`` subcommand. A finished arm's figures are
copied to docs/curriculum-study/ (committed), so ``run`` skips it even on a machine where the workspace is gone.

The task: BabyAI GoTo items the high-level expert (go to the goal when it is in view, else turn left) solves
within 4 turns: about half at 1 turn (the goal in view), the rest need 1-3 turns first. A small cap h=2 cannot
solve the items that need 3-4 turns; the environment's cap (20) can solve all. Every arm trains on the same items
in the same order (the data stream's seed), from the same warm start, for the same number of optimizer steps, and
is evaluated greedily at the same cap (``eval.h`` = 10, 2.5x the longest expert solution, also ScalingInter's last
cap) on the same held-out items. The evaluation cap is 10 rather than 20 for cost: on 2 cores a greedy pass at
h=20 re-reads contexts of up to ~2,000 tokens every turn for every failing item (the pilot's seconds show it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "curriculum-study"
SELF = Path(__file__).resolve()

PARAMS: dict[str, Any] = {
    "task": {"max_expert_turns": 4, "sft_items": 1200, "eval_items": 500, "curve_items": 200},
    "warm": {"epochs": 2, "lr": 1.0e-3, "batch_size": 8},
    "pilot": {"caps": [1, 2, 4, 8, 20], "items": 200},
    "train": {"batch_items": 8, "n_samples": 4, "lr": 2.0e-4, "max_new_tokens": 24, "temperature": 1.0,
              "mini_batch_size": 32, "micro_batch_size": 16, "save_every": 4, "kl_coef": 0.001,
              "guard": {"enabled": False}},
    "eval": {"h": 10, "batch_items": 50, "curve_items": 100},
    "arm": {"name": "fixed-2", "schedule": [[2, 24]], "adaptive": False, "seed": 0},
}

# The arms, at matched optimizer steps (24): a fixed small cap, the environment's cap, ScalingInter's growing
# cap (h1=2, delta_h=4 at 8-step phases, so 2 -> 6 -> 10; the paper's BabyAI schedule 6/13/20 x 100 scaled to
# the run and the task) and the adaptive mode (the same caps, each phase ending early by the adaptive rule, the
# steps it leaves carried on to the next).
ARMS: dict[str, dict[str, Any]] = {  # run in this order, per seed: the costly fixed-20 arm last
    "fixed-2": {"schedule": [[2, 24]], "adaptive": False},
    "scaling": {"schedule": [[2, 8], [6, 8], [10, 8]], "adaptive": False},
    "adaptive": {"schedule": [[2, 8], [6, 8], [10, 8]], "adaptive": True},
    "fixed-20": {"schedule": [[20, 24]], "adaptive": False},
}
#: Issue 46's redone study (docs/study-plan.md): the arms at 150 matched steps with the positive control's recipe
#: (per-trajectory mean loss, lr 5e-5), a fixed arm at the evaluation cap (10), one context budget (4,096) for every
#: arm so that the fixed h = 20 arm is really h = 20, 1,600 held-out items greedy and sampled at T = 1, and a
#: curve from the checkpoints every 25 steps on 400 of them. ``model.base``: the policy the warm start tunes (a
#: model folder, e.g. SmolLM2-135M's from `scalinginter build-model --preset smollm2-135m`; null: models/tiny).
PARAMS_V2: dict[str, Any] = {
    "task": {"max_expert_turns": 4, "sft_items": 1200, "eval_items": 1600, "curve_items": 400},
    "model": {"base": None},
    "warm": {"epochs": 2, "lr": 1.0e-3, "batch_size": 8},
    "pilot": {"caps": [1, 2, 4, 8, 20], "items": 200},
    "train": {"batch_items": 8, "n_samples": 4, "lr": 5.0e-5, "loss_agg": "seq-mean-token-mean",
              "max_new_tokens": 24, "temperature": 1.0, "mini_batch_size": 32, "micro_batch_size": 16,
              "save_every": 25, "keep_checkpoints": 8, "kl_coef": 0.001, "context_budget": 4096,
              "guard": {"enabled": False}},
    "eval": {"h": 10, "batch_items": 50, "curve_items": 400, "sampled": True, "sample_seed": 0},
    "arm": {"name": "fixed-2", "schedule": [[2, 150]], "adaptive": False, "seed": 0},
}
ARMS_V2: dict[str, dict[str, Any]] = {  # docs/study-plan.md's order: the shape shows in seed 0's first four
    "fixed-2": {"schedule": [[2, 150]], "adaptive": False},
    "fixed-10": {"schedule": [[10, 150]], "adaptive": False},
    "fixed-20": {"schedule": [[20, 150]], "adaptive": False},
    "scaling": {"schedule": [[2, 50], [10, 50], [20, 50]], "adaptive": False},
    "adaptive": {"schedule": [[2, 50], [10, 50], [20, 50]], "adaptive": True},
}
#: each version of the study: its settings, arms, workspace and the folder its figures are committed to
STUDIES: dict[str, dict[str, Any]] = {
    "v1": {"params": PARAMS, "arms": ARMS, "workspace": ROOT / "runs" / "curriculum-study", "docs": DOCS},
    "v2": {"params": PARAMS_V2, "arms": ARMS_V2, "workspace": ROOT / "runs" / "curriculum-study-v2",
           "docs": ROOT / "docs" / "curriculum-study-v2"},
}

#: the study's environment servers keep idle instances this long: it trains and evaluates at low priority beside
#: other work, where one batched generation turn can take longer than the default 600 s (the fixed h=20 arm's
#: evaluation lost 29 instances that way, and refused its biased result)
IDLE_TTL_S = 7200
ADAPTIVE_RULE = {"truncated_share": 0.3, "plateau_steps": 4, "plateau_tolerance": 0.02, "min_steps": 3}

STAGES = {
    "items": {"cmd": "{py} {me} stage items", "params": ["task"], "outs": ["items.json"]},
    "warm": {"cmd": "{py} {me} stage warm", "params": ["task", "warm"], "deps": ["items.json"], "outs": ["warm"]},
    "pilot": {"cmd": "{py} {me} stage pilot", "params": ["pilot", "train.max_new_tokens", "eval.batch_items"],
              "deps": ["items.json", "warm"], "outs": [{"pilot": {"persist": True}}],
              "metrics": [{"pilot.json": {"cache": False}}]},
    "warm_eval": {"cmd": "{py} {me} stage warm_eval", "params": ["eval", "train.max_new_tokens"],
                  "deps": ["items.json", "warm"], "metrics": [{"warm_eval.json": {"cache": False}}]},
    "train": {"cmd": "{py} {me} stage train", "params": ["train", "arm"], "deps": ["items.json", "warm"],
              # not persisted: `dvc exp run` checks out (deletes) an output that has no hash yet, so the resume
              # checkpoints live in scratch/ (not an output) and the phases' finals are copied here at the end
              "outs": ["arms/${arm.name}-s${arm.seed}/phases"],
              "metrics": [{"arms/${arm.name}-s${arm.seed}/train.json": {"cache": False}}]},
    "eval": {"cmd": "{py} {me} stage eval", "params": ["eval", "arm", "train.max_new_tokens"],
             "deps": ["items.json", "warm", "arms/${arm.name}-s${arm.seed}/phases"],
             "metrics": [{"arms/${arm.name}-s${arm.seed}/eval.json": {"cache": False}}]},
}


def _dvc(workspace: Path, *args: str) -> int:
    dvc = str(Path(sys.executable).parent / "dvc")
    return subprocess.call([dvc, *args], cwd=workspace)


IGNORED = "/warm-state/\n/scratch/\n"  # the SFT's optimizer state, the arms' resume checkpoints: not the record


#: the params the v2 stages also read (a v1 workspace's params.yaml has none of these keys)
V2_PARAMS = {"warm": ["model"], "pilot": ["train.context_budget"], "warm_eval": ["train.context_budget"],
             "train": ["eval.sampled"], "eval": ["train.context_budget"]}


def _stages(params: dict[str, Any] | None = None) -> dict[str, Any]:
    v2 = "model" in (params or {})
    stages = {}
    for name, stage in STAGES.items():
        stage = {k: (v.format(py=sys.executable, me=SELF) if k == "cmd" else v) for k, v in stage.items()}
        if v2:
            stage["params"] = [*stage["params"], *V2_PARAMS.get(name, [])]
        stages[name] = stage
    return {"stages": stages}


def init_workspace(workspace: Path, params: dict[str, Any] | None = None) -> None:
    """Create the study's git + DVC project with ``params`` (default PARAMS); an existing one keeps its params
    and gets this version's stages (committed when they changed)."""
    if (workspace / ".dvc").exists():
        own = yaml.safe_load((workspace / "params.yaml").read_text())
        (workspace / "dvc.yaml").write_text(yaml.safe_dump(_stages(own), sort_keys=False))
        ignore = workspace / ".gitignore"
        missing = [line for line in IGNORED.splitlines() if line not in ignore.read_text().splitlines()]
        if missing:
            ignore.write_text(ignore.read_text() + "".join(f"{line}\n" for line in missing))
        changed = subprocess.run(["git", "status", "--porcelain", "dvc.yaml", ".gitignore"], cwd=workspace,
                                 check=True, capture_output=True, text=True).stdout.strip()
        if changed:
            subprocess.run(["git", "add", "dvc.yaml", ".gitignore"], cwd=workspace, check=True)
            subprocess.run(["git", "commit", "-q", "-m", "the study's stages of this version", "--", "dvc.yaml",
                            ".gitignore"], cwd=workspace, check=True)
        return
    workspace.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=workspace, check=True)
    subprocess.run(["git", "config", "user.email", "study@scalinginter"], cwd=workspace, check=True)
    subprocess.run(["git", "config", "user.name", "curriculum study"], cwd=workspace, check=True)
    if _dvc(workspace, "init", "-q") != 0:
        raise SystemExit(f"dvc init failed in {workspace}")
    _dvc(workspace, "config", "core.analytics", "false")  # no report file per command left in /tmp
    (workspace / "params.yaml").write_text(yaml.safe_dump(params or PARAMS, sort_keys=False))
    (workspace / "dvc.yaml").write_text(yaml.safe_dump(_stages(params or PARAMS), sort_keys=False))
    (workspace / ".gitignore").write_text(IGNORED)
    subprocess.run(["git", "add", "-A"], cwd=workspace, check=True)
    subprocess.run(["git", "commit", "-q", "-m", "curriculum study workspace"], cwd=workspace, check=True)


def _params() -> dict[str, Any]:
    return yaml.safe_load(Path("params.yaml").read_text())


def _write_json(path: Path, data: Any) -> None:
    from envs.files import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(data, indent=1) + "\n")


# ---- the stages (run by DVC in the workspace) ----

def stage_items(params: dict[str, Any]) -> None:
    """The task's items: SFT episodes, GRPO items and held-out items, each solvable by the expert within the cap."""
    from benchmarks.learning_babyai import solvable
    from envs.registry import load_backend

    task = params["task"]
    backend = load_backend("babyai")
    # BabyAI's index space is unbounded; the splits draw from 0-899. Indices 2000-49999 are the training pool
    # (the first for SFT, the rest for GRPO); 900-1999, then 50000 on, are held out (in neither).
    pool = [f"babyai_{i}" for i in range(2000, 50_000) if backend.sub_task(i) == "GoTo"]
    held = [f"babyai_{i}" for i in [*range(900, 2000), *range(50_000, 60_000)] if backend.sub_task(i) == "GoTo"]
    turns = task["max_expert_turns"]
    sft_episodes = solvable(pool[: task["sft_items"] * 2], turns)
    sft_ids = list(sft_episodes)[: task["sft_items"]]
    held_episodes = solvable(held[: task["eval_items"] * 3], turns)
    held_ok = list(held_episodes)[: task["eval_items"]]
    if len(held_ok) < task["eval_items"]:
        raise SystemExit(f"only {len(held_ok)} held-out items within {turns} expert turns")
    grpo = list(solvable(pool[task["sft_items"] * 2:][:6000], turns))
    _write_json(Path("items.json"), {
        "sft": {i: sft_episodes[i] for i in sft_ids}, "grpo": grpo, "held_out": held_ok,
        "held_out_expert_turns": {i: sum(m["role"] == "assistant" for m in held_episodes[i]) - 1 for i in held_ok}})


def _items() -> dict[str, Any]:
    return json.loads(Path("items.json").read_text())


def base_model(params: dict[str, Any] | None = None) -> Path:
    """The policy the warm start fine-tunes: the workspace's ``model.base`` (v2), else SCALINGINTER_STUDY_BASE,
    else the project's models/tiny (built when a fresh clone has none)."""
    from benchmarks import tiny_model

    return tiny_model((params or {}).get("model", {}).get("base") or os.environ.get("SCALINGINTER_STUDY_BASE"))


def stage_warm(params: dict[str, Any]) -> None:
    from training.warmstart.sft import SFTConfig, sft

    warm = params["warm"]
    episodes = list(_items()["sft"].values())
    if Path("warm").exists():
        shutil.rmtree("warm")
    sft(base_model(params), Path("warm"), episodes,
        SFTConfig(epochs=warm["epochs"], lr=warm["lr"], batch_size=warm["batch_size"]), progress=True)


def _eval_summary(result: Any, items: list[str], expert_turns: dict[str, int]) -> dict[str, Any]:
    """Success with its CI, per expert-turn bucket, mean turns and terminations of a greedy evaluation."""
    from collections import Counter

    part = {i: result.success[i] for i in items}
    flat = [float(v[0]) for v in part.values()]
    from training.evaluation.evaluate import bootstrap_ci

    low, high = bootstrap_ci(flat)
    buckets: dict[str, float] = {}
    for n in sorted(set(expert_turns[i] for i in items)):
        chosen = [float(part[i][0]) for i in items if expert_turns[i] == n]
        buckets[f"expert_{n}_turns"] = sum(chosen) / len(chosen)
    ended = Counter(result.termination[i][0] for i in items)
    return {"success": sum(flat) / len(flat), "ci": [low, high], "items": len(items),
            "turns_mean": sum(result.turns[i][0] for i in items) / len(items),
            "termination": dict(ended), "by_expert_turns": buckets,
            "per_item": {i: int(part[i][0]) for i in items}}


def stage_pilot(params: dict[str, Any]) -> None:
    """The pilot: the warm start's greedy success by turn cap on the first ``pilot.items`` held-out items; each cap
    is kept in pilot/ as it is done, so a killed pilot goes on with the next cap."""
    from envs.launcher import running_server
    from training.checkpoint import folder_hash
    from training.evaluation.evaluate import evaluate

    data = _items()
    expert_turns = {k: int(v) for k, v in data["held_out_expert_turns"].items()}
    pilot, items = params["pilot"], data["held_out"][: params["pilot"]["items"]]
    folder = Path("pilot")
    folder.mkdir(exist_ok=True)
    key = {"warm": folder_hash(Path("warm")), "items": len(items), "max_new_tokens": params["train"]["max_new_tokens"],
           **_budget(params)}
    out: dict[str, Any] = {"by_cap": {}}
    with running_server("babyai", idle_ttl_s=IDLE_TTL_S) as url:
        for h in pilot["caps"]:
            done = folder / f"h{h}.json"
            if done.exists() and json.loads(done.read_text()).get("key") == key:
                out["by_cap"][str(h)] = json.loads(done.read_text())["summary"]
                continue
            started = time.perf_counter()
            result = evaluate(Path("warm"), "babyai", url, items, h=h, max_new_tokens=key["max_new_tokens"],
                              batch_items=params["eval"]["batch_items"], **_budget(params))
            summary = _eval_summary(result, items, expert_turns)
            summary |= {"seconds": round(time.perf_counter() - started, 1), "generated_tokens": result.generated_tokens}
            del summary["per_item"]
            _write_json(done, {"key": key, "summary": summary})
            out["by_cap"][str(h)] = summary
            print(f"warm start, h={h}: greedy success {summary['success']:.1%} on {len(items)} items, "
                  f"{summary['turns_mean']:.2f} turns, {summary['seconds']} s", flush=True)
    out["success_at_largest_cap"] = out["by_cap"][str(pilot["caps"][-1])]["success"]
    _write_json(Path("pilot.json"), out)


def stage_warm_eval(params: dict[str, Any]) -> None:
    """The warm start, greedy at eval.h on every held-out item: the arms' common baseline."""
    from envs.launcher import running_server
    from training.evaluation.evaluate import evaluate

    data = _items()
    held, expert_turns = data["held_out"], {k: int(v) for k, v in data["held_out_expert_turns"].items()}
    with running_server("babyai", idle_ttl_s=IDLE_TTL_S) as url:
        result = evaluate(Path("warm"), "babyai", url, held, h=params["eval"]["h"],
                          max_new_tokens=params["train"]["max_new_tokens"], batch_items=params["eval"]["batch_items"],
                          **_budget(params))
        out: dict[str, Any] = {"held_out": _eval_summary(result, held, expert_turns)}
        out["held_out"]["generated_tokens"] = result.generated_tokens
        out["success"] = out["held_out"]["success"]
        if params["eval"].get("sampled"):  # v2: one sample per item at temperature 1 beside greedy
            out["sampled"] = _sampled(Path("warm"), url, held, expert_turns, params)
    _write_json(Path("warm_eval.json"), out)


def _sampled(checkpoint: Path, url: str, items: list[str], expert_turns: dict[str, int],
             params: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` on ``items``, one sample each at temperature 1 (a fixed seed), at eval.h."""
    from training.evaluation.evaluate import evaluate

    ev = params["eval"]
    result = evaluate(checkpoint, "babyai", url, items, h=ev["h"], k=1, temperature=1.0,
                      seed=ev.get("sample_seed", 0), max_new_tokens=params["train"]["max_new_tokens"],
                      batch_items=ev["batch_items"], **_budget(params))
    return _eval_summary(result, items, expert_turns)


def _budget(params: dict[str, Any]) -> dict[str, Any]:
    """The evaluation's context budget: training's, where the study sets one (v2), else the evaluator's default."""
    budget = params["train"].get("context_budget")
    return {"context_budget": budget} if budget else {}


def _arm_dir(params: dict[str, Any]) -> Path:
    return Path("arms") / f"{params['arm']['name']}-s{params['arm']['seed']}"


def stage_train(params: dict[str, Any]) -> None:
    """The arm's phases in order, each from the previous one's final checkpoint; a killed phase resumes."""
    from envs.launcher import running_server
    from training.checkpoint import list_checkpoints, weights_copy
    from training.phases.trainer import train_phase
    from training.settings.config import TrainConfig
    from training.settings.curriculum import AdaptiveRule

    arm, train = params["arm"], params["train"]
    items = _items()["grpo"]
    config = TrainConfig(items=items, seed=arm["seed"], log_rollouts=False, skip_flat_steps=True,
                         drop_flat_groups=True, **train)
    rule = AdaptiveRule(**ADAPTIVE_RULE) if arm["adaptive"] else None
    scratch, phases_dir = Path("scratch") / _arm_dir(params).name, _arm_dir(params) / "phases"
    init, rows = Path("warm"), []
    with running_server("babyai", idle_ttl_s=IDLE_TTL_S) as url:
        for index, (h, steps) in enumerate(arm["schedule"]):
            last = index == len(arm["schedule"]) - 1
            final = train_phase("babyai", index, h, steps, init, scratch / f"phase-{index}", config=config,
                                url=url, progress=True, adaptive=None if last else rule)
            init = final
    shutil.rmtree(phases_dir, ignore_errors=True)
    for index in range(len(arm["schedule"])):  # the record: each phase's final policy and its metrics
        for part in ("final", "final-state", "dvclive"):  # final-state: the manifest lists its files
            if (scratch / f"phase-{index}" / part).exists():
                shutil.copytree(scratch / f"phase-{index}" / part, phases_dir / f"phase-{index}" / part)
        if params["eval"].get("sampled"):  # v2: the checkpoints every save_every steps, the curve's points
            for folder in list_checkpoints(scratch / f"phase-{index}" / "intermediate"):  # weights only: the
                weights_copy(folder, phases_dir / f"phase-{index}" / "curve" / folder.name)  # optimizer stays
    cumulative = 0
    for index in range(len(arm["schedule"])):
        folder = phases_dir / f"phase-{index}"
        manifest = json.loads((folder / "final" / "manifest.json").read_text())
        for row in _dvclive_rows(folder / "dvclive"):
            cumulative += row.get("perf/generated_tokens", 0.0)
            rows.append({"phase": index, "step": int(row["step"]), "h": int(row.get("curriculum/h", 0)),
                         "success": row.get("success/rate"), "reward": row.get("reward/mean"),
                         "turns": row.get("turns/mean"), "tokens": row.get("perf/generated_tokens", 0.0),
                         "cumulative_tokens": cumulative, "seconds": row.get("timing_s/total"),
                         "turn_cap": row.get("rollout/termination/turn_cap"),
                         "done": row.get("rollout/termination/done"),
                         "context_cap": row.get("rollout/termination/context_cap")})
        rows.append({"phase": index, "end": True, "manifest_curriculum": manifest.get("curriculum", {}),
                     "cost": manifest.get("cost", {})})
    steps = [r for r in rows if "step" in r]
    _write_json(_arm_dir(params) / "train.json", {
        "steps": len(steps), "generated_tokens": cumulative,
        "wall_seconds": sum(r.get("seconds") or 0.0 for r in steps), "rows": rows})


def _dvclive_rows(folder: Path) -> list[dict[str, float]]:
    """The per-step metrics of a dvclive folder, one dict per step."""
    import csv

    by_step: dict[int, dict[str, float]] = {}
    plots = folder / "plots" / "metrics"
    for tsv in plots.rglob("*.tsv"):
        name = str(tsv.relative_to(plots).with_suffix(""))
        with tsv.open() as f:
            for row in csv.DictReader(f, delimiter="\t"):
                step = int(row["step"])
                by_step.setdefault(step, {"step": step})[name] = float(row[tsv.stem])
    return [by_step[s] for s in sorted(by_step)]


def stage_eval(params: dict[str, Any]) -> None:
    """The arm's final policy on every held-out item, and each phase's final (the curve) on the first
    ``curve_items``, greedily at eval.h; v2 (``eval.sampled``) adds the final sampled at T = 1 and a curve point
    for every checkpoint kept during training."""
    from envs.launcher import running_server
    from training.evaluation.evaluate import evaluate

    data = _items()
    held, expert_turns = data["held_out"], {k: int(v) for k, v in data["held_out_expert_turns"].items()}
    ev = params["eval"]
    phases_dir = _arm_dir(params) / "phases"
    n = len(params["arm"]["schedule"])
    out: dict[str, Any] = {"curve": []}
    kwargs: dict[str, Any] = {"h": ev["h"], "max_new_tokens": params["train"]["max_new_tokens"],
                              "batch_items": ev["batch_items"]}
    kwargs |= _budget(params)
    curve = held[: ev.get("curve_items", params["task"]["curve_items"])]
    with running_server("babyai", idle_ttl_s=IDLE_TTL_S) as url:
        for index in range(n):  # v1: each phase's final but the last; v2: every kept checkpoint too
            folder = phases_dir / f"phase-{index}"
            points = sorted((folder / "curve").glob("step-*")) if ev.get("sampled") else []
            if index < n - 1:
                points.append(folder / "final")
            for checkpoint in points:
                result = evaluate(checkpoint, "babyai", url, curve, **kwargs)
                manifest = json.loads((checkpoint / "manifest.json").read_text())
                out["curve"].append({"phase": index, "global_step": manifest.get("global_step"),
                                     "success": sum(result.success[i][0] for i in curve) / len(curve),
                                     "items": len(curve)})
        last = phases_dir / f"phase-{n - 1}" / "final"
        result = evaluate(last, "babyai", url, held, **kwargs)
        out["held_out"] = _eval_summary(result, held, expert_turns)
        out["success"] = out["held_out"]["success"]
        if ev.get("sampled"):
            out["sampled"] = _sampled(last, url, held, expert_turns, params)
    _write_json(_arm_dir(params) / "eval.json", out)


# ---- the driver ----

def _arm_key(name: str, seed: int) -> str:
    return f"{name}-s{seed}"


def run(workspace: Path, seeds: list[int], arms: list[str], docs: Path = DOCS,
        params: dict[str, Any] | None = None, specs: dict[str, dict[str, Any]] | None = None) -> None:
    """Run every arm x seed whose figures are not in ``docs`` yet, one DVC experiment each (arms by name from
    ``specs``, default ARMS)."""
    init_workspace(workspace, params)
    specs = specs or ARMS
    for seed in seeds:
        for name in arms:
            key = _arm_key(name, seed)
            if (docs / f"{key}.json").exists():
                print(f"{key}: done ({docs / key}.json)")
                continue
            spec = specs[name]
            started = time.perf_counter()
            sets = [f"arm.name={name}", f"arm.seed={seed}", f"arm.schedule={json.dumps(spec['schedule'])}",
                    f"arm.adaptive={str(spec['adaptive']).lower()}"]
            args = ["exp", "run", "-n", key] + [a for s in sets for a in ("-S", s)]
            print(f"{key}: dvc {' '.join(args)}", flush=True)
            if _dvc(workspace, *args) != 0:
                raise SystemExit(f"{key}: dvc exp run failed (rerun to resume it)")
            collect(workspace, name, seed, time.perf_counter() - started, docs, spec)


def collect(workspace: Path, name: str, seed: int, seconds: float, docs: Path = DOCS,
            spec: dict[str, Any] | None = None) -> None:
    """Copy a finished arm's figures (and the warm start's) into ``docs``."""
    folder = workspace / "arms" / _arm_key(name, seed)
    train = json.loads((folder / "train.json").read_text())
    evaluation = json.loads((folder / "eval.json").read_text())
    lock = yaml.safe_load((workspace / "dvc.lock").read_text())
    _write_json(docs / f"{_arm_key(name, seed)}.json", {
        "arm": name, "seed": seed, "spec": spec or ARMS[name], "train": train, "eval": evaluation,
        "stage_seconds": round(seconds, 1),
        "lineage": {stage: [o.get("md5") for o in lock["stages"][stage].get("outs", [])]
                    for stage in ("warm", "train")}})
    if not (docs / "warm.json").exists():
        _write_json(docs / "warm.json", _warm(workspace))


def _warm(workspace: Path) -> dict[str, Any]:
    """The warm start's figures: its held-out evaluation and the pilot's success by turn cap."""
    return {**json.loads((workspace / "warm_eval.json").read_text()),
            "by_cap": json.loads((workspace / "pilot.json").read_text())["by_cap"]}


def pilot(workspace: Path, params: dict[str, Any] | None = None, docs: Path = DOCS) -> None:
    init_workspace(workspace, params)
    if _dvc(workspace, "repro", "pilot", "warm_eval") != 0:
        raise SystemExit("the pilot failed (rerun to resume)")
    data = _warm(workspace)
    _write_json(docs / "warm.json", data)
    print(json.dumps({h: {k: v for k, v in s.items() if k != "per_item"} for h, s in data["by_cap"].items()},
                     indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["pilot", "run", "report", "status", "stage"])
    parser.add_argument("stage", nargs="?", help="(stage) items | warm | pilot | warm_eval | train | eval")
    parser.add_argument("--study", choices=sorted(STUDIES), default="v1",
                        help="v1: issue 18's study (4 arms x 24 steps, 500 items); v2: issue 46's (docs/study-plan.md)")
    parser.add_argument("--workspace", type=Path, default=None, help="default: the study's own (runs/...)")
    parser.add_argument("--seeds", default=None, help="default: v1 0,1; v2 0,1,2")
    parser.add_argument("--arms", default=None, help="default: every arm of the study, in its order")
    args = parser.parse_args()
    study = STUDIES[args.study]
    args.workspace = args.workspace or study["workspace"]
    args.seeds = args.seeds or ("0,1,2" if args.study == "v2" else "0,1")
    args.arms = args.arms or ",".join(study["arms"])
    sys.path.insert(0, str(ROOT))
    if args.command == "stage":
        import torch

        torch.set_num_threads(int(os.environ.get("STUDY_THREADS", "2")))
        sys.path.insert(0, str(ROOT))
        {"items": stage_items, "warm": stage_warm, "pilot": stage_pilot, "warm_eval": stage_warm_eval,
         "train": stage_train,
         "eval": stage_eval}[args.stage](_params())
    elif args.command == "pilot":
        pilot(args.workspace, study["params"], study["docs"])
    elif args.command == "run":
        unknown = [a for a in args.arms.split(",") if a not in study["arms"]]
        if unknown:
            raise SystemExit(f"no arm {', '.join(unknown)} in study {args.study}: choose from "
                             f"{', '.join(study['arms'])}")
        run(args.workspace, [int(s) for s in args.seeds.split(",")], args.arms.split(","), docs=study["docs"],
            params=study["params"], specs=study["arms"])
    elif args.command == "report":
        from benchmarks.curriculum_report import write_report

        if args.study != "v1":
            raise SystemExit(f"study {args.study} has no report page yet: its figures are the JSONs in "
                             f"{study['docs']} (one per finished arm and seed)")

        write_report(DOCS)
    else:
        done = sorted(p.stem for p in study["docs"].glob("*-s*.json"))
        print(f"done: {', '.join(done) or 'none'}")


if __name__ == "__main__":
    main()

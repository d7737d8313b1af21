"""The curriculum study's figures from its finished arms (docs/curriculum-study/<arm>-s<seed>.json): the table
with 95% CIs, paired differences (bootstrap over held-out items) to the warm start and between arms, the cost,
and the curves. Writes docs/curriculum-study/summary.json (which the HTML report draws in its "Curriculum study"
section) and docs/curriculum-study.md.

    python benchmarks/curriculum_study.py report
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from training.evaluation.evaluate import bootstrap_ci, paired_difference_ci

ORDER = ["fixed-2", "fixed-20", "scaling", "adaptive"]
LABELS = {"fixed-2": "fixed h=2", "fixed-20": "fixed h=20 (the cap)", "scaling": "ScalingInter 2/6/10",
          "adaptive": "adaptive 2/6/10"}
PAIRS = [("scaling", "fixed-2"), ("scaling", "fixed-20"), ("adaptive", "scaling"), ("fixed-20", "fixed-2")]


def _per_item(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each held-out item's greedy success averaged over an arm's seeds."""
    items = runs[0]["eval"]["held_out"]["per_item"]
    return {i: sum(r["eval"]["held_out"]["per_item"][i] for r in runs) / len(runs) for i in items}


def summarise(folder: Path) -> dict[str, Any]:
    """Everything the study reports, from the arms' files in ``folder``."""
    warm = json.loads((folder / "warm.json").read_text())
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(folder.glob("*-s*.json")):
        data = json.loads(path.read_text())
        runs.setdefault(data["arm"], []).append(data)
    arms = [a for a in ORDER if a in runs] + sorted(set(runs) - set(ORDER))
    warm_items = {i: float(v) for i, v in warm["held_out"]["per_item"].items()}
    table, curves = [], {}
    for arm in arms:
        per_item = _per_item(runs[arm])
        items = sorted(per_item)
        values = [per_item[i] for i in items]
        low, high = bootstrap_ci(values)
        diff, dlow, dhigh = paired_difference_ci([warm_items[i] for i in items], values)
        tokens = [r["train"]["generated_tokens"] for r in runs[arm]]
        seconds = [r["train"]["wall_seconds"] for r in runs[arm]]
        table.append({
            "arm": arm, "label": LABELS.get(arm, arm), "seeds": [r["seed"] for r in runs[arm]],
            "success": sum(values) / len(values), "ci": [low, high], "items": len(items),
            "per_seed": [r["eval"]["held_out"]["success"] for r in runs[arm]],
            "vs_warm": [diff, dlow, dhigh], "rollout_tokens": sum(tokens) / len(tokens),
            "train_seconds": sum(seconds) / len(seconds), "steps": runs[arm][0]["train"]["steps"],
            "turns_mean": sum(r["eval"]["held_out"]["turns_mean"] for r in runs[arm]) / len(runs[arm]),
            "by_expert_turns": {k: sum(r["eval"]["held_out"]["by_expert_turns"][k] for r in runs[arm]) / len(runs[arm])
                                for k in runs[arm][0]["eval"]["held_out"]["by_expert_turns"]},
        })
        curves[arm] = [{"seed": r["seed"], "rows": [row for row in r["train"]["rows"] if "step" in row],
                        "held_out": [*r["eval"]["curve"], {"phase": "final", "global_step": r["train"]["steps"],
                                                           "success": r["eval"]["held_out"]["success"]}]}
                       for r in runs[arm]]
    pairs = []
    by_arm = {a: _per_item(runs[a]) for a in arms}
    for a, b in PAIRS:
        if a in by_arm and b in by_arm:
            items = sorted(by_arm[a])
            diff, low, high = paired_difference_ci([by_arm[b][i] for i in items], [by_arm[a][i] for i in items])
            pairs.append({"a": a, "b": b, "diff": diff, "ci": [low, high]})
    cost = None
    found = {r["arm"]: r for r in table}
    if "scaling" in found and "fixed-20" in found:
        cost = found["scaling"]["rollout_tokens"] / found["fixed-20"]["rollout_tokens"]
    return {"warm": {"success": warm["held_out"]["success"], "ci": warm["held_out"]["ci"],
                     "items": warm["held_out"]["items"], "by_cap": warm["by_cap"],
                     "by_expert_turns": warm["held_out"]["by_expert_turns"]},
            "table": table, "pairs": pairs, "cost_ratio_scaling_vs_fixed_large": cost, "curves": curves,
            "labels": LABELS}


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


def _signed(v: float) -> str:
    return f"{100 * v:+.1f}"


def _phase_table(summary: dict[str, Any]) -> list[str]:
    """Training trajectories per arm and phase, both seeds together: steps, mean turns, and how they ended."""
    out = []
    for arm, seeds in summary.get("curves", {}).items():
        phases: dict[int, dict[str, float]] = {}
        for run in seeds:
            for row in run["rows"]:
                if row.get("step") is None or row.get("turns") is None:
                    continue  # a held-out evaluation between phases
                ended = {k: row.get(k) or 0.0 for k in ("done", "turn_cap", "context_cap")}
                total = sum(ended.values()) or 1.0
                agg = phases.setdefault(row["phase"], {"h": row["h"], "steps": 0, "turns": 0.0, "done": 0.0,
                                                       "turn_cap": 0.0, "context_cap": 0.0})
                agg["steps"] += 1
                agg["turns"] += row["turns"]
                for k, v in ended.items():
                    agg[k] += v / total
        for phase, agg in sorted(phases.items()):
            n = agg["steps"]
            out.append(f"| {summary['labels'].get(arm, arm)} | {phase} (h={agg['h']}) | {n} | {agg['turns'] / n:.2f} | "
                       f"{_pct(agg['done'] / n)} | {_pct(agg['turn_cap'] / n)} | {_pct(agg['context_cap'] / n)} |")
    if not out:
        return []
    return ["", "Training trajectories per phase (all seeds' steps together): length and what ended them:", "",
            "| arm | phase | steps | mean turns | done | cut by the turn cap | cut by the context budget |",
            "|---|---|---|---|---|---|---|", *out]


def markdown(summary: dict[str, Any]) -> str:
    warm = summary["warm"]
    lines = ["# Curriculum study: ScalingInter against fixed turn caps (BabyAI GoTo, tiny policy)", "",
             "Generated by `python benchmarks/curriculum_study.py report` from `docs/curriculum-study/*.json`; the "
             "method, the task and why it is fair to every arm are in `benchmarks/curriculum_study.py`'s docstring.",
             "", "## The warm start (pilot)", "",
             "Greedy success of the SFT warm start by turn cap on the pilot's held-out items:", "",
             "| h | success | 95% CI | mean turns | termination | eval seconds |", "|---|---|---|---|---|---|"]
    for h, s in warm["by_cap"].items():
        lines.append(f"| {h} | {_pct(s['success'])} | {_pct(s['ci'][0])}-{_pct(s['ci'][1])} | {s['turns_mean']:.2f} "
                     f"| {s['termination']} | {s['seconds']} |")
    lines += ["", f"At the evaluation cap on all {warm['items']} held-out items: {_pct(warm['success'])} "
              f"(95% CI {_pct(warm['ci'][0])}-{_pct(warm['ci'][1])}); by the expert's turns: "
              + ", ".join(f"{k.split('_')[1]} turns {_pct(v)}" for k, v in warm["by_expert_turns"].items()), "",
              "## The arms (greedy, at the cap, on the same held-out items; seeds averaged per item)", "",
              "| arm | seeds | steps | success | 95% CI | per seed | vs warm start (paired, 95% CI) | rollout tokens | "
              "train wall s | mean turns |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["table"]:
        d = r["vs_warm"]
        lines.append(f"| {r['label']} | {len(r['seeds'])} | {r['steps']} | {_pct(r['success'])} | "
                     f"{_pct(r['ci'][0])}-{_pct(r['ci'][1])} | {', '.join(_pct(s) for s in r['per_seed'])} | "
                     f"{_signed(d[0])} ({_signed(d[1])} to {_signed(d[2])}) | {r['rollout_tokens']:,.0f} | "
                     f"{r['train_seconds']:,.0f} | {r['turns_mean']:.2f} |")
    buckets = sorted(summary["warm"]["by_expert_turns"])
    if summary["table"] and buckets:
        lines += ["", "Success by how many turns the expert needs (the small cap cannot reach 3-4):", "",
                  "| | " + " | ".join(b.split("_")[1] + " turns" for b in buckets) + " |",
                  "|---|" + "---|" * len(buckets),
                  "| warm start | " + " | ".join(_pct(summary["warm"]["by_expert_turns"][b]) for b in buckets) + " |"]
        lines += [f"| {r['label']} | " + " | ".join(_pct(r["by_expert_turns"].get(b, 0.0)) for b in buckets) + " |"
                  for r in summary["table"]]
    if summary["pairs"]:
        lines += ["", "Paired differences between arms (points, bootstrap over items):", ""]
        for p in summary["pairs"]:
            verdict = "significant" if p["ci"][0] > 0 or p["ci"][1] < 0 else "not significant"
            lines.append(f"- {summary['labels'].get(p['a'], p['a'])} - {summary['labels'].get(p['b'], p['b'])}: "
                         f"{_signed(p['diff'])} (95% CI {_signed(p['ci'][0])} to {_signed(p['ci'][1])}; {verdict})")
    lines += _phase_table(summary)
    ratio = summary["cost_ratio_scaling_vs_fixed_large"]
    if ratio is not None:
        lines += ["", f"Cost: ScalingInter generated {ratio:.2f}x the rollout tokens of the fixed-cap arm at matched "
                  "steps (target <= 0.6)."]
    lines += ["", "Curves per arm (training success against steps and against cumulative rollout tokens) are in the "
              "HTML report's \"Curriculum study\" section (`scalinginter report`).", ""]
    statement = Path(__file__).resolve().parents[1] / "docs" / "curriculum-study" / "statement.md"
    if statement.exists():
        lines += ["## What was and was not shown", "", statement.read_text().strip(), ""]
    return "\n".join(lines)


def write_report(folder: Path) -> Path:
    """Write summary.json beside the arms and docs/curriculum-study.md; returns the markdown's path."""
    from envs.files import atomic_write

    summary = summarise(folder)
    atomic_write(folder / "summary.json", json.dumps(summary, indent=1) + "\n")
    out = folder.parent / "curriculum-study.md"
    atomic_write(out, markdown(summary))
    print(out.read_text())
    return out

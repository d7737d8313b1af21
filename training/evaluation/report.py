"""The report a person looks at: one self-contained HTML page (no network access needed).

    scalinginter report sciworld            # reports/sciworld.html (also the DVC stage report@sciworld)
    scalinginter report                     # reports/index.html: every environment that has results

Sections: a curriculum explorer (the seed page's: h(t) = min(h1 + delta_h * floor(t / Delta), cap) and the
phase staircase), Overall bars per benchmark (the paper's rows from data/paper_results.json beside this
project's), success phase by phase with 95% CIs, success per sub-task, per-phase curves from dvclive, the
lineage chain, the cost ledger and the fixed-h baselines when run. The data is embedded as JSON and drawn
by a small inline script, so the page is one file that opens anywhere.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envs.files import atomic_write
from envs.paths import project_root
from training.checkpoint import CheckpointError, read_manifest
from training.model import PRESETS
from training.settings.config import ConfigError, base_model_dir, curriculum_config, load_params
from training.settings.layout import Run

if TYPE_CHECKING:
    from training.settings.specs import ReportSpec

ENV_NAMES = {"webarena": "WebArena", "deepsearch": "Deep Search", "textcraft": "TextCraft", "babyai": "BabyAI",
             "sciworld": "SciWorld", "mixed": "Mixed (one policy over several environments)"}
CURVES = ["reward/mean", "success/rate", "turns/mean", "actor/entropy", "actor/kl", "actor/pg_loss",
          "curriculum/h", "env/errors"]
TEMPLATE = Path(__file__).with_name("report_template.html")


def _tsv(path: Path) -> list[list[float]]:
    with path.open() as handle:
        rows = list(csv.reader(handle, delimiter="\t"))
    return [[float(r[0]), float(r[-1])] for r in rows[1:] if len(r) >= 2 and r[-1] not in ("", "nan")]


def _curves(run: Path) -> dict[str, list[list[float]]]:
    """Each plotted metric over global steps, phases concatenated in order."""
    out: dict[str, list[list[float]]] = {}
    phases = sorted(run.glob("phase-*"), key=lambda p: int(p.name.split("-")[1]))
    for phase in phases:
        plots = phase / "dvclive" / "plots" / "metrics"
        reasons = sorted((plots / "rollout" / "termination").glob("*.tsv"))
        names = CURVES + [f"rollout/termination/{p.stem}" for p in reasons]
        # a mixed run: each environment's own curves beside the totals
        names += [f"{e}/{n}" for e in ENV_NAMES if (plots / e).is_dir()
                  for n in ("success/rate", "reward/mean", "turns/mean", "curriculum/h", "env/errors")]
        for name in names:
            path = plots / f"{name}.tsv"
            if path.exists():
                out.setdefault(name, []).extend(_tsv(path))
    return out


def _phases(run: Path) -> list[dict[str, Any]]:
    out = []
    for phase in sorted(run.glob("phase-*"), key=lambda p: int(p.name.split("-")[1])):
        try:
            manifest = read_manifest(phase / "final")
        except (CheckpointError, FileNotFoundError):
            continue
        out.append({"phase": manifest.get("phase"), "h": manifest.get("h"), "steps": manifest.get("steps"),
                    "first_step": manifest.get("phase_first_step"),
                    "algorithm": manifest.get("algorithm"),
                    "hash": manifest.get("hash", "")[:12], "parent": manifest.get("parent", "")[:12],
                    "cost": manifest.get("cost", {})})
    return out


def _lineage(env: str, root: Path) -> dict[str, Any]:
    from training.evaluation.lineage import lineage

    try:
        records, problems, revision = lineage(env, root)
    except (FileNotFoundError, LookupError) as err:
        return {"error": str(err), "records": [], "problems": [], "revision": None}
    from training.evaluation.gate import run_result

    try:  # with promotion gates: the checkpoint the run hands back, and why
        result = run_result(env, root)
    except ConfigError as err:
        result = {"error": str(err)}
    return {"revision": revision, "problems": problems, "result": result,
            "records": [{"stage": r.stage, "h": r.h, "steps": r.steps, "trained": r.trained, "algorithm": r.algorithm,
                         "parent": r.parent[:12], "own": r.own[:12]} for r in records]}


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _model(params: dict[str, Any], root: Path) -> dict[str, Any]:
    folder = base_model_dir(params, root)
    config = _json(folder / "config.json") or {}
    weights = folder / "model.safetensors"
    dtype_bytes = {"bfloat16": 2, "float16": 2}.get(str(config.get("torch_dtype") or config.get("dtype")), 4)
    size = weights.stat().st_size // dtype_bytes if weights.exists() else None
    preset = folder.name
    hub = PRESETS[preset].hub_id if preset in PRESETS else None
    return {"name": f"{hub} ({preset})" if hub else f"{preset} Qwen2 (built locally)", "parameters": size,
            "layers": config.get("num_hidden_layers"), "hidden": config.get("hidden_size")}


def _study(root: Path) -> dict[str, Any] | None:
    """The curriculum study's summary (benchmarks/curriculum_study.py report) and its statement, when run."""
    folder = root / "docs" / "curriculum-study"
    summary = _json(folder / "summary.json")
    if not summary:
        return None
    statement = folder / "statement.md"
    return {**summary, "statement": statement.read_text() if statement.exists() else None}


def report_data(envs: list[str], root: Path | None = None) -> dict[str, Any]:
    """Everything the page draws, as plain JSON."""
    root = root or project_root()
    params = load_params(root / "params.yaml")
    section = params.get("curriculum", {})
    profile = section.get("profile", "smoke")
    explorer = {}
    for env in ENV_NAMES:
        if env not in section:
            continue
        spec = section[env]["profiles"].get(profile, {})
        phases = curriculum_config(env, profile, params).phases()
        every = spec.get("every") or (phases[0].steps if phases else 100)
        h1 = spec.get("h1") or phases[0].h
        delta = spec.get("delta_h") or (phases[1].h - phases[0].h if len(phases) > 1 else 0)
        explorer[env] = {"cap": section[env]["cap"], "h1": h1, "delta_h": delta, "every": every,
                         "total": phases[-1].last_step + 1 if phases else 300}
    results = {}
    for env in envs:
        run = Run(env, root=root)
        baselines = {}
        for h in section.get(env, {}).get("fixed_baselines", []):
            metrics = _json(Run(env, h, root).eval_metrics)
            if metrics:
                baselines[f"fixed h={h}"] = metrics
        outside = {}  # scalinginter eval-outside: models behind an API, on the same items
        for path in sorted((run.eval_dir / "outside").glob("*.json")):
            row = _json(path)
            if row and "success" in row:
                outside[row.get("model", path.stem)] = row
        results[env] = {"eval": _json(run.eval_metrics), "curves": _curves(run.dir), "phases": _phases(run.dir),
                        "lineage": _lineage(env, root), "baselines": baselines, "outside": outside}
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return {"profile": profile, "envs": envs, "names": ENV_NAMES, "explorer": explorer,
            "paper": _json(root / "data" / "paper_results.json"), "results": results, "model": _model(params, root),
            "git": revision.stdout.strip() or None, "study": _study(root),
            "generated": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")}


def render(data: dict[str, Any]) -> str:
    blob = json.dumps(data, sort_keys=True).replace("</", "<\\/")
    return TEMPLATE.read_text().replace("/*__DATA__*/null", blob)


def write_report(spec: ReportSpec) -> Path:
    """Write the page of ``spec`` (``training.settings.specs.report_spec``) atomically; returns its file."""
    return atomic_write(spec.out, render(report_data(spec.envs, spec.root)))

"""The DVC pipeline: generated from params.yaml, agrees with the curriculum function, reruns exactly
what a change invalidates."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from envs.launcher import ROOT
from flows.dvc_pipeline import check, render
from training.settings.config import curriculum_config, load_params
from training.settings.specs import start_checkpoint


def _resolved(params: dict, folder: Path) -> dict[str, dict]:
    """The stages DVC resolves from ``render(params)`` (``${...}`` interpolated): {name: {cmd, deps}}."""
    from dvc.repo import Repo

    phases_text, dvc_text = render(params)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.yaml").write_text(yaml.safe_dump(params))
    (folder / "phases.yaml").write_text(phases_text)
    (folder / "dvc.yaml").write_text(dvc_text)
    Repo.init(str(folder), no_scm=True, force=True)
    with Repo(str(folder)) as repo:
        return {s.name: {"cmd": s.cmd, "deps": [str(d.def_path) for d in s.deps]} for s in repo.index.stages}


def test_committed_dvc_yaml_and_phases_agree_with_params_and_the_curriculum(tmp_path) -> None:
    assert check() == [], "run `scalinginter pipeline` and commit phases.yaml and dvc.yaml"
    params = load_params()
    phases = yaml.safe_load((ROOT / "phases.yaml").read_text())
    stages = _resolved(params, tmp_path)
    profile = params["curriculum"]["profile"]
    build = stages["build_model"]["cmd"]
    assert "--seed 0 " in build and "--preset tiny --out models/tiny" in build
    for env in params["pipeline"]["envs"]:
        expected = curriculum_config(env, profile).phases()
        rl = [row for name, row in phases[env].items() if name.startswith("phase_")]  # after any warm start
        assert [(p["h"], p["steps"], p["first_step"]) for p in rl] == [(p.h, p.steps, p.first_step) for p in expected]
        for p in expected:
            stage = stages[f"{env}_phase_{p.index}"]
            assert f"--h {p.h} --steps {p.steps}" in stage["cmd"] and f"--phase {p.index}" in stage["cmd"]
            assert stage["cmd"].startswith("python -m flows.cli train-phase")  # the working copy's own code
            # each phase after the first starts from what the previous phase's promotion gate promoted
            # (phase 0 from the last warm-start stage's checkpoint, or the base model: BabyAI's smoke warm start)
            parent = str(start_checkpoint(env, params)) if p.index == 0 else \
                f"runs/{env}/gate-{p.index - 1}/promotion.json"
            assert f"--init {parent}" in stage["cmd"]
            assert any(parent == d or parent.startswith(d + "/") for d in stage["deps"])  # it, or its stage's folder
            # the code it runs: its own environment and the core, not the other environments nor the CLI
            assert f"envs/{env}" in stage["deps"] and "envs/server.py" in stage["deps"]
            assert "envs" not in stage["deps"] and "flows/cli.py" not in stage["deps"]


def test_changing_one_phase_changes_only_it_and_later_phases() -> None:
    params = load_params()
    params["pipeline"]["envs"] = ["babyai"]
    before = yaml.safe_load(render(params)[0])["babyai"]
    params["curriculum"]["babyai"]["profiles"]["smoke"]["delta_h"] = 3  # phase 0 keeps h1; later phases move
    after = yaml.safe_load(render(params)[0])["babyai"]
    assert before["phase_0"] == after["phase_0"]
    assert before["phase_1"] != after["phase_1"] and before["phase_2"] != after["phase_2"]


def _workspace(tmp_path: Path, envs: str = "babyai", name: str = "repo", one_step_phases: int | None = None) -> Path:
    """A copy of the working tree in its own git repository, with the pipeline on ``envs``' smoke curricula.

    ``one_step_phases=N`` shortens each of those curricula to N phases of one step and the evaluation to two
    items x one sample: for tests of what runs the stages (DVC, Prefect, S3), not of the smoke run itself,
    which test_flow covers at full smoke scale.
    """
    ignore = shutil.ignore_patterns(".venv", ".venv-vllm", ".git", "runs", "models", ".cache", "cache", "tmp",
                                    "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", "*.egg-info")
    work = tmp_path / name
    shutil.copytree(ROOT, work, ignore=ignore)
    params = re.sub(r"(?m)^  envs: \[[^\]]*\]", f"  envs: [{envs}]", (work / "params.yaml").read_text())
    assert f"envs: [{envs}]" in params
    params = _without_main_job_warm_start(params)
    if one_step_phases is not None:
        params = _one_step_phases(params, envs.split(","), one_step_phases)
    (work / "params.yaml").write_text(params)
    _sh(work, "scalinginter", "pipeline")
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x"]):
        _sh(work, "git", *args)
    return work


def _without_main_job_warm_start(params: str) -> str:
    """``params`` without the smoke BabyAI warm start (~4 minutes of SFT, the main job's: `make run`) and with
    BabyAI's smoke evaluation on 6 items, as the other environments': the tests of the smoke run and of what runs
    its stages start from the base model (the warm stage is tested in tests/test_warm.py)."""
    warm = r"(?s)(      smoke: \{[^\n]*),\s*warm_start: \[\{method: sft, split: warm.*?\}\]\}"
    cut = re.sub(warm, r"\1}", params, count=1)
    assert cut != params, "no smoke BabyAI warm start in params.yaml"
    items = cut.replace("envs: {babyai: {items: null,", "envs: {babyai: {items: 6,")
    assert items != cut, "no smoke BabyAI evaluation in params.yaml"
    return items


def _one_step_phases(params: str, envs: list[str], phases: int) -> str:
    """``params`` (params.yaml's text, comments kept) with each env's smoke curriculum cut to ``phases``
    one-step phases, the smoke evaluation to two items x one sample and the smoke gates to two items."""
    for env in envs:
        section = re.search(rf"(?ms)^  {env}:\n.*?^      (smoke: \{{[^}}]*\}})", params)
        assert section is not None, f"no smoke curriculum for {env} in params.yaml"
        smoke = re.sub(r"every: \d+", "every: 1", section.group(1))
        smoke = re.sub(r"total_steps: \d+", f"total_steps: {phases}", smoke)
        params = params[:section.start(1)] + smoke + params[section.end(1):]
    evaluation = re.sub(r"(?m)^(  smoke: \{)items: \d+, k: \d+,", r"\1items: 2, k: 1,", params, count=1)
    evaluation = evaluation.replace("envs: {babyai: {items: 6,", "envs: {babyai: {items: 2,")
    assert evaluation != params, "no smoke evaluation in params.yaml"
    gates = re.sub(r"(?m)^(  smoke: \{enabled: true, )items: \d+,", r"\1items: 2,", evaluation, count=1)
    assert gates != evaluation, "no smoke promotion gate in params.yaml"
    return gates


def _sh(cwd: Path, *cmd: str) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "COLUMNS": "200"}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, f"{' '.join(cmd)}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout + done.stderr


def _ran(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


@pytest.mark.slow
def test_dvc_repro_runs_the_curriculum_then_nothing_then_only_what_changed(tmp_path) -> None:
    work = _workspace(tmp_path, one_step_phases=3)
    first = _sh(work, "dvc", "repro")
    assert {"build_model", "babyai_phase_0", "babyai_gate_0", "babyai_phase_1", "babyai_gate_1", "babyai_phase_2",
            "babyai_gate_2", "babyai_eval", "babyai_report"} <= set(_ran(first))
    assert json.loads((work / "runs/babyai/gate-1/promotion.json").read_text())["decision"] == "promoted"
    assert (work / "runs/babyai/phase-2/final/manifest.json").exists()
    metrics = json.loads((work / "runs/babyai/eval/metrics.json").read_text())
    assert list(metrics["checkpoints"]) == ["base", "phase-0", "phase-1", "phase-2"]
    assert "const DATA = {" in (work / "reports/babyai.html").read_text()
    # `dvc metrics show` reads as a short table: each phase's headline and each checkpoint's success, Avg@k and
    # Pass@k (not every sub-task's and every step's figure, which stay in the plain metrics.json files)
    header = next(line for line in _sh(work, "dvc", "metrics", "show").splitlines() if line.startswith("Path"))
    columns = header.split()[1:]
    assert set(columns) == {"step", "reward_mean", "success_rate", "actor_kl", "actor_entropy", "gate_parent",
                            "gate_phase", "gate_diff", "phase_promoted"} | {
        f"{c}.{m}" for c in ("base", "phase-0", "phase-1", "phase-2") for m in ("success", "avg_at_k", "pass_at_k")}
    assert _ran(_sh(work, "dvc", "repro")) == []  # a second repro does nothing
    params = (work / "params.yaml").read_text()
    smoke = "smoke: {h1: 2, delta_h: 2, every: 1, total_steps: 3}"
    assert params.count(smoke) >= 1
    (work / "params.yaml").write_text(params.replace(smoke, "smoke: {h1: 2, delta_h: 3, every: 1, total_steps: 3}",
                                                     1))
    _sh(work, "scalinginter", "pipeline")
    third = _ran(_sh(work, "dvc", "repro"))
    assert "babyai_phase_0" not in third and {"babyai_phase_1", "babyai_phase_2", "babyai_eval"} <= set(third)
    # lineage: dvc.lock and the checkpoints agree, and each phase's parent is the previous checkpoint
    table = _sh(work, "scalinginter", "lineage", "babyai")
    assert "babyai lineage" in table and "phase_2" in table and "disagreement" not in table
    narrow = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "COLUMNS": "80"}
    table = subprocess.run(["scalinginter", "lineage", "babyai"], cwd=work, env=narrow, capture_output=True,
                           text=True, check=True).stdout
    # whole in an 80-column terminal: every column's name and every hash, nothing cut to "…"
    assert "…" not in table and max(len(line) for line in table.splitlines()) <= 80
    assert all(name in table for name in ("stage", "steps", "algo", "parent", "hash", "reward", "success", "trained"))
    lock = (work / "dvc.lock").read_text()
    (work / "dvc.lock").write_text(lock.replace("h: 5", "h: 7", 1))  # phase 1's h after the change is 5
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "COLUMNS": "200"}
    tampered = subprocess.run(["scalinginter", "lineage", "babyai"], cwd=work, env=env, capture_output=True, text=True)
    assert tampered.returncode == 1 and "dvc.lock says h=7, the checkpoint says 5" in tampered.stdout


def test_adaptive_mode_reaches_the_phase_stages_as_params(tmp_path) -> None:
    params = load_params()
    params["pipeline"]["envs"] = ["babyai"]
    smoke = params["curriculum"]["babyai"]["profiles"]["smoke"]
    smoke.update(mode="adaptive", adaptive={"truncated_share": 0.6, "min_steps": 1})
    phases = {name: row for name, row in yaml.safe_load(render(params)[0])["babyai"].items()
              if name.startswith("phase_")}  # (not the warm start's rows)
    stages = _resolved(params, tmp_path)
    last = f"phase_{len(phases) - 1}"
    for name, row in phases.items():
        adaptive = name != last  # the last phase's h cannot grow
        assert ("adaptive" in row) == adaptive and ("--adaptive" in stages[f"babyai_{name}"]["cmd"]) == adaptive
    assert phases["phase_0"]["adaptive"]["truncated_share"] == 0.6  # a change of the rule reruns the phases


def test_fixed_h_baselines_are_stages_at_the_curriculums_total_steps(tmp_path) -> None:
    params = load_params()
    params["pipeline"].update(envs=["babyai"], baselines=True)
    stages = _resolved(params, tmp_path)
    total = sum(p.steps for p in curriculum_config("babyai", "smoke", params).phases())
    baselines = params["curriculum"]["babyai"]["fixed_baselines"]
    assert len(baselines) == 2
    for h in baselines:
        cmd = stages[f"babyai_fixed_h{h}"]["cmd"]
        assert f"--h {h} --steps {total}" in cmd and f"--init {start_checkpoint('babyai', params)} " in cmd
        assert f"--baseline {h}" in stages[f"babyai_fixed_h{h}_eval"]["cmd"]
        assert f"runs/babyai-fixed-h{h}/eval/metrics.json" in stages["babyai_report"]["deps"]
    params["pipeline"]["baselines"] = False
    assert not any("fixed" in name for name in yaml.safe_load(render(params)[1])["stages"])


@pytest.mark.slow
def test_fixed_h_baselines_run_and_reach_the_report(tmp_path) -> None:
    work = _workspace(tmp_path, one_step_phases=2)
    params = (work / "params.yaml").read_text().replace("  baselines: false", "  baselines: true", 1)
    # a small and a larger h, as BabyAI's [6, 20] are: two steps at h=20 alone cost ~90 s of CPU here
    babyai = "    fixed_baselines: [6, 20]\n"
    assert babyai in params
    (work / "params.yaml").write_text(params.replace(babyai, "    fixed_baselines: [3, 6]\n", 1))
    _sh(work, "scalinginter", "pipeline")
    ran = _ran(_sh(work, "dvc", "repro", "babyai_report"))
    assert {"babyai_fixed_h3", "babyai_fixed_h6", "babyai_fixed_h3_eval", "babyai_fixed_h6_eval"} <= set(ran)
    for h in (3, 6):
        manifest = json.loads((work / f"runs/babyai-fixed-h{h}/phase-0/final/manifest.json").read_text())
        assert (manifest["h"], manifest["steps"]) == (h, 2)  # matched steps: the curriculum's total
        metrics = json.loads((work / f"runs/babyai-fixed-h{h}/eval/metrics.json").read_text())
        assert list(metrics["checkpoints"]) == ["base", f"fixed-h{h}"]
        assert metrics["h"] == json.loads((work / "runs/babyai/eval/metrics.json").read_text())["h"]
    page = (work / "reports/babyai.html").read_text()
    assert '"fixed h=3"' in page and '"fixed h=6"' in page


def _experiments(work: Path) -> dict[str, dict]:
    """``dvc exp show --json``: {experiment name: its data (params, deps and outs with hashes)}, plus the
    baseline under ``"baseline"``."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    shown = json.loads(subprocess.run(["dvc", "exp", "show", "--json"], cwd=work, env=env, capture_output=True,
                                      text=True, check=True).stdout)
    baseline = next(row for row in shown if row["rev"] != "workspace")
    out = {"baseline": baseline["data"]}
    for group in baseline.get("experiments") or []:
        for rev in group["revs"]:
            out[rev["name"]] = rev["data"]
    return out


def _out_hash(data: dict, path: str) -> str:
    return data["outs"][path]["hash"]


@pytest.mark.slow
def test_dvc_experiments_rerun_what_a_setting_touches_with_its_value(tmp_path) -> None:
    """`dvc exp run -S` of a trainer key reruns the phases and not the base model; of model.seed, a new base
    model; of a curriculum key, a clear failure (and `scalinginter exp-run` regenerates the phases and reruns
    exactly them); a queued experiment runs its own snapshot's code; `dvc exp show` lists them all."""
    work = _workspace(tmp_path, one_step_phases=2)
    # the whole chain, so every output dvc.lock names is in the cache (applying an experiment checks them all out)
    _sh(work, "dvc", "repro", "babyai_report")
    _sh(work, "git", "add", "-A")
    _sh(work, "git", "commit", "-qm", "baseline")

    assert _ran(_sh(work, "dvc", "exp", "run", "--temp", "-n", "lr", "-S", "train.smoke.lr=2e-5",
                    "babyai_phase_1")) == ["babyai_phase_0", "babyai_gate_0", "babyai_phase_1"]
    assert _ran(_sh(work, "dvc", "exp", "run", "--temp", "-n", "seed1", "-S", "model.seed=1",
                    "build_model")) == ["build_model"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    refused = subprocess.run(["dvc", "exp", "run", "--temp", "-S", "curriculum.babyai.profiles.smoke.h1=3"],
                             cwd=work, env=env, capture_output=True, text=True)
    assert refused.returncode != 0 and "run `scalinginter pipeline`" in refused.stdout + refused.stderr
    # the curriculum through scalinginter exp-run: phase 0's h changes (2 -> 3), so phase 0 and 1 rerun
    ran = _ran(_sh(work, "scalinginter", "exp-run", "-S", "curriculum.babyai.profiles.smoke.h1=3", "--temp",
                   "-n", "h1", "babyai_phase_1"))
    assert ran in (["pipeline_check", "babyai_phase_0", "babyai_gate_0", "babyai_phase_1"],
                   ["babyai_phase_0", "babyai_gate_0", "babyai_phase_1"]), ran
    assert _sh(work, "git", "status", "--porcelain") == ""  # the working copy's files were restored

    # a queued experiment runs the code of its snapshot, not the installed checkout's
    splits = work / "envs" / "splits.py"
    code = splits.read_text()
    splits.write_text(code.replace("json.dumps(rows, indent=0)", "json.dumps(rows, indent=2)"))
    _sh(work, "dvc", "exp", "run", "--queue", "-n", "code", "splits@babyai")
    splits.write_text(code)
    _sh(work, "dvc", "queue", "start")
    deadline = time.monotonic() + 600
    while re.search(r"\b(Queued|Running)\b", _sh(work, "dvc", "queue", "status")):
        assert time.monotonic() < deadline, _sh(work, "dvc", "queue", "logs", "code")
        time.sleep(1)

    shown = _experiments(work)
    base = shown["baseline"]
    assert {"lr", "seed1", "h1", "code"} <= set(shown)
    assert shown["lr"]["params"]["params.yaml"]["data"]["train"]["smoke"]["lr"] == 2e-5
    assert "reward_mean" in shown["lr"]["metrics"]["runs/babyai/phase-1/summary.json"]["data"]  # and metrics
    assert _out_hash(shown["lr"], "runs/babyai/phase-1/final") != _out_hash(base, "runs/babyai/phase-1/final")
    assert _out_hash(shown["lr"], "models/tiny") == _out_hash(base, "models/tiny")
    assert shown["seed1"]["params"]["params.yaml"]["data"]["model"]["seed"] == 1
    assert _out_hash(shown["seed1"], "models/tiny") != _out_hash(base, "models/tiny")
    assert shown["h1"]["params"]["phases.yaml"]["data"]["babyai"]["phase_0"]["h"] == 3
    _sh(work, "dvc", "exp", "apply", "code")
    assert (work / "data/babyai/train.json").read_text().startswith('[\n  {\n    "item_id"')  # indent=2: its code


def test_a_stage_command_that_cannot_start_leaves_the_committed_splits(tmp_path) -> None:
    """`.venv/bin/dvc repro` outside the activated environment runs the stages' `python` from PATH, which may
    lack the project. The stage fails, naming itself, and the splits in git stay as they were: DVC deletes an
    output that is not persistent before running its command (the evaluation and the report are in the DVC
    cache, so `dvc checkout` brings them back)."""
    work = _workspace(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'typer'\" >&2\nexit 1\n")
    (bin_dir / "python").chmod(0o755)
    splits = {path: (work / path).read_bytes() for path in ("data/babyai/train.json", "data/babyai/test.json")}
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"}
    done = subprocess.run([str(Path(sys.executable).parent / "dvc"), "repro", "-f", "splits@babyai"], cwd=work,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "failed to reproduce 'splits@babyai'" in done.stderr, done.stderr
    assert {path: (work / path).read_bytes() for path in splits} == splits
    assert _sh(work, "git", "status", "--porcelain") == ""


def test_one_run_at_a_time_holds_a_working_copy(tmp_path) -> None:
    """Two flow runs in one working copy would share dvc.lock, the git index and the run folders: the second
    fails at once, naming the lock; another working copy is not held."""
    from flows.scalinginter_flow import working_copy_lock
    from training.settings.config import ConfigError

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from flows.scalinginter_flow import working_copy_lock\n"
                               f"with working_copy_lock(Path({str(tmp_path / 'a')!r})):\n"
                               "    print('held', flush=True); time.sleep(60)"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match="another scalinginter run holds the working copy"), \
                working_copy_lock(tmp_path / "a"):
            pass
        with working_copy_lock(tmp_path / "b"):  # a clone of its own runs side by side
            pass
    finally:
        holder.kill()
        holder.wait()
    with working_copy_lock(tmp_path / "a"):  # released when its holder died
        pass


def test_the_committed_lock_holds_the_splits_of_the_committed_code() -> None:
    """The stages whose outputs live in git (each environment's task splits) are up to date in the committed
    dvc.lock, so `dvc status` on a fresh clone does not list them: a change to their code or seed comes with its
    relocked entry (`dvc repro splits@<env>`, which rewrites the same splits when they do not change)."""
    dvc = Path(sys.executable).parent / "dvc"
    done = subprocess.run([str(dvc), "status", "splits", "--json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=True)
    stale = json.loads(done.stdout or "{}")
    assert stale == {}, f"dvc.lock is stale for {sorted(stale)}: run `dvc repro` on them and commit dvc.lock"


def _imported_files(start: Path) -> set[str]:
    """The project files ``start`` imports, transitively (every import statement, also those inside functions)."""
    import ast

    seen: set[str] = set()
    todo = [start]
    while todo:
        path = todo.pop()
        if str(path.relative_to(ROOT)) in seen:
            continue
        seen.add(str(path.relative_to(ROOT)))
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                     if isinstance(node, ast.ImportFrom) and node.module and not node.level
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            todo += [ROOT / f"{m.replace('.', '/')}.py" for m in names
                     if m.split(".")[0] in ("training", "envs") and (ROOT / f"{m.replace('.', '/')}.py").exists()]
    return seen


def test_the_evaluation_stage_depends_on_all_the_code_that_plays_its_episodes() -> None:
    """A change to any module a rollout runs (the episode loop, its instances, its trajectories, the engine
    interface, the environment clients) reruns the evaluation: each is a dependency of the eval stage in dvc.yaml."""
    from flows.dvc_pipeline import EVAL_CODE

    no_result = {"envs/files.py"}  # atomic file writes
    played = _imported_files(ROOT / "training/rollouts/rollout.py")
    covered = [c.rstrip("/") for c in EVAL_CODE]  # files, or folders (training/engines)
    missing = sorted(f for f in played - no_result if f.startswith("training/")
                     and not any(f == c or f.startswith(c + "/") for c in covered))
    assert not missing, f"add {missing} to flows.dvc_pipeline.EVAL_CODE"
    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["babyai_eval"]
    assert set(EVAL_CODE) <= set(stage["deps"])
    assert "training/settings/specs.py" in stage["deps"]  # EvalSpec.sampling(): how the settings become the sampling
    envs = {f for f in played if f.startswith("envs/") and f not in no_result}
    assert envs <= set(stage["deps"]), sorted(envs - set(stage["deps"]))

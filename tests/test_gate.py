"""Promotion gates (training/evaluation/gate.py): a phase hands its checkpoint on only if it is not worse than its
parent.

The integration tests run, each in a working copy of its own, a multi-turn BabyAI phase (turn cap 4) whose
parent acts and which a learning rate far too high wrecks (rejected, the curriculum stopped, the parent handed
back), and a three-phase bandit curriculum from the 50/50 SFT warm start (conftest): a phase at a sound learning
rate is promoted; a phase at a learning rate far too high wrecks the policy and is rejected, then retried or the
curriculum stopped, as configured; the lineage shows it; a killed gate resumes without sampling again; the margin
moves the decision record, not what the next phase depends on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from flows.dvc_pipeline import render
from flows.export import export_phase, export_result
from training.evaluation.gate import decide, paired_interval, run_gate, run_result
from training.evaluation.lineage import lineage
from training.settings.config import ConfigError, GateConfig, load_params
from training.settings.layout import Run
from training.settings.specs import phase_spec

ROOT = Path(__file__).resolve().parents[1]


def test_paired_interval_resamples_items_then_samples() -> None:
    before = np.zeros((40, 4))
    after = np.zeros((40, 4))
    after[:10] = 1.0  # a quarter of the items always succeed after
    diff, low, high = paired_interval(before, after)
    assert diff == pytest.approx(0.25) and 0.1 < low < 0.25 < high < 0.45
    assert paired_interval(before, before) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="items x samples"):
        paired_interval(np.zeros(3), np.zeros(3))


@pytest.mark.parametrize(("drop", "rule", "passed"), [
    (0.0, "point", True), (0.025, "point", True), (0.2, "point", False),
    (0.075, "point", False), (0.075, "interval", True), (0.5, "interval", False)])
def test_decide_by_margin_and_rule(drop: float, rule: str, passed: bool) -> None:
    before = np.zeros((80, 4))
    before[:48] = 1.0  # 60% of the items succeed before
    after = before.copy()
    after[: round(drop * 80)] = 0.0  # and this share of them fails after
    verdict = decide(before, after, GateConfig(margin=0.05, rule=rule))
    assert verdict["passed"] is passed, verdict
    assert verdict["diff"] == pytest.approx(-drop) and verdict["ci95"][0] <= verdict["diff"] <= verdict["ci95"][1]


def _bandit_workspace(tmp_path: Path, warm: Path, on_reject: str, lrs: list[float]) -> Path:
    """A working copy holding a bandit curriculum of len(lrs) one-turn phases of 3 steps (phase k trained at lrs[k];
    params.yaml's learning rate, which a retry lowers, is the highest of them)."""
    root = tmp_path / "repo"
    (root / "data" / "bandit").mkdir(parents=True)
    for split in ("train", "test", "gate"):
        shutil.copy(ROOT / "data" / "bandit" / f"{split}.json", root / "data" / "bandit")
    shutil.copytree(warm, root / "models" / "tiny")
    if (warm.parent / f"{warm.name}-state").is_dir():  # its trainer state, beside it
        shutil.copytree(warm.parent / f"{warm.name}-state", root / "models" / "tiny-state")
    params = load_params(ROOT / "params.yaml")
    params["pipeline"]["envs"] = ["bandit"]
    params["curriculum"]["profile"] = "smoke"
    params["curriculum"]["bandit"] = {"cap": 1, "fixed_baselines": [1], "profiles": {
        "smoke": {"schedule": [[1, 3]] * len(lrs), "total_steps": 3 * len(lrs)}}}
    params["train"]["smoke"]["envs"]["bandit"] = {
        "batch_items": 4, "n_samples": 4, "max_new_tokens": 16, "kl_coef": 0.0, "skip_flat_steps": True,
        "mini_batch_size": 16, "micro_batch_size": 16, "log_rollouts": False, "lr": max(lrs), "save_every": 1,
        "guard": {"enabled": False}}
    params["eval"]["smoke"]["envs"] = {"bandit": {"k": 4, "temperature": 1.0, "max_new_tokens": 16, "h": 1}}
    params["gate"]["smoke"] |= {"items": 16, "margin": 0.1, "rule": "point", "on_reject": on_reject, "lr_factor": 0.01}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / "phases.yaml").write_text(render(params)[0])
    return root


def _phase(root: Path, index: int, lr: float, url: str, env: str = "bandit") -> None:
    from training.phases.phase import run_phase

    spec = phase_spec(env, index, root)
    spec = spec.model_copy(update={"train": spec.train.model_copy(update={"lr": lr})})
    run_phase(spec, url)


@pytest.mark.slow
def test_a_wrecked_phase_is_rejected_and_retried_and_a_sound_one_promoted(bandit_warm_start, env_server, tmp_path,
                                                                         monkeypatch) -> None:
    url = env_server("bandit")
    root = _bandit_workspace(tmp_path, bandit_warm_start, "retry", [3e-4, 0.05])
    monkeypatch.chdir(root)
    run = Run("bandit", root=root)
    _phase(root, 0, 3e-4, url)
    first = run_gate("bandit", 0, url=url, root=root)
    # measured: 57.8% -> 79.7% (+21.9 points, 95% CI +10.9 to +35.9) on 16 gate items x 4 samples
    assert first["decision"] == "promoted" and first["diff"] > 0 and first["episodes_sampled"] == 2 * 16 * 4
    assert phase_spec("bandit", 1, root).init == root / "runs/bandit/phase-0/final"
    _phase(root, 1, 0.05, url)  # far too high: the policy stops naming a door
    second = run_gate("bandit", 1, url=url, root=root)
    assert not second["passed"] and second["diff"] < -0.3, second
    assert [r["retry"] for r in second["retries"]] == [1] and second["retries"][0]["lr"] == pytest.approx(5e-4)
    retry = second["retries"][0]
    # it started from the best on the gate items of the parent and phase 1's kept intra-phase checkpoints, each
    # scored and recorded (a phase pulled from the remote has none: the record then says {})
    scored = retry["intermediate_scored"]
    assert scored and all(name.startswith("runs/bandit/phase-1/intermediate/step-") for name in scored), retry
    assert retry["start_score"] == pytest.approx(max([second["parent"], *scored.values()]))
    # measured: phase 1 falls to 0%, its retry (from phase 0's checkpoint) reaches 92.2% and is promoted
    assert second["decision"] == ("retry-1" if retry["passed"] else "parent")
    assert json.loads(run.promotion(1).read_text())["checkpoint"] == (
        "runs/bandit/gate-1/retries/retry-1/final" if retry["passed"] else "runs/bandit/phase-0/final")
    result = run_result("bandit", root)
    assert result["checkpoint"] != "runs/bandit/phase-1/final"  # never the rejected checkpoint
    # a killed gate resumes: every evaluation it made is kept, so a rerun samples nothing (no server needed)
    for name in ("promotion.json", "decision.json", "summary.json"):
        (run.gate(1) / name).unlink()
    again = run_gate("bandit", 1, url="http://127.0.0.1:9", root=root)
    assert again["episodes_sampled"] == 0 and again["decision"] == second["decision"]
    # the margin moves the decision record only: promotion.json (the next phase's dependency) stays byte for byte
    promotion = run.promotion(0).read_bytes()
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["gate"]["smoke"]["margin"] = 0.2
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    wider = run_gate("bandit", 0, url="http://127.0.0.1:9", root=root)
    assert wider["margin"] == 0.2 and run.promotion(0).read_bytes() == promotion


def test_a_retry_on_several_ranks_runs_the_phase_stages_command_with_the_same_spec(tiny_model_dir, tmp_path,
                                                                                    monkeypatch) -> None:
    """Where the pool trains on several ranks (SCALINGINTER_NPROC, or nodes), a gate's retry is trained as its
    phase stage is: ``train-phase`` relaunched under torchrun, not in the gate's single process; the command
    builds the very spec the in-process retry trains (the same door); on one rank it stays in process."""
    import subprocess as subprocess_module

    from typer.testing import CliRunner

    import training.phases.phase as phase_module
    from flows.cli import app
    from training.evaluation.gate import _retry

    root = _bandit_workspace(tmp_path, tiny_model_dir, "retry", [3e-4])
    monkeypatch.chdir(root)
    spec = phase_spec("bandit", 0, root)
    start, out, url = root / "models" / "tiny", root / "runs/bandit/gate-0/retries/retry-1", "http://127.0.0.1:9"
    expected = spec.model_copy(update={"init": start, "out": out, "train": spec.train.model_copy(update={"lr": 3e-5})})
    calls: list[list[str]] = []
    def call(cmd: list[str], cwd: Path, env: dict[str, str]) -> int:  # in the run's copy, the servers by variable
        calls.append(cmd)
        return int((cwd, env["SCALINGINTER_ROOT"], env["SCALINGINTER_ENV_URL"]) != (root, str(root), url))

    monkeypatch.setattr(subprocess_module, "call", call)
    seen: list = []
    monkeypatch.setattr(phase_module, "run_phase", lambda s, u, **kw: seen.append((s, u)) or s.out / "final")
    monkeypatch.setenv("SCALINGINTER_NPROC", "2")
    assert _retry(spec, start, out, 3e-5, url, None, root) == out / "final" and not seen  # (exit 0: in root)
    (cmd,) = calls
    assert cmd[1:4] == ["-m", "flows.cli", "train-phase"] and url not in cmd  # (announced to other nodes as is)
    assert cmd[cmd.index("--init") + 1] == "models/tiny" and not cmd[cmd.index("--out") + 1].startswith("/")
    monkeypatch.delenv("SCALINGINTER_NPROC")  # (the relaunched ranks' own view: run the command's spec here)
    monkeypatch.setenv("SCALINGINTER_ROOT", str(root))
    result = CliRunner().invoke(app, cmd[3:], env={"SCALINGINTER_ENV_URL": url})
    assert result.exit_code == 0, result.output
    ((built, given),) = seen  # its paths relative to the copy it runs in
    assert built.model_copy(update={"init": root / built.init, "out": root / built.out}) == expected and given == url
    assert _retry(spec, start, out, 3e-5, url, None, root) == out / "final" and seen[-1] == (expected, url)  # 1 rank
    assert len(calls) == 1


@pytest.mark.slow
def test_a_wrecked_multi_turn_phase_is_rejected_and_the_run_hands_back_its_parent(tiny_model_dir, env_server,
                                                                                  tmp_path, monkeypatch) -> None:
    """The gate on BabyAI GoTo at a turn cap of 4: a parent that acts over several turns (the tiny model taught
    the sighted expert's episodes of the gate items themselves, a test device standing for a good model: no
    claim is made on held-out items) against a phase trained at a learning rate far too high. The phase is
    rejected, the curriculum stops, and the run hands back the parent, never the wrecked phase."""
    from training.evaluation.gate import GateRun
    from training.warmstart.sft import SFTConfig, expert_episodes, sft

    url = env_server("babyai")
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "data" / "babyai", root / "data" / "babyai")
    params = load_params(ROOT / "params.yaml")
    params["pipeline"]["envs"] = ["babyai"]
    params["curriculum"]["profile"] = "smoke"
    params["curriculum"]["babyai"]["profiles"]["smoke"] = {"schedule": [[4, 3]], "total_steps": 3}
    params["train"]["smoke"]["envs"]["babyai"] = {
        "batch_items": 4, "n_samples": 4, "max_new_tokens": 24, "kl_coef": 0.0, "lr": 0.05, "save_every": 1,
        "log_rollouts": False, "guard": {"enabled": False}}
    params["eval"]["smoke"]["envs"] = {"babyai": {"k": 8, "temperature": 1.0, "max_new_tokens": 24, "h": 4,
                                                  "sub_tasks": ["GoTo"], "batch_items": 8}}
    params["gate"]["smoke"] |= {"items": 6, "margin": 0.1, "rule": "point", "on_reject": "stop"}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / "phases.yaml").write_text(render(params)[0])
    monkeypatch.chdir(root)
    items = GateRun("babyai", 0, root, url, None, lambda: 8).items
    episodes = expert_episodes("babyai", items, max_turns=4, expert="sighted")
    assert max(sum(m["role"] == "assistant" for m in conv) for conv in episodes.values()) > 1  # several turns
    # measured: the parent solves 43.8% of the 6 items x 8 samples; the phase 0% (-43.8 points, CI -64.6 to -22.9)
    sft(tiny_model_dir, root / "models" / "tiny", list(episodes.values()), SFTConfig(epochs=20, lr=2e-3, batch_size=2))
    _phase(root, 0, 0.05, url, env="babyai")
    gate = run_gate("babyai", 0, url=url, root=root)
    assert gate["h"] == 4 and gate["episodes_sampled"] == 2 * 6 * 8
    assert gate["parent"] > 0.1, gate  # the parent acts; the wrecked phase falls past the margin
    assert not gate["passed"] and gate["diff"] < -0.1 and gate["decision"] == "stopped", gate
    assert gate["checkpoint"] == gate["parent_checkpoint"] == "models/tiny"
    assert run_result("babyai", root)["checkpoint"] == "models/tiny"  # never runs/babyai/phase-0/final
    assert json.loads(Run("babyai", root=root).promotion(0).read_text())["checkpoint"] == "models/tiny"


@pytest.mark.slow
def test_the_mixed_runs_gate_pools_each_environments_gate_items_at_its_own_cap(bandit_warm_start, env_server,
                                                                              tmp_path, monkeypatch) -> None:
    """The mixed run's gate (mixed.envs: the bandit and TextCraft): each environment's gate items on its own server
    at the run's h clipped to its cap, pooled; a phase that wrecks the bandit is rejected on the pool and the run
    hands back its parent."""
    url = {e: env_server(e) for e in ("bandit", "textcraft")}
    root = _bandit_workspace(tmp_path, bandit_warm_start, "stop", [0.05])
    shutil.copytree(ROOT / "data" / "textcraft", root / "data" / "textcraft")
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["mixed"] = {"envs": ["bandit", "textcraft"]}
    params["pipeline"]["envs"] = ["mixed"]
    params["curriculum"]["mixed"] = {"cap": 2, "profiles": {"smoke": {"schedule": [[2, 3]], "total_steps": 3}}}
    params["train"]["smoke"]["envs"]["mixed"] = params["train"]["smoke"]["envs"]["bandit"] | {
        "max_new_tokens": 12, "mix": {"bandit": {"max_h": 1}, "textcraft": {"max_h": 2}}}
    params["eval"]["smoke"]["envs"] = {"mixed": params["eval"]["smoke"]["envs"]["bandit"] | {"h": 2}}
    params["gate"]["smoke"]["envs"]["mixed"] = {"enabled": True}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / "phases.yaml").write_text(render(params)[0])
    stages = yaml.safe_load(render(params)[1])["stages"]
    assert {"data/bandit/gate.json", "data/textcraft/gate.json"} <= set(stages["mixed_gate_0"]["deps"])
    monkeypatch.chdir(root)
    servers = ";".join(f"{e}={u}" for e, u in url.items())
    _phase(root, 0, 0.05, servers, env="mixed")
    gate = run_gate("mixed", 0, url=servers, root=root)
    assert gate["caps"] == {"bandit": 1, "textcraft": 2} and gate["items"] == 2 * 16
    assert gate["episodes_sampled"] == 2 * 32 * 4
    record = json.loads(next(p for p in (Run("mixed", root=root).gate(0) / "evals").glob("*.json")
                             if p.name != "index.json").read_text())
    assert len(record["success"]) == 32  # the pooled items, bandit's first
    assert gate["parent"] > 0.1 and gate["decision"] == "stopped", gate  # the bandit's half of the parent's wins
    assert run_result("mixed", root)["checkpoint"] == "models/tiny"


@pytest.mark.slow
def test_stop_promotes_the_parent_and_later_phases_train_nothing(bandit_warm_start, env_server, tmp_path,
                                                                 monkeypatch) -> None:
    url = env_server("bandit")
    root = _bandit_workspace(tmp_path, bandit_warm_start, "stop", [3e-4, 0.05, 3e-4])
    monkeypatch.chdir(root)
    run = Run("bandit", root=root)
    _phase(root, 0, 3e-4, url)
    run_gate("bandit", 0, url=url, root=root)
    _phase(root, 1, 0.05, url)
    stopped = run_gate("bandit", 1, url=url, root=root)
    assert stopped["decision"] == "stopped" and stopped["checkpoint"] == "runs/bandit/phase-0/final"
    assert stopped["episodes_sampled"] == 16 * 4  # the parent's scores come from gate 0, which sampled them
    spec = phase_spec("bandit", 2, root)
    assert spec.stopped and spec.init == root / "runs/bandit/phase-0/final"
    _phase(root, 2, 3e-4, url)  # trains nothing: passes the promoted checkpoint on
    assert (run.final(2) / "model.safetensors").read_bytes() == (run.final(0) / "model.safetensors").read_bytes()
    assert json.loads(run.summary(2).read_text())["stopped"] == 1
    assert run_gate("bandit", 2, url="http://127.0.0.1:9", root=root)["decision"] == "passed-on"
    assert run_result("bandit", root)["checkpoint"] == "runs/bandit/phase-0/final"
    # the export hands on the promoted checkpoint, and refuses the rejected one
    path, what = export_result("bandit", tmp_path / "export", root)
    assert what == "phase 0 (stopped)" and "## Promotion" in (path / "README.md").read_text()  # by gate 1
    assert (path / "model.safetensors").read_bytes() == (run.final(0) / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="rejected by its promotion gate"):
        export_phase("bandit", 1, tmp_path / "rejected", root)
    # the lineage tells it: each gate's decision, and the chain of parents through what the gates promoted
    stages = {f"bandit_{kind}_{k}": {"params": {"phases.yaml": {f"bandit.phase_{k}": {"h": 1, "steps": 3,
                                                                                    "algorithm": "grpo"}}}}
              for k in range(3) for kind in ("phase", "gate")}
    (root / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": stages}))
    records, problems, _ = lineage("bandit", root)
    assert problems == []
    rows = {r.stage: r for r in records}
    assert rows["bandit_gate_1"].trained.startswith("stopped:")
    assert rows["bandit_phase_2"].trained.startswith("nothing: the curriculum stopped")
    assert rows["bandit_gate_0"].trained.startswith("promoted:")


def test_gate_stages_carry_their_params_and_the_next_phase_depends_on_the_promotion_only() -> None:
    params = load_params(ROOT / "params.yaml")
    params["pipeline"]["envs"] = ["babyai"]
    stages = yaml.safe_load(render(params)[1])["stages"]
    gate = stages["babyai_gate_0"]
    assert "gate.smoke" in gate["params"] and "runs/babyai/phase-0/final" in gate["deps"]
    assert "runs/babyai/gate-0/promotion.json" in gate["outs"]
    later = stages["babyai_phase_1"]
    assert "runs/babyai/gate-0/promotion.json" in later["deps"] and "gate.smoke" not in later["params"]
    assert "--init runs/babyai/gate-0/promotion.json" in later["cmd"]
    assert not any("gate-0/decision.json" in str(d) for d in later["deps"])
    params["gate"]["smoke"]["enabled"] = False
    ungated = yaml.safe_load(render(params)[1])["stages"]
    assert "babyai_gate_0" not in ungated and "runs/babyai/phase-0/final" in ungated["babyai_phase_1"]["deps"]


def test_the_gate_and_the_evaluation_stage_sample_through_one_spec(tmp_path, monkeypatch) -> None:
    """One door: the promotion gate and the evaluation stage call the sampler with the same arguments, built once
    by ``training.settings.specs.eval_spec`` from the same settings (here an eval section that sets k, temperature and
    seed and leaves the context budget to training's), and differ only in their items."""
    import training.evaluation.eval_stage as eval_stage
    import training.evaluation.evaluate as evaluate_module
    from training.evaluation.gate import GateRun
    from training.settings.config import parse_params
    from training.settings.specs import eval_spec

    root = tmp_path / "work"
    shutil.copytree(Path(__file__).resolve().parent.parent / "data", root / "data")
    params = load_params()
    params["eval"]["smoke"].update(k=3, temperature=0.7, seed=11, context_budget=None)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    params = parse_params((root / "params.yaml").read_text())
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    calls: dict[str, dict] = {}

    class Sampled(Exception):
        pass

    def fake_evaluate(model_dir, env, url, item_ids, **kwargs):
        calls["gate"] = kwargs
        raise Sampled

    def fake_checkpoints(folders, env, url, items, **kwargs):
        calls["eval"] = kwargs
        raise Sampled

    monkeypatch.setattr(evaluate_module, "evaluate", fake_evaluate)
    monkeypatch.setattr(eval_stage, "evaluate_checkpoints", fake_checkpoints)
    monkeypatch.setattr(eval_stage, "server_capacity", lambda url: None)
    spec = eval_spec("babyai", params)
    gate = GateRun("babyai", 0, root, "http://127.0.0.1:9", None, lambda: spec.config.batch_items)
    with pytest.raises(Sampled):
        gate.outcomes(checkpoint)
    with pytest.raises(Sampled):
        eval_stage._run_single_eval("babyai", params, spec, "http://127.0.0.1:9", {"base": checkpoint}, None)
    for call in calls.values():
        call.pop("progress", None)
    assert calls["gate"] == calls["eval"] == {"batch_items": spec.config.batch_items, "policy_url": None,
                                              **spec.sampling()}
    assert spec.sampling()["k"] == 3 and spec.sampling()["temperature"] == 0.7 and spec.sampling()["seed"] == 11
    train_budget = params["train"]["smoke"].get("context_budget", 2048)
    assert spec.sampling()["context_budget"] == train_budget  # eval's None: training's budget
    from training.settings.config import EvalConfig
    from training.settings.specs import EvalSpec
    with pytest.raises(ValueError, match="context_budget is unresolved: read the settings with eval_config"):
        EvalConfig().budget  # noqa: B018 (a spec built by hand, past the door, is refused with the door to use)
    with pytest.raises(ValueError, match="context_budget is unresolved"):
        EvalSpec(config=EvalConfig(), h=spec.h, policy_server=spec.policy_server)
    assert gate.spec == spec
    # gate.cap: phase samples at the phase's own turn cap, everything else as before; the default, final, ignores it
    assert GateRun("babyai", 0, root, "u", None, lambda: 1, phase_h=2).spec.h == spec.h != 2
    params["gate"]["smoke"]["cap"] = "phase"
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    at_phase = GateRun("babyai", 0, root, "u", None, lambda: 1, phase_h=2)
    assert at_phase.spec.h == at_phase.settings()["h"] == 2
    assert at_phase.spec.sampling() == {**spec.sampling(), "h": 2}


@pytest.mark.parametrize(("caps", "handed_back"), [((6, 6, 6), 0), ((2, 4, 6), 2)])
def test_the_run_hands_back_the_best_promotion_among_gates_scored_at_one_cap(tmp_path, caps, handed_back) -> None:
    """``run_result`` compares gate scores only where they were sampled at the same turn cap: with ``cap: final``
    (every gate at the evaluation's cap) the best promoted checkpoint; with ``cap: phase`` at growing caps, scores
    at h = 2 and h = 6 do not compare, and the last promotion is handed back (not gate 0's higher score at h = 2)."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")  # the smoke curriculum: three phases, gated
    run = Run("babyai", root=tmp_path)
    for index, (h, score) in enumerate(zip(caps, (0.9, 0.5, 0.3), strict=True)):
        run.gate_record(index).parent.mkdir(parents=True)
        run.gate_record(index).write_text(json.dumps({
            "decision": "promoted", "checkpoint": f"runs/babyai/phase-{index}/final", "retries": [],
            "phase_checkpoint": f"runs/babyai/phase-{index}/final", "candidate": score, "parent": 0.1, "h": h}))
    result = run_result("babyai", tmp_path)
    assert result == {"checkpoint": f"runs/babyai/phase-{handed_back}/final", "gate": handed_back,
                      "score": (0.9, 0.5, 0.3)[handed_back], "decision": "promoted"}

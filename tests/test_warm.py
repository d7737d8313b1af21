"""Phase types (issue 21): SFT, RFT and DPO stages before the RL phases, declared in params.yaml, each a DVC stage
from the last one's checkpoint, in the lineage and the evaluation, on BabyAI with the tiny policy."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import ValidationError

from flows.dvc_pipeline import BASE, render
from training.checkpoint import read_manifest
from training.placement.devices import DeviceError
from training.settings.config import ConfigError, curriculum_config, load_params
from training.settings.warm import RFTStage, checkpoint_of, parse_stage
from training.warmstart.methods import run_warm_stage

#: SFT on 4 items the expert solves in two turns, then two rounds of rejection sampling and DPO on the same items
#: (the tiny policy replays what it learnt well enough that some of its samples succeed and some fail: measured
#: 14 and 10 of 16 in the two rounds, 6 DPO pairs; 8 items gave 11 and 12 of 32 and 6 pairs in 1.7x the time, and
#: 16 epochs of SFT on 8 left 1 of 32, which other library releases turned into none here). Replies take up to 27
#: tokens here ("pickup green key 1"), so 40 new tokens, never a cut reply.
WARM = [{"method": "sft", "items": 4, "max_turns": 2, "epochs": 40, "batch_size": 2, "lr": 3.0e-3},
        {"method": "rft", "items": 4, "max_turns": 2, "rounds": 2, "k": 4, "h": 2, "epochs": 2, "max_new_tokens": 40},
        {"method": "dpo", "items": 4, "max_turns": 2, "k": 4, "h": 2, "epochs": 2, "max_new_tokens": 40}]


def _params(warm: list[dict], env: str = "babyai") -> dict:
    params = load_params()
    params["pipeline"]["envs"] = [env]
    params["curriculum"][env]["profiles"]["smoke"]["warm_start"] = warm
    params["pipeline"]["baselines"] = True
    return params


def test_warm_start_stages_chain_before_the_first_phase_and_the_baselines() -> None:
    phases_text, dvc_text = render(_params(WARM))
    rows = yaml.safe_load(phases_text)["babyai"]
    assert list(rows)[:5] == ["warm_0", "warm_1", "warm_2", "warm_3", "phase_0"]
    # every setting is a param of its stage; an RFT run of two rounds is two stages, each one round
    assert [(rows[f"warm_{k}"]["method"], rows[f"warm_{k}"].get("round")) for k in range(4)] == \
        [("sft", None), ("rft", 0), ("rft", 1), ("dpo", None)]
    assert rows["warm_1"]["rounds"] == rows["warm_2"]["rounds"] == 1 and rows["warm_1"]["k"] == 4
    stages = yaml.safe_load(dvc_text)["stages"]
    assert f"--index 0 --init {BASE} --out runs/babyai/warm-0" in stages["babyai_warm_0"]["cmd"]
    assert "--init runs/babyai/warm-0/final" in stages["babyai_warm_1"]["cmd"]
    assert "runs/babyai/warm-0" in stages["babyai_warm_1"]["deps"]
    assert "--init runs/babyai/warm-1/round-0" in stages["babyai_warm_2"]["cmd"]  # the round before
    assert "--init runs/babyai/warm-2/round-1" in stages["babyai_warm_3"]["cmd"]
    assert stages["babyai_warm_3"]["params"] == [{"phases.yaml": ["babyai.warm_3"]}]
    for stage in ("babyai_phase_0", "babyai_fixed_h6"):  # the curriculum and its baselines start from the same place
        assert "--init runs/babyai/warm-3/final" in stages[stage]["cmd"], stages[stage]["cmd"]
        assert "runs/babyai/warm-3" in stages[stage]["deps"] and BASE not in stages[stage]["deps"]
    assert "runs/babyai/warm-3" in stages["babyai_eval"]["deps"]
    # without a warm start the pipeline is what it was: phase 0 from the base model
    plain = yaml.safe_load(render(_params([]))[1])["stages"]
    assert not any("warm" in name for name in plain) and f"--init {BASE} " in plain["babyai_phase_0"]["cmd"]


def test_a_bad_warm_start_names_the_key_and_the_mixed_run_has_none() -> None:
    with pytest.raises(ConfigError, match=r"curriculum\.babyai\.profiles\.smoke(.|\n)*warm_start"):
        curriculum_config("babyai", "smoke", _params([{"method": "ppo"}]))
    with pytest.raises(ConfigError, match="beta"):
        curriculum_config("babyai", "smoke", _params([{"method": "dpo", "beta": -1}]))
    with pytest.raises(ConfigError, match="mixed run has no warm start"):
        render(_params([{"method": "sft"}], env="mixed"))
    stage = parse_stage({"method": "rft", "rounds": 3})
    assert isinstance(stage, RFTStage) and checkpoint_of(Path("w"), stage) == Path("w/round-2")
    # what chooses expert episodes beside recorded ones would be ignored: an error naming it
    for chosen in ({"sub_tasks": ["GoTo"]}, {"max_turns": 2}, {"items": 8}, {"split": "warm"}, {"expert": "sighted"}):
        with pytest.raises(ValidationError, match=f"{next(iter(chosen))} choose expert episodes"):
            parse_stage({"method": "sft", "recorded": ["runs/babyai/phase-0/rollouts"], **chosen})
    recorded = parse_stage({"method": "sft", "recorded": ["runs/babyai/phase-0/rollouts"]})
    assert parse_stage(recorded.model_dump(mode="json", exclude_none=True)) == recorded  # phases.yaml's row


def test_a_warm_stage_goes_where_the_work_pool_places_it(monkeypatch, tmp_path) -> None:
    """SCALINGINTER_DEVICE reaches the warm-start stages as it does the phases and the evaluation: a device that
    is not here is an error before any work (the stages trained on the CPU whatever the pool said)."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    monkeypatch.setenv("SCALINGINTER_DEVICE", "cuda:0")
    for row in ({"method": "sft", "items": 1}, {"method": "dpo", "items": 1}):
        with pytest.raises(DeviceError, match="'cuda:0' requested but CUDA is not available"):
            run_warm_stage("babyai", 0, parse_stage(row), tmp_path / "no-model", tmp_path / "warm",
                           url="http://127.0.0.1:9")
    assert not (tmp_path / "warm").exists()


@pytest.mark.slow
def test_sft_rft_dpo_then_grpo_run_as_stages_with_one_lineage(tmp_path) -> None:
    """The flow runs SFT -> RFT -> DPO -> a GRPO phase on BabyAI, each from the last one's checkpoint; the lineage
    agrees with dvc.lock, the evaluation covers every checkpoint, and a changed DPO setting reruns DPO and what
    follows it, never SFT nor RFT."""
    from flows.dvc_pipeline import set_params
    from tests.test_pipeline import _ran, _sh, _workspace
    from training.evaluation.lineage import lineage

    work = _workspace(tmp_path, one_step_phases=1)
    set_params({"curriculum.babyai.profiles.smoke.warm_start": WARM}, work)
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect"), "COLUMNS": "200"}
    done = subprocess.run([str(bin_dir / "scalinginter"), "run", "--env", "babyai", "--profile", "smoke", "--record",
                           "none"], cwd=work, env=env, capture_output=True, text=True, timeout=1200)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "babyai_warm_3: trained" in out and "done: 4 warm-start stages, 1 phases" in out, out[-3000:]

    records, problems, _ = lineage("babyai", work)
    assert problems == []
    assert [(r.stage, r.algorithm) for r in records] == [("babyai_warm_0", "sft"), ("babyai_warm_1", "rft"),
                                                          ("babyai_warm_2", "rft"), ("babyai_warm_3", "dpo"),
                                                          ("babyai_phase_0", "grpo"), ("babyai_gate_0", "gate")]
    assert all(after.parent == before.own for before, after in itertools.pairwise(records))
    assert "round 0: kept" in records[1].trained and "round 1: kept" in records[2].trained
    assert "pairs" in records[3].trained
    # what each stage trained on is in the store beside its checkpoint
    expert = [json.loads(line) for line in (work / "runs/babyai/warm-0/episodes.jsonl").open()]
    assert len(expert) == WARM[0]["items"] and all(e["source"] == "expert" for e in expert)
    assert all(e["input_ids"] and e["assistant_spans"] and e["tokenizer"] for e in expert)  # the store's token ids
    rft_round = read_manifest(work / "runs/babyai/warm-2/round-1")
    assert rft_round["recorded_token_ids"] == rft_round["kept"] > 0  # RFT trained on the very tokens it sampled
    assert (work / "runs/babyai/warm-1/round-0.jsonl").exists()
    assert (work / "runs/babyai/warm-2/round-1.jsonl").exists()
    assert (work / "runs/babyai/warm-3/final.pairs.jsonl").exists()
    evaluated = json.loads((work / "runs/babyai/eval/metrics.json").read_text())["checkpoints"]
    assert list(evaluated) == ["base", "warm-0-sft", "warm-1-rft", "warm-2-rft", "warm-3-dpo", "phase-0"]

    # a changed DPO setting: DPO and the phase after it are stale, SFT and RFT are not
    set_params({"curriculum.babyai.profiles.smoke.warm_start": [*WARM[:2], {**WARM[2], "beta": 0.2}]}, work)
    _sh(work, "scalinginter", "pipeline")
    status = _sh(work, "dvc", "status", "babyai_phase_0", "--with-deps")
    assert "babyai_warm_3" in status and not any(f"babyai_warm_{k}" in status for k in range(3))
    broken = records[3].own
    assert _ran(_sh(work, "dvc", "repro", "babyai_phase_0")) == ["babyai_warm_3", "babyai_phase_0"]
    records, problems, _ = lineage("babyai", work)
    assert problems == [] and records[3].own != broken and records[4].parent == records[3].own


def test_sft_batches_by_length_pad_less_and_see_every_episode_once_an_epoch() -> None:
    import random

    from training.warmstart.sft import epoch_batches

    draw = random.Random(7)
    lengths = [draw.randrange(100, 2000) for _ in range(203)]
    plain = epoch_batches(lengths, 8, random.Random(3))
    order = list(range(203))
    random.Random(3).shuffle(order)
    assert plain == [order[s:s + 8] for s in range(0, 203, 8)]  # off: the shuffle-and-cut of before, unchanged

    def padded(batches: list[list[int]]) -> int:
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)

    grouped = epoch_batches(lengths, 8, random.Random(3), group_by_length=True)
    assert sorted(i for b in grouped for i in b) == list(range(203)) and max(len(b) for b in grouped) == 8
    assert padded(grouped) < 0.8 * padded(plain)
    assert grouped != epoch_batches(lengths, 8, random.Random(4), group_by_length=True)  # shuffled each epoch


def test_the_main_jobs_warm_start_learns_from_the_warm_split_never_from_an_evaluated_item(tiny_model_dir,
                                                                                          tmp_path) -> None:
    """`make run` (BabyAI, smoke) starts with SFT on expert episodes of the warm split's GoTo items: a stage of its
    own, hanging on data/babyai/warm.json, whose items no split, gate or evaluation holds."""
    from envs.splits import load_split

    stages = yaml.safe_load(render(load_params())[1])["stages"]
    assert "data/babyai/warm.json" in stages["babyai_warm_0"]["deps"]
    assert "data/babyai/train.json" not in stages["babyai_warm_0"]["deps"]
    assert "--init runs/babyai/warm-0/final" in stages["babyai_phase_0"]["cmd"]
    warm = {r["item_id"] for r in load_split("babyai", "warm")}
    held = {r["item_id"] for split in ("train", "test", "gate") for r in load_split("babyai", split)}
    assert len(warm) == 4000 and not warm & held
    row = curriculum_config("babyai", "smoke").warm_start[0]
    assert (row.split, row.sub_tasks, row.expert, row.max_turns) == ("warm", ["GoTo"], "sighted", 4)
    # the stage itself, at a tenth of a second's scale: 2 such items, one epoch
    small = parse_stage({**row.model_dump(), "items": 2, "epochs": 1})
    final = run_warm_stage("babyai", 0, small, tiny_model_dir, tmp_path / "warm")
    lines = [json.loads(line) for line in (tmp_path / "warm" / "episodes.jsonl").read_text().splitlines()]
    goto = {r["item_id"] for r in load_split("babyai", "warm") if r["sub_task"] == "GoTo"}
    assert len(lines) == 2 and {x["item_id"] for x in lines} <= goto
    manifest = read_manifest(final)
    assert manifest["warm_start"]["split"] == "warm" and 0 <= manifest["padded_share"] < 1
    with pytest.raises(ValueError, match="the sciworld warm split has only 0 items"):
        run_warm_stage("sciworld", 0, parse_stage({"method": "sft", "split": "warm", "items": 1, "max_turns": 4}),
                       tiny_model_dir, tmp_path / "none")


def test_every_door_of_a_warm_stage_makes_the_same_call(monkeypatch) -> None:
    """One door per stage kind: the warm-start stage's command (what its DVC stage runs), the Prefect task and the
    ``sft`` command given the stage's settings (options, then ``--set``) all call ``run_warm_stage`` with the same
    stage settings, start and device; a setting the stage does not have is refused by name."""
    from typer.testing import CliRunner

    import tasks.pipeline
    import training.warmstart.methods as methods
    from flows.cli import app
    from training.placement.devices import placement
    from training.settings.specs import warm_spec

    calls: list[tuple] = []

    class Called(Exception):
        pass

    def record(env, index, stage, init, out, url=None, server=None, progress=False, device=None):
        calls.append((env, index, stage, Path(init).resolve(), device or placement()))
        raise Called

    monkeypatch.setattr(methods, "run_warm_stage", record)
    monkeypatch.setattr(tasks.pipeline, "run_stage", lambda root, stage, url, work, **kw: work())
    monkeypatch.setenv("SCALINGINTER_DEVICE", "cpu")
    runner = CliRunner()
    done = runner.invoke(app, ["warm-stage", "babyai", "--index", "0"])
    assert isinstance(done.exception, Called), done.output
    with pytest.raises(Called):
        tasks.pipeline.run_warm_stage.fn("babyai", 0, "http://127.0.0.1:9")
    stage, init, _ = warm_spec("babyai", 0, Path("."))
    assert stage.method == "sft" and stage.split == "warm"  # the main job's warm start, not the defaults
    options = {"items": "--episodes", "epochs": "--epochs", "lr": "--lr", "max_tokens": "--max-tokens",
               "lora_r": "--lora-r"}
    argv = [arg for field, flag in options.items() for arg in (flag, str(getattr(stage, field)))]
    rest = stage.model_dump(exclude={"method", "recorded", *options})
    sets = [arg for field, value in rest.items() for arg in ("--set", f"{field}={json.dumps(value)}")]
    done = runner.invoke(app, ["sft", "babyai", "--out", "runs/unused", *argv, *sets])
    assert isinstance(done.exception, Called), done.output
    assert len(calls) == 3 and calls[0] == calls[1] == calls[2], calls
    assert calls[0][:4] == ("babyai", 0, stage, Path(init).resolve())
    done = runner.invoke(app, ["sft", "babyai", "--set", "epoch=3"])
    assert done.exit_code != 0 and "epoch" in done.output and len(calls) == 3

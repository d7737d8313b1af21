"""Rejection-sampling fine-tuning (issue 21): on the bandit, from a 50/50 warm start, a round of sample ->
keep the successes -> SFT raises the sampled success on items it never saw; the round's manifest and kept
episodes give its lineage; a rerun continues instead of redoing a round."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from envs.launcher import ROOT
from training.checkpoint import checkpoint_hash, folder_hash, read_manifest
from training.evaluation.evaluate import evaluate
from training.settings.config import SFTConfig
from training.store import read_episodes, training_conversation
from training.trajectory import Trajectory
from training.warmstart.rft import RFTConfig, rft, select

TRAIN, HELD_OUT = [f"bandit_{i}" for i in range(8)], [f"bandit_{i}" for i in range(40, 56)]


def test_select_keeps_successes_all_or_each_items_shortest() -> None:
    def episode(item: str, turns: int, success: bool) -> Trajectory:
        t = Trajectory(item_id=item, group=0, sample=turns, input_ids=[1] * turns)
        t.turns = [object()] * turns  # type: ignore[list-item]
        t.finish("done")
        t.success = success
        return t

    runs = [episode("a", 3, True), episode("a", 2, True), episode("a", 1, False), episode("b", 4, True)]
    assert [(t.item_id, len(t.turns)) for t in select(runs, "all")] == [("a", 3), ("a", 2), ("b", 4)]
    assert [(t.item_id, len(t.turns)) for t in select(runs, "shortest")] == [("a", 2), ("b", 4)]


@pytest.mark.slow
def test_a_round_of_rejection_sampling_raises_success_on_held_out_items(env_server, bandit_warm_start,
                                                                        tmp_path) -> None:
    url = env_server("bandit")
    config = RFTConfig(rounds=1, k=4, h=1, max_new_tokens=16, sft=SFTConfig(epochs=3, lr=1e-3, batch_size=8))
    before = evaluate(bandit_warm_start, "bandit", url, HELD_OUT, h=1, k=4, temperature=1.0, max_new_tokens=16)
    [round0] = rft(bandit_warm_start, tmp_path, "bandit", url, TRAIN, config)
    after = evaluate(round0, "bandit", url, HELD_OUT, h=1, k=4, temperature=1.0, max_new_tokens=16)
    print(f"sampled success on held-out items: {before.success_rate:.3f} -> {after.success_rate:.3f}")
    assert 0.2 < before.success_rate < 0.8  # the warm start picks either door
    assert after.success_rate > before.success_rate + 0.15, (before.success_rate, after.success_rate)
    manifest = read_manifest(round0, verify=True)
    assert (manifest["kind"], manifest["round"], manifest["sampled"]) == ("rft", 0, 32)
    assert manifest["parent"] == folder_hash(bandit_warm_start) and 0 < manifest["kept"] <= 32
    assert manifest["sample_prefix_reused_tokens"] == 0  # one turn per episode: no conversation to continue
    kept = [json.loads(line) for line in (tmp_path / "round-0.jsonl").open()]
    assert len(kept) == manifest["kept"] and all(k["success"] and k["policy"] == manifest["parent"] for k in kept)
    assert all("right" in [m for m in k["conversation"] if m["role"] == "assistant"][-1]["content"] for k in kept)
    # a rerun with one more round continues from round 0 (verified, not redone)
    identity = checkpoint_hash(round0)
    rounds = rft(bandit_warm_start, tmp_path, "bandit", url, TRAIN, config.model_copy(update={"rounds": 2}))
    assert checkpoint_hash(rounds[0]) == identity and read_manifest(rounds[1])["parent"] == identity
    # rounds made with other settings are never taken for this run's
    with pytest.raises(ValueError, match=r"other settings \(rft differ"):
        rft(bandit_warm_start, tmp_path, "bandit", url, TRAIN, config.model_copy(update={"rounds": 2, "k": 2}))
    with pytest.raises(ValueError, match=r"other settings \(items differ"):
        rft(bandit_warm_start, tmp_path, "bandit", url, TRAIN[:4], config)


@pytest.mark.slow
def test_the_cli_runs_rounds_on_a_server_it_starts(bandit_warm_start, tmp_path) -> None:
    cmd = [sys.executable, "-m", "flows.cli", "rft", "bandit", "--init", str(bandit_warm_start), "--out",
           str(tmp_path), "--rounds", "1", "--k", "2", "--items", "4", "--h", "1", "--max-new-tokens", "16"]
    env = {k: v for k, v in os.environ.items() if k != "SCALINGINTER_ENV_URL"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "round 0: kept" in done.stdout and read_manifest(tmp_path / "round-0")["sampled"] == 8
    bad = subprocess.run([*cmd, "--keep", "longest"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "keep" in bad.stdout + bad.stderr


def test_a_record_keeps_its_sampled_tokens_and_another_tokenizer_re_encodes_it(env_server, bandit_warm_start,
                                                                               tmp_path) -> None:
    from training.chat_format import ChatFormat
    from training.model import load_policy
    from training.store import recorded_trajectory
    from training.warmstart.rft import sample

    _, tokenizer = load_policy(bandit_warm_start)
    chat = ChatFormat(tokenizer)
    [t] = sample(bandit_warm_start, "bandit", env_server("bandit"), TRAIN[:1], RFTConfig(k=1, h=1, max_new_tokens=16),
                 0).trajectories
    record = json.loads(json.dumps(t.log_record()))  # as read back from a JSONL file
    assert record["tokenizer"] == chat.fingerprint and len(record["tokenizer"]) == 16
    again = recorded_trajectory(record, chat)
    end = t.reward_index + 1  # up to the last agent token: the final observation is not trained on
    assert again is not None and again.input_ids == t.input_ids[:end] and again.loss_mask == t.loss_mask[:end]
    assert sum(again.loss_mask) == sum(t.loss_mask) > 0
    assert recorded_trajectory({**record, "tokenizer": "0" * 16}, chat) is None  # another model's ids: re-encode
    assert recorded_trajectory({k: v for k, v in record.items() if k != "input_ids"}, chat) is None


def test_sampling_with_the_prefix_cache_gives_the_same_episodes_and_skips_the_repeated_prefill(
        env_server, tiny_model_dir) -> None:
    from training.warmstart.rft import sample
    from training.warmstart.sft import sft_items

    items, url = sft_items("babyai", 3), env_server("babyai")

    def run(prefix_cache_gb: float):
        config = RFTConfig(k=2, h=3, max_new_tokens=8, prefix_cache_gb=prefix_cache_gb)
        return sample(tiny_model_dir, "babyai", url, items, config, 0)

    def episodes(sampled) -> list[tuple]:
        return [(t.item_id, t.sample, t.input_ids, t.reward, t.termination) for t in sampled.trajectories]

    whole, cached = run(0.0), run(0.5)
    assert episodes(cached) == episodes(whole) and len(whole.trajectories) == 6
    assert len({tuple(t.input_ids) for t in whole.trajectories}) > 1  # the samples vary: equality means something
    # each later turn prefilled only what the turn before added
    assert cached.prefix_reused_tokens > 0 and whole.prefix_reused_tokens == 0


def test_sft_trains_on_recorded_episodes_and_names_them(env_server, bandit_warm_start, tmp_path) -> None:
    """The store: an RFT round's and a DPO run's recorded episodes are SFT data (`scalinginter sft --from`); the
    checkpoint names the files by sha256."""
    url = env_server("bandit")
    rft(bandit_warm_start, tmp_path / "rft", "bandit", url, TRAIN[:4],
        RFTConfig(rounds=1, k=2, h=1, max_new_tokens=16, sft=SFTConfig(epochs=1)))
    records, sources = read_episodes([tmp_path / "rft"])
    assert records and all(r["success"] for r in records) and len(sources) == 1
    assert training_conversation(records[0])[-1]["role"] == "assistant"
    cmd = [sys.executable, "-m", "flows.cli", "sft", "bandit", "--init", str(bandit_warm_start), "--out",
           str(tmp_path / "sft"), "--from", str(tmp_path / "rft" / "round-0.jsonl"), "--epochs", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = read_manifest(tmp_path / "sft" / "final")
    assert manifest["episodes"] == len(records) and manifest["sources"][0]["sha256"] == sources[0]["sha256"]
    assert manifest["recorded_token_ids"] == len(records)  # trained on the very tokens sampled, not re-encoded
    # a warm-start stage of the pipeline can train on the same records (`recorded:` in params.yaml)
    from training.settings.warm import parse_stage
    from training.warmstart.methods import run_warm_stage

    stage = parse_stage({"method": "sft", "recorded": [str(tmp_path / "rft" / "round-0.jsonl")], "epochs": 1})
    warm = read_manifest(run_warm_stage("bandit", 0, stage, bandit_warm_start, tmp_path / "warm"))
    assert (warm["source"], warm["episodes"], warm["recorded_token_ids"]) == ("recorded", len(records), len(records))
    assert warm["warm_start"]["recorded"] == stage.recorded and warm["sources"][0]["sha256"] == sources[0]["sha256"]
    bad = subprocess.run([*cmd[:-4], "--from", str(tmp_path / "missing.jsonl")], cwd=ROOT, capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "no recorded episodes at" in bad.stdout + bad.stderr


def test_a_sampling_stages_context_budget_reaches_its_sampling_and_cuts_its_episodes(env_server, tiny_model_dir,
                                                                                      tmp_path, monkeypatch) -> None:
    """``context_budget`` of an RFT or DPO stage (a phases.yaml row, so a DVC param) is how long its sampled
    episodes may grow (before, every sampling stage took the rollout's default of 2,048 tokens, whatever the
    environment's episodes needed)."""
    from training.settings.warm import parse_stage
    from training.warmstart import methods
    from training.warmstart.rft import sample
    from training.warmstart.sft import sft_items

    url, seen = env_server("babyai"), {}

    class Sampled(Exception):
        pass

    def fake_rft(init, out, env, url, ids, config, **kwargs):
        seen["rft"] = config
        raise Sampled

    def fake_sample(init, env, url, ids, config, round_):
        seen["dpo"] = config
        raise Sampled

    monkeypatch.setattr(methods, "rft", fake_rft)
    monkeypatch.setattr(methods, "sample", fake_sample)
    for method in ("rft", "dpo"):
        stage = parse_stage({"method": method, "items": 2, "context_budget": 96, "k": 3, "h": 5})
        with pytest.raises(Sampled):
            methods.run_warm_stage("babyai", 0, stage, tiny_model_dir, tmp_path / method, url)
    assert seen["rft"].context_budget == seen["dpo"].context_budget == 96
    assert (seen["rft"].k, seen["rft"].h, seen["dpo"].k, seen["dpo"].h) == (3, 5, 3, 5)
    # BabyAI's opening prompt is ~760 tokens here and each turn ~75: 8 turns need ~1,360, a budget of 1,000 cuts
    for budget, ended in ((1000, "context_cap"), (2048, "turn_cap")):
        sampled = sample(tiny_model_dir, "babyai", url, sft_items("babyai", 2),
                         RFTConfig(k=2, h=8, max_new_tokens=24, context_budget=budget), 0)
        assert all(len(t.input_ids) <= budget and t.termination == ended for t in sampled.trajectories), budget

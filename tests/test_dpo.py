"""DPO on agent episodes (issue 21): pairs of a successful and a failed episode of one item; after training the
policy prefers the chosen over the rejected on held-out pairs it never saw, and samples the winning door more."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from envs.launcher import ROOT
from training.checkpoint import folder_hash, read_manifest
from training.evaluation.evaluate import evaluate
from training.model import load_policy
from training.placement.devices import resolve_device
from training.trajectory import Trajectory
from training.warmstart.dpo import DPOConfig, dpo, margins, preference_pairs
from training.warmstart.rft import RFTConfig, sample

TRAIN, HELD_OUT = [f"bandit_{i}" for i in range(8)], [f"bandit_{i}" for i in range(40, 48)]


def test_pairs_match_a_success_with_a_failure_of_the_same_item() -> None:
    def episode(item: str, sample_: int, success: bool) -> Trajectory:
        t = Trajectory(item_id=item, group=0, sample=sample_)
        t.finish("done")
        t.success = success
        return t

    runs = [episode("a", 0, True), episode("a", 1, False), episode("a", 2, False), episode("b", 0, True),
            episode("c", 0, False)]
    pairs = preference_pairs(runs, max_per_item=4)
    assert sorted((c.item_id, c.sample, r.sample) for c, r in pairs) == [("a", 0, 1), ("a", 0, 2)]
    assert len(preference_pairs(runs, max_per_item=1)) == 1
    with pytest.raises(ValueError, match="no preference pairs"):
        dpo(None, None, [], DPOConfig())  # type: ignore[arg-type]


@pytest.mark.slow
def test_dpo_prefers_the_chosen_on_held_out_pairs(env_server, bandit_warm_start, tmp_path) -> None:
    url = env_server("bandit")
    sampling = RFTConfig(k=4, h=1, max_new_tokens=16)
    train_pairs = preference_pairs(sample(bandit_warm_start, "bandit", url, TRAIN, sampling, 0).trajectories)
    held_pairs = preference_pairs(sample(bandit_warm_start, "bandit", url, HELD_OUT, sampling, 1).trajectories)
    assert len(train_pairs) >= 8 and len(held_pairs) >= 4
    out = dpo(bandit_warm_start, tmp_path / "dpo", train_pairs, DPOConfig(beta=0.1, epochs=3, lr=1e-4,
                                                                           batch_pairs=8))
    manifest = read_manifest(out, verify=True)
    assert manifest["kind"] == "dpo" and manifest["parent"] == folder_hash(bandit_warm_start)
    assert manifest["final_loss"] < manifest["first_loss"] and manifest["accuracy_after"] > 0.9
    device = resolve_device("cpu")
    policy, tokenizer = load_policy(out, device)
    reference, _ = load_policy(bandit_warm_start, device)
    held = margins(policy, reference, held_pairs, tokenizer.pad_token_id, device)
    print(f"held-out pairs preferring the chosen: {(held > 0).float().mean():.3f} of {len(held_pairs)}")
    assert float((held > 0).float().mean()) > 0.9
    before = evaluate(bandit_warm_start, "bandit", url, HELD_OUT, h=1, k=4, temperature=1.0, max_new_tokens=16)
    after = evaluate(out, "bandit", url, HELD_OUT, h=1, k=4, temperature=1.0, max_new_tokens=16)
    print(f"sampled success on held-out items: {before.success_rate:.3f} -> {after.success_rate:.3f}")
    assert after.success_rate > before.success_rate
    assert (tmp_path / "dpo.pairs.jsonl").read_text().count("\n") == len(train_pairs)


@pytest.mark.slow
def test_the_cli_samples_pairs_and_trains(bandit_warm_start, tmp_path) -> None:
    cmd = [sys.executable, "-m", "flows.cli", "dpo", "bandit", "--init", str(bandit_warm_start), "--out",
           str(tmp_path / "dpo"), "--k", "4", "--items", "4", "--h", "1", "--max-new-tokens", "16", "--epochs", "1",
           "--lora-r", "4"]
    env = {k: v for k, v in os.environ.items() if k != "SCALINGINTER_ENV_URL"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = read_manifest(tmp_path / "dpo" / "final")  # the stage's layout: the CLI runs a warm-start stage
    assert "DPO on" in done.stdout and manifest["kind"] == "dpo" and manifest["config"]["lora"]["r"] == 4
    assert manifest["warm_start"]["method"] == "dpo" and manifest["warm_start"]["k"] == 4
    assert (tmp_path / "dpo" / "final" / "lora" / "adapter_model.safetensors").exists()  # LoRA through the CLI
    first = json.loads((tmp_path / "dpo" / "final.pairs.jsonl").read_text().splitlines()[0])
    assert (first["policy"], first["env"], first["h"]) == (folder_hash(bandit_warm_start), "bandit", 1)  # provenance
    assert first["chosen"]["input_ids"] and first["chosen"]["tokenizer"]  # the store's token ids

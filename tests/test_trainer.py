"""The trainer: phases bitwise reproducible in fresh processes and after SIGKILL, checkpoint integrity, metrics,
ppo_epochs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from envs.launcher import ROOT, running_server
from training.checkpoint import CheckpointError, checkpoint_hash, read_manifest, state_folder
from training.phases.trainer import train_phase
from training.settings.config import TrainConfig

FAST = ["--set", "batch_items=2", "--set", "n_samples=2", "--set", "max_new_tokens=8", "--set", "lr=0.0001",
        "--set", "mini_batch_size=2", "--set", "micro_batch_size=2", "--set", 'sub_tasks=["GoTo"]']
CONFIG = TrainConfig(batch_items=2, n_samples=2, max_new_tokens=8, lr=1e-4, mini_batch_size=2, micro_batch_size=2,
                     sub_tasks=["GoTo"])


def _train_cmd(url: str, init: Path, out: Path, phase: int, h: int, steps: int) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "train-phase", "babyai", "--phase", str(phase), "--h", str(h),
            "--steps", str(steps), "--init", str(init), "--out", str(out), "--url", url, *FAST]


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _kill_after_checkpoint(cmd: list[str], out: Path, step: int) -> None:
    """Start ``cmd``, SIGKILL it as soon as intermediate checkpoint ``step`` exists."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = out / "intermediate" / f"step-{step:06d}" / "manifest.json"
    deadline = time.monotonic() + 600
    while not target.exists():
        assert proc.poll() is None, "the phase ended before it could be killed"
        assert time.monotonic() < deadline, f"no checkpoint {target} within 600 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "final").exists()


def manifest_hash(phase_dir: Path) -> str:
    return checkpoint_hash(phase_dir / "final")


def _weights(folder: Path) -> bytes:
    return (folder / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_sigkill_mid_phase_and_across_a_phase_boundary_resumes_bitwise(tiny_model_dir, tmp_path) -> None:
    with running_server("babyai") as url:  # its own server: a killed phase leaves its episodes open until reaped
        _sigkill_and_resume(url, tiny_model_dir, tmp_path)


def _sigkill_and_resume(url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    # uninterrupted: phase 0 (h=2, 2 steps) then phase 1 (h=4, 3 steps)
    _run(_train_cmd(url, tiny_model_dir, tmp_path / "a0", 0, 2, 2))
    done = _run(_train_cmd(url, tmp_path / "a0" / "final", tmp_path / "a1", 1, 4, 3))
    # the command's output: no transformers bar per checkpoint load or save, the rollouts' own progress kept
    assert "Loading weights" not in done.stderr and "Writing model shards" not in done.stderr
    assert "babyai phase 1 (h=4)" in done.stderr
    # a second fresh run of the same phase in its own process (another hash seed): bitwise equal weights
    _run(_train_cmd(url, tiny_model_dir, tmp_path / "c0", 0, 2, 2), PYTHONHASHSEED="1")
    assert _weights(tmp_path / "c0" / "final") == _weights(tmp_path / "a0" / "final")
    # interrupted: killed inside phase 0, resumed; then killed inside phase 1, resumed
    _kill_after_checkpoint(_train_cmd(url, tiny_model_dir, tmp_path / "b0", 0, 2, 2), tmp_path / "b0", 1)
    _run(_train_cmd(url, tiny_model_dir, tmp_path / "b0", 0, 2, 2))
    assert _weights(tmp_path / "b0" / "final") == _weights(tmp_path / "a0" / "final")
    _kill_after_checkpoint(_train_cmd(url, tmp_path / "b0" / "final", tmp_path / "b1", 1, 4, 3), tmp_path / "b1", 4)
    for logs in ("dvclive", "rollouts"):  # as `dvc exp run` does to the persistent outputs of an unfinished stage
        shutil.rmtree(tmp_path / "b1" / logs)
    _run(_train_cmd(url, tmp_path / "b0" / "final", tmp_path / "b1", 1, 4, 3))
    assert _weights(tmp_path / "b1" / "final") == _weights(tmp_path / "a1" / "final")
    assert _weights(tmp_path / "a1" / "final") != _weights(tmp_path / "a0" / "final")  # it did train
    manifest = read_manifest(tmp_path / "b1" / "final")
    assert (manifest["phase"], manifest["h"], manifest["global_step"], manifest["phase_first_step"]) == (1, 4, 5, 2)
    assert manifest["parent"] == read_manifest(tmp_path / "a1" / "final")["parent"] == manifest_hash(tmp_path / "a0")
    assert manifest["hash"] == read_manifest(tmp_path / "a1" / "final")["hash"]  # same content, same identity
    rows = (tmp_path / "b1" / "dvclive" / "plots" / "metrics" / "reward" / "mean.tsv").read_text().splitlines()
    assert [r.split("\t")[0] for r in rows[1:]] == ["2", "3", "4"]  # steps re-run after the kill logged once
    assert sorted(p.name for p in (tmp_path / "b1" / "rollouts").glob("*.jsonl")) == \
        [f"step-{s:06d}.jsonl" for s in (2, 3, 4)]  # the step before the kill from the checkpoint's own copy


def test_a_corrupted_checkpoint_is_refused(env_server, tiny_model_dir, tmp_path) -> None:
    final = train_phase("babyai", 0, 1, 1, tiny_model_dir, tmp_path / "p", config=CONFIG, url=env_server("babyai"))
    read_manifest(final, verify=True)
    with (final / "model.safetensors").open("r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    with pytest.raises(CheckpointError, match=r"model\.safetensors fails its recorded sha256"):
        train_phase("babyai", 1, 2, 1, final, tmp_path / "next", config=CONFIG, url=env_server("babyai"))


def test_a_weights_copy_leaves_the_trainer_state_and_refuses_a_corrupted_source(tmp_path) -> None:
    """``weights_copy``: the checkpoint without its optimizer and trainer state (inside it, or in the ``-state``
    folder beside an exported one), verified, naming its source; a corrupted source is refused, nothing written."""
    from training.checkpoint import weights_copy, write_checkpoint

    def write(tmp: Path) -> None:
        for name, data in (("model.safetensors", b"w"), ("config.json", b"{}"), ("optimizer_rank0.pt", b"o"),
                           ("trainer_state.pt", b"s")):
            (tmp / name).write_bytes(data)

    for export in (False, True):
        source = tmp_path / f"export-{export}" / "final"
        write_checkpoint(source, write, {"global_step": 7}, export=export)
        copy = weights_copy(source, tmp_path / f"copy-{export}")
        assert sorted(p.name for p in copy.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]
        manifest = read_manifest(copy, verify=True)
        assert manifest["weights_of"] == read_manifest(source)["hash"] and manifest["global_step"] == 7
        assert sorted(manifest["files"]) == ["config.json", "model.safetensors"]
    (source / "model.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"model\.safetensors fails its recorded sha256"):
        weights_copy(source, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_a_corrupted_base_model_is_refused_by_training_sft_and_evaluation(env_server, tiny_model_dir,
                                                                          tmp_path) -> None:
    """The base model is written as a checkpoint (kind base, with its files' hashes): a flipped byte in it is
    refused before anything trains on it or scores it, naming the file."""
    import shutil

    from training.evaluation.evaluate import evaluate
    from training.warmstart.sft import SFTConfig, sft

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    assert read_manifest(base, verify=True)["kind"] == "base"
    with (base / "model.safetensors").open("r+b") as f:
        f.seek(200)
        f.write(b"\xff\xfe")
    url = env_server("babyai")
    with pytest.raises(CheckpointError, match=r"model\.safetensors fails its recorded sha256"):
        train_phase("babyai", 0, 1, 1, base, tmp_path / "p", config=CONFIG, url=url)
    with pytest.raises(CheckpointError, match=r"model\.safetensors fails its recorded sha256"):
        sft(base, tmp_path / "sft", [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]],
            SFTConfig(epochs=1))
    with pytest.raises(CheckpointError, match=r"model\.safetensors fails its recorded sha256"):
        evaluate(base, "babyai", url, ["babyai_0"], h=1)


def test_a_phase_logs_metrics_rollouts_and_its_cost(env_server, tiny_model_dir, tmp_path) -> None:
    final = train_phase("babyai", 0, 2, 2, tiny_model_dir, tmp_path, config=CONFIG, url=env_server("babyai"))
    metrics = json.loads((tmp_path / "dvclive" / "metrics.json").read_text())
    for name in ("reward", "success", "turns", "actor", "timing_s", "perf", "curriculum", "rollout", "env"):
        assert name in metrics, name
    assert metrics["curriculum"]["h"] == 2 and "termination" in metrics["rollout"]
    # the second turn of each trajectory prefilled only what its first turn added (the hf engine's prefix cache)
    assert metrics["rollout"]["prefix_reused_tokens"] > 0
    assert {"entropy", "kl", "pg_loss", "pg_clipfrac", "grad_norm", "lr"} <= set(metrics["actor"])
    # the trainer scores the sampled tokens as the sampler did (two turns: the prefix cache, padding, the template),
    # so an update starts on-policy
    assert metrics["actor"]["sampler_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["actor"]["sampler_logprob_absdiff_max"] < 1e-2
    assert {"advantage_token_mean", "advantage_weighted"} <= set(metrics["actor"])
    rows = (tmp_path / "dvclive" / "plots" / "metrics" / "reward" / "mean.tsv").read_text().splitlines()
    assert rows[0].split("\t")[0] == "step" and [r.split("\t")[0] for r in rows[1:]] == ["0", "1"]
    assert len(list((tmp_path / "rollouts").glob("step-*.jsonl"))) == 2
    record = json.loads((tmp_path / "rollouts" / "step-000001.jsonl").read_text().splitlines()[0])
    assert (record["env"], record["phase"], record["h"]) == ("babyai", 0, 2)  # where each record came from
    assert record["parent"] == read_manifest(final)["parent"] and record["conversation"]
    cost = read_manifest(final)["cost"]
    assert cost["generated_tokens"] > 0 and cost["trained_tokens"] > 0 and cost["wall_seconds"] > 0
    card = (final / "README.md").read_text()  # a model card a user can hand on with the HF folder
    assert card.startswith("---\nlibrary_name: transformers") and "turn cap h | 2 |" in card
    manifest = read_manifest(final)
    assert f"`{manifest['parent']}`" in card and "babyai" in card and "README.md" in manifest["files"]
    # final/ is a clean Hugging Face folder; optimizer and trainer state live beside it, in the manifest too
    assert not [f.name for f in final.iterdir() if f.suffix == ".pt"]
    assert {f.name for f in (tmp_path / "final-state").iterdir()} == {"trainer_state.pt", "optimizer_rank0.pt"}
    assert {"state/trainer_state.pt", "state/optimizer_rank0.pt"} <= set(manifest["files"])


def test_a_step_larger_than_the_server_trains_with_asynchronous_rollouts(tiny_model_dir, tmp_path) -> None:
    """A server that holds 3 instances and a step of 2 items x 2 samples: lock-step refuses before rolling out
    (naming the way out), rollout_mode async admits the fourth trajectory when one ends and trains."""
    from training.phases.trainer import CapacityConfigError

    with running_server("babyai", max_instances=3) as url:
        with pytest.raises(CapacityConfigError, match="rollout_mode: async"):
            train_phase("babyai", 0, 2, 1, tiny_model_dir, tmp_path / "lockstep", config=CONFIG, url=url)
        config = CONFIG.model_copy(update={"rollout_mode": "async"})
        final = train_phase("babyai", 0, 2, 1, tiny_model_dir, tmp_path / "async", config=config, url=url)
        records = [json.loads(line) for line in (tmp_path / "async" / "rollouts" / "step-000000.jsonl").open()]
        assert len(records) == 4 and not any(r["termination"] == "env_error" for r in records)
        assert read_manifest(final)["config"]["rollout_mode"] == "async"


def test_ppo_epochs_really_run_more_updates(env_server, tiny_model_dir, tmp_path) -> None:
    once = train_phase("babyai", 0, 1, 1, tiny_model_dir, tmp_path / "one", config=CONFIG, url=env_server("babyai"))
    twice = train_phase("babyai", 0, 1, 1, tiny_model_dir, tmp_path / "two", url=env_server("babyai"),
                        config=CONFIG.model_copy(update={"ppo_epochs": 2}))
    state_one = torch.load(state_folder(once) / "optimizer_rank0.pt", weights_only=True)["state"]
    state_two = torch.load(state_folder(twice) / "optimizer_rank0.pt", weights_only=True)["state"]
    assert float(state_two[0]["step"]) == 2 * float(state_one[0]["step"])


def test_the_loss_aggregation_and_grpo_std_settings_reach_the_update(env_server, bandit_warm_start, tmp_path
                                                                     ) -> None:
    """Sampled replies differ in length: each setting changes the weights one step makes, and under the
    per-trajectory mean the advantage the tokens carry in all is zero."""
    url = env_server("bandit")
    runs = {}
    for name, update in {"token": {}, "seq": {"loss_agg": "seq-mean-token-mean"},
                         "no-std": {"grpo_norm_std": False}}.items():
        config = TrainConfig(batch_items=4, n_samples=4, max_new_tokens=16, lr=1e-3, mini_batch_size=16,
                             micro_batch_size=8, skip_flat_steps=True, **update)
        final = train_phase("bandit", 0, 1, 1, bandit_warm_start, tmp_path / name, config=config, url=url)
        runs[name] = (_weights(final), json.loads((tmp_path / name / "dvclive" / "metrics.json").read_text()))
    assert runs["token"][1]["actor"].get("skipped") != 1.0, "the step had no signal: pick another seed"
    assert runs["token"][0] != runs["seq"][0] and runs["token"][0] != runs["no-std"][0]
    assert runs["seq"][1]["actor"]["advantage_weighted"] == pytest.approx(0.0, abs=1e-6)
    token = runs["token"][1]["actor"]
    assert token["advantage_weighted"] == pytest.approx(token["advantage_token_mean"], abs=1e-6)
    assert token["advantage_token_mean"] != pytest.approx(0.0, abs=1e-6)  # replies of unequal length


def test_ppo_trains_a_critic_and_saves_it(env_server, tiny_model_dir, tmp_path) -> None:
    config = CONFIG.model_copy(update={"algorithm": "ppo"})
    final = train_phase("babyai", 0, 2, 1, tiny_model_dir, tmp_path, config=config, url=env_server("babyai"))
    assert "state/critic.safetensors" in read_manifest(final)["files"]
    metrics = json.loads((tmp_path / "dvclive" / "metrics.json").read_text())
    assert {"value_loss", "vf_explained_var", "values_mean", "returns_mean"} <= set(metrics["critic"])


def test_intra_phase_checkpoints_of_a_run_with_other_settings_are_not_resumed(env_server, tiny_model_dir,
                                                                               tmp_path) -> None:
    import shutil

    url = env_server("babyai")
    train_phase("babyai", 0, 1, 2, tiny_model_dir, tmp_path, config=CONFIG, url=url)
    assert (tmp_path / "intermediate" / "step-000001").exists()
    shutil.rmtree(tmp_path / "final")  # DVC removes a stage's outputs before rerunning it; intermediate persists
    final = train_phase("babyai", 0, 2, 2, tiny_model_dir, tmp_path, config=CONFIG, url=url)  # h changed
    manifest = read_manifest(final)
    assert manifest["h"] == 2 and manifest["global_step"] == 2 and manifest["phase_first_step"] == 0
    rows = (tmp_path / "dvclive" / "plots" / "metrics" / "curriculum" / "h.tsv").read_text().splitlines()[1:]
    assert [float(r.split("\t")[1]) for r in rows] == [2.0, 2.0]  # both steps were trained at the new h


def test_bf16_precision_autocasts_the_forward_and_keeps_float32_weights(env_server, tiny_model_dir,
                                                                          tiny_policy, tmp_path) -> None:
    from training.placement.devices import autocast
    from training.rl.losses import policy_forward

    model, _ = tiny_policy
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 12)
    mask[:, 6:] = 1
    with torch.no_grad():
        exact, _ = policy_forward(model, ids, torch.ones_like(ids), mask, entropy=False)
        with autocast(torch.device("cpu"), "bf16"):
            mixed, _ = policy_forward(model, ids, torch.ones_like(ids), mask, entropy=False)
    assert mixed.dtype == torch.float32 and not torch.equal(mixed, exact)  # bf16 matmuls really ran
    assert torch.allclose(mixed, exact, atol=0.1)
    with pytest.raises(ValueError, match="precision must be"):
        autocast(torch.device("cpu"), "fp16")
    final = train_phase("babyai", 0, 1, 1, tiny_model_dir, tmp_path, url=env_server("babyai"),
                        config=CONFIG.model_copy(update={"precision": "bf16"}))
    assert read_manifest(final)["config"]["precision"] == "bf16"
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(final / "model.safetensors").values()} == {torch.float32}


def test_a_step_without_advantage_signal_can_skip_the_update(env_server, tiny_model_dir, tmp_path) -> None:
    """The untrained model fails every BabyAI episode at h=1: every group is flat. With skip_flat_steps the
    weights stay as they were and the step is logged as skipped; without it Adam still moves them."""
    url = env_server("babyai")
    skipped = train_phase("babyai", 0, 1, 1, tiny_model_dir, tmp_path / "skip", url=url,
                          config=CONFIG.model_copy(update={"skip_flat_steps": True}))
    metrics = json.loads((tmp_path / "skip" / "dvclive" / "metrics.json").read_text())
    assert metrics["actor"]["skipped"] == 1.0 and metrics["actor"]["flat_groups"] == CONFIG.batch_items
    assert metrics["success"]["rate"] == 0.0
    assert _weights(skipped) == _weights(tiny_model_dir)
    moved = train_phase("babyai", 0, 1, 1, tiny_model_dir, tmp_path / "update", url=url, config=CONFIG)
    assert _weights(moved) != _weights(tiny_model_dir)
    dropped = train_phase("babyai", 0, 1, 1, tiny_model_dir, tmp_path / "drop", url=url,
                          config=CONFIG.model_copy(update={"drop_flat_groups": True}))
    metrics = json.loads((tmp_path / "drop" / "dvclive" / "metrics.json").read_text())
    assert metrics["actor"]["skipped"] == 1.0
    assert metrics["actor"]["dropped_trajectories"] == CONFIG.batch_items * CONFIG.n_samples
    assert _weights(dropped) == _weights(tiny_model_dir)


def test_dropping_flat_groups_updates_on_the_mixed_groups_only(env_server, bandit_warm_start, tmp_path) -> None:
    """On the 50/50 bandit warm start with pairs of samples about half the groups are flat. The update sees
    only the mixed ones: its trained tokens are theirs, and the flat trajectories are counted as dropped."""
    config = CONFIG.model_copy(update={"drop_flat_groups": True, "sub_tasks": None, "batch_items": 8,
                                       "mini_batch_size": 16, "micro_batch_size": 16, "max_new_tokens": 16})
    out = tmp_path / "drop"
    train_phase("bandit", 0, 1, 1, bandit_warm_start, out, url=env_server("bandit"), config=config)
    metrics = json.loads((out / "dvclive" / "metrics.json").read_text())
    rows = [json.loads(line) for line in (out / "rollouts" / "step-000000.jsonl").read_text().splitlines()]
    by_item: dict[str, set[float]] = {}
    for row in rows:
        by_item.setdefault(row["item_id"], set()).add(row["reward"])
    flat = [item for item, rewards in by_item.items() if len(rewards) == 1]
    assert 0 < len(flat) < len(by_item), by_item  # the seed gives both kinds
    assert metrics["actor"]["flat_groups"] == len(flat)
    assert metrics["actor"]["dropped_trajectories"] == len(flat) * config.n_samples
    assert "skipped" not in metrics["actor"]
    mixed_tokens = sum(row["agent_tokens"] for row in rows if row["item_id"] not in flat)
    assert json.loads((out / "final" / "manifest.json").read_text())["cost"]["trained_tokens"] == mixed_tokens


@pytest.mark.parametrize("update", [{"algorithm": "ppo"}, {"kl_in_reward": True}, {"strategy": "deepspeed"}])
def test_drop_flat_groups_refuses_what_it_cannot_serve(update: dict) -> None:
    with pytest.raises(ValueError, match="drop_flat_groups"):
        TrainConfig(drop_flat_groups=True, **update)


def test_an_item_list_replaces_the_split_and_is_checked() -> None:
    from training.phases.data import DataStream

    items = ["babyai_2003", "babyai_2010", "babyai_2044"]
    stream = DataStream("babyai", TrainConfig(items=items, seed=3))
    drawn = stream.take(7)
    assert set(drawn) == set(items)
    assert sorted(drawn[:3]) == sorted(items)  # each epoch is a permutation of the list
    resumed = DataStream("babyai", TrainConfig(items=items, seed=3), position=4)
    assert resumed.take(3) == drawn[4:]
    with pytest.raises(ValueError, match="non-empty"):
        TrainConfig(items=[])
    with pytest.raises(ValueError, match="no sub_tasks"):
        TrainConfig(items=items, sub_tasks=["GoTo"])


def test_training_sends_the_env_token_to_a_protected_server(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """The rollout's HTTP session carries SCALINGINTER_ENV_TOKEN like every other client (it got 401 before)."""
    with running_server("babyai", token="s3cret") as url:
        monkeypatch.setenv("SCALINGINTER_ENV_TOKEN", "s3cret")
        final = train_phase("babyai", 0, 1, 1, tiny_model_dir, tmp_path / "p", config=CONFIG, url=url)
        assert read_manifest(final)["global_step"] == 1
        monkeypatch.setenv("SCALINGINTER_ENV_TOKEN", "wrong")
        with pytest.raises(Exception, match="401"):
            train_phase("babyai", 0, 1, 1, tiny_model_dir, tmp_path / "q", config=CONFIG, url=url)


class _RunsCode:
    """A pickled object that would create a file when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_trainer_state_that_is_not_plain_data_is_refused(env_server, tiny_model_dir, tmp_path) -> None:
    """A checkpoint from a remote cannot run code: trainer state loads with weights_only (a valid manifest does
    not make a pickle safe)."""
    from training.checkpoint import STATE, write_checkpoint

    final = train_phase("babyai", 0, 1, 1, tiny_model_dir, tmp_path / "p", config=CONFIG, url=env_server("babyai"))
    marker = tmp_path / "unpickled"
    record = {k: v for k, v in read_manifest(final).items() if k not in ("files", "hash")}

    def write(tmp: Path) -> None:
        for f in [*final.iterdir(), *state_folder(final).iterdir()]:
            if f.name != "manifest.json":
                (tmp / f.name).write_bytes(f.read_bytes())
        state = torch.load(state_folder(final) / STATE, weights_only=True)
        torch.save({**state, "extra": _RunsCode(marker)}, tmp / STATE)

    hostile = tmp_path / "hostile"
    write_checkpoint(hostile, write, record)
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        train_phase("babyai", 1, 2, 1, hostile, tmp_path / "next", config=CONFIG, url=env_server("babyai"))
    assert not marker.exists()


def test_metric_names_do_not_collide_with_dvclives_step_column(env_server, tiny_model_dir, tmp_path) -> None:
    from training.phases.metrics import Metrics

    train_phase("babyai", 0, 1, 2, tiny_model_dir, tmp_path, config=CONFIG, url=env_server("babyai"))
    rows = (tmp_path / "dvclive" / "plots" / "metrics" / "timing_s" / "total.tsv").read_text().splitlines()
    assert rows[0].split("\t") == ["step", "total"] and [r.split("\t")[0] for r in rows[1:]] == ["0", "1"]
    assert not list((tmp_path / "dvclive").rglob("step.tsv"))
    with pytest.raises(ValueError, match="collides with dvclive's step column"):
        Metrics(tmp_path / "other").log({"timing_s/step": 1.0}, 0)


def test_a_run_ends_when_another_run_removed_dvclives_shared_signal_file(tmp_path, monkeypatch) -> None:
    # found by a CI run: two trainers in one working copy (two xdist workers) both end their dvclive run; dvclive
    # checks that .dvc/tmp/exps/run/DVCLIVE_STEP_COMPLETED exists, then removes it, and the other run removed it in
    # between. Here the other run's removal comes exactly in that gap.
    import dvclive.vscode

    from training.phases.metrics import Metrics

    (tmp_path / ".dvc").mkdir()
    monkeypatch.chdir(tmp_path)  # the working copy whose .dvc/tmp the signal file goes to
    first, second = Metrics(tmp_path / "a"), Metrics(tmp_path / "b")
    first.log({"reward/mean": 1.0}, 0)
    second.log({"reward/mean": 2.0}, 0)
    signal = tmp_path / ".dvc" / "tmp" / "exps" / "run" / "DVCLIVE_STEP_COMPLETED"
    assert signal.exists()
    first.close()
    assert not signal.exists()
    exists = os.path.exists
    with monkeypatch.context() as patch:  # checked before the other run removed it
        patch.setattr(dvclive.vscode.os.path, "exists", lambda path: path == str(signal) or exists(path))
        second.close()
    assert json.loads((tmp_path / "b" / "metrics.json").read_text())["reward"]["mean"] == 2.0
    broken = Metrics(tmp_path / "c")  # any other missing file is still an error
    broken.log({"reward/mean": 3.0}, 0)
    monkeypatch.setattr(broken.live, "save_dvc_exp", lambda: open(tmp_path / "gone" / "x"))  # noqa: SIM115
    with pytest.raises(FileNotFoundError, match="gone"):
        broken.close()


def test_adaptive_curriculum_advances_early_and_hands_its_steps_on(env_server, tiny_model_dir, tmp_path) -> None:
    """curriculum mode adaptive: a phase whose trajectories mostly hit the turn cap ends after min_steps; the
    steps it leaves go to the next phase (the curriculum's total stays as planned); manifests say so."""
    from training.settings.curriculum import AdaptiveRule

    url = env_server("babyai")
    rule = AdaptiveRule(truncated_share=0.5, min_steps=1)  # the untrained policy never finishes BabyAI in a turn
    first = train_phase("babyai", 0, 1, 3, tiny_model_dir, tmp_path / "p0", config=CONFIG, url=url, adaptive=rule)
    record = read_manifest(first)
    assert record["global_step"] == 1 and record["steps"] == 3  # planned 3 (dvc.lock's value), trained 1
    assert record["curriculum"]["trained_steps"] == 1 and record["curriculum"]["unused_steps"] == 2
    assert "hit the cap h=1" in record["curriculum"]["advanced_early"]
    metrics = json.loads((tmp_path / "p0" / "dvclive" / "metrics.json").read_text())
    assert metrics["curriculum"]["advanced_early"] == 1.0
    last = read_manifest(train_phase("babyai", 1, 2, 1, first, tmp_path / "p1", config=CONFIG, url=url))
    assert last["global_step"] == 4 and last["curriculum"]["budget"] == 3  # 1 planned + 2 handed on
    assert last["curriculum"]["advanced_early"] is None
    patient = AdaptiveRule(truncated_share=0.5, min_steps=10)  # the rule waits: the phase trains as planned
    kept = read_manifest(train_phase("babyai", 0, 1, 2, tiny_model_dir, tmp_path / "q0", config=CONFIG, url=url,
                                     adaptive=patient))
    assert kept["global_step"] == 2 and kept["curriculum"]["unused_steps"] == 0


def test_a_checkpoint_is_hashed_when_written_and_verified_once_when_loaded(env_server, tiny_model_dir, tmp_path,
                                                                           monkeypatch) -> None:
    import training.checkpoint as checkpoint

    final = train_phase("babyai", 0, 1, 1, tiny_model_dir, tmp_path / "p", config=CONFIG, url=env_server("babyai"))
    hashed: list[str] = []
    real = checkpoint.sha256_file
    monkeypatch.setattr(checkpoint, "sha256_file", lambda path: hashed.append(path.name) or real(path))
    for _ in range(3):  # metadata reads (report, lineage, the flow's table) never hash
        read_manifest(final)
    assert hashed == []
    train_phase("babyai", 1, 2, 1, final, tmp_path / "next", config=CONFIG, url=env_server("babyai"))
    # the next phase verifies its init once (every file, once); writing its own checkpoint hashes each new file once
    written = read_manifest(tmp_path / "next" / "final")["files"]
    names = [name.removeprefix("state/") for name in [*read_manifest(final)["files"], *written]]
    assert sorted(hashed) == sorted(names)


def test_the_observation_after_a_cut_trajectorys_last_turn_changes_no_trained_log_prob(tiny_policy) -> None:
    """A trajectory cut by the turn cap ends with the observation that came after its last turn (mask 0): being
    after the last agent token, it cannot change any agent token's log-prob, so the update trains the same."""
    from training.rl.losses import policy_forward

    model, _ = tiny_policy
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(1, 40)
    mask[0, 10:18] = 1  # an agent turn; 18-39: the trailing observation
    full, _ = policy_forward(model, ids, torch.ones_like(ids), mask)
    cut, _ = policy_forward(model, ids[:, :18], torch.ones(1, 18, dtype=torch.long), mask[:, :18])
    assert torch.allclose(full[:, 10:18], cut[:, 10:18], atol=1e-5)


def test_chunked_log_probs_give_the_same_values_and_gradients(tiny_policy) -> None:
    """logprob_chunk computes the vocabulary projection a chunk of positions at a time from the final hidden
    states (recomputed in backward): the log-probs and entropies are those of the whole-logits path, and so
    are the gradients (within float rounding of the accumulation)."""
    from training.rl.losses import policy_forward

    model, _ = tiny_policy
    ids = torch.randint(3, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 30)
    mask[:, 9:] = 1
    grads = []
    for chunk in (None, 7):
        model.zero_grad()
        logprobs, entropy = policy_forward(model, ids, torch.ones_like(ids), mask, 0.8, chunk=chunk,
                                           head=model.get_output_embeddings())
        ((logprobs * mask).sum() + (entropy * mask).sum()).backward()
        grads.append((logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    model.zero_grad()
    (whole_lp, whole_ent, whole_g), (chunk_lp, chunk_ent, chunk_g) = grads
    assert whole_lp[:, 9:].abs().sum() > 0 and torch.allclose(whole_lp, chunk_lp, atol=1e-6)
    assert torch.allclose(whole_ent, chunk_ent, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(whole_g, chunk_g, strict=True))
    with pytest.raises(ValueError, match="output embeddings"):
        policy_forward(model, ids, torch.ones_like(ids), mask, chunk=7)


def test_the_memory_levers_train_the_same_step(env_server, tiny_model_dir, tmp_path) -> None:
    """gradient_checkpointing and logprob_chunk change what is kept for the backward pass, not the update: one
    step with both trains the weights the plain step trains (within float rounding), and both are recorded."""
    from safetensors.torch import load_file

    url = env_server("babyai")
    plain = train_phase("babyai", 0, 2, 1, tiny_model_dir, tmp_path / "plain", config=CONFIG, url=url)
    lean_config = CONFIG.model_copy(update={"gradient_checkpointing": True, "logprob_chunk": 5})
    lean = train_phase("babyai", 0, 2, 1, tiny_model_dir, tmp_path / "lean", config=lean_config, url=url)
    assert read_manifest(lean)["config"]["gradient_checkpointing"] is True
    assert read_manifest(lean)["config"]["logprob_chunk"] == 5
    start, a, b = (load_file(f / "model.safetensors") for f in (tiny_model_dir, plain, lean))
    moved = max(float((a[k] - start[k]).abs().max()) for k in a)
    apart = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert moved > 1e-5 and apart < moved / 10, (moved, apart)


def test_the_training_batch_ends_at_the_last_agent_token_and_trains_the_same(tiny_model_dir) -> None:
    # the observation the environment answered the last reply with is never trained on; the attention being causal,
    # it changes no trained token's log-prob: the batch leaves it out (issue 51: a quarter of the bandit's sequences)
    from training.model import load_policy
    from training.rl.experience import collate
    from training.rl.losses import policy_forward
    from training.trajectory import Trajectory

    model, tokenizer = load_policy(tiny_model_dir)
    ids = tokenizer("the agent reads this and then answers", add_special_tokens=False).input_ids
    trajectories = []
    for sample, (reply, tail) in enumerate([(3, 9), (5, 2), (2, 0)]):
        t = Trajectory("bandit_0", 0, sample)
        t.append_prompt(ids)
        t.append_assistant(ids[:reply], [-0.5] * reply)
        t.append_prompt(ids[:tail])  # the last observation
        t.reward = 1.0
        trajectories.append(t)
    exp = collate(trajectories, tokenizer.pad_token_id)
    ends = [len(ids) + reply for reply in (3, 5, 2)]
    assert exp.input_ids.shape[1] == max(ends)
    for row, (t, end) in enumerate(zip(trajectories, ends, strict=True)):
        assert exp.input_ids[row, :end].tolist() == t.input_ids[:end]
        assert exp.attention_mask[row].sum() == end and exp.mask[row].sum() == end - len(ids)
        assert exp.rewards[row, end - 1] == 1.0 and exp.rewards[row].sum() == 1.0
    # the same log-probs as the whole sequences give, within float rounding (the matmul's blocking follows the width)
    width = max(len(t.input_ids) for t in trajectories)
    full = torch.tensor([t.input_ids + [tokenizer.pad_token_id] * (width - len(t.input_ids)) for t in trajectories])
    full_attention = torch.tensor([[1] * len(t.input_ids) + [0] * (width - len(t.input_ids)) for t in trajectories])
    full_mask = torch.zeros_like(full, dtype=torch.float)
    full_mask[:, :exp.mask.shape[1]] = exp.mask
    with torch.no_grad():
        cut, _ = policy_forward(model, exp.input_ids, exp.attention_mask, exp.mask)
        whole, _ = policy_forward(model, full, full_attention, full_mask)
    assert torch.allclose(cut * exp.mask, whole[:, :cut.shape[1]] * exp.mask, atol=1e-5)


def test_one_optimizer_step_per_batch_takes_its_old_logprobs_from_the_update(env_server, bandit_warm_start, tmp_path,
                                                                             monkeypatch) -> None:
    """With one optimizer step on the whole batch, the recomputed old log-probs are the update's own forward pass:
    the trainer makes no pass of their own (issue 51: a forward of the batch per step) and trains the same weights
    within float rounding as with the pass."""
    from safetensors.torch import load_file

    import training.rl.update as update_module

    passes: list[str] = []
    real = update_module.sequence_logprobs

    def counted(model: torch.nn.Module, *args, **kwargs):
        passes.append(type(model).__name__)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(update_module, "sequence_logprobs", counted)
    url = env_server("bandit")
    config = TrainConfig(batch_items=4, n_samples=4, max_new_tokens=16, lr=1e-3, mini_batch_size=16,
                         micro_batch_size=8, kl_coef=0.0, old_logprobs="recompute")
    runs = {}
    for name in ("from the update", "a pass of their own"):
        if name == "a pass of their own":
            monkeypatch.setattr(update_module.PolicyUpdate, "_updates_once", lambda self, exp: False)
        passes.clear()
        final = train_phase("bandit", 0, 1, 1, bandit_warm_start, tmp_path / name.replace(" ", "-"), config=config,
                            url=url)
        metrics = json.loads((tmp_path / name.replace(" ", "-") / "dvclive" / "metrics.json").read_text())
        runs[name] = (load_file(final / "model.safetensors"), metrics["actor"], len(passes))
    shortcut, own = runs["from the update"], runs["a pass of their own"]
    assert (shortcut[2], own[2]) == (0, 1)  # kl_coef 0: no reference pass either
    start = load_file(bandit_warm_start / "model.safetensors")
    moved = max(float((own[0][k] - start[k]).abs().max()) for k in start)
    apart = max(float((own[0][k] - shortcut[0][k]).abs().max()) for k in start)
    assert moved > 1e-4 and apart < 1e-2 * moved  # Adam's first step divides by |gradient|: rounding shows
    for actor in (shortcut[1], own[1]):  # the on-policy check is reported on both paths
        assert actor["sampler_ratio"] == pytest.approx(1.0, abs=1e-3)

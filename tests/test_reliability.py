"""Faults of training and the pipeline (issue 17, items 11-15): a dead environment server stops the phase with a
clear error (no step of made-up zeros), a killed parent takes its server along, a step rerun after a resume is
logged once, staging folders of a killed checkpoint write are cleaned up, and a corrupt manifest is refused by
name without deleting anything."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from envs.launcher import ROOT, start_server, stop_server
from envs.paths import scratch_dir
from training.checkpoint import MANIFEST, CheckpointError
from training.phases.phase_files import remove_stale_staging
from training.phases.trainer import PhaseTrainer, train_phase
from training.rollouts.rollout import RolloutResult, rollout_stats, write_rollout_log
from training.sampler import EnvironmentFailure
from training.settings.config import TrainConfig
from training.trajectory import Trajectory

CONFIG = TrainConfig(batch_items=2, n_samples=2, max_new_tokens=8, lr=1e-4, mini_batch_size=4, micro_batch_size=4,
                     sub_tasks=["GoTo"], failed_rollout_retries=1)


def test_a_dead_env_server_stops_the_phase_with_a_clear_error(tiny_model_dir, tmp_path) -> None:
    url, proc = start_server("babyai")
    try:
        trainer = PhaseTrainer("babyai", 0, 2, 3, tiny_model_dir, tmp_path, CONFIG, url)
    finally:
        stop_server(proc)  # dies before the first rollout and is not restarted
    with pytest.raises(EnvironmentFailure, match=rf"step 0: all 4 trajectories hit environment errors in 2 tries "
                                                 rf".*environment server at {url} is failing"):
        trainer.run()
    assert not (tmp_path / "final").exists()
    assert not (tmp_path / "dvclive" / "plots" / "metrics" / "reward").exists()  # no fake zeros in the curves


def test_a_rollout_without_valid_trajectories_has_no_reward_metrics() -> None:
    failed = Trajectory(item_id="0", group=0, sample=0, input_ids=[1], loss_mask=[0])
    failed.finish("env_error", "ConnectError")
    stats = rollout_stats(RolloutResult([failed]))
    assert stats["env/errors"] == 1.0 and not {"reward/mean", "success/rate", "turns/mean"} & set(stats)


def test_a_step_rerun_after_a_resume_is_logged_once(tmp_path) -> None:
    done = Trajectory(item_id="3", group=0, sample=0, input_ids=[1, 2], loss_mask=[0, 1])
    done.finish("done")
    result = RolloutResult([done, done])
    path = tmp_path / "step-000001.jsonl"
    write_rollout_log(path, result, 1)
    write_rollout_log(path, result, 1)  # the same step again, after a kill and resume
    assert len(path.read_text().splitlines()) == 2
    assert not list(tmp_path.glob(".*"))  # atomic: no temp file left


def test_staging_folders_of_a_killed_write_are_removed_but_a_live_writers_stay(tmp_path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "intermediate").mkdir()
    stale = [tmp_path / "intermediate" / f".tmp-step-000002-{dead.pid}", tmp_path / "intermediate" / ".tmp-step-000003",
             tmp_path / f".tmp-final-{dead.pid}-state", tmp_path / f".old-final-{dead.pid}"]
    live = tmp_path / "intermediate" / f".tmp-step-000004-{os.getpid()}"
    for folder in [*stale, live, tmp_path / "intermediate" / "step-000001"]:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    # a rollout log's atomic write killed before its rename (found by a CI run of the kill -9 test), and a live one
    (tmp_path / "rollouts").mkdir()
    stale_log, live_log = (tmp_path / "rollouts" / f".tmp-step-000000.jsonl-{pid}" for pid in (dead.pid, os.getpid()))
    for log in (stale_log, live_log, tmp_path / "rollouts" / "step-000000.jsonl"):
        log.write_text('{"step": 0}\n')
    assert sorted(remove_stale_staging(tmp_path)) == sorted([*stale, stale_log])
    assert live.exists() and (tmp_path / "intermediate" / "step-000001").exists()
    assert live_log.exists() and (tmp_path / "rollouts" / "step-000000.jsonl").exists()


@pytest.mark.slow
def test_a_corrupt_manifest_is_refused_by_name_and_nothing_is_deleted(env_server, tiny_model_dir, tmp_path) -> None:
    url = env_server("babyai")
    train_phase("babyai", 0, 1, 2, tiny_model_dir, tmp_path, config=CONFIG, url=url)
    shutil.rmtree(tmp_path / "final")  # as if killed before the end: the intermediate checkpoint resumes it
    shutil.rmtree(tmp_path / "final-state", ignore_errors=True)
    manifest = tmp_path / "intermediate" / "step-000001" / MANIFEST
    text = manifest.read_text()
    manifest.write_text(text.replace('"temperature": 1.0', '"temperature": 2.0'))  # a flipped value
    with pytest.raises(CheckpointError, match=rf"{manifest} fails its own recorded sha256"):
        train_phase("babyai", 0, 1, 2, tiny_model_dir, tmp_path, config=CONFIG, url=url)
    manifest.write_text(text[:-40])  # a broken structure
    with pytest.raises(CheckpointError, match=rf"{manifest} is not valid JSON"):
        train_phase("babyai", 0, 1, 2, tiny_model_dir, tmp_path, config=CONFIG, url=url)
    assert (tmp_path / "intermediate" / "step-000001" / "model.safetensors").exists()  # nothing deleted
    manifest.write_text(text)  # repaired: it resumes and finishes
    final = train_phase("babyai", 0, 1, 2, tiny_model_dir, tmp_path, config=CONFIG, url=url)
    assert json.loads((final / MANIFEST).read_text())["global_step"] == 2


def test_a_killed_parent_takes_its_env_server_along(tmp_path) -> None:
    script = ("import sys, time; sys.path.insert(0, sys.argv[1]); from envs.launcher import start_server; "
              "url, proc = start_server('babyai'); print(proc.pid, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", script, str(ROOT)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    server = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 60
    while True:
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{server}/stat") as f:  # a zombie (exited, not yet reaped by init) counts as gone
            if f.read().split(") ")[1].startswith("Z"):
                break
        assert time.monotonic() < deadline, f"the env server {server} outlived its killed parent by 60 s"
        time.sleep(0.2)


def test_sft_leaves_out_over_long_episodes_with_a_count(tiny_model_dir, tmp_path) -> None:
    from training.checkpoint import read_manifest
    from training.settings.config import SFTConfig
    from training.warmstart.sft import sft

    def episode(turns: int) -> list[dict[str, str]]:
        messages = [{"role": "user", "content": "go to the red ball"}, {"role": "assistant", "content": "OK"},
                    {"role": "user", "content": "you see a wall"}]
        for _ in range(turns):
            messages += [{"role": "assistant", "content": "turn left"}, {"role": "user", "content": "you see a wall"}]
        return messages[:-1]

    short, long = episode(1), episode(200)
    config = SFTConfig(epochs=1, batch_size=2, max_tokens=256)
    out = sft(tiny_model_dir, tmp_path / "sft", [short, long, short], config)
    manifest = read_manifest(out)
    assert (manifest["episodes"], manifest["episodes_over_max_tokens"]) == (2, 1)
    with pytest.raises(ValueError, match=r"all 1 SFT episodes are longer than max_tokens=256"):
        sft(tiny_model_dir, tmp_path / "none", [long], config)


def test_a_rejected_push_keeps_the_recorded_lineage_and_says_how_to_push(tmp_path, monkeypatch) -> None:
    """The main job's last step commits dvc.lock and may push it: a git remote that moved on (or refuses) must not
    fail a run whose training is done; the answer names what was not pushed."""
    from tasks.pipeline import version

    def git(cwd, *args: str) -> str:
        done = subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    remote, work, other = tmp_path / "remote.git", tmp_path / "work", tmp_path / "other"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    git(tmp_path, "clone", "-q", str(remote), str(work))
    for name in ("params.yaml", "dvc.yaml", "phases.yaml", "dvc.lock"):
        (work / name).write_text("{}\n")
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=work, check=True)
    git(work, "add", "-A")
    git(work, "commit", "-qm", "start")
    git(work, "push", "-q", "origin", "HEAD")
    git(tmp_path, "clone", "-q", str(remote), str(other))  # someone else pushes first
    (other / "README").write_text("x")
    git(other, "add", "-A")
    git(other, "commit", "-qm", "theirs")
    git(other, "push", "-q", "origin", "HEAD")
    (work / "dvc.lock").write_text("stages: {}\n")  # this run's lineage
    monkeypatch.setenv("SCALINGINTER_ROOT", str(work))
    monkeypatch.setenv("PATH", f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")  # dvc and git, as make runs
    said = version.fn("scalinginter babyai (smoke): 1 phases", "commit", True)
    assert "committed" in said and "NOT pushed to the git remote origin" in said and "git pull --rebase" in said
    assert "scalinginter babyai" in git(work, "log", "-1", "--format=%s")  # the lineage is recorded here


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_ends_bitwise_equal(tiny_model_dir, tmp_path) -> None:
    """SIGKILL at seeded random moments of a phase (mid-rollout, mid-update, mid-checkpoint or mid-log-write, as
    chance has it), resumed each time until it finishes: the same weights as an uninterrupted run, each step
    logged once, no staging folder left."""
    import random

    from tests.test_trainer import FAST, _weights

    with running_server_for_kills() as url:
        def cmd(out) -> list[str]:
            return [sys.executable, "-m", "flows.cli", "train-phase", "babyai", "--phase", "0", "--h", "2", "--steps",
                    "4", "--init", str(tiny_model_dir), "--out", str(out), "--url", url, *FAST]

        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        started = time.monotonic()
        subprocess.run(cmd(tmp_path / "whole"), cwd=ROOT, env=env, check=True, capture_output=True)
        whole_s = time.monotonic() - started
        for seed in range(3):
            rng = random.Random(seed)
            for attempt in range(5):  # a run that finished before its kill moment (the machine got faster) is
                out, kills = tmp_path / f"killed-{seed}-{attempt}", 0  # timed again, and the next one is killed
                while not (out / "final" / MANIFEST).exists():
                    proc = subprocess.Popen(cmd(out), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
                    started = time.monotonic()
                    if kills < 3:
                        try:
                            proc.wait(timeout=rng.uniform(0.3, 1.0) * whole_s)
                        except subprocess.TimeoutExpired:
                            proc.send_signal(signal.SIGKILL)
                            kills += 1
                    assert proc.wait(timeout=600) in (0, -signal.SIGKILL)
                    if kills == 0:
                        whole_s = time.monotonic() - started
                if kills:
                    break
            assert kills >= 1
            assert _weights(out / "final") == _weights(tmp_path / "whole" / "final"), f"seed {seed}"
            for step in range(4):
                lines = (out / "rollouts" / f"step-{step:06d}.jsonl").read_text().splitlines()
                assert len(lines) == 4, f"seed {seed}, step {step}: {len(lines)} records"
            assert not list(out.rglob(".tmp-*")) and not list(out.rglob(".old-*"))


def running_server_for_kills():
    """Its own BabyAI server: killed runs leave their episodes open until reaped."""
    from envs.launcher import running_server

    return running_server("babyai", idle_ttl_s=30)


def test_scratch_dirs_of_killed_processes_are_swept_but_a_live_ones_stay() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    prefix = f"test-scratch-{uuid.uuid4().hex[:8]}-"
    base = Path(tempfile.gettempdir())
    stale_dir, stale_file = base / f"{prefix}{dead.pid}-abc", base / f"{prefix}{dead.pid}-abc-launch.sh"
    stale_dir.mkdir()
    (stale_dir / "state").write_text("left by a SIGKILL")
    stale_file.write_text("#!/bin/sh")
    live = scratch_dir(prefix)  # this process's own
    try:
        again = scratch_dir(prefix)
        assert not stale_dir.exists() and not stale_file.exists()
        assert live.is_dir() and again.is_dir() and live != again
        assert live.name.startswith(f"{prefix}{os.getpid()}-")
    finally:
        for path in base.glob(f"{prefix}*"):
            shutil.rmtree(path, ignore_errors=True)

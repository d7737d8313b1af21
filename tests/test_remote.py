"""The DVC remote on S3 (through s3fs), against a real S3-compatible server on localhost (moto's)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from envs.launcher import launch
from tests.test_pipeline import _sh, _workspace
from training.checkpoint import read_manifest


@pytest.fixture
def s3_server():
    """moto's S3 server on a free port, with test credentials in the environment; stopped afterwards."""
    url, proc = launch(lambda port: [str(Path(sys.executable).parent / "moto_server"), "-p", str(port)],
                       path="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # S3: any 200 answer
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    try:
        boto3.client("s3", endpoint_url=url).create_bucket(Bucket="scalinginter")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.mark.slow
def test_checkpoints_push_to_and_pull_from_s3(s3_server, tmp_path) -> None:
    """Everything a run produces travels through the remote: checkpoints, the evaluation and the report, so a
    worker that pulls finds the whole pipeline up to date."""
    work = _workspace(tmp_path, one_step_phases=2)
    _sh(work, "dvc", "repro", "babyai_report")
    _sh(work, "dvc", "remote", "add", "-d", "s3", "s3://scalinginter/cache")
    _sh(work, "dvc", "remote", "modify", "s3", "endpointurl", s3_server)
    pushed = _sh(work, "dvc", "push")
    assert "pushed" in pushed
    objects = boto3.client("s3", endpoint_url=s3_server).list_objects_v2(Bucket="scalinginter")
    assert objects["KeyCount"] > 0
    expected = read_manifest(work / "runs/babyai/phase-1/final")["hash"]
    produced = {path: (work / path).read_bytes()
                for path in ("runs/babyai/eval/metrics.json", "runs/babyai/eval/per_item.json", "reports/babyai.html")}
    shutil.rmtree(work / ".dvc" / "cache")  # a worker with nothing but the repository and the remote
    for folder in ("runs", "models", "reports"):
        shutil.rmtree(work / folder)
    _sh(work, "dvc", "pull")
    assert read_manifest(work / "runs/babyai/phase-1/final", verify=True)["hash"] == expected  # every sha256 checked
    assert {path: (work / path).read_bytes() for path in produced} == produced
    assert "disagreement" not in _sh(work, "scalinginter", "lineage", "babyai")
    assert "up to date" in _sh(work, "dvc", "status", "babyai_report")  # nothing to rerun after a pull


def _records(work: Path) -> list[tuple]:
    from training.evaluation.lineage import lineage

    records, problems, _ = lineage("babyai", work)
    assert problems == []
    return [(r.stage, r.h, r.steps, r.algorithm, r.parent, r.own) for r in records]


@pytest.mark.slow
def test_two_workers_sharing_only_the_s3_remote_leave_the_lineage_of_one_machine(s3_server, tmp_path) -> None:
    """Worker A trains phase 0 and pushes; worker B, a fresh clone with no files of A's, pulls phase 0 from S3
    and trains phase 1. The chain equals the one a single machine leaves (checkpoints are bitwise
    reproducible on CPU), and B does not retrain phase 0."""
    single = _workspace(tmp_path, name="single", one_step_phases=2)
    _sh(single, "dvc", "repro", "babyai_phase_1")
    # worker A: its own working copy; code and dvc.lock travel by git (a bare origin), artifacts by S3 only
    a = _workspace(tmp_path, name="a", one_step_phases=2)
    _sh(a, "dvc", "remote", "add", "-d", "s3", "s3://scalinginter/cache")
    _sh(a, "dvc", "remote", "modify", "s3", "endpointurl", s3_server)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    _sh(a, *git, "commit", "-qam", "pipeline on the S3 remote")
    _sh(tmp_path, "git", "clone", "-q", "--bare", str(a), str(tmp_path / "origin.git"))
    _sh(a, "git", "remote", "add", "origin", str(tmp_path / "origin.git"))
    ran_a = _sh(a, "dvc", "repro", "babyai_phase_0")
    assert "Running stage 'babyai_phase_0'" in ran_a
    _sh(a, "dvc", "push")
    _sh(a, *git, "add", "dvc.lock")
    _sh(a, *git, "commit", "-qm", "phase 0")
    _sh(a, "git", "push", "-q", "origin", "HEAD")
    # worker B: a fresh clone; phase 0's checkpoint (and the base model) come from S3
    _sh(tmp_path, "git", "clone", "-q", str(tmp_path / "origin.git"), str(tmp_path / "b"))
    b = tmp_path / "b"
    _sh(b, "dvc", "pull", "--with-deps", "babyai_phase_0")
    ran_b = _sh(b, "dvc", "repro", "babyai_phase_1")
    assert "Running stage 'babyai_phase_1'" in ran_b
    assert "Running stage 'babyai_phase_0'" not in ran_b and "Running stage 'build_model'" not in ran_b
    assert _records(b) == _records(single)


@pytest.mark.slow
def test_s3_credentials_come_from_a_prefect_secret_block_and_stay_out_of_messages(s3_server, tmp_path,
                                                                                 monkeypatch) -> None:
    from prefect.blocks.system import Secret
    from prefect.testing.utilities import prefect_test_harness

    from tasks.pipeline import push_artifacts

    repo = tmp_path / "repo"
    repo.mkdir()
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"],
                ["dvc", "remote", "add", "-d", "s3", "s3://scalinginter/secret"],
                ["dvc", "remote", "modify", "s3", "endpointurl", s3_server]):
        _sh(repo, *cmd)
    (repo / "weights.bin").write_bytes(b"\x01" * 1000)
    _sh(repo, "dvc", "add", "weights.bin")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # nothing in the environment: only the block
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SCALINGINTER_ROOT", str(repo))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    secret = {"aws_access_key_id": "AKIASECRETID0000", "aws_secret_access_key": "s3cr3t-key-that-must-not-leak"}
    bucket = boto3.client("s3", endpoint_url=s3_server, aws_access_key_id="x", aws_secret_access_key="y",
                          region_name="us-east-1")
    with prefect_test_harness():
        with pytest.raises(RuntimeError, match="dvc push failed"):  # no block, no environment: no credentials
            push_artifacts()
        Secret(value=secret).save("scalinginter-s3")
        assert push_artifacts()
        assert bucket.list_objects_v2(Bucket="scalinginter", Prefix="secret")["KeyCount"] > 0
        _sh(repo, "dvc", "remote", "modify", "s3", "url", "s3://no-such-bucket/x")
        with pytest.raises(RuntimeError) as failed:  # a failure's message never carries the credentials
            push_artifacts()
    assert secret["aws_secret_access_key"] not in str(failed.value)
    assert secret["aws_access_key_id"] not in str(failed.value)

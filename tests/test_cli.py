"""The command line: `scalinginter serve` starts a real server; bad input gets one clear message."""

from __future__ import annotations

import signal
import sys

import httpx
from typer.testing import CliRunner

from envs.launcher import launch, wait_healthy
from flows.cli import app

runner = CliRunner()


def test_serve_starts_a_server_that_answers_health_and_stops_on_sigint() -> None:
    url, proc = launch(lambda port: [sys.executable, "-m", "flows.cli", "serve", "textcraft", "--port", str(port)])
    try:
        health = wait_healthy(url, proc)
        assert health["env"] == "textcraft" and health["num_items"] == 544
        assert httpx.post(f"{url}/create").status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


def test_unknown_environment_is_one_clear_message() -> None:
    result = runner.invoke(app, ["serve", "minecraft"])
    assert result.exit_code == 2
    assert "unknown environment 'minecraft'" in result.output and "babyai" in result.output


def test_malformed_backend_option_is_one_clear_message() -> None:
    result = runner.invoke(app, ["serve", "textcraft", "--option", "novalue"])
    assert result.exit_code == 2 and "key=value" in result.output


def test_demo_plays_an_expert_episode_through_http() -> None:
    result = runner.invoke(app, ["demo", "textcraft", "--data-idx", "5"])
    assert result.exit_code == 0, result.output
    assert "success=True" in result.output and "turn 1 agent:" in result.output


def said(result) -> str:
    """What a command printed, in one line (rich wraps its errors at the terminal's width)."""
    return " ".join(result.output.split())


def test_the_warm_start_commands_take_a_device_and_refuse_what_they_would_ignore(tmp_path) -> None:
    # --from trains on every successful episode of its files: what chooses expert episodes is an error beside it
    result = runner.invoke(app, ["sft", "babyai", "--from", str(tmp_path), "--sub-task", "GoTo"])
    assert result.exit_code == 2 and "give one or the other" in said(result), result.output
    result = runner.invoke(app, ["sft", "babyai", "--from", str(tmp_path), "--episodes", "8"])
    assert result.exit_code == 2 and "--episodes and --sub-task choose expert episodes" in said(result)
    # --set recorded= is --from by another name: the same refusal beside --episodes, and on its own no default
    # expert items beside it (the stage is parsed and reaches the recorded files, which hold no episode here)
    result = runner.invoke(app, ["sft", "babyai", "--set", f"recorded={tmp_path}", "--episodes", "8"])
    assert result.exit_code == 2 and "--from (or --set recorded=)" in said(result), result.output
    result = runner.invoke(app, ["sft", "babyai", "--from", str(tmp_path), "--set", f"recorded={tmp_path}"])
    assert result.exit_code == 2 and "both name recorded episodes" in said(result), result.output
    result = runner.invoke(app, ["sft", "babyai", "--set", f"recorded={tmp_path}", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "no successful episode in the recorded files" in said(result)
    import torch

    if torch.cuda.is_available():
        return
    # the device, from --device or a work pool's SCALINGINTER_DEVICE, is checked before any work
    for args, env in ((["sft", "babyai", "--device", "cuda:0"], {}),
                      (["rft", "babyai"], {"SCALINGINTER_DEVICE": "cuda:0"}),
                      (["dpo", "babyai"], {"SCALINGINTER_DEVICE": "cuda:0"})):
        result = runner.invoke(app, [*args, "--out", str(tmp_path / args[0])], env=env)
        assert result.exit_code == 2 and "'cuda:0' requested but CUDA is not available" in result.output, \
            (args, result.output)
        assert not (tmp_path / args[0]).exists()

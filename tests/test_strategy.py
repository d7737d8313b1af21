"""Strategies: DeepSpeed ZeRO over two CPU processes (gloo) trains exactly like plain torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from envs.launcher import ROOT
from training.placement.devices import DeviceError, distributed_backend, resolve_device
from training.placement.strategy import exit_rank

EXTENSIONS = ROOT / ".cache" / "torch_extensions"  # DeepSpeed's JIT-built ops, kept between runs


def _check(cmd: list[str]) -> dict:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(EXTENSIONS), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
def test_deepspeed_two_processes_match_the_torch_strategy(tiny_model_dir, zero: int) -> None:
    pytest.importorskip("deepspeed")
    check = ["-m", "training.strategy_check", "--model", str(tiny_model_dir), "--steps", "3"]
    reference = _check([sys.executable, *check, "--strategy", "torch"])
    distributed = _check([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          *check, "--strategy", "deepspeed", "--zero", str(zero)])
    assert distributed["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
    assert reference["losses"][0] != reference["losses"][-1]  # the weights really moved between steps
    # the weights a checkpoint gets: gathered from both ranks' partitions under ZeRO-3, written whole by rank 0
    assert distributed["weights_norm"] == pytest.approx(reference["weights_norm"], rel=1e-6)


RANK_PROGRAM = """
import atexit, sys, time
from pathlib import Path

import torch
import torch.distributed as dist

from training.placement.strategy import exit_rank

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
atexit.register(lambda: (out / f"shutdown-{rank}").write_text("Python's shutdown ran"))
if rank == 0:
    time.sleep(0.5)  # rank 1's collective is still in flight when it gets to exit_rank
value = torch.tensor([rank + 1.0])
value.owner = rank  # Python state on the tensor, as ZeRO-3's partitions carry
work = dist.all_reduce(value, async_op=True)
del value, work  # gloo's worker thread holds the last reference
print(f"rank {rank} printed")  # to a pipe: buffered, not yet written
exit_rank()
(out / f"returned-{rank}").write_text("exit_rank returned")
"""


def test_a_rank_leaves_its_group_and_ends_before_pythons_shutdown(tmp_path) -> None:
    """A ZeRO-3 rank aborted once in CI after its work was done (SIGABRT, "terminate called without an active
    exception": a gloo worker thread released a collective's tensors while the interpreter shut down), and torchrun
    failed the run. Every per-rank program ends with exit_rank: every rank waits for the others, leaves the group,
    and ends with its output written, without Python's shutdown, where no gloo thread can then touch Python."""
    import torch.distributed as dist

    assert not dist.is_initialized()  # (else the call below would end this test process)
    exit_rank()  # in no group: returns
    program = tmp_path / "rank_program.py"
    program.write_text(RANK_PROGRAM)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(program), str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("rank")) == ["rank 0 printed",
                                                                                          "rank 1 printed"]
    assert not list(tmp_path.glob("shutdown-*")) and not list(tmp_path.glob("returned-*"))


def test_device_selection_is_explicit_about_what_is_missing() -> None:
    assert resolve_device("cpu").type == "cpu"
    assert distributed_backend(resolve_device("cpu")) == "gloo"
    if resolve_device("auto").type == "cpu":
        with pytest.raises(DeviceError, match="CUDA is not available"):
            resolve_device("cuda")
        with pytest.raises(DeviceError, match="NPU is not available"):
            resolve_device("npu")
    with pytest.raises(DeviceError, match="unknown device"):
        resolve_device("tpu")


@pytest.mark.slow
def test_train_phase_on_two_deepspeed_ranks_writes_one_whole_checkpoint(env_server, tiny_model_dir, tmp_path) -> None:
    pytest.importorskip("deepspeed")
    from training.checkpoint import read_manifest

    out = tmp_path / "phase"
    # as a GPU work pool would start it: SCALINGINTER_NPROC and SCALINGINTER_DEVICE (the pool's job variables:
    # placement only) relaunch it under torchrun; the strategy and batch are settings (--set, or params.yaml)
    cmd = [sys.executable, "-m", "flows.cli", "train-phase", "bandit", "--h", "1", "--steps", "2",
           "--init", str(tiny_model_dir), "--out", str(out), "--url", env_server("bandit"), "--set", "batch_items=4",
           "--set", "n_samples=2", "--set", "max_new_tokens=8", "--set", "mini_batch_size=4",
           "--set", "micro_batch_size=2", "--set", "strategy=deepspeed", "--set", "zero_stage=2"]
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(EXTENSIONS), "OMP_NUM_THREADS": "1", "SCALINGINTER_NPROC": "2",
           "SCALINGINTER_DEVICE": "cpu"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = read_manifest(out / "final", verify=True)  # every file matches its sha256
    assert {"state/optimizer_rank0.pt", "state/optimizer_rank1.pt", "model.safetensors"} <= set(manifest["files"])
    assert manifest["global_step"] == 2 and manifest["config"]["strategy"] == "deepspeed"
    assert not list(out.glob(".tmp-*"))  # no staging folder left behind
    # the same phase across two "nodes" on localhost (one rank each, torchrun's c10d rendezvous, as on two machines)
    # trains the same weights as one node of two ranks: the head's launch announces itself in the phase folder and
    # `scalinginter follow` (what the other node's worker runs) starts the same command with its rendezvous
    import socket
    import threading
    import time

    import torch
    from safetensors.torch import load_file

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    nodes = tmp_path / "two-nodes"
    two = [c if c != str(out) else str(nodes) for c in cmd]
    node_env = {**env, "SCALINGINTER_NPROC": "1", "SCALINGINTER_NNODES": "2",
                "SCALINGINTER_RDZV_ENDPOINT": f"127.0.0.1:{port}"}
    follower = subprocess.Popen([sys.executable, "-m", "flows.cli", "follow", "bandit", "--watch", str(tmp_path),
                                 "--launches", "1", "--idle-timeout", "300"], cwd=ROOT, env=node_env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    announcements: list[dict] = []

    def watch() -> None:  # what the head announced, while its launch runs
        while follower.poll() is None and not announcements:
            if (nodes / "rendezvous.json").exists():
                announcements.append(json.loads((nodes / "rendezvous.json").read_text()))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    head = subprocess.run(two, cwd=ROOT, env=node_env, capture_output=True, text=True, timeout=600)
    out_text, err = follower.communicate(timeout=600)
    watcher.join()
    assert head.returncode == 0, head.stderr[-3000:]
    assert follower.returncode == 0 and "joined 1 launch" in out_text, out_text + err[-3000:]
    (announced,) = announcements
    assert announced["nnodes"] == 2 and announced["endpoint"] == f"127.0.0.1:{port}"
    assert announced["argv"] == two[3:] and announced["rdzv_id"].startswith("phase-")
    assert not (nodes / "rendezvous.json").exists()  # removed when the launch ended
    one_node = load_file(out / "final" / "model.safetensors")
    two_nodes = load_file(nodes / "final" / "model.safetensors")
    assert one_node.keys() == two_nodes.keys()
    assert all(torch.equal(one_node[k], two_nodes[k]) for k in one_node)
    two_manifest = read_manifest(nodes / "final", verify=True)
    assert two_manifest["global_step"] == 2  # and two ranks, one per node, each its ZeRO partition:
    assert {"state/optimizer_rank0.pt", "state/optimizer_rank1.pt"} <= set(two_manifest["files"])
    # the next phase loads each rank's ZeRO optimizer state (weights_only, with DeepSpeed's own state classes)
    nxt = tmp_path / "next"
    cmd[cmd.index("--init") + 1], cmd[cmd.index("--out") + 1] = str(out / "final"), str(nxt)
    cmd[cmd.index("--steps") + 1] = "1"
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_manifest(nxt / "final")["global_step"] == 3


def test_the_gpu_check_script_runs_a_step_and_reports_its_figures() -> None:
    """benchmarks/gpu_check.py (run on a GPU machine in bf16) at a tiny shape on this CPU: it samples, trains
    and prints its JSON line."""
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--shape", "tiny",
                           "--prompts", "4", "--prompt-tokens", "8", "--new-tokens", "4", "--steps", "2",
                           "--micro-batch", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["device"] == "cpu" and out["generation_tokens_per_s"] > 0 and out["training_tokens_per_s"] > 0
    # the preflight's estimate is printed beside the peak, and it counts the model's weights exactly
    assert out["preflight_parameters"] == out["parameters"]
    assert out["preflight_estimate_gib"] >= 0 and {"policy", "optimizer"} <= set(out["preflight_parts_gib"])


def test_a_follower_joins_each_announced_launch_once_and_stops_when_told(tmp_path, monkeypatch) -> None:
    """``training.placement.nodes``: the head's announcement (a rendezvous id of its own unless one is given, an
    id per launch, the settings' digest; removed after the launch) and the follower's loop: each launch joined
    once even when the rendezvous id repeats, a failed one logged and watched past, a working copy with other
    settings refused, the end by count or idle timeout; `scalinginter follow` refuses a single-node setting."""
    from typer.testing import CliRunner

    from flows.cli import app
    from training.placement.nodes import ANNOUNCEMENT, announced, follow, is_head, join, settings_digest

    root = tmp_path / "copy"
    root.mkdir()
    (root / "params.yaml").write_text("a: 1\n")
    monkeypatch.setenv("SCALINGINTER_NNODES", "2")
    monkeypatch.setenv("SCALINGINTER_RDZV_ENDPOINT", "10.0.0.1:29500")
    monkeypatch.delenv("SCALINGINTER_RDZV_ID", raising=False)
    assert is_head()
    watch = tmp_path / "runs"
    joined: list[str] = []
    with announced(watch / "phase-0", ["train-phase", "babyai", "--phase", "0"], root) as first:
        assert os.environ["SCALINGINTER_RDZV_ID"] == first  # what the head's own torchrun meets at
        record = json.loads((watch / "phase-0" / ANNOUNCEMENT).read_text())
        assert {k: record[k] for k in ("argv", "endpoint", "rdzv_id", "nnodes", "settings")} == {
            "argv": ["train-phase", "babyai", "--phase", "0"], "endpoint": "10.0.0.1:29500", "rdzv_id": first,
            "nnodes": 2, "settings": settings_digest(root)}
        logs: list[str] = []
        runs = follow(watch, root, launches=1, run=lambda r, cwd: joined.append(r["rdzv_id"]) or 3,
                      log=logs.append, poll_s=0.01)
        assert [r["returncode"] for r in runs] == [3] and any("exit code 3" in line for line in logs)
        # a second follower node joins the launch announced now, once, then idles out
        again = follow(watch, root, run=lambda r, cwd: 0, idle_timeout_s=0.05, poll_s=0.01, log=logs.append)
        assert len(again) == 1
        other = tmp_path / "other"  # a working copy whose settings are not the head's: refused, nothing run
        other.mkdir()
        (other / "params.yaml").write_text("a: 2\n")
        assert join(record, other) == 2
    assert not (watch / "phase-0" / ANNOUNCEMENT).exists() and "SCALINGINTER_RDZV_ID" not in os.environ
    # nodes started by hand with one command and a given rendezvous id still meet: the id is kept; each launch is
    # still joined once, told apart by its own launch id
    monkeypatch.setenv("SCALINGINTER_RDZV_ID", "by-hand")
    seen: list[str] = []

    def launch_twice() -> None:
        for k in (1, 2):
            with announced(watch / f"phase-{k}", ["train-phase"], root) as rdzv_id:
                assert rdzv_id == "by-hand"
                while len(seen) < k:
                    time.sleep(0.01)

    import threading
    import time

    head = threading.Thread(target=launch_twice)
    head.start()
    runs = follow(watch, root, launches=2, run=lambda r, cwd: seen.append(r["launch"]) or 0, poll_s=0.01,
                  idle_timeout_s=30)
    head.join()
    assert [r["rdzv_id"] for r in runs] == ["by-hand", "by-hand"] and len(set(seen)) == 2
    assert follow(watch, root, idle_timeout_s=0.05, poll_s=0.01) == []  # nothing announced: idles out
    # the vllm engine across nodes is refused by the phase's one door (each node's ranks would sample from a server
    # that rank 0 never syncs)
    from training.settings.config import ConfigError, load_params
    from training.settings.specs import build_phase_spec

    with pytest.raises(ConfigError, match=r"train\.engine vllm across nodes"):
        build_phase_spec("babyai", 0, 2, 1, tmp_path, tmp_path / "out", load_params(ROOT / "params.yaml"),
                         "smoke", {"engine": "vllm"})
    monkeypatch.setenv("SCALINGINTER_FOLLOWER", "1")
    assert not is_head()  # a follower's own launch announces nothing
    monkeypatch.setenv("SCALINGINTER_NNODES", "1")
    result = CliRunner().invoke(app, ["follow", "babyai"])
    assert result.exit_code == 2 and "set SCALINGINTER_NNODES" in " ".join(result.output.split())

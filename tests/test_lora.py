"""LoRA (issue 21): SFT with adapters trains only the adapters (every base weight bitwise unchanged), and the
checkpoint's merged weights equal base + (alpha / r) B A, with the adapter itself kept in lora/."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import bandit_conversation
from training.checkpoint import read_manifest
from training.lora import LoraSettings, trainable, with_lora
from training.model import load_policy
from training.settings.config import SFTConfig
from training.warmstart.sft import sft


def test_only_the_adapters_train_and_bad_targets_are_named(tiny_model_dir) -> None:
    model, _ = load_policy(tiny_model_dir, torch.device("cpu"))
    wrapped = with_lora(model, LoraSettings(r=2))
    names = trainable(wrapped)
    assert names and all("lora_" in n for n in names)
    with pytest.raises(ValueError, match=r"lora.target_modules \['c_attn'\] are not modules of this model"):
        with_lora(load_policy(tiny_model_dir, torch.device("cpu"))[0], LoraSettings(target_modules=["c_attn"]))


def test_sft_with_lora_merges_base_plus_adapter_and_leaves_the_base_bitwise(tiny_model_dir, tmp_path) -> None:
    settings = LoraSettings(r=4, alpha=8)
    out = sft(tiny_model_dir, tmp_path / "sft", [bandit_conversation("right")] * 8,
              SFTConfig(epochs=4, lr=5e-3, batch_size=8, lora=settings))
    manifest = read_manifest(out, verify=True)
    assert manifest["final_loss"] < manifest["first_loss"] and manifest["config"]["lora"]["r"] == 4
    base, merged = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    adapter = load_file(out / "lora" / "adapter_model.safetensors")
    assert set(base) == set(merged)
    adapted = 0
    for name, weight in base.items():
        module = name.removesuffix(".weight")
        a, b = (adapter.get(f"base_model.model.{module}.lora_{x}.weight") for x in ("A", "B"))
        if a is None:  # not a target: bitwise the base weight
            assert torch.equal(merged[name], weight), name
            continue
        adapted += 1
        assert b.abs().sum() > 0  # the adapter trained
        assert torch.allclose(merged[name], weight + (settings.alpha / settings.r) * b @ a, atol=1e-6), name
    assert adapted == 4 * sum(1 for n in base if n.endswith("self_attn.q_proj.weight"))


def test_an_rl_phase_with_lora_trains_adapters_only_and_resumes_bitwise(env_server, bandit_warm_start,
                                                                        tmp_path) -> None:
    """GRPO with ``lora``: the checkpoints hold the merged weights and the adapter; every weight the adapters do not
    wrap is the start's, bitwise; a run resumed from its step-1 checkpoint ends bitwise equal to an uninterrupted
    one (the adapters and their optimizer state come back); a tampered adapter is refused."""
    import shutil

    from tests.test_trainer import CONFIG
    from training.checkpoint import CheckpointError
    from training.phases.trainer import train_phase

    config = CONFIG.model_copy(update={"sub_tasks": None, "batch_items": 4, "max_new_tokens": 16, "lr": 2e-3,
                                       "lora": LoraSettings(r=4, alpha=8), "save_every": 1, "keep_checkpoints": 3})
    url = env_server("bandit")
    final = train_phase("bandit", 0, 1, 2, bandit_warm_start, tmp_path / "a", config=config, url=url)
    manifest = read_manifest(final, verify=True)
    assert manifest["config"]["lora"]["r"] == 4 and len(manifest["lora"]["adapter_sha256"]) == 64
    base, merged = load_file(bandit_warm_start / "model.safetensors"), load_file(final / "model.safetensors")
    changed = {n for n in base if not torch.equal(base[n], merged[n])}
    assert changed and all(n.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") for n in changed), changed
    # resumed from step 1: the same final, bitwise
    run = tmp_path / "b"
    shutil.copytree(tmp_path / "a", run)
    assert sorted(p.name for p in (run / "intermediate").iterdir()) == ["step-000001"]
    shutil.rmtree(run / "final"), shutil.rmtree(run / "final-state")
    resumed = train_phase("bandit", 0, 1, 2, bandit_warm_start, run, config=config, url=url)
    assert read_manifest(resumed)["hash"] == manifest["hash"]
    assert load_file(resumed / "lora" / "adapter_model.safetensors").keys() == \
        load_file(final / "lora" / "adapter_model.safetensors").keys()
    # an adapter that is not the one the checkpoint recorded is never resumed from
    shutil.rmtree(run / "final"), shutil.rmtree(run / "final-state")
    adapter = run / "intermediate/step-000001/lora/adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(CheckpointError, match="fails its recorded sha256"):
        train_phase("bandit", 0, 1, 2, bandit_warm_start, run, config=config, url=url)

"""LoRA (issue 21): SFT with adapters trains only the adapters (every base weight bitwise unchanged), and the
checkpoint's merged weights equal base + (alpha / r) B A, with the adapter itself kept in lora/."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import bandit_conversation
from training.checkpoint import read_manifest
from training.config import SFTConfig
from training.lora import LoraSettings, trainable, with_lora
from training.model import load_policy
from training.sft import sft


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

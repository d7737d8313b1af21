"""LoRA adapters (peft) for the supervised and preference methods: only the adapters train, the base weights stay
bitwise as they were, and the checkpoint is the merged model (a plain Hugging Face folder every loader, the
evaluation and the next phase read as any other) with the adapter itself beside it in ``lora/``.

    model = with_lora(model, LoraSettings(r=8))    # trainable: the adapters only
    ...train...
    save_lora(model, tmp)                          # tmp/lora/ (adapter) and the merged weights in tmp/
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

#: the adapter's subfolder in a checkpoint (outside its manifest's top-level files, inside its atomic write)
LORA_DIR = "lora"


class LoraSettings(BaseModel):
    """A LoRA adapter: rank, scale (alpha / r), dropout and the modules it wraps."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    r: int = Field(8, ge=1, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="scale numerator: the update is (alpha / r) B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                      description="module names to adapt (Qwen2's attention projections)")


def lora_of_rank(rank: int) -> LoraSettings | None:
    """Adapters of rank ``rank`` (alpha 2r, the attention projections), or None (every weight trains) at 0."""
    if rank < 0:
        raise ValueError(f"a LoRA rank is 0 (no LoRA) or positive, not {rank}")
    return LoraSettings(r=rank, alpha=2.0 * rank) if rank else None


def with_lora(model: Any, settings: LoraSettings) -> Any:
    """``model`` wrapped with fresh adapters; every other parameter frozen."""
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [m for m in settings.target_modules if m not in names]
    if missing:
        raise ValueError(f"lora.target_modules {missing} are not modules of this model: choose among "
                         f"{sorted(n for n in names if n.endswith('proj'))}")
    config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def trainable(model: Any) -> list[str]:
    """Names of the parameters that train."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


#: the adapter's weights file in ``lora/`` (peft's name)
ADAPTER_FILE = "adapter_model.safetensors"
#: peft's name of the one adapter this project trains
ADAPTER = "default"


def merged_state_dict(model: Any) -> dict[str, Any]:
    """The weights of a peft-wrapped model with its adapters folded in (``W + (alpha / r) B A``, computed as peft's
    own merge computes it), under the plain model's parameter names, without changing ``model``: training can go
    on with the same adapters and optimizer state."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {name: module.get_delta_weight(ADAPTER) for name, module in base.named_modules()
              if isinstance(module, LoraLayer)}
    out = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        owner, sep, leaf = key.partition(".base_layer.")
        if sep:
            key = f"{owner}.{leaf}"
            if leaf == "weight" and owner in deltas:
                value = value + deltas[owner].to(value.dtype)
        out[key] = value
    return out


def save_lora(model: Any, folder: Path) -> str:
    """Write the adapter to ``folder/lora`` and the merged weights to ``folder`` (a plain Hugging Face folder),
    leaving ``model`` as it was; returns the adapter file's sha256."""
    from training.checkpoint import sha256_file

    model.save_pretrained(folder / LORA_DIR)
    model.get_base_model().save_pretrained(folder, state_dict=merged_state_dict(model))
    return sha256_file(folder / LORA_DIR / ADAPTER_FILE)


def load_adapter(model: Any, folder: Path, sha256: str | None = None) -> None:
    """Load the adapter weights ``folder/lora`` holds into the peft-wrapped ``model`` (a resume); with ``sha256``,
    refuse a file that does not match it."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from training.checkpoint import CheckpointError, sha256_file

    path = folder / LORA_DIR / ADAPTER_FILE
    if not path.exists():
        raise CheckpointError(f"checkpoint {folder} has no LoRA adapter ({LORA_DIR}/{ADAPTER_FILE})")
    if sha256 is not None and sha256_file(path) != sha256:
        raise CheckpointError(f"checkpoint {folder}: {LORA_DIR}/{ADAPTER_FILE} fails its recorded sha256; refusing "
                              "to load it")
    result = set_peft_model_state_dict(model, load_file(str(path)), adapter_name=ADAPTER)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise CheckpointError(f"checkpoint {folder}: the adapter does not fit this model ({unexpected[:3]} ...)")

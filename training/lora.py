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
    dropout: float = Field(0.0, ge=0, lt=1)
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


def save_lora(model: Any, folder: Path) -> Any:
    """Write the adapter to ``folder/lora`` and the merged model's weights to ``folder``; returns the merged model
    (the adapters are folded in: keep training the wrapped one only before this)."""
    model.save_pretrained(folder / LORA_DIR)
    merged = model.merge_and_unload()
    merged.save_pretrained(folder)
    return merged

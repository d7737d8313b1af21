"""Runs inside the vLLM server's own environment (``--worker-extension-cls training.vllm_worker.WeightLoader``):
imports nothing of the project, only torch and what vLLM hands it.

vLLM's in-place ``reload_weights`` (``POST /collective_rpc``) restores the output head's old tensors when the
embeddings are tied (Qwen2.5 up to 3B, SmolLM2, the tiny policy): its layer-wise reload sees no ``lm_head``
weight in the checkpoint and puts the previous kernel tensors back, so the server would sample from the new
body and the old head (on CPU also a GEMM handle packed from the old weights). ``load_checkpoint`` reloads,
then ties the head to the freshly loaded embeddings again and re-runs its post-load processing.
"""

from __future__ import annotations

import torch


class WeightLoader:
    """Mixed into vLLM's worker: new methods callable through ``POST /collective_rpc``."""

    def load_checkpoint(self, weights_path: str) -> str:
        """Load the HF checkpoint folder ``weights_path`` in place; return what was done (for the server log)."""
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        config = self.model_runner.model_config.hf_text_config  # type: ignore[attr-defined]
        head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
        tied = bool(getattr(config, "tie_word_embeddings", False)) and head is not None and embed is not None
        if tied:
            if head.weight is not embed.weight:
                with torch.no_grad():
                    head.weight.copy_(embed.weight)
            method = getattr(head, "quant_method", None)
            if method is not None:  # on CPU this re-packs the head's GEMM weights (a oneDNN handle) from the new tensor
                method.process_weights_after_loading(head)
        return f"loaded {weights_path}" + (" (output head tied to the embeddings)" if tied else "")

"""Runs inside the vLLM server's own environment (``--worker-extension-cls training.engines.vllm_worker.WeightLoader``):
imports nothing of the project, only torch and what vLLM hands it. The trainer imports the process-group helpers
below as well (they need torch alone), so both ends of a collective weight transfer open their group the same way.

vLLM's in-place ``reload_weights`` (``POST /collective_rpc``) restores the output head's old tensors when the
embeddings are tied (Qwen2.5 up to 3B, SmolLM2, the tiny policy): its layer-wise reload sees no ``lm_head``
weight in the checkpoint and puts the previous kernel tensors back, so the server would sample from the new
body and the old head (on CPU also a GEMM handle packed from the old weights). Every load below reloads, then
ties the head to the freshly loaded embeddings again and re-runs its post-load processing.

Two ways in:
- ``load_checkpoint``: an HF checkpoint folder on the server's file system (the ``disk`` transfer);
- ``weight_group_join`` once, then ``weight_group_receive`` per update: the trainer (rank 0) broadcasts the
  tensors over a process group it shares with every worker (the ``collective`` transfer): gloo between CPU
  processes, NCCL between CUDA devices, HCCL between Ascend NPUs. Nothing touches the disk.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

GROUP_PREFIX = "scalinginter/weights"


def open_weight_group(backend: str, store: Any, rank: int, world_size: int, timeout_s: float) -> Any:
    """A process group of ``world_size`` ranks over ``store`` (a ``TCPStore``) that leaves torch.distributed's
    default group alone (vLLM's workers and a DeepSpeed trainer each have their own): gloo, nccl or hccl."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(GROUP_PREFIX, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    if backend == "hccl":
        import torch_npu  # noqa: F401  (registers the NPU device and HCCL)
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        return ProcessGroupHCCL(prefixed, rank, world_size, options)
    raise ValueError(f"unknown weight-transfer backend {backend!r}: gloo, nccl or hccl")


def broadcast(group: Any, tensor: torch.Tensor) -> Any:
    """Broadcast ``tensor`` from rank 0 of ``group`` in place; the pending work (``.wait()`` it)."""
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    return group.broadcast([tensor], options)


class WeightLoader:
    """Mixed into vLLM's worker: new methods callable through ``POST /collective_rpc``."""

    def _tie_head(self) -> bool:
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
        return tied

    def load_checkpoint(self, weights_path: str) -> str:
        """Load the HF checkpoint folder ``weights_path`` in place; return what was done (for the server log)."""
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        tied = self._tie_head()
        return f"loaded {weights_path}" + (" (output head tied to the embeddings)" if tied else "")

    def weight_group_rank(self) -> int:
        """This worker's rank in a weight group (the trainer is 0); the trainer counts the workers by it."""
        return 1 + int(self.rank)  # type: ignore[attr-defined]

    def weight_group_join(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> int:
        """Join the trainer's weight group (the trainer is rank 0, this worker ``1 + its rank``); return the rank."""
        rank = self.weight_group_rank()
        timeout = datetime.timedelta(seconds=float(timeout_s))
        store = dist.TCPStore(host, int(port), int(world_size), is_master=False, timeout=timeout)
        self._weight_group = (store, open_weight_group(backend, store, rank, int(world_size), float(timeout_s)),
                              backend)
        return rank

    def weight_group_receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> str:
        """Receive the tensors the trainer broadcasts, in this order, and load them in place."""
        group_state = getattr(self, "_weight_group", None)
        if group_state is None:
            raise RuntimeError("no weight group: the trainer must call weight_group_join first")
        _, group, backend = group_state
        device = torch.device("cpu") if backend == "gloo" else self.device  # type: ignore[attr-defined]

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                broadcast(group, tensor).wait()
                yield name, tensor

        stream = tensors()  # streamed: one tensor in flight at a time, never a second copy of the model
        try:
            self.reload_weights(weights_iterator=stream)  # type: ignore[attr-defined]
        finally:
            for _ in stream:  # take every broadcast the loader left (or failed on), so the trainer never hangs
                pass
        tied = self._tie_head()
        return f"received {len(names)} tensors" + (" (output head tied to the embeddings)" if tied else "")

    def weight_group_leave(self) -> str:
        group_state = getattr(self, "_weight_group", None)
        self._weight_group = None
        return "left" if group_state is not None else "no group"

"""Training strategies: who applies a loss to the weights (plain torch, or DeepSpeed ZeRO over ranks).

* ``torch``: one process, CPU or one GPU; AdamW with gradient clipping.
* ``deepspeed``: DeepSpeed's own engine with ZeRO stage 1, 2 or 3, over several processes (launched by
  ``deepspeed`` or ``torchrun``). On a CPU machine DeepSpeed picks its CPU accelerator and gloo; pass a torch
  optimizer so DeepSpeed does not compile its own Adam, and keep ``TORCH_EXTENSIONS_DIR`` cached (the first
  init builds a small communication op).

Both take token-weighted micro-batch losses (already scaled by their share of the mini-batch), so a
mini-batch split across micro-batches or ranks gives the same update as one big batch.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

StateLoader = Callable[[Path, list[type]], dict[str, Any]]


class Strategy(Protocol):
    """What the trainer asks of a strategy."""

    model: torch.nn.Module
    rank: int
    world_size: int

    def forward(self, **inputs: torch.Tensor) -> Any: ...

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None: ...

    def step(self) -> float: ...

    def optimizer_state(self) -> dict[str, Any]: ...

    def load_optimizer_state(self, folder: Path, load: StateLoader) -> bool:
        """Load this rank's optimizer state from a checkpoint folder with ``load`` (path, allowed classes);
        False when the folder has none (a base model)."""
        ...

    def gather_weights(self) -> dict[str, torch.Tensor] | None:
        """The full weights where no rank holds them whole (ZeRO-3): call on every rank, rank 0 gets them; None
        where the model holds them (the other strategies)."""
        ...

    def save_model(self, folder: Path, weights: dict[str, torch.Tensor] | None = None) -> None: ...

    def barrier(self) -> None: ...


class TorchStrategy:
    """Plain torch: backward, clip, AdamW step."""

    rank, world_size = 0, 1

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> None:
        self.model, self.optimizer, self.grad_clip = model, optimizer, grad_clip

    def forward(self, **inputs: torch.Tensor) -> Any:
        return self.model(**inputs)

    def gather_weights(self) -> dict[str, torch.Tensor] | None:
        return None  # the model holds its weights whole

    def save_model(self, folder: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
        self.model.save_pretrained(folder, state_dict=weights)

    def barrier(self) -> None:
        """One process: nothing to wait for."""

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        loss.backward()

    def step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, folder: Path, load: StateLoader) -> bool:
        path = folder / "optimizer_rank0.pt"
        if not path.exists():
            return False
        self.optimizer.load_state_dict(load(path, []))
        return True


class DeepSpeedStrategy:
    """DeepSpeed's engine with ZeRO; gradients are averaged over ranks (data parallel)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float,
                 zero_stage: int = 2, micro_batch_size: int = 1, device: torch.device | None = None) -> None:
        import deepspeed
        import torch.distributed as dist

        if zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
        config = {
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": 1,  # the trainer marks boundaries itself (uneven last mini-batches)
            "gradient_clipping": grad_clip,
            "zero_optimization": {"stage": zero_stage},
            "zero_allow_untested_optimizer": True,
        }
        if not dist.is_initialized():  # gloo on CPU ranks, NCCL on CUDA, HCCL on Ascend: the ranks' own device's
            from training.placement.devices import distributed_backend

            device = device if device is not None else next(model.parameters()).device
            deepspeed.init_distributed(dist_backend=distributed_backend(device))
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        self.model = self.engine.module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def forward(self, **inputs: torch.Tensor) -> Any:
        return self.engine(**inputs)

    def gather_weights(self) -> dict[str, torch.Tensor] | None:
        """ZeRO-3: the weights gathered from every rank's partition, a collective (every rank must call it, or
        they hang); rank 0 gets the state dict, the others None. ZeRO-1/2: None (every rank holds them whole)."""
        if self.engine.zero_optimization_stage() != 3:
            return None
        weights = self.engine._zero3_consolidated_16bit_state_dict()
        return weights if self.rank == 0 else None

    def save_model(self, folder: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
        """The full HF model; under ZeRO-3 ``weights`` must be :meth:`gather_weights`' (gathered by every rank;
        this writes on rank 0)."""
        if self.engine.zero_optimization_stage() == 3 and weights is None:
            raise RuntimeError("ZeRO-3 partitions the weights: gather them on every rank (gather_weights) and pass "
                               "them to save_model on rank 0")
        self.model.save_pretrained(folder, state_dict=weights)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last_micro_batch)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, folder: Path, load: StateLoader) -> bool:
        """Each rank loads its own ZeRO partition (ZeRO takes a list indexed by data-parallel rank); the
        checkpoint must come from as many ranks as this run has, since the partitions follow the rank count."""
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        saved = sorted(folder.glob("optimizer_rank*.pt"))
        if not saved:
            return False
        if len(saved) != self.world_size:
            raise ValueError(f"{folder} holds the ZeRO optimizer partitions of {len(saved)} ranks but this run has "
                             f"{self.world_size}: resume with {len(saved)} processes (SCALINGINTER_NPROC)")
        # ZeRO records its stage, loss scaler and fragment addresses as objects: allow exactly those
        own = load(folder / f"optimizer_rank{self.rank}.pt", [LossScaler, ZeroStageEnum, fragment_address])
        self.optimizer.load_state_dict([own if r == self.rank else None for r in range(self.world_size)])
        return True


def exit_rank(code: int = 0) -> None:
    """End this process, when a launcher (torchrun, deepspeed) started it as one rank of a process group: wait for
    every rank, leave the group, flush what was printed and logged, and exit with ``code`` at once, without
    Python's shutdown. Returns (does nothing) in a process that is in no group.

    Why not a normal exit: gloo's worker threads release the collectives they ran, and with them tensors that carry
    Python objects (DeepSpeed's ZeRO-3 partitions), a moment after the work completes; one that does so while the
    interpreter shuts down aborts the process (SIGABRT, "terminate called without an active exception"), and the
    launcher fails the whole run after its work was done. Destroying the group does not stop those threads while
    DeepSpeed still holds its groups, so the process leaves before the interpreter is torn down.
    """
    import logging

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    dist.destroy_process_group()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def make_strategy(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float,
                 zero_stage: int = 2, micro_batch_size: int = 1, device: torch.device | None = None) -> Strategy:
    """The strategy called ``name`` (torch or deepspeed). The single-process torch strategy is refused under a
    launcher with several ranks (``WORLD_SIZE`` > 1): each rank would train its own copy apart, none averaging
    its gradients with the others."""
    if name == "torch":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:
            raise ValueError(f"strategy torch trains in one process, but {world} ranks were launched "
                             "(SCALINGINTER_NPROC / torchrun): set train.strategy deepspeed "
                             "(--set strategy=deepspeed) or SCALINGINTER_NPROC=1")
        return TorchStrategy(model, optimizer, grad_clip)
    if name == "deepspeed":
        return DeepSpeedStrategy(model, optimizer, grad_clip, zero_stage, micro_batch_size, device)
    raise ValueError(f"unknown strategy {name!r}: choose torch or deepspeed")

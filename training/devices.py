"""Device selection, in one place: cpu, cuda (NVIDIA) or npu (Ascend through torch_npu)."""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch


class DeviceError(RuntimeError):
    """The requested device is not available here; the message says what is."""


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401 - registers torch.npu

    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


#: a work pool's job variable that places every stage's model (train-phase, warm-start stages, evaluation)
PLACEMENT_VAR = "SCALINGINTER_DEVICE"


def placement(default: str = "cpu") -> str:
    """The device a work pool places the work on (``SCALINGINTER_DEVICE``), else ``default``: placement only,
    never a DVC param (the same settings give the same run on any machine the pool puts it on)."""
    return os.environ.get(PLACEMENT_VAR) or default


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` picks cuda, then npu, then cpu; an explicit name must be available."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("npu") if npu_available() else torch.device("cpu")
    kind = name.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {name!r} requested but CUDA is not available: use --device cpu or auto")
    if kind == "npu" and not npu_available():
        raise DeviceError(f"device {name!r} requested but torch_npu / an Ascend NPU is not available")
    if kind not in {"cpu", "cuda", "npu"}:
        raise DeviceError(f"unknown device {name!r}: choose auto, cpu, cuda[:N] or npu[:N]")
    return torch.device(name)


def distributed_backend(device: torch.device) -> str:
    """The torch.distributed backend for a device: nccl (cuda), hccl (npu), gloo (cpu)."""
    return {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[None]:
    """Mixed precision for forward passes: ``bf16`` autocasts matmuls to bfloat16, ``fp32`` changes nothing.

    Weights, gradients and optimizer state stay float32 either way; log-probs are computed in float32
    from the logits (``policy_forward`` upcasts them).
    """
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision != "bf16":
        raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)

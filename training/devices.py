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


def replica_placement(index: int, count: int) -> tuple[list[int] | None, dict[str, str]]:
    """Where replica ``index`` of ``count`` side-by-side servers runs: (the CPU cores to pin it to, or None; the
    environment variables that give it its own accelerator). On a CUDA or Ascend machine each replica takes one
    visible device (the ``index``-th of those this process sees); on a CPU each takes an even share of this
    process's cores, its threads capped to them. One replica: None and nothing (the server's own defaults)."""
    if count == 1:
        return None, {}
    device = resolve_device("auto")
    if device.type in ("cuda", "npu"):
        var = "CUDA_VISIBLE_DEVICES" if device.type == "cuda" else "ASCEND_RT_VISIBLE_DEVICES"
        visible = os.environ.get(var)
        devices = visible.split(",") if visible else [str(i) for i in range(
            torch.cuda.device_count() if device.type == "cuda" else torch.npu.device_count())]  # type: ignore[attr-defined]
        if count > len(devices):
            raise ValueError(f"{count} policy server replicas need {count} devices; {len(devices)} are visible")
        return None, {var: devices[index]}
    cores = sorted(os.sched_getaffinity(0))
    if count > len(cores):
        raise ValueError(f"{count} policy server replicas need a CPU core each; this process may use {len(cores)}")
    share = cores[index * len(cores) // count:(index + 1) * len(cores) // count]
    return share, {"OMP_NUM_THREADS": str(len(share))}

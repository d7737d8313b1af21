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
    never a DVC param (the same settings give the same run on any machine the pool puts it on). The one reader
    of the variable: the phase's, the evaluation's and the warm-start stages' settings all take it from here."""
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


def rank_device_name(name: str, local_rank: int | None, world_size: int, visible: int | None = None) -> str:
    """The device one rank of ``world_size`` trains on, from the setting ``name`` and its ``LOCAL_RANK``: on one
    process ``name`` itself; on several, an accelerator setting (``cuda``, ``cuda:0``, ``npu`` ...) gives each rank
    its own, ``<kind>:<local_rank>`` (an index in the setting names the kind, not the device: every rank on device
    0 would hold ``world_size`` copies of the policy and the reference), and ``cpu`` stays ``cpu``. ``visible``:
    the accelerators this node shows (a rank past them is refused, naming the setting to change)."""
    if world_size <= 1 or local_rank is None:
        return name
    kind = name.split(":")[0]
    if kind not in ("cuda", "npu"):
        return name
    if visible is not None and local_rank >= visible:
        raise DeviceError(f"local rank {local_rank} has no {kind} device of its own: this node shows {visible}; "
                          f"set SCALINGINTER_NPROC to at most {visible} (one rank per device)")
    return f"{kind}:{local_rank}"


def rank_device(name: str = "auto") -> torch.device:
    """The device this process trains on, set as the current device before anything is loaded: ``name``
    resolved (:func:`resolve_device`), then, under a launcher with several ranks (``WORLD_SIZE`` > 1), moved to
    the rank's own accelerator (:func:`rank_device_name`). The policy, its reference and DeepSpeed's engine all
    live on it."""
    device = resolve_device(name)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = os.environ.get("LOCAL_RANK")
    if world <= 1 or local is None or device.type == "cpu":
        return device
    module = torch.cuda if device.type == "cuda" else torch.npu  # type: ignore[attr-defined]
    device = torch.device(rank_device_name(str(device), int(local), world, module.device_count()))
    module.set_device(device)
    return device


def peak_memory_gib(device: torch.device) -> float | None:
    """The most memory torch has held on an accelerator ``device`` since the process started (GiB); None on the
    CPU, which has no such counter."""
    if device.type not in ("cuda", "npu"):
        return None
    module = torch.cuda if device.type == "cuda" else torch.npu  # type: ignore[attr-defined]
    return float(module.max_memory_allocated(device)) / 2**30


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


#: a work pool's job variable: training processes per node (> 1: torchrun, one rank per device)
NPROC_VAR = "SCALINGINTER_NPROC"
#: a work pool's job variables for a phase across machines: how many nodes, and the rendezvous (host:port) they meet
NNODES_VAR = "SCALINGINTER_NNODES"
RDZV_VAR = "SCALINGINTER_RDZV_ENDPOINT"


def _count(var: str, what: str) -> int:
    """A positive count from the environment variable ``var`` (default 1), refused by name when it is not one."""
    value = os.environ.get(var, "1")
    if not value.isdigit() or int(value) < 1:
        raise DeviceError(f"{var}={value!r}: give the number of {what} (1 or more)")
    return int(value)


def training_ranks() -> int:
    """Training processes per node the work pool asks for (``SCALINGINTER_NPROC``, default 1): the one reader."""
    return _count(NPROC_VAR, "training processes per node")


def training_nodes() -> int:
    """Nodes one phase trains across (``SCALINGINTER_NNODES``, default 1): the one reader."""
    return _count(NNODES_VAR, "nodes one phase trains across")


def launcher_args() -> list[str]:
    """torchrun's arguments for this node, or ``[]`` when one process trains alone (one node, one rank): on one
    node ``--standalone``; across ``SCALINGINTER_NNODES`` nodes, c10d rendezvous at ``SCALINGINTER_RDZV_ENDPOINT``
    (the same host:port on every node, reachable from all; ``SCALINGINTER_RDZV_ID`` tells runs apart), each node
    started with the same command. Every node must see the same run folder (shared storage): rank 0 writes the
    checkpoint and each rank its ZeRO partition."""
    nproc, nodes = training_ranks(), training_nodes()
    if nodes == 1:
        return [] if nproc == 1 else ["--standalone", "--nproc_per_node", str(nproc)]
    endpoint = os.environ.get(RDZV_VAR, "")
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise DeviceError(f"{NNODES_VAR}={nodes} needs {RDZV_VAR}=host:port, the rendezvous every node reaches "
                          f"(got {endpoint!r})")
    return ["--nnodes", str(nodes), "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
            "--rdzv_endpoint", endpoint, "--rdzv_id", os.environ.get("SCALINGINTER_RDZV_ID", "scalinginter")]


def replica_placement(index: int, count: int, offset: int = 0) -> tuple[list[int] | None, dict[str, str]]:
    """Where replica ``index`` of ``count`` side-by-side servers runs: (the CPU cores to pin it to, or None; the
    environment variables that give it its own accelerator). On a CUDA or Ascend machine each replica takes one
    visible device (the ``offset + index``-th of those this process sees: ``offset`` devices are the training
    ranks', see ``policy_server.placement``); on a CPU each takes an even share of this process's cores, its
    threads capped to them. One replica and no offset: None and nothing (the server's own defaults)."""
    if count == 1 and offset == 0:
        return None, {}
    device = resolve_device("auto")
    if device.type in ("cuda", "npu"):
        var = "CUDA_VISIBLE_DEVICES" if device.type == "cuda" else "ASCEND_RT_VISIBLE_DEVICES"
        visible = os.environ.get(var)
        devices = visible.split(",") if visible else [str(i) for i in range(
            torch.cuda.device_count() if device.type == "cuda" else torch.npu.device_count())]  # type: ignore[attr-defined]
        if offset + count > len(devices):
            raise ValueError(f"{count} policy server replicas after {offset} training ranks' devices need "
                             f"{offset + count} devices; {len(devices)} are visible")
        return None, {var: devices[offset + index]}
    if count == 1:
        return None, {}
    cores = sorted(os.sched_getaffinity(0))
    if count > len(cores):
        raise ValueError(f"{count} policy server replicas need a CPU core each; this process may use {len(cores)}")
    share = cores[index * len(cores) // count:(index + 1) * len(cores) // count]
    return share, {"OMP_NUM_THREADS": str(len(share))}

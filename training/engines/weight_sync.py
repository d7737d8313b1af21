"""Keeping a vLLM server's weights those of the trainer: :class:`WeightSync`.

A checkpoint folder is loaded in place (``POST /collective_rpc`` -> :mod:`training.engines.vllm_worker`), or the
weights are broadcast over a :class:`WeightChannel`; the prefix cache is dropped (its KV blocks were computed by the old
weights), and the server's log-probs of a fixed probe sequence are compared with the trainer's: a difference above
the tolerance is an error, never a silent stale policy. Each sync is a :class:`WeightVersion` (global step, content
hash of the weight files, seconds, probe difference).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from envs.paths import scratch_dir
from training.checkpoint import content_hash, sha256_file
from training.engines.engine import EngineError
from training.engines.vllm_engine import VLLMEngine
from training.engines.vllm_server import WORKER_EXTENSION

logger = logging.getLogger(__name__)

def weights_hash(folder: Path) -> str:
    """Content hash of a model folder's weight files (what a sync loads)."""
    files = sorted(Path(folder).glob("*.safetensors")) or sorted(Path(folder).glob("*.bin"))
    if not files:
        raise EngineError(f"{folder} holds no weight files (*.safetensors)")
    return content_hash({p.name: sha256_file(p) for p in files})


@torch.no_grad()
def probe_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """The trainer's log-probs (temperature 1, the model's own precision) of ``ids[1:]``."""
    from training.rl.losses import token_logprobs

    tensor = torch.tensor([ids], device=next(model.parameters()).device)
    was_training = model.training
    model.eval()
    logprobs = token_logprobs(model(tensor).logits, tensor)[0, 1:]
    model.train(was_training)
    return logprobs.tolist()


def probe_sequence(tokenizer: Any) -> list[int]:
    """A fixed sequence in the policy's own chat format (special tokens included): a prompt and a reply."""
    from training.chat_format import ChatFormat

    chat = ChatFormat(tokenizer)
    return chat.prompt([{"role": "user", "content": "Probe: go to the red ball, then open the yellow door."}]) + \
        chat.reply("go forward, turn left, pick up the key")


def sendable_state(weights: torch.nn.Module | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model's (or a state dict's) tensors as a checkpoint holds them: a tensor shared by two names (tied
    embeddings and output head) once, under its first name (the embeddings)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    state = {}
    items = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
    for name, tensor in items.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            state[name] = tensor.detach()
    return state


def tensors_hash(state: dict[str, torch.Tensor], exact: bool | None = None) -> str:
    """Content hash of the tensors a collective sync sends: names, dtypes, shapes and contents, in order.

    ``exact`` (default: for tensors on the CPU) hashes every byte with SHA-256. Tensors on an accelerator are
    fingerprinted where they lie instead (two position-weighted sums of their words per tensor, brought to the host
    in one copy), so a sync never copies a 7B model to the host just to name its version; any change of a value
    or of the order of values changes the fingerprint."""
    digest = hashlib.sha256()
    sums = []
    for name, tensor in state.items():
        digest.update(f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}\n".encode())
        if exact if exact is not None else tensor.device.type == "cpu":
            digest.update(memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
        else:
            sums.append(_fingerprint(tensor))
    if sums:
        digest.update(str(torch.stack(sums).tolist()).encode())
    return digest.hexdigest()


@torch.no_grad()
def _fingerprint(tensor: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """Sum of a tensor's 32-bit words (bytes when its size is not a multiple of 4) and their sum weighted by
    position, in int64 on the tensor's device (wrapping on overflow), a chunk at a time to bound the memory."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    try:
        words = flat.view(torch.int32) if flat.numel() % 4 == 0 else flat
    except RuntimeError:  # a view whose offset is not 4-byte aligned: its bytes then
        words = flat
    total = torch.zeros(2, dtype=torch.int64, device=tensor.device)
    for start in range(0, words.numel(), chunk):
        values = words[start:start + chunk].to(torch.int64)
        weights = torch.arange(start, start + values.numel(), device=tensor.device, dtype=torch.int64) % 65521 + 1
        total[0] += values.sum()
        total[1] += (values * weights).sum()
    return total


class WeightChannel:
    """The trainer's end (rank 0) of a process group it shares with every worker of a vLLM server (the
    ``collective`` transfer): each sync broadcasts the weights tensor by tensor and the workers load them in place
    as they arrive; nothing is written to disk. gloo between CPU processes (so it runs, and is tested, here), NCCL
    between CUDA devices, HCCL between Ascend NPUs: :func:`training.placement.devices.distributed_backend` of the
    trainer's device. ``host`` is the trainer's address as the server's workers reach it."""

    def __init__(self, engine: VLLMEngine, backend: str, host: str = "127.0.0.1", timeout_s: float = 300.0) -> None:

        import torch.distributed as dist

        from training.engines.vllm_worker import open_weight_group

        self.engine, self.backend, self.timeout_s, self.broken = engine, backend, timeout_s, ""
        try:
            workers = len(engine.rpc("weight_group_rank"))
        except EngineError as err:
            if "unreachable" in str(err):
                raise
            raise EngineError(f"{err}; the collective weight transfer needs the server started with "
                              f"--worker-extension-cls {WORKER_EXTENSION} (start_vllm does)") from err
        self.world_size = 1 + workers
        self.store = dist.TCPStore(host, 0, self.world_size, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        opened: dict[str, Any] = {}

        def open_group() -> None:  # blocks until every worker has joined
            try:
                opened["group"] = open_weight_group(backend, self.store, 0, self.world_size, timeout_s)
            except BaseException as err:  # reported below
                opened["error"] = err

        thread = threading.Thread(target=open_group, name="weight-group", daemon=True)
        thread.start()
        engine.rpc("weight_group_join", host=host, port=self.store.port, world_size=self.world_size,
                   backend=backend, timeout_s=timeout_s)
        thread.join(timeout_s)
        if "group" not in opened:
            raise EngineError(f"the weight group with {engine.url}'s {workers} worker(s) did not form "
                              f"({backend}, {host}:{self.store.port}): {opened.get('error', 'timed out')}")
        self.group = opened["group"]

    def send(self, state: dict[str, torch.Tensor]) -> None:
        """Broadcast ``state`` (name -> tensor, in a checkpoint's names) to the server; return once it is loaded."""
        from training.engines.vllm_worker import broadcast

        if self.broken:
            raise EngineError(f"the weight group with {self.engine.url} broke earlier ({self.broken}); restart "
                              "the phase (it resumes from its last checkpoint)")
        gloo = self.backend == "gloo"
        tensors = [(t.cpu() if gloo else t).contiguous() for t in state.values()]
        meta = {"names": list(state), "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                "shapes": [list(t.shape) for t in tensors]}
        with ThreadPoolExecutor(max_workers=1) as pool:
            loaded = pool.submit(self.engine.rpc, "weight_group_receive", **meta)
            works = [broadcast(self.group, t) for t in tensors]  # queued in order; the workers take them in order
            try:
                loaded.result()
            except BaseException as err:
                self.broken = f"{type(err).__name__}: {err}"[:300]
                raise EngineError(f"the policy server {self.engine.url} did not load the broadcast weights: "
                                  f"{err}") from err
            for work in works:
                work.wait()

    def close(self) -> None:
        """Leave the group on the server's side too (a later channel forms a new one)."""
        with contextlib.suppress(EngineError, httpx.HTTPError):
            self.engine.rpc("weight_group_leave")
        self.group = self.store = None


@dataclass(frozen=True)
class WeightVersion:
    """What the server samples from after a sync."""

    step: int
    hash: str
    seconds: float
    probe_max_diff: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class WeightSync:
    """Keeps a vLLM server's weights equal to the trainer's model, verified by a probe after every load."""

    def __init__(self, engine: VLLMEngine, probe_ids: list[int], tolerance: float = 1e-3,
                 adapter_base: Path | None = None, channel: WeightChannel | None = None) -> None:
        if len(probe_ids) < 2:
            raise ValueError("the probe needs at least two tokens")
        self.engine, self.probe_ids, self.tolerance = engine, list(probe_ids), tolerance
        self.adapter_base = adapter_base  # LoRA training: the server keeps these weights, each sync an adapter
        self.channel = channel  # the collective transfer: weights broadcast, never written to disk
        self.workdir = scratch_dir("scalinginter-sync-")
        self.version: WeightVersion | None = None
        self.syncs = 0

    @classmethod
    def serving(cls, url: str, tokenizer: Any, model: torch.nn.Module, folder: Path, step: int = 0,
                tolerance: float = 1e-3, adapter_base: Path | None = None, transport: str = "disk",
                backend: str = "gloo", host: str = "127.0.0.1", state: dict[str, torch.Tensor] | None = None,
                ) -> WeightSync:
        """A sync with the server at ``url`` that serves ``folder`` (``model``'s checkpoint), verified. With
        ``adapter_base`` (``model`` is a peft model training LoRA adapters on those weights): the server loads the
        base once, then ``model``'s adapter in place, and every later sync replaces only the adapter.

        ``transport``: ``disk`` loads checkpoint folders the server reads from the shared file system;
        ``collective`` opens a :class:`WeightChannel` (``backend`` gloo, nccl or hccl; ``host`` the trainer's
        address as the server reaches it) and broadcasts ``model``'s weights (or ``state``, when only this rank
        holds them whole) for every sync, the first included."""
        if transport not in ("disk", "collective"):
            raise ValueError(f"weight transfer {transport!r}: disk or collective")
        engine = VLLMEngine(url, tokenizer.eos_token_id)
        channel = None
        if transport == "collective" and adapter_base is None:  # an adapter is a few MB: it goes by file
            try:
                channel = WeightChannel(engine, backend, host)
            except BaseException:
                engine.close()
                raise
        sync = cls(engine, probe_sequence(tokenizer), tolerance, adapter_base, channel)
        try:
            if adapter_base is not None:
                sync.engine.load_weights(adapter_base)
                sync.push(model, step)
            elif channel is not None:
                sync.push(model, step, state=state)
            else:
                sync.push(model, step, folder=folder)
        except BaseException:  # a first load that fails (or fails its probe) leaves no client, group or files
            sync.close()
            raise
        return sync

    def verify(self, model: torch.nn.Module) -> float:
        """Max abs difference between each live server's and ``model``'s probe log-probs; an error above
        tolerance."""
        local = torch.tensor(probe_logprobs(model, self.probe_ids))
        worst = 0.0
        # a server down since the load is dropped; the others are checked
        for server, served in self.engine.each_live(lambda server: self.engine.prompt_logprobs(self.probe_ids, server)):
            diff = float((torch.tensor(served) - local).abs().max())
            if not diff <= self.tolerance:
                raise EngineError(f"the policy server {self.engine.urls[server]} serves other weights than the "
                                  f"trainer's: probe log-probs differ by {diff:.3g} (tolerance {self.tolerance:g})")
            worst = max(worst, diff)
        return worst

    def push(self, model: torch.nn.Module, step: int, folder: Path | None = None,
             save: Any = None, state: dict[str, torch.Tensor] | None = None) -> WeightVersion:
        """Load ``folder`` (a checkpoint of ``model``'s weights) or, without it, ``model`` saved by ``save(dir)``
        (default ``model.save_pretrained``) into the server; with a :class:`WeightChannel`, broadcast ``state``
        (default: ``model``'s tensors) instead. Verify; return the new version."""
        started = time.perf_counter()
        written = None
        if self.adapter_base is not None:  # LoRA: the adapter alone (a few MB), loaded in place under a new name
            written = self.workdir / f"adapter-{step:06d}-{self.syncs}"
            model.save_pretrained(written)  # a peft model writes its adapter only
            digest = content_hash({p.name: sha256_file(p) for p in written.glob("*.safetensors")})
            self.engine.load_adapter(f"policy-{step}-{self.syncs}", written)
        elif self.channel is not None:
            tensors = sendable_state(model if state is None else state)
            digest = tensors_hash(tensors)
            self.channel.send(tensors)
            self.engine.reset_cache()
        elif folder is None:
            written = folder = self.workdir / f"step-{step:06d}"
            if folder.exists():
                shutil.rmtree(folder)
            (save or (lambda d: model.save_pretrained(d)))(folder)
        if self.adapter_base is None and self.channel is None:
            digest = weights_hash(folder)
            self.engine.load_weights(folder)
        diff = self.verify(model)
        self.version = WeightVersion(step, digest, round(time.perf_counter() - started, 4), diff)
        self.syncs += 1
        for old in self.workdir.iterdir():  # the server has loaded it; only the newest stays
            if old != written:
                shutil.rmtree(old, ignore_errors=True)
        return self.version

    def close(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.channel is not None:
            self.channel.close()
        self.engine.close()

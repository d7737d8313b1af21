"""Checkpoints: an HF-format model folder plus trainer state, written atomically and verified on load.

A checkpoint holds the model (``config.json``, ``model.safetensors``, tokenizer files and chat template),
the trainer state (``trainer_state.pt``: RNG states, data position, global step; ``optimizer_rank<r>.pt``;
a PPO critic) and ``manifest.json`` (phase index, h, the full config, the parent checkpoint's hash, and
the sha256 of every file). An exported checkpoint (a phase's ``final``) is a clean Hugging Face folder (the
model, its tokenizer, a model card, the manifest) with its trainer state beside it in ``<name>-state/``
(listed in the manifest as ``state/<file>``); intermediate checkpoints keep everything in one folder.
Both folders are written into temporary siblings and renamed into place, state first, so a crash never
leaves a checkpoint whose manifest names files that are not there. A checkpoint whose files fail their
recorded sha256 is refused. Its own hash is a content hash over its files' sha256 (not the run metadata),
so the same training on two machines gives the same hash.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
#: files of the trainer state (never part of an exported model folder)
STATE_FILES = ("trainer_state.pt", "optimizer_rank*.pt", "critic.safetensors")
STATE_SUFFIX = "-state"
STATE = "trainer_state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupted; the message names the file."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def content_hash(files: dict[str, str]) -> str:
    """Identity of a checkpoint's content: sha256 of its sorted ``name:sha256`` lines (no run metadata,
    so the same weights and state trained on two machines have the same hash)."""
    return hashlib.sha256("".join(f"{n}:{h}\n" for n, h in sorted(files.items())).encode()).hexdigest()


def checkpoint_hash(folder: Path) -> str:
    """The checkpoint's own hash, as recorded in its manifest."""
    return str(read_manifest(folder)["hash"])


#: the manifest's hash of itself (every other key), so an edited or corrupted manifest is refused
SELF_HASH = "manifest_sha256"


def _manifest_hash(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != SELF_HASH}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _parse_manifest(path: Path) -> dict[str, Any]:
    """A manifest whose structure and self-hash hold, or a CheckpointError naming the file."""
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON (corrupted?): {err}") from err
    if not isinstance(manifest, dict) or not {"files", "hash"} <= set(manifest) or \
            not isinstance(manifest["files"], dict):
        raise CheckpointError(f"{path} lacks the checkpoint's file list or hash (corrupted or not a checkpoint)")
    if SELF_HASH in manifest and manifest[SELF_HASH] != _manifest_hash(manifest):
        raise CheckpointError(f"{path} fails its own recorded sha256 (corrupted or edited); refusing to use it")
    return manifest


def folder_hash(folder: Path) -> str:
    """A checkpoint's hash, or the same content hash computed over a plain model folder's files."""
    if (folder / MANIFEST).exists():
        return checkpoint_hash(folder)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist")
    return content_hash({p.name: sha256_file(p) for p in folder.iterdir() if p.is_file()})


def staging_folder(folder: Path, shared: bool = False) -> Path:
    """The temporary sibling a checkpoint is written into; ``shared`` (several ranks write) omits the pid."""
    return folder.parent / (f".tmp-{folder.name}" if shared else f".tmp-{folder.name}-{os.getpid()}")


def prepare_staging(tmp: Path) -> None:
    """An empty staging folder (left-overs of a killed run are removed)."""
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()


def state_folder(checkpoint: Path) -> Path:
    """Where ``checkpoint``'s trainer state is: beside an exported checkpoint (``final`` -> ``final-state``),
    else inside the checkpoint itself."""
    beside = checkpoint.parent / f"{checkpoint.name}{STATE_SUFFIX}"
    return beside if beside.is_dir() else checkpoint


def _file(folder: Path, name: str) -> Path:
    """A manifest entry's file: ``state/<file>`` lives in the state folder beside the checkpoint."""
    return state_folder(folder) / name[len("state/"):] if name.startswith("state/") else folder / name


def write_checkpoint(folder: Path, write_files: Callable[[Path], None], record: dict[str, Any],
                     tmp: Path | None = None, export: bool = False) -> str:
    """Write a checkpoint atomically: ``write_files(tmp)`` fills a temporary folder, a manifest is added,
    then the folder is renamed to ``folder`` (replacing an older one). Returns the checkpoint's hash.
    Pass ``tmp`` when other processes already wrote their part into a shared staging folder. With ``export``
    the trainer state moves to ``<folder>-state`` beside it, which is renamed into place first."""
    if tmp is None:
        tmp = staging_folder(folder)
        prepare_staging(tmp)
    state_tmp = tmp.parent / f"{tmp.name}{STATE_SUFFIX}"
    try:
        write_files(tmp)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        if export:
            prepare_staging(state_tmp)
            for name in [n for n in files if any(fnmatch.fnmatch(n, pattern) for pattern in STATE_FILES)]:
                (tmp / name).rename(state_tmp / name)
                files[f"state/{name}"] = files.pop(name)
        manifest = json.loads(json.dumps({**record, "files": files, "hash": content_hash(files)}, default=str))
        manifest[SELF_HASH] = _manifest_hash(manifest)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        if export:
            _fsync_dir(state_tmp)
            replace_folder(state_tmp, folder.parent / f"{folder.name}{STATE_SUFFIX}")
        _fsync_dir(tmp)
        replace_folder(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(state_tmp, ignore_errors=True)
        raise
    return checkpoint_hash(folder)


def weights_copy(checkpoint: Path, out: Path) -> Path:
    """A copy of ``checkpoint`` without its trainer state (optimizer, RNG, data position: most of its bytes),
    written atomically to ``out``: what evaluating it needs, not resuming. The source is verified first; the
    copy's manifest keeps the record, lists only the files copied and names the source (``weights_of``: its
    hash). Returns ``out``."""
    source = read_manifest(checkpoint, verify=True)
    kept = [name for name in source["files"]
            if not name.startswith("state/") and not any(fnmatch.fnmatch(name, p) for p in STATE_FILES)]
    record = {k: v for k, v in source.items() if k not in ("files", "hash", SELF_HASH)}

    def write(tmp: Path) -> None:
        for name in kept:
            shutil.copy2(_file(checkpoint, name), tmp / name)

    write_checkpoint(out, write, record | {"weights_of": source["hash"]})
    return out


def replace_folder(new: Path, folder: Path) -> None:
    """Rename the finished folder ``new`` to ``folder``, replacing an older one (never a moment without one)."""
    if folder.exists():
        old = folder.parent / f".old-{folder.name}-{os.getpid()}"
        folder.rename(old)
        new.rename(folder)
        shutil.rmtree(old)
    else:
        new.rename(folder)


def _fsync_dir(folder: Path) -> None:
    for path in folder.iterdir():
        if not path.is_file():  # an intermediate checkpoint's logs/ copy: not part of its content
            continue
        with path.open("rb") as f:
            os.fsync(f.fileno())


#: checkpoints this process has verified, keyed by their folder and every file's inode, size and mtime
_verified: dict[tuple, dict[str, Any]] = {}


def read_manifest(folder: Path, verify: bool = False) -> dict[str, Any]:
    """The manifest of a checkpoint. With ``verify`` (before loading it), every file must match its recorded
    sha256; a process verifies a checkpoint once (a file changed since is verified again), and reading
    metadata never hashes the weights."""
    path = folder / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{folder} is not a checkpoint: {MANIFEST} is missing")
    state = state_folder(folder)
    stats = [(str(p), p.stat()) for d in {folder, state} for p in d.iterdir() if p.is_file()]
    key = (str(folder.resolve()), *sorted((name, st.st_ino, st.st_size, st.st_mtime_ns) for name, st in stats))
    if verify and key in _verified:  # no file changed since this process verified it (stat only, no hashing)
        return _verified[key]
    manifest = _parse_manifest(path)
    if verify:
        for name, expected in manifest["files"].items():
            file = _file(folder, name)
            if not file.exists():
                raise CheckpointError(f"checkpoint {folder}: file {name} is missing")
            if sha256_file(file) != expected:
                raise CheckpointError(f"checkpoint {folder}: file {name} fails its recorded sha256 "
                                      f"(corrupted or edited); refusing to load it")
        _verified[key] = manifest
    return manifest


def list_checkpoints(folder: Path) -> list[Path]:
    """The complete intermediate checkpoints under ``folder`` (``step-NNNNNN``), oldest first."""
    if not folder.exists():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / MANIFEST).exists())


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest complete intermediate checkpoint under ``folder`` (``step-NNNNNN``), if any."""
    steps = list_checkpoints(folder)
    return steps[-1] if steps else None


def prune(folder: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest intermediate checkpoints."""
    steps = sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith("step-"))
    for old in steps[:-keep] if keep > 0 else steps:
        shutil.rmtree(old)


def model_card(record: dict[str, Any], stats: dict[str, float], evaluation: dict[str, Any] | None = None) -> str:
    """A Hugging Face model card (README.md) for a phase's final checkpoint: what it is, where it came from
    (env, h, steps, parent hash) and its last training step's metrics. Deterministic (no timings, no dates),
    so the same training gives the same checkpoint hash; evaluation results live in the run's eval stage
    (``runs/<env>/eval/metrics.json``), which comes after the checkpoint."""
    config = record.get("config", {})
    metrics = {k: stats[k] for k in ("reward/mean", "success/rate", "turns/mean") if k in stats}
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation",
             f"tags: [scalinginter, agentgym-rl, {record['env']}, {record['algorithm']}]", "---", "",
             f"# scalinginter: {record['env']} phase {record['phase']} (h={record['h']})", "",
             f"A policy trained with multi-turn RL under the ScalingInter-RL curriculum on **{record['env']}**: "
             f"curriculum phase {record['phase']} at turn cap h={record['h']}, {record['steps']} planned steps "
             f"(training steps {record['phase_first_step']}..{record['global_step'] - 1}), "
             f"{record['algorithm']}, seed {record['seed']}.", "",
             "| field | value |", "|---|---|",
             f"| environment | {record['env']} |", f"| phase | {record['phase']} |", f"| turn cap h | {record['h']} |",
             f"| steps (planned) | {record['steps']} |", f"| global step | {record['global_step']} |",
             f"| parent checkpoint (sha256 of its files) | `{record['parent']}` |",
             f"| algorithm | {record['algorithm']} |", f"| learning rate | {config.get('lr')} |",
             f"| samples per item | {config.get('n_samples')} |", f"| strategy, precision | "
             f"{config.get('strategy')}, {config.get('precision')} |"]
    lines += [f"| last step {name} | {value:.4f} |" for name, value in metrics.items()]
    if evaluation is not None:  # from the run's eval stage (an export after evaluation)
        low, high = evaluation["success_ci95"]
        lines += ["", f"## Evaluation ({evaluation['items']} held-out items, k={evaluation['k']}, "
                  f"T={evaluation['temperature']}, h={evaluation['h']}, seed {evaluation['seed']})", "",
                  "| metric | value |", "|---|---|",
                  f"| success | {evaluation['success']:.1%} (95% CI {low:.1%}-{high:.1%}) |",
                  f"| Avg@{evaluation['k']} | {evaluation['avg_at_k']:.3f} |",
                  f"| Pass@{evaluation['k']} | {evaluation['pass_at_k']:.1%} |"]
    lines += ["", "Load it with `transformers` (`AutoModelForCausalLM.from_pretrained(folder)`; the tokenizer and "
              "chat template are in the folder). The evaluation of this checkpoint (Avg@k, Pass@k, success with "
              "95% CIs) is in the run's `eval/metrics.json`; `manifest.json` lists every file's sha256 and the "
              "full training config.", ""]
    return "\n".join(lines)

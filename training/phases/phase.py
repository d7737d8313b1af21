"""One curriculum phase as a typed call: what ``scalinginter train-phase``, its DVC stage and the pipeline's
Prefect task all run, with values (never a command line).

    spec = phase_spec("babyai", 1, Path("."))     # h, steps and folders from phases.yaml, settings from params.yaml
    final = run_phase(spec)                        # starts its own servers when no URLs are given
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from envs.files import atomic_write
from envs.launcher import running_replicas
from envs.urls import ServerUrls
from training.checkpoint import MANIFEST
from training.phases.trainer import train_phase
from training.settings.config import mixed_envs
from training.settings.specs import PhaseSpec


def run_phase(spec: PhaseSpec, url: str | None = None, progress: bool = False, policy_url: str | None = None) -> Path:
    """Train phase ``spec`` against the environment server at ``url`` (or comma-separated replicas), or against
    ``spec.server.replicas`` servers started here with ``spec.server``; with ``train.engine: vllm``, sampling from
    the vLLM server at ``policy_url`` or from one started here on the phase's parent checkpoint (every server
    started here is always stopped). Resumes an interrupted phase; returns its final checkpoint folder. A phase
    after a promotion gate that ended the curriculum (``spec.stopped``) trains nothing and passes its start on."""
    if spec.stopped:
        return pass_through(spec, Path("."))
    with contextlib.ExitStack() as stack:
        envs = mixed_envs(spec.env)
        # the servers at ``url`` (parsed once here), or each environment's own started here
        base = ServerUrls.parse(url or {
            e: stack.enter_context(running_replicas(e, **spec.servers.get(e, spec.server).launch_kwargs()))
            for e in envs}, envs)
        if spec.train.engine == "vllm" and policy_url is None and not (spec.out / "final" / MANIFEST).exists():
            from training.engines.vllm_server import running_vllm

            length = spec.policy_server.max_len(spec.train.context_budget, spec.train.max_new_tokens)
            lora = spec.train.lora.r if spec.train.lora is not None else None  # adapters synced in place
            policy_url = stack.enter_context(running_vllm(spec.init, spec.policy_server, length, lora))
        final = train_phase(spec.env, spec.index, spec.h, spec.steps, spec.init, spec.out, config=spec.train,
                            url=base, progress=progress, adaptive=spec.adaptive, policy_url=policy_url,
                            policy_server=spec.policy_server)
    if os.environ.get("RANK", "0") == "0":  # one writer among a phase's ranks
        write_summary(spec.out)
    return final


#: the figures of a phase's last step its DVC metric shows (dvclive's metrics.json keeps every one)
SUMMARY_KEYS = (("reward", "mean"), ("success", "rate"), ("actor", "kl"), ("actor", "entropy"))


def write_summary(out: Path) -> Path:
    """``out/summary.json``: the step and the headline figures of the phase's last step, from its dvclive
    metrics, so that `dvc metrics show` reads as a short row per phase."""
    import json

    from envs.files import atomic_write

    metrics = out / "dvclive" / "metrics.json"
    data = json.loads(metrics.read_text()) if metrics.exists() else {}
    summary: dict[str, float] = {"step": data.get("step", 0)}
    for group, key in SUMMARY_KEYS:
        value = data.get(group, {}).get(key)
        if value is not None:
            summary[f"{group}_{key}"] = value
    path = out / "summary.json"
    atomic_write(path, json.dumps(summary, indent=1))
    return path


def pass_through(spec: PhaseSpec, root: Path) -> Path:
    """Phase ``spec`` after a gate stopped the curriculum: no training; its ``final/`` is the promoted checkpoint
    (files linked, not copied), its summary and metrics say why. Returns the final folder."""
    out = root / spec.out if not spec.out.is_absolute() else spec.out
    source = spec.init if spec.init.is_absolute() else root / spec.init
    final, state = out / "final", out / "final-state"
    for folder in (final, state):
        if folder.exists():
            shutil.rmtree(folder)
    tmp = out / ".tmp-final"
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(source, tmp, copy_function=_link_or_copy)
    beside = source.parent / f"{source.name}-state"
    if beside.is_dir():
        shutil.copytree(beside, state, copy_function=_link_or_copy)
    else:
        state.mkdir(parents=True)
    tmp.rename(final)
    record = {"step": 0, "stopped": 1, "trained_steps": 0}
    for folder in ("rollouts", "dvclive/plots/metrics"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    atomic_write(out / "dvclive" / "metrics.json", json.dumps(record, indent=1))
    atomic_write(out / "summary.json", json.dumps(record | {"passed_on": str(spec.init)}, indent=1))
    return final


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)

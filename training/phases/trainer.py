"""The RL trainer: one curriculum phase at a fixed turn cap h, resumable exactly.

    scalinginter train-phase babyai --phase 0 --h 2 --steps 4 --init models/tiny --out runs/babyai/phase-0

One training step, in the paper's three stages: (1) generate: a rollout of ``batch_items`` items x
``n_samples`` trajectories with at most h turns; (2) prepare experience: old log-probs (the sampler's or
recomputed by the actor), reference log-probs from the frozen base model, advantages (GRPO, RLOO,
REINFORCE++ or PPO/GAE); (3) update the actor over mini-batches for ``ppo_epochs`` epochs. Every
``save_every`` steps and at the end, an atomic checkpoint (``training.checkpoint``) records the weights,
optimizer, RNG states, data position and global step, so rerunning an interrupted phase resumes from its
latest intra-phase checkpoint and ends with bitwise the same weights on CPU.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from envs.urls import ServerUrls
from training.checkpoint import (
    MANIFEST,
    STATE,
    folder_hash,
    latest_checkpoint,
    read_manifest,
    state_folder,
)
from training.guard import Guard, GuardEvent, GuardTrip, lr_scale, read_events, write_events
from training.lora import load_adapter, with_lora
from training.model import load_policy
from training.phases.data import DataStream, MixedData
from training.phases.metrics import Metrics
from training.phases.mixed import MixedRollout, allocation, check_scope, mixed_rollout, shares
from training.phases.phase_files import LOGS, load_state, remove_stale_staging, restore_logs
from training.phases.phase_save import Ledger, PhaseCheckpoints
from training.placement.devices import peak_memory_gib, rank_device
from training.placement.strategy import make_strategy
from training.rl.advantages import flat_rows
from training.rl.critic import ValueModel
from training.rl.experience import collate, experience_stats
from training.rl.losses import loss_weights
from training.rl.update import PolicyUpdate
from training.rollouts.rollout import Rollout, write_rollout_log
from training.sampler import PhaseSampling, build_sampler, train_rollout_config
from training.settings.config import PolicyServerConfig, TrainConfig, mixed_envs
from training.settings.curriculum import AdaptiveRule, adaptive_advance

log = logging.getLogger(__name__)


class PhaseTrainer(PhaseSampling, PolicyUpdate, PhaseCheckpoints):
    """Holds the actor, reference, optimizer and data position of one phase; ``run()`` trains it."""

    def __init__(self, env: str, phase: int, h: int, steps: int, init_checkpoint: Path, out_dir: Path,
                 config: TrainConfig, url: ServerUrls | str | Mapping[str, str], adaptive: AdaptiveRule | None = None,
                 policy_url: str | None = None, policy_server: PolicyServerConfig | None = None) -> None:
        self.env, self.phase, self.h, self.steps, self.config = env, phase, h, steps, config
        self.envs = mixed_envs(env)  # one environment, or a mixed run's several (training.phases.mixed)
        check_scope(self.envs, config)
        self.adaptive = adaptive
        self.out_dir = out_dir
        for folder in ("intermediate", "rollouts"):  # exist even for a 1-step phase or without rollout logs
            (out_dir / folder).mkdir(parents=True, exist_ok=True)
        resume = self._resumable(latest_checkpoint(out_dir / "intermediate"), init_checkpoint)
        source = resume or init_checkpoint
        # verified once before loading: a corrupted or edited file is refused
        manifest = read_manifest(source, verify=True) if (source / MANIFEST).exists() else None
        state_dir = state_folder(source)  # beside an exported checkpoint, inside an intermediate one
        state = load_state(state_dir / STATE) if (state_dir / STATE).exists() else {}
        self.device = rank_device(config.device)  # under several ranks, each its own (LOCAL_RANK), set before loading
        self._setup_model(source, init_checkpoint, resume, manifest)
        self._setup_reference(state, init_checkpoint)
        self._setup_optimizer(source, state_dir, state)
        self._setup_progress(init_checkpoint, resume, manifest, state)
        self._setup_logging(resume)
        self._setup_sampler(url, source, init_checkpoint, policy_url, policy_server)

    def _setup_model(self, source: Path, init_checkpoint: Path, resume: Path | None,
                     manifest: dict[str, Any] | None) -> None:
        """The actor (and its tokenizer) on this rank's device: the source checkpoint's weights, or with LoRA
        adapters on the phase's starting weights (a resume loads the adapters it had trained)."""
        config = self.config
        if config.lora is None:
            self.model, self.tokenizer = load_policy(source, self.device)
        else:
            self.model, self.tokenizer = load_policy(init_checkpoint, self.device)
            torch.manual_seed(config.seed)  # the adapters' initialisation
            self.model = with_lora(self.model, config.lora)
            if resume is not None:
                load_adapter(self.model, resume, (manifest or {}).get("lora", {}).get("adapter_sha256"))
        if config.gradient_checkpointing:  # activations recomputed in backward (training forwards only)
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

    def _setup_reference(self, state: dict[str, Any], init_checkpoint: Path) -> None:
        """The frozen reference the KL term is taken against (the phase's start, or what the resumed run had), on
        the actor's device; none without a KL term."""
        self.reference_path = Path(state.get("reference", init_checkpoint))
        self.reference = None
        if self.config.kl_coef:
            self.reference = load_policy(self.reference_path, self.device)[0].eval().requires_grad_(False)

    def _setup_optimizer(self, source: Path, state_dir: Path, state: dict[str, Any]) -> None:
        """AdamW under the parallel strategy (its state resumed, at this phase's learning rate), and PPO's critic."""
        config = self.config
        optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=config.lr,
                                      weight_decay=config.weight_decay)
        self.strategy = make_strategy(config.strategy, self.model, optimizer, config.grad_clip, config.zero_stage,
                                      config.micro_batch_size, self.device)
        self.optimizer = self.strategy.optimizer
        if self.strategy.load_optimizer_state(state_dir, load_state):
            for group in self.optimizer.param_groups:
                group["lr"] = config.lr  # a new phase may set its own learning rate
        self.critic, self.critic_optimizer = None, None
        if config.algorithm == "ppo":
            self.critic = ValueModel.load(source, self.device, state_dir)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=config.critic_lr)
            if "critic_optimizer" in state:
                self.critic_optimizer.load_state_dict(state["critic_optimizer"])

    def _setup_progress(self, init_checkpoint: Path, resume: Path | None, manifest: dict[str, Any] | None,
                        state: dict[str, Any]) -> None:
        """Where the phase stands: RNG, global step, step budget (the adaptive curriculum's carried steps), the
        guard's history, the cost ledger and the data position."""
        config = self.config
        if "rng" in state:  # every sampling call reseeds from (seed, step, round); this keeps anything else exact
            torch.set_rng_state(state["rng"]["torch"])
        self.global_step = int(state.get("global_step", 0))
        # adaptive curriculum: steps a previous phase left when it advanced early come to this one, so the whole
        # curriculum trains its planned number of steps
        carried = int((manifest or {}).get("curriculum", {}).get("unused_steps", 0)) if resume is None else 0
        self.budget = self.steps + carried
        self.history: list[list[float]] = [list(r) for r in state.get("adaptive_history", [])] if resume else []
        self.advanced: str | None = None
        self.last_stats: dict[str, float] = {}
        # the collapse guard: this run's earlier trips (rollbacks) and the signals since the phase began
        self.identity = {"parent": folder_hash(init_checkpoint), "phase": self.phase, "h": self.h,
                         "steps": self.steps, "config": config.model_dump()}
        self.events = read_events(self.out_dir, self.identity)
        self.guard = Guard(config.guard, json.loads(state.get("guard_history", "[]")) if resume else None)
        last = self.events[-1] if self.events else None
        self.stop_at = last.rolled_back_to if last is not None and last.action == "end_phase" else None
        if resume is not None and manifest is not None:
            self.first_step, self.parent = int(manifest["phase_first_step"]), manifest["parent"]
            self.budget = int(manifest.get("curriculum", {}).get("budget", self.steps))
            cost = manifest.get("cost", {})
            self.ledger = Ledger(int(cost.get("generated_tokens", 0)), int(cost.get("trained_tokens", 0)),
                                 float(cost.get("wall_seconds", 0.0)))
        else:
            self.first_step, self.parent = self.global_step, folder_hash(init_checkpoint)
            self.ledger = Ledger()
        position = int(state.get("data_position", 0))
        self.data = DataStream(self.env, config, position) if len(self.envs) == 1 else \
            MixedData(self.envs, config, position)

    def _setup_logging(self, resume: Path | None) -> None:
        """Rank 0's metrics and rollout logs: restored with a resumed checkpoint, an earlier run's cleared."""
        out_dir = self.out_dir
        self.leader = self.strategy.rank == 0  # only rank 0 logs metrics and writes the shared files
        if self.leader:
            remove_stale_staging(out_dir)
            if resume is not None:
                restore_logs(resume / LOGS, out_dir)
        self.metrics = Metrics(out_dir / "dvclive", resume_at=self.global_step if resume else None) \
            if self.leader else None
        if self.leader and not resume:  # a fresh run: rollout logs of an earlier run with other settings go
            for stale in (out_dir / "rollouts").glob("step-*.jsonl"):
                stale.unlink()

    def _setup_sampler(self, url: ServerUrls | str | Mapping[str, str], source: Path, init_checkpoint: Path,
                       policy_url: str | None, policy_server: PolicyServerConfig | None) -> None:
        """The engine (``training.sampler``) and the rollout over the environment server(s)."""
        config, urls = self.config, ServerUrls.parse(url, self.envs)
        if config.engine == "vllm" and policy_url is None:
            raise ValueError("train.engine vllm samples from a vLLM server: pass its URL (run_phase starts one)")
        server = policy_server or PolicyServerConfig()
        served = config.engine == "vllm"
        # a collective transfer sends the weights themselves: every rank takes part in gathering them (ZeRO-3)
        weights = self.strategy.gather_weights() if served and server.weight_transfer == "collective" else None
        # ZeRO-3 keeps the weights outside the module's parameters, where the hf engine's cache cannot see them change
        zero3 = config.strategy == "deepspeed" and config.zero_stage == 3
        # vllm: every rank samples from the one server; rank 0 keeps it in sync. The server may hold any weights (a
        # parent checkpoint, an earlier run): it serves the very checkpoint this run starts from, the resumed one
        # included, verified before the first rollout; with LoRA it keeps the phase's starting weights and takes
        # each new adapter in place
        sampler = build_sampler(self.model, self.tokenizer, source, policy_url=policy_url if served else None,
                                server=server, device=self.device,
                                prefix_cache_gb=0.0 if zero3 else config.prefix_cache_gb, step=self.global_step,
                                adapter_base=init_checkpoint if config.lora is not None else None, state=weights,
                                syncs=self.strategy.rank == 0)
        if served:
            self.strategy.barrier()
        self.sync = sampler.sync
        engine = sampler.engine
        self.prefix_cache = sampler.prefix_cache  # hf engine: KV kept between turns
        self.stale = False  # the actor changed since the server's last sync
        # max_staleness 1: the next step's rollout, generated while this step updates (its items already taken)
        self.prefetched: tuple[int, Any, dict[str, Any]] | None = None
        self._prefetcher: Any = None
        rollout_config = train_rollout_config(config)
        self.rollout: Rollout | MixedRollout = (
            Rollout(self.env, urls.replicas(), engine, self.tokenizer, rollout_config) if len(self.envs) == 1
            else mixed_rollout(self.envs, urls, engine, self.tokenizer, rollout_config, config))

    def _resumable(self, candidate: Path | None, init_checkpoint: Path) -> Path | None:
        """``candidate`` if it continues this very run (same parent, h, steps and config), else None.

        Intra-phase checkpoints outlive a run (DVC keeps them as persistent outputs). One written by a run
        with other settings or another parent must not be resumed: it is removed and the phase starts over.
        """
        if candidate is None:
            return None
        manifest = read_manifest(candidate, verify=True)  # the one verification: it is the source when resumed
        same = (manifest["parent"] == folder_hash(init_checkpoint) and manifest["h"] == self.h
                and manifest["steps"] == self.steps and manifest["phase"] == self.phase
                and manifest["config"] == json.loads(json.dumps(self.config.model_dump())))
        if not same:
            log.warning("discarding intra-phase checkpoints of an earlier run with other settings in %s",
                        candidate.parent)
            shutil.rmtree(candidate.parent)
            return None
        return candidate

    @property
    def end_step(self) -> int:
        end = self.first_step + self.budget
        return end if self.stop_at is None else min(end, self.stop_at)

    def _set_lr(self, step: int) -> float:
        """The configured learning rate, times the guard's factor for each rollback at or before ``step``."""
        lr = self.config.lr * lr_scale(self.events, step, self.config.guard.lr_factor)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _check_guard(self, step: int, stats: dict[str, float]) -> GuardTrip | None:
        """The guard's verdict on the step, the same on every rank (any rank's trip stops them all)."""
        trip = self.guard.check(step, stats)
        if self.strategy.world_size > 1:
            import torch.distributed as dist

            flag = torch.tensor([float(trip is not None)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0 and trip is None:
                trip = GuardTrip(step, "another rank's signal", float("nan"), float("nan"))
        return trip

    def roll_back(self, trip: GuardTrip) -> GuardEvent:
        """After a trip at step t: drop the checkpoints from step t on (their weights sampled or made the bad
        step), record the event, and leave the newest good checkpoint (or none: the phase's start) to resume."""
        cfg = self.config.guard
        folder = self.out_dir / "intermediate"
        good = [p for p in folder.glob("step-*") if int(p.name[5:]) <= trip.step - 1 and (p / MANIFEST).exists()]
        target = max((int(p.name[5:]) for p in good), default=self.first_step)
        if self.leader:
            for path in folder.glob("step-*"):
                if int(path.name[5:]) > target or target == self.first_step:
                    shutil.rmtree(path)
        lowered = sum(e.action == "lower_lr" for e in self.events)
        action = "lower_lr" if cfg.action == "lower_lr" and lowered < cfg.max_retries else "end_phase"
        scale = cfg.lr_factor ** (lowered + (action == "lower_lr"))
        event = GuardEvent(step=trip.step, signal=trip.signal, value=trip.value, threshold=trip.threshold,
                           action=action, rolled_back_to=target, lr_scale=scale)
        self.events.append(event)
        if self.leader:
            write_events(self.out_dir, self.identity, self.events)
        self.strategy.barrier()
        log.warning("%s phase %d: the collapse guard tripped at step %d (%s); rolled back to step %d and %s",
                    self.env, self.phase, trip.step, trip, target,
                    f"goes on at lr x {scale:g}" if action == "lower_lr" else "ends the phase there")
        return event

    def _advance_early(self, stats: dict[str, float]) -> str | None:
        """Adaptive mode: whether the rule says h should grow now (the phase then ends here), and why."""
        if self.adaptive is None:
            return None
        valid = max(stats.get("rollout/trajectories", 0.0) - stats.get("env/errors", 0.0), 1.0)
        self.history.append([stats.get("rollout/termination/turn_cap", 0.0) / valid, stats["success/rate"]])
        shares, success = [r[0] for r in self.history], [r[1] for r in self.history]
        if not adaptive_advance(self.adaptive, shares, success):
            return None
        if shares[-1] >= self.adaptive.truncated_share:
            return f"{shares[-1]:.0%} of trajectories hit the cap h={self.h}"
        return f"success has not improved for {self.adaptive.plateau_steps} steps"

    def run(self, progress: bool = False) -> Path:
        """Train the remaining steps of the phase; return the final checkpoint folder."""
        from tqdm import tqdm

        steps = tqdm(range(self.global_step, self.end_step), desc=f"{self.env} phase {self.phase} (h={self.h})",
                     disable=not progress, initial=self.global_step - self.first_step, total=self.budget)
        for step in steps:
            started = time.perf_counter()
            self._set_lr(step)
            stats = self.train_step(step)
            self.ledger.wall_seconds += time.perf_counter() - started
            trip = self._check_guard(step, stats)
            if trip is not None:  # nothing of this step is kept: train_phase rolls back and goes on
                self.close()
                raise trip
            self.global_step = step + 1
            self.last_stats = stats
            self.advanced = self._advance_early(stats) if self.global_step < self.end_step else None
            stats |= {"curriculum/h": self.h, "curriculum/phase": self.phase,
                      "guard/trips": float(len(self.events)),
                      "curriculum/advanced_early": float(self.advanced is not None),
                      "timing_s/total": time.perf_counter() - started}
            if self.metrics is not None:
                self.metrics.log(stats, step)
            steps.set_postfix(reward=f"{stats['reward/mean']:.3f}", success=f"{stats['success/rate']:.2f}")
            if self.advanced is not None:
                log.warning("%s phase %d (h=%d) advances early after step %d: %s", self.env, self.phase, self.h,
                            step, self.advanced)
            done = self.global_step == self.end_step or self.advanced is not None
            if done or (self.global_step - self.first_step) % self.config.save_every == 0:
                self.save("final" if done else f"intermediate/step-{self.global_step:06d}")
            if done:
                break
        self.close()
        if self.steps == 0 or not (self.out_dir / "final" / MANIFEST).exists():
            self.save("final")
        return self.out_dir / "final"

    def close(self) -> None:
        """Flush the metrics, drop a prefetched rollout and let go of the policy server."""
        self._drop_prefetched()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.sync is not None:
            self.sync.close()

    def train_step(self, step: int) -> dict[str, float]:
        """Generate, prepare experience, update. Returns the step's metrics."""
        cfg = self.config
        t0 = time.perf_counter()
        self.model.eval()
        if self.prefetched is not None and self.prefetched[0] == step:  # generated while the last step updated
            _, future, served = self.prefetched
            self.prefetched = None
            result = future.result()
            stats = self._sync_policy() | {"rollout/staleness": 1.0}
        else:
            items = self.data.take(cfg.batch_items)[self.strategy.rank::self.strategy.world_size]  # data parallel
            stats = self._sync_policy() | ({"rollout/staleness": 0.0} if cfg.max_staleness else {})
            served = self._served()
            reused = self.prefix_cache.reused_tokens if self.prefix_cache is not None else 0
            result = self._rollout(items, step)
            if self.prefix_cache is not None:  # prompt tokens whose KV came from the conversation's last turn
                stats["rollout/prefix_reused_tokens"] = float(self.prefix_cache.reused_tokens - reused)
        if cfg.max_staleness and step + 1 < self.end_step:
            self._prefetch(step + 1)
        if cfg.log_rollouts and self.leader:
            # each record says where it came from: the environment(s), the phase and its cap, the parent checkpoint
            where = {"env": self.env, "phase": self.phase, "h": self.h, "parent": self.parent}
            write_rollout_log(self.out_dir / "rollouts" / f"step-{step:06d}.jsonl", result, step, where | served)
        self.ledger.generated_tokens += result.generated_tokens
        stats |= result.stats
        t1 = time.perf_counter()
        exp = collate(result.valid, self.tokenizer.pad_token_id)
        flat_groups = None
        if cfg.drop_flat_groups:  # before the log-prob passes, which flat groups would waste
            flat = flat_rows(exp.rewards, exp.group)
            flat_groups = len(torch.unique(exp.group[flat]))
            stats["actor/dropped_trajectories"] = float(flat.sum())
            if bool(flat.all()):
                return stats | {"timing_s/gen": t1 - t0, "actor/skipped": 1.0, "actor/flat_groups": flat_groups}
            exp = exp.select(torch.nonzero(~flat).squeeze(1))
        exp = self.prepare(exp)
        stats |= experience_stats(exp, loss_weights(exp.mask, cfg.loss_agg, cfg.max_new_tokens))
        if flat_groups is not None:
            exp.flat_groups = flat_groups
        t2 = time.perf_counter()
        if cfg.skip_flat_steps and not self._has_signal(exp):
            # every group flat (all samples of each item agree): no policy gradient; Adam would still take a
            # full-size step along the entropy bonus alone, which wrecks a small policy in a few steps
            return stats | {"timing_s/gen": t1 - t0, "timing_s/prep": t2 - t1, "actor/skipped": 1.0,
                            "actor/flat_groups": exp.flat_groups}
        stats |= self.update(exp, step)
        self.stale = True
        t3 = time.perf_counter()
        trained = int(exp.mask.sum()) * cfg.ppo_epochs
        self.ledger.trained_tokens += trained
        peak = peak_memory_gib(self.device)  # on an accelerator: what the preflight's estimate is checked against
        return stats | {"timing_s/gen": t1 - t0, "timing_s/prep": t2 - t1, "timing_s/update": t3 - t2,
                        "perf/tokens_per_s": trained / max(t3 - t2, 1e-9), "actor/flat_groups": exp.flat_groups,
                        **({"perf/peak_memory_gib": peak} if peak is not None else {})}


def train_phase(env: str, phase: int, h: int, steps: int, init_checkpoint: Path | str, out_dir: Path | str, *,
                config: TrainConfig, url: ServerUrls | str | Mapping[str, str], progress: bool = False,
                adaptive: AdaptiveRule | None = None,
                policy_url: str | None = None, policy_server: PolicyServerConfig | None = None) -> Path:
    """Train one curriculum phase at fixed ``h`` from ``init_checkpoint``; resume if interrupted.

    A phase whose final checkpoint exists (and verifies) is not trained again. With ``adaptive`` (the
    curriculum's adaptive mode; not for its last phase, whose h cannot grow), the phase ends early when the rule
    fires, and the steps it leaves go to the next phase; its manifest says when and why.
    """
    out_dir, init_checkpoint = Path(out_dir), Path(init_checkpoint)
    final = out_dir / "final"
    if (final / MANIFEST).exists():
        read_manifest(final, verify=True)
        remove_stale_staging(out_dir)  # a run killed after its final checkpoint's manifest, before its clean-up
        return final
    envs = mixed_envs(env)
    check_scope(envs, config)  # before any server is asked
    urls = ServerUrls.parse(url, envs)
    if config.rollout_mode == "lockstep":  # asynchronous rollouts admit trajectories as instances free instead
        if len(envs) == 1:
            check_capacity(urls, config.batch_items * config.n_samples)
        else:  # each environment's servers hold that environment's share of a step
            counts = allocation({e: s.weight for e, s in shares(envs, config).items()}, config.batch_items)
            for e in envs:
                check_capacity(urls, counts[e] * config.n_samples, e)
    while True:  # each collapse-guard trip rolls back and builds the trainer again from the checkpoint kept
        trainer = PhaseTrainer(env, phase, h, steps, init_checkpoint, out_dir, config, urls, adaptive, policy_url,
                               policy_server)
        try:
            return trainer.run(progress)
        except GuardTrip as trip:
            trainer.roll_back(trip)


class CapacityConfigError(ValueError):
    """A training step needs more live episodes than the environment server can hold."""


def check_capacity(urls: ServerUrls, live: int, env: str | None = None) -> None:
    """Fail before training when one step's ``live`` episodes exceed the simulator/browser pools of ``env``'s
    servers (default: the run's one environment; one server, or replicas whose capacities add up)."""
    from envs.client import server_capacity

    capacities = [server_capacity(u) for u in urls.replicas(env)]
    capacity = None if any(c is None for c in capacities) else sum(c for c in capacities if c)
    if capacity and live > capacity:
        raise CapacityConfigError(f"one step rolls out batch_items x n_samples = {live} episodes at once, but the "
                                  f"environment server holds at most {capacity} (max_jvms / max_contexts): lower "
                                  "batch_items or n_samples, start the server with a larger pool, or set "
                                  "rollout_mode: async (trajectories admitted as instances free)")

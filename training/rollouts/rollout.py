"""The multi-turn rollout: lock-step rounds of one batched generation and one batched environment step.

For a batch of item ids x n samples, each trajectory gets its own environment instance. After the
resets, every round generates one turn for all active trajectories in one engine call, then steps all
of the round's environments in one ``/step_batch`` request, until every trajectory is done or ``h``
rounds have passed (the curriculum's turn cap). Every trajectory has budgets, enforced together and recorded
as what ended it: the turn cap h, tokens per turn (``max_new_tokens``), the context clamp (a next turn that would
overflow ``context_budget``: ``context_cap``), its generated tokens (``token_cap``) and its wall-clock time
since its reset (``time_cap``).

The asynchronous mode (``mode="async"``) drops the rounds: each trajectory moves on its own, generations are
batched by what is ready, and trajectories are admitted as instances free, so one rollout may hold more
trajectories than its servers have instances (SciWorld's JVMs, WebArena's browser contexts).

Replicas: an environment may be served by several servers (``url`` a list). Trajectories are spread over them by
each server's capacity (``/health``), and each round steps every server's share concurrently. A server that
fails (a transport error after the retries) is marked dead: trajectories not yet reset go to the others, and
those it held mid-rollout are rolled out again on the live servers; the failed attempts are counted
(``env/failed_attempts``). Environment failures never become a silent zero reward: transport errors are
retried with backoff, and a trajectory whose environment still fails is marked ``env_error``, excluded from
training and counted. Every instance is closed, also on exceptions and cancellation.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
from tqdm import tqdm

from envs.client import (
    BaseEnvClient,
    ClientLogic,
    EnvServerError,
    StepOutput,
    env_http,
    health_capacity,
    step_many,
)
from envs.registry import client_class
from envs.urls import ServerUrls
from training.chat_format import ChatFormat, opening_messages
from training.engines.engine import Generation, PolicyEngine, SamplingParams
from training.rollouts.rollout_async import AsyncPlay
from training.rollouts.rollout_instances import InstancePool, with_retries
from training.trajectory import TERMINATIONS, Trajectory, Turn

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutConfig:
    """How one rollout runs (the turn cap ``h`` comes from the curriculum, per call)."""

    n_samples: int = 1
    max_new_tokens: int = 64  # per assistant turn
    context_budget: int = 2048  # a trajectory never grows past this many tokens
    max_trajectory_tokens: int | None = None  # a trajectory never generates more than this many tokens in all
    max_trajectory_seconds: float | None = None  # nor runs longer than this (from its reset), checked each turn
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    retries: int = 3  # for retryable environment errors (connection refused, server full)
    backoff_s: float = 0.5  # first retry delay; doubles each time
    system_prompt: str | None = None
    # lockstep: every round generates for all active trajectories, then steps them all. async: each trajectory
    # moves on its own (its next generation as soon as its observation is back), generations batched by what is
    # ready, at most async_batch at once (None: all that are ready), environment steps in flight meanwhile.
    mode: Literal["lockstep", "async"] = "lockstep"
    async_batch: int | None = None


@dataclass
class RolloutResult:
    """The trajectories of one rollout and what it cost."""

    trajectories: list[Trajectory]
    seconds_generating: float = 0.0
    seconds_in_env: float = 0.0
    seconds_total: float = 0.0
    generated_tokens: int = 0
    stats: dict[str, float] = field(default_factory=dict)

    failed_attempts: list[Trajectory] = field(default_factory=list)  # lost with a dead replica, then rolled again
    failed_envs: list[str] = field(default_factory=list)  # a mixed run's environments with no valid trajectory

    @property
    def valid(self) -> list[Trajectory]:
        return [t for t in self.trajectories if t.valid]


class Rollout(InstancePool, AsyncPlay):
    """Runs rollouts of one environment (one server, or several replicas) with one policy engine."""

    def __init__(self, env: str, url: ServerUrls | str | Sequence[str], engine: PolicyEngine, tokenizer: Any,
                 config: RolloutConfig, *, http: httpx.Client | None = None, token: str | None = None) -> None:
        # several servers: a list, or the text of comma-separated URLs (as --url and SCALINGINTER_ENV_URL carry it)
        self.urls = list(ServerUrls.parse(url, [env]).replicas())
        self.env, self.engine, self.config = env, engine, config
        self.url = ",".join(self.urls)
        self.chat = ChatFormat(tokenizer)
        self.client_cls = client_class(env)
        self.https = [http] if http is not None and len(self.urls) == 1 else \
            [env_http(u, token=token, timeout=300.0) for u in self.urls]
        self.http = self.https[0]
        self.dead: set[int] = set()  # replicas that failed; none is tried again by this Rollout
        self.no_batch: set[int] = set()  # servers without /create_batch, /close_batch (AgentGym's): one by one
        self._capacities: list[float] | None = None

    def capacities(self) -> list[float]:
        """How many live instances each server holds at once, from its /health (its simulator or browser pool, or
        its instance limit; infinite when it names neither), read once; an unreachable server holds 0 (it gets
        nothing, and is tried last)."""
        if self._capacities is None:
            capacities = []
            for http in self.https:
                try:
                    capacities.append(float(health_capacity(http.get("/health").json()) or math.inf))
                except (httpx.HTTPError, ValueError):
                    capacities.append(0.0)
            self._capacities = capacities
        return self._capacities

    def weights(self) -> list[float]:
        """Each server's share of the trajectories: its capacity (1 when unbounded); a single server needs no call."""
        if len(self.urls) == 1:
            return [1.0]
        shares = [1.0 if c == math.inf else c for c in self.capacities()]
        return shares if any(shares) else [1.0] * len(shares)

    def run(self, item_ids: Sequence[str], h: int, step: int = 0, progress: bool = False) -> RolloutResult:
        """Roll out ``n_samples`` trajectories per item with at most ``h`` turns each."""
        if h < 1:
            raise ValueError(f"the turn cap h must be >= 1, got {h}")
        started = time.perf_counter()
        trajectories = [Trajectory(item_id, group, sample, tokenizer=self.chat.fingerprint)
                        for group, item_id in enumerate(item_ids) for sample in range(self.config.n_samples)]
        result = RolloutResult(trajectories)
        self._play(result, trajectories, h, step, progress)
        # trajectories a replica lost when it died are rolled out again on the live ones (once)
        lost = [i for i, t in enumerate(trajectories) if t.termination == "env_error" and t.server in self.dead]
        live = len(self.urls) - len(self.dead)
        if lost and live:
            again = [Trajectory(trajectories[i].item_id, trajectories[i].group, trajectories[i].sample,
                                tokenizer=self.chat.fingerprint) for i in lost]
            self._play(result, again, h, step, progress)
            result.failed_attempts = [trajectories[i] for i in lost]
            for i, t in zip(lost, again, strict=True):
                trajectories[i] = t
        result.seconds_total = time.perf_counter() - started
        result.stats = rollout_stats(result)
        return result

    def _play(self, result: RolloutResult, trajectories: list[Trajectory], h: int, step: int, progress: bool) -> None:
        """Reset, then play ``trajectories`` round by round to the end; adds the time and tokens to ``result``."""
        clients: list[BaseEnvClient | None] = [None] * len(trajectories)
        env_seconds = 0.0
        try:
            if self.config.mode == "async":  # resets as instances free, inside the asynchronous loop
                play = self._play_each if getattr(self.engine, "concurrent", False) else self._play_async
                gen_s, env_s, tokens = play(trajectories, clients, h, step)
                result.seconds_generating += gen_s
                env_seconds += env_s
                result.generated_tokens += tokens
                return
            env_seconds += self._reset_all(trajectories, clients)
            rounds = tqdm(range(h), desc=f"{self.env} rollout (h={h})", disable=not progress, leave=False)
            for round_idx in rounds:
                active = [i for i, t in enumerate(trajectories) if t.active]
                if not active:
                    break
                rounds.set_postfix(active=len(active))
                gen_s, env_s, tokens = self._round(trajectories, clients, active, step, round_idx, h)
                result.seconds_generating += gen_s
                env_seconds += env_s
                result.generated_tokens += tokens
        finally:
            env_seconds += self._close_all(clients)
        result.seconds_in_env += env_seconds

    def _begin_many(self, began: Sequence[tuple[Trajectory, ClientLogic, StepOutput]]) -> None:
        """Start each trajectory from its instance's first observation (its opening prompt, encoded with the others'
        in one call; its clock; the budgets that end it before any turn)."""
        cfg = self.config
        for t, client, first in began:
            t.messages = opening_messages(client.conversation_start, first.observation, cfg.system_prompt)
        for (t, _, _), ids in zip(began, self.chat.prompts([t.messages for t, _, _ in began]), strict=True):
            t.append_prompt(ids)
            t.prompt_length = len(t.input_ids)
            t.started = time.perf_counter()
            if t.prompt_length + cfg.max_new_tokens > cfg.context_budget:
                t.finish("context_cap")
            elif cfg.max_trajectory_tokens is not None and cfg.max_new_tokens > cfg.max_trajectory_tokens:
                t.finish("token_cap")

    def _generate(self, trajectories: list[Trajectory], chosen: list[int], step: int, call: int
                  ) -> tuple[list[str], float, int]:
        """One engine call for the ``chosen`` trajectories (seeded by step and call), the turns appended as sampled;
        returns their texts, the seconds it took and the tokens generated."""
        cfg = self.config
        params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                seed=cfg.seed * 1_000_003 + step * 1009 + call)
        started = time.perf_counter()
        if getattr(self.engine, "chat", False):  # a chat API: the messages in, text out, kept in our tokenizer's ids
            answers = self.engine.generate_chat([trajectories[i].messages for i in chosen], params,  # type: ignore
                                                [f"{trajectories[i].item_id}/{trajectories[i].sample}" for i in chosen])
            seconds = time.perf_counter() - started
            texts = [text for text, _ in answers]
            generations = []
            for text, done in answers:  # a reply the model ended closes with the end-of-turn id, as ours do
                ids = self.chat.reply(text) if done else self.chat.encode(text)
                generations.append(Generation(ids, [0.0] * len(ids), done))
        else:
            generations = self.engine.generate([trajectories[i].input_ids for i in chosen], params)
            seconds = time.perf_counter() - started
            texts = [self.chat.decode(g.token_ids) for g in generations]
        for i, g, text in zip(chosen, generations, texts, strict=True):
            trajectories[i].append_assistant(g.token_ids, g.logprobs)
            trajectories[i].messages.append({"role": "assistant", "content": text})
        return texts, seconds, sum(len(g.token_ids) for g in generations)

    def _round(self, trajectories: list[Trajectory], clients: list[BaseEnvClient | None], active: list[int],
               step: int, round_idx: int, h: int) -> tuple[float, float, int]:
        texts, gen_s, tokens = self._generate(trajectories, active, step, round_idx)
        t1 = time.perf_counter()

        def record(positions: list[int], outs: list[StepOutput]) -> None:  # as each server's share comes back
            self._record_many([trajectories[active[p]] for p in positions], [texts[p] for p in positions], outs, h)

        self._step_round([clients[i] for i in active], texts, [trajectories[i].server for i in active], record)
        env_s = time.perf_counter() - t1  # with the observations' tokenisation, overlapped with the other servers
        return gen_s, env_s, tokens

    def _step_round(self, clients: list[Any], texts: list[str], servers: list[int],
                    record: Callable[[list[int], list[StepOutput]], None] | None = None) -> list[StepOutput]:
        """One ``/step_batch`` per server, the servers' shares concurrently; a server whose request fails after
        the retries gives its share env errors (and, if it is unreachable, is marked dead). ``record(positions,
        outputs)`` is called with each server's share as soon as it is back (in that server's thread), so the
        client's work on one share overlaps the other servers' steps."""
        shares: dict[int, list[int]] = {}
        for position, server in enumerate(servers):
            shares.setdefault(server, []).append(position)

        def step_share(server: int) -> list[StepOutput]:
            chosen = shares[server]
            try:
                outs = with_retries(lambda: step_many([clients[p] for p in chosen], [texts[p] for p in chosen],
                                                      partial=True), self.config.retries, self.config.backoff_s)
            except EnvServerError as err:  # the server's whole share failed: each of its trajectories errs
                if err.status_code is None and len(self.urls) > 1:
                    self.dead.add(server)
                outs = [StepOutput("", error=str(err)) for _ in chosen]
            if record is not None:
                record(chosen, outs)
            return outs

        if len(shares) == 1:
            parts = {server: step_share(server) for server in shares}
        else:
            with ThreadPoolExecutor(len(shares)) as pool:
                parts = dict(zip(shares, pool.map(step_share, shares), strict=True))
        outputs: list[StepOutput | None] = [None] * len(clients)
        for server, positions in shares.items():
            for position, out in zip(positions, parts[server], strict=True):
                outputs[position] = out
        return [o for o in outputs if o is not None]

    def _record_many(self, ts: Sequence[Trajectory], texts: Sequence[str], outs: Sequence[StepOutput], h: int) -> None:
        """``_record`` of each step, the observations that continue a trajectory tokenised in one call."""
        going = [k for k, out in enumerate(outs) if out.error is None and not out.done]
        pieces = dict(zip(going, self.chat.observation_pieces([(ts[k].messages, outs[k].observation) for k in going]),
                          strict=True))
        for k, (t, text, out) in enumerate(zip(ts, texts, outs, strict=True)):
            self._record(t, text, out, h, pieces.get(k))

    def _record(self, t: Trajectory, text: str, out: StepOutput, h: int, piece: list[int] | None) -> None:
        """Add a step's outcome to ``t`` and end it by the first budget it meets (the turn cap ``h`` last);
        ``piece``: the observation's ids (None only for a step that ended it: an error or done)."""
        if out.error is not None:
            t.finish("env_error", out.error)
            return
        t.turns.append(Turn(text, out.observation, out.reward, out.score, out.done, malformed=not out.sent))
        t.reward, t.score, t.success = out.reward, out.score, out.success
        if out.done:
            t.finish("done")
            return
        assert piece is not None, "a step that continues its trajectory comes with its observation's ids"
        t.messages.append({"role": "user", "content": out.observation})
        cfg = self.config
        if len(t.input_ids) + len(piece) + cfg.max_new_tokens > cfg.context_budget:
            t.finish("context_cap")
            return
        if cfg.max_trajectory_tokens is not None and sum(t.loss_mask) + cfg.max_new_tokens > cfg.max_trajectory_tokens:
            t.finish("token_cap")  # its next turn could pass the budget
            return
        if cfg.max_trajectory_seconds is not None and time.perf_counter() - t.started > cfg.max_trajectory_seconds:
            t.finish("time_cap")
            return
        t.append_prompt(piece)
        if len(t.turns) >= h:
            t.finish("turn_cap")



def rollout_stats(result: RolloutResult) -> dict[str, float]:
    """Metrics of one rollout, in the project's metric names."""
    valid = result.valid
    ended = Counter(t.termination for t in result.trajectories)
    stats: dict[str, float] = {}
    if valid:  # with no valid trajectory these are missing, never a made-up 0
        rewards = [t.reward for t in valid]
        stats |= {"reward/mean": sum(rewards) / len(rewards), "reward/max": max(rewards), "reward/min": min(rewards),
                  "success/rate": sum(t.success for t in valid) / len(valid),
                  "turns/mean": sum(len(t.turns) for t in valid) / len(valid)}
        turns = [turn for t in valid for turn in t.turns]
        if turns:  # the share of replies with no well-formed action (a collapsing policy's first symptom)
            stats["rollout/invalid_actions"] = sum(turn.malformed for turn in turns) / len(turns)
    stats |= {
        "env/errors": float(ended["env_error"]),
        "rollout/trajectories": float(len(result.trajectories)),
        "timing_s/gen": result.seconds_generating,
        "timing_s/env": result.seconds_in_env,
        "perf/generated_tokens": float(result.generated_tokens),
        "env/failed_attempts": float(len(result.failed_attempts)),
    }
    stats.update({f"rollout/termination/{reason}": float(ended[reason]) for reason in TERMINATIONS})
    return stats


def write_rollout_log(path: Path, result: RolloutResult, step: int, extra: dict[str, Any] | None = None) -> Path:
    """Write the step's log, one JSON line per trajectory (item, conversation, reward, turns, termination, and
    ``extra``, e.g. the weight version the server sampled from), atomically: a step rerun after a resume
    replaces its log, so each step is logged once, and a kill mid-write leaves the old file or the new one."""
    from envs.files import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, "".join(json.dumps({"step": step, **t.log_record(), **(extra or {})}) + "\n"
                               for t in result.trajectories))
    return path

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

import contextlib
import json
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
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
    close_many,
    env_http,
    health_capacity,
    open_many,
    step_many,
)
from envs.registry import client_class
from envs.splits import item_index
from envs.urls import ServerUrls
from training.chat_format import ChatFormat, opening_messages
from training.engine import Generation, PolicyEngine, SamplingParams
from training.trajectory import TERMINATIONS, Trajectory, Turn

T = TypeVar("T")
log = logging.getLogger(__name__)

RESET_THREADS = 8  # resets in flight per server (lock-step); the asynchronous mode admits by capacity instead
OPEN_BATCH = 256  # instances opened by one /create_batch request
MAX_TRAJECTORY_THREADS = 256  # trajectories in flight at once with a concurrent engine (asynchronous mode)


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


def with_retries(call: Callable[[], T], retries: int, backoff_s: float) -> T:
    """Run ``call``; repeat it with exponential backoff while it fails with a retryable EnvServerError."""
    for attempt in range(retries + 1):
        try:
            return call()
        except EnvServerError as err:
            if not err.retryable or attempt == retries:
                raise
            time.sleep(backoff_s * 2**attempt)
    raise AssertionError("unreachable")


class Rollout:
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

    def _assign(self, count: int) -> list[int]:
        """A server for each of ``count`` trajectories: weighted round robin over the live servers."""
        live = [s for s in range(len(self.urls)) if s not in self.dead]
        if not live:
            raise EnvServerError(f"every {self.env} server has failed: {', '.join(self.urls)}", retryable=False)
        weights = self.weights()
        given = dict.fromkeys(live, 0)
        out = []
        for _ in range(count):
            server = min(live, key=lambda s: ((given[s] + 1) / max(weights[s], 1e-9), s))
            given[server] += 1
            out.append(server)
        return out

    def _free_server(self, held: Counter[int]) -> int | None:
        """The live server with the most room left relative to its capacity, or None when every one is full."""
        capacities = self.capacities()
        live = [s for s in range(len(self.urls)) if s not in self.dead]
        if not live:
            raise EnvServerError(f"every {self.env} server has failed: {', '.join(self.urls)}", retryable=False)
        if not any(capacities[s] for s in live):  # none answered /health: try them all, unbounded
            return min(live, key=lambda s: (held[s], s))
        room = [s for s in live if held[s] < capacities[s]]
        return min(room, key=lambda s: ((held[s] + 1) / capacities[s], held[s], s)) if room else None

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

    def _reset_all(self, trajectories: list[Trajectory], clients: list[BaseEnvClient | None]) -> float:
        """Open and reset every trajectory's instance: one ``/create_batch`` request per server (the servers at once),
        then one by one, up to ``RESET_THREADS`` per server at once, for those the batch did not open (a full or
        failing server gets the retry policy, an unreachable replica's go to the others, a server without the
        endpoint is served this way); returns the seconds it took."""
        started = time.perf_counter()
        servers = self._assign(len(trajectories))
        left = self._open_batches(trajectories, clients, list(range(len(trajectories))), servers)

        def reset(i: int) -> None:
            server = servers[i] if servers[i] not in self.dead else self._assign(1)[0]
            while not self._reset_one(trajectories, clients, i, server):
                server = self._assign(1)[0]

        if left:
            with ThreadPoolExecutor(min(len(left), RESET_THREADS * len(self.urls))) as pool:
                list(pool.map(reset, left))  # the first error (a bad item id) is raised
        return time.perf_counter() - started

    def _open_batches(self, trajectories: list[Trajectory], clients: list[BaseEnvClient | None],
                      indices: Sequence[int], servers: Sequence[int]) -> list[int]:
        """Open trajectories ``indices`` (``servers``: the server of each), each server's share in ``/create_batch``
        requests of up to ``OPEN_BATCH``; returns the trajectories left to open one by one. A bad item id (422) is
        raised: nothing of its request was opened."""
        shares: dict[int, list[int]] = {}
        for i, server in zip(indices, servers, strict=True):
            shares.setdefault(server, []).append(i)
        batched = {s: share for s, share in shares.items() if s not in self.no_batch and s not in self.dead}
        left = sorted(i for s, share in shares.items() if s not in batched for i in share)

        def open_share(server: int) -> list[int]:
            share, unopened = batched[server], []
            for start in range(0, len(share), OPEN_BATCH):
                chunk = share[start:start + OPEN_BATCH]
                try:
                    opened = open_many(self.client_cls, self.https[server],
                                       [item_index(trajectories[i].item_id) for i in chunk])
                except EnvServerError as err:
                    if err.status_code in (404, 405):  # an AgentGym server: no batch endpoint
                        self.no_batch.add(server)
                    elif err.status_code is not None and 400 <= err.status_code < 500 and not err.retryable:
                        raise
                    unopened.extend(share[start:])
                    break
                began = []
                for i, outcome in zip(chunk, opened, strict=True):
                    if isinstance(outcome, EnvServerError):
                        unopened.append(i)  # the server was full or its simulator failed: retried one by one
                        continue
                    client, first = outcome
                    trajectories[i].server = server
                    clients[i] = client  # type: ignore[assignment]
                    began.append((trajectories[i], client, first))
                self._begin_many(began)
            return unopened

        if len(batched) > 1:
            with ThreadPoolExecutor(len(batched)) as pool:
                unopened = list(pool.map(open_share, batched))
        else:
            unopened = [open_share(s) for s in batched]
        return sorted(left + [i for share in unopened for i in share])

    def _reset_one(self, trajectories: list[Trajectory], clients: list[BaseEnvClient | None], i: int,
                   server: int) -> bool:
        """Open trajectory ``i``'s instance on ``server`` and reset it to its item. False when the server could not
        be reached and another live replica should take it (the server is then marked dead); an environment error
        otherwise ends the trajectory as ``env_error``."""
        cfg, t = self.config, trajectories[i]
        t.server = server
        try:
            client = with_retries(lambda: self.client_cls(self.urls[server], http=self.https[server]),
                                  cfg.retries, cfg.backoff_s)
            clients[i] = client
            first = with_retries(lambda: client.reset(item_index(t.item_id)), cfg.retries, cfg.backoff_s)
        except EnvServerError as err:
            if err.status_code is not None and 400 <= err.status_code < 500 and not err.retryable:
                raise  # a bad item id or request is the caller's mistake: fail loudly
            if err.status_code is None and len(self.urls) - len(self.dead) > 1:
                self.dead.add(server)  # unreachable after the retries: the next live replica takes it
                return False
            t.finish("env_error", str(err))
            return True
        self._begin_many([(t, client, first)])
        return True

    def _open_group(self, trajectories: list[Trajectory], clients: list[BaseEnvClient | None], group: list[int],
                    server: int) -> list[bool]:
        """Open ``group``'s instances on ``server``: one ``/create_batch``, then one by one for what it did not
        open. Per trajectory as ``_reset_one``: False when the server could not be reached (to be admitted again
        elsewhere)."""
        left = set(self._open_batches(trajectories, clients, group, [server] * len(group)))
        return [self._reset_one(trajectories, clients, i, server) if i in left else True for i in group]

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

    def _play_async(self, trajectories: list[Trajectory], clients: list[BaseEnvClient | None], h: int,
                    step: int) -> tuple[float, float, int]:
        """The asynchronous mode: generate for the trajectories that are ready (up to ``async_batch``), hand each
        generated batch's environment steps to worker threads, and generate for the next ready ones while they
        run. Trajectories are admitted as instances free: each is reset (in a worker) only while its server holds
        fewer live instances than its capacity (``/health``), and a finished trajectory's instance is closed at
        once, so a rollout may have more trajectories than the servers hold at a time. Each trajectory still ends
        by its own budgets (h counted in its own turns). Returns seconds generating, seconds waiting on the
        environment, and tokens generated."""
        cfg = self.config
        pending = list(range(len(trajectories)))  # not yet admitted, in order
        held: Counter[int] = Counter()  # live instances per server
        ready: list[int] = []
        # a future's trajectories, and their replies (None: a reset)
        in_flight: dict[Future[Any], tuple[list[int], list[str] | None]] = {}
        gen_s, tokens, calls = 0.0, 0, 0
        busy_env = 0.0
        with ThreadPoolExecutor(max(4, 2 * len(self.urls))) as pool:

            def admit() -> None:  # what the servers have room for, each server's share opened in one request
                groups: dict[int, list[int]] = {}
                while pending and (server := self._free_server(held)) is not None:
                    i = pending.pop(0)
                    held[server] += 1
                    trajectories[i].server = server
                    groups.setdefault(server, []).append(i)
                for server, group in groups.items():
                    in_flight[pool.submit(self._open_group, trajectories, clients, group, server)] = (group, None)

            def release(finished: list[int]) -> None:  # finished trajectories give their instances back now
                for i in finished:
                    held[trajectories[i].server] -= 1
                self._close_all(clients, finished)

            admit()
            while ready or in_flight:
                if ready:
                    batch, ready = ready[: cfg.async_batch or len(ready)], ready[cfg.async_batch or len(ready):]
                    texts, seconds, generated = self._generate(trajectories, batch, step, calls)
                    calls += 1
                    gen_s += seconds
                    tokens += generated

                    def steps(batch: list[int] = batch, texts: list[str] = texts) -> list[StepOutput]:
                        return self._step_round([clients[i] for i in batch], texts,
                                                [trajectories[i].server for i in batch])

                    in_flight[pool.submit(steps)] = (batch, texts)
                    if ready:  # more to generate now; collect what has come back meanwhile without waiting
                        done = {f for f in in_flight if f.done()}
                    else:
                        t1 = time.perf_counter()
                        done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                        busy_env += time.perf_counter() - t1
                else:
                    t1 = time.perf_counter()
                    done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                    busy_env += time.perf_counter() - t1
                finished: list[int] = []
                for future in done:
                    batch, texts = in_flight.pop(future)
                    if texts is None:  # resets came back
                        unreached = [i for i, reached in zip(batch, future.result(), strict=True) if not reached]
                        for i in unreached:  # its server could not be reached: admit it again elsewhere
                            held[trajectories[i].server] -= 1
                        pending[:0] = unreached
                        batch = [i for i in batch if i not in unreached]
                    else:
                        self._record_many([trajectories[i] for i in batch], texts, future.result(), h)
                    for i in batch:
                        if trajectories[i].active:
                            ready.append(i)
                        else:
                            finished.append(i)
                release(finished)
                admit()
        for i in pending:  # cannot happen while a live server has capacity; never leave a trajectory unended
            trajectories[i].finish("env_error", "no environment server had room for it")
        return gen_s, busy_env, tokens

    def _play_each(self, trajectories: list[Trajectory], clients: list[BaseEnvClient | None], h: int,
                   step: int) -> tuple[float, float, int]:
        """The asynchronous mode with an engine that batches concurrent requests itself (``engine.concurrent``: a
        vLLM server batches continuously): each trajectory runs on its own thread from its reset to its end, its
        next generation sent as soon as its observation is back and its step as soon as its reply is sampled, so no
        trajectory waits for another. At most the servers' capacity run at once (admitted as instances free). Each
        turn's seed comes from the trajectory and the turn, not from timing. Returns seconds generating and
        waiting on the environment (summed over the trajectories, so overlapping) and tokens generated."""
        totals = {"gen": 0.0, "env": 0.0, "tokens": 0}
        held: Counter[int] = Counter()
        room = threading.Condition()

        def take_server() -> int:
            with room:
                while (server := self._free_server(held)) is None:
                    room.wait()
                held[server] += 1
                return server

        def play(i: int) -> None:
            t, server = trajectories[i], take_server()
            try:
                while not self._reset_one(trajectories, clients, i, server):  # unreachable: another replica
                    with room:
                        held[server] -= 1
                    server = take_server()
                while t.active:
                    texts, gen_s, tokens = self._generate(trajectories, [i], step,
                                                          len(t.turns) * len(trajectories) + i)
                    started = time.perf_counter()
                    out = self._step_round([clients[i]], texts, [server])[0]
                    env_s = time.perf_counter() - started
                    self._record_many([t], texts, [out], h)
                    with room:
                        totals["gen"] += gen_s
                        totals["env"] += env_s
                        totals["tokens"] += tokens
            finally:  # the instance goes back at once, for the next trajectory to be admitted
                self._close_one(clients, i)
                with room:
                    held[server] -= 1
                    room.notify_all()

        capacities = self.capacities()
        bounded = all(c != math.inf for c in capacities) and any(capacities)
        workers = min(len(trajectories), MAX_TRAJECTORY_THREADS, int(sum(capacities)) if bounded else len(trajectories))
        with ThreadPoolExecutor(max(1, workers)) as pool:
            list(pool.map(play, range(len(trajectories))))  # the first error (a dead engine) is raised
        return totals["gen"], totals["env"], int(totals["tokens"])

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

    @staticmethod
    def _close_one(clients: list[BaseEnvClient | None], i: int) -> None:
        """Close trajectory ``i``'s instance now and forget it (already gone, reaped or with its server, is fine)."""
        client, clients[i] = clients[i], None
        if client is not None:
            with contextlib.suppress(EnvServerError):
                client.close()

    def _close_all(self, clients: list[BaseEnvClient | None], only: Sequence[int] | None = None) -> float:
        """Close every instance still open (of trajectories ``only``, when given): one ``/close_batch`` request per
        server (the servers at once), one by one (``RESET_THREADS`` per server at once) where that failed; returns
        the seconds it took."""
        started = time.perf_counter()
        if only is not None and not only:
            return 0.0
        server_of = {id(http): s for s, http in enumerate(self.https)}
        chosen = range(len(clients)) if only is None else only
        shares: dict[int, list[int]] = {}
        for i in chosen:
            client = clients[i]
            server = server_of.get(id(client.http)) if client is not None else None
            if server is not None and server not in self.no_batch:
                shares.setdefault(server, []).append(i)

        def close_share(server: int) -> None:
            try:
                close_many([clients[i] for i in shares[server]])  # type: ignore[misc]
            except EnvServerError as err:
                if err.status_code in (404, 405):  # an AgentGym server: no batch endpoint
                    self.no_batch.add(server)
                return  # left open: closed one by one below
            for i in shares[server]:
                clients[i] = None

        with ThreadPoolExecutor(max(1, len(shares))) as pool:
            list(pool.map(close_share, [s for s, share in shares.items() if len(share) > 1]))
        open_ = [i for i in chosen if clients[i] is not None]
        if len(open_) > 1:
            with ThreadPoolExecutor(min(len(open_), RESET_THREADS * len(self.urls))) as pool:
                list(pool.map(lambda i: self._close_one(clients, i), open_))
        for i in open_:  # (a close cut short by an interrupt is tried once more here)
            self._close_one(clients, i)
        return time.perf_counter() - started


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

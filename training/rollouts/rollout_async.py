"""The rollout modes where trajectories move on their own (``training.rollouts.rollout``): ``async`` (each
trajectory's next generation as soon as its observation is back, batched by what is ready; trajectories admitted
as the servers' instances free) and one thread per trajectory for a concurrent engine. A part of
:class:`training.rollouts.rollout.Rollout`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from envs.client import BaseEnvClient, StepOutput
from training.trajectory import Trajectory

MAX_TRAJECTORY_THREADS = 256  # trajectories in flight at once with a concurrent engine (asynchronous mode)


class AsyncPlay:
    """How a :class:`~training.rollouts.rollout.Rollout` plays trajectories that do not move in lock-step."""

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

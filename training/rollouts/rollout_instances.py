"""Opening and closing a rollout's environment instances across its servers (``training.rollouts.rollout``): which
server each trajectory goes to (weighted by capacity, the failed ones left out), the resets (batched, retried, each
trajectory's own on failure) and the closes that follow every rollout, also on errors. A part of
:class:`training.rollouts.rollout.Rollout`.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from envs.client import BaseEnvClient, EnvServerError, close_many, open_many
from envs.splits import item_index
from training.trajectory import Trajectory

T = TypeVar("T")
RESET_THREADS = 8  # resets in flight per server (lock-step); the asynchronous mode admits by capacity instead
OPEN_BATCH = 256  # instances opened by one /create_batch request


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


class InstancePool:
    """The instances of a :class:`~training.rollouts.rollout.Rollout`'s trajectories on its servers."""

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

"""Run an environment's expert over a task split through a real HTTP server, and count successes."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tqdm import tqdm

from envs.client import env_http
from envs.launcher import running_server
from envs.registry import client_class, expert
from envs.splits import item_index, load_split


@dataclass
class ExpertReport:
    """Expert outcomes per item, and counts per sub-task."""

    env: str
    outcomes: dict[str, bool] = field(default_factory=dict)
    by_sub_task: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return len(self.outcomes)

    @property
    def successes(self) -> int:
        return sum(self.outcomes.values())

    @property
    def rate(self) -> float:
        return self.successes / self.total if self.total else 0.0


@contextlib.contextmanager
def _server(env: str, url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    with running_server(env) as started:
        yield started


def run_experts(
    env: str,
    split: str = "test",
    *,
    limit: int | None = None,
    url: str | None = None,
    workers: int = 4,
    progress: bool = False,
) -> ExpertReport:
    """Play the expert on every item of ``data/<env>/<split>.json`` (or its first ``limit``)."""
    items = load_split(env, split)[:limit]
    solve, cls = expert(env), client_class(env)
    report = ExpertReport(env)
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    with _server(env, url) as base, env_http(base, timeout=300.0) as http:

        def play(item: dict) -> bool:
            client = cls(base, http=http)
            try:
                return bool(solve(client, item_index(item["item_id"])).success)
            finally:
                client.close()

        with ThreadPoolExecutor(workers) as pool:
            results = pool.map(play, items)
            for item, ok in tqdm(zip(items, results, strict=True), total=len(items), disable=not progress,
                                 desc=f"{env} expert"):
                report.outcomes[item["item_id"]] = ok
                counts[item["sub_task"]][0] += ok
                counts[item["sub_task"]][1] += 1
    report.by_sub_task = {k: (v[0], v[1]) for k, v in counts.items()}
    return report

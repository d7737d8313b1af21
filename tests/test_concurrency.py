"""Many concurrent episodes on one server: no cross-talk, and the same data_idx gives the same text."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from envs.registry import client_class

EPISODES = 64


def _script(env: str, i: int) -> list[str]:
    """A per-episode action script whose observations depend on the episode's own state."""
    if env == "textcraft":
        return [f"get {i % 5 + 1} oak logs", "inventory", f"get {i % 3 + 1} cobblestone", "inventory"]
    if env == "deepsearch":
        from envs.deepsearch.world import default_world

        people = list(default_world().people)
        return [f"<search> {people[(7 * i + k) % len(people)]} born </search>" for k in range(3)] + \
            [f"<answer> {people[i]} </answer>"]
    rng = random.Random(i)
    return [rng.choice(["turn left", "turn right", "move forward"]) for _ in range(6)]


def _play(env: str, url: str, http: httpx.Client, i: int) -> list[str]:
    client = client_class(env)(url, http=http)
    try:
        seen = [client.reset(i).observation]
        for action in _script(env, i):
            out = client.step(action if env == "deepsearch" else f"Thought: step {i}\nAction: {action}")
            seen.append(out.observation)
            if out.done:
                break
        return seen
    finally:
        client.close()


@pytest.mark.parametrize("env", ["babyai", "textcraft", "deepsearch"])
def test_64_concurrent_episodes_do_not_cross_talk(env: str, env_server) -> None:
    url = env_server(env)
    live = httpx.get(f"{url}/health").json()["instances"]  # a worker's tests share the server
    with httpx.Client(base_url=url, timeout=120.0, limits=httpx.Limits(max_connections=EPISODES)) as http:
        serial = [_play(env, url, http, i) for i in range(EPISODES)]
        with ThreadPoolExecutor(EPISODES) as pool:
            concurrent = list(pool.map(lambda i: _play(env, url, http, i), range(EPISODES)))
    assert concurrent == serial
    assert len({tuple(s) for s in serial}) > EPISODES // 2  # the episodes really differ from each other
    assert httpx.get(f"{url}/health").json()["instances"] == live


@pytest.mark.parametrize("env", ["babyai", "textcraft", "deepsearch", pytest.param("sciworld", marks=pytest.mark.jvm)])
def test_same_data_idx_same_first_observation_under_concurrency(env: str, env_server) -> None:
    url = env_server(env)
    indices = [3, 11, 3, 5, 3, 11, 8, 3] if env != "sciworld" else [3, 40, 3, 3]
    with httpx.Client(base_url=url, timeout=120.0) as http:

        def first(i: int) -> str:
            client = client_class(env)(url, http=http)
            try:
                return client.reset(i).observation
            finally:
                client.close()

        with ThreadPoolExecutor(len(indices)) as pool:
            seen = list(pool.map(first, indices))
        again = first(3)
    by_idx: dict[int, set[str]] = {}
    for i, obs in zip(indices, seen, strict=True):
        by_idx.setdefault(i, set()).add(obs)
    assert all(len(v) == 1 for v in by_idx.values()), "the same data_idx gave different first observations"
    assert by_idx[3] == {again}
    assert len({next(iter(v)) for v in by_idx.values()}) == len(by_idx)  # different tasks differ

"""BabyAI env-steps/s through HTTP at 64 concurrent episodes, against calling the environment in-process.

    python benchmarks/env_throughput.py [--episodes 64] [--seconds 10]

Modes (all step primitive high-level actions, "turn left" / "turn right" / "move forward", chosen by a
seeded RNG; finished episodes are reset and their reset time is not counted as steps):
  in-process  the backend called directly, no HTTP;
  http-batch  the project's client: one reused httpx.Client, one POST /step_batch per round of 64 steps;
  http-async  an async httpx client, one POST /step per env step, 64 in flight (the naive way);
  latency     one episode, one POST /step at a time: median latency, minus the in-process median =
              the latency HTTP adds.
Targets on the 2-core reference machine: >= 2000 steps/s for http-batch, <= 1 ms median added latency.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import httpx

from envs.client import step_many
from envs.launcher import running_server
from envs.registry import async_client_class, client_class, load_backend

ACTIONS = ("turn left", "turn right", "move forward")


def _reply(rng: random.Random) -> str:
    return f"Thought: keep exploring.\nAction: {rng.choice(ACTIONS)}"


def in_process(episodes: int, seconds: float) -> tuple[float, float]:
    """Steps/s and median step latency (ms) calling the backend directly."""
    backend = load_backend("babyai")
    rng = random.Random(0)
    envs = [backend.new_instance() for _ in range(episodes)]
    for i, env in enumerate(envs):
        env.reset(i)
    steps, latencies, end = 0, [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        for i, env in enumerate(envs):
            t = time.perf_counter()
            result = env.step(rng.choice(ACTIONS))
            latencies.append(time.perf_counter() - t)
            steps += 1
            if result.done:
                env.reset(i + episodes * steps)
    return steps / sum(latencies), statistics.median(latencies) * 1e3


def http_batch(url: str, episodes: int, seconds: float) -> float:
    """Steps/s with the project's client: one reused connection, one /step_batch per round."""
    rng = random.Random(0)
    with httpx.Client(base_url=url, timeout=60.0) as http:
        clients = [client_class("babyai")(url, http=http) for _ in range(episodes)]
        for i, c in enumerate(clients):
            c.reset(i)
        steps, spent, end = 0, 0.0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            outs = step_many(clients, [_reply(rng) for _ in clients])
            spent += time.perf_counter() - t
            steps += len(outs)
            for i, (c, out) in enumerate(zip(clients, outs, strict=True)):
                if out.done:
                    c.reset(i + episodes * steps)
        for c in clients:
            c.close()
    return steps / spent


async def _http_async(url: str, episodes: int, seconds: float) -> float:
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as http:
        cls = async_client_class("babyai")
        clients = [await cls.create(url, http=http) for _ in range(episodes)]
        for i, c in enumerate(clients):
            await c.reset(i)
        steps, spent, end = 0, 0.0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            outs = await asyncio.gather(*(c.step(_reply(rng)) for c in clients))
            spent += time.perf_counter() - t
            steps += len(outs)
            for i, (c, out) in enumerate(zip(clients, outs, strict=True)):
                if out.done:
                    await c.reset(i + episodes * steps)
        for c in clients:
            await c.close()
    return steps / spent


def http_latency(url: str, steps: int = 2000) -> float:
    """Median latency (ms) of one POST /step at a time."""
    rng = random.Random(1)
    latencies = []
    with httpx.Client(base_url=url, timeout=60.0) as http:
        client = client_class("babyai")(url, http=http)
        client.reset(0)
        for n in range(steps):
            t = time.perf_counter()
            out = client.step(_reply(rng))
            latencies.append(time.perf_counter() - t)
            if out.done:
                client.reset(n + 1)
        client.close()
    return statistics.median(latencies) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    rate, median_ms = in_process(args.episodes, args.seconds)
    print(f"in-process : {rate:8.0f} steps/s   median step {median_ms:.3f} ms")
    with running_server("babyai") as url:
        print(f"http-batch : {http_batch(url, args.episodes, args.seconds):8.0f} steps/s   "
              f"({args.episodes} episodes, one /step_batch per round)")
        print(f"http-async : {asyncio.run(_http_async(url, args.episodes, args.seconds)):8.0f} steps/s   "
              f"({args.episodes} episodes, one /step per env step)")
        latency = http_latency(url)
    print(f"latency    : median {latency:.3f} ms per /step, {latency - median_ms:+.3f} ms added by HTTP")


if __name__ == "__main__":
    main()

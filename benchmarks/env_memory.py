"""Server memory under many reset/close cycles (the reference TextCraft server leaked here).

    python benchmarks/env_memory.py --env textcraft --cycles 5000
    python benchmarks/env_memory.py --env babyai --cycles 5000

Each cycle is create -> reset(data_idx) -> close through HTTP against a real server subprocess; the
server's RSS is read (psutil) after a warm-up and at the end. Target: growth < 20 MB over 5,000 cycles.
"""

from __future__ import annotations

import argparse
import time

import httpx
import psutil
from tqdm import tqdm

from envs.launcher import running_server


def cycle(http: httpx.Client, data_idx: int) -> None:
    """One create -> reset -> close cycle."""
    idx = http.post("/create").raise_for_status().json()["id"]
    http.post("/reset", json={"id": idx, "data_idx": data_idx}).raise_for_status()
    http.post("/close", json={"id": idx}).raise_for_status()


def rss_growth_mb(url: str, cycles: int, index_space: int, warmup: int = 300, progress: bool = False) -> dict:
    """Run ``warmup`` then ``cycles`` cycles against ``url``; return RSS before/after in MB."""
    with httpx.Client(base_url=url, timeout=60.0) as http:
        server = psutil.Process(http.get("/health").json()["pid"])
        for i in range(warmup):
            cycle(http, i % index_space)
        before = server.memory_info().rss / 2**20
        start = time.perf_counter()
        for i in tqdm(range(cycles), disable=not progress, desc="reset/close cycles"):
            cycle(http, (warmup + i) % index_space)
        seconds = time.perf_counter() - start
        after = server.memory_info().rss / 2**20
        live = http.get("/health").json()["instances"]
    return {"rss_before_mb": before, "rss_after_mb": after, "growth_mb": after - before,
            "cycles_per_s": cycles / seconds, "live_instances": live}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env", default="textcraft", choices=["textcraft", "babyai", "deepsearch"])
    parser.add_argument("--cycles", type=int, default=5000)
    args = parser.parse_args()
    space = {"textcraft": 544, "babyai": 900, "deepsearch": 2800}[args.env]
    with running_server(args.env) as url:
        result = rss_growth_mb(url, args.cycles, space, progress=True)
    print(f"{args.env}: {args.cycles} reset/close cycles, RSS {result['rss_before_mb']:.1f} -> "
          f"{result['rss_after_mb']:.1f} MB (growth {result['growth_mb']:+.1f} MB), "
          f"{result['cycles_per_s']:.0f} cycles/s, {result['live_instances']} live instances left")


if __name__ == "__main__":
    main()

"""Soak: continuous episodes against one environment server for a while; the server's RSS, open files and
threads sampled as it goes, so a leak shows as a slope.

    python benchmarks/soak.py --env babyai --minutes 30 [--episodes 16] [--every 30] [--option KEY=VALUE]

``--episodes`` episodes run at once, each created, reset on a random item, stepped with the environment's
own example actions (``/available_actions``, or a fixed reply) up to 10 turns, then closed, and again,
through ``step_many`` (one ``/step_batch`` per round), as a rollout does. Prints one JSON line per sample and
a summary: growth after warm-up (the first sample after one minute) for RSS (MB), open files and threads.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REPLIES = {"babyai": "Thought: go.\nAction: go forward", "textcraft": "Thought: look.\nAction: inventory",
           "deepsearch": "<search>capital city</search>", "sciworld": "Thought: look.\nAction: look around",
           "webarena": "Thought:\nlook further.\n\nAction:\nscroll [down]"}


def _tree_usage(server: psutil.Process) -> tuple[int, int, int]:
    """RSS, open files and sockets, and threads of the server and its children (a browser's renderers come and
    go: one that exits while it is read is left out)."""
    rss = files = threads = 0
    for proc in [server, *server.children(recursive=True)]:
        try:
            rss += proc.memory_info().rss
            files += len(proc.open_files()) + len(proc.net_connections())
            threads += proc.num_threads()
        except psutil.NoSuchProcess:
            continue
    return rss, files, threads


def main() -> None:
    from envs.client import step_many
    from envs.launcher import running_server
    from envs.registry import client_class

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="babyai", choices=sorted(REPLIES))
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a backend option for the server, e.g. sciworld's java_opts")
    args = parser.parse_args()
    rng = random.Random(0)
    options = dict(o.split("=", 1) for o in args.option)
    with running_server(args.env, **options) as url:
        import httpx

        health = httpx.get(f"{url}/health").json()
        server, items = psutil.Process(health["pid"]), int(health["num_items"] or 100_000)  # BabyAI: unbounded
        started = next_sample = time.monotonic()
        samples, episodes, steps = [], 0, 0
        while time.monotonic() - started < args.minutes * 60:
            clients = [client_class(args.env)(url) for _ in range(args.episodes)]
            for client in clients:
                client.reset(rng.randrange(items))
            for _ in range(10):
                live = [c for c in clients if not getattr(c, "done", False)]
                if not live:
                    break
                outs = step_many(live, [REPLIES[args.env]] * len(live), partial=True)
                steps += len(outs)
                for client, out in zip(live, outs, strict=True):
                    client.done = out.done or bool(out.error)
            for client in clients:
                client.close()
            episodes += len(clients)
            if time.monotonic() >= next_sample:
                rss, files, threads = _tree_usage(server)
                sample = {"t_s": round(time.monotonic() - started), "episodes": episodes, "steps": steps,
                          "rss_mb": round(rss / 2**20, 1), "server_rss_mb": round(server.memory_info().rss / 2**20, 1),
                          "children_rss_mb": sorted(round(c.memory_info().rss / 2**20, 1)
                                                    for c in server.children(recursive=True) if c.is_running()),
                          "open_files": files, "threads": threads,
                          "instances": httpx.get(f"{url}/health").json()["instances"]}
                samples.append(sample)
                print(json.dumps(sample), flush=True)
                next_sample += args.every
        warm = next((s for s in samples if s["t_s"] >= 60), samples[0])
        last = samples[-1]
        print(json.dumps({"env": args.env, "minutes": args.minutes, "episodes": episodes, "steps": steps,
                          "rss_growth_mb": round(last["rss_mb"] - warm["rss_mb"], 1),
                          "server_rss_growth_mb": round(last["server_rss_mb"] - warm["server_rss_mb"], 1),
                          "open_files_growth": last["open_files"] - warm["open_files"],
                          "threads_growth": last["threads"] - warm["threads"],
                          "instances_left": last["instances"]}), flush=True)


if __name__ == "__main__":
    main()

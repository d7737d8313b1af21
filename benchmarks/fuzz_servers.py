"""Hostile requests against the environment servers, many of them: the fuzzing test's strategies
(``tests/test_hostile.py``) with --examples per server, counting statuses, then checking the server is healthy,
its instance count, and its RSS growth.

    python benchmarks/fuzz_servers.py [--envs babyai textcraft deepsearch] [--examples 10000]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import httpx
import psutil
from hypothesis import HealthCheck, given, settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def fuzz_server(env: str, examples: int) -> dict[str, object]:
    """Send ``examples`` fuzzed requests to a fresh ``env`` server; what came back and how the server is after."""
    from envs.launcher import running_server
    from tests.test_hostile import _BODIES, _PATHS, _new

    with running_server(env) as url, httpx.Client(base_url=url, timeout=60) as http:
        server = psutil.Process(http.get("/health").json()["pid"])
        live = [_new(http) for _ in range(2)]
        rss_before = server.memory_info().rss
        statuses: collections.Counter[int] = collections.Counter()
        bad: list[str] = []

        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(path=_PATHS, body=_BODIES)
        def fuzz(path: str, body: object) -> None:
            if isinstance(body, dict) and body.get("id") == -2:
                body = {**body, "id": live[0]}
            if path in ("/observation", "/available_actions"):
                answer = http.get(path, params={"id": str(body.get("id") if isinstance(body, dict) else body)})
            else:
                answer = http.post(path, content=json.dumps(body).encode(),
                                   headers={"content-type": "application/json"})
            statuses[answer.status_code] += 1
            if answer.status_code >= 500 and answer.status_code not in (502, 503):
                bad.append(f"{path} {answer.status_code} {answer.text[:200]}")

        fuzz()
        health = http.get("/health").json()
        return {"env": env, "requests": sum(statuses.values()), "statuses": dict(sorted(statuses.items())),
                "undocumented_5xx": len(bad), "first_bad": bad[:3], "healthy": health["status"] == "ok",
                "instances_left": health["instances"],
                "rss_growth_mb": round((server.memory_info().rss - rss_before) / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", default=["babyai", "textcraft", "deepsearch"])
    parser.add_argument("--examples", type=int, default=10_000)
    args = parser.parse_args()
    for env in args.envs:
        print(json.dumps(fuzz_server(env, args.examples)), flush=True)


if __name__ == "__main__":
    main()

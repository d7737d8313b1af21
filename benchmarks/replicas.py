"""Environment-bound rollouts: asynchronous against lock-step, 1 and 2 local replicas, and a replica killed mid-way.

    python benchmarks/replicas.py [--env babyai|textcraft|sciworld] [--trajectories 64] [--h 10] [--repeats 3]
    python benchmarks/replicas.py --engine vllm --env sciworld --trajectories 64 --h 10 --heap 128m  # issue 19's figure
                                  [--policy-replicas 2]

The policy is scripted (every reply ``turn left``, no model), so the time is the environment's: parsing, the
HTTP round trips and the simulator. Prints env-steps/s with one server and with two (each its own process, so
two cores serve), the ratio; trajectories/s of the asynchronous mode (generations of what is ready, a quarter of
the trajectories at a time, environment steps in flight meanwhile) against lock-step rounds on one server; then
a run over two replicas where one is SIGKILLed after the first round: how
many trajectories finished, how many were rolled out again on the other, and how many were lost (must be 0).

``--engine vllm``: the tiny policy served by a vLLM server (``make vllm``) samples every reply instead (at
temperature 1, so trajectories differ in length and in what the environment does with them), and only the
asynchronous against lock-step comparison runs: there generation and environment steps overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class TurnLeft:
    """Every reply a valid action; calls ``hook(calls)`` before each generation."""

    def __init__(self, tokenizer, reply: str, hook=lambda calls: None) -> None:
        self.ids = [*tokenizer(reply, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        self.hook, self.calls = hook, 0

    def generate(self, prompts, params):
        from training.engines.engine import Generation

        self.calls += 1
        self.hook(self.calls)
        return [Generation(list(self.ids), [0.0] * len(self.ids), True) for _ in prompts]


REPLIES = {"babyai": "Thought: look around.\nAction: turn left", "textcraft": "Thought: check.\nAction: inventory",
           "sciworld": "Thought: look.\nAction: look around"}


def server_options(env: str, trajectories: int, heap: str | None = None) -> dict[str, int | str]:
    """A SciWorld server holds one JVM per live instance (4 by default): one for every trajectory of a rollout,
    each with ``heap`` (the server's default when None; 64 JVMs at its -Xmx384m need ~29 GB, at 128m ~13 GB)."""
    if env != "sciworld":
        return {}
    return {"max_jvms": trajectories, **({"heap": heap} if heap else {})}


def main() -> None:
    import httpx
    from transformers import AutoTokenizer

    from envs.launcher import running_replicas
    from envs.splits import load_split
    from training.rollouts.rollout import Rollout, RolloutConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="babyai", choices=sorted(REPLIES))
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--h", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", default="scripted", choices=["scripted", "vllm"])
    parser.add_argument("--async-batch", type=int, default=None,
                        help="--engine vllm: generations per engine call in the asynchronous mode (default a quarter "
                             "of the trajectories; 0: all that are ready)")
    parser.add_argument("--heap", default=None,
                        help="--env sciworld: each JVM's java heap (e.g. 128m; default the server's -Xmx384m, ~450 MiB "
                             "resident a JVM, ~200 MiB at 128m)")
    parser.add_argument("--cpu-executor", default="uni", choices=["uni", "mp"],
                        help="--engine vllm: policy_server.cpu_executor of the server")
    parser.add_argument("--policy-replicas", type=int, default=1,
                        help="--engine vllm: policy_server.replicas (vLLM servers side by side)")
    args = parser.parse_args()
    if args.engine == "vllm":
        if args.async_batch is None:
            args.async_batch = max(1, args.trajectories // 4)
        policy_async_vs_lockstep(args)
        return
    from benchmarks import tiny_model

    tokenizer = AutoTokenizer.from_pretrained(tiny_model())
    items = [r["item_id"] for r in load_split(args.env, "train")[: args.trajectories // 4]]
    config = RolloutConfig(n_samples=4, max_new_tokens=16, context_budget=100_000, retries=1, backoff_s=0.05)
    options = server_options(args.env, args.trajectories, args.heap)  # every server of this run
    rates = {}
    for replicas in (1, 2):
        with running_replicas(args.env, replicas, **options) as url:
            rollout = Rollout(args.env, url, TurnLeft(tokenizer, REPLIES[args.env]), tokenizer, config)
            rollout.run(items, h=2)  # warm-up
            best = 0.0
            for _ in range(args.repeats):
                # a fresh rollout each time: no ids kept from the run before (a training step rolls out new items)
                rollout = Rollout(args.env, url, TurnLeft(tokenizer, REPLIES[args.env]), tokenizer, config)
                started = time.perf_counter()
                result = rollout.run(items, h=args.h)
                steps = sum(len(t.turns) for t in result.trajectories)
                best = max(best, steps / (time.perf_counter() - started))
            rates[replicas] = best
            chat = rollout.chat  # the share of texts (prompts, observations) whose ids were kept from before
            print(json.dumps({"replicas": replicas, "env_steps_per_s": round(best, 1), "trajectories":
                              len(result.trajectories), "texts_kept": round(
                                  chat.encode_hits / max(1, chat.encode_hits + chat.encode_misses), 3)}), flush=True)
    print(json.dumps({"speedup_2_vs_1": round(rates[2] / rates[1], 2)}), flush=True)
    per_s = {}
    with running_replicas(args.env, 1, **options) as url:
        # warm-up: the first rollout on a fresh server starts its simulators (a SciWorld JVM each), which would be
        # charged to whichever mode ran first
        Rollout(args.env, url, TurnLeft(tokenizer, REPLIES[args.env]), tokenizer, config).run(items, h=2)
        for mode in ("lockstep", "async"):
            cfg = RolloutConfig(n_samples=4, max_new_tokens=16, context_budget=100_000, mode=mode,
                                async_batch=max(1, args.trajectories // 4))
            rollout = Rollout(args.env, url, TurnLeft(tokenizer, REPLIES[args.env]), tokenizer, cfg)
            best = 0.0
            for _ in range(args.repeats):
                started = time.perf_counter()
                done = len(rollout.run(items, h=args.h).trajectories)
                best = max(best, done / (time.perf_counter() - started))
            per_s[mode] = best
            print(json.dumps({"mode": mode, "trajectories_per_s": round(best, 2)}), flush=True)
    print(json.dumps({"speedup_async_vs_lockstep": round(per_s["async"] / per_s["lockstep"], 2)}), flush=True)
    with running_replicas(args.env, 2, **options) as url:
        victim = httpx.get(f"{url.split(',')[1]}/health").json()["pid"]
        engine = TurnLeft(tokenizer, REPLIES[args.env],
                          hook=lambda calls: os.kill(victim, signal.SIGKILL) if calls == 2 else None)
        rollout = Rollout(args.env, url, engine, tokenizer, config)
        result = rollout.run(items, h=args.h)
        print(json.dumps({"killed_replica": 1, "trajectories": len(result.trajectories),
                          "valid": len(result.valid), "rolled_out_again": len(result.failed_attempts),
                          "env_errors_left": len(result.trajectories) - len(result.valid),
                          "lost": args.trajectories - len(result.trajectories)}), flush=True)


def policy_async_vs_lockstep(args: argparse.Namespace) -> None:
    """trajectories/s of the asynchronous mode against lock-step rounds, the tiny policy served by vLLM."""
    from benchmarks import tiny_model
    from envs.launcher import running_replicas
    from envs.splits import load_split
    from training.engines.vllm_engine import VLLMEngine
    from training.engines.vllm_server import running_vllm
    from training.model import load_policy
    from training.rollouts.rollout import Rollout, RolloutConfig
    from training.settings.config import PolicyServerConfig

    model_dir = tiny_model()
    _, tokenizer = load_policy(model_dir)
    items = [r["item_id"] for r in load_split(args.env, "train")[: args.trajectories // 4]]
    budget, new_tokens = 4096, 24
    per_s: dict[str, list[float]] = {"lockstep": [], "async": []}
    server = PolicyServerConfig(cpu_executor=args.cpu_executor, replicas=args.policy_replicas)
    with running_vllm(model_dir, server, max_model_len=budget + new_tokens) as policy_url, \
            running_replicas(args.env, 1, **server_options(args.env, args.trajectories, args.heap)) as url:
        engine = VLLMEngine(policy_url, tokenizer.eos_token_id)
        # warm-up: every simulator started (SciWorld launches a JVM per instance on its first reset) and warm
        Rollout(args.env, url, engine, tokenizer, RolloutConfig(n_samples=4, max_new_tokens=4, context_budget=budget)
                ).run(items, h=2)
        for repeat in range(args.repeats):
            for mode in ("lockstep", "async"):  # interleaved, so both see the same machine
                config = RolloutConfig(n_samples=4, max_new_tokens=new_tokens, context_budget=budget, mode=mode,
                                       temperature=1.0, seed=repeat, async_batch=args.async_batch or None)
                rollout = Rollout(args.env, url, engine, tokenizer, config)
                started = time.perf_counter()
                result = rollout.run(items, h=args.h)
                seconds = time.perf_counter() - started
                per_s[mode].append(len(result.trajectories) / seconds)
                print(json.dumps({"mode": mode, "repeat": repeat, "trajectories": len(result.trajectories),
                                  "valid": len(result.valid), "seconds": round(seconds, 1),
                                  "turns": sum(len(t.turns) for t in result.trajectories),
                                  "trajectories_per_s": round(per_s[mode][-1], 3)}), flush=True)
    best = {mode: max(rates) for mode, rates in per_s.items()}
    print(json.dumps({"engine": "vllm", "cpu_executor": args.cpu_executor, "policy_replicas": args.policy_replicas,
                      "env": args.env, "h": args.h, "async_batch": args.async_batch,
                      "speedup_async_vs_lockstep": round(best["async"] / best["lockstep"], 2)}), flush=True)


if __name__ == "__main__":
    main()

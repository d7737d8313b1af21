"""The vllm engine against the hf engine: generation tokens/s on the same prompts, and weight-sync seconds.

    python benchmarks/vllm_engine.py [--model models/tiny] [--prompts 64] [--new-tokens 64] [--syncs 5]
                                     [--cpu-executor uni|mp] [--cpu-threads-bind auto|all] [--replicas N]

Both engines sample the same ``--prompts`` prompts (BabyAI-style chat prompts) for ``--new-tokens`` new tokens
each (``ignore`` of the end-of-turn id is not possible in the hf engine, so a turn may end early: tokens/s counts
the tokens actually generated). The hf engine runs ``generate`` in this process with one batch of all prompts and
the machine's torch threads; the vllm engine sends them as concurrent requests (one per prompt, each with its own
seed) to a server started here, or to ``--replicas`` servers side by side (``policy_server.replicas``: on a CPU
each pinned to its share of the cores, the requests spread over them). ``--repeats`` timed generations per
engine, interleaved, each after ``--settle`` seconds of quiet (the engine timed before it leaves spinning threads
behind: torch's OpenMP workers and, with ``--cpu-executor mp``, vLLM's engine core and worker, which poll their
queue for a second after their last message; on 2 cores a generation that starts beside them can fall into a mode
of tiny batches several times slower); medians reported. Then ``--syncs`` weight syncs are timed both ways:
``sync`` saves a checkpoint folder the server loads in place; ``sync_collective`` broadcasts the tensors over a
gloo group with the process that runs the server's model (NCCL or HCCL on accelerators; one server only); each is
verified by the probe (on every replica). Prints a JSON line; the figures in docs/measurements.md come from it.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from training.chat_format import ChatFormat
    from training.engines.engine import HFEngine, SamplingParams
    from training.engines.vllm_engine import VLLMEngine
    from training.engines.vllm_server import running_vllm
    from training.engines.weight_sync import WeightChannel, WeightSync, probe_sequence
    from training.model import load_policy
    from training.settings.config import PolicyServerConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="timed generations per engine (medians reported)")
    parser.add_argument("--cpu-executor", default="uni", choices=["uni", "mp"],
                        help="policy_server.cpu_executor of the server (uni: the model in the engine core; mp: in a "
                        "worker process)")
    parser.add_argument("--cpu-threads-bind", default="auto", help="policy_server.cpu_threads_bind of an mp server "
                        "(auto: vLLM keeps a core for its scheduler; all: every core)")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds of quiet before each timed generation")
    parser.add_argument("--replicas", type=int, default=1, help="policy_server.replicas: servers side by side")
    args = parser.parse_args()

    from benchmarks import tiny_model

    args.model = str(tiny_model(args.model))
    model, tokenizer = load_policy(args.model)
    model.eval()
    chat = ChatFormat(tokenizer)
    colours = ["red", "green", "blue", "purple", "yellow", "grey"]
    things = ["ball", "box", "key", "door"]
    prompts = [chat.prompt([{"role": "user", "content": f"Go to the {colours[i % 6]} {things[i % 4]} (episode {i})."}])
               for i in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
    out: dict[str, object] = {"model": args.model, "prompts": args.prompts, "new_tokens": args.new_tokens,
                              "settle_s": args.settle, "cpu_executor": args.cpu_executor,
                              "cpu_threads_bind": args.cpu_threads_bind, "replicas": args.replicas,
                              "torch_threads": torch.get_num_threads()}

    def timed(engine: object) -> tuple[int, float]:
        time.sleep(args.settle)
        started = time.perf_counter()
        tokens = sum(len(g.token_ids) for g in engine.generate(prompts, params))  # type: ignore[attr-defined]
        return tokens, time.perf_counter() - started

    def summary(runs: list[tuple[int, float]]) -> dict[str, float]:
        rates = [tokens / seconds for tokens, seconds in runs]
        return {"tokens": runs[0][0], "tokens_per_s_median": round(statistics.median(rates), 1),
                "tokens_per_s_runs": [round(r, 1) for r in rates]}

    hf = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, batch_size=args.prompts)
    hf.generate(prompts[:2], SamplingParams(max_new_tokens=4, seed=0))  # warm-up
    budget = max(len(p) for p in prompts) + args.new_tokens
    started = time.perf_counter()
    server = PolicyServerConfig(cpu_executor=args.cpu_executor, cpu_threads_bind=args.cpu_threads_bind,
                                replicas=args.replicas)
    with running_vllm(Path(args.model), server, max_model_len=budget) as url:
        out["vllm_start_s"] = round(time.perf_counter() - started, 1)
        engine = VLLMEngine(url, tokenizer.eos_token_id)
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, seed=0))  # warm-up
        hf_runs, vllm_runs = [], []
        for _ in range(args.repeats):  # interleaved, so both see the same machine
            hf_runs.append(timed(hf))
            vllm_runs.append(timed(engine))
        out["hf"], out["vllm"] = summary(hf_runs), summary(vllm_runs)
        out["speedup"] = round(out["vllm"]["tokens_per_s_median"] / out["hf"]["tokens_per_s_median"], 2)  # type: ignore[index]
        trained = copy.deepcopy(model)
        params_count = sum(p.numel() for p in model.parameters())
        transports = [("sync", None), ("sync_collective", "gloo")][:1 if args.replicas > 1 else 2]
        for key, channel in transports:  # by checkpoint folder; broadcast
            sync = WeightSync(engine, probe_sequence(tokenizer),
                              channel=WeightChannel(engine, channel) if channel else None)
            times, diffs = [], []
            for step in range(1, args.syncs + 1):
                with torch.no_grad():  # stands in for an optimizer step
                    for param in trained.parameters():
                        param.add_(torch.randn_like(param) * 1e-3)
                version = sync.push(trained, step)
                times.append(version.seconds)
                diffs.append(version.probe_max_diff)
            shutil.rmtree(sync.workdir, ignore_errors=True)  # the engine stays open for the next transport
            out[key] = {"parameters": params_count, "seconds_median": round(statistics.median(times), 3),
                        "seconds_max": round(max(times), 3), "probe_max_diff": max(diffs)}
        engine.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()

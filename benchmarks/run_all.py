"""Every benchmark at a size that fits ~20 minutes on the 2-core machine, one after the other; writes
docs/benchmarks.md (figure, target, command, date, machine load, seconds). ``make bench`` runs it.

    python benchmarks/run_all.py [--only NAME ...] [--out docs/benchmarks.md]

The long measurements are not rerun here (their own documents carry their figures): the learning benchmarks
(benchmarks/learning_babyai.py, bandit_learning_seeds.py; docs/measurements.md), the curriculum study
(docs/curriculum-study.md), the 30-minute soaks and the 10,000-request fuzzing (docs/reliability.md). A benchmark
that fails or is missing its optional dependency is a row saying so, never a silent gap.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bench:
    name: str
    args: list[str]
    target: str
    figure: str  # regex: the output lines that carry the figure
    needs: str | None = None  # an optional module the benchmark imports, or a file it runs (`make` builds it)
    timeout_s: int = 600


BENCHES = [
    Bench("environment throughput (BabyAI over HTTP)", ["benchmarks/env_throughput.py", "--seconds", "5"],
          ">= 2000 steps/s http-batch; <= 1 ms added median latency", r"^(http-batch|latency).*"),
    Bench("BabyAI in-process step", ["benchmarks/babyai_inprocess.py", "--steps", "20000"],
          "text layer well under 0.2 ms per step", r"^per step.*"),
    Bench("server memory (TextCraft reset/close)", ["benchmarks/env_memory.py", "--env", "textcraft", "--cycles",
                                                    "2000"], "growth < 20 MB over 5,000 cycles", r".*RSS.*"),
    Bench("rollout throughput (64 BabyAI trajectories, tiny model)", ["benchmarks/rollout_throughput.py"],
          "environment wait <= 10% of wall; engine >= 0.8x bare generate", r"^(\d+ trajectories|engine).*"),
    Bench("replicas and asynchronous rollouts (BabyAI, scripted policy)",
          ["benchmarks/replicas.py", "--trajectories", "64", "--h", "8", "--repeats", "2"],
          ">= 1.8x env-steps/s with 2 replicas; 0 lost on a kill (async vs lock-step here: environment-bound)",
          r".*(speedup|lost).*"),
    Bench("asynchronous vs lock-step rollouts (16 SciWorld trajectories at h=10, tiny policy on vLLM)",
          ["benchmarks/replicas.py", "--engine", "vllm", "--env", "sciworld", "--trajectories", "16", "--h", "10",
           "--repeats", "1", "--heap", "128m"],
          "async >= 1.5x lock-step trajectories/s (issue 19's size: 64 x 10)", r'^\{"(engine|mode)".*'),
    Bench("orchestration overhead per phase", ["benchmarks/orchestration_overhead.py", "--phases", "4"],
          "<= 1 s per phase after the first (which pays the imports)", r"^overhead per phase.*", timeout_s=900),
    Bench("one GRPO step end to end vs TRL's GRPOTrainer (8 x 8, <= 64 tokens, one core)",
          ["benchmarks/grpo_step_vs_trl.py", "--steps", "6", "--blocks", "2"],
          ">= 1.2x TRL's trained tokens/s at TRL-matched settings, >= 1.0x at the project's defaults",
          r"^(ours|trl).*", needs=".venv-trl/bin/python", timeout_s=900),
    Bench("vllm engine vs hf engine", ["benchmarks/vllm_engine.py", "--prompts", "32", "--syncs", "3"],
          "vllm >= 1.5x hf tokens/s; weight sync <= 1 s", r"^\{.*"),
    Bench("vllm engine, two replicas (a core each), vs hf engine",
          ["benchmarks/vllm_engine.py", "--prompts", "64", "--syncs", "3", "--replicas", "2"],
          "vllm >= 1.5x hf tokens/s; weight sync <= 1 s", r"^\{.*"),
    Bench("RFT and DPO from the bandit's 50/50 warm start (with and without LoRA)", ["benchmarks/methods.py"],
          "each raises held-out sampled success over the warm start (paired 95% CI above 0)",
          r"^(warm start|RFT|DPO).*"),
    Bench("hostile requests (BabyAI, 1,000)", ["benchmarks/fuzz_servers.py", "--envs", "babyai", "--examples",
                                               "1000"], "0 undocumented 5xx; healthy after", r"^\{.*"),
]


def run(bench: Bench) -> dict[str, str]:
    command = " ".join(["python", *bench.args])
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    if bench.needs and "/" in bench.needs and not (ROOT / bench.needs).exists():
        figure = f"skipped: needs {bench.needs} (`make trl`; not a project dependency)"
    elif bench.needs and "/" not in bench.needs and importlib.util.find_spec(bench.needs) is None:
        figure = f"skipped: needs `pip install {bench.needs}` (not a project dependency)"
    else:
        try:
            done = subprocess.run([sys.executable, *bench.args], cwd=ROOT, capture_output=True, text=True,
                                  timeout=bench.timeout_s)
            lines = [line.strip() for line in done.stdout.splitlines() if re.match(bench.figure, line.strip())]
            if done.returncode != 0:
                figure = f"FAILED (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
            else:
                figure = "<br>".join(lines) or f"(no figure line; last output: {done.stdout.strip()[-200:]})"
        except subprocess.TimeoutExpired:
            figure = f"FAILED: over {bench.timeout_s} s"
    return {"name": bench.name, "figure": figure.replace("|", "/"), "target": bench.target, "command": command,
            "date": dt.date.today().isoformat(), "seconds": f"{time.perf_counter() - started:.0f}",
            "load": f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}"}


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (platform.processor() is empty on most Linux builds); the same
    code runs ~2x apart on two hosts of this machine's kind, so the doc says which one it ran on."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def write(rows: list[dict[str, str]], out: Path, note: str = "") -> None:
    from envs.files import atomic_write

    cores = os.cpu_count()
    lines = ["# Benchmarks", "",
             f"Written by `make bench` (`python benchmarks/run_all.py`), last on {dt.date.today().isoformat()}: "
             f"{platform.machine()} ({cpu_model()}), {cores} cores, Python {platform.python_version()}. Each row's "
             "date is its own run's (`--only` reruns some rows and keeps the others). Load is the 1-minute load "
             "average before -> after each benchmark (other work on the machine shows there). Sizes are reduced to fit "
             "~20 minutes; each command runs alone at full size too.",
             *(["", note, ""] if note else [""]),
             "| benchmark | figure | target | command | date | seconds | load |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['figure']} | {r['target']} | `{r['command']}` | {r['date']} | {r['seconds']} | "
              f"{r['load']} |" for r in rows]
    lines += ["", "Not rerun here (long; figures in their own documents): the learning benchmarks "
              "(`benchmarks/learning_babyai.py`, `benchmarks/bandit_learning_seeds.py`, `docs/measurements.md`), the "
              "curriculum study (`docs/curriculum-study.md`), the 30-minute soaks and 10,000-request fuzzing "
              "(`docs/reliability.md`).", ""]
    atomic_write(out, "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="names (substrings) of the benchmarks to run")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--note", default="", help="a line about this run (e.g. what else the machine was doing)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    chosen = [b for b in BENCHES if not args.only or any(o in b.name for o in args.only)]
    rows = []
    for bench in chosen:
        print(f"== {bench.name}: python {' '.join(bench.args)}", flush=True)
        rows.append(run(bench))
        print(f"   {rows[-1]['figure']} ({rows[-1]['seconds']} s)", flush=True)
    note = args.note
    if args.only and args.out.exists():  # the benchmarks not rerun keep their rows (and the note of their run)
        kept, old_note = existing(args.out)
        fresh = {r["name"] for r in rows}
        order = [b.name for b in BENCHES]
        rows = sorted([*rows, *(r for r in kept if r["name"] not in fresh)],
                      key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
        note = note or old_note
    write(rows, args.out, note)
    print(f"wrote {args.out}")


def existing(out: Path) -> tuple[list[dict[str, str]], str]:
    """The rows of a benchmarks page :func:`write` wrote, and the note above its table. A page written before rows
    had dates gives each row the page's date."""
    keys = ["name", "figure", "target", "command", "date", "seconds", "load"]
    text = out.read_text().split("\n| benchmark |")[0]
    note = "\n".join(text.splitlines()[3:]).strip()
    written = re.search(r"\b(\d{4}-\d{2}-\d{2})\b", text)
    rows = []
    for line in out.read_text().splitlines():
        cells = line.strip().removeprefix("| ").removesuffix(" |").split(" | ")
        if len(cells) == len(keys) - 1:  # no date column
            cells.insert(4, written.group(1) if written else "")
        if len(cells) == len(keys) and line.startswith("| ") and cells[0] not in ("benchmark", "---"):
            row = dict(zip(keys, cells, strict=True))
            row["command"] = row["command"].strip("`")
            rows.append(row)
    return rows, note


if __name__ == "__main__":
    main()

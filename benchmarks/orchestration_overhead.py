"""Orchestration overhead per phase: the Prefect task running the phase's DVC stage (status check, the
stage's command, dvc.lock record), against calling ``train_phase`` directly in one warm process.

    python benchmarks/orchestration_overhead.py [--env babyai] [--phases 3]

A scratch working copy (git + DVC) gets a curriculum of --phases one-step phases. After a warm-up (base
model, splits), the flow trains them (each phase a Prefect task running its DVC stage); then the same
phases are trained by direct ``train_phase`` calls against one server. Overhead = stage time - direct time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def sh(cwd: Path, *cmd: str) -> None:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True)


def workspace(env: str, phases: int) -> Path:
    """The tests' scratch working copy (git + DVC) with ``phases`` one-step phases of ``env``."""
    sys.path.insert(0, str(ROOT))
    from tests.test_pipeline import _workspace

    return _workspace(Path(tempfile.mkdtemp(prefix="overhead-")), envs=env, one_step_phases=phases)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env", default="babyai")
    parser.add_argument("--phases", type=int, default=3)
    args = parser.parse_args()
    work = workspace(args.env, args.phases)
    os.environ.update(SCALINGINTER_ROOT=str(work), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                      PREFECT_HOME=str(work.parent / "prefect"), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                      PATH=f"{BIN}:{os.environ['PATH']}")
    os.chdir(work)
    started = time.perf_counter()
    sh(work, "dvc", "repro", "build_model", f"splits@{args.env}")  # warm-up: not per-phase work
    print(f"warm-up (base model, splits): {time.perf_counter() - started:.0f} s")

    from envs.launcher import running_server
    from flows.scalinginter_flow import scalinginter
    from training.phases.trainer import train_phase
    from training.settings.config import curriculum_config, train_config

    result = scalinginter(env=args.env, profile="smoke")
    stage = [row["task_seconds"] for row in result["phases"]]
    print("how each phase ran:", ", ".join(row["how"] for row in result["phases"]))
    direct = []
    config = train_config(args.env, "smoke")
    with running_server(args.env) as url:
        parent = work / "models" / "tiny"
        for phase in curriculum_config(args.env, "smoke").phases():
            t0 = time.perf_counter()
            out = work.parent / f"direct-{phase.index}"
            parent = train_phase(args.env, phase.index, phase.h, phase.steps, parent, out, config=config, url=url)
            direct.append(time.perf_counter() - t0)
    print(f"{'phase':>6} {'flow stage s':>13} {'direct s':>9} {'overhead s':>11}")
    for i, (s, d) in enumerate(zip(stage, direct, strict=True)):
        print(f"{i:>6} {s:>13.2f} {d:>9.2f} {s - d:>11.2f}")
    overhead = [s - d for s, d in zip(stage, direct, strict=True)]
    later = overhead[1:] or overhead  # the target is for the phases after the first, which pays the imports
    print(f"overhead per phase after the first: median {statistics.median(later):.2f} s, mean "
          f"{statistics.mean(later):.2f} s (target <= 1 s); the first {overhead[0]:.2f} s")
    shutil.rmtree(work.parent, ignore_errors=True)


if __name__ == "__main__":
    main()

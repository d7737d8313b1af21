"""The main job on the two open-world environments at smoke scale (the README's command with --env)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_pipeline import _sh, _workspace


@pytest.mark.slow
@pytest.mark.parametrize("env", ["deepsearch", pytest.param("webarena", marks=pytest.mark.browser)])
def test_main_job_runs_the_open_world_environments(env: str, tmp_path) -> None:
    work = _workspace(tmp_path, envs=env, one_step_phases=3)  # the smoke run's full scale: test_flow
    cmd = [str(Path(sys.executable).parent / "scalinginter"), "run", "--env", env, "--profile", "smoke"]
    environ = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_HOME": str(tmp_path / "prefect"),
               "COLUMNS": "200"}
    done = subprocess.run(cmd, cwd=work, env=environ, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "done: 3 phases" in done.stdout
    assert (work / f"runs/{env}/phase-2/final/manifest.json").exists()
    assert (work / f"runs/{env}/eval/metrics.json").exists() and (work / f"reports/{env}.html").exists()
    assert "disagreement" not in _sh(work, "scalinginter", "lineage", env)

"""Server memory stays flat under reset/close cycles (short version of benchmarks/env_memory.py)."""

from __future__ import annotations

import pytest

from benchmarks.env_memory import rss_growth_mb
from envs.launcher import running_server


@pytest.mark.slow
@pytest.mark.parametrize(("env", "space"), [("textcraft", 544), ("babyai", 900), ("deepsearch", 2800)])
def test_reset_close_cycles_do_not_grow_the_server(env: str, space: int) -> None:
    with running_server(env) as url:
        result = rss_growth_mb(url, cycles=1500, index_space=space, warmup=300)
    assert result["live_instances"] == 0
    assert result["growth_mb"] < 10, result

"""Shared fixtures: real environment servers on free localhost ports, started once per test session."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from envs.testing import running_server


@pytest.fixture(scope="session")
def env_server() -> Iterator[Callable[[str], str]]:
    """``env_server("babyai")`` -> base URL of a session-wide server for that environment."""
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}

        def get(env: str) -> str:
            if env not in urls:
                urls[env] = stack.enter_context(running_server(env, max_jvms=4) if env == "sciworld"
                                                else running_server(env))
            return urls[env]

        yield get

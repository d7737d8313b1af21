"""Shared fixtures: real environment servers on free localhost ports, started once per test session."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from envs.launcher import running_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub (this machine has none)
os.environ.setdefault("DVC_NO_ANALYTICS", "1")  # else the test workspaces' DVC leaves a file per command in /tmp


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread in every test process, whatever ran before in it.

    CPU results can depend on the thread count (reductions split by thread), and a fixture that set the
    count when first used made it depend on which tests an xdist worker had run before; one thread also
    keeps two workers from oversubscribing two cores.
    """
    import torch

    torch.set_num_threads(1)


# The end-to-end files, longest first (measured, `make test` --durations): run first, the two xdist workers
# each start on one and the short tests fill in around them, instead of one long test starting last.
LONGEST_FIRST = ("test_flow", "test_pipeline", "test_deployment", "test_warm", "test_openworld_flow", "test_remote",
                 "test_trainer", "test_strategy", "test_sciworld")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests first (the end-to-end files longest first), every other test after them in file order."""
    def rank(item: pytest.Item) -> tuple[int, int]:
        module = item.path.stem
        order = LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)
        return (0 if item.get_closest_marker("slow") else 1, order)

    items.sort(key=rank)  # stable: within a rank, the collection order


@contextlib.contextmanager
def serving(app: object) -> Iterator[str]:
    """A FastAPI app served by uvicorn on a free localhost port in a thread of this process (a server whose
    routes or backend a test changed); yields its base URL and always stops it."""
    import threading

    import uvicorn

    sock = socket.socket()  # bound here, on a port the kernel picks: no other process can take it first
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        thread.join(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


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


def build_test_model(out: Path) -> Path:
    """The tiny default policy built from a small expert corpus (the tests' and the bandit benchmark's)."""
    from envs.corpus import expert_corpus
    from training.model import build_tiny

    return build_tiny(list(expert_corpus({"babyai": 2, "textcraft": 2})), out, seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """The tiny default policy, built once per test session."""
    return build_test_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_policy(tiny_model_dir):
    """(model, tokenizer) of the tiny policy, loaded once."""
    from training.model import load_policy

    model, tokenizer = load_policy(tiny_model_dir)
    return model.eval(), tokenizer


def bandit_conversation(arm: str) -> list[dict[str, str]]:
    """One bandit episode in the rollout's message format, choosing ``arm``."""
    from envs.bandit.backend import OBSERVATION
    from envs.bandit.client import INSTRUCTION

    return [{"role": "user", "content": INSTRUCTION}, {"role": "assistant", "content": "OK."},
            {"role": "user", "content": OBSERVATION},
            {"role": "assistant", "content": f"Thought: pick one.\nAction: {arm}"}]


def build_bandit_warm_start(tiny_model: Path, out: Path) -> Path:
    """The tiny model after SFT on as many 'left' as 'right' replies: it picks either, about evenly."""
    from training.warmstart.sft import SFTConfig, sft

    return sft(tiny_model, out, [bandit_conversation("left"), bandit_conversation("right")] * 8,
               SFTConfig(epochs=30, lr=2e-3, batch_size=8))


@pytest.fixture(scope="session")
def bandit_warm_start(tiny_model_dir, tmp_path_factory):
    """See ``build_bandit_warm_start``; built once per test session."""
    return build_bandit_warm_start(tiny_model_dir, tmp_path_factory.mktemp("bandit") / "sft")

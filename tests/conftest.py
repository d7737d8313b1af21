"""Shared fixtures: real environment servers on free localhost ports, started once per test session."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import pytest

from envs.testing import running_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub (this machine has none)


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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """The tiny default policy, built once per test session from a small expert corpus."""
    from envs.corpus import expert_corpus
    from training.model import build_tiny

    out = tmp_path_factory.mktemp("tiny-model")
    return build_tiny(list(expert_corpus({"babyai": 2, "textcraft": 2})), out, seed=0)


@pytest.fixture(scope="session")
def tiny_policy(tiny_model_dir):
    """(model, tokenizer) of the tiny policy, loaded once."""
    import torch

    from training.model import load_policy

    torch.set_num_threads(1)
    model, tokenizer = load_policy(tiny_model_dir)
    return model.eval(), tokenizer


def bandit_conversation(arm: str) -> list[dict[str, str]]:
    """One bandit episode in the rollout's message format, choosing ``arm``."""
    from envs.bandit.backend import OBSERVATION
    from envs.bandit.client import INSTRUCTION

    return [{"role": "user", "content": INSTRUCTION}, {"role": "assistant", "content": "OK."},
            {"role": "user", "content": OBSERVATION},
            {"role": "assistant", "content": f"Thought: pick one.\nAction: {arm}"}]


@pytest.fixture(scope="session")
def bandit_warm_start(tiny_model_dir, tmp_path_factory):
    """The tiny model after SFT on as many 'left' as 'right' replies: it picks either, about evenly."""
    from training.sft import SFTConfig, sft

    out = tmp_path_factory.mktemp("bandit") / "sft"
    return sft(tiny_model_dir, out, [bandit_conversation("left"), bandit_conversation("right")] * 8,
               SFTConfig(epochs=30, lr=2e-3, batch_size=8))

"""The trainers learn: on the bandit (one action pays), RL after a 50/50 SFT warm start raises success."""

from __future__ import annotations

from pathlib import Path

import pytest

from envs.splits import load_split
from tests.conftest import bandit_conversation
from training.config_train import TrainConfig
from training.evaluate import evaluate
from training.sft import to_trajectory
from training.trainer import train_phase


@pytest.fixture(scope="module")
def warm_start(bandit_warm_start: Path) -> Path:
    return bandit_warm_start


def test_sft_trains_only_the_agents_reply(tiny_policy) -> None:
    tokenizer = tiny_policy[1]
    t = to_trajectory(bandit_conversation("right"), tokenizer)
    trained = tokenizer.decode([i for i, m in zip(t.input_ids, t.loss_mask, strict=True) if m])
    assert trained == "Thought: pick one.\nAction: right<|im_end|>"  # not the acknowledgement "OK."


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "reinforce_pp", "ppo"])
def test_rl_raises_success_over_the_warm_start(algorithm: str, warm_start: Path, env_server, tmp_path) -> None:
    url = env_server("bandit")
    test = [r["item_id"] for r in load_split("bandit", "test")]
    before = evaluate(warm_start, "bandit", url, test, h=1, k=4, temperature=1.0, max_new_tokens=16)
    config = TrainConfig(algorithm=algorithm, batch_items=4, n_samples=4, max_new_tokens=16, lr=1e-3, kl_coef=0,
                         mini_batch_size=16, micro_batch_size=16, log_rollouts=False)
    final = train_phase("bandit", 0, 1, 8, warm_start, tmp_path, config=config, url=url)
    after = evaluate(final, "bandit", url, test, h=1, k=4, temperature=1.0, max_new_tokens=16)
    assert 0.2 < before.success_rate < 0.8  # the warm start is undecided
    assert after.success_rate >= 0.8 and after.success_rate > before.success_rate + 0.2, (before, after)

"""The trainers learn: on the bandit (one action pays), RL after a 50/50 SFT warm start raises success.

The setting sits far from any knife edge (measured over 8 training seeds per algorithm by
``benchmarks/bandit_learning_seeds.py``, figures in docs/guide/tests.md): lr 3e-4 over 12 steps, and no update on a
step whose groups all agree. At lr 1e-3 the tiny policy learns "right" within 3-4 steps and then wrecks
itself on the steps after: with every group flat, Adam's momentum keeps pushing the "right" logit up
everywhere ("right right right ...") until success falls to 0, so the outcome depended on the step at
which the run converged.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from envs.splits import load_split
from tests.conftest import bandit_conversation
from training.evaluation.evaluate import evaluate, paired_difference_ci
from training.phases.trainer import train_phase
from training.settings.config import TrainConfig
from training.warmstart.sft import to_trajectory

EVAL = {"h": 1, "k": 8, "temperature": 1.0, "max_new_tokens": 16}  # 16 items x 8 samples
STEPS = 12


def bandit_config(algorithm: str, seed: int = 0, lr: float = 3e-4) -> TrainConfig:
    """The learning test's trainer settings (also run over many seeds by benchmarks/bandit_learning_seeds.py)."""
    return TrainConfig(algorithm=algorithm, seed=seed, batch_items=4, n_samples=4, max_new_tokens=16, lr=lr,
                       kl_coef=0, skip_flat_steps=True, mini_batch_size=16, micro_batch_size=16, log_rollouts=False)


@pytest.fixture(scope="module")
def warm_start(bandit_warm_start: Path) -> Path:
    return bandit_warm_start


def test_sft_trains_only_the_agents_reply(tiny_policy) -> None:
    tokenizer = tiny_policy[1]
    t = to_trajectory(bandit_conversation("right"), tokenizer)
    trained = tokenizer.decode([i for i, m in zip(t.input_ids, t.loss_mask, strict=True) if m])
    assert trained == "Thought: pick one.\nAction: right<|im_end|>"  # not the acknowledgement "OK."


def test_sft_masks_the_replies_without_generation_tags_in_the_template(tiny_policy) -> None:
    """Hub templates such as Qwen2.5's have no {% generation %} tags; the mask must not depend on them (it came
    out all zeros, and SFT trained on nothing, without an error)."""
    import copy

    tokenizer = tiny_policy[1]
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert "generation %}" not in plain.chat_template
    conversation = [*bandit_conversation("left"), {"role": "user", "content": "You lost."},
                    {"role": "assistant", "content": "Thought: again.\nAction: right"}]
    tagged, untagged = to_trajectory(conversation, tokenizer), to_trajectory(conversation, plain)
    assert untagged.input_ids == tagged.input_ids and untagged.loss_mask == tagged.loss_mask
    trained = tokenizer.decode([i for i, m in zip(untagged.input_ids, untagged.loss_mask, strict=True) if m])
    assert trained == "Thought: pick one.\nAction: left<|im_end|>Thought: again.\nAction: right<|im_end|>"
    with pytest.raises(ValueError, match="at least one assistant reply"):
        to_trajectory(conversation[:3], plain)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "reinforce_pp", "ppo"])
def test_rl_raises_success_over_the_warm_start(algorithm: str, warm_start: Path, env_server, tmp_path) -> None:
    url = env_server("bandit")
    test = [r["item_id"] for r in load_split("bandit", "test")]
    before = evaluate(warm_start, "bandit", url, test, **EVAL)
    final = train_phase("bandit", 0, 1, STEPS, warm_start, tmp_path, config=bandit_config(algorithm), url=url)
    after = evaluate(final, "bandit", url, test, **EVAL)
    assert 0.2 < before.success_rate < 0.8, before  # the warm start is undecided
    gain, low, _ = paired_difference_ci(before.item_success(), after.item_success())
    # measured after 12 steps: 0.81-0.94 over seeds 0-7 of every algorithm, from 0.625 (a run that does not
    # learn, lr 1e-9, stays at 0.625 with a paired interval around 0 and fails both checks)
    assert after.success_rate >= 0.75 and low > 0, (before.success_rate, after.success_rate, gain, low)

"""Every advantage estimator against hand-computed values, with masked tokens between agent turns and the
terminal reward on the last agent token."""

from __future__ import annotations

import math

import pytest
import torch

from training.rl.advantages import gae, grpo, masked_mean, reinforce_plus_plus, rloo

# Two trajectories of one item. Positions: 0 prompt, 1-2 agent turn 1, 3 observation, 4-5 agent turn 2.
MASK = torch.tensor([[0, 1, 1, 0, 1, 1], [0, 1, 1, 0, 0, 0]], dtype=torch.float)
REWARDS = torch.tensor([[0, 0, 0, 0, 0, 1.0], [0, 0, 0.0, 0, 0, 0]])  # success on the last agent token
GROUP = torch.tensor([0, 0])


def test_grpo_z_scores_within_the_group_and_zeroes_flat_groups() -> None:
    adv, flat = grpo(REWARDS, MASK, GROUP)
    # scores 1 and 0: mean 0.5, unbiased std sqrt(0.5) -> z = +-0.5 / (0.7071 + 1e-6)
    z = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert torch.allclose(adv[0], z * MASK[0]) and torch.allclose(adv[1], -z * MASK[1])
    assert flat == 0
    same = torch.tensor([[0, 0, 0, 0, 0, 1.0], [0, 0, 1.0, 0, 0, 0]])
    adv, flat = grpo(same, MASK, GROUP)
    assert flat == 1 and torch.count_nonzero(adv) == 0
    adv, flat = grpo(REWARDS, MASK, torch.tensor([0, 1]))  # groups of one sample carry no signal
    assert flat == 2 and torch.count_nonzero(adv) == 0


def test_rloo_subtracts_the_mean_of_the_other_samples() -> None:
    rewards = torch.zeros(3, 4)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 0.5])
    mask = torch.tensor([[0, 1, 1, 1]] * 3, dtype=torch.float)
    adv = rloo(rewards, mask, torch.tensor([0, 0, 0]))
    # 1 - (0 + 0.5)/2 = 0.75;  0 - (1 + 0.5)/2 = -0.75;  0.5 - (1 + 0)/2 = 0
    assert torch.allclose(adv[:, -1], torch.tensor([0.75, -0.75, 0.0]))
    assert torch.all(adv[:, 0] == 0)


def test_reinforce_plus_plus_discounts_over_agent_tokens_only_then_whitens() -> None:
    adv = reinforce_plus_plus(REWARDS, MASK, gamma=0.5)
    # trajectory 0 returns at agent tokens 1, 2, 4, 5: 0.125, 0.25, 0.5, 1 (position 3 is skipped);
    # trajectory 1 has no reward: 0, 0. Whitened over the six agent tokens.
    raw = [0.125, 0.25, 0.5, 1.0, 0.0, 0.0]
    mean = sum(raw) / 6
    std = math.sqrt(sum((r - mean) ** 2 for r in raw) / 6)
    expected = [(r - mean) / std for r in raw]
    got = [adv[0, 1], adv[0, 2], adv[0, 4], adv[0, 5], adv[1, 1], adv[1, 2]]
    assert [round(float(g), 5) for g in got] == [round(e, 5) for e in expected]
    assert adv[0, 3] == 0 and adv[0, 0] == 0 and torch.all(adv[1, 3:] == 0)


def test_gae_sees_the_terminal_reward_through_masked_positions() -> None:
    values = torch.tensor([[9.0, 0.2, 0.4, 9.0, 0.6, 0.8], [9.0, 0.3, 0.1, 9.0, 9.0, 9.0]])
    adv, returns = gae(REWARDS, values, MASK, gamma=0.9, lam=1.0)
    # lambda = 1: returns are discounted rewards over agent tokens: 0.729, 0.81, 0.9, 1 (skipping position 3)
    assert torch.allclose(returns[0], torch.tensor([0, 0.729, 0.81, 0, 0.9, 1.0]))
    assert torch.allclose(returns[1], torch.zeros(6))
    raw = torch.tensor([0.729 - 0.2, 0.81 - 0.4, 0.9 - 0.6, 1.0 - 0.8, -0.3, -0.1])
    expected = (raw - raw.mean()) / raw.std(unbiased=False)
    got = torch.stack([adv[0, 1], adv[0, 2], adv[0, 4], adv[0, 5], adv[1, 1], adv[1, 2]])
    assert torch.allclose(got, expected, atol=1e-4)
    assert adv[0, 3] == 0 and adv[1, 0] == 0  # values at masked positions (9.0) never leak in


def test_gae_with_lambda_zero_is_one_step_td() -> None:
    values = torch.tensor([[0.0, 0.5, 0.25, 0.7]])
    mask = torch.tensor([[0, 1, 0, 1]], dtype=torch.float)
    rewards = torch.tensor([[0, 0, 0, 1.0]])
    _, returns = gae(rewards, values, mask, gamma=1.0, lam=0.0)
    # at 3: r + 0 = 1; at 1: r + V(next agent token, position 3) = 0 + 0.7, never V(2) of the observation
    assert torch.allclose(returns, torch.tensor([[0, 0.7, 0, 1.0]]))


def test_masked_mean_ignores_masked_positions_and_empty_masks() -> None:
    x = torch.tensor([[1.0, 100.0, 3.0]])
    assert masked_mean(x, torch.tensor([[1.0, 0, 1]])) == 2.0
    assert masked_mean(x, torch.zeros(1, 3)) == 0.0


def test_grpo_without_std_normalisation_only_centres_each_group() -> None:
    rewards = torch.tensor([[0, 1.0], [0, 0.0], [0, 0.0], [0, 0.0]])
    mask = torch.ones(4, 2)
    group = torch.tensor([0, 0, 0, 0])
    centred, _ = grpo(rewards, mask, group, norm_std=False)
    assert torch.allclose(centred[:, 0], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    scaled, _ = grpo(rewards, mask, group)
    assert torch.allclose(scaled[:, 0], centred[:, 0] / 0.5, atol=1e-4)  # the group's std is 0.5


def _long_failures() -> tuple[torch.Tensor, torch.Tensor]:
    """One group, as multi-turn rollouts make it: a 1-turn success (2 tokens) and a failure cut by the turn
    cap (6 tokens); GRPO's advantages are +0.71 and -0.71 on every token of each."""
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.float)
    rewards = torch.zeros(2, 6)
    rewards[0, 1] = 1.0
    advantages, _ = grpo(rewards, mask, torch.tensor([0, 0]))
    return advantages, mask


def test_token_mean_lets_long_failing_trajectories_outweigh_the_successes() -> None:
    from training.rl.losses import loss_weights

    advantages, mask = _long_failures()
    net = float((advantages * loss_weights(mask, "token-mean")).sum())
    assert net == pytest.approx((2 * 0.7071 - 6 * 0.7071) / 8, abs=1e-3)  # pushes down what the policy does


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_per_trajectory_aggregation_keeps_each_group_balanced(mode: str) -> None:
    from training.rl.losses import loss_weights

    advantages, mask = _long_failures()
    weights = loss_weights(mask, mode, norm=6.0)
    per_trajectory = (advantages * weights).sum(-1)
    if mode == "seq-mean-token-mean":  # each trajectory weighs the same: the group's advantages sum to 0
        assert float(per_trajectory.sum()) == pytest.approx(0.0, abs=1e-6)
        assert float(weights.sum()) == pytest.approx(1.0)
    else:  # every token the same constant weight, whatever its trajectory's length
        assert torch.allclose(weights[mask.bool()], torch.full((8,), 1 / 12))


def test_loss_weights_refuse_an_unknown_mode() -> None:
    from training.rl.losses import loss_weights

    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        loss_weights(torch.ones(1, 2), "sequence")  # type: ignore[arg-type]

import math

import pytest
import torch

from r1fit.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    group_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0])


def test_group_of_two_with_std_scaling():
    # Groups [1, 0] and [0, 1]: mean 0.5, deviations +-0.5; unbiased std = sqrt(0.5) = 0.70711,
    # so adv = +-0.5 / (0.70711 + 1e-4) = +-0.70700.
    expected = 0.5 / (math.sqrt(0.5) + 1e-4)
    adv = group_advantages(REWARDS, num_generations=2)
    torch.testing.assert_close(adv, torch.tensor([expected, -expected, -expected, expected]))


def test_group_of_two_without_std_scaling():
    adv = group_advantages(REWARDS, num_generations=2, scale_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_group_of_four_with_std_scaling():
    # One group [1, 0, 0, 1]: mean 0.5, unbiased variance = 4 * 0.25 / 3 = 1/3, std = 0.57735,
    # so adv = +-0.5 / (0.57735 + 1e-4) = +-0.86588.
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    adv = group_advantages(REWARDS, num_generations=4)
    torch.testing.assert_close(adv, torch.tensor([expected, -expected, -expected, expected]))
    assert adv[0].item() == pytest.approx(0.86588, abs=1e-5)


def test_group_of_four_without_std_scaling():
    adv = group_advantages(REWARDS, num_generations=4, scale_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_equal_rewards_give_zero_advantage_not_nan():
    adv = group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), num_generations=2)
    torch.testing.assert_close(adv, torch.zeros(4))


def test_groups_are_contiguous_rows():
    # Group 0 = [3, 1] (mean 2), group 1 = [10, 20] (mean 15); interleaved grouping would differ.
    adv = group_advantages(torch.tensor([3.0, 1.0, 10.0, 20.0]), num_generations=2, scale_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -5.0, 5.0]))


def test_integer_rewards_are_promoted():
    adv = group_advantages(torch.tensor([1, 0]), num_generations=2, scale_std=False)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5]))


def test_registry_matches_function():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}
    torch.testing.assert_close(get_advantage_estimator("grpo")(REWARDS, 2), group_advantages(REWARDS, 2))
    torch.testing.assert_close(
        get_advantage_estimator("dr_grpo")(REWARDS, 2), group_advantages(REWARDS, 2, scale_std=False)
    )


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(REWARDS, num_generations=1)
    with pytest.raises(ValueError, match="not a multiple of num_generations=3"):
        group_advantages(REWARDS, num_generations=3)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(REWARDS.view(2, 2), num_generations=2)
    with pytest.raises(ValueError, match=r"allowed: \['dr_grpo', 'grpo', 'reinforce_pp', 'reinforce_pp_baseline', "
                                         r"'rloo'\]"):
        get_advantage_estimator("ppo")
    for name in ("rloo", "reinforce_pp", "reinforce_pp_baseline"):
        with pytest.raises(ValueError, match="not a multiple of num_generations=3"):
            get_advantage_estimator(name)(REWARDS, 3)


# ---------------------------------------------------------------- RLOO, by hand


def test_rloo_leave_one_out_by_hand():
    # Group [1, 0, 0, 1]: for r_0 = 1 the other three average (0 + 0 + 1) / 3 = 1/3, so A_0 = 2/3;
    # for r_1 = 0 they average (1 + 0 + 1) / 3 = 2/3, so A_1 = -2/3. Equals G/(G-1) (r - mean) = 4/3 * 0.5.
    adv = rloo_advantages(REWARDS, num_generations=4)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    # Groups [3, 1] and [10, 20, ...] of two: A = r - the other one: [2, -2], [-10, 10].
    adv = rloo_advantages(torch.tensor([3.0, 1.0, 10.0, 20.0]), num_generations=2)
    torch.testing.assert_close(adv, torch.tensor([2.0, -2.0, -10.0, 10.0]))


def test_rloo_matches_slow_loop():
    rewards = torch.randn(12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    g = 4
    expected = [rewards[i] - sum(rewards[j] for j in range(i // g * g, i // g * g + g) if j != i) / (g - 1)
                for i in range(12)]
    torch.testing.assert_close(rloo_advantages(rewards, g), torch.stack(expected))


# ---------------------------------------------------------------- REINFORCE++, by hand


def test_reinforce_pp_normalises_over_the_whole_batch():
    # Rewards [3, 1, 10, 20]: batch mean 8.5; deviations [-5.5, -7.5, 1.5, 11.5];
    # unbiased variance (30.25 + 56.25 + 2.25 + 132.25) / 3 = 221 / 3 = 73.6667, std = 8.58293.
    rewards = torch.tensor([3.0, 1.0, 10.0, 20.0], dtype=torch.float64)
    std = math.sqrt(221 / 3)
    expected = torch.tensor([-5.5, -7.5, 1.5, 11.5], dtype=torch.float64) / (std + 1e-4)
    torch.testing.assert_close(reinforce_pp_advantages(rewards, 2), expected)
    torch.testing.assert_close(get_advantage_estimator("reinforce_pp")(rewards, 2), expected)


def test_reinforce_pp_baseline_subtracts_group_mean_then_batch_std():
    # Groups [3, 1] (mean 2) and [10, 20] (mean 15): x = [1, -1, -5, 5], batch mean 0;
    # unbiased variance (1 + 1 + 25 + 25) / 3 = 52 / 3, std = 4.16333.
    rewards = torch.tensor([3.0, 1.0, 10.0, 20.0], dtype=torch.float64)
    expected = torch.tensor([1.0, -1.0, -5.0, 5.0], dtype=torch.float64) / (math.sqrt(52 / 3) + 1e-4)
    torch.testing.assert_close(reinforce_pp_advantages(rewards, 2, group_baseline=True), expected)
    torch.testing.assert_close(get_advantage_estimator("reinforce_pp_baseline")(rewards, 2), expected)
    # Unlike GRPO (per-group std: +-0.7071 in both groups), the small group keeps its small scale.
    assert abs(expected[0]) < abs(expected[2])


def test_reinforce_pp_depends_on_the_other_groups():
    # The batch std is over every row: changing group 1 changes group 0's advantages, which is
    # why the step's rewards are gathered from every process before any estimator runs.
    a = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, group_baseline=True)
    b = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 0.0, 5.0]), 2, group_baseline=True)
    assert not torch.allclose(a[:2], b[:2])


def test_reinforce_pp_equal_rewards_give_zero_not_nan():
    torch.testing.assert_close(reinforce_pp_advantages(torch.ones(4), 2), torch.zeros(4))

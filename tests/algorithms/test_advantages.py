import math

import pytest
import torch

from r1fit.algorithms.advantages import ADVANTAGE_ESTIMATORS, get_advantage_estimator, group_advantages

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
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo"}
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
    with pytest.raises(ValueError, match=r"allowed: \['dr_grpo', 'grpo'\]"):
        get_advantage_estimator("ppo")

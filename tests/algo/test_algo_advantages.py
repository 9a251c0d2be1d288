"""Hand-worked checks of group_advantages and zero_std_fraction."""

import math

import pytest
import torch

from fastgrpo.algo import group_advantages, zero_std_fraction

# Two prompts, G = 3: group 0 = [1, 2, 3], group 1 = [4, 4, 4] (no signal).
REWARDS = torch.tensor([1.0, 2.0, 3.0, 4.0, 4.0, 4.0])
EPS = 1e-4


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


def test_mean_baseline_with_group_scale_divides_by_the_unbiased_group_std():
    # group 0: mean 2, centred [-1, 0, 1], unbiased var = (1 + 0 + 1) / 2 = 1 -> std 1
    # group 1: centred [0, 0, 0], std 0 -> 0 / (0 + eps) = 0
    adv = group_advantages(REWARDS, 3)
    d = 1.0 + EPS
    close(adv, [-1 / d, 0.0, 1 / d, 0.0, 0.0, 0.0])


def test_mean_baseline_without_scaling_is_just_the_centred_reward():
    close(group_advantages(REWARDS, 3, scale="none"), [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0])


def test_batch_scale_divides_by_the_std_of_all_rewards_not_of_the_centred_advantages():
    # all rewards [1, 2, 3, 4, 4, 4]: mean 3, squared deviations 4+1+0+1+1+1 = 8,
    # unbiased var 8 / 5 = 1.6 -> std sqrt(1.6) = 1.264911.
    # (std of the centred advantages [-1,0,1,0,0,0] would be sqrt(2/5) = 0.632456 instead.)
    d = math.sqrt(1.6) + EPS
    close(group_advantages(REWARDS, 3, scale="batch"), [-1 / d, 0.0, 1 / d, 0.0, 0.0, 0.0])


def test_leave_one_out_baseline_subtracts_the_mean_of_the_other_rewards():
    # 1 - (2+3)/2 = -1.5 ; 2 - (1+3)/2 = 0 ; 3 - (1+2)/2 = 1.5 ; 4 - 4 = 0
    close(
        group_advantages(REWARDS, 3, baseline="leave_one_out", scale="none"),
        [-1.5, 0.0, 1.5, 0.0, 0.0, 0.0],
    )


def test_leave_one_out_with_group_scale_divides_by_the_group_std():
    d = 1.0 + EPS  # group 0 std is 1 (see above)
    close(
        group_advantages(REWARDS, 3, baseline="leave_one_out"),
        [-1.5 / d, 0.0, 1.5 / d, 0.0, 0.0, 0.0],
    )


def test_leave_one_out_with_batch_scale_uses_the_batch_reward_std():
    d = math.sqrt(1.6) + EPS
    close(
        group_advantages(REWARDS, 3, baseline="leave_one_out", scale="batch"),
        [-1.5 / d, 0.0, 1.5 / d, 0.0, 0.0, 0.0],
    )


def test_two_generations_give_plus_minus_one_over_root_two_scaled_values():
    # group [0, 1]: mean 0.5, centred [-0.5, 0.5], unbiased std sqrt(0.25+0.25) = 0.707107
    # leave-one-out without scaling: [0 - 1, 1 - 0] = [-1, 1]
    s = math.sqrt(0.5) + EPS
    close(group_advantages(torch.tensor([0.0, 1.0]), 2), [-0.5 / s, 0.5 / s])
    close(
        group_advantages(torch.tensor([0.0, 1.0]), 2, baseline="leave_one_out", scale="none"),
        [-1.0, 1.0],
    )


def test_custom_eps_is_added_to_the_std():
    # group 0 std 1, eps 1 -> divide by 2
    adv = group_advantages(REWARDS, 3, eps=1.0)
    close(adv, [-0.5, 0.0, 0.5, 0.0, 0.0, 0.0])


def test_integer_rewards_are_promoted_to_float():
    adv = group_advantages(torch.tensor([0, 2]), 2, scale="none")
    assert adv.is_floating_point()
    close(adv, [-1.0, 1.0])


def test_zero_std_fraction_counts_groups_with_all_equal_rewards():
    # group 0 varies, group 1 is constant -> 1 of 2 groups
    close(zero_std_fraction(REWARDS, 3), 0.5)
    close(zero_std_fraction(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2), 1.0)
    close(zero_std_fraction(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2), 0.0)


@pytest.mark.parametrize(
    ("rewards", "g", "message"),
    [
        (torch.ones(5), 2, "multiple of num_generations"),
        (torch.ones(4), 1, ">= 2"),
        (torch.ones(2, 2), 2, "1-D"),
        (torch.ones(0), 2, "positive multiple"),
    ],
)
def test_bad_shapes_or_group_sizes_raise_a_clear_value_error(rewards, g, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards, g)
    with pytest.raises(ValueError, match=message):
        zero_std_fraction(rewards, g)


def test_unknown_scale_or_baseline_names_raise_and_list_the_valid_ones():
    with pytest.raises(ValueError, match="group, batch, none"):
        group_advantages(REWARDS, 3, scale="std")
    with pytest.raises(ValueError, match="mean, leave_one_out"):
        group_advantages(REWARDS, 3, baseline="rloo")
    with pytest.raises(ValueError, match="eps"):
        group_advantages(REWARDS, 3, eps=-1.0)

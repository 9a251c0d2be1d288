"""DAPO's soft overlong punishment, and the length columns every reward receives."""

from __future__ import annotations

import pytest

from fastgrpo.rewards import RewardSet
from fastgrpo.rewards.overlong import overlong_penalty


def test_no_penalty_up_to_limit_minus_buffer_then_linear_to_minus_factor():
    lengths = [10, 75, 88, 100, 120]
    values = overlong_penalty(
        [""] * 5, [""] * 5, lengths, [100] * 5, overlong_buffer=25, overlong_penalty_factor=2.0
    )
    assert values == pytest.approx([0.0, 0.0, -2.0 * 13 / 25, -2.0, -2.0])


def test_the_default_buffer_is_a_quarter_of_the_limit():
    assert overlong_penalty(["", ""], ["", ""], [96, 112], [128, 128]) == pytest.approx([0.0, -0.5])


def test_a_buffer_longer_than_the_limit_is_refused():
    with pytest.raises(ValueError, match="between 1 and the length limit 8"):
        overlong_penalty([""], [""], [4], [8], overlong_buffer=9)


def test_a_reward_spec_binds_options_and_the_set_passes_the_length_columns():
    rewards = RewardSet.from_specs(
        [{"name": "overlong_penalty", "options": {"overlong_buffer": 4}, "weight": 0.5}]
    )
    columns = {"completion_lengths": [2, 6, 8], "max_completion_length": [8, 8, 8]}
    result = rewards(["p"] * 3, ["a", "b", "c"], columns)
    assert result.total == pytest.approx([0.0, -0.25, -0.5])
    with pytest.raises(ValueError, match="'options' must be a mapping"):
        RewardSet.from_specs([{"name": "overlong_penalty", "options": 4}])

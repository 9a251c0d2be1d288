"""Tests for reward lookup and RewardSet: weighting, fault handling and user rewards."""

import logging
import math
import sys

import pytest

from fastgrpo.rewards import (
    BUILTIN_REWARDS,
    RewardResult,
    RewardSet,
    answer_format,
    math_accuracy,
    resolve_reward,
)
from fastgrpo.rewards.overlong import overlong_penalty

PROMPTS = ["What is 9 * 2?", "What is 9 * 2?", "What is 9 * 2?"]
COMPLETIONS = ["9 * 2 = 18\n#### 18", "It is 17", "no idea"]
COLUMNS = {"answer": ["18", "18", "18"]}


def constant_reward(value):
    """A reward that gives every completion the same value."""

    def reward(prompts, completions, **columns):
        return [value] * len(completions)

    return reward


def raising_reward(prompts, completions, **columns):
    raise RuntimeError("grader service unavailable")


def nan_reward(prompts, completions, **columns):
    return [1.0, math.nan, None][: len(completions)]


def short_reward(prompts, completions, **columns):
    return [1.0]


def test_builtin_names_resolve_to_their_functions():
    assert resolve_reward("math_accuracy") is math_accuracy
    assert resolve_reward("answer_format") is answer_format
    assert resolve_reward("overlong_penalty") is overlong_penalty
    builtins = {"math_accuracy", "answer_format", "overlong_penalty", "math_verify"}
    assert set(BUILTIN_REWARDS) == builtins


def test_unknown_builtin_name_suggests_the_nearest_and_lists_all():
    with pytest.raises(ValueError) as error:
        resolve_reward("math_acuracy")
    message = str(error.value)
    assert "Did you mean 'math_accuracy'?" in message
    assert "answer_format, math_accuracy" in message


def test_reward_by_module_and_function_name_is_imported(tmp_path, monkeypatch):
    (tmp_path / "my_team_rewards.py").write_text(
        "def brevity(prompts, completions, **kw):\n"
        "    return [1.0 if len(c) < 10 else 0.0 for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_team_rewards", raising=False)
    reward = resolve_reward("my_team_rewards:brevity")
    assert reward(["q", "q"], ["short", "a much longer completion"]) == [1.0, 0.0]


def test_reward_from_a_python_file_path_is_loaded(tmp_path):
    reward_file = tmp_path / "custom_reward.py"
    reward_file.write_text(
        "def says_please(prompts, completions, **kw):\n"
        "    return [float('please' in c) for c in completions]\n"
    )
    reward = resolve_reward(f"{reward_file}:says_please")
    assert reward(["q", "q"], ["yes please", "no"]) == [1.0, 0.0]


def test_missing_module_error_names_the_module_and_the_fix():
    with pytest.raises(
        ValueError, match="Cannot import module 'no_such_reward_module'.*PYTHONPATH"
    ):
        resolve_reward("no_such_reward_module:score")


def test_missing_function_error_lists_what_the_module_defines(tmp_path):
    reward_file = tmp_path / "few_rewards.py"
    reward_file.write_text("def length(prompts, completions, **kw):\n    return []\n")
    with pytest.raises(ValueError, match="has no attribute 'lenght'.*length"):
        resolve_reward(f"{reward_file}:lenght")


def test_missing_file_error_names_the_path(tmp_path):
    missing = tmp_path / "absent.py"
    with pytest.raises(ValueError, match="absent.py.*does not exist"):
        resolve_reward(f"{missing}:score")


def test_weighted_total_sums_each_reward_times_its_weight():
    rewards = RewardSet([("accuracy", math_accuracy, 1.0), ("format", answer_format, 0.5)])
    result = rewards(PROMPTS, COMPLETIONS, COLUMNS)
    assert isinstance(result, RewardResult)
    assert result.per_reward == {"accuracy": [1.0, 0.0, 0.0], "format": [1.0, 0.0, 0.0]}
    assert result.total == [1.5, 0.0, 0.0]
    assert result.failures == {"accuracy": 0, "format": 0}


def test_raising_reward_scores_zero_and_counts_every_value_as_failed(caplog):
    rewards = RewardSet([("broken", raising_reward, 1.0), ("bonus", constant_reward(2), 1.0)])
    with caplog.at_level(logging.WARNING, logger="fastgrpo.rewards"):
        result = rewards(PROMPTS, COMPLETIONS, COLUMNS)
    assert result.per_reward["broken"] == [0.0, 0.0, 0.0]
    assert result.failures == {"broken": 3, "bonus": 0}
    assert result.total == [2.0, 2.0, 2.0]
    assert "grader service unavailable" in caplog.text


def test_nan_and_none_values_are_replaced_by_zero_and_counted():
    result = RewardSet([("flaky", nan_reward, 1.0)])(PROMPTS, COMPLETIONS, COLUMNS)
    assert result.per_reward["flaky"] == [1.0, 0.0, 0.0]
    assert result.failures["flaky"] == 2


def test_wrong_length_output_is_all_zero_and_all_counted():
    result = RewardSet([("short", short_reward, 1.0)])(PROMPTS, COMPLETIONS, COLUMNS)
    assert result.per_reward["short"] == [0.0, 0.0, 0.0]
    assert result.failures["short"] == 3


def test_integer_and_boolean_values_are_converted_to_float():
    result = RewardSet([("ints", constant_reward(True), 3)])(PROMPTS, COMPLETIONS, COLUMNS)
    assert result.per_reward["ints"] == [1.0, 1.0, 1.0]
    assert all(type(value) is float for value in result.total)
    assert result.total == [3.0, 3.0, 3.0]


def test_repeated_failures_are_logged_once_per_hundred_calls(caplog):
    rewards = RewardSet([("broken", raising_reward, 1.0)])
    with caplog.at_level(logging.WARNING, logger="fastgrpo.rewards"):
        for _ in range(150):
            rewards(PROMPTS, COMPLETIONS, COLUMNS)
    assert len(caplog.records) == 2


def test_from_specs_accepts_names_dicts_and_user_functions(tmp_path):
    reward_file = tmp_path / "length_reward.py"
    reward_file.write_text(
        "def length_penalty(prompts, completions, **kw):\n"
        "    return [-len(c) / 100 for c in completions]\n"
    )
    rewards = RewardSet.from_specs(
        [
            "math_accuracy",
            {"name": "answer_format", "weight": 0.25},
            {"function": f"{reward_file}:length_penalty", "name": "length", "weight": 2.0},
        ]
    )
    assert rewards.names == ["math_accuracy", "answer_format", "length"]
    assert rewards.weights == {"math_accuracy": 1.0, "answer_format": 0.25, "length": 2.0}
    result = rewards(["q"], ["#### 18"], {"answer": ["18"]})
    assert result.total == pytest.approx([1.0 + 0.25 - 2 * 0.07])


def test_from_specs_rejects_unknown_keys_and_duplicate_names():
    with pytest.raises(ValueError, match="unknown keys weigth"):
        RewardSet.from_specs([{"name": "math_accuracy", "weigth": 2.0}])
    with pytest.raises(ValueError, match="math_accuracy appear more than once"):
        RewardSet.from_specs(["math_accuracy", "math_accuracy"])


def test_mismatched_prompt_and_completion_counts_are_rejected():
    rewards = RewardSet([("format", answer_format, 1.0)])
    with pytest.raises(ValueError, match="2 prompts for 3 completions"):
        rewards(["q", "q"], COMPLETIONS)


def test_values_of_gives_a_rewards_own_values_unless_it_failed():
    """The trainer's accuracy metric reuses math_accuracy's values when it is a configured
    reward, instead of scoring the batch twice; a failed or absent reward gives None."""
    from fastgrpo.rewards import math_accuracy

    rewards = RewardSet.from_specs(["math_accuracy", {"name": "answer_format", "weight": 0.5}])
    completions = ["The answer is 7", "The answer is 8"]
    result = rewards(["q", "q"], completions, {"answer": ["7", "7"]})
    assert rewards.values_of(math_accuracy, result) == [1.0, 0.0]
    assert rewards.values_of(math_accuracy, result) == math_accuracy(
        ["q", "q"], completions, answer=["7", "7"]
    )
    assert RewardSet.from_specs(["answer_format"]).values_of(math_accuracy, result) is None
    failed = rewards(["q", "q"], completions, {})  # no answer column: math_accuracy fails
    assert failed.failures["math_accuracy"] == 2
    assert rewards.values_of(math_accuracy, failed) is None

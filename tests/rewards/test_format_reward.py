"""Tests for the format rewards: explicit-answer detection and regex templates."""

import pytest

from fastgrpo.rewards import answer_format, regex_format


@pytest.mark.parametrize(
    "completion",
    [
        "9 * 2 = 18 dollars.\n#### 18",
        "So the area is $\\boxed{12}$.",
        "Adding them gives 30, so the answer is 30.",
        "Answer: 12 apples",
        "42",
        "42.",
        "-7",
        "$1,234.50",
    ],
)
def test_completion_with_an_explicit_or_bare_answer_gets_format_credit(completion):
    assert answer_format(["q"], [completion]) == [1.0]


@pytest.mark.parametrize(
    "completion",
    [
        "She had 20 apples and gave away 8, so 12 remain.",
        "I don't know.",
        "#### ",
        "",
        "42 apples and 3 pears",
    ],
)
def test_completion_without_an_extractable_answer_gets_no_format_credit(completion):
    assert answer_format(["q"], [completion]) == [0.0]


def test_answer_format_reads_chat_form_and_ignores_extra_columns():
    completions = [[{"role": "assistant", "content": "#### 5"}], [{"role": "assistant"}]]
    assert answer_format(["q", "q"], completions, answer=["5", "6"]) == [1.0, 0.0]


def test_regex_format_rewards_a_think_answer_template_across_lines():
    reward = regex_format(r"^<think>.*</think>\s*<answer>.*</answer>$")
    completions = [
        "<think>\n16 - 3 - 4 = 9\n</think>\n<answer>18</answer>",
        "<answer>18</answer>",
    ]
    assert reward(["q", "q"], completions, answer=["18", "18"]) == [1.0, 0.0]


def test_regex_format_rejects_an_invalid_pattern_with_a_clear_message():
    with pytest.raises(ValueError, match="invalid regular expression"):
        regex_format("(unclosed")

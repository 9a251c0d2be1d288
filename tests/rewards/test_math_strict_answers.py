"""Tests for the stricter numeric answer rules of ``math_accuracy`` (issue 31, item 4).

A number is only an answer when it stands on its own: not inside an identifier (``A2B``,
``x1``), not a piece of a symbolic expression (``x^2``, ``\\frac{1+\\sqrt{5}}{2}``, ``3x``).
Grouped thousands may be written ``14,916``, ``14{,}916``, ``1\\,000`` or with thin spaces.
"""

import json
from fractions import Fraction
from pathlib import Path

import pytest

from fastgrpo.rewards import extract_answer, math_accuracy, normalize_number


@pytest.mark.parametrize(
    "completion",
    [
        "The code is A2B",
        "we set x1",
        "I used model3b",
        "Let v_2 be the speed of train B2",
    ],
)
def test_a_number_inside_a_word_or_identifier_is_not_an_answer(completion):
    assert extract_answer(completion) is None


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("She picks 12 apples with robot R2D2", "12"),
        ("So x1 + x2 = 7", "7"),
        ("The total is 5km", "5"),
        ("He finished 3rd", "3"),
        ("It weighs 5g", "5"),
        ("It takes 2.5h", "2.5"),
    ],
)
def test_identifiers_are_skipped_like_words(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    "completion",
    [
        "Solving, x = \\frac{1+\\sqrt{5}}{2}",
        "x^2 - x - 1 = 0, so x = \\frac{1+\\sqrt{5}}{2}",
        "The expression simplifies to x^2",
        "Expanding gives 4x",
        "After factoring we get 2 and then 3x",
        "so the side is 2\\sqrt{3}",
        "The circumference is 6\\pi",
        "so the total is 2^{10}",
        "Therefore 5^3",
        "Hence the area is 12 + 2\\sqrt2",
        "Then y = \\frac{a+1}{2}",
        "The length is 4 + \\sqrt{x+3}",
        "It is 2\\frac{1}{2} cups",
    ],
)
def test_a_symbolic_final_expression_is_not_read_as_a_number(completion):
    assert normalize_number(extract_answer(completion)) is None


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("The area is 12 cm^2", "12"),
        ("The floor covers 40 m^2.", "40"),
        ("It is 90^\\circ", "90"),
        ("It is 12^\\circ C", "12"),
        ("Dividing, x = \\frac{3}{4}", "3/4"),
        ("The answer box: \\boxed{41", "41"),
        ("Each costs \\text{18 dollars}", "18"),
    ],
)
def test_units_powers_and_simple_fractions_at_the_end_still_give_the_number(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("\\frac{1+\\sqrt{5}}{2}", None),
        ("x^2", None),
        ("3x", None),
        ("2n", None),
        ("2\\sqrt{3}", None),
        ("3\\pi", None),
        ("2^{10}", Fraction(1024)),
        ("2^10", Fraction(1024)),
        ("-3^{2}", Fraction(-9)),
        ("10^{-2}", None),
        ("2^{1000}", None),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\frac{a+1}{2}", None),
        ("2\\frac{1}{2}", None),
        ("12 cm^2", Fraction(12)),
        ("5km", Fraction(5)),
        ("4.5L", Fraction(9, 2)),
        ("12m^2", Fraction(12)),
        ("3 apples", Fraction(3)),
    ],
)
def test_symbolic_answers_are_refused_and_clean_integer_powers_evaluated(answer, expected):
    assert normalize_number(answer) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("14,916", Fraction(14916)),
        ("14{,}916", Fraction(14916)),
        ("1{,}234{,}567.5", Fraction(2469135, 2)),
        ("1\\,000", Fraction(1000)),
        ("1 000", Fraction(1000)),
        ("1\u2009000", Fraction(1000)),
        ("1\u202f000", Fraction(1000)),
        ("12 345 678", Fraction(12345678)),
        ("$14{,}916$", Fraction(14916)),
        ("-1\u2009000", Fraction(-1000)),
        ("1 00", None),
        ("14{,}91", None),
    ],
)
def test_thousands_groups_in_every_common_notation_parse(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("In total 14{,}916 people came", "14,916"),
        ("In total 1\u2009000 people came", "1,000"),
        ("In total 1\u202f000 people came", "1,000"),
        ("In total 1\\,000 people came", "1,000"),
        ("In total 14,916 people came", "14,916"),
    ],
)
def test_grouped_numbers_in_running_text_are_read_whole(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    ("completion", "gold", "reward"),
    [
        ("Final Answer: The final answer is $18$. I hope it is correct.", "18", 1.0),
        ("Final Answer: The final answer is 14{,}916. I hope it is correct.", "14916", 1.0),
        ("Final Answer: The total number of apples is 42.", "42", 1.0),
        ("Final Answer: The number of eggs left is $-3$. Done.", "-3", 1.0),
        ("Final Answer: The final answer is $\\frac{1}{2}$. I hope it is correct.", "0.5", 1.0),
        ("Final Answer: The final answer is $\\boxed{2^{10}}$.", "1024", 1.0),
        ("Final Answer: The final answer is $x^2$. I hope it is correct.", "2", 0.0),
        ("So the answer is \\boxed{14{,}916}.", "14,916", 1.0),
        ("The answer is 1\u2009000 dollars.", "1000", 1.0),
        ("The answer is $1,234.50.", "1234.5", 1.0),
        ("The answer is -7.", "-7", 1.0),
        ("Answer: 12 apples", "12", 1.0),
        ("#### 1 000", "1000", 1.0),
    ],
)
def test_common_final_answer_templates_are_scored(completion, gold, reward):
    assert math_accuracy(["q"], [completion], answer=[gold]) == [reward]


def test_a_final_answer_stating_a_number_before_is_keeps_it_whole():
    assert extract_answer("Final Answer: 42 is the total.") == "42 is the total"


LABELLED_OUTPUTS = [
    json.loads(line)
    for line in (Path(__file__).parent / "labelled_math_outputs.jsonl").read_text().splitlines()
]


@pytest.mark.parametrize("row", LABELLED_OUTPUTS, ids=[row["note"] for row in LABELLED_OUTPUTS])
def test_math_accuracy_agrees_with_every_hand_labelled_model_output(row):
    assert math_accuracy(["q"], [row["completion"]], answer=[row["answer"]]) == [row["reward"]]


def test_the_labelled_set_holds_both_rewards():
    rewards = [row["reward"] for row in LABELLED_OUTPUTS]
    assert len(rewards) >= 25 and 0.0 in rewards and 1.0 in rewards


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("The answer is 42 because she had 6 bags of 7.", "42"),
        ("Final Answer: The total is 18 dollars since 9 * 2 = 18.", "18 dollars"),
        ("So the answer is 12 apples, which is 3 more than 9", "12 apples"),
        ("The answer is 7 as 3 + 4 = 7", "7"),
    ],
)
def test_a_stated_answer_ends_where_its_explanation_begins(completion, expected):
    assert extract_answer(completion) == expected

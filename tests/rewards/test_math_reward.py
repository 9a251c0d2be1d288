"""Tests for the math answer reward: extraction, number parsing and scoring.

The cases are shaped like real model outputs and real GSM8K/MATH references, since
a reward that misreads "$1,234.50." or "\\boxed{\\frac{3}{4}}" silently trains the
policy on wrong signals.
"""

from fractions import Fraction

import pytest

from fastgrpo.rewards import (
    answers_match,
    extract_answer,
    math_accuracy,
    normalize_number,
    reference_answer,
)

JANET_COMPLETION = "Janet has 16 - 3 - 4 = 9 eggs left. She makes 9 * $2 = $18 every day.\n#### 18"
GSM8K_RAW_ANSWER = (
    "Each box holds 12 * 6 = <<12*6=72>>72 cans.\n"
    "15 boxes hold 15 * 72 = <<15*72=1080>>1,080 cans.\n#### 1,080"
)


def test_gsm8k_style_hash_answer_is_extracted():
    assert extract_answer(JANET_COMPLETION) == "18"


def test_last_hash_marker_wins_when_there_are_several():
    assert extract_answer("#### 5\nWait, I made a mistake.\n#### 7") == "7"


def test_hash_marker_beats_a_later_boxed_answer():
    assert extract_answer("#### 12\nAs a check: \\boxed{13}") == "12"


def test_boxed_fraction_with_nested_braces_is_extracted_whole():
    assert extract_answer("Thus the probability is \\boxed{\\frac{3}{4}}.") == "\\frac{3}{4}"


def test_last_boxed_answer_wins():
    assert extract_answer("First \\boxed{2}, corrected: $\\boxed{5}$.") == "5"


def test_unclosed_boxed_falls_back_to_the_last_number():
    assert extract_answer("so the result is \\boxed{41") == "41"


def test_answer_phrase_with_dollars_and_trailing_period_is_extracted():
    assert extract_answer("The answer is $1,234.50.") == "$1,234.50"


def test_answer_phrase_stops_at_the_end_of_its_sentence():
    completion = "The answer is 18. She sold 3 boxes for 6 dollars each."
    assert extract_answer(completion) == "18"


def test_a_colon_prefix_is_an_answer_phrase():
    assert extract_answer("Q: What is 6 * 7?\nA: 42") == "42"


def test_answer_colon_keeps_the_units_for_later_parsing():
    assert extract_answer("Answer: 12 apples") == "12 apples"


def test_markdown_bold_final_answer_is_extracted():
    assert extract_answer("Adding up: 7 + 11.\n**Final Answer:** 18") == "18"
    assert extract_answer("**Final Answer**: 18") == "18"


def test_final_answer_on_the_next_line_is_extracted():
    assert extract_answer("Final answer:\n\n42") == "42"


def test_answer_phrase_keeps_the_right_side_of_an_equation():
    assert extract_answer("The answer is x = 5.") == "5"


def test_answer_phrase_is_case_insensitive():
    assert extract_answer("THE ANSWER IS 9") == "9"


def test_answer_phrase_with_nothing_after_it_is_skipped():
    completion = "Let's work out what the answer is. 3 + 4 = 7"
    assert extract_answer(completion) == "7"


def test_negative_final_number_keeps_its_sign():
    assert extract_answer("Subtracting 7 from both sides, so x = -7.") == "-7"


def test_last_number_is_the_answer_when_nothing_is_marked():
    completion = "She had 20 apples, gave away 5 and ate 3, leaving 12"
    assert extract_answer(completion) == "12"


def test_binary_minus_is_not_read_as_a_negative_sign():
    assert extract_answer("Pages 10-20") == "20"


def test_text_without_any_number_has_no_answer():
    assert extract_answer("I am not sure how to solve this problem.") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1,234", Fraction(1234)),
        ("$18", Fraction(18)),
        ("50%", Fraction(50)),
        ("18 dollars", Fraction(18)),
        ("5 apples", Fraction(5)),
        ("3.5 km", Fraction(7, 2)),
        ("18.", Fraction(18)),
        ("0.50", Fraction(1, 2)),
        ("3/4", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\dfrac{3}{4}", Fraction(3, 4)),
        ("-\\frac{1}{2}", Fraction(-1, 2)),
        ("-7", Fraction(-7)),
        ("\u22127", Fraction(-7)),
        ("+5", Fraction(5)),
        ("\\$18", Fraction(18)),
        ("$\\$1,080$", Fraction(1080)),
        ("\\text{18 dollars}", Fraction(18)),
        ("90^\\circ", Fraction(90)),
        (".5", Fraction(1, 2)),
    ],
)
def test_numeric_answers_parse_to_exact_values(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    "text", ["eighteen", "3 + 4 = 7", "12 apples and 3 oranges", "1,23", "1/0", "", "x"]
)
def test_non_numeric_answers_parse_to_none(text):
    assert normalize_number(text) is None


def test_decimal_and_fraction_forms_of_one_half_match():
    assert answers_match("0.5", "1/2")
    assert answers_match("0.50", "\\frac{1}{2}")


def test_percent_answer_matches_a_bare_reference():
    assert answers_match(extract_answer("It is 50%"), "50")


def test_different_numbers_do_not_match():
    assert not answers_match("17", "18")


def test_text_answers_match_ignoring_case_spaces_and_final_period():
    assert answers_match("  Paris. ", "paris")
    assert not answers_match("London", "Paris")


def test_missing_prediction_never_matches():
    assert not answers_match(None, "18")


def test_raw_gsm8k_reference_yields_its_final_value():
    assert reference_answer(GSM8K_RAW_ANSWER) == "1,080"


def test_bare_reference_is_returned_stripped():
    assert reference_answer("  18\n") == "18"
    assert reference_answer(18) == "18"


def test_math_accuracy_scores_a_realistic_batch():
    completions = [
        JANET_COMPLETION,
        "The answer is $1,234.50.",
        "Hence $\\boxed{\\frac{3}{4}}$",
        "Answer: 12 apples",
        "I think it is 19.",
        "I cannot solve this.",
    ]
    answers = ["18", "1234.5", "0.75", GSM8K_RAW_ANSWER.replace("1,080", "12"), "18", "3"]
    prompts = ["q"] * len(completions)
    assert math_accuracy(prompts, completions, answer=answers) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_math_accuracy_matches_raw_gsm8k_reference_with_thousands_comma():
    completion = "So in total there are 1080 cans.\n#### 1080"
    assert math_accuracy(["q"], [completion], answer=[GSM8K_RAW_ANSWER]) == [1.0]


def test_math_accuracy_reads_chat_form_completions():
    completions = [
        [{"role": "assistant", "content": "The answer is 42."}],
        [{"role": "assistant", "content": "The answer is 41."}],
    ]
    assert math_accuracy(["q", "q"], completions, answer=["42", "42"]) == [1.0, 0.0]


def test_math_accuracy_ignores_unknown_columns():
    scores = math_accuracy(["q"], ["#### 7"], answer=["7"], difficulty=["easy"], id=[3])
    assert scores == [1.0]


def test_math_accuracy_rejects_answers_of_the_wrong_length():
    with pytest.raises(ValueError, match="one reference answer per completion"):
        math_accuracy(["q", "q"], ["1", "2"], answer=["1"])


def test_unmarked_latex_fraction_at_the_end_is_read_whole():
    assert extract_answer("Dividing, x = \\frac{3}{4}") == "3/4"
    assert math_accuracy(["q"], ["so each gets \\dfrac{10}{4} cups"], answer=["2.5"]) == [1.0]


def test_last_number_scans_only_the_end_and_finds_what_a_whole_scan_finds():
    """`_last_number` starts its scan at a whitespace before the last digit; on texts of many
    numbers (thousands separators, decimals, fractions, signs, LaTeX fractions, digits inside
    words) it must give what scanning the whole text gives."""
    import random

    from fastgrpo.rewards import math as math_reward

    def whole_scan(text):
        return math_reward._last_number_from(math_reward._simplify_latex(text), 0)

    pieces = [
        "1,234,567",
        "3.25",
        "-7",
        "\u22124",
        "16-3",
        "3/4",
        "\\frac{5}{8}",
        "t123",
        "x",
        "apples",
        "=",
        "(2)",
        "[9]",
        ".5",
        "12.",
        "1,23",
        "\n",
        "  ",
        "\t",
        "$18",
        "50%",
        "A2B",
        "x^2",
        "cm^2",
        "3x",
        "5km",
        "14{,}916",
        "1\u2009000",
        "1\\,000",
        "\\sqrt{5}",
        "\\boxed{41",
        "90^\\circ",
    ]
    generator = random.Random(0)
    for _ in range(400):
        words = [generator.choice(pieces) for _ in range(generator.randint(0, 120))]
        sep = generator.choice(["", " ", " ", "\n"])
        text = sep.join(words)
        assert math_reward._last_number(text) == whole_scan(text), text
    long_number = "9" * 200  # longer than the window: the scan starts at the space before it
    assert math_reward._last_number("a 1 " + long_number) == long_number

"""Tests for the built-in arithmetic task: determinism, disjoint splits, exact answers, errors."""

import re

import pytest

from fastgrpo.data.arithmetic import arithmetic_task

TOKEN = re.compile(r"\(-\d+\)|\d+|[+\-*]")


def evaluate_text(expression: str) -> int:
    """Independent int evaluator for "a op b op c" with * before + and -."""
    tokens = TOKEN.findall(expression)
    assert "".join(tokens) == expression.replace(" ", "")
    numbers = [int(token.strip("()")) for token in tokens[0::2]]
    operators = tokens[1::2]
    total, product, sign = 0, numbers[0], 1
    for operator, number in zip(operators, numbers[1:]):
        if operator == "*":
            product *= number
            continue
        total += sign * product
        sign, product = (1 if operator == "+" else -1), number
    return total + sign * product


def expressions(examples) -> list[str]:
    return [example.columns["expression"] for example in examples]


def test_same_seed_gives_identical_problems():
    first = arithmetic_task(seed=3, num_train=50, num_eval=10)
    second = arithmetic_task(seed=3, num_train=50, num_eval=10)
    assert first.train == second.train
    assert first.eval == second.eval


def test_different_seeds_give_different_problems():
    first = arithmetic_task(seed=0, num_train=50, num_eval=10)
    second = arithmetic_task(seed=1, num_train=50, num_eval=10)
    assert expressions(first.train) != expressions(second.train)
    assert expressions(first.eval) != expressions(second.eval)


def test_default_task_has_requested_sizes_and_name():
    task = arithmetic_task()
    assert (len(task.train), len(task.eval), task.name) == (5000, 200, "arithmetic")


def test_no_eval_expression_appears_in_train_and_none_repeat():
    task = arithmetic_task(num_train=5000, num_eval=200)
    train, evaluation = expressions(task.train), expressions(task.eval)
    assert len(set(train)) == 5000
    assert len(set(evaluation)) == 200
    assert not set(train) & set(evaluation)


def test_splits_stay_disjoint_when_nearly_every_problem_is_used():
    task = arithmetic_task(min_value=0, max_value=9, num_train=180, num_eval=20)
    assert len(set(expressions(task.train)) | set(expressions(task.eval))) == 200


def test_answers_equal_the_integer_value_of_the_expression():
    task = arithmetic_task(num_train=300, num_eval=50, num_operands=3, operations="+-*")
    for example in task.train + task.eval:
        expected = evaluate_text(example.columns["expression"])
        assert example.answer == str(expected)
        assert example.columns["answer"] == example.answer


def test_multiplication_binds_tighter_than_addition():
    task = arithmetic_task(num_train=400, num_eval=0, num_operands=3, operations="+*")
    by_expression = {example.columns["expression"]: example.answer for example in task.train}
    mixed = [text for text in by_expression if "+" in text and "*" in text]
    assert mixed
    for text in mixed:
        assert by_expression[text] == str(evaluate_text(text))
    assert evaluate_text("2 + 3 * 4") == 14


def test_prompt_uses_the_template_and_default_wording():
    task = arithmetic_task(num_train=1, num_eval=1, seed=5)
    example = task.train[0]
    assert example.prompt == (
        f"What is {example.columns['expression']}? Answer with just the number."
    )
    custom = arithmetic_task(num_train=1, num_eval=0, prompt_template="Compute {expression}.")
    assert re.fullmatch(r"Compute \d+ [+-] \d+\.", custom.train[0].prompt)


def test_operands_stay_within_the_value_range():
    task = arithmetic_task(min_value=10, max_value=20, num_train=100, num_eval=10)
    for text in expressions(task.train + task.eval):
        numbers = [int(token) for token in re.findall(r"\d+", text)]
        assert all(10 <= number <= 20 for number in numbers)


def test_negative_operands_are_parenthesised():
    task = arithmetic_task(min_value=-5, max_value=-1, num_train=20, num_eval=0)
    for example in task.train:
        assert re.fullmatch(r"\(-\d\) [+-] \(-\d\)", example.columns["expression"])
        assert example.answer == str(evaluate_text(example.columns["expression"]))


def test_allow_negative_false_keeps_every_answer_non_negative():
    task = arithmetic_task(
        allow_negative=False, operations="-", num_operands=3, num_train=500, num_eval=50
    )
    assert all(int(example.answer) >= 0 for example in task.train + task.eval)


def test_allow_negative_true_does_produce_negative_answers():
    task = arithmetic_task(operations="-", num_train=200, num_eval=0)
    assert any(int(example.answer) < 0 for example in task.train)


def test_large_problem_spaces_are_sampled_distinct_and_disjoint():
    task = arithmetic_task(
        num_operands=4, operations="+-*", allow_negative=False, num_train=300, num_eval=30
    )
    train, evaluation = expressions(task.train), expressions(task.eval)
    assert len(set(train)) == 300
    assert not set(train) & set(evaluation)
    assert all(int(example.answer) >= 0 for example in task.train)


def test_too_many_problems_requested_says_how_many_are_possible():
    with pytest.raises(ValueError, match=r"only 200 are possible.*max_value"):
        arithmetic_task(min_value=0, max_value=9, num_train=190, num_eval=20)


def test_min_value_above_max_value_is_rejected():
    with pytest.raises(ValueError, match=r"min_value \(10\) must be <= max_value \(5\)"):
        arithmetic_task(min_value=10, max_value=5)


@pytest.mark.parametrize("num_operands", [1, 0, -3])
def test_fewer_than_two_operands_is_rejected(num_operands):
    with pytest.raises(ValueError, match="num_operands must be >= 2"):
        arithmetic_task(num_operands=num_operands)


def test_unknown_operator_is_rejected():
    with pytest.raises(ValueError, match=r"unknown operator\(s\) \['/'\]"):
        arithmetic_task(operations="+/")


def test_allow_negative_false_that_excludes_everything_is_rejected():
    with pytest.raises(ValueError, match="excludes every problem"):
        arithmetic_task(min_value=-9, max_value=-1, operations="+", allow_negative=False)


def test_template_without_expression_is_rejected():
    with pytest.raises(ValueError, match="must contain"):
        arithmetic_task(prompt_template="What is the answer?")

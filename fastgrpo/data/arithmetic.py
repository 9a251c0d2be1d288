"""Built-in, seeded arithmetic problems ("What is 37 + 48?") with exact integer answers.

Why: a task that needs no download and has a trivially checkable answer is the fastest way
to smoke-test the whole GRPO loop. Problems are drawn from explicit `random.Random` streams
(never the global RNG), so the same seed always gives the same problems, and the eval split
is drawn first and then excluded from train, so no eval expression is ever trained on.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from fastgrpo.data.example import Example, TaskData

VALID_OPERATIONS = "+-*"
DEFAULT_PROMPT_TEMPLATE = "What is {expression}? Answer with just the number."
# Problem spaces up to this size are enumerated exactly; larger ones are rejection-sampled.
ENUMERATION_LIMIT = 250_000
# Train-split size when none is asked for (smaller when fewer problems exist).
DEFAULT_NUM_TRAIN = 5000
# Rejection sampling gives up after this many random draws per requested problem.
MAX_DRAWS_PER_PROBLEM = 50

Problem = tuple[tuple[int, ...], tuple[str, ...]]


def arithmetic_task(
    *,
    seed: int = 0,
    num_train: int | None = None,
    num_eval: int = 200,
    min_value: int = 0,
    max_value: int = 99,
    num_operands: int = 2,
    operations: str = "+-",
    allow_negative: bool = True,
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
) -> TaskData:
    """Generate disjoint train/eval splits of integer arithmetic problems.

    Operands are drawn uniformly from [min_value, max_value]; operators from `operations`
    (any of "+", "-", "*"; "*" binds tighter than "+"/"-"). With allow_negative=False every
    problem's answer is >= 0. `prompt_template` must contain "{expression}".
    num_train=None takes every problem the eval split leaves, up to DEFAULT_NUM_TRAIN.
    """
    # the knobs are checked before they size the problem space (num_operands=0 broke that)
    _validate_knobs(num_train or 0, num_eval, min_value, max_value, num_operands, operations)
    if num_train is None:
        space = ProblemSpace(min_value, max_value, num_operands, operations, allow_negative)
        room = space.upper_bound - num_eval
        if space.upper_bound <= ENUMERATION_LIMIT and set(operations) <= set("+-*"):
            room = sum(1 for _ in space.enumerate_valid()) - num_eval
        num_train = max(1, min(DEFAULT_NUM_TRAIN, room))
    ops = _validate_knobs(num_train, num_eval, min_value, max_value, num_operands, operations)
    _validate_template(prompt_template)
    space = ProblemSpace(min_value, max_value, num_operands, ops, allow_negative)
    eval_problems, train_problems = _draw_splits(space, num_train, num_eval, seed)
    return TaskData(
        train=[_to_example(problem, prompt_template) for problem in train_problems],
        eval=[_to_example(problem, prompt_template) for problem in eval_problems],
        name="arithmetic",
    )


class ProblemSpace:
    """All expressions of `num_operands` operands in a value range joined by given operators."""

    def __init__(
        self, min_value: int, max_value: int, num_operands: int, ops: str, allow_negative: bool
    ) -> None:
        self.min_value = min_value
        self.max_value = max_value
        self.num_operands = num_operands
        self.ops = ops
        self.allow_negative = allow_negative

    @property
    def upper_bound(self) -> int:
        """Number of distinct expressions before the allow_negative filter."""
        num_values = self.max_value - self.min_value + 1
        return num_values**self.num_operands * len(self.ops) ** (self.num_operands - 1)

    def is_valid(self, problem: Problem) -> bool:
        return self.allow_negative or evaluate(*problem) >= 0

    def enumerate_valid(self) -> Iterator[Problem]:
        """Every valid problem, in a fixed canonical order."""
        values = range(self.min_value, self.max_value + 1)
        for operands in itertools.product(values, repeat=self.num_operands):
            for ops in itertools.product(self.ops, repeat=self.num_operands - 1):
                if self.is_valid((operands, ops)):
                    yield operands, ops

    def draw(self, rng: random.Random) -> Problem:
        operands = tuple(
            rng.randint(self.min_value, self.max_value) for _ in range(self.num_operands)
        )
        ops = tuple(rng.choice(self.ops) for _ in range(self.num_operands - 1))
        return operands, ops

    def describe(self) -> str:
        return (
            f"min_value={self.min_value}, max_value={self.max_value}, "
            f"num_operands={self.num_operands}, operations={self.ops!r}, "
            f"allow_negative={self.allow_negative}"
        )


def evaluate(operands: tuple[int, ...], ops: tuple[str, ...]) -> int:
    """Exact integer value of the expression, with "*" binding tighter than "+" and "-"."""
    terms = [operands[0]]
    signs: list[str] = []
    for op, value in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= value
        else:
            signs.append(op)
            terms.append(value)
    total = terms[0]
    for sign, term in zip(signs, terms[1:]):
        total = total + term if sign == "+" else total - term
    return total


def format_expression(operands: tuple[int, ...], ops: tuple[str, ...]) -> str:
    """Render as "37 + 48"; negative operands get parentheses: "12 - (-3)"."""
    parts = [_format_operand(operands[0])]
    for op, value in zip(ops, operands[1:]):
        parts.extend([op, _format_operand(value)])
    return " ".join(parts)


def _format_operand(value: int) -> str:
    return f"({value})" if value < 0 else str(value)


def _to_example(problem: Problem, prompt_template: str) -> Example:
    expression = format_expression(*problem)
    answer = str(evaluate(*problem))
    return Example(
        prompt=prompt_template.format(expression=expression),
        answer=answer,
        columns={"answer": answer, "expression": expression},
    )


def _validate_knobs(
    num_train: int, num_eval: int, min_value: int, max_value: int, num_operands: int, ops: str
) -> str:
    """Check the knobs and return the de-duplicated operator string."""
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"num_train and num_eval must be >= 0, got {num_train} and {num_eval}")
    if min_value > max_value:
        raise ValueError(f"min_value ({min_value}) must be <= max_value ({max_value})")
    if num_operands < 2:
        raise ValueError(f"num_operands must be >= 2, got {num_operands}")
    unknown = sorted(set(ops) - set(VALID_OPERATIONS))
    if unknown or not ops:
        raise ValueError(
            f"operations={ops!r} contains unknown operator(s) {unknown}; "
            f"use a non-empty string of {VALID_OPERATIONS!r} (e.g. '+-')"
        )
    return "".join(dict.fromkeys(ops))


def _validate_template(prompt_template: str) -> None:
    if "{expression}" not in prompt_template:
        raise ValueError(f"prompt_template must contain '{{expression}}', got {prompt_template!r}")
    try:
        prompt_template.format(expression="1 + 1")
    except (KeyError, IndexError, ValueError) as error:
        raise ValueError(
            f"prompt_template {prompt_template!r} can only use the field {{expression}} "
            f"(write literal braces as '{{{{' and '}}}}'): {error!r}"
        ) from error


def _draw_splits(
    space: ProblemSpace, num_train: int, num_eval: int, seed: int
) -> tuple[list[Problem], list[Problem]]:
    """Draw eval first, then train from what eval left; return (eval, train)."""
    eval_rng = random.Random(f"arithmetic-eval-{seed}")
    train_rng = random.Random(f"arithmetic-train-{seed}")
    needed = num_train + num_eval
    if space.upper_bound <= ENUMERATION_LIMIT:
        valid = list(space.enumerate_valid())
        _check_enough(space, len(valid), needed, num_train, num_eval)
        eval_problems = eval_rng.sample(valid, num_eval)
        taken = set(eval_problems)
        remaining = [problem for problem in valid if problem not in taken]
        return eval_problems, train_rng.sample(remaining, num_train)
    _check_enough(space, space.upper_bound, needed, num_train, num_eval)
    eval_problems = _rejection_sample(space, eval_rng, num_eval, exclude=set())
    train_problems = _rejection_sample(space, train_rng, num_train, exclude=set(eval_problems))
    return eval_problems, train_problems


def _check_enough(
    space: ProblemSpace, possible: int, needed: int, num_train: int, num_eval: int
) -> None:
    if possible == 0:
        raise ValueError(
            f"allow_negative=False excludes every problem ({space.describe()}): every "
            "answer would be negative; raise min_value/max_value, change operations, "
            "or set allow_negative=True"
        )
    if needed > possible:
        raise ValueError(
            f"asked for num_train={num_train} + num_eval={num_eval} = {needed} distinct "
            f"arithmetic problems, but only {possible} are possible with {space.describe()}; "
            "widen the range (min_value/max_value), raise num_operands, add operations, "
            "or lower num_train/num_eval"
        )


def _rejection_sample(
    space: ProblemSpace, rng: random.Random, count: int, exclude: set[Problem]
) -> list[Problem]:
    """Draw `count` distinct valid problems not in `exclude`, in draw order."""
    chosen: list[Problem] = []
    seen = set(exclude)
    max_draws = MAX_DRAWS_PER_PROBLEM * count + 1000
    for _ in range(max_draws):
        if len(chosen) == count:
            return chosen
        problem = space.draw(rng)
        if problem not in seen and space.is_valid(problem):
            seen.add(problem)
            chosen.append(problem)
    if len(chosen) == count:
        return chosen
    raise ValueError(
        f"found only {len(chosen)} of {count} distinct valid arithmetic problems in "
        f"{max_draws} random draws ({space.describe()}); allow_negative=False probably "
        "excludes most problems: set allow_negative=True, raise min_value/max_value, "
        "or lower num_train/num_eval"
    )

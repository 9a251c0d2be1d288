"""The `math_verify` reward: symbolic answers that the numeric `math_accuracy` cannot judge, in a
worker thread (no SIGALRM), and a one-line error when the library is missing."""

from __future__ import annotations

import sys

import pytest

from fastgrpo.rewards import RewardSet
from fastgrpo.rewards.math import math_accuracy
from fastgrpo.rewards.registry import resolve_reward

pytest.importorskip("math_verify")

CASES = [  # (completion, reference, right)
    ("So the answer is $\\boxed{\\frac{1}{2}}$.", "0.5", True),
    ("The probability is $0.5$.", "\\frac{1}{2}", True),
    ("We get $\\sqrt{8}$.", "2\\sqrt{2}", True),
    ("The solution set is $(1,2]$.", "(1, 2]", True),
    ("The roots are $\\{2, 1\\}$.", "\\{1, 2\\}", True),
    ("Hence $x = 2$.", "x=2", True),
    ("The final answer is $\\frac{1+\\sqrt{5}}{2}$.", "\\frac{1+\\sqrt{5}}{2}", True),
    ("The final answer is $\\frac{1+\\sqrt{5}}{2}$.", "2", False),
    ("I think it is 8.", "7", False),
    ("I cannot tell.", "\\frac{1}{3}", False),
]


def test_symbolic_answers_are_judged_as_math_verify_judges_them():
    reward = resolve_reward("math_verify")
    completions = [c for c, _, _ in CASES]
    answers = [a for _, a, _ in CASES]
    got = reward([""] * len(CASES), completions, answer=answers)
    assert got == [1.0 if right else 0.0 for _, _, right in CASES]
    # where the numeric reward cannot see the equality
    numeric = math_accuracy([""] * 3, completions[:3], answer=answers[:3])
    assert numeric != [1.0, 1.0, 1.0]


def test_it_runs_in_the_reward_threads_with_no_signal_errors():
    rewards = RewardSet.from_specs(["math_verify"], timeout=60)
    result = rewards([""] * 2, [CASES[0][0], CASES[-1][0]], {"answer": ["0.5", "1/3"]})
    assert result.total == [1.0, 0.0] and result.failures == {"math_verify": 0}


def test_without_the_library_the_reward_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ValueError, match="needs the math-verify package: pip install"):
        resolve_reward("math_verify")

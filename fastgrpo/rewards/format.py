"""Format rewards: does a completion state its answer in a form a grader can read?

A small format reward early in GRPO training teaches the model to end with an
explicit answer ("#### 18", "\\boxed{18}", "The answer is 18"), which makes the
accuracy reward reliable. ``regex_format`` covers custom output templates such as
``<think>...</think><answer>...</answer>``.
"""

import re
from collections.abc import Callable, Sequence
from typing import Any

from fastgrpo.rewards.completions import completion_text
from fastgrpo.rewards.math import extract_marked_answer

RewardFunction = Callable[..., list[float]]

# A completion that is nothing but a number, e.g. "42", "42.", "-7", "$1,234.50", "3/4".
_BARE_NUMBER = re.compile(
    r"[-+\u2212]?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?%?\.?"
    r"|[-+\u2212]?\.\d+%?\.?"
)


def answer_format(
    prompts: Sequence[Any], completions: Sequence[Any], **columns: Any
) -> list[float]:
    """1.0 for each completion with an explicit or bare-number final answer, else 0.0."""
    return [1.0 if _has_extractable_answer(completion_text(c)) else 0.0 for c in completions]


def _has_extractable_answer(text: str) -> bool:
    """True if the text marks its answer explicitly or is just a number."""
    if extract_marked_answer(text) is not None:
        return True
    return _BARE_NUMBER.fullmatch(text.strip()) is not None


def regex_format(pattern: str) -> RewardFunction:
    """A reward giving 1.0 to completions where ``re.search(pattern, c, re.DOTALL)`` matches."""
    compiled = _compile_pattern(pattern)

    def regex_format_reward(
        prompts: Sequence[Any], completions: Sequence[Any], **columns: Any
    ) -> list[float]:
        return [1.0 if compiled.search(completion_text(c)) else 0.0 for c in completions]

    regex_format_reward.__name__ = "regex_format_reward"
    regex_format_reward.__qualname__ = f"regex_format({pattern!r})"
    return regex_format_reward


def _compile_pattern(pattern: str) -> re.Pattern[str]:
    """Compile a format pattern, turning a syntax error into a ValueError that names it."""
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as error:
        raise ValueError(
            f"regex_format got an invalid regular expression {pattern!r}: {error}. "
            "Fix the pattern (remember to escape special characters such as '(' or '.')."
        ) from error

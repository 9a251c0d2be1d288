"""Reward functions for GRPO training and the machinery that combines them.

Every reward follows the TRL convention ``fn(prompts, completions, **columns) ->
list[float]``, where dataset columns (such as ``answer``) arrive as keyword lists
with one value per completion. :class:`RewardSet` resolves rewards from config
strings, weights them, and shields training from rewards that fail.
"""

from fastgrpo.rewards.format import answer_format, regex_format
from fastgrpo.rewards.math import (
    answers_match,
    extract_answer,
    math_accuracy,
    normalize_number,
    reference_answer,
)
from fastgrpo.rewards.registry import BUILTIN_REWARDS, RewardResult, RewardSet, resolve_reward

__all__ = [
    "BUILTIN_REWARDS",
    "RewardResult",
    "RewardSet",
    "answer_format",
    "answers_match",
    "extract_answer",
    "math_accuracy",
    "normalize_number",
    "reference_answer",
    "regex_format",
    "resolve_reward",
]

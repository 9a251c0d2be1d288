"""DAPO's soft overlong punishment, as a reward to add to the others.

A completion cut off at the length limit gets no final answer, and a reward of 0 for it teaches
little about why. DAPO instead penalises length itself, softly: nothing up to `limit - buffer`
tokens, then a penalty falling linearly to `-factor` at the limit (and staying there past it).
Rewards receive each completion's token count and the limit as the columns `completion_lengths`
and `max_completion_length` (rollout.max_new_tokens), as every reward does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def overlong_penalty(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_lengths: Sequence[int],
    max_completion_length: Sequence[int],
    overlong_buffer: int | None = None,
    overlong_penalty_factor: float = 1.0,
    **columns: Any,
) -> list[float]:
    """0 for a completion of at most limit - buffer tokens, then (limit - buffer - length) /
    buffer * factor, down to -factor at the limit. `overlong_buffer` None: a quarter of the
    limit (DAPO used 4,096 of 20,480 tokens)."""
    out = []
    for length, limit in zip(completion_lengths, max_completion_length, strict=True):
        buffer = limit // 4 if overlong_buffer is None else overlong_buffer
        if not 0 < buffer <= limit:
            raise ValueError(
                f"overlong_buffer={buffer} must be between 1 and the length limit {limit}"
            )
        over = int(length) - (limit - buffer)
        out.append(-overlong_penalty_factor * min(max(over, 0), buffer) / buffer)
    return out

"""Split rows into micro-batches that fit a token budget (padding included)."""

from __future__ import annotations

import torch


def plan_micro_batches(
    prompt_lengths: torch.Tensor, completion_lengths: torch.Tensor, token_budget: int
) -> list[list[int]]:
    """Consecutive groups of row indices whose padded size (rows x longest row) fits the budget.

    Rows are sorted by length first so that rows of similar length share a micro-batch and little
    padding is computed. A row longer than the budget gets a micro-batch of its own.
    """
    lengths = (prompt_lengths + completion_lengths).tolist()
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for row in order:
        candidate = max(longest, lengths[row])
        if current and candidate * (len(current) + 1) > token_budget:
            batches.append(current)
            current, candidate = [], lengths[row]
        current.append(row)
        longest = candidate
    if current:
        batches.append(current)
    return batches

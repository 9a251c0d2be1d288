"""Split rows into micro-batches that fit a token budget."""

from __future__ import annotations

import torch


def plan_micro_batches(
    prompt_lengths: torch.Tensor,
    completion_lengths: torch.Tensor,
    token_budget: int,
    groups: torch.Tensor | None = None,
) -> list[list[int]]:
    """Groups of row indices whose size fits the budget (a row over the budget runs alone).

    Padded rows (`groups` None, the transformers path): a micro-batch costs rows x its longest
    row, so rows are sorted by length first and rows of similar length share a micro-batch.

    Packed rows (`groups` (B,): rows with the same number share a prompt, which the native
    trainer packs once per micro-batch, `logprobs.pack_rows`): a micro-batch costs its distinct
    prompts plus its completions. Rows keep their order with each prompt's rows together, and
    the micro-batches are balanced: as few as the budget allows, each about the same size (21, 21,
    21 and 1 rows would cost a whole micro-batch of host time for one row).
    """
    if groups is None:
        return _padded_plan(prompt_lengths, completion_lengths, token_budget)
    prompts, completions = prompt_lengths.tolist(), completion_lengths.tolist()
    group_of = groups.tolist()
    first_seen: dict[int, int] = {}
    for row, g in enumerate(group_of):
        first_seen.setdefault(g, row)
    order = sorted(range(len(group_of)), key=lambda r: (first_seen[group_of[r]], r))

    def fill(cap: int) -> list[list[int]]:
        batches: list[list[int]] = []
        current: list[int] = []
        size, seen = 0, set()
        for row in order:
            g = group_of[row]
            extra = completions[row] + (0 if g in seen else prompts[row])
            if current and size + extra > cap:
                batches.append(current)
                current, size, seen = [], 0, set()
                extra = completions[row] + prompts[row]
            current.append(row)
            size += extra
            seen.add(g)
        if current:
            batches.append(current)
        return batches

    plan = fill(token_budget)
    low, high = 1, token_budget  # the smallest cap that needs no more micro-batches
    while low < high:
        mid = (low + high) // 2
        if len(fill(mid)) <= len(plan):
            high = mid
        else:
            low = mid + 1
    balanced = fill(high)
    return balanced if len(balanced) <= len(plan) else plan


def _padded_plan(
    prompt_lengths: torch.Tensor, completion_lengths: torch.Tensor, token_budget: int
) -> list[list[int]]:
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

"""The micro-batch planner: every row once, within the budget, shared prompts counted once."""

from __future__ import annotations

import torch

from fastgrpo.train.batching import plan_micro_batches


def packed_cost(rows, prompts, completions, groups) -> int:
    """What a packed micro-batch feeds: each distinct prompt once, plus every completion."""
    distinct = {int(groups[r]): int(prompts[r]) for r in rows}
    return sum(distinct.values()) + sum(int(completions[r]) for r in rows)


def test_packed_plan_counts_each_prompt_once_and_balances_the_micro_batches():
    # GRPO's shape: 8 prompts x 8 rows, prompt 128, completion 256 (the bench_step workload)
    groups = torch.arange(8).repeat_interleave(8)
    prompts = torch.full((64,), 128)
    completions = torch.full((64,), 256)
    plan = plan_micro_batches(prompts, completions, 8192, groups)
    assert sorted(r for rows in plan for r in rows) == list(range(64))
    costs = [packed_cost(rows, prompts, completions, groups) for rows in plan]
    # 17,408 tokens with prompts shared: 3 micro-batches (unshared it would be 24,576: 4 or more)
    assert len(plan) == 3 and max(costs) <= 8192
    assert max(costs) - min(costs) <= 128 + 256  # balanced to within a row and a prompt
    for rows in plan:  # a prompt's rows stay next to each other, in order
        assert rows == sorted(rows, key=lambda r: (int(groups[r]), r))


def test_packed_plan_keeps_the_budget_with_uneven_rows_and_interleaved_groups():
    generator = torch.Generator().manual_seed(0)
    groups = torch.randint(0, 5, (40,), generator=generator)  # rows of a prompt not adjacent
    prompts = groups * 7 + 3  # the same length for a prompt's rows
    completions = torch.randint(1, 60, (40,), generator=generator)
    plan = plan_micro_batches(prompts, completions, 150, groups)
    assert sorted(r for rows in plan for r in rows) == list(range(40))
    assert all(packed_cost(rows, prompts, completions, groups) <= 150 for rows in plan)
    greedy_batches = 0  # the plan uses no more micro-batches than a plain greedy fill
    size, seen = 0, set()
    for r in sorted(range(40), key=lambda r: (int((groups == groups[r]).nonzero()[0]), r)):
        extra = int(completions[r]) + (0 if int(groups[r]) in seen else int(prompts[r]))
        if greedy_batches == 0 or size + extra > 150:
            greedy_batches, size, seen = greedy_batches + 1, 0, set()
            extra = int(completions[r]) + int(prompts[r])
        size += extra
        seen.add(int(groups[r]))
    assert len(plan) == greedy_batches


def test_a_row_over_the_budget_runs_alone_and_padded_plans_sort_by_length():
    prompts, completions = torch.tensor([5, 5, 5]), torch.tensor([3, 100, 4])
    plan = plan_micro_batches(prompts, completions, 50, torch.tensor([0, 0, 0]))
    assert [1] in plan and sorted(r for rows in plan for r in rows) == [0, 1, 2]
    padded = plan_micro_batches(prompts, completions, 30)  # rows x longest <= 30
    assert padded == [[0, 2], [1]]

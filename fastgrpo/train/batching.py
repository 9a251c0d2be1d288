"""Split a rollout's rows into mini-batches (one optimizer step each) of micro-batches that fit a
token budget (one forward and backward each)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgrpo.rollout import Rollout
from fastgrpo.train.logprobs import prompt_groups, trim_padding


@dataclass
class MicroBatch:
    rollout: Rollout  # trimmed rows
    advantages: torch.Tensor  # (b,)
    ref_logp: torch.Tensor | None = None  # (b, Tc), set by the reference scoring phase
    old_logp: torch.Tensor | None = None  # (b, Tc), set by the old log-probs phase


@dataclass
class MiniBatch:
    """The rows of one optimizer step: its micro-batches, and the counts its loss divides by."""

    micro: list[MicroBatch]
    num_sequences: int  # all of the mini-batch's rows, those left out included (on all ranks)
    num_tokens: torch.Tensor  # () its completion tokens, those left out included (on all ranks)
    rows: int = 0  # its rows on this rank
    # passes with no rows this rank runs after its micro-batches, to run as many forwards and
    # backwards as the busiest rank (`plan_update(lockstep=True)`: FSDP's collectives)
    idle_passes: int = 0


def plan_update(
    rollout: Rollout,
    advantages: torch.Tensor,
    *,
    mini_batches: int,
    token_budget: int,
    zero_gradient_rows: bool,
    packed: bool,
    world=None,
    lockstep: bool = False,
) -> list[MiniBatch]:
    """`mini_batches` equal slices of the rows, each in micro-batches of `token_budget` tokens.

    With `zero_gradient_rows` (a zero advantage gives a zero gradient: no KL, no entropy term)
    rows of zero advantage are left out of the micro-batches; they still count in the loss
    normalisers, so the update is the one the whole batch would give. `packed`: the native
    model's forward, which packs rows without padding and each shared prompt once.

    With a `world` (`distributed.World`) the rows are this rank's share of the global batch, and
    each mini-batch's counts are the global ones: its rows on every rank (`World.share` deals
    prompt groups round-robin, so this rank's mini-batch m is its share of the global one).
    `lockstep` (FSDP) sets each mini-batch's `idle_passes`: the busiest rank's number of
    micro-batches that run a forward (those with a kept token) less this rank's.
    """
    rows = advantages.shape[0]
    per_mini = rows // mini_batches
    plan = []
    for m in range(mini_batches):
        index = torch.arange(m * per_mini, (m + 1) * per_mini, device=advantages.device)
        sub = rollout.rows(index)
        num_tokens = sub.completion_mask.sum()
        num_sequences = per_mini
        if world is not None and world.size > 1:
            num_tokens, num_sequences = world.sum(num_tokens), per_mini * world.size
        num_tokens = num_tokens.clamp(min=1)
        active = (advantages[index] != 0) | (not zero_gradient_rows)  # rows that move weights
        micro = _micro_batches(sub, advantages[index], active, token_budget, packed)
        plan.append(MiniBatch(micro, num_sequences, num_tokens, rows=per_mini))
    if lockstep and world is not None and world.size > 1:
        passes = torch.tensor([float(sum(map(runs_forward, m.micro))) for m in plan])
        busiest = world.max(passes.to(advantages.device)).tolist()
        for mini, most, mine in zip(plan, busiest, passes.tolist()):
            mini.idle_passes = int(most - mine)
    return plan


def runs_forward(mb: MicroBatch) -> bool:
    """Whether scoring or training this micro-batch runs the model (else no token is kept)."""
    return bool(mb.rollout.completion_mask.any())


def _micro_batches(
    sub: Rollout, advantages, active, token_budget: int, packed: bool
) -> list[MicroBatch]:
    index = active.nonzero().squeeze(-1)
    if index.numel() == 0:
        return []
    chosen = sub.rows(index)
    groups = prompt_groups(chosen.prompt_ids, chosen.prompt_mask) if packed else None
    plan = plan_micro_batches(
        chosen.prompt_mask.sum(-1), chosen.completion_mask.sum(-1), token_budget, groups
    )
    return [MicroBatch(trim_padding(chosen.rows(rows)), advantages[index][rows]) for rows in plan]


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

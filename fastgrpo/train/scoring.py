"""The no-gradient phases before the update: reference and old log-probs of the completions.

Both are computed once per rollout, on the micro-batches the update will use, so the first inner
step sees a ratio of exactly 1. The reference model keeps no activations, so it scores several
micro-batches per forward (fewer forwards, less host time: the trainer is host-bound at small
batches). The old log-probs stay on the training micro-batches themselves: a GEMM over more rows
may round differently, and they must equal the first inner step's log-probs to the bit.
"""

from __future__ import annotations

import torch

from fastgrpo.algo.rollout_correction import as_sampling_logp, importance_weights, mismatch_metrics
from fastgrpo.train.batching import MicroBatch, MiniBatch
from fastgrpo.train.logprobs import completion_logprobs, concat_rollouts

# the reference scores over this many training micro-batch budgets at once
SCORING_BUDGET_FACTOR = 4


@torch.no_grad()
def score_reference(
    ref_model, plan: list[MiniBatch], *, temperature: float, token_budget: int, fused: bool
) -> None:
    """Set each micro-batch's `ref_logp` (b, Tc): the frozen reference's log-probs."""
    budget = SCORING_BUDGET_FACTOR * token_budget
    for mini in plan:
        scored = score_groups(ref_model, mini.micro, budget, temperature, fused)
        for mb, logp in zip(mini.micro, scored):
            mb.ref_logp = logp


@torch.no_grad()
def score_old(model, plan: list[MiniBatch], *, temperature: float, fused: bool) -> None:
    """Set each micro-batch's `old_logp` (b, Tc): the policy's log-probs before the update."""
    for mini in plan:
        for mb in mini.micro:
            mb.old_logp, _ = completion_logprobs(
                model, mb.rollout, temperature=temperature, fused=fused
            )
        run_idle_passes(model, mini.idle_passes, with_grad=False)


def run_idle_passes(model, count: int, with_grad: bool) -> None:
    """`count` passes over no rows (FSDP: as many collectives as the busiest rank runs)."""
    if count:
        from fastgrpo.distributed.fsdp import idle_pass

        for _ in range(count):
            idle_pass(model, with_grad)


@torch.no_grad()
def score_groups(
    model, micro: list[MicroBatch], budget: int, temperature: float, fused: bool
) -> list[torch.Tensor]:
    """(b, Tc) completion log-probs of each micro-batch's rows, from forwards over groups of
    consecutive micro-batches of up to `budget` padded tokens each."""
    groups: list[list[MicroBatch]] = []
    size = budget  # padded tokens in the current group; start a new group at once
    for mb in micro:
        rollout = mb.rollout
        tokens = rollout.prompt_ids.shape[0] * (
            rollout.prompt_ids.shape[1] + rollout.completion_ids.shape[1]
        )  # padded, as the plan counts them
        if size + tokens > budget:
            groups.append([])
            size = 0
        groups[-1].append(mb)
        size += tokens
    out = []
    for group in groups:
        merged = concat_rollouts([mb.rollout for mb in group])
        logp, _ = completion_logprobs(model, merged, temperature=temperature, fused=fused)
        for mb, part in zip(group, logp.split([mb.advantages.shape[0] for mb in group])):
            out.append(part[:, : mb.rollout.completion_ids.shape[1]])  # (b, Tc)
    return out


@torch.no_grad()
def correct_sampling_logp(plan: list[MiniBatch], mode: str, cap: float) -> dict[str, float]:
    """Importance-sampling correction of every micro-batch in `mode` (`algo.importance_sampling_mode`):
    modes other than token_truncate (which the loss applies itself) turn each micro-batch's
    sampling log-probs into the ones that give the mode's weights; the step's mismatch metrics,
    under TRL's names, when the old log-probs were scored (else none)."""
    parts = []
    for mini in plan:
        for mb in mini.micro:
            rollout = mb.rollout
            if mb.old_logp is None or rollout.sampling_logp is None:
                continue
            mask = rollout.completion_mask
            weight = importance_weights(mb.old_logp, rollout.sampling_logp, mask, mode, cap)
            parts.append(
                mismatch_metrics(mb.old_logp, rollout.sampling_logp, mask, mode, cap, weight)
            )
            parts[-1]["tokens"] = mask.sum()
            if mode != "token_truncate":
                rollout.sampling_logp = as_sampling_logp(mb.old_logp, weight)
    if not parts:
        return {}
    tokens = torch.stack([p["tokens"] for p in parts]).float()
    share = tokens / tokens.sum().clamp(min=1.0)
    mean = lambda key: float((torch.stack([p[key] for p in parts]) * share).sum())  # noqa: E731
    return {
        "sampling/sampling_logp_difference/mean": mean("gap_mean"),
        "sampling/sampling_logp_difference/max": float(max(p["gap_max"] for p in parts)),
        "sampling/importance_sampling_ratio/mean": mean("is_mean"),
        "sampling/importance_sampling_ratio/min": float(min(p["is_min"] for p in parts)),
        "sampling/importance_sampling_ratio/max": float(max(p["is_max"] for p in parts)),
        "sampling/corrected_frac": mean("corrected"),
    }

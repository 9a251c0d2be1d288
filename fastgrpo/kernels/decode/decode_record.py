"""The bookkeeping at the end of a decode step in one kernel: record the sampled tokens, end the
rows that sampled a stop token, and advance the step counters.

What: `record_step(tokens, logp, lengths, finished, last_token, step, slot, token, token_logp,
stop_ids, pad_id, advance_slot)`, for rows still running (not `finished`), stores `token` and its
log-prob at column `step` of `tokens` / `logp` (the pad id and 0 for finished rows), adds 1 to their
`lengths` and marks the rows whose token is one of `stop_ids` finished; then it sets `last_token` to
`token` (the next step's input) and advances `step` by one, and `slot` (the completion-cache slot
of the next step's input) by one when `advance_slot`. `step` and `slot` are () int64 device
tensors, so a CUDA graph of the decode step replays with them advancing in place.

Why: as torch ops this was ~12 small kernels per decode step (two `where` + `index_copy_`, the
lengths add, `isin` as a broadcast compare and a reduction, the flag update, the copy, and the two
counter increments), and plain launches break the programmatic-dependent-launch chain of the
step's Triton kernels. One program does it all: the 0.5B model's decode step at 64 rows on an H100
went from 1.128 to 1.044 ms (1.133 to 1.087-1.106 in an earlier pair;
benchmarks/results/rollout_ab_h100_v2.txt).

Reference: `record_step_ref`, the torch ops, which is also the CPU path.
"""

from __future__ import annotations

import torch

from fastgrpo import switches
from fastgrpo.kernels.decode import pdl
from fastgrpo.kernels.support import triton

if triton is not None:
    import triton.language as tl

BLOCK_ROWS = 1024
MAX_STOP_IDS = 1024
"""More stop ids than this go to the torch ops: the kernel compares each row with every stop id."""
COMPARES_PER_BLOCK = 8192
"""Rows per block times (padded) stop ids, the size of the kernel's compare tile."""
# FASTGRPO_DECODE_KERNELS=0 keeps the torch ops on CUDA too
ENABLED = switches.DECODE_KERNELS


def record_step_ref(
    tokens: torch.Tensor,  # (B, T) int64
    logp: torch.Tensor,  # (B, T) fp32
    lengths: torch.Tensor,  # (B,) int64
    finished: torch.Tensor,  # (B,) bool
    last_token: torch.Tensor,  # (B,) int64
    step: torch.Tensor,  # () int64: the column this step's tokens go to
    slot: torch.Tensor,  # () int64: the cache slot of the next step's input
    token: torch.Tensor,  # (B,) int64 sampled
    token_logp: torch.Tensor,  # (B,) fp32
    stop_ids: torch.Tensor,  # (S,) int64
    pad_id: int,
    advance_slot: bool,
) -> None:
    """Record one step's samples in place, by torch ops."""
    alive = ~finished  # (B,)
    column = step.view(1)
    tokens.index_copy_(1, column, torch.where(alive, token, pad_id).unsqueeze(1))
    logp.index_copy_(1, column, torch.where(alive, token_logp, 0.0).unsqueeze(1))
    lengths += alive
    finished |= alive & torch.isin(token, stop_ids)
    last_token.copy_(token)
    step += 1
    if advance_slot:
        slot += 1


if triton is not None:

    @triton.jit
    def _record_step_kernel(
        tokens_ptr,  # (B, T) int64 contiguous
        logp_ptr,  # (B, T) fp32 contiguous
        lengths_ptr,  # (B,) int64
        finished_ptr,  # (B,) bool
        last_ptr,  # (B,) int64
        step_ptr,
        slot_ptr,  # () int64 each
        token_ptr,  # (B,) int64
        token_logp_ptr,  # (B,) fp32
        stop_ptr,  # (S,) int64
        B,
        T,
        n_stop,
        pad_id,
        ADVANCE_SLOT: tl.constexpr,
        BLOCK: tl.constexpr,
        STOP_PAD: tl.constexpr,
        PDL: tl.constexpr = False,  # programmatic dependent launch (kernels.pdl)
    ):
        pdl.start(PDL)
        pdl.wait(PDL)
        # one program: the counters advance after every row has read them
        step = tl.load(step_ptr)
        stops = tl.arange(0, STOP_PAD)
        stop_ids = tl.load(stop_ptr + stops, mask=stops < n_stop, other=-1)  # ids are >= 0
        for first in range(0, B, BLOCK):
            rows = (first + tl.arange(0, BLOCK)).to(tl.int64)
            ok = rows < B
            token = tl.load(token_ptr + rows, mask=ok, other=0)
            alive = tl.load(finished_ptr + rows, mask=ok, other=1) == 0
            at = rows * T + step
            tl.store(tokens_ptr + at, tl.where(alive, token, pad_id), mask=ok)
            token_logp = tl.load(token_logp_ptr + rows, mask=ok, other=0.0)
            tl.store(logp_ptr + at, tl.where(alive, token_logp, 0.0), mask=ok)
            lengths = tl.load(lengths_ptr + rows, mask=ok, other=0)
            tl.store(lengths_ptr + rows, lengths + alive.to(tl.int64), mask=ok)
            hits = tl.sum((token[:, None] == stop_ids[None, :]).to(tl.int32), axis=1)
            tl.store(finished_ptr + rows, (alive == 0) | (hits > 0), mask=ok)
            tl.store(last_ptr + rows, token, mask=ok)
        tl.debug_barrier()  # every thread has read step before any writes it
        tl.store(step_ptr, step + 1)
        if ADVANCE_SLOT:
            tl.store(slot_ptr, tl.load(slot_ptr) + 1)


def _rows_per_block(B: int, stop_pad: int) -> int:
    return max(1, min(BLOCK_ROWS, triton.next_power_of_2(B), COMPARES_PER_BLOCK // stop_pad))


def record_step_triton(
    tokens, logp, lengths, finished, last_token, step, slot, token, token_logp, stop_ids, pad_id,
    advance_slot,
) -> None:  # fmt: skip
    """As `record_step_ref`, by one Triton launch (one program). No host sync."""
    if triton is None:
        raise RuntimeError("the Triton step record needs `pip install triton`")
    B, T = tokens.shape
    if not (tokens.is_contiguous() and logp.is_contiguous()) or logp.shape != (B, T):
        raise ValueError("tokens and logp must be contiguous (B, T)")
    if any(t.shape != (B,) for t in (lengths, finished, last_token, token, token_logp)):
        raise ValueError(f"per-row tensors of shape ({B},) expected")
    if step.shape != () or slot.shape != () or stop_ids.dim() != 1:
        raise ValueError("step and slot must be () tensors and stop_ids (S,)")
    stop_pad = max(2, triton.next_power_of_2(stop_ids.numel()))
    if B == 0 or stop_pad > MAX_STOP_IDS:
        record_step_ref(
            tokens, logp, lengths, finished, last_token, step, slot, token, token_logp,
            stop_ids, pad_id, advance_slot,
        )  # fmt: skip
        return
    _record_step_kernel[(1,)](
        tokens,
        logp,
        lengths,
        finished,
        last_token,
        step,
        slot,
        token,
        token_logp,
        stop_ids,
        B,
        T,
        stop_ids.numel(),
        pad_id,
        ADVANCE_SLOT=advance_slot,
        BLOCK=_rows_per_block(B, stop_pad),
        STOP_PAD=stop_pad,
        num_warps=4,
        **pdl.launch_options(),
    )


if triton is not None:

    @triton.jit
    def _live_groups_kernel(
        finished_ptr, out_ptr, P, G, BLOCK_P: tl.constexpr, G_PAD: tl.constexpr
    ):
        members = tl.arange(0, G_PAD)
        live = tl.zeros([BLOCK_P], dtype=tl.int32)
        for first in range(0, P, BLOCK_P):
            groups = first + tl.arange(0, BLOCK_P)
            ok = (groups[:, None] < P) & (members[None, :] < G)
            flags = tl.load(finished_ptr + groups[:, None] * G + members[None, :], mask=ok, other=1)
            live += tl.max((flags == 0).to(tl.int32), 1)  # 1 where a row of the group runs
        tl.store(out_ptr, tl.sum(live, 0))


def live_groups_ref(finished: torch.Tensor, group: int) -> torch.Tensor:
    """() int32: how many groups of `group` consecutive rows of `finished` (B,) have a row still
    running."""
    return (~finished.view(-1, group)).any(1).sum().to(torch.int32)


def live_groups_triton(finished: torch.Tensor, group: int, out: torch.Tensor) -> None:
    """`out.fill_(live_groups_ref(finished, group))` by one Triton launch (one program), for
    `finished` (B,) bool and `out` a () int32 tensor on the GPU or in pinned host memory, which the
    GPU reaches through unified addressing. No host sync."""
    if triton is None:
        raise RuntimeError("the Triton finish check needs `pip install triton`")
    _check_live_groups(finished, group, out)
    P = finished.numel() // group
    g_pad = triton.next_power_of_2(group)
    block = max(1, min(triton.next_power_of_2(max(P, 1)), 1024 // g_pad))
    _live_groups_kernel[(1,)](finished, out, P, group, BLOCK_P=block, G_PAD=g_pad, num_warps=1)


def _check_live_groups(finished, group, out) -> None:
    if finished.dim() != 1 or finished.dtype != torch.bool:
        raise ValueError(
            f"finished must be a (B,) bool tensor, got {tuple(finished.shape)} {finished.dtype}"
        )
    if group < 1 or finished.numel() % group:
        raise ValueError(f"{finished.numel()} rows do not split into groups of {group}")
    if out.shape != () or out.dtype != torch.int32:
        raise ValueError(f"out must be a () int32 tensor, got {tuple(out.shape)} {out.dtype}")


def live_groups_into(finished: torch.Tensor, group: int, out: torch.Tensor) -> None:
    """Write how many groups of `group` rows have a row still running into `out` (0: all rows
    finished): on CUDA by `live_groups_triton`, which may write into pinned host memory directly,
    so a host look at a wave costs one small launch instead of a reduction kernel and a
    device-to-host copy (each with its hand-off gap); elsewhere by torch."""
    if ENABLED and triton is not None and finished.is_cuda:
        return live_groups_triton(finished, group, out)
    _check_live_groups(finished, group, out)
    out.copy_(live_groups_ref(finished, group), non_blocking=True)


def record_step(
    tokens, logp, lengths, finished, last_token, step, slot, token, token_logp, stop_ids, pad_id,
    advance_slot,
) -> None:  # fmt: skip
    """The kernel on CUDA, else the reference."""
    args = (tokens, logp, lengths, finished, last_token, step, slot, token, token_logp, stop_ids)
    if ENABLED and triton is not None and tokens.is_cuda:
        return record_step_triton(*args, pad_id, advance_slot)
    return record_step_ref(*args, pad_id, advance_slot)

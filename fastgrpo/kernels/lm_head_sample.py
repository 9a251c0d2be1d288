"""A decode step's LM head and sampler in one kernel: tokens straight from the hidden states, with
no (B, V) logits in memory.

What: for hidden (B, H) and the LM-head weight (V, H), each row's token `argmax(z + g)` with
z = hidden @ weight.T / T and g the counter-based Gumbel noise of `fastgrpo.rollout.sampling`
(the same noise as `sample_tokens.sample_tokens_fused`, column for column), and its
`logp = log_softmax(z)[token]` in fp32. Temperature 0 is greedy (argmax of the logits, logp at
T = 1). The plain setting only (no top-k, no top-p), and at most `MAX_ROWS` rows.

How: one program per block of BLOCK_V vocabulary columns streams its weight rows once (bulk tensor
copies, a few stages in flight) against all rows of the batch, the logits tile staying in
registers. Its epilogue does what the sampler does per column: hashes the column's noise, keeps
each row's best score, its column and that column's logit, and the row's max and sum of
exponentials over the block. A second small kernel per row picks the best block (ties: the lowest
column, as torch.argmax) and merges the sums into the log-normaliser.

Why: a decode step ran the LM head as a cuBLAS GEMM writing (B, V) bf16 logits, then the sampler
read them back: at 64 rows of a 151936-entry vocabulary (the 0.5B shape) ~105 us for the GEMM
(272 MB of weight) plus ~27 us of sampling, which is compute-bound (a 32-bit hash, two log2 and
an exp2 per column) and cannot start before the last logit is written. Here the sampler's
arithmetic runs while the weight streams in. The logits also stay in fp32 (cuBLAS rounds them to
bf16), so a sampled token's log-prob is the one the trainer's LM-head kernels compute from their
fp32 accumulator, not one from rounded logits.

Reference: `lm_head_sample_ref`: the logits in fp32 by torch, then the torch sampler.
"""

from __future__ import annotations

import torch

from fastgrpo.kernels import pdl
from fastgrpo.kernels.lm_head_stats import (
    LOG2E,
    TensorDescriptor,
    _interpreting,
    _tma_ready,
    triton,
)
from fastgrpo.kernels.sample_tokens import check_sampling_args

if triton is not None:
    import triton.language as tl

    from fastgrpo.kernels.lm_head_stats import _LN2
    from fastgrpo.kernels.sample_tokens import _noise_log2, _row_keys

MAX_ROWS = 64
"""The most rows the kernel takes: all rows share each weight tile in one program; more rows would
need a second pass over the weight, which cuBLAS then the sampler do better."""


def takes(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel serves these operands as they are: a decode batch of at most MAX_ROWS
    rows on a GPU, one float dtype, both readable by bulk tensor copies without a copy (a copy of
    the LM head would cost more than the fusion saves)."""
    return (
        triton is not None
        and hidden.is_cuda
        and hidden.dim() == 2
        and hidden.shape[0] <= MAX_ROWS
        and hidden.dtype == weight.dtype
        and hidden.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and all(_tma_ready(t) is t for t in (hidden, weight))
    )


def lm_head_sample_ref(hidden, weight, temperature: float, seeds, step):
    """(tokens (B,) int64, logp (B,) fp32): fp32 logits by torch, then the torch sampler."""
    from fastgrpo.rollout.sampling import SamplingParams, sample_tokens_torch

    logits = hidden.float() @ weight.float().t()  # (B, V)
    return sample_tokens_torch(logits, SamplingParams(temperature), seeds, step)


if triton is not None:

    @triton.jit
    def _lm_head_sample_kernel(
        x_desc,  # hidden (B, H), blocks (BLOCK_B, BLOCK_K)
        w_desc,  # weight (V, H), blocks (BLOCK_V, BLOCK_K)
        seeds_ptr,  # (B,) int64
        step_ptr,  # (B,) or () int64
        best_ptr,  # (S, B) fp32: the block's best score (the logit when greedy)
        col_ptr,  # (S, B) int32: its column
        z_ptr,  # (S, B) fp32: that column's z * log2(e)
        max_ptr,  # (S, B) fp32: the block's max of z * log2(e)
        sum_ptr,  # (S, B) fp32: its sum of exp2(z * log2(e) - max)
        B,
        V,
        H,
        seed_stride,
        step_stride,  # 0 for a scalar step
        scale,  # fp32 log2(e) / T (log2(e) when greedy)
        BLOCK_B: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GREEDY: tl.constexpr,
        FAST_LOG: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        PDL: tl.constexpr = False,  # programmatic dependent launch (kernels.pdl)
    ):
        pdl.start(PDL)
        pdl.wait(PDL)
        block = tl.program_id(0)
        v0 = block * BLOCK_V
        acc = tl.zeros([BLOCK_B, BLOCK_V], tl.float32)
        for k in range(0, H, BLOCK_K):
            x = x_desc.load([0, k])  # (BLOCK_B, BLOCK_K); rows past B arrive as zeros
            w = w_desc.load([v0, k])  # (BLOCK_V, BLOCK_K); columns past V too
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        rows = tl.arange(0, BLOCK_B)
        row_ok = rows < B
        cols = v0 + tl.arange(0, BLOCK_V)  # (BLOCK_V,) int32
        col_ok = (cols < V)[None, :]
        z2 = tl.where(col_ok, acc * scale, float("-inf"))  # (BLOCK_B, BLOCK_V)
        if GREEDY:
            score = tl.where(col_ok, acc, float("-inf"))
        else:
            some_row = tl.minimum(rows, B - 1)  # rows past B read row B - 1's keys, unused
            lo_key, hi_key = _row_keys(seeds_ptr, seed_stride, step_ptr, step_stride, some_row)
            noise = _noise_log2(cols[None, :], lo_key[:, None], hi_key[:, None], FAST_LOG)
            score = z2 + noise
        best = tl.max(score, 1)  # (BLOCK_B,)
        # the lowest column holding the best score, as torch.argmax
        col = tl.min(tl.where(score == best[:, None], cols[None, :], 2**31 - 1), 1)
        z_best = tl.max(tl.where(cols[None, :] == col[:, None], z2, float("-inf")), 1)
        top = tl.max(z2, 1)
        total = tl.sum(tl.exp2(z2 - top[:, None]), 1)  # every block holds a column below V
        out = block * B + rows
        tl.store(best_ptr + out, best, mask=row_ok)
        tl.store(col_ptr + out, col, mask=row_ok)
        tl.store(z_ptr + out, z_best, mask=row_ok)
        tl.store(max_ptr + out, top, mask=row_ok)
        tl.store(sum_ptr + out, total, mask=row_ok)

    @triton.jit
    def _pick_kernel(
        best_ptr,
        col_ptr,
        z_ptr,
        max_ptr,
        sum_ptr,  # each (S, B), as written by _lm_head_sample_kernel
        tokens_ptr,  # (B,) int64
        logp_ptr,  # (B,) fp32
        B,
        S,
        S_PAD: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """Row by row: the best block (ties: the lowest, hence the lowest column), its column and
        logit, and the log-normaliser from the blocks' maxima and sums."""
        pdl.start(PDL)
        pdl.wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        blocks = tl.arange(0, S_PAD)
        ok = blocks < S
        at = blocks * B + row
        best = tl.load(best_ptr + at, mask=ok, other=float("-inf"))
        _, winner = tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)
        mine = blocks == winner
        token = tl.sum(tl.where(mine, tl.load(col_ptr + at, mask=ok, other=0), 0), 0)
        z2 = tl.sum(tl.where(mine, tl.load(z_ptr + at, mask=ok, other=0.0), 0.0), 0)
        block_max = tl.load(max_ptr + at, mask=ok, other=float("-inf"))
        block_sum = tl.load(sum_ptr + at, mask=ok, other=0.0)
        top = tl.max(block_max, 0)
        total = tl.sum(block_sum * tl.exp2(block_max - top), 0)
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logp_ptr + row, (z2 - top - tl.log2(total)) * _LN2)


def _blocks() -> tuple[int, int, int, int]:
    """(BLOCK_V, BLOCK_K, num_warps, num_stages). In the interpreter, small blocks so that a test
    vocabulary spans several blocks and a partial last one."""
    if _interpreting():
        return 32, 16, 4, 1
    # 128 columns x 64-wide k steps, 3 stages: 72 KB of shared memory, so three programs share a
    # multiprocessor and one's epilogue (the sampler's arithmetic) runs while another's weight
    # streams in
    return 128, 64, 4, 3


def lm_head_sample(
    hidden: torch.Tensor,  # (B, H), B <= MAX_ROWS
    weight: torch.Tensor,  # (V, H), hidden's dtype
    temperature: float,  # 0 = greedy
    seeds: torch.Tensor,  # (B,) int64
    step: torch.Tensor,  # (B,) or () int64, read on the device
    blocks: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B,) int64, logp (B,) fp32) as `lm_head_sample_ref`, in two Triton launches. No
    host sync: safe to capture in a CUDA graph and replay with `step` changed in place. `blocks`
    overrides `_blocks()` (tuning)."""
    if triton is None:
        raise RuntimeError("the fused LM-head sampler needs `pip install triton`")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden (B, H) and weight (V, H) expected, got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():
        raise ValueError(
            f"hidden and weight must share a float dtype: {hidden.dtype}, {weight.dtype}"
        )
    B, H = hidden.shape
    V = weight.shape[0]
    if B > MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS} rows per call, got {B}")
    check_sampling_args(B, V, hidden.device, temperature, seeds, step)
    device = hidden.device
    tokens = torch.empty(B, dtype=torch.int64, device=device)
    logp = torch.empty(B, dtype=torch.float32, device=device)
    if B == 0:
        return tokens, logp
    if _interpreting() and hidden.dtype == torch.bfloat16:  # numpy has no bf16; fp32 is exact
        hidden, weight = hidden.float(), weight.float()
    hidden, weight = _tma_ready(hidden), _tma_ready(weight)
    block_v, block_k, warps, stages = blocks or _blocks()
    block_b = max(16, triton.next_power_of_2(B))
    greedy = temperature == 0
    scale = LOG2E if greedy else LOG2E / temperature
    splits = triton.cdiv(V, block_v)
    best, z2, split_max, split_sum = torch.empty(4, splits, B, dtype=torch.float32, device=device)
    cols = torch.empty(splits, B, dtype=torch.int32, device=device)
    _lm_head_sample_kernel[(splits,)](
        TensorDescriptor.from_tensor(hidden, [block_b, block_k]),
        TensorDescriptor.from_tensor(weight, [block_v, block_k]),
        seeds,
        step,
        best,
        cols,
        z2,
        split_max,
        split_sum,
        B,
        V,
        H,
        seeds.stride(0),
        step.stride(0) if step.dim() else 0,
        scale,
        BLOCK_B=block_b,
        BLOCK_V=block_v,
        BLOCK_K=block_k,
        GREEDY=greedy,
        FAST_LOG=not _interpreting(),
        DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
        num_warps=warps,
        num_stages=stages,
        **pdl.launch_options(),
    )
    _pick_kernel[(B,)](
        best,
        cols,
        z2,
        split_max,
        split_sum,
        tokens,
        logp,
        B,
        splits,
        S_PAD=triton.next_power_of_2(splits),
        **pdl.launch_options(),
    )
    return tokens, logp

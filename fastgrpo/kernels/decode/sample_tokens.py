"""The decode step's token sampler in one pass over the logits: Gumbel-max token and its log-prob.

What: for each row of `logits` (B, V), the token `argmax(z + g)` with `z = logits / T` and `g` the
counter-based Gumbel noise of `fastgrpo.rollout.sampling` (a 64-bit splitmix64 state per (seed,
step), then 32 bits per vocabulary index from two rounds of lowbias32), and
`logp = log_softmax(z)[token]` in fp32. Temperature 0 is greedy: `argmax(logits)`, with `logp` at
T = 1. Only the plain setting (no top-k, no top-p) is served, the usual GRPO one.

How: the vocabulary is cut into splits of `BLOCKS_PER_SPLIT` blocks; one program per (row, split)
walks its blocks once, hashing the noise of each column in registers. Each lane keeps its own best
score and column and its own sum of exponentials of z against the block-wide running max, so a
block costs one cross-lane reduction (that max), and the best score is reduced once at the end. A second, tiny kernel (one program per
row) picks the best split (ties: the lowest split, hence the lowest column, as `torch.argmax`),
merges the sums into the log-normaliser and reads the token's logit again for its log-prob. The
number of splits depends on V alone, so a row's result never depends on its batch. No host sync:
`step` is read on the device, so the launch replays in a CUDA graph while `step` advances.

Everything runs in base 2, where the GPU's fast exp2 / log2 (one MUFU instruction each) live:
with r the column's uniform and L = -log2(1 - r) = Exp(1) * log2(e), the score is
`z * log2(e) / T - log2(L)`, which is (z + g) * log2(e) up to a constant, so it has the same
argmax. L comes from the series of -log1p(-r) for r < 1/32 (5 terms, relative error < 1e-8),
where 1 - r would lose r's low bits, and from log2(1 - r) above. Per column that is the 32-bit
hash, two log2 and one exp2 (for the log-normaliser).

Why: the torch sampler costs ~0.8 ms of a 7 ms decode step on the H100 at 64 x 151936 (about 15
whole-(B, V) int64 / fp32 passes); this reads the bf16 logits once (~20 MB at B = 64). A first
version hashed 64 bits per column and used libdevice's exact log1p / log to match the torch
sampler bit for bit: ~130 instructions per column, 45 us at B = 64 (compute-bound). Matching
torch bit for bit is not needed for correct sampling, so this version trades it for speed: 26.8
us at B = 64 and 87.6 us at B = 256 on the H100 (benchmarks/lab/tune_sampler.py), against 1.8 and 6.9
ms for the torch sampler.

Same noise up to rounding: the uniform r and its clamps are bitwise `sampling_ref._gumbel`'s; the logs
differ from torch's in the last bits (fast log2 on a GPU, numpy's in the interpreter), so tokens
agree with the torch sampler except at near-ties (the tests skip rows whose two best scores are
within 1e-5).

Reference: `sample_tokens_fused_ref`, the torch sampler itself (`sampling.sample_tokens_torch`).
"""

from __future__ import annotations

import math

import torch

from fastgrpo.kernels.decode import pdl
from fastgrpo.kernels.decode.sampling_ref import SamplingParams, sample_tokens_torch
from fastgrpo.kernels.support import LN2, LOG2E, interpreting, triton

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    from fastgrpo.kernels.support import LN2_CONSTEXPR, LOG2E_CONSTEXPR

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def sample_tokens_fused_ref(logits, temperature: float, seeds, step):
    """(tokens (B,) int64, logp (B,) fp32) by the torch sampler with no top-k / top-p: the spec."""
    return sample_tokens_torch(logits, SamplingParams(temperature), seeds, step)


if triton is not None:
    # splitmix64 (Steele, Lea, Flood 2014) in uint64, which wraps and shifts logically
    _GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
    _MUL1 = tl.constexpr(0xBF58476D1CE4E5B9)
    _MUL2 = tl.constexpr(0x94D049BB133111EB)
    # lowbias32 (hash-prospector) in uint32
    _LOWBIAS_MUL1 = tl.constexpr(0x7FEB352D)
    _LOWBIAS_MUL2 = tl.constexpr(0x846CA68B)
    _R_SCALE = tl.constexpr(2.0**-32)  # 32 bits -> [0, 1]
    _R_MIN = tl.constexpr(2.0**-33)
    _R_MAX = tl.constexpr(1.0 - 2.0**-24)  # the largest fp32 below 1
    _SERIES_BELOW = tl.constexpr(1.0 / 32)

    @triton.jit
    def _mix64(x):
        """splitmix64 output function of uint64 x."""
        x ^= x >> 30
        x *= _MUL1
        x ^= x >> 27
        x *= _MUL2
        x ^= x >> 31
        return x

    @triton.jit
    def _lowbias32(x):
        """lowbias32 of uint32 x."""
        x ^= x >> 16
        x *= _LOWBIAS_MUL1
        x ^= x >> 15
        x *= _LOWBIAS_MUL2
        x ^= x >> 16
        return x

    @triton.jit
    def _row_keys(seeds_ptr, seed_stride, step_ptr, step_stride, row):
        """(lo, hi) uint32: the halves of the row's splitmix64 state, as `sampling_ref.row_state`."""
        seed = tl.load(seeds_ptr + row * seed_stride).to(tl.uint64, bitcast=True)
        step = tl.load(step_ptr + row * step_stride).to(tl.uint64, bitcast=True)
        state = _mix64(_mix64(seed + _GOLDEN) + step * _GOLDEN)
        return (state & 0xFFFFFFFF).to(tl.uint32), (state >> 32).to(tl.uint32)

    @triton.jit
    def _log2(x, FAST: tl.constexpr):
        if FAST:  # one MUFU instruction (lg2.approx); tl.log2 is libdevice's exact log2f
            return libdevice.fast_log2f(x)
        else:  # the interpreter
            return tl.log2(x)

    @triton.jit
    def _noise_log2(cols, lo, hi, FAST: tl.constexpr):
        """-log2(L), L = Exp(1) * log2(e) from the uniform of `sampling_ref.column_bits`: the Gumbel
        noise g times log2(e), less the constant log2(ln 2)."""
        bits = _lowbias32(_lowbias32(cols.to(tl.uint32) ^ lo) ^ hi)
        r = tl.minimum(tl.maximum(bits.to(tl.float32) * _R_SCALE, _R_MIN), _R_MAX)
        # -log1p(-r) = r + r^2/2 + r^3/3 + ...: 5 terms below 1/32, where 1 - r loses r's bits
        series = r * (1.0 + r * (0.5 + r * (1.0 / 3 + r * (0.25 + r * 0.2)))) * LOG2E_CONSTEXPR
        small = r < _SERIES_BELOW
        big = -_log2(tl.where(small, 0.5, 1.0 - r), FAST)
        return -_log2(tl.where(small, series, big), FAST)

    @triton.jit
    def _sample_splits_kernel(
        logits_ptr,  # (B, V), any strides
        seeds_ptr,  # (B,) int64
        step_ptr,  # (B,) or () int64
        best_ptr,  # (S, B) fp32: the split's best score (base 2; the logit when greedy)
        col_ptr,  # (S, B) int32: its column
        max_ptr,  # (S, B) fp32: the split's max of z * log2(e)
        sum_ptr,  # (S, B) fp32: its sum of exp2(z * log2(e) - max)
        B,
        V,
        stride_b,
        stride_v,
        seed_stride,
        step_stride,  # 0 for a scalar step
        scale,  # fp32 log2(e) / T (log2(e) when greedy)
        BLOCK_V: tl.constexpr,
        BLOCKS_PER_SPLIT: tl.constexpr,
        GREEDY: tl.constexpr,
        FAST_LOG: tl.constexpr,
        PDL: tl.constexpr = False,  # programmatic dependent launch (kernels.pdl)
    ):
        pdl.start(PDL)
        pdl.wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        start = split * (BLOCK_V * BLOCKS_PER_SPLIT)
        stop = tl.minimum(start + BLOCK_V * BLOCKS_PER_SPLIT, V)
        offs = tl.arange(0, BLOCK_V)
        if not GREEDY:
            lo_key, hi_key = _row_keys(seeds_ptr, seed_stride, step_ptr, step_stride, row)
        row_ptr = logits_ptr + row * stride_b
        # per lane: the best score and its column (no reduction in the loop), and the sum of
        # exp2(z2 - running_max) against the block-wide running max (one reduction per block)
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_col = tl.full([BLOCK_V], 2**31 - 1, tl.int32)
        lane_sum = tl.zeros([BLOCK_V], tl.float32)
        running_max = tl.full([], float("-inf"), tl.float32)
        for lo in range(start, stop, BLOCK_V):
            cols = lo + offs  # (BLOCK_V,) int32
            ok = cols < stop
            x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=ok, other=float("-inf"))
            x = x.to(tl.float32)
            z2 = x * scale  # (BLOCK_V,) z * log2(e)
            if GREEDY:
                score = x
            else:
                score = z2 + _noise_log2(cols, lo_key, hi_key, FAST_LOG)  # -inf past the split
            better = score > best  # strict: a lane's earlier (lower) column keeps a tie; never
            best = tl.where(better, score, best)  # past the split, where the score is -inf
            best_col = tl.where(better, cols, best_col)
            new_max = tl.maximum(running_max, tl.max(z2, 0))
            base = tl.where(new_max == float("-inf"), 0.0, new_max)  # no -inf - -inf
            lane_sum = lane_sum * tl.exp2(running_max - base) + tl.exp2(z2 - base)
            running_max = new_max
        top = tl.max(best, 0)
        # the lowest column among the lanes holding the best score, as torch.argmax; a split of
        # -inf scores keeps its first column
        col = tl.min(tl.where(best == top, best_col, 2**31 - 1), 0)
        col = tl.where(col == 2**31 - 1, start, col)
        out = split * B + row
        tl.store(best_ptr + out, top)
        tl.store(col_ptr + out, col)
        tl.store(max_ptr + out, running_max)
        tl.store(sum_ptr + out, tl.sum(lane_sum, 0))

    @triton.jit
    def _combine_splits_kernel(
        logits_ptr,  # (B, V), any strides
        best_ptr,
        col_ptr,
        max_ptr,
        sum_ptr,  # each (S, B), as written by _sample_splits_kernel
        tokens_ptr,  # (B,) int64
        logp_ptr,  # (B,) fp32
        B,
        S,
        stride_b,
        stride_v,
        scale,
        S_PAD: tl.constexpr,
        PDL: tl.constexpr = False,  # programmatic dependent launch (kernels.pdl)
    ):
        pdl.start(PDL)
        pdl.wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        splits = tl.arange(0, S_PAD)
        ok = splits < S
        at = splits * B + row  # (S_PAD,)
        best = tl.load(best_ptr + at, mask=ok, other=float("-inf"))
        _, winner = tl.max(best, 0, return_indices=True, return_indices_tie_break_left=True)
        col = tl.load(col_ptr + at, mask=ok, other=0)
        token = tl.sum(tl.where(splits == winner, col, 0), 0).to(tl.int64)
        split_max = tl.load(max_ptr + at, mask=ok, other=float("-inf"))
        split_sum = tl.load(sum_ptr + at, mask=ok, other=0.0)
        top = tl.max(split_max, 0)
        base = tl.where(top == float("-inf"), 0.0, top)
        total = tl.sum(split_sum * tl.exp2(split_max - base), 0)
        z2 = tl.load(logits_ptr + row * stride_b + token * stride_v).to(tl.float32) * scale
        tl.store(tokens_ptr + row, token)
        tl.store(logp_ptr + row, (z2 - base - tl.log2(total)) * LN2_CONSTEXPR)

    @triton.jit
    def _noise_kernel(
        seeds_ptr,
        step_ptr,
        noise_ptr,  # (B, V) fp32
        V,
        seed_stride,
        step_stride,
        BLOCK_V: tl.constexpr,
        FAST_LOG: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        lo_key, hi_key = _row_keys(seeds_ptr, seed_stride, step_ptr, step_stride, row)
        noise = _noise_log2(cols, lo_key, hi_key, FAST_LOG)
        tl.store(noise_ptr + row * V + cols, noise, mask=cols < V)


def _blocks() -> tuple[int, int, int]:
    """(BLOCK_V, BLOCKS_PER_SPLIT, num_warps). In the interpreter, small blocks so that test
    vocabularies of ~1000 span several splits of several blocks. On a GPU (not yet tuned on the
    H100): splits of 4096 columns, 38 at V = 151936, so B * 38 programs (2432 at B = 64)."""
    if interpreting():
        return 128, 2, 1
    return 1024, 4, 4


def _check_inputs(logits, temperature, seeds, step) -> None:
    if logits.dim() != 2 or logits.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"logits must be a (B, V) tensor of one of {KERNEL_DTYPES}, got "
            f"{logits.dtype} {tuple(logits.shape)}"
        )
    check_sampling_args(*logits.shape, logits.device, temperature, seeds, step)


def check_sampling_args(B: int, V: int, device, temperature, seeds, step) -> None:
    """The temperature, the vocabulary size and the (seeds, step) tensors of a sampler call for B
    rows on `device`; a clear error otherwise."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not isinstance(step, torch.Tensor):
        raise TypeError("step must be an int64 tensor (it lives on the device in a CUDA graph)")
    if not 0 < V < 2**31:
        raise ValueError(f"the vocabulary must have 1 to 2^31 - 1 entries, got {V}")
    for name, t, shapes in (("seeds", seeds, [(B,)]), ("step", step, [(), (B,)])):
        if t.dtype != torch.int64 or tuple(t.shape) not in shapes or t.device != device:
            raise ValueError(
                f"{name} must be an int64 tensor of shape {' or '.join(map(str, shapes))} on "
                f"{device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
            )


def sample_tokens_fused(
    logits: torch.Tensor,  # (B, V) fp16 / bf16 / fp32, any strides
    temperature: float,  # 0 = greedy
    seeds: torch.Tensor,  # (B,) int64
    step: torch.Tensor,  # (B,) or () int64, read on the device
    blocks: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B,) int64, logp (B,) fp32) as `sample_tokens_fused_ref`, in two Triton launches.
    No host sync: safe to capture in a CUDA graph and replay with `step` changed in place.
    `blocks` overrides `_blocks()` (BLOCK_V, BLOCKS_PER_SPLIT, num_warps), for tuning."""
    if triton is None:
        raise RuntimeError("the fused Triton sampler needs `pip install triton`")
    _check_inputs(logits, temperature, seeds, step)
    B, V = logits.shape
    device = logits.device
    tokens = torch.empty(B, dtype=torch.int64, device=device)
    logp = torch.empty(B, dtype=torch.float32, device=device)
    if B == 0:
        return tokens, logp
    greedy = temperature == 0
    scale = LOG2E if greedy else LOG2E / temperature  # passed as fp32
    block_v, blocks_per_split, warps = blocks or _blocks()
    splits = triton.cdiv(V, block_v * blocks_per_split)
    best, split_max, split_sum = torch.empty(3, splits, B, dtype=torch.float32, device=device)
    cols = torch.empty(splits, B, dtype=torch.int32, device=device)
    strides = (logits.stride(0), logits.stride(1))
    _sample_splits_kernel[(B, splits)](
        logits,
        seeds,
        step,
        best,
        cols,
        split_max,
        split_sum,
        B,
        V,
        *strides,
        seeds.stride(0),
        step.stride(0) if step.dim() else 0,
        scale,
        BLOCK_V=block_v,
        BLOCKS_PER_SPLIT=blocks_per_split,
        GREEDY=greedy,
        FAST_LOG=not interpreting(),
        num_warps=warps,
        **pdl.launch_options(),
    )
    _combine_splits_kernel[(B,)](
        logits,
        best,
        cols,
        split_max,
        split_sum,
        tokens,
        logp,
        B,
        splits,
        *strides,
        scale,
        S_PAD=triton.next_power_of_2(splits),
        **pdl.launch_options(),
    )
    return tokens, logp


def noise_log2(seeds: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:  # (B, V)
    """The noise the kernel adds to z * log2(e), written out (a test helper: no input checks).
    `noise_log2(...) * ln 2 - ln(ln 2)` is the Gumbel noise `sampling_ref._gumbel` draws."""
    if triton is None:
        raise RuntimeError("the fused Triton sampler needs `pip install triton`")
    B = seeds.shape[0]
    noise = torch.empty(B, vocab, dtype=torch.float32, device=seeds.device)
    block_v = _blocks()[0]
    _noise_kernel[(B, triton.cdiv(vocab, block_v))](
        seeds,
        step,
        noise,
        vocab,
        seeds.stride(0),
        step.stride(0) if step.dim() else 0,
        BLOCK_V=block_v,
        FAST_LOG=not interpreting(),
    )
    return noise


def gumbel_noise(seeds: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:  # (B, V)
    """The kernel's noise in natural units, comparable to `sampling_ref._gumbel` (a test helper)."""
    return noise_log2(seeds, step, vocab) * LN2 - math.log(LN2)

"""The decode step's token sampler in one pass over the logits: Gumbel-max token and its log-prob.

What: for each row of `logits` (B, V), the token `argmax(z + g)` with `z = logits / T` and `g` the
counter-based Gumbel noise of `fastgrpo.rollout.sampling` (splitmix64 of (seed, step, vocabulary
index)), and `logp = log_softmax(z)[token]` in fp32. Temperature 0 is greedy: `argmax(logits)`,
with `logp` at T = 1. Only the plain setting (no top-k, no top-p) is served, the usual GRPO one.

How: the vocabulary is cut into splits of `BLOCKS_PER_SPLIT` blocks; one program per (row, split)
walks its blocks once, hashing the noise of each column in registers, and keeps the best score,
its column, and an online max / sum of exponentials of z. A second, tiny kernel (one program per
row) picks the best split (ties: the lowest split, hence the lowest column, as `torch.argmax`),
merges the sums into the log-normaliser and reads the token's logit again for its log-prob. The
number of splits depends on V alone, so a row's result never depends on its batch. No host sync:
`step` is read on the device, so the launch replays in a CUDA graph while `step` advances.

Why: on the H100 the torch sampler costs ~0.8 ms of a 7 ms decode step at 64 x 151936 (about 15
whole-(B, V) int64 / fp32 passes). This reads the bf16 logits once (~20 MB at B = 64). Not yet
timed: ptxas (triton 3.6, sm_90) makes ~130 instructions per column, mostly the 64-bit hash and the
two logs, so at B = 64 the kernel is likely compute-bound at some 40-70 us rather than ~10 us of
bandwidth.

Same noise, same tokens: each step is rounded as the torch sampler rounds it on the same device.
z is `logits * fp32(1 / T)` on CUDA, where torch divides by a Python scalar by multiplying with its
fp32 reciprocal (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu), and a true division on the CPU.
No multiply-add is fused (`enable_fp_fusion=False`). log1p and log are libdevice's `__nv_log1pf`
and `__nv_logf`, the bitcode form of CUDA's `log1pf` / `logf` that torch's `::log1p` / `::log`
call, without flush-to-zero as nvcc compiles torch; both are written with explicit fma only, so
contraction settings cannot change them. On a GPU the noise is therefore meant to be bitwise
`sampling._gumbel` (the GPU tests check it). The interpreter (CPU tests) has no libdevice: there
log1p comes from numpy's float32 log, within a few ulps of torch's CPU log1p (measured: at most
4.8e-7 for |g| <= 1, 3.2e-7 relative above), so the CPU tests compare tokens away from near-ties.

Reference: `sample_tokens_fused_ref`, the torch sampler itself (`sampling.sample_tokens_torch`).
"""

from __future__ import annotations

import torch

from fastgrpo.kernels.lm_head_stats import LOG2E, _interpreting, triton

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def sample_tokens_fused_ref(logits, temperature: float, seeds, step):
    """(tokens (B,) int64, logp (B,) fp32) by the torch sampler with no top-k / top-p: the spec."""
    from fastgrpo.rollout.sampling import SamplingParams, sample_tokens_torch

    return sample_tokens_torch(logits, SamplingParams(temperature), seeds, step)


if triton is not None:
    # splitmix64 (Steele, Lea, Flood 2014) in uint64, which wraps and shifts logically
    _GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
    _MUL1 = tl.constexpr(0xBF58476D1CE4E5B9)
    _MUL2 = tl.constexpr(0x94D049BB133111EB)
    _R_SCALE = tl.constexpr(2.0**-63)  # 63 bits -> [0, 1]
    _R_MIN = tl.constexpr(2.0**-64)
    _R_MAX = tl.constexpr(1.0 - 2.0**-24)  # the largest fp32 below 1
    _LOG2E = tl.constexpr(LOG2E)

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
    def _row_stream(seeds_ptr, seed_stride, step_ptr, step_stride, row):
        """The row's splitmix64 state, as `sampling._gumbel` derives it from (seed, step)."""
        seed = tl.load(seeds_ptr + row * seed_stride).to(tl.uint64, bitcast=True)
        step = tl.load(step_ptr + row * step_stride).to(tl.uint64, bitcast=True)
        return _mix64(_mix64(seed + _GOLDEN) + step * _GOLDEN)

    @triton.jit
    def _log1p(x, LIBDEVICE: tl.constexpr):
        if LIBDEVICE:
            return libdevice.log1p(x)
        else:  # the interpreter: Goldberg's log1p from log, accurate to a few ulps
            u = 1.0 + x
            return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))

    @triton.jit
    def _log(x, LIBDEVICE: tl.constexpr):
        if LIBDEVICE:
            return libdevice.log(x)
        else:
            return tl.log(x)

    @triton.jit
    def _gumbel(state, LIBDEVICE: tl.constexpr):
        """Gumbel noise from the splitmix64 states `row + index * golden` (uint64), step by step
        as `sampling._gumbel`: the top 63 bits to fp32 (round to nearest), times 2^-63, clamped
        to [2^-64, 1 - 2^-24], then -log(-log1p(-r))."""
        bits = _mix64(state)
        r = (bits >> 1).to(tl.int64, bitcast=True).to(tl.float32) * _R_SCALE
        r = tl.minimum(tl.maximum(r, _R_MIN), _R_MAX)
        return -_log(-_log1p(-r, LIBDEVICE), LIBDEVICE)

    @triton.jit
    def _scaled(x, scale, GREEDY: tl.constexpr, DIVIDE: tl.constexpr):
        """z in fp32, rounded as the torch sampler rounds `logits.float() / T` on this device."""
        z = x.to(tl.float32)
        if GREEDY:
            return z
        elif DIVIDE:
            return z / scale  # scale = T
        else:
            return z * scale  # scale = fp32(1 / T)

    @triton.jit
    def _sample_splits_kernel(
        logits_ptr,  # (B, V), any strides
        seeds_ptr,  # (B,) int64
        step_ptr,  # (B,) or () int64
        best_ptr,  # (S, B) fp32: the split's best score z + g (z when greedy)
        col_ptr,  # (S, B) int32: its column
        max_ptr,  # (S, B) fp32: the split's max of z
        sum_ptr,  # (S, B) fp32: its sum of exp(z - max)
        B,
        V,
        stride_b,
        stride_v,
        seed_stride,
        step_stride,  # 0 for a scalar step
        scale,
        BLOCK_V: tl.constexpr,
        BLOCKS_PER_SPLIT: tl.constexpr,
        GREEDY: tl.constexpr,
        DIVIDE: tl.constexpr,
        LIBDEVICE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1).to(tl.int64)
        start = split * (BLOCK_V * BLOCKS_PER_SPLIT)
        stop = tl.minimum(start + BLOCK_V * BLOCKS_PER_SPLIT, V)
        offs = tl.arange(0, BLOCK_V)
        if not GREEDY:
            # index * golden = (lo + 1) * golden + offs * golden: one 64-bit multiply per block
            stream = _row_stream(seeds_ptr, seed_stride, step_ptr, step_stride, row)
            offs_golden = offs.to(tl.uint64) * _GOLDEN  # (BLOCK_V,)
        row_ptr = logits_ptr + row * stride_b
        best = tl.full([], float("-inf"), tl.float32)
        best_col = start  # kept when every score is -inf: the first column, as torch.argmax
        running_max = tl.full([], float("-inf"), tl.float32)
        running_sum = tl.zeros([], tl.float32)
        for lo in range(start, stop, BLOCK_V):
            cols = lo + offs  # (BLOCK_V,) int64
            ok = cols < stop
            x = tl.load(row_ptr + cols * stride_v, mask=ok, other=float("-inf"))
            z = _scaled(x, scale, GREEDY, DIVIDE)  # (BLOCK_V,) fp32
            if GREEDY:
                score = z
            else:
                state = stream + tl.cast(lo + 1, tl.uint64) * _GOLDEN + offs_golden
                score = z + _gumbel(state, LIBDEVICE)  # -inf past the split, as z
            top, at = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
            better = top > best  # strict: an earlier block keeps a tie
            best = tl.where(better, top, best)
            best_col = tl.where(better, lo + at, best_col)
            new_max = tl.maximum(running_max, tl.max(z, 0))
            base = tl.where(new_max == float("-inf"), 0.0, new_max)  # no -inf - -inf
            running_sum = running_sum * tl.exp2((running_max - base) * _LOG2E) + tl.sum(
                tl.exp2((z - base) * _LOG2E), 0
            )
            running_max = new_max
        out = split * B + row
        tl.store(best_ptr + out, best)
        tl.store(col_ptr + out, best_col.to(tl.int32))
        tl.store(max_ptr + out, running_max)
        tl.store(sum_ptr + out, running_sum)

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
        GREEDY: tl.constexpr,
        DIVIDE: tl.constexpr,
    ):
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
        total = tl.sum(split_sum * tl.exp2((split_max - base) * _LOG2E), 0)
        z = _scaled(tl.load(logits_ptr + row * stride_b + token * stride_v), scale, GREEDY, DIVIDE)
        tl.store(tokens_ptr + row, token)
        tl.store(logp_ptr + row, (z - base) - tl.log2(total) / _LOG2E)

    @triton.jit
    def _gumbel_kernel(
        seeds_ptr,
        step_ptr,
        noise_ptr,  # (B, V) fp32
        V,
        seed_stride,
        step_stride,
        BLOCK_V: tl.constexpr,
        LIBDEVICE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
        stream = _row_stream(seeds_ptr, seed_stride, step_ptr, step_stride, row)
        g = _gumbel(stream + (cols + 1).to(tl.uint64) * _GOLDEN, LIBDEVICE)
        tl.store(noise_ptr + row * V + cols, g, mask=cols < V)


def _blocks() -> tuple[int, int, int]:
    """(BLOCK_V, BLOCKS_PER_SPLIT, num_warps). In the interpreter, small blocks so that test
    vocabularies of ~1000 span several splits of several blocks. On a GPU (not yet tuned on the
    H100): splits of 4096 columns, 38 at V = 151936, so B * 38 programs (2432 at B = 64)."""
    if _interpreting():
        return 128, 2, 1
    return 1024, 4, 4


def _check_inputs(logits, temperature, seeds, step) -> None:
    if logits.dim() != 2 or logits.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"logits must be a (B, V) tensor of one of {KERNEL_DTYPES}, got "
            f"{logits.dtype} {tuple(logits.shape)}"
        )
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not isinstance(step, torch.Tensor):
        raise TypeError("step must be an int64 tensor (it lives on the device in a CUDA graph)")
    B, V = logits.shape
    if not 0 < V < 2**31:
        raise ValueError(f"the vocabulary must have 1 to 2^31 - 1 entries, got {V}")
    for name, t, shapes in (("seeds", seeds, [(B,)]), ("step", step, [(), (B,)])):
        if t.dtype != torch.int64 or tuple(t.shape) not in shapes or t.device != logits.device:
            raise ValueError(
                f"{name} must be an int64 tensor of shape {' or '.join(map(str, shapes))} on "
                f"{logits.device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
            )


def sample_tokens_fused(
    logits: torch.Tensor,  # (B, V) fp16 / bf16 / fp32, any strides
    temperature: float,  # 0 = greedy
    seeds: torch.Tensor,  # (B,) int64
    step: torch.Tensor,  # (B,) or () int64, read on the device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B,) int64, logp (B,) fp32) as `sample_tokens_fused_ref`, in two Triton launches.
    No host sync: safe to capture in a CUDA graph and replay with `step` changed in place."""
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
    divide = device.type != "cuda"  # torch's own rounding of z / T on this device (see top)
    t32 = torch.tensor(temperature, dtype=torch.float32)  # what torch takes from the Python scalar
    scale = 1.0 if greedy else t32.item() if divide else (1.0 / t32).item()  # fp32 1 / fp32 T
    block_v, blocks_per_split, warps = _blocks()
    splits = triton.cdiv(V, block_v * blocks_per_split)
    best, split_max, split_sum = torch.empty(3, splits, B, dtype=torch.float32, device=device)
    cols = torch.empty(splits, B, dtype=torch.int32, device=device)
    strides = (logits.stride(0), logits.stride(1))
    # rounded as torch's kernels round: no fused multiply-add, libdevice without flush-to-zero
    exact = dict(enable_fp_fusion=False, enable_reflect_ftz=False)
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
        DIVIDE=divide,
        LIBDEVICE=not _interpreting(),
        num_warps=warps,
        **exact,
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
        GREEDY=greedy,
        DIVIDE=divide,
        **exact,
    )
    return tokens, logp


def gumbel_noise(seeds: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:  # (B, V)
    """The kernel's Gumbel noise, written out, for tests against `sampling._gumbel` (no input
    checks: a test helper)."""
    if triton is None:
        raise RuntimeError("the fused Triton sampler needs `pip install triton`")
    B = seeds.shape[0]
    noise = torch.empty(B, vocab, dtype=torch.float32, device=seeds.device)
    block_v = _blocks()[0]
    _gumbel_kernel[(B, triton.cdiv(vocab, block_v))](
        seeds,
        step,
        noise,
        vocab,
        seeds.stride(0),
        step.stride(0) if step.dim() else 0,
        BLOCK_V=block_v,
        LIBDEVICE=not _interpreting(),
        enable_fp_fusion=False,
        enable_reflect_ftz=False,
    )
    return noise

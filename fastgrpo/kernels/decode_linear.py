"""The decode step's small linears at a few dozen rows, with the SwiGLU after gate/up in the same
kernel, for the rollout engine.

What:
- `linear(x, weight, bias, swiglu=False)`: x @ weight.T + bias for a decode batch; with
  `swiglu=True`, weight (2I, K) and bias are a packed gate/up projection (gate rows first) and the
  result is silu(gate) * up, (M, I);
- `norm_linear(x, residual, norm_weight, eps, weight, bias, swiglu=False)` returns
  (out, new_residual): the residual add + RMSNorm (the `rms_norm` kernel), then `linear`.
- `linear_to_residual(x, weight, bias)`: for a product whose only reader is the next residual
  add + RMSNorm (a layer's down_proj): with a long K, `linear_split_sums` gives fp32 parts over k
  ranges (`rms_norm.SplitSums`) that the norm kernel sums, a split-K GEMM with no reduction kernel.
Each uses a Triton kernel where it measured faster than cuBLAS (`takes`, `takes_split_sums`), else
F.linear (+ the `swiglu` kernel), so a caller may use them for any shape.

Why: at 64 rows each weight of a 0.5B layer is read in a few microseconds of mostly fixed cost.
On the H100 cuBLAS ran o_proj (896 x 896) as a split-K GEMM plus a reduction, 8.6 us for 1.6 MB
(benchmarks/results/profile_decode_step_h100_v3.txt), and SiLU * up was a 4.3 us kernel of its own.
Here each program owns a block of output columns for all rows and streams its slice of the weight
(and, for gate/up, the matching up slice), so no split-K, and the SiLU is the epilogue.
`benchmarks/tune_decode_linear.py` measured where it wins: 64 rows, weights of at most ~9M elements
with K <= 1024 (q/k/v, o_proj, gate/up of the 0.5B shape), and the 0.5B down_proj (K = 4864) as
split-K parts (8.5 us with the norm that reads it, against 10.7 for cuBLAS + norm); cuBLAS stays
faster at 256 rows and for every 7B linear.

Tried and left out (same script, H200): the residual add + RMSNorm in the linear's prologue was
2.6-3.2x slower than the norm kernel + linear (the row loads that feed elementwise work before the
dot are not pipelined like the weight's); programmatic dependent launch moved nothing beyond noise
while the kernels around these do not use it.

Numerics: fp32 accumulation; the bias added in fp32; the output rounded once to bf16, as a GEMM
with a bias epilogue rounds. With `swiglu`, gate and up are each rounded to bf16 as the GEMM would
return them, silu(gate) is rounded as F.silu rounds it, and the product once, so the result differs
from the model's ops only by the GEMM's summation order.

Reference: `linear_ref`, the model's own ops (F.linear, F.silu * up).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from fastgrpo.kernels import pdl
from fastgrpo.kernels.lm_head_stats import _interpreting, triton
from fastgrpo.kernels.rms_norm import SplitSums, add_rms_norm
from fastgrpo.kernels.rope import rope_write_kv_, rope_write_kv_ref
from fastgrpo.kernels.swiglu import silu_mul

if triton is not None:
    import triton.language as tl

    from fastgrpo.kernels.rms_norm import _rsqrt
    from fastgrpo.kernels.rope import _rotate
    from fastgrpo.kernels.swiglu import _exp  # libdevice's exp, numpy's in the interpreter

# FASTGRPO_DECODE_LINEAR=0 keeps every decode linear on cuBLAS (to compare)
ENABLED = os.environ.get("FASTGRPO_DECODE_LINEAR", "1") != "0"
KERNEL_DTYPES = (torch.bfloat16,)
MAX_ROWS = 64
"""The most rows the kernel takes. At 256 rows cuBLAS was faster for all but o_proj."""
MAX_WEIGHT_ELEMENTS = 9 * 2**20
"""The largest weight (packed gate/up counted whole) the kernel takes: the 0.5B gate/up (8.7M)
won, the 7B o_proj (12.8M) and larger lost to cuBLAS."""
MAX_K = 1024
"""The longest reduction the kernel takes in one range: with one program per column block, a
long K leaves too few programs streaming too much (the 0.5B down_proj, K = 4864, lost). Longer
ones go to `linear_split_sums` when their reader is a norm (SPLIT_SUMS)."""
# FASTGRPO_SPLIT_SUMS=0 keeps down_proj on cuBLAS (to compare)
SPLIT_SUMS = os.environ.get("FASTGRPO_SPLIT_SUMS", "1") != "0"


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, swiglu: bool = False
) -> torch.Tensor:
    """x (M, K) @ weight.T + bias, then silu(gate) * up with swiglu, by the model's PyTorch ops."""
    out = F.linear(x, weight, bias)
    if swiglu:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out


if triton is not None:

    @triton.jit
    def _accumulate(
        x_ptr,
        w_ptr,
        rows,  # (BM,) int64 rows of x
        cols,  # (BN,) int64 rows of w: any set of them, not only a contiguous block
        row_ok,
        col_ok,
        up_offset,  # with SWIGLU: rows between a gate row and its up row
        K,
        stride_x,
        stride_w,
        k_start,
        k_end,
        SWIGLU: tl.constexpr,
        EVEN_K: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        DOT_FP32: tl.constexpr,
        PDL: tl.constexpr,
        LINE: tl.constexpr,
        PREFETCH_LINES: tl.constexpr,
    ):
        """(acc, acc_up), fp32 (BM, BN): x[rows, k_start:k_end] @ w[cols, k_start:k_end].T, and
        with SWIGLU the same for w's rows cols + up_offset. With PDL the weight rows are prefetched
        into L2 (they are no earlier kernel's output) before waiting for the previous kernel."""
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        if PDL:
            line_k = tl.minimum(k_start + tl.arange(0, PREFETCH_LINES) * LINE, k_end - 1)
            w_rows = tl.where(col_ok, cols, 0)
            pdl.prefetch_l2(w_ptr + w_rows[:, None] * stride_w + line_k[None, :], PDL)
            if SWIGLU:
                up_rows = w_rows + up_offset
                pdl.prefetch_l2(w_ptr + up_rows[:, None] * stride_w + line_k[None, :], PDL)
        pdl.wait(PDL)
        for k0 in range(k_start, k_end, BK):
            ks = k0 + tl.arange(0, BK)
            if EVEN_K:
                a_ok = row_ok[:, None]
                w_ok = col_ok[:, None]
            else:
                a_ok = row_ok[:, None] & (ks < K)[None, :]
                w_ok = col_ok[:, None] & (ks < K)[None, :]
            a = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=a_ok, other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=w_ok, other=0.0)
            if DOT_FP32:  # the interpreter has no bf16 dot; fp32 copies are exact
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, tl.trans(w), acc)
            if SWIGLU:
                up_at = w_ptr + (cols + up_offset)[:, None] * stride_w + ks[None, :]
                w_up = tl.load(up_at, mask=w_ok, other=0.0)
                if DOT_FP32:
                    w_up = w_up.to(tl.float32)
                acc_up = tl.dot(a, tl.trans(w_up), acc_up)
        return acc, acc_up

    @triton.jit
    def _decode_linear_kernel(
        x_ptr,  # (M, K) rows at stride_x, unit stride on K
        w_ptr,  # (N, K) rows at stride_w (2N rows with SWIGLU: gate rows, then up rows)
        b_ptr,  # (N,) or (2N,) bias; unused without HAS_BIAS
        out_ptr,  # (M, N) contiguous
        M,
        N,
        K,
        stride_x,
        stride_w,
        k_per_split,  # with SPLIT_K: the k range of each program along axis 2 (a multiple of BK)
        HAS_BIAS: tl.constexpr,
        SPLIT_K: tl.constexpr,  # store fp32 parts (S, M, N), one per k range, not the sum
        SWIGLU: tl.constexpr,
        EVEN_K: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        DOT_FP32: tl.constexpr,
        PDL: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
        LINE: tl.constexpr,  # weight elements per 128-byte line
        PREFETCH_LINES: tl.constexpr,  # a power of two >= the lines of one row's k range
        ss_ptr=None,  # with NORM_ROWS: (P, M) fp32 parts of each row's sum of squares
        n_parts=0,
        inv_h=1.0,  # fp32(1 / H) of the norm
        eps=0.0,
        NORM_ROWS: tl.constexpr = False,  # x is r * w of a norm's rows r: scale rows by rstd
        PARTS_PAD: tl.constexpr = 1,  # a power of two >= n_parts
    ):
        pdl.start(PDL)
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        row_ok = rows < M
        col_ok = cols < N
        dtype = out_ptr.dtype.element_ty
        k_start = 0
        k_end = K
        if SPLIT_K:
            k_start = tl.program_id(2) * k_per_split
            k_end = tl.minimum(K, k_start + k_per_split)
        acc, acc_up = _accumulate(
            x_ptr,
            w_ptr,
            rows,
            cols,
            row_ok,
            col_ok,
            N,
            K,
            stride_x,
            stride_w,
            k_start,
            k_end,
            SWIGLU,
            EVEN_K,
            BM,
            BN,
            BK,
            DOT_FP32,
            PDL,
            LINE,
            PREFETCH_LINES,
        )
        if NORM_ROWS:  # RMSNorm(r) * w @ W.T = rstd * ((r * w) @ W.T), one rstd per row
            parts = tl.arange(0, PARTS_PAD)
            ss_at = ss_ptr + parts[:, None] * M + rows[None, :]  # (PARTS_PAD, BM), one load
            ss_ok = (parts < n_parts)[:, None] & row_ok[None, :]
            ss = tl.sum(tl.load(ss_at, mask=ss_ok, other=0.0), axis=0)
            rstd = _rsqrt(ss * inv_h + eps, LIBDEVICE)[:, None]
            acc = acc * rstd
            acc_up = acc_up * rstd
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:
                acc_up += tl.load(b_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            gate = acc.to(dtype).to(tl.float32)
            up = acc_up.to(dtype).to(tl.float32)
            silu = tl.math.div_rn(gate, 1.0 + _exp(-gate, LIBDEVICE)).to(dtype).to(tl.float32)
            acc = silu * up
        out_at = out_ptr + rows[:, None] * N + cols[None, :]
        if SPLIT_K:
            out_at += tl.program_id(2).to(tl.int64) * M * N
        tl.store(out_at, acc.to(dtype), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _linear_residual_kernel(
        x_ptr,  # (M, K) rows at stride_x, unit stride on K
        w_ptr,  # (N, K) rows at stride_w
        b_ptr,  # (N,) bias; unused without HAS_BIAS
        res_ptr,  # (M, N) the residual stream, rows at stride_res
        norm_w_ptr,  # (N,) the next RMSNorm's weight
        new_res_ptr,  # (M, N) contiguous: the residual after the add
        scaled_ptr,  # (M, N) contiguous: new residual * norm weight
        ss_ptr,  # (N / BN, M) fp32: each program's part of each row's sum of squares
        M,
        N,
        K,
        stride_x,
        stride_w,
        stride_res,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        DOT_FP32: tl.constexpr,
        PDL: tl.constexpr,
        LINE: tl.constexpr,
        PREFETCH_LINES: tl.constexpr,
    ):
        """A linear whose output is added to the residual stream and then RMS-normed (a layer's
        o_proj): r = x @ W.T + b + residual, rounded as the model rounds the GEMM and the add; it
        stores r, r * norm weight, and per row its columns' part of sum(r^2). The norm's rstd is
        applied by the next linear (NORM_ROWS), so the norm needs no kernel of its own."""
        pdl.start(PDL)
        pid_n = tl.program_id(0)
        rows = (tl.program_id(1) * BM + tl.arange(0, BM)).to(tl.int64)
        cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        row_ok = rows < M
        col_ok = cols < N
        acc, _ = _accumulate(
            x_ptr,
            w_ptr,
            rows,
            cols,
            row_ok,
            col_ok,
            0,
            K,
            stride_x,
            stride_w,
            0,
            K,
            False,
            EVEN_K,
            BM,
            BN,
            BK,
            DOT_FP32,
            PDL,
            LINE,
            PREFETCH_LINES,
        )
        dtype = new_res_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        ok = row_ok[:, None] & col_ok[None, :]
        y = acc.to(dtype).to(tl.float32)  # the GEMM's output
        res = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=ok, other=0.0)
        r = (y + res.to(tl.float32)).to(dtype)  # the model's x + attn_out
        at = rows[:, None] * N + cols[None, :]
        tl.store(new_res_ptr + at, r, mask=ok)
        norm_w = tl.load(norm_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        r32 = r.to(tl.float32)
        tl.store(scaled_ptr + at, (r32 * norm_w[None, :]).to(dtype), mask=ok)
        tl.store(ss_ptr + pid_n * M + rows, tl.sum(r32 * r32, axis=1), mask=row_ok)

    @triton.jit
    def _qkv_rope_kernel(
        x_ptr,  # (M, K) rows at stride_x, unit stride on K
        w_ptr,  # (NQ * D + 2 * NKV * D, K) packed q/k/v weight, rows at stride_w
        b_ptr,  # its bias; unused without HAS_BIAS
        cos_ptr,
        sin_ptr,  # (M, D) this step's tables, rows at stride_cos and stride_sin
        q_ptr,  # (M, NQ * D) contiguous: the rotated queries
        ck_ptr,
        cv_ptr,  # (M, Tc, NKV * D) contiguous completion caches
        slot_ptr,  # () int64: the cache slot this step writes
        M,
        K,
        stride_x,
        stride_w,
        stride_cos,
        stride_sin,
        Tc,
        NQ: tl.constexpr,
        NKV: tl.constexpr,
        D: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        DOT_FP32: tl.constexpr,
        PDL: tl.constexpr,
        LINE: tl.constexpr,
        PREFETCH_LINES: tl.constexpr,
    ):
        """q/k/v of a decode step with RoPE and the KV-cache write in the epilogue. Program n owns
        BN of the packed output's columns. In the q and k parts these are BN / 2 rotation pairs of
        one head, column p and its partner p + D / 2, interleaved so that the accumulator splits
        into the two halves; in the v part, BN consecutive columns. Rotated q goes to q_ptr,
        rotated k and v to slot `slot` of the caches."""
        pdl.start(PDL)
        HALF: tl.constexpr = D // 2
        QCOLS: tl.constexpr = NQ * D
        KCOLS: tl.constexpr = NKV * D
        first = tl.program_id(0) * BN  # the first column in the packed layout
        rows = (tl.program_id(1) * BM + tl.arange(0, BM)).to(tl.int64)
        row_ok = rows < M
        idx = tl.arange(0, BN)
        rotated = first < QCOLS + KCOLS
        pair = first // D * D + (first % D) // 2 + idx // 2  # the lower half's column
        cols = tl.where(rotated, pair + (idx % 2) * HALF, first + idx).to(tl.int64)
        col_ok = cols < QCOLS + 2 * KCOLS
        acc, _ = _accumulate(
            x_ptr,
            w_ptr,
            rows,
            cols,
            row_ok,
            col_ok,
            0,
            K,
            stride_x,
            stride_w,
            0,
            K,
            False,
            EVEN_K,
            BM,
            BN,
            BK,
            DOT_FP32,
            PDL,
            LINE,
            PREFETCH_LINES,
        )
        dtype = q_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = acc.to(dtype)  # rounded as the GEMM's output is
        slot = tl.load(slot_ptr)
        cache_row = rows[:, None] * (Tc * KCOLS) + slot * KCOLS  # (BM, 1) offsets of (row, slot)
        if rotated:
            x1, x2 = tl.split(tl.reshape(out, (BM, BN // 2, 2)))  # columns p and p + D / 2
            lo = (first // D * D + (first % D) // 2 + tl.arange(0, BN // 2)).to(tl.int64)
            d = lo % D  # < D / 2: the position inside the head
            ok = row_ok[:, None]
            c_at = cos_ptr + rows[:, None] * stride_cos + d[None, :]
            s_at = sin_ptr + rows[:, None] * stride_sin + d[None, :]
            c1 = tl.load(c_at, mask=ok, other=0.0).to(tl.float32)
            c2 = tl.load(c_at + HALF, mask=ok, other=0.0).to(tl.float32)
            s1 = tl.load(s_at, mask=ok, other=0.0).to(tl.float32)
            s2 = tl.load(s_at + HALF, mask=ok, other=0.0).to(tl.float32)
            y1, y2 = _rotate(x1, x2, c1, c2, s1, s2)
            if first < QCOLS:
                at = q_ptr + rows[:, None] * QCOLS + lo[None, :]
            else:
                at = ck_ptr + cache_row + (lo - QCOLS)[None, :]
            tl.store(at, y1.to(dtype), mask=ok)
            tl.store(at + HALF, y2.to(dtype), mask=ok)
        else:
            # a name of its own: the GPU compiler wants a variable to keep one type across branches
            v_at = cv_ptr + cache_row + (cols - QCOLS - KCOLS)[None, :]
            tl.store(v_at, out, mask=row_ok[:, None] & col_ok[None, :])


def pick_config(M: int, N: int, K: int, swiglu: bool) -> dict:
    """Block sizes measured best on the 0.5B shapes at 64 rows (tune_decode_linear.py): 16
    output columns per program with 128-wide k steps for q/k/v and o_proj, 32 columns with 64-wide
    steps for gate/up (two weight tiles per step), 5 pipeline stages; 16 or 32 rows per program
    when there are that few."""
    bm = _rows_per_block(M)
    bn, bk = (32, 64) if swiglu else (16, 128)
    bk = min(bk, max(16, triton.next_power_of_2(K)))
    return dict(BM=bm, BN=bn, BK=bk, num_warps=4, num_stages=5)


def _rows_per_block(M: int) -> int:
    return 16 if M <= 16 else 32 if M <= 32 else 64


def _decode_batch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """bf16 on CUDA, unit last strides, at most MAX_ROWS rows and a weight of at most
    MAX_WEIGHT_ELEMENTS: the products where a kernel of this module can beat cuBLAS."""
    given = [x, weight] if bias is None else [x, weight, bias]
    return (
        ENABLED
        and triton is not None
        and x.is_cuda
        and x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and weight.numel() <= MAX_WEIGHT_ELEMENTS
        and all(t.dtype in KERNEL_DTYPES and t.stride(-1) == 1 for t in given)
    )


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel runs this product: a decode batch (`_decode_batch`) with K <= MAX_K."""
    return _decode_batch(x, weight, bias) and weight.shape[1] <= MAX_K


def _check(x, weight, bias, swiglu) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"x (M, K) and weight (N, K) expected, got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"a packed gate/up weight needs an even row count, got {weight.shape[0]}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    given = [x, weight] if bias is None else [x, weight, bias]
    if any(t.dtype not in KERNEL_DTYPES for t in given):
        raise ValueError(f"the kernel takes {KERNEL_DTYPES}, got {[t.dtype for t in given]}")
    if any(t.device != x.device for t in given):
        raise ValueError("x, weight and bias must live on one device")
    if any(t.stride(-1) != 1 for t in given):
        raise ValueError("x, weight and bias need unit stride on their last dim")


def linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    swiglu: bool = False,
    config: dict | None = None,
) -> torch.Tensor:
    """As `linear_ref`, by one Triton launch: any row count and shape (`takes` says where it is
    the faster choice). No host sync, so it can be captured in a CUDA graph. `config` overrides
    `pick_config` (BM, BN, BK, num_warps, num_stages; for tuning)."""
    if triton is None:
        raise RuntimeError("the Triton decode linear needs `pip install triton`")
    _check(x, weight, bias, swiglu)
    M, K = x.shape
    N = weight.shape[0] // 2 if swiglu else weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    cfg = dict(pick_config(M, N, K, swiglu), **(config or {}))
    _launch(x, weight, bias, out, N, swiglu, 0, 1, cfg)
    return out


def _launch(x, weight, bias, out, N, swiglu, k_per_split, splits, cfg, norm=None) -> None:
    """The kernel over (N / BN, M / BM, splits) programs, cfg as `pick_config` gives it;
    k_per_split 0: one k range, the sum stored in out. norm: (ss parts (P, M), H, eps) when x is
    a norm's rows times its weight (`linear_norm_linear`)."""
    M, K = x.shape
    cfg = dict(cfg)
    bm = cfg.pop("BM")
    grid = (triton.cdiv(N, cfg["BN"]), triton.cdiv(M, bm), splits)
    line = 128 // weight.element_size()
    k_range = k_per_split if k_per_split > 0 else K
    _decode_linear_kernel[grid](
        x,
        weight,
        weight if bias is None else bias,
        out,
        M,
        N,
        K,
        x.stride(0),
        weight.stride(0),
        k_per_split,
        HAS_BIAS=bias is not None,
        SPLIT_K=k_per_split > 0,
        SWIGLU=swiglu,
        EVEN_K=K % cfg["BK"] == 0,
        BM=bm,
        LIBDEVICE=not _interpreting(),
        DOT_FP32=_interpreting(),
        LINE=line,
        PREFETCH_LINES=triton.next_power_of_2(triton.cdiv(k_range, line)),
        enable_fp_fusion=False,
        **_norm_rows_args(norm),
        **cfg,
        **pdl.launch_options(),
    )


def _norm_rows_args(norm) -> dict:
    if norm is None:
        return {}
    ss, H, eps = norm
    parts = ss.shape[0]
    return dict(
        ss_ptr=ss,
        n_parts=parts,
        inv_h=1.0 / H,
        eps=eps,
        NORM_ROWS=True,
        PARTS_PAD=triton.next_power_of_2(parts),
    )


def split_k_config(M: int, N: int, K: int) -> dict:
    """Blocks for `linear_split_sums`, the best of a sweep on the H100 for the 0.5B down_proj at
    64 rows (tune_decode_linear.py): 64 output columns per program, k ranges of 1024 (8 steps of
    128; more when there would be over 8 ranges), 5 stages."""
    bm = _rows_per_block(M)
    steps = -(-K // 128)
    return dict(
        BM=bm, BN=64, BK=128, num_warps=4, num_stages=5, k_per_split=max(8, -(-steps // 8)) * 128
    )


def linear_split_sums(
    x: torch.Tensor, weight: torch.Tensor, config: dict | None = None
) -> SplitSums:
    """x @ weight.T as fp32 parts over ranges of K (`SplitSums`), for a long-K product at a few
    rows (the down_proj of a decode step), whose parts the next `add_rms_norm` adds up: the
    split-K GEMM without a reduction kernel of its own. No host sync."""
    if triton is None:
        raise RuntimeError("the Triton decode linear needs `pip install triton`")
    _check(x, weight, None, False)
    M, K = x.shape
    N = weight.shape[0]
    cfg = dict(split_k_config(M, N, K), **(config or {}))
    k_per_split = cfg.pop("k_per_split")
    if k_per_split % cfg["BK"]:
        raise ValueError(f"k_per_split {k_per_split} must be a multiple of BK {cfg['BK']}")
    splits = max(1, triton.cdiv(K, k_per_split))
    partials = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    if M and N:
        _launch(x, weight, None, partials, N, False, k_per_split, splits, cfg)
    return SplitSums(partials, x.dtype)


def takes_split_sums(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a product goes to `linear_split_sums`: as `takes`, but for the long reductions that
    `takes` leaves to cuBLAS (K > MAX_K), without a bias."""
    return (
        SPLIT_SUMS and bias is None and _decode_batch(x, weight, None) and weight.shape[1] > MAX_K
    )


def linear_to_residual(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | SplitSums:
    """A product whose only reader is the next `add_rms_norm` (a layer's down_proj): split-K
    parts where `takes_split_sums`, else `linear`."""
    if takes_split_sums(x, weight, bias):
        return linear_split_sums(x, weight)
    return linear(x, weight, bias)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, swiglu: bool = False
) -> torch.Tensor:
    """x @ weight.T + bias (then silu(gate) * up with swiglu): the kernel where `takes`, else
    cuBLAS (+ the SiLU * up kernel on CUDA)."""
    if takes(x, weight, bias):
        return linear_triton(x, weight, bias, swiglu)
    out = F.linear(x, weight, bias)
    if swiglu:
        gate, up = out.chunk(2, dim=-1)
        out = silu_mul(gate, up)
    return out


def qkv_rope_write_ref(x, weight, bias, cos, sin, comp_k, comp_v, slot, num_heads, num_kv_heads):
    """A decode step's q/k/v projection, RoPE and KV-cache write by the model's ops: x (M, K),
    weight (nh * D + 2 * nkv * D, K) packed q/k/v, cos/sin (M, D), caches (M, Tc, nkv, D), slot
    () int64. Returns the rotated q (M, nh, D); rotated k and v go to the caches at `slot`."""
    M, D = x.shape[0], comp_k.shape[-1]
    q, k, v = linear_ref(x, weight, bias).split(
        [num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1
    )
    q, k, v = q.reshape(M, num_heads, D), k.reshape(M, num_kv_heads, D), v.reshape(M, -1, D)
    rope_write_kv_ref(q, k, v, cos, sin, comp_k, comp_v, slot)
    return q


def takes_qkv_rope(x, weight, bias, cos, comp_k, comp_v) -> bool:
    """Whether `qkv_rope_write` runs the fused kernel: a decode batch that `takes` runs, a head
    dim that the kernel's column blocks tile (pairs of one head per block), contiguous caches of
    x's dtype and tables with unit stride on the head dim."""
    D = comp_k.shape[-1]
    bn = pick_config(x.shape[0], weight.shape[0], x.shape[1], False)["BN"] if triton else 0
    return (
        takes(x, weight, bias)
        and bn > 0
        and D % bn == 0
        and all(c.is_contiguous() and c.dtype == x.dtype for c in (comp_k, comp_v))
        and cos.stride(-1) == 1
    )


def qkv_rope_write_triton(x, weight, bias, cos, sin, comp_k, comp_v, slot, num_heads, num_kv_heads):
    """As `qkv_rope_write_ref`, by one Triton launch (`_qkv_rope_kernel`); no host sync."""
    if triton is None:
        raise RuntimeError("the Triton decode linear needs `pip install triton`")
    _check(x, weight, bias, False)
    M, K = x.shape
    B, Tc, nkv, D = comp_k.shape
    if (
        nkv != num_kv_heads
        or B != M
        or comp_v.shape != comp_k.shape
        or weight.shape[0] != (num_heads + 2 * nkv) * D
        or cos.shape != (M, D)
        or sin.shape != (M, D)
    ):
        raise ValueError(
            f"q/k/v + RoPE + cache write needs x (M, K), a packed weight ((nh + 2 nkv) D, K), "
            f"tables (M, D) and caches (M, Tc, nkv, D); got x {tuple(x.shape)}, weight "
            f"{tuple(weight.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}, caches "
            f"{tuple(comp_k.shape)} / {tuple(comp_v.shape)} for {num_heads} q heads"
        )
    cfg = pick_config(M, weight.shape[0], K, False)
    if D % cfg["BN"] or not comp_k.is_contiguous() or not comp_v.is_contiguous():
        raise ValueError(f"head dim {D} must be a multiple of {cfg['BN']}; contiguous caches")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("cos and sin need unit stride on the head dim")
    q = torch.empty(M, num_heads, D, dtype=x.dtype, device=x.device)
    if M == 0:
        return q
    if _interpreting() and x.dtype == torch.bfloat16:  # numpy has no bf16 for the tables
        cos, sin = cos.float(), sin.float()
    bm = cfg.pop("BM")
    line = 128 // weight.element_size()
    _qkv_rope_kernel[(triton.cdiv(weight.shape[0], cfg["BN"]), triton.cdiv(M, bm))](
        x,
        weight,
        weight if bias is None else bias,
        cos,
        sin,
        q,
        comp_k,
        comp_v,
        slot,
        M,
        K,
        x.stride(0),
        weight.stride(0),
        cos.stride(0),
        sin.stride(0),
        Tc,
        NQ=num_heads,
        NKV=nkv,
        D=D,
        HAS_BIAS=bias is not None,
        EVEN_K=K % cfg["BK"] == 0,
        BM=bm,
        DOT_FP32=_interpreting(),
        LINE=line,
        PREFETCH_LINES=triton.next_power_of_2(triton.cdiv(K, line)),
        enable_fp_fusion=False,
        **cfg,
        **pdl.launch_options(),
    )
    return q


def qkv_rope_write(x, weight, bias, cos, sin, comp_k, comp_v, slot, num_heads, num_kv_heads):
    """`qkv_rope_write_ref` by one kernel where `takes_qkv_rope`, else `linear` and then RoPE and
    the cache write in one more kernel (`rope_write_kv_`, which falls back to the reference)."""
    if takes_qkv_rope(x, weight, bias, cos, comp_k, comp_v):
        return qkv_rope_write_triton(
            x, weight, bias, cos, sin, comp_k, comp_v, slot, num_heads, num_kv_heads
        )
    M, D = x.shape[0], comp_k.shape[-1]
    q, k, v = linear(x, weight, bias).split(
        [num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1
    )
    q, k, v = q.view(M, num_heads, D), k.view(M, num_kv_heads, D), v.view(M, -1, D)
    rope_write_kv_(q, k, v, cos, sin, comp_k, comp_v, slot)
    return q


def takes_norm_between(x, weight, bias, residual, norm_weight, weight2, bias2) -> bool:
    """Whether `linear_norm_linear` runs its two kernels: both products are ones `takes` runs,
    and the residual and norm weight are x's dtype with unit last strides."""
    M, N = x.shape[0], weight.shape[0]
    return (
        takes(x, weight, bias)
        and takes(residual, weight2, bias2)
        and residual.shape == (M, N)
        and norm_weight.shape == (N,)
        and norm_weight.dtype == residual.dtype == x.dtype
        and norm_weight.is_contiguous()
    )


def linear_norm_linear_triton(
    x, weight, bias, residual, norm_weight, eps, weight2, bias2, swiglu=False
):
    """`norm_linear(linear(x, weight, bias), residual, norm_weight, eps, weight2, bias2, swiglu)`
    in two launches instead of three: the first linear adds the residual and stores r, r * norm
    weight and per-block parts of sum(r^2) (`_linear_residual_kernel`); the second multiplies
    each row of its fp32 sums by rstd before its bias (RMSNorm(r) * w @ W2.T = rstd * ((r * w) @
    W2.T)). Returns (out, new residual). The new residual is bitwise the model's; out rounds r * w
    once where the norm rounds r * rstd and then its product with w, so it differs from
    `norm_linear`'s by bf16 roundings, not more. No host sync."""
    if triton is None:
        raise RuntimeError("the Triton decode linear needs `pip install triton`")
    _check(x, weight, bias, False)
    M, K = x.shape
    N = weight.shape[0]
    if residual.shape != (M, N) or norm_weight.shape != (N,):
        raise ValueError(
            f"residual ({M}, {N}) and norm weight ({N},) expected for x {tuple(x.shape)} and "
            f"weight {tuple(weight.shape)}; got {tuple(residual.shape)}, "
            f"{tuple(norm_weight.shape)}"
        )
    if residual.dtype != x.dtype or norm_weight.dtype != x.dtype:
        raise ValueError(
            f"residual and norm weight must be x's {x.dtype}; got {residual.dtype}, "
            f"{norm_weight.dtype}"
        )
    if residual.stride(-1) != 1:
        raise ValueError("the residual needs unit stride on its last dim")
    new_residual = torch.empty(M, N, dtype=x.dtype, device=x.device)
    scaled = torch.empty_like(new_residual)
    _check(scaled, weight2, bias2, swiglu)
    N2 = weight2.shape[0] // 2 if swiglu else weight2.shape[0]
    out = torch.empty(M, N2, dtype=x.dtype, device=x.device)
    if M == 0:
        return out, new_residual
    cfg = pick_config(M, N, K, False)
    bm = cfg.pop("BM")
    parts = triton.cdiv(N, cfg["BN"])
    ss = torch.empty(parts, M, dtype=torch.float32, device=x.device)
    line = 128 // weight.element_size()
    _linear_residual_kernel[(parts, triton.cdiv(M, bm))](
        x,
        weight,
        weight if bias is None else bias,
        residual,
        norm_weight.contiguous(),
        new_residual,
        scaled,
        ss,
        M,
        N,
        K,
        x.stride(0),
        weight.stride(0),
        residual.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=K % cfg["BK"] == 0,
        BM=bm,
        DOT_FP32=_interpreting(),
        LINE=line,
        PREFETCH_LINES=triton.next_power_of_2(triton.cdiv(K, line)),
        enable_fp_fusion=False,
        **cfg,
        **pdl.launch_options(),
    )
    cfg2 = pick_config(M, N2, N, swiglu)
    _launch(scaled, weight2, bias2, out, N2, swiglu, 0, 1, cfg2, norm=(ss, N, eps))
    return out, new_residual


def linear_norm_linear(x, weight, bias, residual, norm_weight, eps, weight2, bias2, swiglu=False):
    """(linear(RMSNorm(x @ weight.T + bias + residual) * norm_weight, weight2, bias2, swiglu),
    new residual): a layer's o_proj, residual add, norm and gate/up. Two kernels where
    `takes_norm_between`, else `linear` and `norm_linear` (three)."""
    if takes_norm_between(x, weight, bias, residual, norm_weight, weight2, bias2):
        return linear_norm_linear_triton(
            x, weight, bias, residual, norm_weight, eps, weight2, bias2, swiglu
        )
    return norm_linear(linear(x, weight, bias), residual, norm_weight, eps, weight2, bias2, swiglu)


def norm_linear(x, residual, norm_weight, eps, weight, bias, swiglu: bool = False):
    """(linear(RMSNorm(x + residual) * norm_weight), x + residual): the `rms_norm` kernel on
    CUDA, then `linear`."""
    h, new_residual = add_rms_norm(x, residual, norm_weight, eps)
    return linear(h, weight, bias, swiglu), new_residual

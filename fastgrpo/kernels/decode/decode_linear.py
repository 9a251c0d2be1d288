"""The decode step's small linears at a few dozen rows, with the SwiGLU after gate/up in the same
kernel, for the rollout engine.

What:
- `linear(x, weight, bias, swiglu=False)`: x @ weight.T + bias for a decode batch; with
  `swiglu=True`, weight (2I, K) and bias are a packed gate/up projection (gate rows first) and the
  result is silu(gate) * up, (M, I);
- `norm_linear(x, residual, norm_weight, eps, weight, bias, swiglu=False)` returns
  (out, new_residual): the residual add + RMSNorm (the `rms_norm` kernel), then `linear`.
- `linear_to_residual(x, weight, bias)`: for a product whose only reader is the next residual
  add + RMSNorm (a layer's o_proj and down_proj): `linear_split_sums` gives fp32 parts over k
  ranges (`rms_norm.SplitSums`) that the norm kernel sums, a split-K GEMM with no reduction kernel.
Each uses a Triton kernel where it measured faster than cuBLAS (`takes`, `takes_split_sums`), else
F.linear (+ the `swiglu` kernel), so a caller may use them for any shape. On Hopper GPUs the
gate/up product goes to the Gluon kernel of `decode_linear_gluon` where it applies.

Why: at 64 rows each weight of a 0.5B layer is read in a few microseconds of mostly fixed cost.
On the H100 cuBLAS ran o_proj (896 x 896) as a split-K GEMM plus a reduction, 8.6 us for 1.6 MB
(benchmarks/results/profile_decode_step_h100_v3.txt), and SiLU * up was a 4.3 us kernel of its own.
Here each program owns a block of output columns for all rows and streams its slice of the weight
(and, for gate/up, the matching up slice), so no split-K, and the SiLU is the epilogue. Both
operands arrive by bulk tensor copies (TMA), which zero-fill past the edges, so the loop has no
masks: alone 0.5-1.3 us faster per linear than cp.async pointer loads with bitwise the same
results, neutral in the whole decode step (benchmarks/results/tune_decode_linear_tma_h100_v1.txt).
`benchmarks/lab/tune_decode_linear.py` measured where it wins: 64 rows, weights of at most ~9M elements
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

import torch
import torch.nn.functional as F

from fastgrpo import switches
from fastgrpo.kernels.decode import decode_linear_gluon, pdl
from fastgrpo.kernels.decode.decode_attention import ProjectedParts
from fastgrpo.kernels.layers.rms_norm import SplitSums, add_rms_norm
from fastgrpo.kernels.layers.swiglu import silu_mul
from fastgrpo.kernels.support import (
    TensorDescriptor,
    interpreting,
    kernel_dtype,
    tma_readable,
    tma_ready,
    triton,
)

if triton is not None:
    import triton.language as tl

    from fastgrpo.kernels.layers.swiglu import (
        exp_libdevice,  # libdevice's exp, numpy's in the interpreter
    )

# FASTGRPO_DECODE_KERNELS=0 keeps every decode linear on cuBLAS
ENABLED = switches.DECODE_KERNELS
KERNEL_DTYPES = (torch.bfloat16,)
MAX_ROWS = 64
"""The most rows the kernel takes. At 256 rows cuBLAS was faster for all but o_proj. Past 64 rows
(two 64-row blocks) the replayed 0.5B decode step was 57 and 31 us slower with the kernel at 72
and 96 rows, 32-35 us faster at 128 (benchmarks/results/decode_rows_h100_v1.txt): not taken."""
MAX_WEIGHT_ELEMENTS = 9 * 2**20
"""The largest weight (packed gate/up counted whole) the kernel takes: the 0.5B gate/up (8.7M)
won, the 7B o_proj (12.8M) and larger lost to cuBLAS."""
MAX_K = 1024
"""The longest reduction the kernel takes in one range: with one program per column block, a
long K leaves too few programs streaming too much (the 0.5B down_proj, K = 4864, lost). Longer
ones go to `linear_split_sums` when their reader is a norm."""
SHORT_K_RANGE = 384
"""The k range of a split-K product with K <= MAX_K whose reader is a norm (a layer's o_proj);
0 runs those whole, in `linear`. At the 0.5B o_proj (K = 896: ranges of 384, 384 and 128, 42
programs) the decode step took 20-27 us less than with o_proj whole; 256, 512 and 640 did less
well, 128 worse than whole (benchmarks/results/decode_step_ab_h100_v1.txt, sections 11-12)."""

QKV_K_RANGE = 384
"""The k range of the q/k/v product's split-K parts where the decode attention adds them up as it
loads q, k and v (`linear_to_attention`); 0 runs q/k/v whole. At the 0.5B shape (K = 896: ranges
of 384, 384 and 128) with QKV_BLOCK_N output columns per program: 108 programs of at most 3 k
steps instead of 72 of 7."""
QKV_BLOCK_N = 32


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
    def _decode_linear_kernel(
        x_desc,  # (M, K), block [BM, BK]
        w_desc,  # (N, K) (2N rows with SWIGLU: gate rows, then up rows), block [BN, BK]
        w_ptr,  # the same weight, rows at stride_w: its L2 prefetch before the PDL wait
        b_ptr,  # (N,) or (2N,) bias; unused without HAS_BIAS
        out_ptr,  # (M, N) contiguous
        M,
        N,
        K,
        stride_w,
        k_per_split,  # with SPLIT_K: the k range of each program along axis 2 (a multiple of BK)
        HAS_BIAS: tl.constexpr,
        SPLIT_K: tl.constexpr,  # store fp32 parts (S, M, N), one per k range, not the sum
        SWIGLU: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        DOT_FP32: tl.constexpr,
        PDL: tl.constexpr,  # programmatic dependent launch (kernels.pdl)
        LINE: tl.constexpr,  # weight elements per 128-byte line
        PREFETCH_LINES: tl.constexpr,  # a power of two >= the lines of one row's k range
    ):
        pdl.start(PDL)
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        row_ok = rows < M
        col_ok = cols < N
        dtype = out_ptr.dtype.element_ty
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        k_start = 0
        k_end = K
        if SPLIT_K:
            k_start = tl.program_id(2) * k_per_split
            k_end = tl.minimum(K, k_start + k_per_split)
        if PDL:  # the weight is no earlier kernel's output: fetch it while that kernel finishes
            line_k = tl.minimum(k_start + tl.arange(0, PREFETCH_LINES) * LINE, k_end - 1)
            w_rows = tl.minimum(cols, N - 1)
            pdl.prefetch_l2(w_ptr + w_rows[:, None] * stride_w + line_k[None, :], PDL)
            if SWIGLU:
                pdl.prefetch_l2(w_ptr + (w_rows + N)[:, None] * stride_w + line_k[None, :], PDL)
        pdl.wait(PDL)
        # bulk tensor copies (TMA): rows past M or N and columns past K arrive as zeros, so no
        # masks; a gate tile's columns past N read up rows, which the store below drops
        for k0 in range(k_start, k_end, BK):
            a = x_desc.load([pid_m * BM, k0])
            w = w_desc.load([pid_n * BN, k0])
            if DOT_FP32:  # the interpreter has no bf16 dot; fp32 copies are exact
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, tl.trans(w), acc)
            if SWIGLU:
                w_up = w_desc.load([N + pid_n * BN, k0])
                if DOT_FP32:
                    w_up = w_up.to(tl.float32)
                acc_up = tl.dot(a, tl.trans(w_up), acc_up)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:
                acc_up += tl.load(b_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            gate = acc.to(dtype).to(tl.float32)
            up = acc_up.to(dtype).to(tl.float32)
            silu = (
                tl.math.div_rn(gate, 1.0 + exp_libdevice(-gate, LIBDEVICE)).to(dtype).to(tl.float32)
            )
            acc = silu * up
        out_at = out_ptr + rows[:, None] * N + cols[None, :]
        if SPLIT_K:
            out_at += tl.program_id(2).to(tl.int64) * M * N
        tl.store(out_at, acc.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def pick_config(M: int, N: int, K: int, swiglu: bool) -> dict:
    """Block sizes measured best on the 0.5B shapes at 64 rows with the bulk tensor copies
    (benchmarks/results/tune_decode_linear_tma_h100_v1.txt): 128-wide k steps; 16 output columns
    per program with 6 pipeline stages for q/k/v and o_proj; 32 with 3 stages for gate/up (two
    weight tiles per step), which reads the rows half as often: 11.30 against 11.65 us with its
    norm, and -14 us per decode step over 24 paired rounds in one process, 17 of them faster
    (benchmarks/results/decode_step_checks_h100_v1.txt); 16 or 32 rows per program when there
    are that few."""
    bm = _rows_per_block(M)
    bk = min(128, max(16, triton.next_power_of_2(K)))
    if swiglu:
        return dict(BM=bm, BN=32, BK=bk, num_warps=4, num_stages=3)
    return dict(BM=bm, BN=16, BK=bk, num_warps=4, num_stages=6)


def _rows_per_block(M: int) -> int:
    return 16 if M <= 16 else 32 if M <= 32 else 64


def _decode_batch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """bf16 on CUDA, unit last strides, at most MAX_ROWS rows and a weight of at most
    MAX_WEIGHT_ELEMENTS with 16-byte aligned rows (a bulk tensor copy reads it where it is): the
    products where a kernel of this module can beat cuBLAS."""
    given = [x, weight] if bias is None else [x, weight, bias]
    return (
        ENABLED
        and triton is not None
        and x.is_cuda
        and x.dim() == 2
        and weight.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and weight.numel() <= MAX_WEIGHT_ELEMENTS
        and all(t.dtype == x.dtype and t.stride(-1) == 1 for t in given)
        and tma_readable(weight)  # read in place: the engine's weights are the trainer's
        and kernel_dtype("decode_linear", x.dtype, KERNEL_DTYPES)
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


def _launch(x, weight, bias, out, N, swiglu, k_per_split, splits, cfg) -> None:
    """The kernel over (N / BN, M / BM, splits) programs, cfg as `pick_config` gives it;
    k_per_split 0: one k range, the sum stored in out."""
    M, K = x.shape
    cfg = dict(cfg)
    bm = cfg.pop("BM")
    grid = (triton.cdiv(N, cfg["BN"]), triton.cdiv(M, bm), splits)
    line = 128 // weight.element_size()
    k_range = k_per_split if k_per_split > 0 else K
    _decode_linear_kernel[grid](
        TensorDescriptor.from_tensor(tma_ready(x), [bm, cfg["BK"]]),
        TensorDescriptor.from_tensor(tma_ready(weight), [cfg["BN"], cfg["BK"]]),
        weight,
        weight if bias is None else bias,
        out,
        M,
        N,
        K,
        weight.stride(0),
        k_per_split,
        HAS_BIAS=bias is not None,
        SPLIT_K=k_per_split > 0,
        SWIGLU=swiglu,
        BM=bm,
        LIBDEVICE=not interpreting(),
        DOT_FP32=interpreting(),
        LINE=line,
        PREFETCH_LINES=triton.next_power_of_2(triton.cdiv(k_range, line)),
        enable_fp_fusion=False,
        **cfg,
        **pdl.launch_options(),
    )


def split_k_config(M: int, N: int, K: int) -> dict:
    """Blocks for `linear_split_sums`, the best of sweeps on the H100 at 64 rows: 64 output
    columns per program, 128-wide k steps, 5 stages; k ranges of 1024 (more when there would be
    over 8 ranges) for a long K (the 0.5B down_proj, tune_decode_linear.py), of SHORT_K_RANGE for
    K <= MAX_K (the 0.5B o_proj, in the decode step)."""
    bm = _rows_per_block(M)
    steps = -(-K // 128)
    k_range = SHORT_K_RANGE if K <= MAX_K else max(8, -(-steps // 8)) * 128
    return dict(BM=bm, BN=64, BK=128, num_warps=4, num_stages=5, k_per_split=k_range)


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
    """Whether a product whose reader adds up parts goes to `linear_split_sums`: a decode batch
    without a bias, with a long K (which `takes` leaves to cuBLAS) or, unless SHORT_K_RANGE is 0,
    a short one."""
    long_k = weight.shape[1] > MAX_K
    return bias is None and (long_k or SHORT_K_RANGE > 0) and _decode_batch(x, weight, None)


def linear_to_residual(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | SplitSums:
    """A product whose only reader is the next `add_rms_norm` (a layer's o_proj and down_proj):
    split-K parts where `takes_split_sums`, else `linear`."""
    if takes_split_sums(x, weight, bias):
        return linear_split_sums(x, weight)
    return linear(x, weight, bias)


def linear_to_attention(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts_read: bool
) -> torch.Tensor | ProjectedParts:
    """A packed q/k/v product whose only reader is the decode attention: split-K parts
    (`ProjectedParts`, the bias carried along) where that attention adds them up (`parts_read`)
    and the product is a decode batch, else `linear`."""
    if parts_read and QKV_K_RANGE > 0 and _decode_batch(x, weight, bias):
        config = dict(BN=QKV_BLOCK_N, k_per_split=QKV_K_RANGE)
        return ProjectedParts(linear_split_sums(x, weight, config).partials, bias, x.dtype)
    return linear(x, weight, bias)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, swiglu: bool = False
) -> torch.Tensor:
    """x @ weight.T + bias (then silu(gate) * up with swiglu): the kernel where `takes`, else
    cuBLAS (+ the SiLU * up kernel on CUDA)."""
    if takes(x, weight, bias):
        if swiglu and decode_linear_gluon.applies(x, weight, bias):
            out = torch.empty(x.shape[0], weight.shape[0] // 2, dtype=x.dtype, device=x.device)
            if decode_linear_gluon.launch(x, weight, out):
                return out
        return linear_triton(x, weight, bias, swiglu)
    out = F.linear(x, weight, bias)
    if swiglu:
        gate, up = out.chunk(2, dim=-1)
        out = silu_mul(gate, up)
    return out


def norm_linear(x, residual, norm_weight, eps, weight, bias, swiglu: bool = False):
    """(linear(RMSNorm(x + residual) * norm_weight), x + residual): the `rms_norm` kernel on
    CUDA, then `linear`."""
    h, new_residual = add_rms_norm(x, residual, norm_weight, eps)
    return linear(h, weight, bias, swiglu), new_residual

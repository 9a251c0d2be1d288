"""The decode step's linears at a few dozen rows, with the RMSNorm before them and the SwiGLU
after them computed inside the same kernel, for the rollout engine.

What:
- `norm_linear(x, residual, norm_weight, eps, weight, bias)` returns (out, new_residual):
  new_residual = x + residual rounded to x's dtype (x itself when residual is None), and
  out = (RMSNorm(new_residual) * norm_weight) @ weight.T + bias;
- with `swiglu=True`, weight (2I, K) and bias are a packed gate/up projection (gate rows first)
  and out = silu(gate) * up, (M, I);
- `norm_weight=None` skips the norm: `norm_linear(x, None, None, 0, weight, bias)` is a plain
  linear (the o_proj and down_proj of a decode step).

Why: at 64 rows a decode step of the 0.5B model ran ~10 kernels per layer on an H100 (1.53 ms per
step for 0.39 ms of memory traffic; benchmarks/results/profile_decode_step_h100_v3.txt): the
residual add + RMSNorm before q/k/v and before gate/up (2.2 us each), the GEMMs (cuBLAS picks a
split-K GEMM plus a reduction for o_proj, 8.6 us for 1.6 MB of weight) and SiLU * up (4.3 us).
Here each program owns a block of output columns for all rows: it reads the rows (a few hundred
KB, from L2) next to its slice of the weight, so the norm's sum of squares, the residual add and
the SiLU cost no extra pass, and q/k/v becomes one kernel, gate/up/SiLU another.

Numerics (bf16 only, the engine's dtype): the residual add in fp32 rounded to bf16, as the model
rounds it; the row's sum of squares in fp32. Where the model rounds RMSNorm(x) to bf16 and then
times the weight, here x * norm_weight is rounded to bf16, goes through the matmul (fp32
accumulation), and the per-row 1 / rms scales the fp32 result: one bf16 rounding of the input
either way, at a different point, so the outputs differ from the model's by bf16 rounding noise
(the tests hold both to the same distance from a float64 reference). The bias is added in fp32;
gate and up are rounded to bf16 as a GEMM would return them, silu(gate) is rounded as F.silu
rounds it, and the product once.

Reference: `norm_linear_ref`, the model's own ops (add_rms_norm_ref, F.linear, F.silu * up).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from fastgrpo.kernels.lm_head_stats import _interpreting, triton
from fastgrpo.kernels.rms_norm import add_rms_norm_ref, add_rms_norm_triton

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    try:  # programmatic dependent launch (Hopper): triton >= 3.3
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # pragma: no cover - older triton
        gdc_launch_dependents = gdc_wait = None

# FASTGRPO_DECODE_LINEAR=0 keeps the decode step on add_rms_norm + cuBLAS + silu_mul (to compare)
ENABLED = os.environ.get("FASTGRPO_DECODE_LINEAR", "1") != "0"
# FASTGRPO_PDL=0 launches the kernel without programmatic dependent launch
PDL_ENABLED = os.environ.get("FASTGRPO_PDL", "1") != "0"
KERNEL_DTYPES = (torch.bfloat16,)
FUSE_NORM = False
"""Whether the residual add and RMSNorm run in the linear's prologue or as their own kernel
before it. On the H100 the prologue made q/k/v 2.6x and gate/up 3.2x slower at 64 rows (the row
loads that feed elementwise work before the dot are not pipelined like the weight's), so the
norm stays a kernel of its own (benchmarks/NOTES.md, issue 4)."""
MAX_ROWS = 256
"""The most rows the kernel takes: a decode step's batch. Beyond it (a prefill) the weight is
re-read by too many row blocks, and cuBLAS is the better GEMM."""


def norm_linear_ref(
    x: torch.Tensor,  # (M, K)
    residual: torch.Tensor | None,  # (M, K) or None
    norm_weight: torch.Tensor | None,  # (K,) or None: no norm
    eps: float,
    weight: torch.Tensor,  # (N, K), or (2I, K) packed gate/up with swiglu
    bias: torch.Tensor | None,
    swiglu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new_residual) by the model's PyTorch ops."""
    if norm_weight is None:
        if residual is not None:
            raise ValueError("a residual is added only before a norm")
        h, new_residual = x, x
    else:
        h, new_residual = add_rms_norm_ref(x, residual, norm_weight, eps)
    out = F.linear(h, weight, bias)
    if swiglu:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out, new_residual


if triton is not None:

    @triton.jit
    def _exp(x, LIBDEVICE: tl.constexpr):
        if LIBDEVICE:
            return libdevice.exp(x)
        else:  # the interpreter has no libdevice
            return tl.exp(x)

    @triton.jit
    def _rsqrt(x, LIBDEVICE: tl.constexpr):
        if LIBDEVICE:
            return libdevice.rsqrt(x)
        else:
            return tl.math.rsqrt(x)

    @triton.jit
    def _decode_linear_kernel(
        x_ptr,  # (M, K) rows at stride_x, unit stride on K
        res_ptr,  # (M, K) rows at stride_r; unused without HAS_RESIDUAL
        new_res_ptr,  # (M, K) contiguous; unused without HAS_RESIDUAL
        g_ptr,  # (K,) norm weight; unused without HAS_NORM
        w_ptr,  # (N, K) rows at stride_w (2N rows with SWIGLU: gate rows, then up rows)
        b_ptr,  # (N,) or (2N,) bias; unused without HAS_BIAS
        out_ptr,  # (M, N) contiguous
        M,
        N,
        K,
        stride_x,
        stride_r,
        stride_w,
        inv_k,  # fp32(1 / K)
        eps,
        HAS_RESIDUAL: tl.constexpr,
        HAS_NORM: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SWIGLU: tl.constexpr,
        EVEN_K: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        DOT_FP32: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:
            # launched early behind the previous kernel: wait for its writes, then let the next
            # kernel launch (it waits in turn for this one to finish before it reads anything)
            gdc_wait()
            gdc_launch_dependents()
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        row_ok = rows < M
        col_ok = cols < N
        rows64 = rows.to(tl.int64)
        cols64 = cols.to(tl.int64)
        dtype = out_ptr.dtype.element_ty
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        sum_sq = tl.zeros((BM,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            if EVEN_K:
                a_ok = row_ok[:, None]
                w_ok = col_ok[:, None]
            else:
                a_ok = row_ok[:, None] & (ks < K)[None, :]
                w_ok = col_ok[:, None] & (ks < K)[None, :]
            a = tl.load(x_ptr + rows64[:, None] * stride_x + ks[None, :], mask=a_ok, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(
                    res_ptr + rows64[:, None] * stride_r + ks[None, :], mask=a_ok, other=0.0
                )
                a = (a.to(tl.float32) + r.to(tl.float32)).to(dtype)
                # the first column block writes the new residual
                if pid_n == 0:
                    tl.store(new_res_ptr + rows64[:, None] * K + ks[None, :], a, mask=a_ok)
            if HAS_NORM:
                a32 = a.to(tl.float32)
                sum_sq += tl.sum(a32 * a32, axis=1)
                if EVEN_K:
                    g = tl.load(g_ptr + ks)
                else:
                    g = tl.load(g_ptr + ks, mask=ks < K, other=0.0)
                a = (a32 * g.to(tl.float32)[None, :]).to(dtype)
            w = tl.load(w_ptr + cols64[:, None] * stride_w + ks[None, :], mask=w_ok, other=0.0)
            if DOT_FP32:  # the interpreter has no bf16 dot; fp32 copies are exact
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, tl.trans(w), acc)
            if SWIGLU:
                w_up = tl.load(
                    w_ptr + (cols64 + N)[:, None] * stride_w + ks[None, :], mask=w_ok, other=0.0
                )
                if DOT_FP32:
                    w_up = w_up.to(tl.float32)
                acc_up = tl.dot(a, tl.trans(w_up), acc_up)
        if HAS_NORM:
            scale = _rsqrt(sum_sq * inv_k + eps, LIBDEVICE)[:, None]  # (BM, 1)
            acc = acc * scale
            acc_up = acc_up * scale
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:
                acc_up += tl.load(b_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            gate = acc.to(dtype).to(tl.float32)
            up = acc_up.to(dtype).to(tl.float32)
            silu = tl.math.div_rn(gate, 1.0 + _exp(-gate, LIBDEVICE)).to(dtype).to(tl.float32)
            acc = silu * up
        out_at = out_ptr + rows64[:, None] * N + cols64[None, :]
        tl.store(out_at, acc.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


SHARED_MEMORY_BUDGET = 160 * 1024  # bytes of pipelined tiles per program (the H100 has 227 KB)


def pick_config(M: int, N: int, K: int, swiglu: bool) -> dict:
    """Block sizes for an (M, K) x (N, K)^T product: 64 rows per program (the smallest Hopper
    tensor-core tile; 16 or 32 for fewer rows), and the widest column block that still gives at
    least ~one program per SM, since each program streams its own slice of the weight; as many
    pipeline stages (up to 4) as fit the shared-memory budget."""
    bm = _rows_per_block(M)
    row_blocks = -(-M // bm)
    bn = 16
    for wider in (32, 64, 128):
        if row_blocks * -(-N // wider) >= 120:
            bn = wider
    bk = 128 if K >= 128 else max(16, 1 << (max(K, 1) - 1).bit_length())
    stage_bytes = (bm * bk + (2 if swiglu else 1) * bn * bk) * 2
    stages = max(2, min(4, SHARED_MEMORY_BUDGET // stage_bytes))
    return dict(BN=bn, BK=bk, num_warps=4, num_stages=stages)


def _rows_per_block(M: int) -> int:
    return 16 if M <= 16 else 32 if M <= 32 else 64


def use_pdl() -> bool:
    """Programmatic dependent launch: on Hopper and newer, with a Triton that has it."""
    return (
        PDL_ENABLED
        and triton is not None
        and gdc_wait is not None
        and not _interpreting()
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability()[0] >= 9
    )


def _check(x, residual, norm_weight, weight, bias, swiglu) -> None:
    M, K = x.shape if x.dim() == 2 else (None, None)
    if M is None or weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(
            f"x (M, K) and weight (N, K) expected, got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"a packed gate/up weight needs an even row count, got {weight.shape[0]}")
    if residual is not None and (norm_weight is None or residual.shape != x.shape):
        raise ValueError("a residual (M, K) like x is added only before a norm")
    if norm_weight is not None and norm_weight.shape != (K,):
        raise ValueError(f"norm_weight must be ({K},), got {tuple(norm_weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    given = [t for t in (x, residual, norm_weight, weight, bias) if t is not None]
    if any(t.dtype not in KERNEL_DTYPES for t in given):
        raise ValueError(f"the kernel takes {KERNEL_DTYPES}, got {[t.dtype for t in given]}")
    if any(t.device != x.device for t in given):
        raise ValueError("every input must live on one device")
    if any(t.stride(-1) != 1 for t in given):
        raise ValueError("every input needs unit stride on its last dim")
    if M > MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS} rows (a decode batch), got {M}")


def norm_linear_triton(
    x,
    residual,
    norm_weight,
    eps,
    weight,
    bias,
    swiglu=False,
    config: dict | None = None,
    fuse_norm: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `norm_linear_ref`, by Triton: one launch with the norm in the linear's prologue
    (`fuse_norm`, default FUSE_NORM), else the `add_rms_norm` kernel and then the linear. No host
    sync, so it can be captured in a CUDA graph. `config` overrides `pick_config` (block sizes,
    warps, stages; for tuning)."""
    if triton is None:
        raise RuntimeError("the Triton decode linear needs `pip install triton`")
    _check(x, residual, norm_weight, weight, bias, swiglu)
    if norm_weight is not None and not (FUSE_NORM if fuse_norm is None else fuse_norm):
        h, new_residual = add_rms_norm_triton(x, residual, norm_weight, eps)
        return _launch(h, None, None, 0.0, weight, bias, swiglu, config)[0], new_residual
    return _launch(x, residual, norm_weight, eps, weight, bias, swiglu, config)


def _launch(x, residual, norm_weight, eps, weight, bias, swiglu, config):
    M, K = x.shape
    N = weight.shape[0] // 2 if swiglu else weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    new_residual = (
        x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    )
    if M == 0 or N == 0:
        return out, new_residual
    cfg = dict(pick_config(M, N, K, swiglu), **(config or {}))
    bm = cfg.pop("BM", _rows_per_block(M))
    pdl = use_pdl()
    launch = dict(launch_pdl=True) if pdl else {}
    grid = (triton.cdiv(N, cfg["BN"]), triton.cdiv(M, bm))
    res = x if residual is None else residual
    _decode_linear_kernel[grid](
        x,
        res,
        new_residual,
        weight if norm_weight is None else norm_weight,
        weight,
        weight if bias is None else bias,
        out,
        M,
        N,
        K,
        x.stride(0),
        res.stride(0),
        weight.stride(0),
        1.0 / K,
        eps,
        HAS_RESIDUAL=residual is not None,
        HAS_NORM=norm_weight is not None,
        HAS_BIAS=bias is not None,
        SWIGLU=swiglu,
        EVEN_K=K % cfg["BK"] == 0,
        BM=bm,
        LIBDEVICE=not _interpreting(),
        DOT_FP32=_interpreting(),
        PDL=pdl,
        enable_fp_fusion=False,
        **cfg,
        **launch,
    )
    return out, new_residual


def applies(x: torch.Tensor) -> bool:
    """Whether the kernel takes this activation: bf16 on CUDA, a decode batch of rows."""
    return (
        ENABLED
        and triton is not None
        and x.is_cuda
        and x.dtype in KERNEL_DTYPES
        and x.dim() == 2
        and x.shape[0] <= MAX_ROWS
    )


def norm_linear(
    x, residual, norm_weight, eps, weight, bias, swiglu=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new_residual): the kernel when `applies(x)` and every input is bf16 with unit last
    stride, else the reference."""
    given = [t for t in (x, residual, norm_weight, weight, bias) if t is not None]
    if applies(x) and all(t.dtype in KERNEL_DTYPES and t.stride(-1) == 1 for t in given):
        return norm_linear_triton(x, residual, norm_weight, eps, weight, bias, swiglu)
    return norm_linear_ref(x, residual, norm_weight, eps, weight, bias, swiglu)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias for a decode batch (o_proj, down_proj): the kernel where it applies."""
    return norm_linear(x, None, None, 0.0, weight, bias)[0]

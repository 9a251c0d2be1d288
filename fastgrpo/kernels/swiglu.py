"""SiLU(gate) * up in one kernel, for the model's no-grad (rollout) path.

What: `silu_mul(gate, up)` returns silu(gate) * up for two (..., I) tensors of one dtype, the
inner activation of the SwiGLU MLP.

Why: a decode step of the 0.5B model at 64 rows takes 3.3 ms on an H100, ~2 ms of it in small
elementwise kernels of 1.5-4 us each, ~20 per layer (benchmarks/results/profile_decode_step_h100_v2
.txt). `F.silu(gate) * up` is two of them and writes and reads back the silu in between; here one
kernel reads gate and up once.

Numerics: as torch's CUDA kernels: silu in fp32, g / (1 + exp(-g)) with CUDA's `expf` (libdevice
`__nv_expf`, no flush-to-zero, as nvcc compiles torch) and an IEEE division (`div_rn`), rounded
to the dtype; then the product, exact in fp32 for 16-bit inputs, rounded once. So the result is
meant to be bitwise torch's on a GPU (the GPU tests check it). The interpreter (CPU tests) has no
libdevice: there exp is numpy's, within an ulp or so of fp32.

Reference: `silu_mul_ref`, `F.silu(gate) * up` as the model's MLP computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastgrpo.kernels.lm_head_stats import _interpreting, triton

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK = 1024  # elements per program


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """(..., I) silu(gate) * up, as the model's MLP computes it."""
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _exp(x, LIBDEVICE: tl.constexpr):
        if LIBDEVICE:
            return libdevice.exp(x)
        else:  # the interpreter has no libdevice
            return tl.exp(x)

    @triton.jit
    def _silu_mul_kernel(
        gate_ptr,
        up_ptr,  # (rows, cols) each, unit column stride, rows `row_stride` elements apart
        out_ptr,  # (rows * cols,) contiguous
        n,
        cols,
        row_stride,
        BLOCK: tl.constexpr,
        LIBDEVICE: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        src = (offs // cols) * row_stride + offs % cols
        g = tl.load(gate_ptr + src, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + src, mask=ok, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        silu = tl.math.div_rn(g, 1.0 + _exp(-g, LIBDEVICE)).to(dtype)  # rounded as F.silu's output
        tl.store(out_ptr + offs, (silu.to(tl.float32) * u).to(dtype), mask=ok)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """As `silu_mul_ref`, by the Triton kernel, over the flat elements. No host sync, so it can
    be captured in a CUDA graph."""
    if triton is None:
        raise RuntimeError("the Triton SiLU-mul kernel needs `pip install triton`")
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"gate and up must share a shape and one of {KERNEL_DTYPES}; got "
            f"{tuple(gate.shape)} {gate.dtype}, {tuple(up.shape)} {up.dtype}"
        )
    row_stride = _row_stride(gate, up)
    if row_stride is None:
        raise ValueError(
            "gate and up must be contiguous, or 2-D rows with unit column stride and one row "
            "stride (e.g. the two halves of a packed gate/up projection)"
        )
    if gate.device != up.device:
        raise ValueError("gate and up must live on one device")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)  # (..., I) contiguous
    n, cols = gate.numel(), gate.shape[-1]
    if n == 0:
        return out
    _silu_mul_kernel[(triton.cdiv(n, BLOCK),)](
        gate,
        up,
        out,
        n,
        cols,
        row_stride,
        BLOCK=BLOCK,
        LIBDEVICE=not _interpreting(),
        num_warps=4,
        enable_fp_fusion=False,
        enable_reflect_ftz=False,
    )
    return out


def _row_stride(gate: torch.Tensor, up: torch.Tensor) -> int | None:
    """Elements between rows of gate and up when the kernel can read them, else None."""
    if gate.is_contiguous() and up.is_contiguous():
        return gate.shape[-1] if gate.dim() else 1
    if gate.dim() == 2 and gate.stride(1) == up.stride(1) == 1 and gate.stride(0) == up.stride(0):
        return gate.stride(0)
    return None


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the kernel on CUDA tensors of the kernel's dtypes it can read (contiguous,
    or the halves of a packed gate/up projection), else the reference."""
    if (
        triton is not None
        and gate.is_cuda
        and gate.dtype in KERNEL_DTYPES
        and _row_stride(gate, up) is not None
    ):
        return silu_mul_triton(gate, up)
    return silu_mul_ref(gate, up)

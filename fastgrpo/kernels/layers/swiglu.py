"""SiLU(gate) * up in one kernel, for the model's no-grad (rollout) path, and with a one-kernel
backward for its training forward.

What: `silu_mul(gate, up)` returns silu(gate) * up for two (..., I) tensors of one dtype, the
inner activation of the SwiGLU MLP. `silu_mul_train(gate_up, inner)` is the same of the two halves
of one packed (T, 2I) gate/up projection, differentiable: its backward is one kernel that reads
gate_up and the incoming gradient once and writes d_gate_up (T, 2I), the gradient the packed
projection's matmul backward takes, with no cat of d_gate and d_up.

Why: a decode step of the 0.5B model at 64 rows takes 3.3 ms on an H100, ~2 ms of it in small
elementwise kernels of 1.5-4 us each, ~20 per layer (benchmarks/results/profile_decode_step_h100_v2
.txt). `F.silu(gate) * up` is two of them and writes and reads back the silu in between; here one
kernel reads gate and up once. In training, torch's autograd adds two multiplies, silu's backward
and a cat of d_gate and d_up into the packed gradient, and keeps silu(gate) (T, I) beside gate_up
for the backward; here one kernel, which keeps only gate_up. The flat blocks load and store 16
bytes per thread in bf16 when I is a multiple of 16 (Triton specialises such arguments), as
Qwen2.5's 4864 and 18944 are (read in the sm_90 PTX of both kernels; not timed here).

Numerics: as torch's CUDA kernels: silu in fp32, g / (1 + exp(-g)) with CUDA's `expf` (libdevice
`__nv_expf`, no flush-to-zero, as nvcc compiles torch) and an IEEE division (`div_rn`), rounded
to the dtype; then the product, exact in fp32 for 16-bit inputs, rounded once. So the result is
meant to be bitwise torch's on a GPU (the GPU tests check it). The interpreter (CPU tests) has no
libdevice: there exp is numpy's, within an ulp or so of fp32. The backward computes, with
s = sigmoid(g), d_gate = d_out * up * s * (1 + g * (1 - s)) and d_up = d_out * g * s in fp32 and
rounds each once; torch's autograd rounds d_out * up and silu(g) to the dtype first, so this is
at least as accurate (the tests hold it within 2x of torch's own error against float64).

Reference: `silu_mul_ref`, `F.silu(gate) * up` as the model's MLP computes it (and its autograd).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastgrpo.kernels.support import interpreting, triton

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
    def exp_libdevice(x, LIBDEVICE: tl.constexpr):
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
        silu = tl.math.div_rn(g, 1.0 + exp_libdevice(-g, LIBDEVICE)).to(
            dtype
        )  # rounded as F.silu's output
        tl.store(out_ptr + offs, (silu.to(tl.float32) * u).to(dtype), mask=ok)

    @triton.jit
    def _silu_mul_backward_kernel(
        gate_up_ptr,  # (rows, 2 * cols), unit column stride, rows `row_stride` elements apart
        d_out_ptr,  # (rows * cols,) contiguous
        d_gate_up_ptr,  # (rows, 2 * cols) contiguous
        act_ptr,  # (rows * cols,) contiguous: silu(gate) * up again, when WRITE_ACT
        n,
        cols,
        row_stride,
        BLOCK: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        WRITE_ACT: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        row, col = offs // cols, offs % cols
        src = row * row_stride + col  # gate; up is `cols` further on
        dst = row * (2 * cols) + col
        g = tl.load(gate_up_ptr + src, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + src + cols, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(d_out_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        e = exp_libdevice(-g, LIBDEVICE)
        s = tl.math.div_rn(1.0, 1.0 + e)  # sigmoid(g): 0 when exp overflows
        dtype = d_gate_up_ptr.dtype.element_ty
        tl.store(d_gate_up_ptr + dst, (dy * u * s * (1.0 + g * (1.0 - s))).to(dtype), mask=ok)
        tl.store(d_gate_up_ptr + dst + cols, (dy * (g * s)).to(dtype), mask=ok)
        if WRITE_ACT:  # the forward kernel's exact steps and roundings
            silu = tl.math.div_rn(g, 1.0 + e).to(dtype)
            tl.store(act_ptr + offs, (silu.to(tl.float32) * u).to(dtype), mask=ok)


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
        LIBDEVICE=not interpreting(),
        num_warps=4,
        enable_fp_fusion=False,
        enable_reflect_ftz=False,
    )
    return out


def silu_mul_backward_triton(
    gate_up: torch.Tensor,  # (T, 2I), unit column stride
    d_out: torch.Tensor,  # (T, I)
    inner: int,
    with_act: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """(T, 2I) contiguous [d_gate | d_up] of silu(gate) * up at gate_up, given d_out, by one
    Triton kernel; `with_act`: also (T, I) silu(gate) * up, bitwise `silu_mul_triton`'s, from the
    same read of gate_up (the down projection's weight gradient needs it). No host sync, so it
    can be captured in a CUDA graph."""
    if triton is None:
        raise RuntimeError("the Triton SiLU-mul kernel needs `pip install triton`")
    _check_gate_up_shape(gate_up, inner)
    if gate_up.dtype not in KERNEL_DTYPES or gate_up.stride(1) != 1:
        raise ValueError(
            f"gate_up must be one of {KERNEL_DTYPES} with unit column stride; got "
            f"{gate_up.dtype}, strides {gate_up.stride()}"
        )
    T = gate_up.shape[0]
    if d_out.shape != (T, inner) or d_out.dtype != gate_up.dtype:
        raise ValueError(
            f"d_out must be ({T}, {inner}) {gate_up.dtype}; got {tuple(d_out.shape)} {d_out.dtype}"
        )
    if d_out.device != gate_up.device:
        raise ValueError("gate_up and d_out must live on one device")
    d_out = d_out.contiguous()  # a no-op for the usual gradient; an expanded one gets copied
    d_gate_up = torch.empty(T, 2 * inner, dtype=gate_up.dtype, device=gate_up.device)
    act = torch.empty(T, inner, dtype=gate_up.dtype, device=gate_up.device) if with_act else None
    n = T * inner
    if n > 0:
        _silu_mul_backward_kernel[(triton.cdiv(n, BLOCK),)](
            gate_up,
            d_out,
            d_gate_up,
            d_gate_up if act is None else act,
            n,
            inner,
            gate_up.stride(0),
            BLOCK=BLOCK,
            LIBDEVICE=not interpreting(),
            WRITE_ACT=with_act,
            num_warps=4,
            enable_fp_fusion=False,  # as the forward kernel: act bitwise the forward's
            enable_reflect_ftz=False,
        )
    return (d_gate_up, act) if with_act else d_gate_up


def _check_gate_up_shape(gate_up: torch.Tensor, inner: int) -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * inner:
        raise ValueError(
            f"gate_up must be (T, 2 * inner) = (T, {2 * inner}); got {tuple(gate_up.shape)}"
        )


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


class _SiluMulTrain(torch.autograd.Function):
    """silu(gate) * up of the halves of gate_up by the inference kernel (so bitwise `silu_mul`);
    the backward is `silu_mul_backward_triton`, from gate_up saved as it is (no copies)."""

    @staticmethod
    def forward(ctx, gate_up, inner):
        ctx.inner = inner
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.split(inner, dim=-1)  # (T, I) views, rows 2I apart
        return silu_mul_triton(gate, up)

    @staticmethod
    def backward(ctx, d_out):
        (gate_up,) = ctx.saved_tensors
        return silu_mul_backward_triton(gate_up, d_out, ctx.inner), None


def _train_kernels_take(gate_up: torch.Tensor) -> bool:
    """Whether the training kernels run on this (T, 2I) gate_up: Triton, a CUDA tensor (or the
    interpreter), one of the kernel's dtypes, unit column stride."""
    return (
        triton is not None
        and (gate_up.is_cuda or interpreting())
        and gate_up.dtype in KERNEL_DTYPES
        and gate_up.stride(1) == 1
    )


def silu_mul_train(gate_up: torch.Tensor, inner: int) -> torch.Tensor:
    """(T, I) silu(gate) * up of a packed gate/up projection output gate_up (T, 2I), whose columns
    [0, I) are gate and [I, 2I) up; differentiable. One forward and one backward kernel on CUDA
    tensors (or in the interpreter) of the kernel's dtypes with unit column stride, else the
    reference on the halves, with torch's autograd."""
    _check_gate_up_shape(gate_up, inner)
    if _train_kernels_take(gate_up):
        return _SiluMulTrain.apply(gate_up, inner)
    gate, up = gate_up.split(inner, dim=-1)
    return silu_mul_ref(gate, up)


class _SiluMulLinear(torch.autograd.Function):
    """linear(silu(gate) * up) that saves only gate_up: the backward recomputes silu(gate) * up
    (bitwise the forward's, by the same kernel) for the weight's gradient. In the MLP that
    saves the (T, I) activation per layer, ~23% of a 0.5B model's activation memory per token."""

    @staticmethod
    def forward(ctx, gate_up, inner, weight, bias):
        ctx.inner = inner
        ctx.has_bias = bias is not None
        ctx.save_for_backward(gate_up, weight)
        gate, up = gate_up.split(inner, dim=-1)  # (T, I) views
        return F.linear(silu_mul_triton(gate, up), weight, bias)  # (T, out)

    @staticmethod
    def backward(ctx, d_out):
        gate_up, weight = ctx.saved_tensors
        wants_input, _, wants_weight, wants_bias = ctx.needs_input_grad
        d_out = d_out.contiguous()
        d_gate_up = d_weight = d_bias = None
        act = None
        if wants_input:  # one kernel for [d_gate | d_up] and, for d_weight, silu(gate) * up
            out = silu_mul_backward_triton(gate_up, d_out @ weight, ctx.inner, wants_weight)
            d_gate_up, act = out if wants_weight else (out, None)  # (T, 2I), (T, I)
        if wants_weight:
            if act is None:
                act = silu_mul_triton(*gate_up.split(ctx.inner, dim=-1))  # (T, I)
            d_weight = d_out.t() @ act  # (out, I)
        if wants_bias and ctx.has_bias:
            d_bias = d_out.sum(0)
        return d_gate_up, None, d_weight, d_bias


def silu_mul_linear_train(
    gate_up: torch.Tensor, inner: int, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """(T, out) = linear(silu(gate) * up, weight, bias) for a packed gate/up output gate_up
    (T, 2I) and weight (out, I): the SwiGLU MLP's down projection, differentiable, keeping only
    gate_up for the backward (see `_SiluMulLinear`). Where `silu_mul_train` would take the
    reference, so does this, with torch's autograd."""
    _check_gate_up_shape(gate_up, inner)
    if _train_kernels_take(gate_up):
        return _SiluMulLinear.apply(gate_up, inner, weight, bias)
    return F.linear(silu_mul_train(gate_up, inner), weight, bias)

"""Residual add and RMSNorm in one kernel, for the model's no-grad (rollout) path.

What: `add_rms_norm(x, residual, weight, eps)` returns (normed, new_residual) with
new_residual = x + residual rounded to x's dtype, exactly as the model's `x = x + attn_out`, and
normed = RMSNorm(new_residual) * weight, as `transformer.RMSNorm.forward` computes it: the mean
square in fp32, x * rsqrt(mean + eps) in fp32 cast back to x's dtype, then one multiply by the
weight rounded to promote(weight, x). `residual=None` normalizes x alone (new_residual is x itself).

Why: a decode step of the 0.5B model at 64 rows takes 3.3 ms on an H100, ~2 ms of it in small
elementwise kernels of 1.5-4 us each, ~20 per layer (benchmarks/results/profile_decode_step_h100_v2
.txt). The PyTorch RMSNorm is a chain of them (cast, pow, mean, add eps, rsqrt, mul, cast, weight
mul), run twice per layer, plus the residual add; here one program per row reads x and residual
once and writes both outputs.

Numerics: every rounding of the PyTorch code is repeated (the add in fp32 rounded to x's dtype,
the normalized row rounded to x's dtype before the weight multiply, the product of two 16-bit
values exact in fp32 and rounded once). The only freedom is the order of the fp32 sum of squares,
which may move the mean by an fp32 ulp and, rarely, the normalised row by one ulp of bf16 (two
after the weight multiply rounds again; measured on the H100). The mean is that
sum times fp32(1 / n), as torch's CUDA mean computes it; rsqrt is libdevice's `__nv_rsqrtf`, the
`rsqrtf` torch calls (numpy's 1 / sqrt in the interpreter).

Reference: `add_rms_norm_ref`, written with the model's own `RMSNorm` arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgrpo.kernels.lm_head_stats import _interpreting, triton

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class SplitSums:
    """A product summed over its reduction dim in parts (split-K): `partials` (S, R, H) fp32, whose
    sum rounded once to `dtype` is the product. `add_rms_norm` takes it as its x, so the parts are
    added up by the norm kernel that reads them anyway (`decode_linear.linear_split_sums`)."""

    partials: torch.Tensor  # (S, R, H) fp32
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.partials.shape[1:]

    def total(self) -> torch.Tensor:
        """(R, H): the sum of the parts rounded to dtype, as a GEMM's fp32 output is."""
        return self.partials.sum(0).to(self.dtype)


def add_rms_norm_ref(
    x: torch.Tensor | SplitSums,  # (..., H)
    residual: torch.Tensor | None,  # (..., H) or None
    weight: torch.Tensor,  # (H,)
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed (..., H), new_residual (..., H)) by PyTorch ops, as the model computes them."""
    if isinstance(x, SplitSums):
        x = x.total()
    if residual is not None:
        x = residual + x  # (..., H), the model's `x = x + sublayer(x)`
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), x


if triton is not None:

    @triton.jit
    def _rsqrt(x, LIBDEVICE: tl.constexpr):
        if LIBDEVICE:  # `__nv_rsqrtf`, the bitcode of the `rsqrtf` that torch's rsqrt calls
            return libdevice.rsqrt(x)
        else:  # the interpreter has no libdevice
            return tl.math.rsqrt(x)

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr,  # (R, H) rows at stride_x, unit stride on H
        res_ptr,  # (R, H) rows at stride_r; unused without HAS_RESIDUAL
        w_ptr,  # (H,)
        out_ptr,  # (R, H) contiguous, promote(weight, x) dtype
        new_res_ptr,  # (R, H) contiguous, x's dtype; unused without HAS_RESIDUAL
        stride_x,
        stride_r,
        H,
        inv_h,  # fp32(1 / H)
        eps,
        HAS_RESIDUAL: tl.constexpr,
        SPLITS: tl.constexpr,  # 0: x is the rows; S > 0: x is S fp32 parts to sum (SplitSums)
        stride_split,  # elements between the parts (with SPLITS)
        BLOCK: tl.constexpr,
        LIBDEVICE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        dtype = res_ptr.dtype.element_ty if SPLITS > 0 else x_ptr.dtype.element_ty
        if SPLITS > 0:  # the fp32 sum of the parts, rounded once as a GEMM's output
            total = tl.zeros((BLOCK,), dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                total += tl.load(
                    x_ptr + s * stride_split + row * stride_x + cols, mask=ok, other=0.0
                )
            x = total.to(dtype)
        else:
            x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
            tl.store(new_res_ptr + row * H + cols, x, mask=ok)
        x32 = x.to(tl.float32)
        mean_square = tl.sum(x32 * x32, axis=0) * inv_h
        normed = (x32 * _rsqrt(mean_square + eps, LIBDEVICE)).to(dtype)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        out = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + row * H + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """(R, H) rows of (..., H) with unit stride on H: a view, or a copy when the leading dims are
    not one stride apart (heads of a packed q/k/v projection, under Qwen3's q/k norm)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} needs unit stride on its last dim, got strides {t.stride()}")
    return t.reshape(-1, t.shape[-1])


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `add_rms_norm_ref`, by the Triton kernel: one program per row. No host sync, so it
    can be captured in a CUDA graph."""
    if triton is None:
        raise RuntimeError("the Triton RMSNorm kernel needs `pip install triton`")
    if isinstance(x, SplitSums):
        return _add_rms_norm_split_sums(x, residual, weight, eps)
    H = x.shape[-1]
    if weight.shape != (H,):
        raise ValueError(f"weight must be ({H},) for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    if x.dtype not in KERNEL_DTYPES or weight.dtype not in KERNEL_DTYPES:
        raise ValueError(f"x and weight must be in {KERNEL_DTYPES}, got {x.dtype}, {weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x {tuple(x.shape)} {x.dtype}, got "
            f"{tuple(residual.shape)} {residual.dtype}"
        )
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if any(t.device != x.device for t in tensors):
        raise ValueError("x, residual and weight must live on one device")
    if H > 65536:
        raise ValueError(f"one program holds a whole row: hidden size {H} > 65536")
    x_rows = _rows(x, "x")  # (R, H)
    res_rows = x_rows if residual is None else _rows(residual, "residual")  # (R, H)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)  # (..., H)
    new_residual = (
        x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    )
    R = x_rows.shape[0]
    if R == 0 or H == 0:
        return out, new_residual
    _launch(x_rows, x_rows.stride(0), 0, 0, res_rows, weight, out, new_residual, eps, residual)
    return out, new_residual


def _launch(x, stride_x, splits, stride_split, res_rows, weight, out, new_residual, eps, residual):
    """One program per row of res_rows (R, H); x is the rows, or with splits > 0 the parts."""
    R, H = res_rows.shape
    block = triton.next_power_of_2(H)
    _add_rms_norm_kernel[(R,)](
        x,
        res_rows,
        weight.contiguous(),
        out,
        new_residual,
        stride_x,
        res_rows.stride(0),
        H,
        1.0 / H,
        eps,
        HAS_RESIDUAL=residual is not None,
        SPLITS=splits,
        stride_split=stride_split,
        BLOCK=block,
        LIBDEVICE=not _interpreting(),
        num_warps=min(16, max(1, block // 256)),
        enable_fp_fusion=False,
        enable_reflect_ftz=False,  # rsqrt without flush-to-zero, as nvcc compiles torch's
    )


def _add_rms_norm_split_sums(
    x: SplitSums, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_triton` for x given as split-K parts: the kernel sums them first."""
    S, R, H = x.partials.shape
    if residual is None or residual.shape != (R, H) or residual.dtype != x.dtype:
        raise ValueError(
            f"split sums ({R}, {H}) are added to a residual of that shape and dtype {x.dtype}"
        )
    if x.partials.dtype != torch.float32 or not x.partials.is_contiguous():
        raise ValueError("split sums must be contiguous fp32 parts (S, R, H)")
    if weight.shape != (H,) or weight.dtype not in KERNEL_DTYPES:
        raise ValueError(f"weight must be ({H},) in {KERNEL_DTYPES}, got {weight.shape}")
    res_rows = _rows(residual, "residual")
    out = torch.empty(
        R, H, dtype=torch.promote_types(weight.dtype, x.dtype), device=res_rows.device
    )
    new_residual = torch.empty(R, H, dtype=x.dtype, device=res_rows.device)
    _launch(x.partials, H, S, R * H, res_rows, weight, out, new_residual, eps, residual)
    return out, new_residual


def add_rms_norm(
    x: torch.Tensor | SplitSums, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual): the kernel on CUDA tensors of the kernel's
    dtypes, else the reference. x may be `SplitSums` (then the kernel adds up the parts)."""
    if isinstance(x, SplitSums):
        if triton is not None and x.partials.is_cuda:
            return add_rms_norm_triton(x, residual, weight, eps)
        return add_rms_norm_ref(x, residual, weight, eps)
    if triton is not None and x.is_cuda and x.dtype in KERNEL_DTYPES:
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)

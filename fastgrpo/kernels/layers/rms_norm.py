"""Residual add and RMSNorm in one kernel, for the model's no-grad (rollout) path, and with a
backward kernel for training.

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

Training: `add_rms_norm_train` is the same forward (bitwise; it also stores each row's fp32
rstd) under an autograd.Function, where autograd of the PyTorch code runs a chain of small kernels
forward and back. Its backward is one kernel over tiles of rows plus a small sum: with r the new
residual, n = r * rstd and dn = d_normed * weight, g = d_new_residual + rstd * (dn - n * mean(dn *
n)) in fp32, rounded once to x's dtype, is the gradient of both x and residual (the forward's
rounding of n before the weight multiply is taken as identity there, as autograd's chain does up
to its own roundings); d weight is the sum over rows of d_normed * n rounded as the forward rounds
it, in fp32 parts per program added up by `.sum(0)`: deterministic, no atomics.

Reference: `add_rms_norm_ref`, written with the model's own `RMSNorm` arithmetic, and
`add_rms_norm_backward_ref`, the closed form of its gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgrpo.kernels.decode import pdl
from fastgrpo.kernels.support import interpreting, multiprocessors, triton

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DECODE_COLUMNS_PER_WARP = 128  # columns per warp when the rows fit one wave (256 otherwise)


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
    """(normed (..., H), new_residual (..., H)) by PyTorch ops, as the model computes them. fp64
    inputs stay in fp64 (where the model's `.float()` would round them), so that the tests' float64
    reference is one."""
    if isinstance(x, SplitSums):
        x = x.total()
    if residual is not None:
        x = residual + x  # (..., H), the model's `x = x + sublayer(x)`
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # the model's x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), x


def add_rms_norm_backward_ref(
    d_normed: torch.Tensor,  # (T, H) promote(weight, x) dtype
    d_new_residual: torch.Tensor | None,  # (T, H) x's dtype
    new_residual: torch.Tensor,  # (T, H) x's dtype
    weight: torch.Tensor,  # (H,)
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g (T, H) x's dtype, d weight (H,) weight's dtype): the gradients of `add_rms_norm_ref` by
    the closed form the backward kernel evaluates, in fp32 (fp64 for fp64 inputs). g is the
    gradient of both x and residual. With r the new residual, n = r * rstd and dn = d_normed * w:
    g = d_new_residual + rstd * (dn - n * mean(dn * n)), d weight = sum over rows of
    d_normed * n rounded to x's dtype (as the forward multiplies the weight by the rounded n)."""
    acc = torch.promote_types(new_residual.dtype, torch.float32)
    r = new_residual.to(acc)  # (T, H)
    rstd = torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)  # (T, 1)
    n = r * rstd  # (T, H)
    dy = d_normed.to(acc)  # (T, H)
    dn = dy * weight.to(acc)  # (T, H)
    g = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))  # (T, H)
    if d_new_residual is not None:
        g = g + d_new_residual.to(acc)
    d_weight = (dy * n.to(new_residual.dtype).to(acc)).sum(0)  # (H,)
    return g.to(new_residual.dtype), d_weight.to(weight.dtype)


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
        rstd_ptr,  # (R,) fp32: each row's 1 / sqrt(mean square + eps); unused without STORE_RSTD
        stride_x,
        stride_r,
        H,
        inv_h,  # fp32(1 / H)
        eps,
        HAS_RESIDUAL: tl.constexpr,
        STORE_RSTD: tl.constexpr,  # for the backward (`add_rms_norm_train`)
        SPLITS: tl.constexpr,  # 0: x is the rows; S > 0: x is S fp32 parts to sum (SplitSums)
        stride_split,  # elements between the parts (with SPLITS)
        BLOCK: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        PDL: tl.constexpr = False,  # programmatic dependent launch (kernels.pdl)
    ):
        pdl.start(PDL)
        pdl.wait(PDL)
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
        rstd = _rsqrt(mean_square + eps, LIBDEVICE)
        if STORE_RSTD:
            tl.store(rstd_ptr + row, rstd)
        normed = (x32 * rstd).to(dtype)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        out = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + row * H + cols, out.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _add_rms_norm_backward_kernel(
        d_out_ptr,  # (R, H) contiguous: d normed, promote(weight, x) dtype
        d_res_ptr,  # (R, H) contiguous: d new_residual, x's dtype; unused without HAS_D_RES
        res_ptr,  # (R, H) rows at stride_r: the forward's new_residual, x's dtype
        rstd_ptr,  # (R,) fp32: the forward's 1 / sqrt(mean square + eps) per row
        w_ptr,  # (H,)
        g_ptr,  # (R, H) contiguous, x's dtype: d x = d residual; unused without NEED_G
        dw_ptr,  # (programs, H) fp32: each program's sum over its rows; unused without NEED_DW
        R,
        H,
        stride_r,
        rows_per_program,  # a multiple of ROWS
        inv_h,  # fp32(1 / H)
        HAS_D_RES: tl.constexpr,
        NEED_G: tl.constexpr,
        NEED_DW: tl.constexpr,
        ROWS: tl.constexpr,  # rows per tile: (ROWS, BLOCK) elements are loaded at once
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        col_ok = cols < H
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        dw = tl.zeros((ROWS, BLOCK), dtype=tl.float32)  # summed over its rows once, at the end
        first = pid * rows_per_program
        last = tl.minimum(first + rows_per_program, R)
        for start in range(first, last, ROWS):
            rows = start + tl.arange(0, ROWS)
            row_ok = rows < last
            ok = row_ok[:, None] & col_ok[None, :]
            rows64 = rows.to(tl.int64)
            at = rows64[:, None] * H + cols[None, :]  # (ROWS, BLOCK) offsets in the gradients
            r = tl.load(res_ptr + rows64[:, None] * stride_r + cols[None, :], mask=ok, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]  # (ROWS, 1)
            n = r.to(tl.float32) * rstd  # bitwise the forward's normalised row, before rounding
            dy = tl.load(d_out_ptr + at, mask=ok, other=0.0).to(tl.float32)
            if NEED_G:
                dn = dy * w[None, :]
                mean_dn_n = tl.sum(dn * n, axis=1)[:, None] * inv_h  # (ROWS, 1)
                g = rstd * (dn - n * mean_dn_n)
                if HAS_D_RES:
                    g += tl.load(d_res_ptr + at, mask=ok, other=0.0).to(tl.float32)
                tl.store(g_ptr + at, g.to(g_ptr.dtype.element_ty), mask=ok)
            if NEED_DW:  # the weight multiplied n rounded to x's dtype in the forward
                dw += dy * n.to(res_ptr.dtype.element_ty).to(tl.float32)
        if NEED_DW:
            tl.store(dw_ptr + pid * H + cols, tl.sum(dw, axis=0), mask=col_ok)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """(R, H) rows of (..., H) with unit stride on H: a view, or a copy when the leading dims are
    not one stride apart (heads of a packed q/k/v projection, under Qwen3's q/k norm)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} needs unit stride on its last dim, got strides {t.stride()}")
    return t.reshape(-1, t.shape[-1])


def add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    rstd: torch.Tensor | None = None,  # (R,) fp32, filled with 1 / sqrt(mean square + eps)
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `add_rms_norm_ref`, by the Triton kernel: one program per row. No host sync, so it
    can be captured in a CUDA graph. `rstd`, when given, receives each row's reciprocal RMS (for
    the backward); the outputs are bitwise the same either way."""
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
    if rstd is not None and (rstd.shape != (R,) or rstd.dtype != torch.float32):
        raise ValueError(f"rstd must be ({R},) fp32, got {tuple(rstd.shape)} {rstd.dtype}")
    if R == 0 or H == 0:
        return out, new_residual
    _launch(
        x_rows, x_rows.stride(0), 0, 0, res_rows, weight, out, new_residual, eps, residual, rstd
    )
    return out, new_residual


def _launch(
    x, stride_x, splits, stride_split, res_rows, weight, out, new_residual, eps, residual, rstd=None
):
    """One program per row of res_rows (R, H); x is the rows, or with splits > 0 the parts.
    Warps: one per 256 columns; twice that when the rows fit one wave of programs (a decode
    batch), where each row's loads are the whole critical path: 8 warps instead of 4 at H = 896
    took the 0.5B decode step (49 norms) 6.7 us lower on an H100, 22 us since o_proj's split-K
    parts (benchmarks/results/decode_step_ab_h100_v1.txt, sections 10 and 14: replayed steps;
    the 15-23 us of norm_warps_h100_v1.txt carried the whole-rollout harness's noise)."""
    R, H = res_rows.shape
    block = triton.next_power_of_2(H)
    one_wave = res_rows.is_cuda and R <= multiprocessors(res_rows.device)
    per_warp = DECODE_COLUMNS_PER_WARP if one_wave else 256
    _add_rms_norm_kernel[(R,)](
        x,
        res_rows,
        weight.contiguous(),
        out,
        new_residual,
        out if rstd is None else rstd,
        stride_x,
        res_rows.stride(0),
        H,
        1.0 / H,
        eps,
        HAS_RESIDUAL=residual is not None,
        STORE_RSTD=rstd is not None,
        SPLITS=splits,
        stride_split=stride_split,
        BLOCK=block,
        LIBDEVICE=not interpreting(),
        num_warps=min(16, max(1, block // per_warp)),
        enable_fp_fusion=False,
        enable_reflect_ftz=False,  # rsqrt without flush-to-zero, as nvcc compiles torch's
        **pdl.launch_options(),
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


# The backward's grid: tiles of ~4096 elements (8 warps, 16 per thread per tensor, loaded 16
# bytes at a time), about 4 programs per SM of whole tiles each. At
# T=4096, H=896 on an H100 (132 SMs): 512 programs of 8 rows (two tiles of 4), whose (512, H) fp32
# partial sums of d weight (1.8 MB, written once and read once by `.sum(0)`) are small beside the
# 29 MB of bf16 gradients and rows it reads and writes. ptxas (Triton 3.9, sm_90a, compiled here
# without a GPU) gives 98 registers at H=896 and 125 at H=4096, no spills: two programs fit on an
# SM at once, so the 4 per SM run in two rounds. Chosen by that arithmetic, not yet timed on a GPU.
TILE_ELEMENTS = 4096
PROGRAMS_PER_SM = 4


def _backward_grid(R: int, H: int, device: torch.device) -> tuple[int, int, int]:
    """(rows per tile, rows per program, programs) for the backward over R rows of H."""
    rows = max(1, min(16, TILE_ELEMENTS // triton.next_power_of_2(H)))
    sms = multiprocessors(device) if device.type == "cuda" else 1
    per_program = triton.cdiv(triton.cdiv(R, PROGRAMS_PER_SM * sms), rows) * rows
    return rows, per_program, triton.cdiv(R, per_program)


def _add_rms_norm_backward(
    d_normed: torch.Tensor,  # (T, H) promote(weight, x) dtype
    d_new_residual: torch.Tensor | None,  # (T, H) x's dtype
    new_residual: torch.Tensor,  # (T, H) x's dtype, unit stride on H
    rstd: torch.Tensor,  # (T,) fp32, from the forward
    weight: torch.Tensor,  # (H,)
    need_g: bool,
    need_d_weight: bool,
    tiles_per_program: int | None = None,  # tests: another partition of the rows
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(g (T, H) x's dtype, d weight (H,) weight's dtype), each None when not needed, as
    `add_rms_norm_backward_ref`: one kernel, then the sum of its per-program d weight parts in a
    fixed order (no atomics: deterministic). No host sync."""
    R, H = new_residual.shape
    device = new_residual.device
    g = torch.empty(R, H, dtype=new_residual.dtype, device=device) if need_g else None
    if R == 0 or H == 0:
        return g, torch.zeros_like(weight) if need_d_weight else None
    rows, per_program, programs = _backward_grid(R, H, device)
    if tiles_per_program is not None:
        per_program = tiles_per_program * rows
        programs = triton.cdiv(R, per_program)
    parts = torch.empty(programs, H, dtype=torch.float32, device=device) if need_d_weight else None
    d_normed = d_normed.contiguous()  # the gradient of a sum arrives expanded, with stride 0
    block = triton.next_power_of_2(H)
    _add_rms_norm_backward_kernel[(programs,)](
        d_normed,
        d_normed if d_new_residual is None else d_new_residual.contiguous(),
        new_residual,
        rstd,
        weight.contiguous(),
        new_residual if g is None else g,
        rstd if parts is None else parts,
        R,
        H,
        new_residual.stride(0),
        per_program,
        1.0 / H,
        HAS_D_RES=d_new_residual is not None,
        NEED_G=need_g,
        NEED_DW=need_d_weight,
        ROWS=rows,
        BLOCK=block,
        num_warps=min(16, max(1, rows * block // 512)),
    )
    return g, None if parts is None else parts.sum(0).to(weight.dtype)


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


class _AddRMSNorm(torch.autograd.Function):
    """The forward kernel, which also keeps each row's rstd, and one backward kernel for x,
    residual and the weight (x and residual share one gradient: new_residual = x + residual)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        rstd = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)  # (T,)
        normed, new_residual = add_rms_norm_triton(x, residual, weight, eps, rstd)
        ctx.save_for_backward(new_residual, weight, rstd)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
        return normed, new_residual

    @staticmethod
    def backward(ctx, d_normed, d_new_residual):
        new_residual, weight, rstd = ctx.saved_tensors
        need_x, need_residual, need_weight = ctx.needs_input_grad[:3]
        if d_normed is None:  # only new_residual = x + residual was used
            g, d_weight = d_new_residual, None
        else:
            g, d_weight = _add_rms_norm_backward(
                d_normed,
                d_new_residual,
                new_residual,
                rstd,
                weight,
                need_x or need_residual,
                need_weight,
            )
        return g if need_x else None, g if need_residual else None, d_weight, None


def _check_train_inputs(x, residual, weight) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be (T, H), got {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x {tuple(x.shape)} {x.dtype}, got "
            f"{tuple(residual.shape)} {residual.dtype}"
        )
    if weight.shape != (x.shape[1],):
        raise ValueError(
            f"weight must be ({x.shape[1]},) for x {tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    if not (x.dtype.is_floating_point and weight.dtype.is_floating_point):
        raise ValueError(f"x and weight must be floating point, got {x.dtype}, {weight.dtype}")


def add_rms_norm_train(
    x: torch.Tensor,  # (T, H)
    residual: torch.Tensor | None,  # (T, H) or None
    weight: torch.Tensor,  # (H,)
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed (T, H), new_residual (T, H)) as `add_rms_norm`, differentiable with respect to
    x, residual and weight: the training forward. With the kernels (CUDA, or Triton's
    interpreter) that is one launch forward, one back and a small sum over its programs.
    The outputs are bitwise `add_rms_norm_triton`'s, with or without grad. Elsewhere (or for
    dtypes the kernels do not take) the reference, by autograd. With residual None and grad
    enabled, new_residual is a view of x (autograd needs a node of its own for it)."""
    _check_train_inputs(x, residual, weight)
    on_kernel = (
        triton is not None
        and (x.is_cuda or interpreting())
        and x.dtype in KERNEL_DTYPES
        and weight.dtype in KERNEL_DTYPES
    )
    if not on_kernel:
        return add_rms_norm_ref(x, residual, weight, eps)
    tensors = (x, weight) if residual is None else (x, residual, weight)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return add_rms_norm_triton(x, residual, weight, eps)
    return _AddRMSNorm.apply(x, residual, weight, eps)

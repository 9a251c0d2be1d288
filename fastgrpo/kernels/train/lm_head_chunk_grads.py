"""The row-wise steps of the fused LM-head loss between the statistics kernel and the backward
GEMMs, per chunk of rows: each row's reference exponent (`chunk_references`), the per-row
gradient scale (`scale_rows`), the logits' gradient from the stored probabilities
(`dz_from_probs_`), and two small in-place helpers (`scale_by_`, `add_matmul_f32_`).

Split out of `lm_head_grpo_loss.py`, whose autograd function calls them; their spec is the fused
loss's reference, `lm_head_grpo_loss_ref`, which the tests compare the whole path against.
"""

from __future__ import annotations

import torch

from fastgrpo.kernels.support import interpreting, triton

if triton is not None:
    import triton.language as tl

    from fastgrpo.kernels.support import LN2_CONSTEXPR, LOG2E_CONSTEXPR

ROW_BLOCK = 128  # the largest row block of the backward kernels


if triton is not None:

    @triton.jit
    def _reference_kernel(
        logp_ptr,
        lse_ptr,
        t2_ptr,
        ref_ptr,  # out (C,): the base-2 reference of each row's stored probabilities
        flags_ptr,  # out (row blocks,) int32: 1 where a row of the block needs rescaling
        C,
        safe_log2_ratio,
        BLOCK_M: tl.constexpr,
    ):
        """The target's logit as the reference, or the log-sum-exp where the target is so
        unlikely (p below 2^-safe) that p / p_target could overflow."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        ok = rows < C
        logp = tl.load(logp_ptr + rows, mask=ok, other=0.0)
        lse2 = tl.load(lse_ptr + rows, mask=ok, other=0.0) * LOG2E_CONSTEXPR
        t2 = tl.load(t2_ptr + rows, mask=ok, other=0.0)
        unsafe = ok & (-logp * LOG2E_CONSTEXPR > safe_log2_ratio)
        tl.store(ref_ptr + rows, tl.where(unsafe, lse2, t2), mask=ok)
        tl.store(flags_ptr + tl.program_id(0), tl.max(unsafe.to(tl.int32), 0))

    @triton.jit
    def _scale_rows_kernel(
        probs_ptr,
        stride_p,  # (C, V) e = 2^(z2 - ref) per element; the target's entry is rewritten
        h_ptr,
        stride_h,
        hs_ptr,
        stride_hs,  # out (C, H): s * hidden row
        s_ptr,  # out (C,) fp32
        tgt_ptr,
        lse_ptr,
        t2_ptr,
        ref_ptr,
        g_ptr,
        H,
        V,
        inv_temp,
        BLOCK_H: tl.constexpr,
    ):
        """d(loss)/d(logits) of row r is s * e' with s = -(g / T) * 2^(ref - lse2) and e' the
        stored row with its target entry set to 2^(t2 - ref) - 2^(lse2 - ref), since
        dz = (g / T) * (onehot - p) and p = e * 2^(ref - lse2). So dH = s * (e' @ W) and
        dW = e'^T @ (s * hidden): plain GEMMs, no pass over the (C, V) values."""
        row = tl.program_id(0).to(tl.int64)
        lse2 = tl.load(lse_ptr + row) * LOG2E_CONSTEXPR
        ref = tl.load(ref_ptr + row)
        s = -tl.load(g_ptr + row) * inv_temp * tl.exp2(ref - lse2)
        tl.store(s_ptr + row, s)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            h = tl.load(h_ptr + row * stride_h + cols, mask=cols < H, other=0.0).to(tl.float32)
            tl.store(
                hs_ptr + row * stride_hs + cols, (s * h).to(hs_ptr.dtype.element_ty), mask=cols < H
            )
        target = tl.load(tgt_ptr + row).to(tl.int64)
        if (target >= 0) & (target < V):
            entry = tl.exp2(tl.load(t2_ptr + row) - ref) - tl.exp2(lse2 - ref)
            tl.store(probs_ptr + row * stride_p + target, entry.to(probs_ptr.dtype.element_ty))

    @triton.jit
    def _dz_from_probs_kernel(
        z_ptr,
        stride_zn,  # (C, V) e = 2^(z2 - ref) in, d(loss)/d(logits) out, in place
        tgt_ptr,
        lse_ptr,
        ref_ptr,
        ent_ptr,
        g_ptr,
        ge_ptr,
        limit_ptr,  # () int32: rows at and past this one are left as they are (no GEMM reads them)
        V,
        inv_temp,
        BLOCK_V: tl.constexpr,
    ):
        """dz = (g * (onehot - p) - ge * p * (ln p + H)) / T for one row and one vocabulary block:
        the entropy bonus's gradient needs ln p per element, so it cannot be a per-row scale.

        A row with g = ge = 0 (zero advantage, masked, clipped) only writes zeros: no reads.
        """
        row = tl.program_id(0).to(tl.int64)
        if row >= tl.load(limit_ptr):
            return
        cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
        ok = cols < V
        g = tl.load(g_ptr + row)
        ge = tl.load(ge_ptr + row)
        if (g == 0.0) & (ge == 0.0):
            dz = tl.zeros([BLOCK_V], tl.float32)
        else:
            shift = tl.load(ref_ptr + row) - tl.load(lse_ptr + row) * LOG2E_CONSTEXPR
            ent = tl.load(ent_ptr + row)
            target = tl.load(tgt_ptr + row).to(tl.int64)
            e = tl.load(z_ptr + row * stride_zn + cols, mask=ok, other=0.0).to(tl.float32)
            p = e * tl.exp2(shift)
            # below 1e-30, p * ln p is below 1e-28: the floor only keeps log2(0) out
            log2_p = tl.log2(tl.maximum(e, 1.0e-30)) + shift
            dz = g * (tl.where(cols == target, 1.0, 0.0) - p)
            dz -= ge * p * (log2_p * LN2_CONSTEXPR + ent)
        tl.store(
            z_ptr + row * stride_zn + cols, (dz * inv_temp).to(z_ptr.dtype.element_ty), mask=ok
        )


if triton is not None:

    @triton.jit
    def _scale_by_kernel(
        x_ptr, stride_x, rows, cols, factor_ptr, ROWS: tl.constexpr, BLOCK: tl.constexpr
    ):
        """x *= factor, in place, ROWS rows per program; nothing is read or written when the factor
        is exactly 1 (a plain `loss.backward()`), so the usual call costs a launch, not a pass."""
        factor = tl.load(factor_ptr).to(tl.float32)
        if factor != 1.0:
            first = tl.program_id(0).to(tl.int64) * ROWS
            for row in range(first, tl.minimum(first + ROWS, rows)):
                for c in range(0, cols, BLOCK):
                    offs = c + tl.arange(0, BLOCK)
                    ptrs = x_ptr + row * stride_x + offs
                    x = tl.load(ptrs, mask=offs < cols, other=0.0).to(tl.float32)
                    tl.store(ptrs, (x * factor).to(x_ptr.dtype.element_ty), mask=offs < cols)


def scale_by_(x, factor):
    """x (R, C) with unit column stride *= factor (a 0-d device tensor), without a host sync."""
    rows, cols = x.shape
    per_program = 64
    if x.numel():
        _scale_by_kernel[(triton.cdiv(rows, per_program),)](
            x,
            x.stride(0),
            rows,
            cols,
            factor.contiguous(),
            ROWS=per_program,
            BLOCK=min(1024, triton.next_power_of_2(cols)),
        )
    return x


def chunk_references(chunk):
    """(ref (C,), flags (row blocks,)) from `_reference_kernel` for a `ChunkStats`."""
    rows = chunk.logp.shape[0]
    ref = torch.empty_like(chunk.logp)
    flags = torch.empty(
        triton.cdiv(rows, chunk.block_m), dtype=torch.int32, device=chunk.logp.device
    )
    if rows:
        _reference_kernel[(flags.shape[0],)](
            chunk.logp,
            chunk.lse,
            chunk.target2,
            ref,
            flags,
            rows,
            chunk.SAFE_LOG2_RATIO,
            BLOCK_M=chunk.block_m,
        )
    return ref, flags


def scale_rows(chunk, targets, ref, g, temperature, hidden, dtype):
    """(s (C,), s * hidden (C, H) in `dtype`) from `_scale_rows_kernel`, which also rewrites the
    target entries of `chunk.probs`."""
    rows, H = hidden.shape
    scale = torch.empty_like(g)
    scaled = torch.empty(rows, H, dtype=dtype, device=hidden.device)
    if rows:
        _scale_rows_kernel[(rows,)](
            chunk.probs,
            chunk.probs.stride(0),
            hidden,
            hidden.stride(0),
            scaled,
            scaled.stride(0),
            scale,
            targets,
            chunk.lse,
            chunk.target2,
            ref,
            g,
            H,
            chunk.probs.shape[1],
            1.0 / temperature,
            BLOCK_H=min(1024, triton.next_power_of_2(H)),
        )
    return scale, scaled


def dz_from_probs_(chunk, targets, ref, g, ge, temperature, limit):
    rows, V = chunk.probs.shape
    block = 256 if interpreting() else 4096
    if rows:
        _dz_from_probs_kernel[(rows, triton.cdiv(V, block))](
            chunk.probs,
            chunk.probs.stride(0),
            targets,
            chunk.lse,
            ref,
            chunk.entropy,
            g,
            ge,
            limit,
            V,
            1.0 / temperature,
            BLOCK_V=block,
        )


def add_matmul_f32_(out, a, b):
    """out += a @ b in place, out fp32, a and b bf16 (or fp32): one GEMM with beta=1, no temporary."""
    if a.dtype == out.dtype:
        return out.addmm_(a, b)
    try:
        return torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    except (TypeError, RuntimeError, NotImplementedError):  # torch without addmm(out_dtype)
        return out.add_(torch.mm(a.float(), b.float()))

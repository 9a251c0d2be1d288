"""Rotary position embedding of q and k, in place, in one kernel, for the model's no-grad path.

What: `apply_rope_qk_(q, k, cos, sin)` rotates q (T, nh, D) and k (T, nkv, D) in place by cos/sin
(T, D) in the rotate_half convention of Hugging Face: x * cos + cat(-x2, x1) * sin, with x1, x2
the two halves of each head. One program per token rotates all its q and k heads.
`rope_write_kv_(q, k, v, cos, sin, comp_k, comp_v, slot)` is a decode step's RoPE and KV-cache
write in the same launch: the rotated k and the v of each row stored at completion slot `slot`
(as `kv_write.write_kv` stores them), which saves the decode step a launch per layer.

Why: a decode step of the 0.5B model at 64 rows takes 3.3 ms on an H100, ~2 ms of it in small
elementwise kernels of 1.5-4 us each, ~20 per layer (benchmarks/results/profile_decode_step_h100_v2
.txt). `transformer.apply_rope` is a cat, two multiplies and an add for q and again for k (plus a
negation); here one launch reads each head once and writes it back.

Numerics: as `apply_rope` rounds in the activation dtype: x * cos and rotated * sin are each
rounded to that dtype, then their sum is (the multiplies and the add are separate torch kernels).
The kernel computes each step in fp32 and rounds where torch does, with no fused multiply-add, so
the result is bitwise the torch one (the product of two 16-bit values is exact in fp32).

Reference: `apply_rope_qk_ref`, the model's own `apply_rope` on q and on k; `rope_write_kv_ref`
adds `write_kv_ref`.
"""

from __future__ import annotations

import torch

from fastgrpo.kernels.kv_write import check_cache_write, write_kv_ref
from fastgrpo.kernels.lm_head_stats import triton

if triton is not None:
    import triton.language as tl

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def apply_rope_qk_ref(
    q: torch.Tensor,  # (T, nh, D)
    k: torch.Tensor,  # (T, nkv, D)
    cos: torch.Tensor,  # (T, D)
    sin: torch.Tensor,  # (T, D)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated q, rotated k), new tensors, by the model's `apply_rope`."""
    from fastgrpo.models.transformer import apply_rope

    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


if triton is not None:

    @triton.jit
    def _rotate_heads(
        base,  # pointer to head 0, element 0 of this token
        stride_h,
        n_heads,
        c1,
        c2,
        s1,
        s2,  # (HALF_PAD,) fp32 halves of this token's cos and sin
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        copy_base=None,  # with COPY: pointer to head 0 of a contiguous (n_heads, 2 * HALF) copy
        COPY: tl.constexpr = False,
    ):
        """Rotate n_heads heads in place, rounding each product and the sum to their dtype; with
        COPY, also store the rotated heads at copy_base (the KV cache)."""
        heads = tl.arange(0, HEADS_PAD)
        offs = tl.arange(0, HALF_PAD)
        ok = (heads < n_heads)[:, None] & (offs < HALF)[None, :]
        at = base + heads[:, None].to(tl.int64) * stride_h + offs[None, :]  # (HEADS_PAD, HALF_PAD)
        x1 = tl.load(at, mask=ok, other=0.0)
        x2 = tl.load(at + HALF, mask=ok, other=0.0)
        dtype = x1.dtype
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        # first half x1 * cos1 + (-x2) * sin1, second half x2 * cos2 + x1 * sin2, each product
        # rounded to the activation dtype before the add, as torch's separate kernels round it
        lo1 = (f1 * c1[None, :]).to(dtype).to(tl.float32)
        lo2 = (-f2 * s1[None, :]).to(dtype).to(tl.float32)
        hi1 = (f2 * c2[None, :]).to(dtype).to(tl.float32)
        hi2 = (f1 * s2[None, :]).to(dtype).to(tl.float32)
        lo, hi = lo1 + lo2, hi1 + hi2
        tl.store(at, lo.to(dtype), mask=ok)
        tl.store(at + HALF, hi.to(dtype), mask=ok)
        if COPY:
            copy_at = copy_base + heads[:, None].to(tl.int64) * (2 * HALF) + offs[None, :]
            tl.store(copy_at, lo.to(dtype), mask=ok)
            tl.store(copy_at + HALF, hi.to(dtype), mask=ok)

    @triton.jit
    def _rope_qk_kernel(
        q_ptr,  # (T, nh, D), unit stride on D
        k_ptr,  # (T, nkv, D), unit stride on D
        cos_ptr,
        sin_ptr,  # (T, D), unit stride on D
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_ct,
        stride_st,
        v_ptr,  # (T, nkv, D), unit stride on D; unused without WRITE_KV
        ck_ptr,
        cv_ptr,  # (T, Tc, nkv, D) contiguous completion caches; unused without WRITE_KV
        slot_ptr,  # () int64 cache slot; unused without WRITE_KV
        stride_vt,
        stride_vh,
        Tc,
        NQ: tl.constexpr,
        NK: tl.constexpr,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        NQ_PAD: tl.constexpr,
        NK_PAD: tl.constexpr,
        WRITE_KV: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, HALF_PAD)
        ok = offs < HALF
        cos_at = cos_ptr + t * stride_ct + offs
        sin_at = sin_ptr + t * stride_st + offs
        c1 = tl.load(cos_at, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_at + HALF, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_at, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_at + HALF, mask=ok, other=0.0).to(tl.float32)
        _rotate_heads(q_ptr + t * stride_qt, stride_qh, NQ, c1, c2, s1, s2, HALF, HALF_PAD, NQ_PAD)
        if WRITE_KV:
            # this token's cache row: (t, slot) of (T, Tc, nkv, D)
            cache_row = (t * Tc + tl.load(slot_ptr)) * (NK * 2 * HALF)
            k_base = k_ptr + t * stride_kt
            _rotate_heads(
                k_base,
                stride_kh,
                NK,
                c1,
                c2,
                s1,
                s2,
                HALF,
                HALF_PAD,
                NK_PAD,
                ck_ptr + cache_row,
                True,
            )
            heads = tl.arange(0, NK_PAD)
            dims = tl.arange(0, 2 * HALF_PAD)
            ok_v = (heads < NK)[:, None] & (dims < 2 * HALF)[None, :]
            at_v = v_ptr + t * stride_vt + heads[:, None].to(tl.int64) * stride_vh + dims[None, :]
            to_v = cv_ptr + cache_row + heads[:, None].to(tl.int64) * (2 * HALF) + dims[None, :]
            tl.store(to_v, tl.load(at_v, mask=ok_v, other=0.0), mask=ok_v)
        else:
            k_base = k_ptr + t * stride_kt
            _rotate_heads(k_base, stride_kh, NK, c1, c2, s1, s2, HALF, HALF_PAD, NK_PAD)


def _check_inputs(q, k, cos, sin) -> None:
    """Shapes, dtypes, layout and device that the kernel assumes; a clear error otherwise."""
    if q.dim() != 3 or k.dim() != 3 or cos.dim() != 2 or sin.shape != cos.shape:
        raise ValueError(
            f"q (T, nh, D), k (T, nkv, D), cos and sin (T, D) expected; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    T, _, D = q.shape
    if k.shape[0] != T or k.shape[2] != D or cos.shape != (T, D) or D % 2:
        raise ValueError(
            f"q, k, cos and sin must share T and an even D; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, cos/sin {tuple(cos.shape)}"
        )
    tensors = (q, k, cos, sin)
    if q.dtype not in KERNEL_DTYPES or any(t.dtype != q.dtype for t in tensors):
        raise ValueError(
            f"q, k, cos and sin must share one of {KERNEL_DTYPES} (cos/sin in the activation "
            f"dtype, as RotaryTable.lookup gives them); got {[t.dtype for t in tensors]}"
        )
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("q, k, cos and sin need unit stride on their last dim")
    if any(t.device != q.device for t in tensors):
        raise ValueError("q, k, cos and sin must live on one device")


def apply_rope_qk_triton(q, k, cos, sin) -> None:
    """Rotate q and k in place as `apply_rope_qk_ref` computes them, by the Triton kernel. No
    host sync, so it can be captured in a CUDA graph."""
    _launch(q, k, cos, sin, None)


def rope_write_kv_triton(q, k, v, cos, sin, comp_k, comp_v, slot) -> None:
    """As `rope_write_kv_ref`, by one Triton launch (one program per row)."""
    check_cache_write(comp_k, comp_v, k, v)
    if v.stride(-1) != 1:
        raise ValueError("v needs unit stride on its last dim")
    _launch(q, k, cos, sin, (v, comp_k, comp_v, slot))


def _launch(q, k, cos, sin, kv_write) -> None:
    if triton is None:
        raise RuntimeError("the Triton RoPE kernel needs `pip install triton`")
    _check_inputs(q, k, cos, sin)
    T, nh, D = q.shape
    nkv = k.shape[1]
    if T == 0:
        return
    v, comp_k, comp_v, slot = kv_write if kv_write is not None else (k, q, q, q)
    _rope_qk_kernel[(T,)](
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        v,
        comp_k,
        comp_v,
        slot,
        v.stride(0),
        v.stride(1),
        comp_k.shape[1] if kv_write is not None else 0,
        NQ=nh,
        NK=nkv,
        HALF=D // 2,
        HALF_PAD=triton.next_power_of_2(D // 2),
        NQ_PAD=triton.next_power_of_2(nh),
        NK_PAD=triton.next_power_of_2(nkv),
        WRITE_KV=kv_write is not None,
        num_warps=4,
        enable_fp_fusion=False,
    )


def apply_rope_qk_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q (T, nh, D) and k (T, nkv, D) in place by cos/sin (T, D): the kernel on CUDA
    tensors of the kernel's dtypes, else the reference copied back."""
    if triton is not None and q.is_cuda and q.dtype in KERNEL_DTYPES:
        return apply_rope_qk_triton(q, k, cos, sin)
    q_rot, k_rot = apply_rope_qk_ref(q, k, cos, sin)
    q.copy_(q_rot)
    k.copy_(k_rot)


def rope_write_kv_ref(q, k, v, cos, sin, comp_k, comp_v, slot) -> None:
    """A decode step's RoPE and KV-cache write: q (B, nh, D) and k (B, nkv, D) rotated in place,
    then k and v (B, nkv, D) stored at completion slot `slot` (() int64) of comp_k and comp_v
    (B, Tc, nkv, D)."""
    apply_rope_qk_(q, k, cos, sin)
    write_kv_ref(comp_k, comp_v, k, v, slot)


def rope_write_kv_(q, k, v, cos, sin, comp_k, comp_v, slot) -> None:
    """`rope_write_kv_ref` by one kernel on CUDA tensors it can read, else the reference."""
    if (
        triton is not None
        and q.is_cuda
        and q.dtype in KERNEL_DTYPES
        and comp_k.is_contiguous()
        and comp_v.is_contiguous()
        and v.stride(-1) == 1
    ):
        return rope_write_kv_triton(q, k, v, cos, sin, comp_k, comp_v, slot)
    return rope_write_kv_ref(q, k, v, cos, sin, comp_k, comp_v, slot)

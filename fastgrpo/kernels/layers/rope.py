"""Rotary position embedding of q and k in one kernel: in place for the model's no-grad path, and
out of place with a one-kernel backward for its training forward.

What: `apply_rope_qk_(q, k, cos, sin)` rotates q (T, nh, D) and k (T, nkv, D) in place by cos/sin
(T, D) in the rotate_half convention of Hugging Face: x * cos + cat(-x2, x1) * sin, with x1, x2
the two halves of each head. One program per token rotates all its q and k heads.
`rope_write_kv_(q, k, v, cos, sin, comp_k, comp_v, slot)` is a decode step's RoPE and KV-cache
write in the same launch: the rotated k and the v of each row stored at completion slot `slot`
(as `kv_write.write_kv` stores them), which saves the decode step a launch per layer.
`rope_qk_train(q, k, cos, sin)` returns the rotated q and k as new tensors, differentiable: its
backward rotates both incoming gradients back in one launch. Rotating x by (cos, sin) is a linear
map whose transpose, on the halves, is dx1 = dy1 * cos1 + dy2 * sin2 and
dx2 = dy2 * cos2 - dy1 * sin1: RoPE by -sin when both halves share their angles, as the model's
tables do (angles cat(freqs, freqs)); the kernel applies the transpose, so it holds for any table.

Why: a decode step of the 0.5B model at 64 rows takes 3.3 ms on an H100, ~2 ms of it in small
elementwise kernels of 1.5-4 us each, ~20 per layer (benchmarks/results/profile_decode_step_h100_v2
.txt). `apply_rope` (the model's PyTorch path) is a cat, two multiplies and an add for q and again for k (plus a
negation); here one launch reads each head once and writes it back. In training, torch's autograd
runs about as many kernels again backward (two multiplies, the negation, slice gradients and
their sum, for q and for k); here one launch rotates both gradients back.

Numerics: as `apply_rope` rounds in the activation dtype: x * cos and rotated * sin are each
rounded to that dtype, then their sum is (the multiplies and the add are separate torch kernels).
The kernel computes each step in fp32 and rounds where torch does, with no fused multiply-add, so
the result is bitwise the torch one (the product of two 16-bit values is exact in fp32). The
backward computes each gradient in fp32 and rounds it once (torch's autograd rounds the two
products, and again their sum), so it is at least as accurate as torch's.

Reference: `apply_rope_qk_ref`, the model's own `apply_rope` on q and on k; `rope_write_kv_ref`
adds `write_kv_ref`.
"""

from __future__ import annotations

import torch

from fastgrpo.kernels.decode import pdl
from fastgrpo.kernels.decode.kv_write import check_cache_write, write_kv_ref
from fastgrpo.kernels.support import interpreting, triton

if triton is not None:
    import triton.language as tl

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D) rotated by cos/sin (T, D), in the rotate_half convention of HF: the
    model's RoPE (its PyTorch path), and the spec of the kernels here."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (T, heads, D)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rope_qk_ref(
    q: torch.Tensor,  # (T, nh, D)
    k: torch.Tensor,  # (T, nkv, D)
    cos: torch.Tensor,  # (T, D)
    sin: torch.Tensor,  # (T, D)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated q, rotated k), new tensors, by the model's `apply_rope`."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


if triton is not None:

    @triton.jit
    def _rotate(x1, x2, c1, c2, s1, s2):
        """(lo, hi) fp32 halves of x rotated as `apply_rope` rounds: x1 * cos1 + (-x2) * sin1 and
        x2 * cos2 + x1 * sin2, each product rounded to x's dtype before the add, as torch's
        separate kernels round it; the caller rounds the sums."""
        dtype = x1.dtype
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        lo1 = (f1 * c1[None, :]).to(dtype).to(tl.float32)
        lo2 = (-f2 * s1[None, :]).to(dtype).to(tl.float32)
        hi1 = (f2 * c2[None, :]).to(dtype).to(tl.float32)
        hi2 = (f1 * s2[None, :]).to(dtype).to(tl.float32)
        return lo1 + lo2, hi1 + hi2

    @triton.jit
    def _rotate_back(y1, y2, c1, c2, s1, s2):
        """(lo, hi) fp32 halves of the transpose of the rotation applied to the gradient y:
        y1 * cos1 + y2 * sin2 and y2 * cos2 - y1 * sin1, unrounded."""
        f1, f2 = y1.to(tl.float32), y2.to(tl.float32)
        return f1 * c1[None, :] + f2 * s2[None, :], f2 * c2[None, :] - f1 * s1[None, :]

    @triton.jit
    def _table_halves(
        cos_ptr, sin_ptr, t, stride_ct, stride_st, HALF: tl.constexpr, HALF_PAD: tl.constexpr
    ):
        """(cos1, cos2, sin1, sin2), the (HALF_PAD,) fp32 halves of token t's cos and sin."""
        offs = tl.arange(0, HALF_PAD)
        ok = offs < HALF
        cos_at = cos_ptr + t * stride_ct + offs
        sin_at = sin_ptr + t * stride_st + offs
        c1 = tl.load(cos_at, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_at + HALF, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_at, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_at + HALF, mask=ok, other=0.0).to(tl.float32)
        return c1, c2, s1, s2

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
        lo, hi = _rotate(x1, x2, c1, c2, s1, s2)
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
        PDL: tl.constexpr = False,  # programmatic dependent launch (kernels.pdl)
    ):
        pdl.start(PDL)
        pdl.wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        c1, c2, s1, s2 = _table_halves(cos_ptr, sin_ptr, t, stride_ct, stride_st, HALF, HALF_PAD)
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

    @triton.jit
    def _rotate_heads_into(
        src,  # pointer to head 0, element 0 of this token; heads stride_h apart
        stride_h,
        dst,  # pointer to head 0 of this token's contiguous (n_heads, 2 * HALF) output
        n_heads,
        c1,
        c2,
        s1,
        s2,  # (HALF_PAD,) fp32 halves of this token's cos and sin
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        BACKWARD: tl.constexpr,
    ):
        """Store n_heads heads of src rotated (as `_rotate_heads`, bitwise) or, with BACKWARD,
        rotated back (fp32, one rounding) at dst."""
        heads = tl.arange(0, HEADS_PAD)
        offs = tl.arange(0, HALF_PAD)
        ok = (heads < n_heads)[:, None] & (offs < HALF)[None, :]
        at = src + heads[:, None].to(tl.int64) * stride_h + offs[None, :]  # (HEADS_PAD, HALF_PAD)
        x1 = tl.load(at, mask=ok, other=0.0)
        x2 = tl.load(at + HALF, mask=ok, other=0.0)
        if BACKWARD:
            lo, hi = _rotate_back(x1, x2, c1, c2, s1, s2)
        else:
            lo, hi = _rotate(x1, x2, c1, c2, s1, s2)
        to = dst + heads[:, None].to(tl.int64) * (2 * HALF) + offs[None, :]
        tl.store(to, lo.to(x1.dtype), mask=ok)
        tl.store(to + HALF, hi.to(x1.dtype), mask=ok)

    @triton.jit
    def _rope_qk_into_kernel(
        q_ptr,  # (T, nh, D), unit stride on D; unused without DO_Q
        k_ptr,  # (T, nkv, D), unit stride on D; unused without DO_K
        q_out_ptr,  # (T, nh, D) contiguous
        k_out_ptr,  # (T, nkv, D) contiguous
        cos_ptr,
        sin_ptr,  # (T, D), unit stride on D
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_ct,
        stride_st,
        NQ: tl.constexpr,
        NK: tl.constexpr,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        NQ_PAD: tl.constexpr,
        NK_PAD: tl.constexpr,
        DO_Q: tl.constexpr,
        DO_K: tl.constexpr,
        BACKWARD: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        c1, c2, s1, s2 = _table_halves(cos_ptr, sin_ptr, t, stride_ct, stride_st, HALF, HALF_PAD)
        if DO_Q:
            q_src, q_dst = q_ptr + t * stride_qt, q_out_ptr + t * (NQ * 2 * HALF)
            _rotate_heads_into(
                q_src, stride_qh, q_dst, NQ, c1, c2, s1, s2, HALF, HALF_PAD, NQ_PAD, BACKWARD
            )
        if DO_K:
            k_src, k_dst = k_ptr + t * stride_kt, k_out_ptr + t * (NK * 2 * HALF)
            _rotate_heads_into(
                k_src, stride_kh, k_dst, NK, c1, c2, s1, s2, HALF, HALF_PAD, NK_PAD, BACKWARD
            )


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
        **pdl.launch_options(),
    )


def rope_qk_triton(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated q, rotated k) as new contiguous tensors, bitwise `apply_rope_qk_ref`, by one
    Triton launch; q and k are read, not written (they may be views of a packed qkv)."""
    return _launch_into(q, k, cos, sin, backward=False)


def rope_qk_backward_triton(d_q_rot, d_k_rot, cos, sin):
    """(d_q, d_k), new contiguous tensors: the gradients of rotated q and k (either may be None,
    and then so is its result) rotated back, in fp32 rounded once, by one Triton launch."""
    return _launch_into(d_q_rot, d_k_rot, cos, sin, backward=True)


def _launch_into(q, k, cos, sin, backward: bool):
    if triton is None:
        raise RuntimeError("the Triton RoPE kernel needs `pip install triton`")
    if q is None and k is None:
        return None, None
    q_in, k_in = (q if q is not None else k), (k if k is not None else q)  # a stand-in for None
    _check_inputs(q_in, k_in, cos, sin)
    q_out = None if q is None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = None if k is None else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    T, nh, D = q_in.shape
    nkv = k_in.shape[1]
    if T == 0:
        return q_out, k_out
    _rope_qk_into_kernel[(T,)](
        q_in,
        k_in,
        q_out if q_out is not None else k_out,
        k_out if k_out is not None else q_out,
        cos,
        sin,
        q_in.stride(0),
        q_in.stride(1),
        k_in.stride(0),
        k_in.stride(1),
        cos.stride(0),
        sin.stride(0),
        NQ=nh,
        NK=nkv,
        HALF=D // 2,
        HALF_PAD=triton.next_power_of_2(D // 2),
        NQ_PAD=triton.next_power_of_2(nh),
        NK_PAD=triton.next_power_of_2(nkv),
        DO_Q=q is not None,
        DO_K=k is not None,
        BACKWARD=backward,
        num_warps=4,
        # the forward rounds as torch does, so no fused multiply-add; the backward may fuse
        enable_fp_fusion=backward,
    )
    return q_out, k_out


class _RopeQKTrain(torch.autograd.Function):
    """Rotated q and k by `rope_qk_triton`; the backward rotates the incoming gradients back by
    `rope_qk_backward_triton`. Only cos and sin are saved; they get no gradient."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no work
        ctx.save_for_backward(cos, sin)
        return rope_qk_triton(q, k, cos, sin)

    @staticmethod
    def backward(ctx, d_q_rot, d_k_rot):
        cos, sin = ctx.saved_tensors
        d_q_rot = _unit_last_stride(d_q_rot) if ctx.needs_input_grad[0] else None
        d_k_rot = _unit_last_stride(d_k_rot) if ctx.needs_input_grad[1] else None
        d_q, d_k = rope_qk_backward_triton(d_q_rot, d_k_rot, cos, sin)
        return d_q, d_k, None, None


def _unit_last_stride(x: torch.Tensor | None) -> torch.Tensor | None:
    """x as the kernel reads it: itself when its last dim has unit stride, else a contiguous copy
    (e.g. of the expanded gradient of a sum; `contiguous()` would keep an empty one's strides)."""
    if x is None or x.stride(-1) == 1:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def rope_qk_train(
    q: torch.Tensor,  # (T, nh, D)
    k: torch.Tensor,  # (T, nkv, D)
    cos: torch.Tensor,  # (T, D)
    sin: torch.Tensor,  # (T, D)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated q, rotated k), new tensors, differentiable with respect to q and k: one forward
    and one backward launch on CUDA tensors (or in the interpreter) that the kernel reads (one of
    its dtypes shared by all four, unit stride on D, cos and sin needing no gradient), else
    `apply_rope_qk_ref` with torch's autograd. q and k may be views of a packed qkv projection."""
    tensors = (q, k, cos, sin)
    if (
        triton is not None
        and (q.is_cuda or interpreting())
        and q.dtype in KERNEL_DTYPES
        and all(t.dtype == q.dtype and t.stride(-1) == 1 for t in tensors)
        and not (cos.requires_grad or sin.requires_grad)
    ):
        return _RopeQKTrain.apply(q, k, cos, sin)
    return apply_rope_qk_ref(q, k, cos, sin)


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

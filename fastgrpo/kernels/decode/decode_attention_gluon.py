"""The decode step's RoPE, KV write and attention in Gluon for Hopper GPUs, with the cached keys and
values loaded by bulk tensor copies before the programmatic-dependent-launch wait.

What: `launch(q, k, v, cos, sin, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, slot)` does what
`decode_attention.rope_decode_attention` does (see `rope_decode_attention_ref`): rotates this step's
q and k, writes k and v at completion slot `slot`, and returns the attention of each row's queries
over its prompt's keys, its completion slots 0..slot-1 and the new key. `applies` says where it
serves: bf16 on a Hopper GPU, head dim 64 or 128, at most 16 query heads per kv head, and between
one program per two multiprocessors and one per multiprocessor (rows x kv heads), the decode batch
of a GRPO step at 0.5B. With fewer rows the Triton kernel's key splits serve better; with more,
its programs queue in waves, so their loads cannot start before the wait, and the ring of its
stages exposes each block's latency on long completions: at 256 rows x 1024 new tokens (workload
B) 2.25 ms per step against 2.19-2.23 with the Triton kernel, and at the 7B shape with 64 rows
(256 programs) 6.73-6.75 against 6.72-6.73 (benchmarks/results/decode_attention_gluon_h100_v1.txt).

How: one program per (row, kv head), 4 warps. The prompt's keys and the row's cached completion
keys are walked in blocks of BLOCK_N keys (prompt blocks, then completion blocks), each block's
keys and values one TMA box apiece through a ring of STAGES shared-memory stages (a last, partial
block in boxes of PART_ROWS keys, those past its keys placed beyond the tensor's end, where TMA
fills zeros without reading memory; the values past its last key are zeroed in registers, since
the slots there may hold anything an earlier wave left, inf or nan included). The cache
contents were written before this graph replay started (earlier steps' kernels, and the prefill),
so the first block is asked for before the PDL wait; after it, this step's q, k and v and cos/sin
are loaded first and the rest of the ring's blocks asked for behind them (`EARLY_BLOCKS`). The
rep query heads are the rows of a [16, D] tile for mma_v2 (m16n8k16; wgmma's 64 rows would be
7/64 full at the 0.5B shape); an online softmax in base 2 over the blocks, then the new key,
rotated and stored at the slot, folded in from registers as the Triton kernel folds it.

Why: the Triton kernel computes every key's address (a pointer per element, chosen between the
two caches) and loads only after the wait. On an H100 at the 0.5B shape and 64 rows, a spike of
this kernel without RoPE took 4.2 us per call at slots 64-128 and 6.2 at slot 255, against 5.1-5.7
and 8.4 for the Triton kernel with RoPE (benchmarks/results/decode_attention_gluon_h100_v1.txt).
In the decode step, replayed: -7.7 us against the Triton kernel (decode_step_ab_h100_v1.txt,
section 10; the -22 us first recorded carried the whole-rollout harness's noise).

Numerics: q and the new key rotated as `_rotate_rows` rotates them (each product rounded to bf16,
the fp32 sum rounded), so the cache gets the Triton kernel's bits; scores and outputs are fp32 sums
of exact bf16 products like the Triton kernel's, in another order (other block sizes), so outputs
may differ from it by bf16 rounding.

Caveat (the pre-wait loads): they are correct because every decode step's cache writes complete
before the next step's kernels start: each step is its own CUDA graph replay, and an eager step
holds plain launches (the LM head: cuBLAS, or the fused LM head + sampler of `lm_head_sample`)
that end every PDL chain. A decode step with no
such boundary between steps would need the loads after the wait. FASTGRPO_GLUON=0 keeps
the Triton kernel.

Reference: `decode_attention.rope_decode_attention_ref`; the Triton kernel serves everywhere else.
"""

from __future__ import annotations

import math

import torch

from fastgrpo import switches
from fastgrpo.kernels.decode import pdl
from fastgrpo.kernels.decode.pdl import gluon_start, gluon_wait
from fastgrpo.kernels.support import (
    LOG2E,
    bf16_shared_layout,
    gluon,
    is_hopper,
    multiprocessors,
    warn_not_compiled,
)

if gluon is not None:  # support found triton's Gluon layer
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


# FASTGRPO_GLUON=0 keeps the decode attention on the Triton kernel
ENABLED = switches.GLUON
QUERY_ROWS = 16
"""The query tile's rows (mma_v2's m16): at most this many query heads per kv head."""
PART_ROWS = 32
"""Rows per box of a last, partial block: only its keys in use, rounded up to 32, are read."""
EARLY_BLOCKS = 1
"""Cache blocks asked for before the PDL wait; the rest of the ring's first fill is asked for
after this step's q, k and v (from L2). Timestamps in the kernel (clock64, A's decode step)
showed each program starting about when q/k/v's GEMM had ended, so its wait returned at once,
and this step's q arriving 2-4 us after it, behind every block's bulk copies, then the blocks
folded one after another. With one block early and q, k and v asked for first, each fold
starts when its block lands: -30.3 us per step of A, 8 of 8 rounds (control -1.4); all blocks
early but k and v with q -11.2; no block early +9.3 and -3.6 with k and v
(benchmarks/results/decode_attention_stages_h100_v1.txt, sections 11-13)."""
_failed = False


def blocks(d: int) -> tuple[int, int]:
    """(BLOCK_N, STAGES): 128-key blocks, 4 stages at d = 64; 64-key blocks, 4 stages at d = 128.
    Either takes 128 KB of shared memory, more than half of a multiprocessor's 227 KB, so no two
    programs share one (a wave of at most one program per multiprocessor is where the kernel
    serves). With 3 stages (96 KB) two could, and A's decode step was 14.0 us slower, 8 of 8
    rounds (control 1.3), with 6 stages (192 KB) 2 us slower than with 4; 256-key blocks were 38 us
    slower (benchmarks/results/decode_attention_stages_h100_v1.txt). A's blocks never pass 3, so
    the fourth stage is only room that keeps a second program off the multiprocessor."""
    return (128, 4) if d <= 64 else (64, 4)


if gluon is not None:
    _ROWS = gl.constexpr(QUERY_ROWS)

    @gluon.jit
    def _copy_block(
        full_desc, part_desc, row, valid, past_end, col, bar, dst, BLOCK_N: gl.constexpr
    ):
        """BLOCK_N rows of a cache from `row` into dst: one box when all `valid` of them are keys
        to read, else boxes of PART rows for the valid part and boxes wholly past the tensor's end
        (`past_end`) for the rest, which TMA fills with zeros without reading memory; either way
        dst's bytes all arrive, as the stage's mbarrier expects."""
        if valid >= BLOCK_N:
            tma.async_copy_global_to_shared(full_desc, [row, col], bar, dst)
        else:
            PART: gl.constexpr = part_desc.block_type.shape[0]
            for j in gl.static_range(BLOCK_N // PART):
                at = gl.where(j * PART < valid, row + j * PART, past_end)
                tma.async_copy_global_to_shared(
                    part_desc, [at, col], bar, dst.slice(j * PART, PART)
                )

    @gluon.jit
    def _valid_keys(i, n_prompt, n_comp, n_prompt_blocks, BLOCK_N: gl.constexpr):
        """How many of block i's BLOCK_N keys are keys to read: prompt blocks come first, then
        the row's completion blocks."""
        return gl.where(
            i < n_prompt_blocks,
            n_prompt - i * BLOCK_N,
            n_comp - (i - n_prompt_blocks) * BLOCK_N,
        )

    @gluon.jit
    def _issue(
        descs, k_smem, v_smem, ready,
        i, total, n_prompt, n_comp, n_prompt_blocks, prompt_row0, comp_row0, col, prompt_rows,
        comp_rows, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        """Block i's keys and values into its stage when i < total; returns i + 1."""
        pk_desc, pv_desc, ck_desc, cv_desc, pk_part, pv_part, ck_part, cv_part = descs
        if i < total:
            stage = i % STAGES
            bar = ready.index(stage)
            mbarrier.expect(bar, 2 * pk_desc.block_type.nbytes)
            k_dst = k_smem.index(stage)
            v_dst = v_smem.index(stage)
            valid = _valid_keys(i, n_prompt, n_comp, n_prompt_blocks, BLOCK_N)
            if i < n_prompt_blocks:
                row = prompt_row0 + i * BLOCK_N
                _copy_block(pk_desc, pk_part, row, valid, prompt_rows, col, bar, k_dst, BLOCK_N)
                _copy_block(pv_desc, pv_part, row, valid, prompt_rows, col, bar, v_dst, BLOCK_N)
            else:
                row = comp_row0 + (i - n_prompt_blocks) * BLOCK_N
                _copy_block(ck_desc, ck_part, row, valid, comp_rows, col, bar, k_dst, BLOCK_N)
                _copy_block(cv_desc, cv_part, row, valid, comp_rows, col, bar, v_dst, BLOCK_N)
        return i + 1

    @gluon.jit
    def _rotate(x, x_swapped, cos_row, sin_signed):
        """`decode_attention._rotate_rows`: x * cos + x_swapped * sin_signed, each product
        rounded to x's dtype before the fp32 sum, the sum rounded."""
        dtype: gl.constexpr = x.dtype
        a = (x.to(gl.float32) * cos_row).to(dtype).to(gl.float32)
        c = (x_swapped.to(gl.float32) * sin_signed).to(dtype).to(gl.float32)
        return (a + c).to(dtype)

    @gluon.jit
    def _projected(at, cols, mask, part_stride, bias_ptr, PARTS: gl.constexpr, dtype: gl.constexpr):
        """This step's q, k or v at pointers `at` (columns `cols` of the projection): as stored
        (PARTS 0), or the sum of PARTS fp32 split-K parts in order, plus the bias where one is
        given (`bias_ptr` not None), rounded once to dtype, as a GEMM's fp32 output is."""
        if PARTS == 0:
            return gl.load(at, mask=mask, other=0.0)
        x = gl.load(at, mask=mask, other=0.0)
        for part in gl.static_range(1, PARTS):
            x += gl.load(at + part * part_stride, mask=mask, other=0.0)
        if bias_ptr is not None:
            x += gl.load(bias_ptr + cols, mask=mask, other=0.0).to(gl.float32)
        return x.to(dtype)

    @gluon.jit
    def _attend(q_dot, k_tile, v_tile, valid, m_i, l_i, acc, scale2, N: gl.constexpr,
                mma: gl.constexpr, a_layout: gl.constexpr, b_layout: gl.constexpr):  # fmt: skip
        """Fold N cached keys and values (shared-memory tiles [N, D], the first `valid` >= 1 of
        them keys to read) into the online softmax (m_i, l_i) and the output acc."""
        k_dot = k_tile.permute((1, 0)).load(b_layout)
        s = mma_v2(q_dot, k_dot, gl.zeros([q_dot.shape[0], N], gl.float32, layout=mma))
        keys = gl.arange(0, N, layout=gl.SliceLayout(0, mma))
        s = gl.where(gl.expand_dims(keys < valid, 0), s * scale2, float("-inf"))
        # valid >= 1, so m_new is finite
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        p_dot = gl.convert_layout(p.to(k_tile.dtype), a_layout)
        v_dot = v_tile.load(b_layout)
        if valid < N:  # zero the values past the last key: 0 * a stale inf is nan
            value_rows = gl.arange(0, N, layout=gl.SliceLayout(1, b_layout))
            v_dot = gl.where(gl.expand_dims(value_rows < valid, 1), v_dot, 0.0)
        acc = mma_v2(p_dot, v_dot, acc * gl.expand_dims(alpha, 1))
        return m_new, l_i, acc

    @gluon.jit
    def _attention_kernel(
        q_ptr,  # (B, nh, D): heads D apart, rows stride_q apart
        k_ptr,
        v_ptr,  # (B, nkv, D) this step's k (not yet rotated) and v: heads D apart
        q_bias,
        k_bias,
        v_bias,  # with PARTS: q, k and v's biases (nh * D,), (nkv * D,) each, or None
        part_stride,  # with PARTS: elements between one part of q, k and v and the next
        cos_ptr,
        sin_ptr,  # (B, D) each row's cos and sin
        pk_desc,
        pv_desc,  # prompt caches as (P * Lp, nkv * D), box [BLOCK_N, D]
        ck_desc,
        cv_desc,  # completion caches as (B * Tc, nkv * D), box [BLOCK_N, D]
        pk_part,
        pv_part,
        ck_part,
        cv_part,  # the same four with boxes of fewer rows, for a last, partial block
        ck_ptr,
        cv_ptr,  # the completion caches (B, Tc, nkv, D), for the slot's write
        out_ptr,  # (B, nh, D) contiguous
        lens_ptr,  # (P,) valid prompt keys
        slot_ptr,  # (): completion slots 0..slot-1 are cached; the new k, v go to `slot`
        stride_q,
        stride_k,
        stride_v,
        stride_cos,
        stride_sin,
        G,
        Lp,
        Tc,
        n_prompts,  # P
        n_rows,  # B
        scale2,  # log2(e) / sqrt(D)
        NKV: gl.constexpr,
        REP: gl.constexpr,
        D: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        PDL: gl.constexpr,
        PARTS: gl.constexpr,  # 0: q, k, v as given; S: each the sum of S fp32 parts (+ bias)
        EARLY: gl.constexpr,  # cache blocks asked for before the PDL wait (<= STAGES)
    ):
        pid = gl.program_id(0)
        b = pid // NKV
        kvh = pid % NKV
        prompt = b // G
        k_smem = gl.allocate_shared_memory(pk_desc.dtype, [STAGES, BLOCK_N, D], pk_desc.layout)
        v_smem = gl.allocate_shared_memory(pk_desc.dtype, [STAGES, BLOCK_N, D], pk_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for z in gl.static_range(STAGES):
            mbarrier.init(ready.index(z), count=1)
        fence_async_shared()
        gluon_start(PDL)

        # the cached keys first: written before this replay started (see the module's caveat)
        n_prompt = gl.minimum(gl.load(lens_ptr + prompt), Lp).to(gl.int32)
        slot = gl.load(slot_ptr)
        n_comp = gl.minimum(slot, Tc).to(gl.int32)
        n_prompt_blocks = gl.cdiv(n_prompt, BLOCK_N)
        total = n_prompt_blocks + gl.cdiv(n_comp, BLOCK_N)
        descs = (pk_desc, pv_desc, ck_desc, cv_desc, pk_part, pv_part, ck_part, cv_part)
        ring = (descs, k_smem, v_smem, ready)
        counts = (n_prompt, n_comp, n_prompt_blocks)
        rows0 = (prompt * Lp, b * Tc, kvh * D, n_prompts * Lp, n_rows * Tc)
        issued = total * 0
        for _ in gl.static_range(EARLY):
            issued = _issue(*ring, issued, total, *counts, *rows0, BLOCK_N, STAGES)
        gluon_wait(PDL)

        # q's rep heads, rotated, as a [16, D] tile (rows past REP are zeros)
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        heads = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, blk))
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
        swapped = (offs_d + D // 2) % D
        head_ok = gl.expand_dims(heads < REP, 1)
        dtype: gl.constexpr = pk_desc.dtype
        q_cols = gl.expand_dims(kvh * REP + heads, 1) * D
        q_row = q_ptr + b.to(gl.int64) * stride_q
        q_at = q_cols + gl.expand_dims(offs_d, 0)
        q_swapped_at = q_cols + gl.expand_dims(swapped, 0)
        q = _projected(q_row + q_at, q_at, head_ok, part_stride, q_bias, PARTS, dtype)
        q_swapped = _projected(
            q_row + q_swapped_at, q_swapped_at, head_ok, part_stride, q_bias, PARTS, dtype
        )
        cos_row = gl.load(cos_ptr + b.to(gl.int64) * stride_cos + offs_d).to(gl.float32)
        sin_row = gl.load(sin_ptr + b.to(gl.int64) * stride_sin + offs_d).to(gl.float32)
        k_row = k_ptr + b.to(gl.int64) * stride_k
        v_at_row = v_ptr + b.to(gl.int64) * stride_v
        k_cols = kvh * D + offs_d
        k_swapped_cols = kvh * D + swapped
        every = offs_d < D
        k_new = _projected(k_row + k_cols, k_cols, every, part_stride, k_bias, PARTS, dtype)
        k_swapped = _projected(
            k_row + k_swapped_cols, k_swapped_cols, every, part_stride, k_bias, PARTS, dtype
        )
        v_new = _projected(v_at_row + k_cols, k_cols, every, part_stride, v_bias, PARTS, dtype)
        # the rest of the ring's first fill, asked for after this step's q, k and v: loads issued
        # before them would be queued ahead of them (see EARLY_BLOCKS)
        for _ in gl.static_range(STAGES - EARLY):
            issued = _issue(*ring, issued, total, *counts, *rows0, BLOCK_N, STAGES)
        sin_signed = gl.where(offs_d < D // 2, -sin_row, sin_row)
        q = _rotate(q, q_swapped, gl.expand_dims(cos_row, 0), gl.expand_dims(sin_signed, 0))

        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, mma)
        q_dot = gl.convert_layout(q, a_layout)
        m_i = gl.full([_ROWS], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([_ROWS], gl.float32, layout=row_layout)
        acc = gl.zeros([_ROWS, D], gl.float32, layout=mma)
        for i in range(0, total):
            stage = i % STAGES
            mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
            valid = _valid_keys(i, n_prompt, n_comp, n_prompt_blocks, BLOCK_N)
            k_tile = k_smem.index(stage)
            v_tile = v_smem.index(stage)
            m_i, l_i, acc = _attend(
                q_dot, k_tile, v_tile, valid, m_i, l_i, acc, scale2, BLOCK_N,
                mma, a_layout, b_layout,
            )  # fmt: skip
            issued = _issue(*ring, issued, total, *counts, *rows0, BLOCK_N, STAGES)

        # the new key: rotated, stored at the slot, folded in from registers
        k_new = _rotate(k_new, k_swapped, cos_row, sin_signed)  # (D,)
        slot_at = ((b.to(gl.int64) * Tc + slot) * NKV + kvh) * D + offs_d
        gl.store(ck_ptr + slot_at, k_new)
        gl.store(cv_ptr + slot_at, v_new)
        s_new = gl.sum(q.to(gl.float32) * gl.expand_dims(k_new.to(gl.float32), 0), axis=1)
        s_new = gl.convert_layout(s_new * scale2, row_layout)
        m_new = gl.maximum(m_i, s_new)
        alpha = gl.exp2(m_i - m_new)
        p_new = gl.exp2(s_new - m_new)
        l_i = l_i * alpha + p_new
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, mma))
        v_row = gl.convert_layout(v_new, gl.SliceLayout(0, mma)).to(gl.float32)
        p_v = gl.expand_dims(p_new.to(pk_desc.dtype).to(gl.float32), 1) * gl.expand_dims(v_row, 0)
        acc = acc * gl.expand_dims(alpha, 1) + p_v

        out = acc / gl.expand_dims(l_i, 1)
        rows = gl.arange(0, _ROWS, layout=row_layout)
        o_row = (b.to(gl.int64) * (NKV * REP) + kvh * REP + gl.expand_dims(rows, 1)) * D
        o_at = out_ptr + o_row + gl.expand_dims(cols, 0)
        gl.store(o_at, out.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(rows < REP, 1))
        for z in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(z))


def applies(q, k, v, cos, sin, prompt_k, comp_k) -> bool:
    """Whether the Gluon kernel serves this call (shapes as `rope_decode_attention` takes them,
    already checked by the caller): bf16 on a Hopper GPU, d 64 or 128, rep <= 16 query heads per
    kv head, heads of q, k and v d apart, contiguous caches, and rows x kv heads between half the
    multiprocessors and all of them (one wave)."""
    if not (ENABLED and not _failed and gluon is not None and q.is_cuda):
        return False
    B, nh, d = q.shape
    return (
        all(t.dtype == torch.bfloat16 for t in (q, k, v))
        and q.stride(1) == d
        and k.stride(1) == d
        and v.stride(1) == d
        and all(t.stride(-1) == 1 for t in (q, k, v))
        and all(t.stride(0) * t.element_size() % 16 == 0 for t in (q, k, v))
        and _serves(B, nh, cos, sin, prompt_k, comp_k)
    )


def takes_parts(rows: int, nh: int, cos, sin, prompt_k, comp_k) -> bool:
    """Whether the kernel would serve a call whose q, k and v come as split-K parts
    (`launch_parts`), asked before the parts are computed: as `applies`, for `rows` rows."""
    return (
        ENABLED
        and not _failed
        and gluon is not None
        and prompt_k.is_cuda
        and _serves(rows, nh, cos, sin, prompt_k, comp_k)
    )


def _serves(B, nh, cos, sin, prompt_k, comp_k) -> bool:
    nkv, d = prompt_k.shape[2:]
    return (
        d in (64, 128)
        and nh % nkv == 0
        and nh // nkv <= QUERY_ROWS
        and prompt_k.dtype == comp_k.dtype == torch.bfloat16
        and cos.stride(-1) == 1
        and sin.stride(-1) == 1
        and prompt_k.is_contiguous()
        and comp_k.is_contiguous()
        and multiprocessors(prompt_k.device) <= 2 * B * nkv <= 2 * multiprocessors(prompt_k.device)
        and is_hopper(prompt_k.device.index)
    )


def launch(q, k, v, cos, sin, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, slot):
    """`rope_decode_attention` by the Gluon kernel where `applies`; None (with a warning the first
    time) when it does not compile with this triton: the caller then runs the Triton kernel."""
    caches = (prompt_k, prompt_v, prompt_lens, comp_k, comp_v, slot)
    return _launch(q, k, v, (None, None, None), 0, 0, cos, sin, *caches)


def launch_parts(
    partials, bias, nh, cos, sin, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, slot
):
    """As `launch` for q, k and v given as split-K parts of the packed q/k/v projection:
    `partials` (S, B, (nh + 2 nkv) d) fp32 contiguous and `bias` ((nh + 2 nkv) d,) or None. The
    kernel adds each value's parts in order and the bias, and rounds once to the caches' dtype,
    as it loads them; no separate sum is launched. Where `takes_parts`; None as `launch`."""
    nkv, d = prompt_k.shape[2:]
    edges = [0, nh * d, (nh + nkv) * d, (nh + 2 * nkv) * d]
    q, k, v = (partials[0, :, a:b] for a, b in zip(edges, edges[1:]))
    B = partials.shape[1]
    q, k, v = q.view(B, nh, d), k.view(B, nkv, d), v.view(B, nkv, d)
    biases = (None,) * 3 if bias is None else tuple(bias[a:b] for a, b in zip(edges, edges[1:]))
    caches = (prompt_k, prompt_v, prompt_lens, comp_k, comp_v, slot)
    return _launch(q, k, v, biases, partials.shape[0], partials.stride(0), cos, sin, *caches)


def _launch(q, k, v, biases, parts, part_stride, cos, sin, prompt_k, prompt_v, prompt_lens,
            comp_k, comp_v, slot):  # fmt: skip
    global _failed
    B, nh, d = q.shape
    P, Lp, nkv, _ = prompt_k.shape
    Tc = comp_k.shape[1]
    block_n, stages = blocks(d)
    box = [block_n, d]

    def cache(t, rows, box=box):
        return TensorDescriptor.from_tensor(t.view(rows, nkv * d), box, bf16_shared_layout(box))

    part = [PART_ROWS, d]

    out = torch.empty(B, nh, d, dtype=prompt_k.dtype, device=q.device)
    try:
        _attention_kernel[(B * nkv,)](
            q, k, v, *biases, part_stride, cos, sin,
            cache(prompt_k, P * Lp), cache(prompt_v, P * Lp),
            cache(comp_k, B * Tc), cache(comp_v, B * Tc),
            cache(prompt_k, P * Lp, part), cache(prompt_v, P * Lp, part),
            cache(comp_k, B * Tc, part), cache(comp_v, B * Tc, part),
            comp_k, comp_v, out, prompt_lens, slot,
            q.stride(0), k.stride(0), v.stride(0), cos.stride(0), sin.stride(0),
            B // P, Lp, Tc, P, B, LOG2E / math.sqrt(d),
            NKV=nkv, REP=nh // nkv, D=d, BLOCK_N=block_n, STAGES=stages, PARTS=parts,
            EARLY=min(EARLY_BLOCKS, stages),
            num_warps=4, enable_fp_fusion=False, **pdl.launch_options(),
        )  # fmt: skip
    except Exception as error:  # a Gluon API this kernel does not match (it was written for 3.6)
        _failed = True
        warn_not_compiled("the Gluon decode attention", error, "the Triton kernel")
        return None
    return out

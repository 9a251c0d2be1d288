"""The Triton kernel of the decode attention (`decode_attention.decode_attention_ref`'s spec).

The Triton kernel (flash-decoding): one program per (row, kv head, key split). It loads the rep
query heads of its kv head as one [REP_PAD, D] tile (rep padded to 16 rows for tl.dot), then walks
its share of the prompt's keys followed by the row's completion keys (one sequence, one loop) in
[BLOCK_N, D] blocks, each block read once and used for all rep heads by tl.dot, with an online
softmax in base 2 (log2(e) / sqrt(d) folded into one scale) and fp32 statistics. The loop
bounds come from `prompt_lens` and `step`, read on the device, so the launch does not depend on
them and replays in a CUDA graph while `step` advances in place. When rows x kv heads would
leave multiprocessors idle (few rows), the keys are split across programs and a small kernel
merges the partial results.

Why per row and not per (prompt, kv head) covering its G rows: the completion keys, private to each
row, dominate the bytes read once a completion is a few hundred tokens long, and a per-prompt
program would walk its G rows' completions one after another on one multiprocessor (P x nkv
programs, 16 at P=8, nkv=2). Per row there are B x nkv programs (128 at B=64, nkv=2), and the G
rows of a prompt are neighbours in launch order, so their repeated reads of the prompt's keys are
served by L2. Stacking G x rep queries into one tile would only save tensor-core work, which a
decode step, bound by memory, has to spare.

`rope=` folds the step's RoPE and KV write in (`decode_attention.rope_decode_attention`).
"""

from __future__ import annotations

import math

import torch

from fastgrpo import switches
from fastgrpo.kernels.decode import pdl
from fastgrpo.kernels.decode.kv_write import check_cache_write
from fastgrpo.kernels.support import (
    LOG2E,
    interpreting,
    multiprocessors,
    reference_notice,
    shared_memory,
    triton,
)

if triton is not None:
    import triton.language as tl

# FASTGRPO_DECODE_KERNELS=0 keeps CUDA tensors on the reference (to bisect)
USE_TRITON = switches.DECODE_KERNELS
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SPLITS = 0
"""Key splits per (row, kv head) on the GPU; 0 chooses by shape (the lab's A/B scripts fix it)."""
BLOCKS: tuple[int, ...] = ()
"""(BLOCK_N, num_warps, num_stages) on the GPU; () chooses by shape (the lab's A/B scripts fix it)."""


if triton is not None:

    @triton.jit
    def _rotate_rows(x, x_swapped, cos_row, sin_signed):
        """Rows of x (R, D) rotated as `rope.apply_rope_qk_` rotates them, bitwise: with
        x_swapped the row's halves exchanged and sin_signed = cat(-sin1, sin2), x * cos +
        x_swapped * sin_signed, each product rounded to x's dtype before the fp32 add, as torch's
        separate kernels round them (see kernels/layers/rope.py)."""
        dtype = x.dtype
        a = (x.to(tl.float32) * cos_row[None, :]).to(dtype).to(tl.float32)
        c = (x_swapped.to(tl.float32) * sin_signed[None, :]).to(dtype).to(tl.float32)
        return (a + c).to(dtype)

    @triton.jit
    def _fold_keys(
        q,  # (REP_PAD, D) queries of one kv head, in the cache dtype
        pk_base,
        pv_base,  # pointers to prompt key / value 0 of this kv head
        ck_base,
        cv_base,  # pointers to completion key / value 0 of this kv head
        n_prompt,  # keys [0, n_prompt) are the prompt's, [n_prompt, ...) the completion's
        start,
        stop,  # keys [start, stop) of the joined sequence
        stride_n,  # elements from one key to the next
        scale2,  # log2(e) / sqrt(d)
        REP_PAD: tl.constexpr,
        D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """Fold keys [start, stop) of the prompt's keys followed by the completion's (one
        sequence) into the online softmax: each [BLOCK_N, D] block of keys and values is loaded
        once (masked past `stop`, so stale slots are never read) and serves all query heads
        through tl.dot; a block that straddles the two parts reads each key from its own cache.
        One loop over both parts fills the pipeline once per program, not once per part: the 0.5B
        decode step at 64 rows on an H100 took 1.023 ms mean against 1.047 with a loop per part
        (three pairs in one run, benchmarks/results/rollout_ab_h100_v2.txt).

        Key positions and offsets inside one sequence are int32 (a sequence's cache rows are far
        below 2^31 elements; the int64 part is in the base pointers), and the choice between the
        two caches is made once per key, not per element: the loop is latency-bound, one warp per
        scheduler, so every integer instruction it drops is time. Returns the running max
        (REP_PAD,), sum (REP_PAD,) and output (REP_PAD, D) of the online softmax, all fp32."""
        m_i = tl.full([REP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, D], tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)[None, :]
        for block in range(start, stop, BLOCK_N):
            keys = block + offs_n  # (BLOCK_N,) int32
            valid = keys < stop
            in_prompt = keys < n_prompt
            row = tl.where(in_prompt, keys, keys - n_prompt) * stride_n  # (BLOCK_N,) int32
            k_at = tl.where(in_prompt, pk_base, ck_base) + row
            k = tl.load(k_at[:, None] + offs_d, mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale2  # (REP_PAD, BN)
            s = tl.where(valid[None, :], s, float("-inf"))
            # every block holds a valid key, so m_new is finite and no row sees -inf - -inf
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])  # (REP_PAD, BLOCK_N)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_at = tl.where(in_prompt, pv_base, cv_base) + row
            v = tl.load(v_at[:, None] + offs_d, mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _decode_attention_kernel(
        q_ptr,  # (B, nh, D), unit stride on D
        pk_ptr,
        pv_ptr,  # (P, Lp, nkv, D) contiguous
        lens_ptr,  # (P,) valid prompt keys
        ck_ptr,
        cv_ptr,  # (B, Tc, nkv, D) contiguous
        step_ptr,  # () completion slots 0..step are valid (with ROPE, slot step is written here)
        out_ptr,  # (B, nh, D) when SPLIT is false; else (S, B, nh, D) fp32 partial outputs
        m_ptr,
        l_ptr,  # (S, B, nh) fp32 partial max and sum (base 2), written when SPLIT
        kn_ptr,
        vn_ptr,  # with ROPE: (B, nkv, D) this step's k (not yet rotated) and v; else unused
        cos_ptr,
        sin_ptr,  # with ROPE: (B, D) each row's cos and sin; else unused
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_vb,
        stride_vh,
        stride_cb,
        stride_sb,
        B,
        G,
        Lp,
        Tc,
        scale2,  # log2(e) / sqrt(d)
        NKV: tl.constexpr,
        REP: tl.constexpr,
        D: tl.constexpr,
        REP_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        ROPE: tl.constexpr,  # rotate q and k here and write k, v at slot `step` (see below)
        PDL: tl.constexpr = False,  # programmatic dependent launch (kernels.pdl)
    ):
        pdl.start(PDL)
        pdl.wait(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        n_splits = tl.num_programs(2)
        prompt = b // G  # int32: one division instruction sequence, not int64's
        heads = kvh * REP + tl.arange(0, REP_PAD)  # (REP_PAD,) query heads of this kv head
        head_ok = tl.arange(0, REP_PAD) < REP
        offs_d = tl.arange(0, D)
        q_row = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
        q = tl.load(q_row + offs_d[None, :], mask=head_ok[:, None], other=0.0)  # (REP_PAD, D)
        step = tl.load(step_ptr)
        if ROPE:
            # this row's q heads rotated here; the new key is not read from the cache (another
            # split may not have written it yet) but folded in from registers after the loop
            swapped = (offs_d + D // 2) % D
            cos_row = tl.load(cos_ptr + b.to(tl.int64) * stride_cb + offs_d).to(tl.float32)
            sin_row = tl.load(sin_ptr + b.to(tl.int64) * stride_sb + offs_d).to(tl.float32)
            sin_signed = tl.where(offs_d < D // 2, -sin_row, sin_row)
            q_swapped = tl.load(q_row + swapped[None, :], mask=head_ok[:, None], other=0.0)
            q = _rotate_rows(q, q_swapped, cos_row, sin_signed)
            n_comp = tl.minimum(step, Tc).to(tl.int32)  # cached slots 0..step-1
        else:
            n_comp = tl.minimum(step + 1, Tc).to(tl.int32)

        n_prompt = tl.minimum(tl.load(lens_ptr + prompt), Lp).to(tl.int32)
        prompt_at = (prompt.to(tl.int64) * Lp * NKV + kvh) * D
        comp_at = (b.to(tl.int64) * Tc * NKV + kvh) * D
        # this split's share of the joined keys, whole blocks; split 0 always holds key 0
        n_all = n_prompt + n_comp
        chunk = tl.cdiv(tl.cdiv(n_all, n_splits), BLOCK_N) * BLOCK_N
        m_i, l_i, acc = _fold_keys(
            q,
            pk_ptr + prompt_at,
            pv_ptr + prompt_at,
            ck_ptr + comp_at,
            cv_ptr + comp_at,
            n_prompt,
            split * chunk,
            tl.minimum((split + 1) * chunk, n_all),
            NKV * D,
            scale2,
            REP_PAD,
            D,
            BLOCK_N,
            DOT_PRECISION,
        )
        if ROPE:
            if split == n_splits - 1:  # the last split also owns the new key: rotate, store, fold
                k_at = kn_ptr + b.to(tl.int64) * stride_kb + kvh * stride_kh
                k_new = tl.load(k_at + offs_d)[None, :]
                k_swapped = tl.load(k_at + swapped)[None, :]
                k_new = _rotate_rows(k_new, k_swapped, cos_row, sin_signed)  # (1, D)
                v_new = tl.load(vn_ptr + b.to(tl.int64) * stride_vb + kvh * stride_vh + offs_d)
                slot_at = comp_at + step * (NKV * D) + offs_d  # (D,) in (B, Tc, nkv, D)
                tl.store(ck_ptr + slot_at[None, :], k_new)
                tl.store(cv_ptr + slot_at, v_new)
                # the tensor cores' products of 16-bit values are exact in fp32, as here; only
                # the order of the fp32 sum differs from a key read by the loop's tl.dot
                s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale2
                m_new = tl.maximum(m_i, s_new)
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s_new - m_new)
                l_i = l_i * alpha + p
                p_v = p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
                acc = acc * alpha[:, None] + p_v
                m_i = m_new

        rows = b.to(tl.int64) * (NKV * REP) + heads  # (REP_PAD,) flat (b, head) index
        if SPLIT:
            at = split.to(tl.int64) * B * (NKV * REP) + rows
            tl.store(m_ptr + at, m_i, mask=head_ok)
            tl.store(l_ptr + at, l_i, mask=head_ok)
            tl.store(out_ptr + at[:, None] * D + offs_d[None, :], acc, mask=head_ok[:, None])
        else:
            out = acc / l_i[:, None]
            o_at = out_ptr + rows[:, None] * D + offs_d[None, :]
            tl.store(o_at, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])

    @triton.jit
    def _combine_splits_kernel(
        acc_ptr,  # (S, R, D) fp32 partial outputs, R = B * nh
        m_ptr,
        l_ptr,  # (S, R) fp32 partial max and sum (base 2)
        out_ptr,  # (R, D)
        R,
        S,
        D: tl.constexpr,
        S_PAD: tl.constexpr,
        PDL: tl.constexpr = False,  # programmatic dependent launch (kernels.pdl)
    ):
        """out = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s for one (row, head)."""
        pdl.start(PDL)
        pdl.wait(PDL)
        r = tl.program_id(0).to(tl.int64)
        splits = tl.arange(0, S_PAD)
        ok = splits < S
        at = splits * R + r  # (S_PAD,)
        m = tl.load(m_ptr + at, mask=ok, other=float("-inf"))  # -inf too for splits with no keys
        l_s = tl.load(l_ptr + at, mask=ok, other=0.0)
        offs_d = tl.arange(0, D)
        acc = tl.load(acc_ptr + at[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
        w = tl.exp2(m - tl.max(m, 0))  # (S_PAD,); split 0 holds a key, so the max is finite
        out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l_s, 0)  # (D,)
        tl.store(out_ptr + r * D + offs_d, out.to(out_ptr.dtype.element_ty))


def blocks_for(
    rows: int = 0, nkv: int = 1, d: int = 128, itemsize: int = 2
) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). Small blocks in the interpreter, so that tiny test
    caches still span several blocks and partial ones. On a GPU, 64-key blocks, 2 stages; but
    when rows x kv heads are at most one program per multiprocessor, d <= 64 and they fit shared
    memory, 256-key blocks with 3 stages, which take a 0.5B decode step's keys (prompt 128 + up
    to 256) in one or two iterations and, through `num_splits`, with no key split and no merge
    kernel: on an H100 at 64 rows 6.95 us alone with the RoPE against 8.70, and the step 0.985 ms
    against 0.998 (three pairs, benchmarks/results/rollout_rope_attention_h100_v1.txt). Their 130
    KB of shared memory would leave one program per multiprocessor, so more programs keep the
    small blocks. In fp32 (`itemsize` 4) they would take 276 KB, more than the H100's 227."""
    if interpreting():
        return 16, 4, 1
    if len(BLOCKS) == 3:
        return BLOCKS
    large = (256, 4, 3)
    if d <= 64 and 0 < rows * nkv <= multiprocessors():
        if shared_bytes(*large, d, itemsize) <= shared_memory():
            return large
    return 64, 4, 2


def shared_bytes(block_n: int, warps: int, stages: int, d: int, itemsize: int) -> int:
    """A bound on the kernel's shared memory for `blocks_for`' (block_n, warps, stages): Triton
    keeps stages - 1 key blocks and as many value blocks in flight, plus less than one more block
    for its layout conversions (20 KB at 256 fp32 keys of d 64, which took 276 KB in all)."""
    return (2 * max(stages - 1, 1) + 1) * block_n * d * itemsize


def num_splits(rows: int, nkv: int, keys: int, block_n: int, device: torch.device) -> int:
    """Key splits per (row, kv head): 1 when rows x kv heads already give a program per
    multiprocessor, else as many as reach that, at most one per two blocks of the full caches and
    at most 16. On an H100 (benchmarks/results/rollout_ab_h100_v2.txt): at the 0.5B shape with 64
    rows (128 programs, 2 splits) a decode step took 1.09-1.13 ms, with 1 split 1.20-1.22 and with
    3 splits 1.12; the 7B attention at 64 rows (256 programs, 1 split; 2 when the aim was two
    programs per multiprocessor) took 29.2 us per layer alone against 31.6 with 2 splits
    (tune_decode_attention_h100_v1.json). A function of the shapes alone, never of the step,
    so a captured graph stays valid."""
    if device.type != "cuda":
        return 1
    if SPLITS > 0:
        return SPLITS
    programs, target = rows * nkv, multiprocessors(device)
    if programs >= target:
        return 1
    return max(1, min(-(-target // programs), keys // (2 * block_n), 16))


def check_inputs(q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, step) -> None:
    """Shapes, dtypes, layout and device that the kernel assumes; a clear error otherwise."""
    if q.dim() != 3 or prompt_k.dim() != 4 or comp_k.dim() != 4:
        raise ValueError(
            f"q (B, nh, d), prompt_k (P, Lp, nkv, d), comp_k (B, Tc, nkv, d) expected; got "
            f"{tuple(q.shape)}, {tuple(prompt_k.shape)}, {tuple(comp_k.shape)}"
        )
    P, Lp, nkv, d = prompt_k.shape
    B, nh, _ = q.shape
    if (
        prompt_v.shape != prompt_k.shape
        or comp_v.shape != comp_k.shape
        or q.shape[2] != d
        or comp_k.shape[0] != B
        or comp_k.shape[2:] != (nkv, d)
        or prompt_lens.shape != (P,)
        or step.dim() != 0
        or B % P
        or nh % nkv
    ):
        raise ValueError(
            "decode attention needs q (B, nh, d), prompt k/v (P, Lp, nkv, d), lens (P,), "
            "completion k/v (B, Tc, nkv, d), step (), with B % P == 0 and nh % nkv == 0; got "
            f"q {tuple(q.shape)}, prompt {tuple(prompt_k.shape)}/{tuple(prompt_v.shape)}, lens "
            f"{tuple(prompt_lens.shape)}, completion {tuple(comp_k.shape)}/{tuple(comp_v.shape)}, "
            f"step {tuple(step.shape)}"
        )
    if d < 16 or d & (d - 1):
        raise ValueError(f"the kernel needs a head dim that is a power of two >= 16, got {d}")
    caches = (prompt_k, prompt_v, comp_k, comp_v)
    if q.dtype not in KERNEL_DTYPES or any(c.dtype != q.dtype for c in caches):
        raise ValueError(
            f"q and the caches must share one of {KERNEL_DTYPES}; got q {q.dtype}, caches "
            f"{[c.dtype for c in caches]}"
        )
    if prompt_lens.is_floating_point() or step.is_floating_point():
        raise ValueError(f"integer lens and step expected, got {prompt_lens.dtype}, {step.dtype}")
    if q.stride(2) != 1 or not all(c.is_contiguous() for c in caches):
        raise ValueError("the caches must be contiguous and q must have unit stride on d")
    if any(t.device != q.device for t in (*caches, prompt_lens, step)):
        raise ValueError("all decode attention inputs must live on one device")


def decode_attention_triton(
    q,
    prompt_k,
    prompt_v,
    prompt_lens,
    comp_k,
    comp_v,
    step,
    splits: int | None = None,
    blocks: tuple[int, int, int] | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """(B, nh, d) in q's dtype, as `decode_attention_ref`, by the Triton kernel. No host sync:
    safe to capture in a CUDA graph and replay with `step` (and `prompt_lens`) changed in place.
    `splits` overrides the number of key splits per (row, kv head) (tests), `blocks` the
    (BLOCK_N, num_warps, num_stages) of `blocks_for` (tuning). With `rope` = (k, v, cos, sin), q is
    not yet rotated: see `rope_decode_attention`."""
    if triton is None:
        raise RuntimeError("the Triton decode-attention kernel needs `pip install triton`")
    check_inputs(q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, step)
    if rope is not None:
        check_rope_inputs(q, comp_k, comp_v, *rope)
    P, Lp, nkv, d = prompt_k.shape
    B, nh, _ = q.shape
    Tc, rep = comp_k.shape[1], nh // nkv
    out_dtype = q.dtype
    k_new, v_new, cos, sin = rope if rope is not None else (q, q, q, q)
    caches = (comp_k, comp_v)
    if interpreting() and q.dtype == torch.bfloat16:
        # The interpreter (numpy) has no bf16; fp32 copies are exact, and the GPU's bf16 dot
        # multiplies exactly and accumulates in fp32, so only the bf16 rounding of p (and, with
        # rope, of the rotation's products) differs. The new k and v are written back below.
        q, prompt_k, prompt_v, k_new, v_new, cos, sin = (
            t.float() for t in (q, prompt_k, prompt_v, k_new, v_new, cos, sin)
        )
        comp_k, comp_v = comp_k.float(), comp_v.float()
    block_n, warps, stages = blocks or blocks_for(B, nkv, d, q.element_size())
    if splits is None:
        splits = num_splits(B, nkv, Lp + Tc, block_n, q.device)
    out = torch.empty(B, nh, d, dtype=out_dtype, device=q.device)
    if B == 0:
        return out
    if splits > 1:
        partial = torch.empty(splits, B, nh, d, dtype=torch.float32, device=q.device)
        m, l_s = torch.empty(2, splits, B, nh, dtype=torch.float32, device=q.device)
    else:
        partial, m, l_s = out, out, out  # m and l are not written without splits
    _decode_attention_kernel[(B, nkv, splits)](
        q,
        prompt_k,
        prompt_v,
        prompt_lens,
        comp_k,
        comp_v,
        step,
        partial,
        m,
        l_s,
        k_new,
        v_new,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        cos.stride(0),
        sin.stride(0),
        B,
        B // P,
        Lp,
        Tc,
        LOG2E / math.sqrt(d),
        NKV=nkv,
        REP=rep,
        D=d,
        REP_PAD=max(16, triton.next_power_of_2(rep)),
        BLOCK_N=block_n,
        SPLIT=splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        ROPE=rope is not None,
        num_warps=warps,
        num_stages=stages,
        # as the RoPE kernel: no contraction of the rotation's rounded products into an FMA
        enable_fp_fusion=rope is None,
        **pdl.launch_options(),
    )
    if splits > 1:
        _combine_splits_kernel[(B * nh,)](
            partial,
            m,
            l_s,
            out,
            B * nh,
            splits,
            D=d,
            S_PAD=triton.next_power_of_2(splits),
            **pdl.launch_options(),
        )
    if rope is not None and caches[0] is not comp_k:  # the interpreter's fp32 copies
        caches[0].copy_(comp_k)
        caches[1].copy_(comp_v)
    return out


def check_rope_inputs(q, comp_k, comp_v, k, v, cos, sin) -> None:
    """What the kernel's RoPE and KV write assume of k, v (B, nkv, d) and cos, sin (B, d)."""
    check_cache_write(comp_k, comp_v, k, v)
    B, nh, d = q.shape
    if cos.shape != (B, d) or sin.shape != (B, d):
        raise ValueError(
            f"cos and sin must be (B, d) = {(B, d)}, got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if d % 2:
        raise ValueError(f"RoPE needs an even head dim, got {d}")
    if k.dtype != q.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    if any(t.stride(-1) != 1 for t in (k, v, cos, sin)):
        raise ValueError("k, v, cos and sin need unit stride on their last dim")
    if any(t.device != q.device for t in (k, v, cos, sin)):
        raise ValueError("all decode attention inputs must live on one device")


def kernel_serves(q, prompt_k) -> bool:
    d = q.shape[-1]
    return (
        USE_TRITON
        and triton is not None
        and q.is_cuda
        and q.dtype in KERNEL_DTYPES
        and prompt_k.dtype == q.dtype
        and d >= 16
        and d & (d - 1) == 0
        and fits_shared_memory(q, d)
    )


def fits_shared_memory(q, d: int) -> bool:
    """Whether the kernel's small blocks fit a program's shared memory on q's device (fp32 keys
    of d 256 take ~190 KB: an H100 has room, a 99 KB consumer GPU not); else the reference
    serves, and says so once."""
    itemsize = q.element_size()
    need = shared_bytes(*blocks_for(0, 1, d, itemsize), d, itemsize)
    if interpreting() or need <= shared_memory(q.device):
        return True
    dtype = str(q.dtype).removeprefix("torch.")
    reference_notice("decode attention", f"for {dtype} at head dim {d} (it exceeds shared memory)")
    return False

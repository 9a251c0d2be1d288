"""Attention of one decode step over a shared prompt cache and each sample's own completion cache.

What: row b (one sample) belongs to prompt b // G. Its query attends to (1) the keys of its prompt,
stored once for all G samples of that prompt, and (2) the keys of its own completion up to and
including the current step. Softmax runs over both parts together, in fp32 (or the inputs' wider dtype).

Why: GRPO samples G completions of every prompt. Prefilling each prompt once and sharing its KV
cache saves G-1 prefills and G-1 copies of the prompt's cache; a kernel that reads each KV head
once for all its query heads (GQA) and only the valid part of each cache also saves the bandwidth
that the padded reference spends on Lp + Tc keys per row whatever the lengths.

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

Reference: `decode_attention_ref` (einsum over padded caches, masks for prompt lengths and the
step). It is the spec and the CPU path.
"""

from __future__ import annotations

import math
import os

import torch

from fastgrpo.kernels import pdl
from fastgrpo.kernels.lm_head_stats import LOG2E, _interpreting, multiprocessors, triton

if triton is not None:
    import triton.language as tl

# FASTGRPO_DECODE_ATTENTION=ref keeps CUDA tensors on the reference (to compare or to bisect)
USE_TRITON = os.environ.get("FASTGRPO_DECODE_ATTENTION", "triton") != "ref"
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# FASTGRPO_ATTENTION_SPLITS=n fixes the key splits per (row, kv head) on the GPU (to compare)
SPLITS = int(os.environ.get("FASTGRPO_ATTENTION_SPLITS", "0"))
# FASTGRPO_ATTENTION_BLOCKS=n,w,s fixes (BLOCK_N, num_warps, num_stages) on the GPU (to compare)
BLOCKS = tuple(int(v) for v in os.environ.get("FASTGRPO_ATTENTION_BLOCKS", "").split(",") if v)


def decode_attention_ref(
    q: torch.Tensor,  # (B, nh, d) this step's queries, B = P * G
    prompt_k: torch.Tensor,  # (P, Lp, nkv, d)
    prompt_v: torch.Tensor,  # (P, Lp, nkv, d)
    prompt_lens: torch.Tensor,  # (P,) int64, valid keys of each prompt
    comp_k: torch.Tensor,  # (B, Tc, nkv, d)
    comp_v: torch.Tensor,  # (B, Tc, nkv, d)
    step: torch.Tensor,  # () int64: completion slots 0..step are valid
) -> torch.Tensor:
    """(B, nh, d) attention output in q's dtype."""
    P, Lp, nkv, d = prompt_k.shape
    B, nh, _ = q.shape
    G, rep, Tc = B // P, nh // nkv, comp_k.shape[1]
    f = torch.promote_types(q.dtype, torch.float32)  # fp32 at least
    qg = q.view(P, G, nkv, rep, d).to(f) * (1.0 / math.sqrt(d))  # (P, G, nkv, rep, d)
    scores_p = torch.einsum("pgkrd,plkd->pgkrl", qg, prompt_k.to(f))  # (P, G, nkv, rep, Lp)
    past_prompt = torch.arange(Lp, device=q.device) >= prompt_lens.view(P, 1, 1, 1, 1)
    scores_p = scores_p.masked_fill(past_prompt, float("-inf"))
    ck = comp_k.view(P, G, Tc, nkv, d).to(f)
    scores_c = torch.einsum("pgkrd,pgtkd->pgkrt", qg, ck)  # (P, G, nkv, rep, Tc)
    future = torch.arange(Tc, device=q.device) > step
    scores_c = scores_c.masked_fill(future, float("-inf"))
    probs = torch.softmax(torch.cat([scores_p, scores_c], -1), -1)
    out = torch.einsum("pgkrl,plkd->pgkrd", probs[..., :Lp], prompt_v.to(f))
    cv = comp_v.view(P, G, Tc, nkv, d).to(f)
    out = out + torch.einsum("pgkrt,pgtkd->pgkrd", probs[..., Lp:], cv)  # (P, G, nkv, rep, d)
    return out.reshape(B, nh, d).to(q.dtype)


if triton is not None:

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
        (three pairs in one run, benchmarks/results/rollout_ab_h100_v2.txt). Returns the running
        max (REP_PAD,), sum (REP_PAD,) and output (REP_PAD, D) of the online softmax, all fp32."""
        m_i = tl.full([REP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, D], tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        for block in range(start, stop, BLOCK_N):
            keys = block + offs_n  # (BLOCK_N,) int64
            valid = keys < stop
            in_prompt = keys < n_prompt
            row = tl.where(in_prompt, keys, keys - n_prompt)[:, None] * stride_n + offs_d[None, :]
            k_at = tl.where(in_prompt[:, None], pk_base + row, ck_base + row)
            k = tl.load(k_at, mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale2  # (REP_PAD, BN)
            s = tl.where(valid[None, :], s, float("-inf"))
            # every block holds a valid key, so m_new is finite and no row sees -inf - -inf
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])  # (REP_PAD, BLOCK_N)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_at = tl.where(in_prompt[:, None], pv_base + row, cv_base + row)
            v = tl.load(v_at, mask=valid[:, None], other=0.0)
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
        step_ptr,  # () completion slots 0..step are valid
        out_ptr,  # (B, nh, D) when SPLIT is false; else (S, B, nh, D) fp32 partial outputs
        m_ptr,
        l_ptr,  # (S, B, nh) fp32 partial max and sum (base 2), written when SPLIT
        stride_qb,
        stride_qh,
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
        PDL: tl.constexpr = False,  # programmatic dependent launch (kernels.pdl)
    ):
        pdl.start(PDL)
        pdl.wait(PDL)
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        n_splits = tl.num_programs(2)
        prompt = b // G
        heads = kvh * REP + tl.arange(0, REP_PAD)  # (REP_PAD,) query heads of this kv head
        head_ok = tl.arange(0, REP_PAD) < REP
        offs_d = tl.arange(0, D)
        q_at = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_at, mask=head_ok[:, None], other=0.0)  # (REP_PAD, D)

        n_prompt = tl.minimum(tl.load(lens_ptr + prompt).to(tl.int64), Lp)
        n_comp = tl.minimum(tl.load(step_ptr).to(tl.int64) + 1, Tc)
        prompt_at = (prompt * Lp * NKV + kvh) * D
        comp_at = (b * Tc * NKV + kvh) * D
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

        rows = b * (NKV * REP) + heads  # (REP_PAD,) flat (b, head) index
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


def _blocks() -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). Small blocks in the interpreter, so that tiny test
    caches still span several blocks and partial ones. Not yet tuned on the H100: 64 keys per
    block keeps a [64, 128] bf16 tile of keys and one of values (32 KB) in flight per stage."""
    if _interpreting():
        return 16, 4, 1
    if len(BLOCKS) == 3:
        return BLOCKS
    return 64, 4, 2


def _num_splits(rows: int, nkv: int, keys: int, block_n: int, device: torch.device) -> int:
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


def _check_inputs(q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, step) -> None:
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
) -> torch.Tensor:
    """(B, nh, d) in q's dtype, as `decode_attention_ref`, by the Triton kernel. No host sync:
    safe to capture in a CUDA graph and replay with `step` (and `prompt_lens`) changed in place.
    `splits` overrides the number of key splits per (row, kv head) (tests), `blocks` the
    (BLOCK_N, num_warps, num_stages) of `_blocks` (tuning)."""
    if triton is None:
        raise RuntimeError("the Triton decode-attention kernel needs `pip install triton`")
    _check_inputs(q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, step)
    P, Lp, nkv, d = prompt_k.shape
    B, nh, _ = q.shape
    Tc, rep = comp_k.shape[1], nh // nkv
    out_dtype = q.dtype
    if _interpreting() and q.dtype == torch.bfloat16:
        # The interpreter (numpy) has no bf16; fp32 copies are exact, and the GPU's bf16 dot
        # multiplies exactly and accumulates in fp32, so only the bf16 rounding of p differs.
        q, prompt_k, prompt_v, comp_k, comp_v = (
            t.float() for t in (q, prompt_k, prompt_v, comp_k, comp_v)
        )
    block_n, warps, stages = blocks or _blocks()
    if splits is None:
        splits = _num_splits(B, nkv, Lp + Tc, block_n, q.device)
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
        q.stride(0),
        q.stride(1),
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
        num_warps=warps,
        num_stages=stages,
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
    return out


def _kernel_serves(q, prompt_k) -> bool:
    d = q.shape[-1]
    return (
        USE_TRITON
        and triton is not None
        and q.is_cuda
        and q.dtype in KERNEL_DTYPES
        and prompt_k.dtype == q.dtype
        and d >= 16
        and d & (d - 1) == 0
    )


def decode_attention(q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, step):
    """The decode step's attention (see `decode_attention_ref` for the arguments): the Triton
    kernel on CUDA tensors it supports (head dim a power of two >= 16, fp16/bf16/fp32), else the
    reference (CPU, other head dims, FASTGRPO_DECODE_ATTENTION=ref)."""
    if _kernel_serves(q, prompt_k):
        return decode_attention_triton(q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, step)
    return decode_attention_ref(q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, step)

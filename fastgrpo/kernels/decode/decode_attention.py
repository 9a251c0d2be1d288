"""Attention of one decode step over a shared prompt cache and each sample's own completion cache.

What: row b (one sample) belongs to prompt b // G. Its query attends to (1) the keys of its prompt,
stored once for all G samples of that prompt, and (2) the keys of its own completion up to and
including the current step. Softmax runs over both parts together, in fp32 (or the inputs' wider dtype).

Why: GRPO samples G completions of every prompt. Prefilling each prompt once and sharing its KV
cache saves G-1 prefills and G-1 copies of the prompt's cache; a kernel that reads each KV head
once for all its query heads (GQA) and only the valid part of each cache also saves the bandwidth
that the padded reference spends on Lp + Tc keys per row whatever the lengths.

The Triton kernel (flash-decoding, one program per row, kv head and key split) is in
`decode_attention_triton`; on Hopper, a bf16 decode batch of one wave of programs goes to the
Gluon kernel (`decode_attention_gluon`).

`rope_decode_attention` is the decode step's RoPE, KV-cache write and attention in that one
kernel: every program rotates its own query heads, and the program of the last key split rotates
the new key, stores it and v at the step's slot, and folds it into its softmax from registers (no
program reads that slot, which may not be written yet). On an H100 this took the 0.5B decode step
at 64 rows from 1.036 to 0.998 ms (one launch fewer per layer; benchmarks/results/
rollout_rope_attention_h100_v1.txt). The kernel is latency-bound (one warp per scheduler, ~1200
instructions per warp, ncu in the same file), so positions and offsets inside a sequence are int32.

`rope_decode_attention_parts` takes this step's q, k and v as split-K parts of the packed
q/k/v GEMM (`ProjectedParts`): on Hopper the Gluon kernel adds each value's parts and the bias as
it loads them, so q/k/v's GEMM has more, shorter programs and no launch sums the parts.

Reference: `decode_attention_ref` (einsum over padded caches, masks for prompt lengths and the
step). It is the spec and the CPU path; `rope_decode_attention_ref` adds `rope.rope_write_kv_ref`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastgrpo.kernels.decode import decode_attention_gluon
from fastgrpo.kernels.decode.decode_attention_triton import (
    check_inputs,
    check_rope_inputs,
    decode_attention_triton,
    kernel_serves,
)
from fastgrpo.kernels.layers.rope import rope_write_kv_, rope_write_kv_ref


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


def decode_attention(q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, step):
    """The decode step's attention (see `decode_attention_ref` for the arguments): the Triton
    kernel on CUDA tensors it supports (head dim a power of two >= 16, fp16/bf16/fp32), else the
    reference (CPU, other head dims, FASTGRPO_DECODE_KERNELS=0)."""
    if kernel_serves(q, prompt_k):
        return decode_attention_triton(q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, step)
    return decode_attention_ref(q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, step)


def rope_decode_attention_ref(
    q, k, v, cos, sin, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, slot
):
    """A decode step's RoPE (q and k rotated in place), KV write at completion slot `slot` and
    attention over slots 0..slot: `rope.rope_write_kv_ref`, then `decode_attention_ref`."""
    rope_write_kv_ref(q, k, v, cos, sin, comp_k, comp_v, slot)
    return decode_attention_ref(q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, slot)


def rope_decode_attention(q, k, v, cos, sin, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, slot):
    """`rope_decode_attention_ref` in one kernel on CUDA tensors it supports (others take two
    steps: `rope.rope_write_kv_` then `decode_attention`). q and k are
    (B, nh, d) and (B, nkv, d) not yet rotated, v (B, nkv, d), cos and sin (B, d) each row's
    table row, `slot` a () device tensor; returns (B, nh, d). The kernel leaves q and k as they
    are (the reference rotates them in place); the caches get the rotated k and v either way.

    Why: the separate RoPE kernel was one of nine launches per layer of the decode step, each a
    link in a chain of dependent kernels; here every program rotates its own query heads (7 x 64
    values at the 0.5B shape) while its first keys load, and the program of the last key split
    rotates and stores the new key and folds it into its softmax from registers. On Hopper a bf16
    decode batch of one wave of programs goes to the Gluon kernel instead
    (`decode_attention_gluon`), which loads the cached keys before it waits for q."""
    readable = all(t.stride(-1) == 1 for t in (k, v, cos, sin))
    if readable and kernel_serves(q, prompt_k):
        check_inputs(q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, slot)
        check_rope_inputs(q, comp_k, comp_v, k, v, cos, sin)
        if decode_attention_gluon.applies(q, k, v, cos, sin, prompt_k, comp_k):
            out = decode_attention_gluon.launch(
                q, k, v, cos, sin, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, slot
            )
            if out is not None:
                return out
        return decode_attention_triton(
            q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, slot, rope=(k, v, cos, sin)
        )
    rope_write_kv_(q, k, v, cos, sin, comp_k, comp_v, slot)
    return decode_attention(q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, slot)


@dataclass
class ProjectedParts:
    """A decode step's packed q/k/v projection as split-K parts: `partials` (S, B, (nh + 2 nkv)
    d) fp32 over ranges of the hidden size, and the projection's `bias` or None. The projection
    is the parts' sum in order plus the bias, rounded once to `dtype`."""

    partials: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype

    def total(self) -> torch.Tensor:
        """(B, (nh + 2 nkv) d): the projection, as the kernel forms it."""
        out = self.partials[0]
        for part in self.partials[1:]:
            out = out + part
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(self.dtype)


def takes_projected_parts(rows: int, nh: int, cos, sin, prompt_k, comp_k) -> bool:
    """Whether `rope_decode_attention_parts` would add up parts in its kernel for a step of `rows`
    rows and nh query heads (asked before the q/k/v GEMM, which otherwise returns one tensor)."""
    return decode_attention_gluon.takes_parts(rows, nh, cos, sin, prompt_k, comp_k)


def rope_decode_attention_parts(
    qkv: ProjectedParts, nh: int, cos, sin, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, slot
):
    """`rope_decode_attention` of q, k and v = qkv.total() split into nh, nkv and nkv heads: the
    Gluon kernel adds up the parts as it loads them where `takes_projected_parts`, else the parts
    are summed first."""
    _check_parts(qkv, nh, cos, sin, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, slot)
    nkv, d = prompt_k.shape[2:]
    B = qkv.partials.shape[1]
    if takes_projected_parts(B, nh, cos, sin, prompt_k, comp_k):
        out = decode_attention_gluon.launch_parts(
            qkv.partials, qkv.bias, nh, cos, sin, prompt_k, prompt_v, prompt_lens, comp_k, comp_v,
            slot,
        )  # fmt: skip
        if out is not None:
            return out
    q, k, v = qkv.total().split([nh * d, nkv * d, nkv * d], dim=-1)
    q, k, v = q.reshape(B, nh, d), k.reshape(B, nkv, d), v.reshape(B, nkv, d)
    return rope_decode_attention(q, k, v, cos, sin, prompt_k, prompt_v, prompt_lens, comp_k,
                                 comp_v, slot)  # fmt: skip


def _check_parts(qkv, nh, cos, sin, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, slot) -> None:
    """What `rope_decode_attention_parts` assumes of the parts, and of the rest as the kernel's
    other entry points check it (views of the caches stand in for q, k and v's shapes)."""
    parts, bias = qkv.partials, qkv.bias
    nkv, d = prompt_k.shape[2:] if prompt_k.dim() == 4 else (0, 0)
    width = (nh + 2 * nkv) * d
    if parts.dim() != 3 or parts.shape[2] != width or nh % max(nkv, 1):
        raise ValueError(
            f"q/k/v parts (S, B, (nh + 2 nkv) d) = (S, B, {width}) expected for nh {nh} and "
            f"caches {tuple(prompt_k.shape)}, got {tuple(parts.shape)}"
        )
    if parts.dtype != torch.float32 or not parts.is_contiguous():
        raise ValueError(f"the parts must be contiguous fp32, got {parts.dtype}")
    if bias is not None and (bias.shape != (width,) or bias.device != parts.device):
        raise ValueError(f"the q/k/v bias must be ({width},) on the parts' device")
    if parts.device != prompt_k.device or qkv.dtype != prompt_k.dtype:
        raise ValueError("the parts must live with the caches, and round to the caches' dtype")
    B = parts.shape[1]
    q, k, v = prompt_k[0, 0, :1].expand(B, nh, d), comp_k[:, 0], comp_v[:, 0]
    check_inputs(q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, slot)
    check_rope_inputs(q, comp_k, comp_v, k, v, cos, sin)

"""Attention of one decode step over a shared prompt cache and each sample's own completion cache.

What: row b (one sample) belongs to prompt b // G. Its query attends to (1) the keys of its prompt,
stored once for all G samples of that prompt, and (2) the keys of its own completion up to and
including the current step. Softmax runs over both parts together, in fp32 (or the inputs' wider dtype).

Why: GRPO samples G completions of every prompt. Prefilling each prompt once and sharing its KV
cache saves G-1 prefills and G-1 copies of the prompt's cache; a kernel that reads each prompt's
keys once for its G samples and all their query heads (GQA) also saves the bandwidth.

Reference: `decode_attention_ref` (einsum over padded caches, masks for prompt lengths and the
step). It is the spec and the CPU path.
"""

from __future__ import annotations

import math

import torch


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
    """The decode step's attention (see `decode_attention_ref` for the arguments)."""
    return decode_attention_ref(q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, step)

"""Fused LM head + GRPO-family loss: hidden states in, scalar loss and its gradients out.

What: rows (completion tokens, packed) go through the LM head in chunks sized by a memory budget.
For each chunk one Triton kernel computes the logits tile by tile, keeps fp32 softmax statistics
(so log-probs are exact to ~1e-6 and bitwise equal to scoring) and stores each row's probabilities
relative to its target's, e = p / p_target, once in bf16 (`lm_head_stats.ChunkStats`); the per-token
loss and its derivatives with respect to each row's log-prob (and entropy) come from one small
kernel. Since d(loss)/d(logits) = (g / T)(onehot - p) = s * e' per row (s = -(g / T) p_target, e'
is e with the target's entry set to 1 - 1 / p_target, written by a per-row kernel), two plain GEMMs
give d(hidden) = s * (e' @ W) and accumulate d(weight) += e'^T @ (s * hidden), with no pass over
the (rows, V) values in between (the entropy bonus, whose gradient needs ln p per element, keeps
one). The gradient is finished during the forward call, so backward only scales it: 6*N*H*V FLOPs
in all, one chunk of probabilities in memory at a time.

Why: the `[tokens, vocab]` logits are where GRPO spends its memory (5 GB in bf16 at 16k tokens and
a 152k vocabulary); this path never holds more than one chunk of them.

Reference: `lm_head_grpo_loss_ref` (autograd through fp32 logits and the same per-token loss).
The per-token loss mirrors `fastgrpo.algo.policy_loss` for token-level ratios; the weights
`token_weights` turn each aggregation (sequence mean, token mean, constant length) into a weighted
token sum. A sequence-level ratio (GSPO) couples rows, so `lm_head_policy_loss` takes two passes:
statistics for all rows, then the gradient pass with the logits recomputed (8*N*H*V FLOPs).
"""

from __future__ import annotations

import torch

from fastgrpo.kernels.support import aligned_empty, interpreting, kernel_dtype, triton
from fastgrpo.kernels.train import lm_head_backward as backward_gemms
from fastgrpo.kernels.train.lm_head_chunk_grads import (
    ROW_BLOCK,
    add_matmul_f32_,
    chunk_references,
    dz_from_probs_,
    scale_by_,
    scale_rows,
)
from fastgrpo.kernels.train.lm_head_logprob import lm_head_logprob_ref
from fastgrpo.kernels.train.lm_head_stats import ChunkStats, lm_head_stats_triton
from fastgrpo.kernels.train.token_loss import (
    TOKEN_LEVEL_LOSSES,
    loss_and_grads,
    per_token_loss,
    token_loss_and_grads,
)

# one chunk of bf16 (rows, V) values: ~2k rows at a 152k vocabulary
DEFAULT_CHUNK_BYTES = 640 * 2**20
# The two backward GEMMs: "triton" (lm_head_backward: rows known to have no gradient skipped, on
# the device) or "cublas" (torch.mm, every row; 3-5% faster when no row can be skipped).
BACKWARD_GEMMS = "triton"


def token_weights(
    mask,
    loss_type: str,
    *,
    num_sequences=None,
    num_tokens=None,
    max_completion_length=None,
    dtype=torch.float32,
):
    """(B, T) weights w so that sum(w * per_token_loss) equals the loss type's aggregation."""
    m = (mask != 0).to(dtype)  # (B, T)
    sequences = m.shape[0] if num_sequences is None else num_sequences
    if loss_type in ("grpo", "gspo"):
        return m / m.sum(-1, keepdim=True).clamp(min=1.0) / sequences
    if loss_type == "dr_grpo":
        return m / (sequences * max_completion_length)
    # as_tensor keeps a device tensor on the device: no host sync
    tokens = (
        m.sum() if num_tokens is None else torch.as_tensor(num_tokens, device=m.device).to(dtype)
    )
    return m / tokens.clamp(min=1.0)


def lm_head_grpo_loss_ref(
    hidden,
    weight,
    targets,
    weights,
    advantages,
    *,
    old_logp=None,
    ref_logp=None,
    sampling_logp=None,
    temperature=1.0,
    **settings,
):
    """(loss, logp, entropy) with autograd through the reference log-prob path: the spec."""
    with_entropy = settings.get("entropy_coef", 0.0) != 0.0
    logp, entropy = lm_head_logprob_ref(hidden, weight, targets, temperature, with_entropy=True)
    ent = entropy if with_entropy else entropy.detach()
    loss = (
        weights
        * per_token_loss(logp, old_logp, ref_logp, advantages, ent, sampling_logp, **settings)
    ).sum()
    return loss, logp.detach(), entropy.detach()


class _FusedLMHeadLoss(torch.autograd.Function):
    """Loss and gradients in the forward call; backward scales them by the incoming gradient.

    `chunk_loss(start, end, logp, entropy) -> (loss, d/dlogp, d/dentropy)` (rows independent,
    token-level ratios, e.g. `token_loss.token_loss_and_grads` on the chunk's rows): one pass,
    6*N*H*V FLOPs. `whole_loss(logp, entropy)` (rows coupled, e.g. GSPO's sequence ratio): a
    statistics pass over all rows, then the gradient pass recomputes each chunk's logits,
    8*N*H*V FLOPs. Exactly one of the two is given.
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        targets,
        temperature,
        chunk_rows,
        chunk_loss,
        whole_loss,
        active_rows,
        entropy_grad,
    ):
        N, H = hidden.shape
        V = weight.shape[0]
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_hidden = torch.zeros_like(hidden) if need_dh else None
        chunks = [(start, min(start + chunk_rows, N)) for start in range(0, N, chunk_rows)]
        # dW sums across chunks in the weight's dtype, one rounding per chunk, unless there are
        # many chunks (see _dw_in_fp32)
        dw_fp32 = need_dw and _dw_in_fp32(len(chunks), weight.dtype)
        d_weight = None
        if need_dw:  # rows on 16 bytes: the dW kernel reads and writes it by TMA
            dw_dtype = torch.float32 if dw_fp32 else weight.dtype
            d_weight = aligned_empty(V, H, dtype=dw_dtype, device=weight.device)
            d_weight.zero_()
        logp = torch.empty(N, dtype=torch.float32, device=hidden.device)
        entropy, lse = torch.empty_like(logp), torch.empty_like(logp)
        triton_gemms = BACKWARD_GEMMS == "triton"
        if active_rows is None:
            active_rows = torch.full((), N, dtype=torch.int32, device=hidden.device)
        if whole_loss is not None:
            for start, end in chunks:
                stats = lm_head_stats_triton(
                    hidden[start:end], weight, targets[start:end], temperature
                )
                logp[start:end], entropy[start:end], lse[start:end] = stats
            loss, g_all, ge_all = loss_and_grads(whole_loss, logp, entropy, fill_unused=False)
            entropy_grad = ge_all is not None
        parts = []  # the chunks' loss terms, added once at the end
        # bf16 probabilities for bf16 models; fp32 for fp32 models and under the interpreter
        buffer_dtype = (
            torch.float32 if interpreting() or hidden.dtype == torch.float32 else torch.bfloat16
        )
        # rows on 16 bytes: the statistics kernel stores the probabilities by TMA
        buffer = aligned_empty(min(chunk_rows, N), V, dtype=buffer_dtype, device=hidden.device)
        # per chunk, on the device in a few launches for all chunks: n, the leading rows that can
        # carry a gradient (the only ones that get GEMM work with the Triton GEMMs), and n rounded
        # up to a row block (the entropy path writes zeros up to there)
        starts = torch.arange(0, N, chunk_rows, device=hidden.device)
        row_counts = (N - starts).clamp(max=chunk_rows)
        if triton_gemms:
            row_counts = torch.minimum((active_rows - starts).clamp(min=0), row_counts)
        row_counts = row_counts.to(torch.int32)
        row_limits = (row_counts + ROW_BLOCK - 1) // ROW_BLOCK * ROW_BLOCK
        for index, (start, end) in enumerate(chunks):
            chunk = ChunkStats(
                hidden[start:end], weight, targets[start:end], temperature, buffer[: end - start]
            )
            if whole_loss is None:
                logp[start:end], entropy[start:end] = chunk.logp, chunk.entropy
                part, g, ge = chunk_loss(start, end, chunk.logp, chunk.entropy)
                parts.append(part)
            else:  # the recomputed statistics are bitwise those of the first pass
                g = g_all[start:end]
                ge = None if ge_all is None else ge_all[start:end]
            n, limit = row_counts[index], row_limits[index]
            ref, flags = chunk_references(chunk)
            chunk.rescale_rows_(ref, flags)  # rows with a very unlikely target, if any
            if entropy_grad:  # dz in place: the GEMMs read it unscaled
                dz_from_probs_(chunk, targets[start:end], ref, g, ge, temperature, limit)
                scale, h_rows = None, hidden[start:end].to(buffer_dtype)
            else:  # dz = scale * probs (target entries rewritten): no pass over the buffer
                scale, h_rows = scale_rows(
                    chunk, targets[start:end], ref, g, temperature, hidden[start:end], buffer_dtype
                )
            z = chunk.probs
            if need_dh and triton_gemms:  # splits merged, scaled and written in one kernel
                backward_gemms.dh(z, weight.to(buffer_dtype), n, scale, out=d_hidden[start:end])
            elif need_dh:
                dh = torch.mm(z, weight.to(buffer_dtype)).float()
                d_hidden[start:end] = dh if scale is None else dh * scale[:, None]
            if need_dw and triton_gemms:
                backward_gemms.add_dw_(d_weight, z, h_rows, n)
            elif need_dw and dw_fp32:
                add_matmul_f32_(d_weight, z.t(), h_rows)
            elif need_dw:  # fp32 accumulation inside the GEMM, one rounding to the weight's dtype
                d_weight.addmm_(z.t(), h_rows)
            del chunk, z
        if whole_loss is None:
            loss = torch.stack(parts).sum() if parts else logp.new_zeros(())
        del buffer  # free the chunk buffer before the bf16 copy of dW: this sets the peak
        # Kept on ctx, not saved for backward: backward scales them in place and hands them over,
        # so no second [V, H] copy is made (the gradient is the only dW buffer left).
        ctx.grads = (d_hidden, None if d_weight is None else d_weight.to(weight.dtype))
        ctx.mark_non_differentiable(logp, entropy)
        return loss, logp, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        if ctx.grads is None:
            raise RuntimeError(
                "the fused LM-head loss computes its gradients in the forward call and hands them "
                "over once; call backward once per forward (no retain_graph double backward)"
            )
        d_hidden, d_weight = ctx.grads
        ctx.grads = None
        for grad in (d_hidden, d_weight):
            if grad is not None:
                scale_by_(grad, grad_loss)
        return d_hidden, d_weight, None, None, None, None, None, None, None


@torch.compiler.disable
def _fused_apply(*args):
    """The fused call stays opaque to torch.compile: a compiled caller breaks its graph here and
    runs the chunk loop and Triton launches eagerly (they gain nothing from tracing)."""
    return _FusedLMHeadLoss.apply(*args)


def fused_token_loss(
    hidden,
    weight,
    targets,
    weights,
    advantages,
    old_logp,
    ref_logp,
    sampling_logp,
    temperature,
    chunk_rows,
    settings,
):
    """The one-pass fused call for token-level losses: sum(weights * per_token_loss).

    Rows known before the call to have no gradient (weight 0, or advantage 0 when beta and the
    entropy bonus are 0) are moved behind the others, on the device; the backward GEMMs then skip
    them. The log-probs and entropies come back in the caller's order.
    """
    zero = weights == 0
    if settings.get("beta", 0.0) == 0.0 and settings.get("entropy_coef", 0.0) == 0.0:
        zero = zero | (advantages == 0)
    order = torch.argsort(zero.to(torch.int8), stable=True)  # rows with a gradient first
    active_rows = (~zero).sum().to(torch.int32)
    take = lambda x: None if x is None else x[order]  # noqa: E731
    old_logp, ref_logp, sampling_logp = take(old_logp), take(ref_logp), take(sampling_logp)
    weights, advantages = weights[order], advantages[order]
    pick = lambda x, s, e: None if x is None else x[s:e]  # noqa: E731

    def chunk_loss(start, end, logp, entropy):
        return token_loss_and_grads(
            logp,
            entropy,
            pick(old_logp, start, end),
            pick(ref_logp, start, end),
            pick(sampling_logp, start, end),
            advantages[start:end],
            weights[start:end],
            settings,
        )

    loss, logp, entropy = _fused_apply(
        hidden[order],
        weight,
        targets[order],
        temperature,
        chunk_rows,
        chunk_loss,
        None,
        active_rows,
        settings.get("entropy_coef", 0.0) != 0.0,
    )
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return loss, logp[inverse], entropy[inverse]


MAX_LOW_PRECISION_CHUNKS = 16  # dW sums up to this many chunks in the weight's dtype (bf16)


def _dw_in_fp32(n_chunks, dtype) -> bool:
    """Sum dW across chunks in fp32? Only for fp32 weights or more than 16 chunks. Otherwise each
    chunk's GEMM accumulates in fp32 and rounds once into the bf16 sum: no fp32 [V, H] buffer
    (0.51 GiB at V=152k, H=896; 2 GiB at H=3584) and half the read-modify-write traffic. Measured
    on the H100 (benchmarks/HISTORY.md): at 16 chunks the dW error against fp64 was 2.69e-3, against
    2.38e-3 summed in fp32 and 4.95e-3 for plain PyTorch in bf16 (the issue allows 2x the last)."""
    if dtype == torch.float32 or interpreting():
        return True
    return n_chunks > MAX_LOW_PRECISION_CHUNKS


def _chunk_rows(weight, chunk_bytes) -> int:
    """Rows per chunk for a logits budget: a multiple of 512 rows where it can be (whole waves of
    the statistics kernel: 4 row blocks x SMs/4 vocabulary splits), else of 128. The chunk's
    buffer is bf16, or fp32 for an fp32 weight (`_FusedLMHeadLoss.forward`)."""
    itemsize = 4 if weight.dtype == torch.float32 else 2
    rows = chunk_bytes // (itemsize * weight.shape[0])
    return max(128, rows // 512 * 512 if rows >= 512 else rows // 128 * 128)


def _fused_serves(hidden) -> bool:
    """The default choice of the fused path: CUDA bf16/fp16. In fp32 the kernels multiply in IEEE
    fp32 (not TF32) on the CUDA cores, ~11x slower than the reference's cuBLAS at the same
    precision (H100, N=4096, H=576, V=49152, forward + backward: 367 ms against 32)."""
    return (
        triton is not None
        and hidden.is_cuda
        and kernel_dtype("the fused LM-head loss", hidden.dtype)
    )


def lm_head_policy_loss(
    hidden,
    weight,
    targets,
    loss_fn,
    *,
    temperature=1.0,
    chunk_bytes=DEFAULT_CHUNK_BYTES,
    fused=None,
):
    """(loss, logp, entropy) for any loss of the rows' log-probs and entropies, `loss_fn(logp,
    entropy) -> scalar` (e.g. `algo.policy_loss` with a sequence-level ratio). The fused path is
    two passes (8*N*H*V FLOPs) with no [N, V] logits beyond one chunk; the reference elsewhere.
    """
    if fused is None:
        fused = _fused_serves(hidden)
    if not fused:
        logp, entropy = lm_head_logprob_ref(hidden, weight, targets, temperature, with_entropy=True)
        return loss_fn(logp, entropy), logp.detach(), entropy.detach()
    return _fused_apply(
        hidden,
        weight,
        targets,
        temperature,
        _chunk_rows(weight, chunk_bytes),
        None,
        loss_fn,
        None,
        True,  # replaced by whether loss_fn uses the entropy
    )


def lm_head_grpo_loss(
    hidden,
    weight,
    targets,
    weights,
    advantages,
    *,
    old_logp=None,
    ref_logp=None,
    sampling_logp=None,
    temperature=1.0,
    chunk_bytes=DEFAULT_CHUNK_BYTES,
    fused=None,
    **settings,
):
    """(loss, logp, entropy) for packed rows: fused Triton path on CUDA, reference elsewhere.

    hidden (N, H), weight (V, H), targets (N,), weights (N,) aggregation weights from
    `token_weights` (0 for rows that do not count), advantages (N,) (each row its sequence's),
    old/ref/sampling log-probs (N,) or None. `settings` are `per_token_loss`'s keywords.
    `fused` forces the choice (None: fused on CUDA for bf16/fp16, see `_fused_serves`; True on
    CPU needs TRITON_INTERPRET=1).
    """
    if fused is None:
        fused = _fused_serves(hidden)
    if settings.get("loss_type", "grpo") not in TOKEN_LEVEL_LOSSES:
        raise ValueError(
            "lm_head_grpo_loss takes token-level losses; use lm_head_policy_loss for GSPO"
        )
    if not fused:
        return lm_head_grpo_loss_ref(
            hidden,
            weight,
            targets,
            weights,
            advantages,
            old_logp=old_logp,
            ref_logp=ref_logp,
            sampling_logp=sampling_logp,
            temperature=temperature,
            **settings,
        )
    return fused_token_loss(
        hidden,
        weight,
        targets,
        weights.float(),
        advantages.float(),
        old_logp,
        ref_logp,
        sampling_logp,
        temperature,
        _chunk_rows(weight, chunk_bytes),
        settings,
    )

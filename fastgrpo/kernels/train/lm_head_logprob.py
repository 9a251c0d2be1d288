"""Per-token log-probabilities (and entropy) straight from hidden states and the LM-head weight.

This is the spec that the fused Triton kernel must match: logits = hidden @ weight.T / temperature
in fp32, log-softmax, gather at the target ids. Temperature is applied exactly as the sampler
applies it, so on-policy ratios are 1. Rows are processed in chunks, and under autograd each chunk
is recomputed in the backward pass instead of keeping its `[rows, vocab]` logits alive, so the
reference path never holds more than one chunk of logits.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_ROWS = 1024


def _chunk_logprob(hidden, weight, targets, temperature: float, with_entropy: bool):
    logits = hidden @ weight.t()  # (n, V)
    logits = (
        logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    )  # fp32 at least
    log_z = torch.logsumexp(logits, dim=-1)  # (n,)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z  # (n,)
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    probs = torch.softmax(logits, dim=-1)
    entropy = log_z - (probs * logits).sum(-1)  # H = log Z - E_p[z]
    return logp, entropy


def lm_head_logprob_ref(
    hidden: torch.Tensor,  # (N, H)
    weight: torch.Tensor,  # (V, H)
    targets: torch.Tensor,  # (N,) int64
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log p(target) per row, and entropy per row when asked (None otherwise)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden (N, H) and weight (V, H) expected, got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be ({hidden.shape[0]},), got {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_rows):
        part = (hidden[start : start + chunk_rows], weight, targets[start : start + chunk_rows])
        if needs_grad:
            logp, entropy = checkpoint(
                _chunk_logprob, *part, temperature, with_entropy, use_reentrant=False
            )
        else:
            logp, entropy = _chunk_logprob(*part, temperature, with_entropy)
        logps.append(logp)
        entropies.append(entropy)
    logp = torch.cat(logps) if logps else hidden.new_zeros(0, dtype=torch.float32)
    entropy = (torch.cat(entropies) if entropies else logp.clone()) if with_entropy else None
    return logp, entropy


def lm_head_logprob(
    hidden,
    weight,
    targets,
    temperature: float = 1.0,
    with_entropy: bool = False,
    fused: bool | None = None,
):
    """Per-row (logp, entropy | None). On CUDA without autograd (scoring: reference and old
    log-probs, evaluation) the Triton statistics kernel runs, with no [N, V] logits; otherwise the
    reference. `fused` forces the choice (True on CPU needs TRITON_INTERPRET=1). Training with
    the fused loss goes through `lm_head_grpo_loss`. In fp32 the reference serves unless `fused`
    asks for the kernel: the kernel's IEEE fp32 products run on the CUDA cores, several times
    slower than cuBLAS at the same precision."""
    from fastgrpo.kernels.support import kernel_dtype, triton
    from fastgrpo.kernels.train.lm_head_stats import lm_head_stats_triton

    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if fused is None:
        fused = (
            triton is not None
            and hidden.is_cuda
            and hidden.dtype == weight.dtype
            and kernel_dtype("the LM-head statistics", hidden.dtype)
        )
    if fused and not needs_grad:
        logp, entropy, _ = lm_head_stats_triton(hidden, weight, targets, temperature)
        return logp, entropy if with_entropy else None
    return lm_head_logprob_ref(hidden, weight, targets, temperature, with_entropy)

"""Token sampler of the generation engine: one call per decode step for a batch of rows.

The sampling itself (Gumbel-max with counter-based noise, top-k and top-p) is specified by
`fastgrpo.kernels.decode.sampling_ref`, in PyTorch. On CUDA, greedy or with no top-k / top-p, `sample_tokens` runs the fused Triton sampler
(`fastgrpo.kernels.decode.sample_tokens`): the same noise and tokens in one pass over the logits instead
of ~15 whole-(B, V) torch ops. FASTGRPO_DECODE_KERNELS=0 keeps the torch path everywhere.
"""

from __future__ import annotations

import torch

from fastgrpo import switches
from fastgrpo.kernels.decode import lm_head_sample
from fastgrpo.kernels.decode.sample_tokens import KERNEL_DTYPES, sample_tokens_fused, triton
from fastgrpo.kernels.decode.sampling_ref import SamplingParams, sample_tokens_torch

__all__ = ["SamplingParams", "sample_from_hidden", "sample_tokens", "sample_tokens_torch"]

# FASTGRPO_DECODE_KERNELS=0 keeps the torch sampler on CUDA too; tests flip the attribute
FUSED_SAMPLER = switches.DECODE_KERNELS


def sample_tokens(
    logits: torch.Tensor,  # (B, V) any float dtype
    params: SamplingParams,
    seeds: torch.Tensor,  # (B,) int64, one seed per sample
    step: torch.Tensor,  # (B,) or () int64, the decode step index
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return `(tokens (B,) int64, logp (B,) fp32)`.

    `logp` is `log_softmax(logits / T)[token]` under the temperature-scaled distribution BEFORE
    top-k/top-p truncation, which is what the trainer recomputes from its own logits. With
    temperature 0 the token is the argmax (ties: lowest index) and `logp` uses T = 1.
    """
    if _fused_serves(logits, params):
        return sample_tokens_fused(logits, params.temperature, seeds, step)
    return sample_tokens_torch(logits, params, seeds, step)


def sample_from_hidden(
    hidden: torch.Tensor,  # (B, H) final hidden states
    lm_head_weight: torch.Tensor,  # (V, H)
    params: SamplingParams,
    seeds: torch.Tensor,  # (B,) int64
    step: torch.Tensor,  # (B,) or () int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens(hidden @ lm_head_weight.T, ...)`. A decode batch on a Hopper GPU with the
    plain settings (no top-k / top-p, at most `lm_head_sample.MAX_ROWS` bf16 rows) goes through
    the fused LM-head sampler, which never writes the logits and keeps them in fp32; anything else
    computes the logits, then samples."""
    if _fused_serves(hidden, params) and lm_head_sample.takes(hidden, lm_head_weight):
        sampled = lm_head_sample.lm_head_sample(
            hidden, lm_head_weight, params.temperature, seeds, step
        )
        if sampled is not None:  # None: the kernel did not compile here (it warned)
            return sampled
    logits = torch.nn.functional.linear(hidden, lm_head_weight)  # (B, V)
    return sample_tokens(logits, params, seeds, step)


def _fused_serves(logits: torch.Tensor, params: SamplingParams) -> bool:
    return (
        FUSED_SAMPLER
        and triton is not None
        and logits.is_cuda
        and logits.dtype in KERNEL_DTYPES
        and (params.greedy or (params.top_k == 0 and params.top_p == 1))  # greedy ignores both
    )

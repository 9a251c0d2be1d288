"""Importance-sampling correction of the rollout engine's log-probs, in TRL's four modes
(`vllm_importance_sampling_mode`; here `algo.importance_sampling_mode`).

The engine samples from log-probs that differ slightly from the trainer's (other kernels, other
rounding), so the update is a little off-policy. Each token's policy-gradient term is weighted by
the ratio of the trainer's old log-prob to the sampler's, r = exp(old - sampling):

  token_truncate     w_t = min(r_t, cap)                    (TIS; the loss does this itself)
  token_mask         w_t = r_t where r_t <= cap, else 0     (MIS)
  sequence_truncate  w = min(R, cap) on every token, R = exp(sum_t (old_t - sampling_t))
  sequence_mask      w = R where R <= cap, else 0

The loss takes the weight through the sampling log-probs it already reads: given
`old - log(w)` in their place it computes exp(old - (old - log w)) = w, capped (a no-op here), so
every loss path (reference, fused kernel) applies every mode unchanged. That needs the old
log-probs before the update, which the trainer then scores (TRL does too).
"""

from __future__ import annotations

import torch

from fastgrpo.config import IMPORTANCE_SAMPLING_MODES as MODES  # one list of the modes


@torch.no_grad()
def importance_weights(
    old_logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> torch.Tensor:
    """(B, T) weights of the completion tokens (0 where `mask` is 0), fp32."""
    if mode not in MODES:
        raise ValueError(f"importance sampling mode {mode!r}; choose one of {', '.join(MODES)}")
    m = mask.to(torch.float32)
    diff = (old_logp.float() - sampling_logp.float()) * m  # (B, T)
    if mode.startswith("sequence"):
        ratio = torch.exp(diff.sum(-1, keepdim=True)).expand_as(diff)  # (B, T)
    else:
        ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        weight = ratio.clamp(max=cap)
    else:
        weight = torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))
    return weight * m


def as_sampling_logp(old_logp: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The sampling log-probs under which the loss's exp(old - sampling) is `weight` (+inf where
    the weight is 0: exp(-inf) = 0)."""
    return old_logp.float() - torch.log(weight)


@torch.no_grad()
def mismatch_metrics(
    old_logp: torch.Tensor,
    sampling_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    cap: float,
    weight: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs are from the trainer's, and what the correction did:
    |old - sampling| mean and max over the tokens, the weights' mean, min and max, and the share
    of tokens (token modes) or sequences (sequence modes) capped or masked. 0-d tensors.
    `weight`: `importance_weights` of the same arguments, when the caller has them already."""
    keep = mask.bool()
    gap = (old_logp.float() - sampling_logp.float()).abs()[keep]
    diff = (old_logp.float() - sampling_logp.float()) * mask
    if mode.startswith("sequence"):
        ratio = torch.exp(diff.sum(-1))  # (B,)
        rows = keep.any(-1)
        ratio = ratio[rows]
    else:
        ratio = torch.exp(diff)[keep]
    if weight is None:
        weight = importance_weights(old_logp, sampling_logp, mask, mode, cap)
    weights = weight[keep] if not mode.startswith("sequence") else weight[rows, 0]
    empty = torch.zeros((), device=old_logp.device)
    if gap.numel() == 0:
        return {
            k: empty for k in ("gap_mean", "gap_max", "is_mean", "is_min", "is_max", "corrected")
        }
    return {
        "gap_mean": gap.mean(),
        "gap_max": gap.max(),
        "is_mean": weights.mean(),
        "is_min": weights.min(),
        "is_max": weights.max(),
        "corrected": (ratio > cap).float().mean(),
    }

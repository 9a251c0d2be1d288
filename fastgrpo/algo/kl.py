"""Per-token KL penalty estimators between the policy and a frozen reference policy.

What: given the log-probability of each sampled token under the policy (``logp``) and under the
reference model (``ref_logp``), return a per-token estimate of KL(policy || reference).

Why: GRPO-family losses add ``beta * kl`` to every token's loss. Only the sampled token's
log-probabilities are available, so KL is estimated from the single log-ratio
``d = logp - ref_logp`` with one of Schulman's estimators ("Approximating KL Divergence", 2020):

* ``"k1"``: ``d``                                   unbiased, can be negative, high variance
* ``"k2"``: ``0.5 * d**2``                          biased, always >= 0, low variance
* ``"k3"``: ``exp(ref_logp - logp) - (ref_logp - logp) - 1``
  unbiased, always >= 0, low variance; TRL GRPOTrainer's (only) estimator and our default.

All estimators are exactly 0 where ``logp == ref_logp``. Masking is the caller's job.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def _kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def _kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def _kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    neg_log_ratio = ref_logp - logp
    return torch.exp(neg_log_ratio) - neg_log_ratio - 1


_KL_FNS = {
    "k1": _kl_k1,
    "k2": _kl_k2,
    "k3": _kl_k3,
}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate, same shape as ``logp`` (typically ``(B, T)``).

    Differentiable with respect to ``logp`` (and ``ref_logp``, though that is normally frozen).
    Raises ``ValueError`` for an unknown estimator or mismatched shapes.
    """
    if estimator not in _KL_FNS:
        raise ValueError(
            f"unknown kl_estimator {estimator!r}; valid values: {', '.join(KL_ESTIMATORS)}"
        )
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"ref_logp must have the same shape as logp {tuple(logp.shape)}, "
            f"got {tuple(ref_logp.shape)}"
        )
    return _KL_FNS[estimator](logp, ref_logp)

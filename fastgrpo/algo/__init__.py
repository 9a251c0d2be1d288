"""Pure tensor math of GRPO-family RL: advantages, KL estimators and policy losses.

Everything here is side-effect free (no I/O, no state) and is the numerical reference that the
trainer and the fused kernels must match.
"""

from fastgrpo.algo.advantages import group_advantages, zero_std_fraction
from fastgrpo.algo.kl import KL_ESTIMATORS, kl_penalty
from fastgrpo.algo.losses import LOSS_TYPES, policy_loss

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_TYPES",
    "group_advantages",
    "kl_penalty",
    "policy_loss",
    "zero_std_fraction",
]

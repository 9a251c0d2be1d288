"""Group-relative advantages for GRPO-family trainers.

What: turn one scalar reward per completion into one advantage per completion, by comparing each
completion with the other completions sampled for the same prompt (its "group").

Why: GRPO replaces a learned value function with this group baseline. The exact formula (which
baseline, which standard deviation, where epsilon goes) changes training dynamics, and later fused
kernels must reproduce it bit for bit, so it is written out here once as plain tensor math.

Layout: ``rewards`` has shape ``(P * G,)``; rows ``i*G .. i*G + G - 1`` are the ``G`` completions of
prompt ``i`` (consecutive grouping, as produced by repeating each prompt ``G`` times).

Formulas, for one group ``r_1 .. r_G``:

* baseline ``"mean"``:           ``c_j = r_j - mean(r)``
* baseline ``"leave_one_out"``:  ``c_j = r_j - (sum(r) - r_j) / (G - 1)``   (RLOO)
* scale ``"group"``:  ``a_j = c_j / (std(r) + eps)``, ``std`` unbiased (Bessel, ``torch.std``) over
  the group's rewards.
* scale ``"batch"``:  ``a_j = c_j / (std(all rewards) + eps)``, ``std`` unbiased over the whole
  ``(P * G,)`` reward vector. Like TRL's ``scale_rewards="batch"`` this is the std of the raw
  *rewards*, not of the centred advantages (TRL computes ``nanstd(rewards)`` over the batch and
  subtracts the per-group mean separately).
* scale ``"none"``:   ``a_j = c_j``  (Dr. GRPO recommendation).

With the default ``baseline="mean", scale="group", eps=1e-4`` this equals TRL's GRPOTrainer
advantages (``scale_rewards="group"``), ignoring TRL's NaN handling for unscorable completions.
"""

from __future__ import annotations

import torch

BASELINES = ("mean", "leave_one_out")
SCALES = ("group", "batch", "none")


def _validate(rewards: torch.Tensor, num_generations: int) -> None:
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D with shape (num_prompts * num_generations,), "
            f"got shape {tuple(rewards.shape)}"
        )
    if isinstance(num_generations, bool) or not isinstance(num_generations, int):
        raise ValueError(f"num_generations must be an int, got {num_generations!r}")
    if num_generations < 2:
        raise ValueError(
            f"num_generations must be >= 2 (a group needs at least two completions to compare), "
            f"got {num_generations}"
        )
    if rewards.numel() == 0 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"rewards.numel() ({rewards.numel()}) must be a positive multiple of "
            f"num_generations ({num_generations})"
        )


def _as_float(rewards: torch.Tensor) -> torch.Tensor:
    return rewards if rewards.is_floating_point() else rewards.to(torch.float32)


# --- baselines: (P, G) grouped rewards -> (P, G) centred rewards ---------------------------------


def _baseline_mean(grouped: torch.Tensor) -> torch.Tensor:
    return grouped - grouped.mean(dim=1, keepdim=True)  # (P, G)


def _baseline_leave_one_out(grouped: torch.Tensor) -> torch.Tensor:
    g = grouped.shape[1]
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (g - 1)  # (P, G)
    return grouped - others_mean  # (P, G)


_BASELINE_FNS = {
    "mean": _baseline_mean,
    "leave_one_out": _baseline_leave_one_out,
}


# --- scales: (P, G) grouped rewards -> divisor broadcastable to (P, G), or None -----------------


def _scale_group(grouped: torch.Tensor, eps: float) -> torch.Tensor:
    return grouped.std(dim=1, keepdim=True) + eps  # (P, 1), unbiased


def _scale_batch(grouped: torch.Tensor, eps: float) -> torch.Tensor:
    return grouped.reshape(-1).std() + eps  # (), unbiased over all P*G rewards


def _scale_none(grouped: torch.Tensor, eps: float) -> None:
    return None


_SCALE_FNS = {
    "group": _scale_group,
    "batch": _scale_batch,
    "none": _scale_none,
}


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    scale: str = "group",
    baseline: str = "mean",
    eps: float = 1e-4,
    batch_std: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return group-relative advantages, shape ``(P * G,)``, same dtype as ``rewards`` (float).

    Args:
        rewards: ``(P * G,)`` rewards, grouped consecutively by prompt. Integer rewards are
            promoted to float32.
        num_generations: ``G``, completions per prompt; must be >= 2 and divide ``rewards.numel()``.
        scale: ``"group"`` (divide by the group's unbiased std + eps), ``"batch"`` (divide by the
            unbiased std of all rewards + eps, as TRL's ``scale_rewards="batch"``) or ``"none"``.
        baseline: ``"mean"`` (subtract the group mean) or ``"leave_one_out"`` (subtract the mean of
            the other ``G - 1`` rewards of the group, RLOO).
        eps: added to the std before dividing; must be >= 0.
        batch_std: with ``scale="batch"``, the std to divide by instead of that of ``rewards``:
            in data-parallel training ``rewards`` is one rank's share of the batch, and the std
            is the whole batch's (``distributed.World.batch_std``).

    A group whose rewards are all equal gets advantage exactly 0 with every setting.
    """
    _validate(rewards, num_generations)
    if baseline not in _BASELINE_FNS:
        raise ValueError(f"unknown baseline {baseline!r}; valid values: {', '.join(BASELINES)}")
    if scale not in _SCALE_FNS:
        raise ValueError(f"unknown scale {scale!r}; valid values: {', '.join(SCALES)}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")

    grouped = _as_float(rewards).view(-1, num_generations)  # (P, G)
    centred = _BASELINE_FNS[baseline](grouped)  # (P, G)
    if scale == "batch" and batch_std is not None:
        divisor = batch_std.to(grouped.dtype) + eps  # ()
    else:
        divisor = _SCALE_FNS[scale](grouped, eps)  # (P, 1) | () | None
    advantages = centred if divisor is None else centred / divisor  # (P, G)
    return advantages.reshape(-1)  # (P * G,)


def zero_std_fraction(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Fraction of groups whose ``G`` rewards are all exactly equal, as a 0-dim float tensor.

    Such groups carry no learning signal (all their advantages are 0); the fraction is a standard
    GRPO health metric.
    """
    _validate(rewards, num_generations)
    grouped = _as_float(rewards).view(-1, num_generations)  # (P, G)
    all_equal = grouped.amax(dim=1) == grouped.amin(dim=1)  # (P,)
    return all_equal.to(grouped.dtype).mean()  # ()

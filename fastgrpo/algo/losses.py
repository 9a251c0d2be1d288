"""GRPO-family policy losses: per-token surrogate, corrections, penalties and aggregation.

What: ``policy_loss`` turns per-token log-probabilities of sampled completions, one advantage per
completion and a padding mask into a scalar loss (plus detached metrics). One function covers
GRPO, BNPO, Dr. GRPO, DAPO, GSPO and CISPO; the variants differ only in the per-token surrogate,
the ratio level (token or sequence) and the normaliser, each picked by a dict lookup below.

Why: this is the numerical reference for the trainer and for the fused Triton kernels that must
match it. It follows TRL's ``GRPOTrainer._compute_loss`` (same setting names, same order of
operations) except where noted under "Differences from TRL".

Computation, all tensors ``(B, T)`` unless noted, ``m`` = mask as 0/1 floats:

1. Padding: every ``(B, T)`` input is replaced by 0 where ``m == 0`` *before any math*, so padded
   positions may hold any garbage (even inf/NaN) and never reach the loss or the gradient.
2. ``old_logp = logp.detach()`` when not given (on-policy: ratio exactly 1).
   ``log_ratio = logp - old_logp``.
   level ``"token"``:    ``log_w = log_ratio``
   level ``"sequence"``: ``log_w = sum_t(log_ratio * m) / max(sum_t m, 1)`` per row, broadcast
   over ``T`` (GSPO).  ``coef_1 = exp(log_w)``.
3. Surrogate, with ``A`` the ``(B,)`` advantages broadcast over ``T``:
   * clipped (grpo, bnpo, dr_grpo, dapo, gspo):
     ``coef_2 = clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)``; then, if ``delta`` is set,
     ``coef_1 = min(coef_1, delta)`` (two-sided clipping, INTELLECT-2; applied after ``coef_2``);
     ``loss_t = -min(coef_1 * A, coef_2 * A)``.
   * cispo: ``loss_t = -min(coef_1, epsilon_high).detach() * A * logp``. As in TRL, the cap is
     ``epsilon_high`` itself (not ``1 + epsilon_high``; ScaleRL's epsilon_max, recommended 5.0),
     and when ``epsilon_high`` is None it falls back to ``epsilon_low`` like every other loss.
     ``delta`` is ignored, as in TRL.
4. Truncated importance sampling (TIS), when ``sampling_logp`` is given:
   ``loss_t *= min(exp(old_logp - sampling_logp), importance_sampling_cap)`` (detached).
5. ``loss_t += beta * kl_penalty(logp, ref_logp, kl_estimator)`` when ``beta != 0``.
6. ``loss_t -= entropy_coef * entropy`` when ``entropy_coef != 0``.
7. Aggregation, with ``S = num_sequences`` (default ``B``) and ``N = num_tokens`` (default
   ``sum(m)``, clamped to >= 1):
   * grpo, gspo:     ``sum_b [ sum_t(loss_t * m) / max(sum_t m, 1) ] / S``
   * dr_grpo:        ``sum(loss_t * m) / (S * max_completion_length)``
   * bnpo, dapo, cispo: ``sum(loss_t * m) / N``

Exact gradient accumulation: split a batch of ``B_total`` rows with ``N_total`` masked tokens into
micro-batches and call ``policy_loss(micro, num_sequences=B_total, num_tokens=N_total)`` on each;
the sum of those losses (and of their gradients) equals ``policy_loss(full batch)`` for every
loss type, up to float rounding, whatever the split sizes. (Each normaliser above is a sum of
per-row or per-token terms divided by a batch-wide constant, so it distributes over rows.)

Differences from TRL (``trl/trainer/grpo_trainer.py``, ``_compute_loss``):
* TRL divides grpo/bnpo/dr_grpo losses by the number of accumulation steps; ours divides by the
  global ``S``/``N`` instead, which agrees for equal-sized micro-batches and stays exact otherwise.
  With the defaults (one call per batch) every value equals TRL's with accumulation 1. bnpo and
  dapo therefore compute the same number here; both names are kept for config compatibility.
* ``"gspo"`` is shorthand for TRL's ``loss_type="grpo", importance_sampling_level="sequence"``.
* The entropy bonus is aggregated like the policy term (TRL always uses a token mean).
* ``importance_sampling_cap`` defaults to 2.0, TRL's original ``vllm_importance_sampling_cap``
  default (TRL later renamed it ``vllm_importance_sampling_clip_max`` with default 3.0).
* Metrics are means over this call's masked tokens (sequence-level ratios count once per token).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fastgrpo.algo.kl import KL_ESTIMATORS, kl_penalty

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "gspo", "cispo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
DEFAULT_IMPORTANCE_SAMPLING_CAP = 2.0


# --- per-token surrogates: return (loss, low_clipped, high_clipped), all (B, T) ----------------


def clipped_surrogate(coef_1, adv, logp, *, epsilon_low, epsilon_high, delta):
    """PPO-style clipped objective, negated. ``adv`` is (B, 1)."""
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)  # (B, T)
    low_clipped = (coef_1 < 1 - epsilon_low) & (adv < 0)  # (B, T)
    high_clipped = (coef_1 > 1 + epsilon_high) & (adv > 0)  # (B, T)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)  # (B, T)
    loss = -torch.min(coef_1 * adv, coef_2 * adv)  # (B, T)
    return loss, low_clipped, high_clipped


def cispo_surrogate(coef_1, adv, logp, *, epsilon_low, epsilon_high, delta):
    """CISPO: REINFORCE on ``logp`` weighted by the detached ratio capped at ``epsilon_high``."""
    weight = torch.clamp(coef_1, max=epsilon_high).detach()  # (B, T)
    loss = -weight * adv * logp  # (B, T)
    high_clipped = (coef_1 > epsilon_high) & (adv > 0)  # (B, T), TRL's cispo_clip_ratio
    return loss, torch.zeros_like(high_clipped), high_clipped


# --- aggregators: masked (B, T) per-token loss -> 0-dim loss ------------------------------------


def _aggregate_sequence_mean(loss, m, *, num_sequences, num_tokens, max_completion_length):
    seq_loss = (loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # (B,)
    return seq_loss.sum() / num_sequences


def _aggregate_constant_length(loss, m, *, num_sequences, num_tokens, max_completion_length):
    return (loss * m).sum() / (num_sequences * max_completion_length)


def _aggregate_token_mean(loss, m, *, num_sequences, num_tokens, max_completion_length):
    return (loss * m).sum() / num_tokens


class _LossSpec(NamedTuple):
    surrogate: object
    aggregate: object
    forced_level: str | None  # None: use the importance_sampling_level argument


_LOSS_SPECS = {
    "grpo": _LossSpec(clipped_surrogate, _aggregate_sequence_mean, None),
    "bnpo": _LossSpec(clipped_surrogate, _aggregate_token_mean, None),
    "dr_grpo": _LossSpec(clipped_surrogate, _aggregate_constant_length, None),
    "dapo": _LossSpec(clipped_surrogate, _aggregate_token_mean, None),
    "gspo": _LossSpec(clipped_surrogate, _aggregate_sequence_mean, "sequence"),
    "cispo": _LossSpec(cispo_surrogate, _aggregate_token_mean, None),
}


# --- validation -----------------------------------------------------------------------------


def _check_bt(name: str, x: torch.Tensor | None, shape: torch.Size) -> None:
    if x is not None and x.shape != shape:
        raise ValueError(
            f"{name} must have shape (B, T) = {tuple(shape)} like logp, got {tuple(x.shape)}"
        )


def _validate(
    logp,
    old_logp,
    ref_logp,
    advantages,
    mask,
    entropy,
    sampling_logp,
    *,
    loss_type,
    beta,
    kl_estimator,
    epsilon_low,
    epsilon_high,
    delta,
    importance_sampling_level,
    max_completion_length,
    entropy_coef,
    importance_sampling_cap,
    num_sequences,
    num_tokens,
):
    if loss_type not in _LOSS_SPECS:
        raise ValueError(f"unknown loss_type {loss_type!r}; valid values: {', '.join(LOSS_TYPES)}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"unknown kl_estimator {kl_estimator!r}; valid values: {', '.join(KL_ESTIMATORS)}"
        )
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"unknown importance_sampling_level {importance_sampling_level!r}; "
            f"valid values: {', '.join(IMPORTANCE_SAMPLING_LEVELS)}"
        )
    if logp.dim() != 2 or not logp.is_floating_point():
        raise ValueError(
            f"logp must be a floating (B, T) tensor, got {logp.dtype} of shape {tuple(logp.shape)}"
        )
    shape = logp.shape
    for name, x in (
        ("old_logp", old_logp),
        ("ref_logp", ref_logp),
        ("mask", mask),
        ("entropy", entropy),
        ("sampling_logp", sampling_logp),
    ):
        _check_bt(name, x, shape)
    if advantages.shape != shape[:1]:
        raise ValueError(
            f"advantages must have shape (B,) = ({shape[0]},), got {tuple(advantages.shape)}"
        )
    if beta != 0.0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when beta != 0 (got beta={beta})")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError(f"entropy is required when entropy_coef != 0 (got {entropy_coef})")
    if not 0.0 <= epsilon_low <= 1.0:
        raise ValueError(f"epsilon_low must be in [0, 1], got {epsilon_low}")
    if epsilon_high < 0.0 or (loss_type == "cispo" and epsilon_high <= 0.0):
        raise ValueError(
            f"epsilon_high must be >= 0 (> 0 for cispo, where it is the ratio cap), "
            f"got {epsilon_high}"
        )
    if delta is not None and delta <= 1.0:
        raise ValueError(f"delta must be > 1 (recommended > 1 + epsilon_high), got {delta}")
    if importance_sampling_cap <= 0.0:
        raise ValueError(f"importance_sampling_cap must be > 0, got {importance_sampling_cap}")
    if loss_type == "dr_grpo" and (max_completion_length is None or max_completion_length <= 0):
        raise ValueError(
            f"loss_type='dr_grpo' needs max_completion_length > 0, got {max_completion_length}"
        )
    if num_sequences is not None and (
        isinstance(num_sequences, bool) or not isinstance(num_sequences, int) or num_sequences <= 0
    ):
        raise ValueError(f"num_sequences must be a positive int, got {num_sequences!r}")
    if isinstance(num_tokens, (int, float)) and num_tokens <= 0:
        raise ValueError(f"num_tokens must be > 0, got {num_tokens}")


def _masked_mean(x: torch.Tensor, m: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return (x.to(m.dtype) * m).sum() / count


# --- public API -----------------------------------------------------------------------------


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "grpo",
    beta: float = 0.0,
    kl_estimator: str = "k3",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    sampling_logp: torch.Tensor | None = None,
    importance_sampling_cap: float | None = None,
    num_sequences: int | None = None,
    num_tokens: int | float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return ``(loss, metrics)`` for one (micro-)batch; see the module docstring for the math.

    Args:
        logp: ``(B, T)`` log-probs of the sampled tokens under the current policy (with grad).
        old_logp: ``(B, T)`` log-probs under the policy that generated the data, or None for
            on-policy (``logp.detach()``). Detached.
        ref_logp: ``(B, T)`` reference-model log-probs; required when ``beta != 0``. Detached.
        advantages: ``(B,)`` one advantage per sequence. Detached.
        mask: ``(B, T)`` bool or 0/1 float; nonzero marks a completion token, 0 padding.
        loss_type: one of ``LOSS_TYPES``.
        beta: KL coefficient. ``kl_estimator``: one of ``KL_ESTIMATORS``.
        epsilon_low, epsilon_high: clip range ``[1 - epsilon_low, 1 + epsilon_high]``;
            ``epsilon_high`` None means ``epsilon_low``. For cispo ``epsilon_high`` is the cap.
        delta: optional upper bound on the unclipped ratio (two-sided clipping).
        importance_sampling_level: ``"token"`` or ``"sequence"`` (forced for gspo).
        max_completion_length: the constant normaliser of dr_grpo (required for it).
        entropy: ``(B, T)`` per-token entropies (with grad); required when ``entropy_coef != 0``.
        sampling_logp: ``(B, T)`` log-probs under which the rollout engine sampled; enables TIS.
        importance_sampling_cap: TIS upper bound, default 2.0.
        num_sequences: rows in the whole accumulated batch (default ``B``).
        num_tokens: masked tokens in the whole accumulated batch (default ``mask.sum()``).

    Metrics (0-dim, detached, means over this call's masked tokens): ``ratio_mean``,
    ``clip_ratio/low_mean`` (ratio < 1 - epsilon_low with A < 0), ``clip_ratio/high_mean``
    (ratio > 1 + epsilon_high with A > 0; for cispo: ratio > cap with A > 0),
    ``clip_ratio/region_mean`` (either), plus ``kl`` if ``ref_logp`` is given, ``entropy`` if
    ``entropy`` is given and ``is_ratio_mean`` if ``sampling_logp`` is given.
    """
    if epsilon_high is None:
        epsilon_high = epsilon_low
    if importance_sampling_cap is None:
        importance_sampling_cap = DEFAULT_IMPORTANCE_SAMPLING_CAP
    _validate(
        logp,
        old_logp,
        ref_logp,
        advantages,
        mask,
        entropy,
        sampling_logp,
        loss_type=loss_type,
        beta=beta,
        kl_estimator=kl_estimator,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        delta=delta,
        importance_sampling_level=importance_sampling_level,
        max_completion_length=max_completion_length,
        entropy_coef=entropy_coef,
        importance_sampling_cap=importance_sampling_cap,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
    )
    spec = _LOSS_SPECS[loss_type]
    level = spec.forced_level or importance_sampling_level
    dtype = logp.dtype

    valid = mask if mask.dtype == torch.bool else mask != 0  # (B, T) bool
    m = valid.to(dtype)  # (B, T)

    def clean(x: torch.Tensor | None, detach: bool) -> torch.Tensor | None:
        """Zero padded positions before any math, so garbage there never reaches loss or grad."""
        if x is None:
            return None
        x = x.detach() if detach else x
        return torch.where(valid, x.to(dtype), 0.0)  # (B, T)

    logp = clean(logp, detach=False)  # (B, T)
    old_logp = logp.detach() if old_logp is None else clean(old_logp, detach=True)  # (B, T)
    ref_logp = clean(ref_logp, detach=True)  # (B, T) | None
    entropy = clean(entropy, detach=False)  # (B, T) | None
    sampling_logp = clean(sampling_logp, detach=True)  # (B, T) | None
    adv = advantages.detach().to(dtype).unsqueeze(1)  # (B, 1)

    # Importance weight of the current policy against the data-generating policy.
    log_ratio = logp - old_logp  # (B, T)
    if level == "sequence":
        seq_log_ratio = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(
            min=1.0
        )  # (B, 1)
        log_ratio = seq_log_ratio.expand_as(logp)  # (B, T)
    coef_1 = torch.exp(log_ratio)  # (B, T)

    per_token_loss, low_clipped, high_clipped = spec.surrogate(
        coef_1, adv, logp, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta
    )  # (B, T) x3

    is_ratio = None
    if sampling_logp is not None:
        is_ratio = torch.clamp(torch.exp(old_logp - sampling_logp), max=importance_sampling_cap)
        per_token_loss = per_token_loss * is_ratio  # (B, T)

    kl = None
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, kl_estimator)  # (B, T)
        if beta != 0.0:
            per_token_loss = per_token_loss + beta * kl  # (B, T)

    if entropy_coef != 0.0:
        per_token_loss = per_token_loss - entropy_coef * entropy  # (B, T)

    seqs = logp.shape[0] if num_sequences is None else num_sequences
    toks = m.sum() if num_tokens is None else torch.as_tensor(num_tokens, device=m.device)
    toks = toks.to(dtype).clamp(min=1.0)  # ()
    loss = spec.aggregate(
        per_token_loss,
        m,
        num_sequences=seqs,
        num_tokens=toks,
        max_completion_length=max_completion_length,
    )  # ()

    with torch.no_grad():
        count = m.sum().clamp(min=1.0)  # () local masked tokens
        metrics = {
            "ratio_mean": _masked_mean(coef_1, m, count),
            "clip_ratio/low_mean": _masked_mean(low_clipped, m, count),
            "clip_ratio/high_mean": _masked_mean(high_clipped, m, count),
            "clip_ratio/region_mean": _masked_mean(low_clipped | high_clipped, m, count),
        }
        if kl is not None:
            metrics["kl"] = _masked_mean(kl, m, count)
        if entropy is not None:
            metrics["entropy"] = _masked_mean(entropy, m, count)
        if is_ratio is not None:
            metrics["is_ratio_mean"] = _masked_mean(is_ratio, m, count)
    metrics = {k: v.detach() for k, v in metrics.items()}
    return loss, metrics

"""Per-token GRPO-family loss and its derivatives in one Triton kernel.

What: for packed rows (N,) with their log-probs and entropies (from the statistics kernel), the
old / reference / sampling log-probs, advantages and aggregation weights, one kernel computes each
row's weighted loss term w * l and the derivatives g = w * dl/dlogp and ge = w * dl/dentropy, for
every token-level variant of `per_token_loss`: the clipped ratio (with
the two-sided `delta` cap) or CISPO's capped REINFORCE weight, the truncated importance-sampling
correction, the k1/k2/k3 KL penalty and the entropy bonus. Settings are run-time arguments.

Why: the fused LM-head loss needs these per chunk of rows; through autograd they were ~40 small
kernel launches per chunk (about 2 ms of GPU time and most of the host time of a 16k-token call).

Reference: `token_loss_and_grads_ref` (autograd through `per_token_loss`), the spec. At a tie of the
two clipped terms (every unclipped token: on-policy the ratio is exactly 1) autograd's min splits
the gradient evenly; the kernel does the same, so both give the full unclipped gradient.
"""

from __future__ import annotations

import torch

from fastgrpo.algo.kl import KL_ESTIMATORS, kl_penalty
from fastgrpo.algo.losses import cispo_surrogate, clipped_surrogate
from fastgrpo.kernels.support import interpreting, triton

if triton is not None:
    import triton.language as tl

CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo")
KL_CODE = {"k1": 1, "k2": 2, "k3": 3}
TOKEN_LEVEL_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")


def per_token_loss(
    logp,
    old_logp,
    ref_logp,
    advantages,
    entropy,
    sampling_logp,
    *,
    loss_type="grpo",
    beta=0.0,
    kl_estimator="k3",
    epsilon_low=0.2,
    epsilon_high=None,
    delta=None,
    entropy_coef=0.0,
    importance_sampling_cap=2.0,
):
    """Per-token loss of packed rows (N,): the token-level part of `algo.policy_loss`."""
    if loss_type not in TOKEN_LEVEL_LOSSES:
        raise ValueError(
            f"per_token_loss handles token-level losses {TOKEN_LEVEL_LOSSES}, not {loss_type!r}"
        )
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    old_logp = logp.detach() if old_logp is None else old_logp
    coef_1 = torch.exp(logp - old_logp)
    surrogate = cispo_surrogate if loss_type == "cispo" else clipped_surrogate
    loss, _, _ = surrogate(
        coef_1, advantages, logp, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta
    )
    if sampling_logp is not None:
        loss = loss * torch.clamp(torch.exp(old_logp - sampling_logp), max=importance_sampling_cap)
    if beta != 0.0:
        loss = loss + beta * kl_penalty(logp, ref_logp, kl_estimator)
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * entropy
    return loss


def loss_and_grads(loss_fn, logp, entropy, fill_unused=True):
    """loss_fn(logp, entropy) and its derivatives with respect to both (zeros where unused, or
    None for an unused entropy without `fill_unused`)."""
    with torch.enable_grad():
        logp_leaf = logp.detach().requires_grad_()
        entropy_leaf = entropy.detach().requires_grad_()
        loss = loss_fn(logp_leaf, entropy_leaf)
        g, ge = torch.autograd.grad(loss, (logp_leaf, entropy_leaf), allow_unused=True)
    g = torch.zeros_like(logp) if g is None else g
    if ge is None:
        return loss.detach(), g.contiguous(), torch.zeros_like(logp) if fill_unused else None
    return loss.detach(), g.contiguous(), ge.contiguous()


def token_loss_and_grads_ref(logp, entropy, old, ref, sampling, adv, weights, settings):
    """(sum of w * l, g, ge) by autograd through `per_token_loss`: the spec."""

    def loss_fn(lp, ent):
        return (weights * per_token_loss(lp, old, ref, adv, ent, sampling, **settings)).sum()

    return loss_and_grads(loss_fn, logp, entropy)


if triton is not None:

    @triton.jit
    def _token_loss_kernel(
        logp_ptr,
        ent_ptr,
        old_ptr,
        ref_ptr,
        samp_ptr,
        adv_ptr,
        w_ptr,
        term_ptr,
        g_ptr,
        ge_ptr,  # outputs: w * l, w * dl/dlogp, w * dl/dentropy, each (N,) fp32
        N,
        eps_low,
        eps_high,
        delta,  # +inf when unset
        beta,
        entropy_coef,
        is_cap,
        CISPO: tl.constexpr,
        HAS_OLD: tl.constexpr,
        HAS_SAMPLING: tl.constexpr,
        KL: tl.constexpr,  # 0 none, 1 k1, 2 k2, 3 k3
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        logp = tl.load(logp_ptr + offs, mask=ok, other=0.0)
        adv = tl.load(adv_ptr + offs, mask=ok, other=0.0)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0)
        if HAS_OLD:
            old = tl.load(old_ptr + offs, mask=ok, other=0.0)
        else:
            old = logp
        ratio = tl.exp(logp - old)  # d ratio / d logp = ratio
        if CISPO:
            capped = tl.minimum(ratio, eps_high)  # detached weight
            loss = -capped * adv * logp
            dloss = -capped * adv
        else:
            clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
            capped = tl.minimum(ratio, delta)
            a = capped * adv
            b = clipped * adv
            # clamp passes the gradient inside its closed range, as torch.clamp does
            da = tl.where(ratio <= delta, ratio * adv, 0.0)
            db = tl.where((ratio >= 1.0 - eps_low) & (ratio <= 1.0 + eps_high), ratio * adv, 0.0)
            loss = -tl.minimum(a, b)
            dloss = -tl.where(a < b, da, tl.where(b < a, db, 0.5 * (da + db)))
        if HAS_SAMPLING:
            samp = tl.load(samp_ptr + offs, mask=ok, other=0.0)
            is_weight = tl.minimum(tl.exp(old - samp), is_cap)
            loss = loss * is_weight
            dloss = dloss * is_weight
        if KL != 0:
            ref = tl.load(ref_ptr + offs, mask=ok, other=0.0)
            d = logp - ref
            if KL == 1:
                loss += beta * d
                dloss += beta
            elif KL == 2:
                loss += beta * 0.5 * d * d
                dloss += beta * d
            else:
                e = tl.exp(-d)
                loss += beta * (e + d - 1.0)
                dloss += beta * (1.0 - e)
        ent = tl.load(ent_ptr + offs, mask=ok, other=0.0)
        loss -= entropy_coef * ent
        tl.store(term_ptr + offs, w * loss, mask=ok)
        tl.store(g_ptr + offs, w * dloss, mask=ok)
        tl.store(ge_ptr + offs, -w * entropy_coef, mask=ok)


def token_loss_and_grads(logp, entropy, old, ref, sampling, adv, weights, settings):
    """(sum of w * l, g, ge) for packed rows, in one Triton launch plus a sum.

    `settings` are `per_token_loss`'s keywords (token-level loss types only)."""
    loss_type = settings.get("loss_type", "grpo")
    if loss_type not in CLIPPED_LOSSES + ("cispo",):
        raise ValueError(f"token-level loss types only, not {loss_type!r}")
    estimator = settings.get("kl_estimator", "k3")
    if estimator not in KL_CODE:
        raise ValueError(
            f"unknown kl_estimator {estimator!r}; valid values: {', '.join(KL_ESTIMATORS)}"
        )
    beta = float(settings.get("beta", 0.0))
    if beta != 0.0 and ref is None:
        raise ValueError("beta != 0 needs the reference log-probs")
    eps_low = float(settings.get("epsilon_low", 0.2))
    eps_high = settings.get("epsilon_high")
    eps_high = eps_low if eps_high is None else float(eps_high)
    delta = settings.get("delta")
    n = logp.shape[0]
    term, g, ge = (torch.empty_like(logp) for _ in range(3))
    block = 128 if interpreting() else 1024
    if n:
        _token_loss_kernel[(triton.cdiv(n, block),)](
            logp,
            entropy,
            logp if old is None else old,
            logp if ref is None else ref,
            logp if sampling is None else sampling,
            adv,
            weights,
            term,
            g,
            ge,
            n,
            eps_low,
            eps_high,
            float("inf") if delta is None else float(delta),
            beta,
            float(settings.get("entropy_coef", 0.0)),
            float(settings.get("importance_sampling_cap", 2.0)),
            CISPO=loss_type == "cispo",
            HAS_OLD=old is not None,
            HAS_SAMPLING=sampling is not None,
            KL=KL_CODE[estimator] if beta != 0.0 else 0,
            BLOCK=block,
        )
    return term.sum(), g, ge

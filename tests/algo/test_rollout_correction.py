"""Importance-sampling correction in TRL's four modes: the weights against a float64 spec, the
sampling log-probs that carry them through every loss path (reference and Triton kernel), and
the mismatch metrics."""

from __future__ import annotations

import pytest
import torch

from fastgrpo.algo.rollout_correction import (
    MODES,
    as_sampling_logp,
    importance_weights,
    mismatch_metrics,
)
from fastgrpo.kernels.train.token_loss import (
    per_token_loss,
    token_loss_and_grads,
    token_loss_and_grads_ref,
)


def batch(seed: int = 0, rows: int = 5, width: int = 7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, width, generator=g) * 3
    sampling = old + 0.4 * torch.randn(rows, width, generator=g)  # a visible mismatch
    lengths = torch.tensor([7, 1, 4, 6, 3])[:rows]
    mask = (torch.arange(width) < lengths[:, None]).float()
    return old, sampling, mask


def spec(old, sampling, mask, mode, cap):
    """The weights in float64, written out per case."""
    diff = (old.double() - sampling.double()) * mask.double()
    out = torch.zeros_like(diff)
    for i in range(diff.shape[0]):
        for t in range(diff.shape[1]):
            if not mask[i, t]:
                continue
            r = torch.exp(diff[i].sum() if mode.startswith("sequence") else diff[i, t])
            if mode.endswith("truncate"):
                out[i, t] = min(r, cap)
            else:
                out[i, t] = r if r <= cap else 0.0
    return out


@pytest.mark.parametrize("mode", MODES)
def test_weights_follow_each_mode(mode):
    old, sampling, mask = batch()
    got = importance_weights(old, sampling, mask, mode, cap=1.5)
    want = spec(old, sampling, mask, mode, 1.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    capped = (
        (want == 1.5).sum() if mode.endswith("truncate") else (want == 0).sum() - (mask == 0).sum()
    )
    assert capped > 0  # the batch exercises the cap


@pytest.mark.parametrize("mode", MODES)
def test_the_loss_applies_the_weights_through_the_sampling_log_probs(mode):
    """Every loss path computes min(exp(old - sampling), cap): given old - log(w) it applies w,
    masked tokens (w = 0) included; the Triton kernel (interpreted) agrees with the spec."""
    old, sampling, mask = batch(1)
    keep = mask.bool()
    weight = importance_weights(old, sampling, mask, mode, cap=1.5)
    carried = as_sampling_logp(old, weight)[keep]
    o = old[keep]
    logp = o + 0.05 * torch.randn(o.shape, generator=torch.Generator().manual_seed(2))
    adv = torch.linspace(-1, 1, o.numel())
    settings = {"loss_type": "grpo", "importance_sampling_cap": 1.5}
    plain = per_token_loss(logp, o, None, adv, None, None, **settings)
    weighted = per_token_loss(logp, o, None, adv, None, carried, **settings)
    torch.testing.assert_close(weighted, plain * weight[keep], rtol=1e-6, atol=1e-7)
    w = torch.ones_like(o)
    ref = token_loss_and_grads_ref(logp, torch.zeros_like(o), o, None, carried, adv, w, settings)
    got = token_loss_and_grads(logp, torch.zeros_like(o), o, None, carried, adv, w, settings)
    for a, b in zip(got[:2], ref[:2]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_mismatch_metrics_on_a_small_case():
    old = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    sampling = torch.tensor([[-1.5, -1.0, 0.0], [-1.0, -1.0, -4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    m = mismatch_metrics(old, sampling, mask, "token_mask", cap=2.0)
    assert float(m["gap_mean"]) == pytest.approx((0.5 + 1.0 + 0 + 0 + 3.0) / 5)
    assert float(m["gap_max"]) == 3.0
    # ratios exp(0.5), exp(-1), 1, 1, exp(3): exp(3) > 2 is masked
    assert float(m["corrected"]) == pytest.approx(1 / 5)
    assert float(m["is_min"]) == 0.0 and float(m["is_max"]) == pytest.approx(1.6487, rel=1e-4)
    s = mismatch_metrics(old, sampling, mask, "sequence_truncate", cap=2.0)
    # sequences: exp(0.5 - 1.0) = 0.61, exp(3) capped to 2
    assert float(s["corrected"]) == 0.5 and float(s["is_max"]) == 2.0

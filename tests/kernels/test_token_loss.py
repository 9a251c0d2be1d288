"""The per-token loss kernel against autograd through `per_token_loss` (every token-level variant)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, LOSS_VARIANTS, NEEDS_TRITON, variant_id

from fastgrpo.kernels.train import token_loss as tk

pytestmark = NEEDS_TRITON
VARIANTS = LOSS_VARIANTS + [dict(loss_type="dapo", epsilon_high=0.28, importance_sampling_cap=1.5)]


def _rows(n, seed, with_old=True, with_sampling=False):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, generator=gen) * 6
    entropy = torch.rand(n, generator=gen) * 3
    # ratios spread across both clip edges, plus exact ties at the edges
    old = logp + torch.randn(n, generator=gen) * 0.4 if with_old else None
    if with_old:
        old[:4] = logp[:4] - torch.log(torch.tensor([0.8, 1.2, 1.0, 1.5]))
    ref = logp + torch.randn(n, generator=gen) * 0.3
    sampling = (old if with_old else logp) + torch.randn(n, generator=gen) * 0.5
    adv = torch.randn(n, generator=gen)
    adv[5:9] = 0.0
    weights = torch.rand(n, generator=gen) / n
    weights[9] = 0.0
    dev = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return [dev(x) for x in (logp, entropy, old, ref, sampling if with_sampling else None, adv)] + [
        dev(weights)
    ]


@pytest.mark.parametrize("settings", VARIANTS, ids=variant_id)
@pytest.mark.parametrize("with_old", [True, False])
def test_kernel_matches_autograd_reference(settings, with_old):
    rows = _rows(
        301,
        seed=len(settings),
        with_old=with_old,
        with_sampling="importance_sampling_cap" in settings,
    )
    got = tk.token_loss_and_grads(*rows, settings)
    want = tk.token_loss_and_grads_ref(*rows, settings)
    assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-7)
    assert torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-8)
    assert torch.allclose(got[2], want[2], rtol=1e-5, atol=1e-8)


def test_bad_settings_are_refused_clearly():
    rows = _rows(16, seed=0)
    with pytest.raises(ValueError, match="token-level"):
        tk.token_loss_and_grads(*rows, dict(loss_type="gspo"))
    with pytest.raises(ValueError, match="kl_estimator"):
        tk.token_loss_and_grads(*rows, dict(beta=0.1, kl_estimator="k9"))

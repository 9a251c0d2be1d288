"""The Triton LM-head statistics kernel against the float64 reference (interpreter on CPU)."""

from __future__ import annotations

import os

import pytest
import torch
from kernel_cases import DEVICE, NEEDS_TRITON, ON_GPU

from fastgrpo.kernels.train import lm_head_stats as ops

pytestmark = NEEDS_TRITON


def _inputs(n, h, v, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    # logits with a standard deviation of ~4, as a trained LM head gives (log-probs down to ~-25);
    # at much larger logits the fp32 accumulator itself is off by more than 1e-4
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    weight = (torch.randn(v, h, generator=gen) * 4 / h**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[0] = v - 1  # the last (tail-masked) vocabulary column
    return hidden.to(DEVICE), weight.to(DEVICE), targets.to(DEVICE)


# h=13: rows not 16-byte aligned, so the kernel reads a zero-padded copy
@pytest.mark.parametrize("n, h, v", [(1, 16, 151), (37, 48, 151), (20, 32, 1000), (5, 13, 151)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stats_kernel_matches_float64_reference(n, h, v, temperature, dtype):
    hidden, weight, targets = _inputs(n, h, v, dtype, seed=n + v)
    logp, entropy, lse = ops.lm_head_stats_triton(hidden, weight, targets, temperature)
    want_logp, want_entropy, want_lse = ops.lm_head_stats_ref(
        hidden.double(), weight.double(), targets, temperature
    )
    assert (logp.double() - want_logp).abs().max() <= 1e-4
    assert (entropy.double() - want_entropy).abs().max() <= 1e-4
    assert (lse.double() - want_lse).abs().max() <= 1e-4
    assert logp.dtype == torch.float32 and (logp <= 0).all()


def test_stats_kernel_without_entropy_gives_the_same_log_probs():
    hidden, weight, targets = _inputs(23, 32, 300, torch.bfloat16, seed=5)
    logp, entropy, lse = ops.lm_head_stats_triton(hidden, weight, targets, 0.8)
    bare, none, bare_lse = ops.lm_head_stats_triton(
        hidden, weight, targets, 0.8, with_entropy=False
    )
    assert none is None and entropy is not None
    assert torch.equal(logp, bare) and torch.equal(lse, bare_lse)


def test_stats_kernel_is_deterministic_run_to_run():
    hidden, weight, targets = _inputs(19, 32, 300, torch.bfloat16, seed=3)
    first = ops.lm_head_stats_triton(hidden, weight, targets, 0.9)
    again = ops.lm_head_stats_triton(hidden, weight, targets, 0.9)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_stats_kernel_at_a_real_vocabulary_and_int64_offsets():
    hidden, weight, targets = _inputs(4099, 896, 151936, torch.bfloat16, seed=7)
    logp, entropy, _ = ops.lm_head_stats_triton(hidden, weight, targets, 1.0)
    want_logp, want_entropy, _ = ops.lm_head_stats_ref(
        hidden.double(), weight.double(), targets, 1.0
    )
    assert (logp.double() - want_logp).abs().max() <= 1e-4
    assert (entropy.double() - want_entropy).abs().max() <= 1e-4
    assert os.environ.get("TRITON_INTERPRET") != "1"


def test_combine_kernel_matches_its_torch_reference():
    gen = torch.Generator().manual_seed(3)
    splits, n = 5, 37
    m = torch.randn(splits, n, generator=gen) * 10
    s = torch.rand(splits, n, generator=gen) * 100 + 1
    pz = torch.randn(splits, n, generator=gen) * 50
    t = torch.randn(n, generator=gen) * 10
    stats = torch.stack([m, s, pz]).to(DEVICE)
    got = ops._combine(stats, t.to(DEVICE))
    want = ops.combine_stats(m.double(), s.double(), pz.double(), t.double())
    for g, w in zip(got, want):
        assert torch.allclose(g.double().cpu(), w, rtol=1e-5, atol=1e-5)

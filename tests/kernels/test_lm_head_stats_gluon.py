"""The Gluon statistics kernel of the training pass (Hopper) against the Triton kernel, bit for bit,
and against the float64 reference; where it does not apply, the Triton kernel serves."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import UncompilableKernel

from fastgrpo.kernels.support import aligned_empty
from fastgrpo.kernels.train import lm_head_stats as ops
from fastgrpo.kernels.train import lm_head_stats_gluon as gluon_stats

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _chunk(n, h, v, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = (torch.randn(n, h, device="cuda", generator=gen) * 0.5).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=gen) * 4 / h**0.5).bfloat16()
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    targets[0] = v - 1  # the last, tail-masked, vocabulary column
    return hidden, weight, targets


def _training_stats(hidden, weight, targets, temperature, entropy, gluon):
    """(per-split statistics, stored probabilities, ChunkStats) of one training pass."""
    saved = gluon_stats.ENABLED
    gluon_stats.ENABLED = gluon
    try:
        probs = aligned_empty(hidden.shape[0], weight.shape[0], dtype=torch.bfloat16, device="cuda")
        chunk = ops.ChunkStats(hidden, weight, targets, temperature, probs, entropy)
        return chunk._stats, probs, chunk
    finally:
        gluon_stats.ENABLED = saved


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize(
    "n, h, v", [(2048, 896, 151936), (1000, 896, 151936), (1, 896, 32768), (300, 3584, 152064)]
)
@pytest.mark.parametrize("entropy", [True, False])
def test_gluon_training_stats_are_bitwise_the_triton_kernels(n, h, v, entropy):
    hidden, weight, targets = _chunk(n, h, v, seed=n + h)
    probs = torch.empty(1, dtype=torch.bfloat16, device="cuda")
    assert gluon_stats.applies(hidden, probs, ops._blocks(h), None)
    stats, probs, chunk = _training_stats(hidden, weight, targets, 0.8, entropy, gluon=True)
    want_stats, want_probs, _ = _training_stats(hidden, weight, targets, 0.8, entropy, gluon=False)
    assert not gluon_stats._failed
    assert torch.equal(stats, want_stats)
    assert torch.equal(probs, want_probs)
    logp, ent, _ = ops.lm_head_stats_ref(hidden[:64].double(), weight.double(), targets[:64], 0.8)
    assert (chunk.logp[:64].double() - logp).abs().max() <= 1e-4
    if entropy:
        assert (chunk.entropy[:64].double() - ent).abs().max() <= 1e-4


def test_gluon_kernel_serves_only_hopper_bf16_training_with_its_configuration():
    cpu = torch.zeros(4, 896, dtype=torch.bfloat16)
    assert not gluon_stats.applies(cpu, cpu, gluon_stats.CONFIG, None)
    if ON_HOPPER:
        gpu = cpu.cuda()
        assert gluon_stats.applies(gpu, gpu, gluon_stats.CONFIG, None)
        assert not gluon_stats.applies(gpu.float(), gpu, gluon_stats.CONFIG, None)
        assert not gluon_stats.applies(gpu, gpu.float(), gluon_stats.CONFIG, None)
        assert not gluon_stats.applies(gpu, gpu, (128, 128, 64, 8, 3), None)  # other tiles
        assert not gluon_stats.applies(gpu, gpu, gluon_stats.CONFIG, torch.ones(1))  # flags


@pytest.mark.skipif(gluon_stats.gluon is None, reason="needs triton's Gluon")
def test_a_gluon_kernel_that_does_not_compile_warns_once_and_hands_back(monkeypatch):
    monkeypatch.setattr(gluon_stats, "_lm_head_stats_gluon_kernel", UncompilableKernel())
    monkeypatch.setattr(gluon_stats, "_failed", False)
    hidden = torch.zeros(4, 64, dtype=torch.bfloat16)
    weight = torch.zeros(300, 64, dtype=torch.bfloat16)
    stats = torch.empty(3, 2, 4)
    probs = torch.empty(4, 304, dtype=torch.bfloat16)[:, :300]
    with pytest.warns(UserWarning, match="unsupported layout"):
        done = gluon_stats.launch(hidden, weight, 1.0, stats, probs, torch.zeros(4), True)
    assert done is False and gluon_stats._failed
    assert not gluon_stats.applies(hidden, probs, gluon_stats.CONFIG, None)  # not tried again

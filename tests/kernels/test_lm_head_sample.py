"""The fused LM-head sampler (tokens straight from hidden states) against fp32 logits by torch and
the torch sampler (interpreter on CPU). Tokens are compared on rows whose two best reference scores
are more than 1e-5 apart (a near-tie can go either way); log-probs against float64."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, NEEDS_TRITON, ON_GPU

from fastgrpo.kernels import lm_head_sample as ops
from fastgrpo.rollout.sampling import _gumbel

pytestmark = NEEDS_TRITON

NEAR_TIE = 1e-5


def _inputs(batch, hidden, vocab, seed, dtype=torch.float32):
    """hidden (B, H), weight (V, H) giving logits of std ~3, seeds (B,), step () on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, hidden, generator=gen).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen) * 3 / hidden**0.5).to(dtype)
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
    return x.to(DEVICE), w.to(DEVICE), seeds.to(DEVICE), torch.tensor(seed * 31 + 7).to(DEVICE)


def _check(tokens, logp, x, w, temperature, seeds, step):
    logits = x.double() @ w.double().t()  # (B, V)
    z = logits / temperature if temperature else logits
    scores = z + _gumbel(seeds, step, z.shape[1]).double() if temperature else z
    top = scores.topk(min(2, z.shape[1]), -1).values
    clear = (top[:, 0] - top[:, -1] > NEAR_TIE) | (z.shape[1] == 1)
    assert clear.any(), "every row is a near-tie: the test compares nothing"
    assert torch.equal(tokens[clear].cpu(), scores.argmax(-1)[clear].cpu())
    want = torch.log_softmax(z, -1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert logp.dtype == torch.float32
    assert (logp.double() - want).abs().max() <= 1e-4


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("B, H, V", [(1, 16, 151), (5, 48, 1000), (17, 32, 33), (3, 16, 1)])
def test_tokens_and_log_probs_match_fp32_logits_and_the_torch_sampler(B, H, V, temperature):
    x, w, seeds, step = _inputs(B, H, V, seed=B + V)
    tokens, logp = ops.lm_head_sample(x, w, temperature, seeds, step)
    assert tokens.dtype == torch.int64 and tokens.shape == (B,)
    _check(tokens, logp, x, w, temperature, seeds, step)


def test_per_row_steps_and_the_same_seed_give_the_same_samples():
    x, w, seeds, _ = _inputs(6, 16, 200, seed=3)
    step = torch.arange(6, device=DEVICE) * 1000
    first = ops.lm_head_sample(x, w, 1.0, seeds, step)
    again = ops.lm_head_sample(x, w, 1.0, seeds, step)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    _check(*first, x, w, 1.0, seeds, step)


def test_samples_follow_the_softmax_of_the_logits():
    """64 identical rows with distinct steps: a chi-square test of 1,280 draws over 6 tokens."""
    x, w, _, _ = _inputs(1, 16, 6, seed=11)
    x = x.expand(64, -1).contiguous()
    seeds = torch.full((64,), 1234, device=DEVICE)
    counts = torch.zeros(6)
    for call in range(20):
        step = torch.arange(64, device=DEVICE) + 64 * call
        tokens, _ = ops.lm_head_sample(x, w, 1.0, seeds, step)
        counts += torch.bincount(tokens.cpu(), minlength=6).float()
    probs = torch.softmax((x[:1].double() @ w.double().t())[0], -1).cpu()
    expected = probs * counts.sum()
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 20.5  # the 0.999 quantile of chi-square with 5 degrees of freedom


def test_launcher_says_what_it_cannot_take():
    x, w, seeds, step = _inputs(3, 16, 40, seed=1)
    with pytest.raises(ValueError, match="at most"):
        ops.lm_head_sample(x[:1].expand(65, -1), w, 1.0, seeds[:1].expand(65), step)
    with pytest.raises(ValueError, match="share a float dtype"):
        ops.lm_head_sample(x.double(), w, 1.0, seeds, step)
    with pytest.raises(ValueError, match="temperature"):
        ops.lm_head_sample(x, w, -1.0, seeds, step)
    with pytest.raises(ValueError, match="seeds"):
        ops.lm_head_sample(x, w, 1.0, seeds[:2], step)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("B", [64, 7])
def test_bf16_at_the_real_vocabulary(B, temperature):
    x, w, seeds, step = _inputs(B, 896, 151936, seed=B, dtype=torch.bfloat16)
    tokens, logp = ops.lm_head_sample(x, w, temperature, seeds, step)
    _check(tokens, logp, x, w, temperature, seeds, step)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_captured_in_a_cuda_graph_follows_the_step_changed_in_place():
    x, w, seeds, step = _inputs(64, 896, 151936, seed=5, dtype=torch.bfloat16)
    ops.lm_head_sample(x, w, 1.0, seeds, step)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, logp = ops.lm_head_sample(x, w, 1.0, seeds, step)
    for value in (3, 90, 4):
        step.fill_(value)
        graph.replay()
        want = ops.lm_head_sample(x, w, 1.0, seeds, step)
        assert torch.equal(tokens, want[0]) and torch.equal(logp, want[1])

"""The fused LM-head sampler (Gluon, Hopper) against fp32 logits by torch and the torch sampler.
Tokens are compared on rows whose two best reference scores are more than 1e-5 apart (a near-tie
can go either way); log-probs against float64 at the sampled tokens. Elsewhere the decode step
samples from logits, and a kernel that does not compile hands back to that path."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import UncompilableKernel

from fastgrpo.kernels.decode import lm_head_sample as ops
from fastgrpo.kernels.decode.sampling_ref import _gumbel
from fastgrpo.kernels.layers.rms_norm import add_rms_norm
from fastgrpo.rollout import SamplingParams
from fastgrpo.rollout.sampling import sample_from_hidden, sample_tokens

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(
    not ON_HOPPER or ops.gluon is None, reason="needs a Hopper GPU (sm_90) and triton's Gluon"
)
NEAR_TIE = 1e-5


def _inputs(batch, hidden, vocab, seed):
    """hidden (B, H), weight (V, H) in bf16 giving logits of std ~3, seeds (B,), step ()."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, hidden, generator=gen).bfloat16().cuda()
    w = (torch.randn(vocab, hidden, generator=gen) * 3 / hidden**0.5).bfloat16().cuda()
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=gen).cuda()
    return x, w, seeds, torch.tensor(seed * 31 + 7).cuda()


def _check(tokens, logp, x, w, temperature, seeds, step):
    logits = x.double() @ w.double().t()  # (B, V)
    z = logits / temperature if temperature else logits
    scores = z + _gumbel(seeds, step, z.shape[1]).double() if temperature else z
    top = scores.topk(min(2, z.shape[1]), -1).values
    clear = (top[:, 0] - top[:, -1] > NEAR_TIE) | (z.shape[1] == 1)
    assert clear.any(), "every row is a near-tie: the test compares nothing"
    assert torch.equal(tokens[clear], scores.argmax(-1)[clear])
    want = torch.log_softmax(z, -1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    assert tokens.dtype == torch.int64 and logp.dtype == torch.float32
    assert (logp.double() - want).abs().max() <= 1e-4


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize(
    "B, H, V", [(64, 896, 151936), (7, 896, 151936), (1, 896, 151936), (5, 64, 1000), (3, 64, 33)]
)
@pytest.mark.gpu
@needs_hopper
def test_tokens_and_log_probs_match_fp32_logits_and_the_torch_sampler(B, H, V, temperature):
    x, w, seeds, step = _inputs(B, H, V, seed=B + V)
    assert ops.takes(x, w)
    tokens, logp = ops.lm_head_sample(x, w, temperature, seeds, step)
    _check(tokens, logp, x, w, temperature, seeds, step)


@pytest.mark.gpu
@needs_hopper
def test_per_row_steps_and_the_same_seed_give_the_same_samples():
    x, w, seeds, _ = _inputs(6, 896, 151936, seed=3)
    step = torch.arange(6).cuda() * 1000
    first = ops.lm_head_sample(x, w, 1.0, seeds, step)
    again = ops.lm_head_sample(x, w, 1.0, seeds, step)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    _check(*first, x, w, 1.0, seeds, step)


@pytest.mark.gpu
@needs_hopper
def test_samples_follow_the_softmax_of_the_logits():
    """64 identical rows with distinct steps: a chi-square test of 6,400 draws over 6 tokens."""
    x, w, _, _ = _inputs(1, 64, 6, seed=11)
    x = x.expand(64, -1).contiguous()
    seeds = torch.full((64,), 1234).cuda()
    counts = torch.zeros(6)
    for call in range(100):
        step = torch.arange(64).cuda() + 64 * call
        tokens, _ = ops.lm_head_sample(x, w, 1.0, seeds, step)
        counts += torch.bincount(tokens.cpu(), minlength=6).float()
    probs = torch.softmax((x[:1].double() @ w.double().t())[0], -1).cpu()
    expected = probs * counts.sum()
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 20.5  # the 0.999 quantile of chi-square with 5 degrees of freedom


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("other", [5 + ops.BLOCK_V // 4, 5 + ops.BLOCK_V // 2, 5 + 3 * ops.BLOCK_V])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_tie_goes_to_the_lower_column(other, temperature):
    """Two equal best logits: in the other warpgroup's columns of the same accumulator (5 + 32),
    in the tile's other accumulator (5 + 64), or in another program's tile (5 + 3 x 128: program
    order is not column order, so the merge must pick the lowest column). Greedy must pick 5;
    sampled, where the noise breaks the tie, must match the reference's scores."""
    x, w, seeds, step = _inputs(8, 64, 4096, seed=2)
    w[5] = w[other] = (x.float().mean(0) * 50).bfloat16()
    tokens, logp = ops.lm_head_sample(x, w, temperature, seeds, step)
    if temperature:
        _check(tokens, logp, x, w, temperature, seeds, step)
        return
    logits = x.float() @ w.float().t()
    winners = logits.max(-1).values == logits[:, 5]
    assert winners.any() and (tokens[winners] == 5).all()


@pytest.mark.gpu
@needs_hopper
def test_captured_after_the_norm_follows_the_step_and_the_hidden_changed_in_place():
    """In a captured step the kernel asks for its weight before its PDL wait and for the hidden
    rows after it: each replay must sample from what the norm before it wrote in that replay."""
    x, w, seeds, step = _inputs(64, 896, 151936, seed=5)
    gain = torch.rand(896, device=x.device).bfloat16() + 0.5

    def norm_then_sample():
        hidden = add_rms_norm(x, None, gain, 1e-6)[0]  # the decode norm kernel, launched with PDL
        return ops.lm_head_sample(hidden, w, 1.0, seeds, step)

    norm_then_sample()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, logp = norm_then_sample()
    seen = set()
    for value in (3, 90, 4):
        step.fill_(value)
        x.copy_(torch.randn_like(x))
        graph.replay()
        want = norm_then_sample()  # eager: a plain launch
        assert torch.equal(tokens, want[0]) and torch.equal(logp, want[1])
        seen.add(tuple(tokens.tolist()))
    assert len(seen) == 3  # each replay sampled from its own hidden rows


def test_the_fused_path_serves_only_hopper_bf16_decode_batches():
    cpu = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert not ops.takes(cpu, torch.zeros(10, 64, dtype=torch.bfloat16))
    if ON_HOPPER and ops.gluon is not None:
        x, w = cpu.cuda(), torch.zeros(10, 64, dtype=torch.bfloat16).cuda()
        assert ops.takes(x, w)
        assert not ops.takes(x.float(), w.float())
        assert not ops.takes(torch.zeros(65, 64, dtype=torch.bfloat16).cuda(), w)  # > MAX_ROWS
        # rows of 12 bf16 are not 16-byte aligned: bulk copies would need a copy of the LM head
        assert not ops.takes(torch.zeros(4, 12, dtype=torch.bfloat16).cuda(), w[:, :12])


@pytest.mark.skipif(ops.gluon is None, reason="needs triton's Gluon")
def test_a_sampler_that_does_not_compile_warns_once_and_hands_back(monkeypatch):
    monkeypatch.setattr(ops, "_lm_head_sample_kernel", UncompilableKernel())
    monkeypatch.setattr(ops, "_failed", False)
    monkeypatch.setattr(ops, "multiprocessors", lambda device: 4)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w = torch.zeros(300, 64, dtype=torch.bfloat16)
    seeds, step = torch.zeros(4, dtype=torch.int64), torch.tensor(0)
    with pytest.warns(UserWarning, match="unsupported layout"):
        assert ops.lm_head_sample(x, w, 1.0, seeds, step) is None
    assert ops._failed and not ops.takes(x, w)


def test_sampling_from_hidden_states_equals_sampling_their_logits():
    """Off the fused path (CPU here), `sample_from_hidden` is the logits, then `sample_tokens`."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 16, generator=gen), torch.randn(40, 16, generator=gen)
    seeds, step = torch.arange(5), torch.tensor(3)
    params = SamplingParams(0.8)
    got = sample_from_hidden(x, w, params, seeds, step)
    want = sample_tokens(x @ w.t(), params, seeds, step)
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1])

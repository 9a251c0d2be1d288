"""The decode-step sampler: its distribution against the exact filtered one, its counter-based
reproducibility, greedy decoding, the returned log-probs, and parameter validation.

Statistical tests run on fixed seeds, so they are deterministic; each one rejects at p < 1e-8,
so over the ~30 of them the chance that a correct sampler fails for its seeds is below 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

from fastgrpo.kernels.decode.sampling_ref import _filter, _gumbel, _mix64, column_bits
from fastgrpo.rollout import SamplingParams, sample_tokens

ALPHA = 1e-8
N = 150_000  # samples per distribution test: a 3% error in the temperature fails several


def _exact_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # (V,) float64
    """The filtered distribution in float64, written out token by token (HF semantics)."""
    z = logits.double() / params.temperature
    order = sorted(range(len(z)), key=lambda i: -z[i].item())
    keep = set(order)
    if params.top_k:
        kth = z[order[min(params.top_k, len(z)) - 1]]
        keep = {i for i in order if z[i] >= kth}
    if params.top_p < 1:
        probs = _softmax_over(z, keep)
        mass, kept = 0.0, set()
        for i in (i for i in order if i in keep):
            if mass < params.top_p:
                kept.add(i)
            mass += probs[i].item()
            # keep float32 rounding in the sampler from deciding the cut
            assert abs(mass - params.top_p) > 1e-4, "test logits too close to the top-p cut"
        keep = kept
    return _softmax_over(z, keep)


def _softmax_over(z: torch.Tensor, keep: set[int]) -> torch.Tensor:
    mask = torch.zeros(len(z), dtype=torch.bool)
    mask[list(keep)] = True
    return torch.softmax(z.masked_fill(~mask, -math.inf), -1)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit over the cells with probs > 0.

    The chi-square survival function with k degrees of freedom is Q(k/2, x/2), the regularized
    upper incomplete gamma function: torch.special.gammaincc (agrees with scipy.stats.chi2.sf).
    """
    support = probs > 0
    expected = probs[support] * counts.sum()
    assert expected.min() >= 5, "too few expected counts for the chi-square approximation"
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    dof = torch.tensor((support.sum().item() - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(dof, stat / 2).item()


def _counts(tokens: torch.Tensor, cells: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=cells).double()


def _logits(vocab: int, seed: int, scale: float = 1.0) -> torch.Tensor:  # (V,)
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("top_p", [1.0, 0.8])
@pytest.mark.parametrize("top_k", [0, 3])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
@pytest.mark.parametrize("vocab", [7, 13])
def test_samples_follow_the_exact_filtered_distribution(vocab, temperature, top_k, top_p):
    params = SamplingParams(temperature, top_k, top_p)
    logits = _logits(vocab, seed=vocab)
    probs = _exact_probs(logits, params)
    seeds = torch.arange(N)  # consecutive seeds, as an engine hands them out
    tokens, _ = sample_tokens(logits.expand(N, vocab), params, seeds, torch.tensor(3))
    counts = _counts(tokens, vocab)
    assert counts[probs == 0].sum() == 0, "sampled a token outside the top-k / top-p set"
    assert _chi2_pvalue(counts, probs) > ALPHA


def test_steps_of_one_seed_follow_the_distribution():
    params = SamplingParams(temperature=1.0)
    logits = _logits(7, seed=1)
    tokens, _ = sample_tokens(logits.expand(N, 7), params, torch.full((N,), 12345), torch.arange(N))
    assert _chi2_pvalue(_counts(tokens, 7), _exact_probs(logits, params)) > ALPHA


@pytest.mark.parametrize("vary", ["seed", "step"])
def test_neighbouring_seeds_and_steps_draw_independently(vary):
    """Pairs (seed s, s + 1) or (step t, t + 1) have the product distribution as joint law."""
    params = SamplingParams(temperature=1.0)
    vocab = 7
    logits = torch.linspace(-1.0, 1.0, vocab)  # every pair of tokens has probability >= 0.002
    seeds = torch.arange(2 * N) if vary == "seed" else torch.arange(N).repeat_interleave(2)
    step = torch.arange(2 * N) % 2 if vary == "step" else torch.tensor(0)
    tokens, _ = sample_tokens(logits.expand(2 * N, vocab), params, seeds, step)
    pairs = tokens[0::2] * vocab + tokens[1::2]  # (N,) joint cell
    probs = _exact_probs(logits, params)
    assert _chi2_pvalue(_counts(pairs, vocab * vocab), torch.outer(probs, probs).flatten()) > ALPHA


def test_gumbel_noise_has_the_gumbel_distribution():
    """Kolmogorov-Smirnov at a grid of points: P(sup |F_n - F| > 0.0031) < 1e-8 for n = 1e6."""
    noise = _gumbel(torch.arange(1000), torch.tensor(7), 1000).flatten().double()  # (1e6,)
    points = torch.linspace(-2.5, 12.0, 400, dtype=torch.float64)
    empirical = torch.searchsorted(noise.sort().values, points, right=True) / noise.numel()
    assert (empirical - torch.exp(-torch.exp(-points))).abs().max() < 0.0031


def test_hash_is_splitmix64_with_unsigned_wraparound():
    def splitmix64(x: int) -> int:
        x &= (1 << 64) - 1
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
        return x ^ (x >> 31)

    values = [0, 1, -1, 12345, -(2**63), 2**63 - 1, 0x9E3779B97F4A7C15 - 2**64]
    got = _mix64(torch.tensor(values)).tolist()
    assert [v % 2**64 for v in got] == [splitmix64(v) for v in values]


def test_column_bits_are_two_rounds_of_lowbias32_keyed_by_the_row_state():
    def lowbias32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    states = torch.tensor([0, -1, 2**63 - 1, -(2**63), 0x0123456789ABCDEF])
    got = column_bits(states.clone(), 70)  # (5, 70)
    for b, state in enumerate(states.tolist()):
        lo, hi = state % 2**32, (state % 2**64) >> 32
        assert got[b].tolist() == [lowbias32(lowbias32(v ^ lo) ^ hi) for v in range(70)]


PARAMS = [
    SamplingParams(1.0),
    SamplingParams(0.8, top_k=5),
    SamplingParams(1.2, top_p=0.9),
    SamplingParams(0.6, top_k=20, top_p=0.7),
]


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_a_row_draws_the_same_token_whatever_its_batch(params):
    gen = torch.Generator().manual_seed(0)
    batch, vocab = 64, 50
    logits = torch.randn(batch, vocab, generator=gen) * 2  # (B, V)
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
    step = torch.randint(0, 4096, (batch,), generator=gen)
    tokens, logp = sample_tokens(logits, params, seeds, step)

    perm = torch.randperm(batch, generator=gen)
    shuffled, shuffled_logp = sample_tokens(logits[perm], params, seeds[perm], step[perm])
    assert torch.equal(shuffled, tokens[perm])
    torch.testing.assert_close(shuffled_logp, logp[perm])
    for b in (0, 17, 63):
        alone, _ = sample_tokens(logits[b : b + 1], params, seeds[b : b + 1], step[b : b + 1])
        assert alone.item() == tokens[b].item()


def test_a_scalar_step_equals_the_same_step_on_every_row():
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(3))
    seeds = torch.arange(32) * 7919
    params = SamplingParams(1.0, top_p=0.95)
    scalar, _ = sample_tokens(logits, params, seeds, torch.tensor(5))
    rows, _ = sample_tokens(logits, params, seeds, torch.full((32,), 5))
    assert torch.equal(scalar, rows)


def test_different_steps_give_different_draws():
    logits = torch.zeros(1, 1000).expand(50, 1000)  # uniform: equal draws have probability 1e-3
    seeds = torch.full((50,), 42)
    first, _ = sample_tokens(logits, SamplingParams(), seeds, torch.tensor(0))
    second, _ = sample_tokens(logits, SamplingParams(), seeds, torch.tensor(1))
    assert first.unique().numel() == 1  # same seed and step: same token on every row
    assert not torch.equal(first, second)


def test_greedy_picks_the_argmax_and_the_lowest_index_on_ties():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, -1.0, 3.0, 3.0], [0.0, 0.0, 0.0, 5.0]])
    tokens, logp = sample_tokens(logits, SamplingParams(0.0), torch.arange(3), torch.tensor(0))
    assert tokens.tolist() == [1, 0, 3]
    expected = torch.log_softmax(logits.double(), -1)[torch.arange(3), tokens]
    torch.testing.assert_close(logp.double(), expected, atol=1e-5, rtol=0)


def test_greedy_ignores_top_k_top_p_and_seeds():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(4))
    greedy = SamplingParams(0.0, top_k=3, top_p=0.5)
    tokens, _ = sample_tokens(logits, greedy, torch.arange(16), torch.tensor(9))
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("vocab", [13, 151936])
@pytest.mark.parametrize("params", PARAMS + [SamplingParams(0.0)], ids=str)
def test_logp_is_the_untruncated_log_softmax_at_the_temperature(params, vocab):
    batch = 8
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    tokens, logp = sample_tokens(logits, params, torch.arange(batch), torch.arange(batch))
    scaled = logits.double() / (params.temperature or 1.0)
    expected = torch.log_softmax(scaled, -1)[torch.arange(batch), tokens]
    assert logp.dtype == torch.float32 and logp.shape == (batch,)
    torch.testing.assert_close(logp.double(), expected, atol=1e-5, rtol=0)


def test_top_k_on_a_real_vocabulary_samples_only_the_k_largest():
    batch, vocab, k = 16, 151936, 20
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(5))
    tokens, _ = sample_tokens(
        logits, SamplingParams(1.5, top_k=k), torch.arange(batch), torch.tensor(0)
    )
    allowed = logits.topk(k, -1).indices  # (B, k)
    assert (allowed == tokens.unsqueeze(1)).any(1).all()


@pytest.mark.parametrize("params", PARAMS + [SamplingParams(0.0)], ids=str)
def test_bf16_logits_sample_like_their_fp32_values(params):
    logits = torch.randn(32, 500, generator=torch.Generator().manual_seed(6)).bfloat16()
    seeds, step = torch.arange(32), torch.tensor(11)
    tokens, logp = sample_tokens(logits, params, seeds, step)
    tokens32, logp32 = sample_tokens(logits.float(), params, seeds, step)
    assert torch.equal(tokens, tokens32)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, logp32)


@pytest.mark.parametrize("vocab", [2, 13, 1000])
@pytest.mark.parametrize("params", PARAMS[1:] + [SamplingParams(1.0, top_p=0.3)], ids=str)
def test_filter_keeps_the_tokens_hf_warpers_keep(params, vocab):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    z = torch.randn(64, vocab, generator=torch.Generator().manual_seed(vocab)) * 3  # (B, V)
    z = z / params.temperature
    hf = TopKLogitsWarper(params.top_k)(None, z.clone()) if params.top_k else z.clone()
    hf = TopPLogitsWarper(params.top_p)(None, hf) if params.top_p < 1 else hf
    assert torch.equal(_filter(z, params).isfinite(), hf.isfinite())


def test_logits_are_not_modified():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(7))
    before = logits.clone()
    sample_tokens(logits, SamplingParams(0.7, top_k=5, top_p=0.8), torch.arange(4), torch.tensor(0))
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_invalid_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_seeds_and_step_must_be_int64_tensors_of_the_batch():
    logits, params = torch.zeros(4, 10), SamplingParams()
    with pytest.raises(TypeError, match="step"):
        sample_tokens(logits, params, torch.arange(4), 0)
    with pytest.raises(ValueError, match="seeds"):
        sample_tokens(logits, params, torch.arange(4, dtype=torch.int32), torch.tensor(0))
    with pytest.raises(ValueError, match="step"):
        sample_tokens(logits, params, torch.arange(4), torch.arange(3))

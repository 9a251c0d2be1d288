"""The fused Triton sampler against the torch sampler it replaces (interpreter on CPU).

The kernel draws the torch sampler's noise up to the last bits of its logs (the GPU's fast log2,
numpy's log2 in the interpreter): the tests compare the noise to within that rounding, and tokens
on every row whose two best reference scores are more than 1e-5 apart (a near-tie can go either
way; `_assert_same_tokens` says how many rows it had to skip, and it insists on at least one row).
What the kernel computes in several ways (dtypes, strides, batches, graphs) must agree bit for bit.
Small blocks in the interpreter (128 columns, 2 per split) make V = 1000 span 4 splits.
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_cases import DEVICE, NEEDS_TRITON, ON_GPU

from fastgrpo.kernels.decode import sample_tokens as ops
from fastgrpo.kernels.decode import sampling_ref
from fastgrpo.kernels.decode.sampling_ref import _gumbel
from fastgrpo.rollout import SamplingParams, sample_tokens, sampling

pytestmark = NEEDS_TRITON

NEAR_TIE = 1e-5
# the kernel's noise against torch's: the same uniforms, logs that differ in the last bits
# (|g| < 23, so 2e-6 is a few ulps)
NOISE_RTOL, NOISE_ATOL = 1e-6, 2e-6


def _inputs(batch, vocab, seed, dtype=torch.float32, scale=3.0):
    """(logits (B, V), seeds (B,), step ()) on DEVICE; logits with std `scale`, as an LM head's."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=gen) * scale).to(dtype)
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
    step = torch.tensor(seed * 31 + 7)
    return logits.to(DEVICE), seeds.to(DEVICE), step.to(DEVICE)


def _reference_gap(logits, temperature, seeds, step):  # (B,)
    """Gap between the two best scores z + g of the torch sampler, as it rounds them."""
    z = logits.float() / temperature if temperature else logits.float()
    scores = z + _gumbel(seeds, step, z.shape[1]) if temperature else z
    top = scores.topk(2, -1).values  # (B, 2)
    return top[:, 0] - top[:, 1]


def _assert_same_tokens(tokens, want, gap):
    clear = gap > NEAR_TIE
    assert clear.any(), "every row is a near-tie: the test compares nothing"
    assert torch.equal(tokens[clear], want[clear]), f"{int((~clear).sum())} near-tie rows skipped"


def _float64_logp(logits, temperature, tokens):  # (B,)
    z = logits.double() / (temperature or 1.0)
    return torch.log_softmax(z, -1).gather(1, tokens.unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("step_shape", ["scalar", "per-row"])
def test_noise_is_the_torch_samplers_noise(step_shape):
    gen = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**63), 2**63 - 1, (3,), generator=gen).to(DEVICE)
    step = torch.tensor(12) if step_shape == "scalar" else torch.tensor([0, 1, 2**40])
    step = step.to(DEVICE)
    noise = ops.gumbel_noise(seeds, step, 997)
    want = _gumbel(seeds, step, 997)
    torch.testing.assert_close(noise, want, rtol=NOISE_RTOL, atol=NOISE_ATOL)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
@pytest.mark.parametrize("vocab", [13, 997, 1000])
def test_tokens_equal_the_torch_samplers_tokens(vocab, temperature):
    logits, seeds, step = _inputs(5, vocab, seed=vocab)
    tokens, _ = ops.sample_tokens_fused(logits, temperature, seeds, step)
    want, _ = ops.sample_tokens_fused_ref(logits, temperature, seeds, step)
    assert tokens.dtype == torch.int64 and tokens.shape == (5,)
    _assert_same_tokens(tokens, want, _reference_gap(logits, temperature, seeds, step))


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0])
def test_logp_is_the_float64_log_softmax_at_the_temperature(temperature):
    logits, seeds, step = _inputs(5, 997, seed=1, scale=5.0)  # log-probs down to ~-40
    tokens, logp = ops.sample_tokens_fused(logits, temperature, seeds, step)
    assert logp.dtype == torch.float32 and logp.shape == (5,)
    want = _float64_logp(logits, temperature, tokens)
    torch.testing.assert_close(logp.double(), want, atol=1e-5, rtol=0)


def test_greedy_picks_the_argmax_and_the_lowest_index_on_ties():
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(2))
    logits[0, [700, 300, 301]] = 9.0  # ties in two splits: 300 (split 1) wins
    logits[1, [255, 256]] = 9.0  # on either side of a split boundary
    logits[2, [130, 129]] = 9.0  # in one block
    logits[3] = 0.0  # all tied
    logits[4, 999] = 9.0  # the last column
    logits = logits.to(DEVICE)
    seeds, step = torch.arange(5, device=DEVICE), torch.tensor(0, device=DEVICE)
    tokens, logp = ops.sample_tokens_fused(logits, 0.0, seeds, step)
    assert tokens.tolist() == [300, 255, 129, 0, 999]
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logp.double(), _float64_logp(logits, 0.0, tokens), atol=1e-5, rtol=0)


def test_sampling_ties_pick_the_lowest_index():
    """At T = log2(e) the kernel's scale log2(e) / T is exactly 1, so logits = -noise_log2 (the
    kernel's own noise) make every score exactly 0; lowering the logits of the first k columns by
    1 leaves column k the lowest-index maximum."""
    firsts = [0, 1, 255, 256, 700, 999]  # split boundaries at multiples of 256 in the interpreter
    seeds = torch.full((len(firsts),), 5, device=DEVICE)
    step = torch.tensor(3, device=DEVICE)
    logits = -ops.noise_log2(seeds, step, 1000)  # (B, V)
    for row, k in enumerate(firsts):
        logits[row, :k] -= 1.0
    tokens, _ = ops.sample_tokens_fused(logits, ops.LOG2E, seeds, step)
    assert tokens.tolist() == firsts


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_and_bfloat16_logits_sample_as_their_fp32_values(dtype):
    """z is the exact fp32 value of each logit, so the kernel's answer is bitwise the same."""
    logits, seeds, step = _inputs(5, 1000, seed=3, dtype=dtype)
    tokens, logp = ops.sample_tokens_fused(logits, 0.8, seeds, step)
    tokens32, logp32 = ops.sample_tokens_fused(logits.float(), 0.8, seeds, step)
    assert torch.equal(tokens, tokens32) and torch.equal(logp, logp32)
    want, _ = ops.sample_tokens_fused_ref(logits, 0.8, seeds, step)
    _assert_same_tokens(tokens, want, _reference_gap(logits, 0.8, seeds, step))


@pytest.mark.parametrize("layout", ["padded rows", "column major"])
def test_strided_logits_give_the_contiguous_result(layout):
    logits, seeds, step = _inputs(5, 997, seed=4, dtype=torch.bfloat16)
    if layout == "padded rows":  # a view of a wider buffer: row stride 1021
        view = torch.zeros(5, 1021, dtype=logits.dtype, device=DEVICE)[:, :997]
    else:
        view = torch.zeros(997, 5, dtype=logits.dtype, device=DEVICE).t()
    view.copy_(logits)
    tokens, logp = ops.sample_tokens_fused(view, 1.3, seeds, step)
    want, want_logp = ops.sample_tokens_fused(logits, 1.3, seeds, step)
    assert torch.equal(tokens, want) and torch.equal(logp, want_logp)


def test_per_row_steps_follow_each_rows_step_and_a_scalar_step_is_every_rows():
    logits, seeds, _ = _inputs(5, 1000, seed=5)
    steps = torch.tensor([0, 1, 9, 2**33, 4095], device=DEVICE)
    tokens, _ = ops.sample_tokens_fused(logits, 1.0, seeds, steps)
    want, _ = ops.sample_tokens_fused_ref(logits, 1.0, seeds, steps)
    _assert_same_tokens(tokens, want, _reference_gap(logits, 1.0, seeds, steps))

    scalar, scalar_logp = ops.sample_tokens_fused(logits, 1.0, seeds, steps[2])
    rows, rows_logp = ops.sample_tokens_fused(logits, 1.0, seeds, steps[2].expand(5))
    assert torch.equal(scalar, rows) and torch.equal(scalar_logp, rows_logp)


def test_a_rows_result_does_not_depend_on_its_batch():
    """The splits depend on V alone, so even the log-prob is bitwise the same in any batch."""
    logits, seeds, step = _inputs(5, 997, seed=6)
    steps = step + torch.arange(5, device=DEVICE)
    tokens, logp = ops.sample_tokens_fused(logits, 0.9, seeds, steps)
    perm = torch.tensor([3, 0, 4, 2], device=DEVICE)
    some, some_logp = ops.sample_tokens_fused(logits[perm], 0.9, seeds[perm], steps[perm])
    assert torch.equal(some, tokens[perm]) and torch.equal(some_logp, logp[perm])


def test_an_empty_batch_gives_empty_outputs():
    logits = torch.zeros(0, 50, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    tokens, logp = ops.sample_tokens_fused(logits, 1.0, empty, torch.tensor(0, device=DEVICE))
    assert tokens.shape == (0,) and tokens.dtype == torch.int64 and logp.dtype == torch.float32


def test_invalid_inputs_raise_clear_errors():
    logits = torch.zeros(4, 10, device=DEVICE)
    seeds, step = torch.arange(4, device=DEVICE), torch.tensor(0, device=DEVICE)
    with pytest.raises(ValueError, match="logits"):
        ops.sample_tokens_fused(logits.double(), 1.0, seeds, step)
    with pytest.raises(ValueError, match="logits"):
        ops.sample_tokens_fused(logits[0], 1.0, seeds, step)
    with pytest.raises(ValueError, match="temperature"):
        ops.sample_tokens_fused(logits, -1.0, seeds, step)
    with pytest.raises(ValueError, match="seeds"):
        ops.sample_tokens_fused(logits, 1.0, seeds.int(), step)
    with pytest.raises(ValueError, match="step"):
        ops.sample_tokens_fused(logits, 1.0, seeds, torch.arange(3, device=DEVICE))
    with pytest.raises(TypeError, match="step"):
        ops.sample_tokens_fused(logits, 1.0, seeds, 0)


def test_sample_tokens_runs_the_kernel_for_plain_settings_on_cuda_only(monkeypatch):
    calls = []

    def counted(*args):
        calls.append(args)
        return ops.sample_tokens_fused(*args)

    monkeypatch.setattr(sampling, "sample_tokens_fused", counted)
    logits, seeds, step = _inputs(3, 50, seed=7)
    cases = [
        (SamplingParams(1.0), ON_GPU),
        (SamplingParams(0.0, top_k=5), ON_GPU),  # greedy ignores top-k
        (SamplingParams(1.0, top_k=5), False),
        (SamplingParams(1.0, top_p=0.9), False),
    ]
    for params, fused in cases:
        calls.clear()
        tokens, _ = sample_tokens(logits, params, seeds, step)
        want, _ = sampling.sample_tokens_torch(logits, params, seeds, step)
        assert bool(calls) == fused, params
        gap = _reference_gap(
            sampling_ref._filter(logits.float(), params), params.temperature, seeds, step
        )
        _assert_same_tokens(tokens, want, gap)
    monkeypatch.setattr(sampling, "FUSED_SAMPLER", False)  # FASTGRPO_DECODE_KERNELS=0
    calls.clear()
    sample_tokens(logits, SamplingParams(1.0), seeds, step)
    assert not calls


REAL_B, REAL_V = 64, 151936


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_noise_is_the_torch_noise_at_a_real_vocabulary():
    gen = torch.Generator().manual_seed(10)
    seeds = torch.randint(-(2**62), 2**62, (REAL_B,), generator=gen).cuda()
    step = torch.randint(0, 4096, (REAL_B,), generator=gen).cuda()
    noise, want = ops.gumbel_noise(seeds, step, REAL_V), _gumbel(seeds, step, REAL_V)
    torch.testing.assert_close(noise, want, rtol=NOISE_RTOL, atol=NOISE_ATOL)
    assert os.environ.get("TRITON_INTERPRET") != "1"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_tokens_are_the_torch_samplers_at_a_real_vocabulary(temperature):
    logits, seeds, step = _inputs(REAL_B, REAL_V, seed=8, dtype=torch.bfloat16, scale=4.0)
    tokens, logp = ops.sample_tokens_fused(logits, temperature, seeds, step)
    want, want_logp = ops.sample_tokens_fused_ref(logits, temperature, seeds, step)
    gap = _reference_gap(logits, temperature, seeds, step)
    _assert_same_tokens(tokens, want, gap)
    same = tokens == want
    torch.testing.assert_close(logp[same], want_logp[same], atol=1e-5, rtol=0)
    want64 = _float64_logp(logits, temperature, tokens)
    torch.testing.assert_close(logp.double(), want64, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_kernel_captured_in_a_cuda_graph_follows_the_step_changed_in_place():
    logits, seeds, step = _inputs(REAL_B, REAL_V, seed=9, dtype=torch.bfloat16, scale=4.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.sample_tokens_fused(logits, 0.8, seeds, step)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, logp = ops.sample_tokens_fused(logits, 0.8, seeds, step)
    seen = set()
    for value in (0, 1, 77, 4095, 5):
        step.fill_(value)
        graph.replay()
        want, want_logp = ops.sample_tokens_fused(logits, 0.8, seeds, step)  # eager, same kernel
        assert torch.equal(tokens, want) and torch.equal(logp, want_logp), value
        seen.add(tuple(tokens.tolist()))
    assert len(seen) == 5  # the replays really drew with the new steps

"""Attention over shared prompts (`SharedKeys`): each prompt packed once, its completions' queries
attending to the prompt's keys and their own, must equal attention over one copy of the prompt
per completion, in the output and in the gradients (a prompt's k/v gradient is the sum over its
copies)."""

from __future__ import annotations

import pytest
import torch

from fastgrpo.models import attention as attention_module
from fastgrpo.models.attention import (
    VARLEN,
    PackedCausalAttention,
    SharedKeys,
    causal_attention_ref,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def layouts(prompts: list[int], completions: list[list[int]], device="cpu"):
    """Both layouts of the same rows, as index lists into the shared packed tokens.

    Returns (shared attention, copies: (Tc,) index of each copy token in the shared layout,
    first_copy: (Tc,) bool, True where the copy token is the one whose output the shared layout
    keeps, i.e. every completion token and the first copy of each prompt token, copy lengths)."""
    packed, q_lengths, key_rows, k_lengths = 0, [], [], []
    copies, first_copy, copy_lengths = [], [], []
    for p, rows in zip(prompts, completions):
        prompt = list(range(packed, packed + p))
        packed += p
        q_lengths.append(p)
        key_rows += prompt
        k_lengths.append(p)
        for j, c in enumerate(rows):
            own = list(range(packed, packed + c))
            packed += c
            q_lengths.append(c)
            key_rows += prompt + own
            k_lengths.append(p + c)
            copies += prompt + own
            first_copy += [j == 0] * p + [True] * c
            copy_lengths.append(p + c)
    cu = torch.tensor([0, *q_lengths], device=device).cumsum(0)
    cu_k = torch.tensor([0, *k_lengths], device=device).cumsum(0)
    keys = SharedKeys(torch.tensor(key_rows, device=device), cu_k, max(k_lengths))
    return (
        PackedCausalAttention(cu, max(q_lengths), keys=keys),
        torch.tensor(copies, device=device),
        torch.tensor(first_copy, device=device),
        copy_lengths,
    )


PROMPTS = [4, 1, 6]
COMPLETIONS = [[3, 1, 5], [2], [1, 7]]


def run(attend, q, k, v, grad_out):
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = attend(0, *inputs)
    out.backward(grad_out)
    return [out.detach()] + [x.grad for x in inputs]


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("padded", [True, False], ids=["one-padded-call", "call-per-sequence"])
def test_shared_prompt_attention_equals_attention_over_copies(window, padded, monkeypatch):
    monkeypatch.setattr(attention_module, "PADDED_BATCH_LIMIT", 1000 if padded else 0)
    generator = torch.Generator().manual_seed(3)
    shared, copies, first, copy_lengths = layouts(PROMPTS, COMPLETIONS)
    shared.layer_windows = [window]
    T = int(shared.cu_seqlens[-1])
    q, grad_out = torch.randn(2, T, 6, 8, generator=generator, dtype=torch.float64)
    k, v = torch.randn(2, T, 2, 8, generator=generator, dtype=torch.float64)
    got = run(shared, q, k, v, grad_out)

    # the same rows with a copy of their prompt each; the upstream gradient of a prompt token
    # goes to its first copy only, as the shared layout has one output per prompt token
    per_copy = PackedCausalAttention.from_lengths(copy_lengths, layer_windows=[window])
    want = run(per_copy, q[copies], k[copies], v[copies], grad_out[copies] * first[:, None, None])
    torch.testing.assert_close(got[0][copies[first]], want[0][first], rtol=0, atol=1e-12)
    for name, g, w in zip(("dq", "dk", "dv"), got[1:], want[1:]):
        summed = torch.zeros_like(g).index_add_(0, copies, w)  # a prompt token's copies add up
        torch.testing.assert_close(g, summed, rtol=0, atol=1e-12, msg=name)

    # and against the spec (fp32), evaluated on the gathered keys
    rows = shared.keys.rows
    ref = causal_attention_ref(q, k[rows], v[rows], shared.cu_seqlens, window, shared.cu_seqlens_k)
    torch.testing.assert_close(got[0], ref, rtol=0, atol=2e-6)


def test_causal_mask_is_aligned_to_the_end_of_the_keys():
    """A query sequence of 2 after 3 prompt keys: query 0 sees keys 0..3, query 1 keys 0..4; with
    a window of 2 they see keys 2..3 and 3..4."""
    mask = attention_module._causal_mask(2, None, "cpu", 5)
    assert mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    mask = attention_module._causal_mask(2, 2, "cpu", 5)
    assert mask.tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("autograd", ["flash", "varlen_attn"])
def test_flash_shared_prompt_attention_is_within_twice_sdpas_bf16_error(window, autograd):
    """The flash kernels on the gathered keys (end-aligned causal mask) against the fp32 spec,
    output and gradients, with the SDPA path on the same bf16 inputs as the yardstick."""
    prompts = [128, 37, 200]
    completions = [[256, 1, 100, 256], [64], [255, 3]]
    shared, copies, first, _ = layouts(prompts, completions, "cuda")
    shared.layer_windows = [window]
    T = int(shared.cu_seqlens[-1])
    generator = torch.Generator(device="cuda").manual_seed(4)
    q, grad_out = torch.randn(
        2, T, 14, 64, device="cuda", dtype=torch.bfloat16, generator=generator
    )
    k, v = torch.randn(2, T, 2, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
    assert VARLEN is not None and shared._varlen_applies(q, window)
    sdpa = PackedCausalAttention(
        shared.cu_seqlens, shared.max_seqlen, [window], use_varlen=False, keys=shared.keys
    )

    def exact(layer, q, k, v):
        rows = shared.keys.rows
        return causal_attention_ref(
            q, k[rows], v[rows], shared.cu_seqlens, window, shared.cu_seqlens_k
        )

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_module, "FLASH_AUTOGRAD", autograd == "flash")
        fast = run(shared, q, k, v, grad_out)
    base = run(sdpa, q, k, v, grad_out)
    ref = run(exact, q.float(), k.float(), v.float(), grad_out.float())
    for name, f, b, r in zip(("out", "dq", "dk", "dv"), fast, base, ref):
        assert (f.float() - r).norm() <= 2 * (b.float() - r).norm(), name
    with torch.no_grad():  # the direct flash forward, as scoring takes it
        torch.testing.assert_close(shared(0, q, k, v), fast[0], rtol=0, atol=0)

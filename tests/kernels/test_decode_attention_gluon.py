"""The Gluon decode attention (Hopper) against the float64 reference and the Triton kernel at real
shapes: the same cache writes bit for bit, outputs within the bf16 path's own error; where it does
not apply, `rope_decode_attention` keeps the Triton kernel."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import NEEDS_TRITON, ON_GPU, UncompilableKernel
from test_decode_attention import (
    REAL,
    _float64_ref,
    _real_case,
    _ref_with_rounded_probs,
    _rope_inputs,
    _rope_reference,
)

from fastgrpo.kernels.decode import decode_attention as ops
from fastgrpo.kernels.decode import decode_attention_gluon as gluon_attention
from fastgrpo.kernels.decode import decode_attention_triton as triton_ops

pytestmark = NEEDS_TRITON
ON_HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (sm_90)")


def test_a_program_takes_more_than_half_of_a_multiprocessors_shared_memory():
    """Keys and values of every stage: over half of the H100's 227 KB per block (so no two
    programs share a multiprocessor), and within it."""
    for d in (64, 128):
        block_n, stages = gluon_attention.blocks(d)
        ring = stages * 2 * block_n * d * 2
        assert 227 * 1024 // 2 < ring <= 227 * 1024 - 1024


def test_cpu_tensors_are_not_taken():
    inputs = tuple(t.cpu() for t in _rope_inputs(_real_case(14, 2, 64, 5), dtype=torch.bfloat16))
    q, k, v, cos, sin, pk, pv, lens, ck, cv, slot = inputs
    assert not gluon_attention.applies(q, k, v, cos, sin, pk, ck)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("step", [0, 1, 100, 128, 129, 255])
@pytest.mark.parametrize("heads", REAL.values(), ids=REAL.keys())
def test_gluon_attention_at_a_real_shape(heads, step):
    """Prompts of 1..128 keys (odd lengths, partial blocks), slots from the first to the last.
    (At the 7B shape 64 rows are two waves of programs, which `applies` leaves to the Triton
    kernel; the kernel itself must still be right there.)"""
    inputs = _rope_inputs(_real_case(*heads, step, seed=step), dtype=torch.bfloat16, seed=step)
    q, k, v, cos, sin, pk, pv, lens, ck, cv, slot = inputs
    assert gluon_attention.applies(q, k, v, cos, sin, pk, ck) == (heads[2] == 64)
    tri_ck, tri_cv = ck.clone(), cv.clone()
    tri = triton_ops.decode_attention_triton(
        q, pk, pv, lens, tri_ck, tri_cv, slot, 1, rope=(k, v, cos, sin)
    )
    _, want_ck, want_cv, rotated = _rope_reference(inputs)
    out = gluon_attention.launch(*inputs)
    assert torch.equal(ck, want_ck) and torch.equal(cv, want_cv)  # bitwise the RoPE kernel's
    assert torch.equal(ck, tri_ck) and torch.equal(cv, tri_cv)
    want = _float64_ref(*rotated)
    own = (_ref_with_rounded_probs(*rotated).double() - want).abs().max()
    assert (out.double() - want).abs().max() <= 2 * own + 1e-3
    # the Triton kernel sums the same exact products in another order
    assert (out.float() - tri.float()).abs().max() <= 2 * own + 1e-3


@pytest.mark.gpu
@needs_hopper
def test_rope_decode_attention_sends_a_decode_batch_to_gluon_and_few_rows_to_triton(monkeypatch):
    calls = []
    real = gluon_attention.launch
    monkeypatch.setattr(gluon_attention, "launch", lambda *a: calls.append(1) or real(*a))
    inputs = _rope_inputs(_real_case(14, 2, 64, 50), dtype=torch.bfloat16, seed=3)
    want = ops.rope_decode_attention(*[t.clone() for t in inputs])
    assert calls == [1]
    few = _rope_inputs((2, 2, 14, 2, 64, 128, 256, [100, 7], 50), dtype=torch.bfloat16, seed=4)
    ops.rope_decode_attention(*few)  # 8 programs: the Triton kernel's key splits serve
    many = _rope_inputs((32, 4, 14, 2, 64, 128, 256, [100] * 32, 50), dtype=torch.bfloat16)
    ops.rope_decode_attention(*many)  # 256 programs, two waves: the Triton kernel
    assert calls == [1]
    monkeypatch.setattr(gluon_attention, "ENABLED", False)
    off = ops.rope_decode_attention(*[t.clone() for t in inputs])
    assert calls == [1]
    assert (want.float() - off.float()).abs().max() <= 2e-2


@pytest.mark.gpu
@needs_hopper
def test_gluon_attention_replays_in_a_cuda_graph_as_the_slot_advances():
    inputs = _rope_inputs(_real_case(14, 2, 64, 10), dtype=torch.bfloat16, seed=9)
    q, k, v, cos, sin, pk, pv, lens, ck, cv, slot = inputs
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = gluon_attention.launch(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    for s in (10, 11, 200):
        slot.fill_(s)
        ref_inputs = (q, k, v, cos, sin, pk, pv, lens, ck.clone(), cv.clone(), slot.clone())
        want, _, _, _ = _rope_reference(ref_inputs)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ck[:, s], _rope_reference(ref_inputs)[1][:, s])
        assert (out.float() - want.float()).abs().max() <= 2e-2


@pytest.mark.skipif(gluon_attention.gluon is None, reason="needs triton's Gluon")
def test_a_gluon_attention_that_does_not_compile_warns_once_and_hands_back(monkeypatch):
    monkeypatch.setattr(gluon_attention, "_attention_kernel", UncompilableKernel())
    monkeypatch.setattr(gluon_attention, "_failed", False)
    inputs = tuple(t.cpu() for t in _rope_inputs(_real_case(14, 2, 64, 5), dtype=torch.bfloat16))
    with pytest.warns(UserWarning, match="the Gluon decode attention did not compile.*unsupported"):
        assert gluon_attention.launch(*inputs) is None
    assert gluon_attention._failed
    q, k, v, cos, sin, pk, pv, lens, ck, cv, slot = inputs
    assert not gluon_attention.applies(q, k, v, cos, sin, pk, ck)  # not tried again


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("step", [1, 37, 128, 200])
def test_stale_nan_past_the_valid_keys_changes_nothing(step):
    """Cache slots past each prompt's length and past the step may hold anything an earlier wave
    left there (inf, nan): whole-box loads read some of them, and none may reach the output."""
    case = _real_case(14, 2, 64, step, seed=step)
    clean = _rope_inputs(case, dtype=torch.bfloat16, seed=step)
    stale = tuple(t.clone() for t in clean)
    q, k, v, cos, sin, pk, pv, lens, ck, cv, slot = stale
    past_prompt = torch.arange(pk.shape[1], device=pk.device)[None, :] >= lens[:, None]
    for cache in (pk, pv):
        cache[past_prompt] = float("nan")
    for cache in (ck, cv):
        cache[:, step + 1 :] = float("inf")
        cache[:, step] = float("nan")  # the slot itself is written by the call
    want = gluon_attention.launch(*clean)
    out = gluon_attention.launch(*stale)
    assert torch.equal(out, want)
    assert torch.equal(ck[:, : step + 1], clean[8][:, : step + 1])


def _parts_case(heads, step, bias: bool, seed=0):
    """`_rope_inputs` at a real shape with q, k and v replaced by three fp32 split-K parts (and a
    bf16 bias) of the packed projection; returns (parts, the inputs with q/k/v = parts.total())."""
    inputs = _rope_inputs(_real_case(*heads, step, seed=seed), dtype=torch.bfloat16, seed=seed)
    q, k, v, cos, sin, pk, pv, lens, ck, cv, slot = inputs
    B, nh, d = q.shape
    nkv = k.shape[1]
    gen = torch.Generator().manual_seed(seed + 7)
    width = (nh + 2 * nkv) * d
    partials = (torch.randn(3, B, width, generator=gen) * 0.6).to(q.device)
    b = (torch.randn(width, generator=gen) * 0.3).to(torch.bfloat16).to(q.device) if bias else None
    parts = ops.ProjectedParts(partials, b, torch.bfloat16)
    q, k, v = parts.total().split([nh * d, nkv * d, nkv * d], dim=-1)
    summed = (q.view(B, nh, d), k.view(B, nkv, d), v.view(B, nkv, d), *inputs[3:])
    return parts, summed


def test_projected_parts_are_summed_in_order_plus_the_bias_then_rounded_once():
    partials = torch.tensor([[[1.0, 2.0**-9]], [[2.0**-9, 3.0]], [[1.5, -1.0]]])
    bias = torch.tensor([2.0**-8, 0.5], dtype=torch.bfloat16)
    got = ops.ProjectedParts(partials, bias, torch.bfloat16).total()
    want = (((partials[0] + partials[1]) + partials[2]) + bias.float()).to(torch.bfloat16)
    assert torch.equal(got, want) and got.dtype == torch.bfloat16
    # rounded once: 2.5 + 2**-9 + 2**-8 is not a bf16, and two roundings would lose the 2**-9
    assert float(got[0, 0]) == float(torch.tensor(2.5 + 2**-9 + 2**-8).to(torch.bfloat16))


def test_rope_decode_attention_parts_is_the_attention_of_the_summed_projection():
    """On CPU (and wherever the Gluon kernel does not serve) the parts are summed first: the
    output and the cache writes are `rope_decode_attention`'s on the summed q, k and v."""
    parts, summed = _parts_case(REAL["nh14-nkv2-d64"], 37, bias=True)
    parts = ops.ProjectedParts(parts.partials.cpu(), parts.bias.cpu(), parts.dtype)
    summed = [t.cpu() for t in summed]
    q, k, v, cos, sin, pk, pv, lens, ck, cv, slot = summed
    want_ck, want_cv = ck.clone(), cv.clone()
    want = ops.rope_decode_attention(q.clone(), k.clone(), v, cos, sin, pk, pv, lens, want_ck,
                                     want_cv, slot)  # fmt: skip
    got = ops.rope_decode_attention_parts(parts, q.shape[1], cos, sin, pk, pv, lens, ck, cv, slot)
    assert torch.equal(got, want)
    assert torch.equal(ck, want_ck) and torch.equal(cv, want_cv)
    with pytest.raises(ValueError, match="q/k/v parts"):
        ops.rope_decode_attention_parts(parts, 12, cos, sin, pk, pv, lens, ck, cv, slot)
    half = ops.ProjectedParts(parts.partials.half(), None, parts.dtype)
    with pytest.raises(ValueError, match="contiguous fp32"):
        ops.rope_decode_attention_parts(half, 14, cos, sin, pk, pv, lens, ck, cv, slot)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("step", [0, 129, 255])
def test_gluon_attention_adds_up_projected_parts_as_the_summed_projection(step, bias):
    """The kernel's sum of the parts (in order, then the bias, rounded once) is the projection's
    `total()`: output and cache writes bitwise those of the kernel given the summed q, k, v."""
    parts, summed = _parts_case(REAL["nh14-nkv2-d64"], step, bias, seed=step)
    q, k, v, cos, sin, pk, pv, lens, ck, cv, slot = summed
    want_ck, want_cv = ck.clone(), cv.clone()
    want = gluon_attention.launch(q, k, v, cos, sin, pk, pv, lens, want_ck, want_cv, slot)
    assert ops.takes_projected_parts(q.shape[0], q.shape[1], cos, sin, pk, ck)
    got = ops.rope_decode_attention_parts(parts, q.shape[1], cos, sin, pk, pv, lens, ck, cv, slot)
    assert torch.equal(ck, want_ck) and torch.equal(cv, want_cv)
    assert torch.equal(got, want)

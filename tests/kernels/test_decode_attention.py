"""The Triton decode-attention kernel against the float64 reference (interpreter on CPU)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from kernel_cases import DEVICE, NEEDS_TRITON, ON_GPU

from fastgrpo.kernels.decode import decode_attention as ops
from fastgrpo.kernels.decode import decode_attention_triton as triton_ops

pytestmark = NEEDS_TRITON


def _inputs(P, G, nh, nkv, d, Lp, Tc, lens, step, dtype=torch.float32, seed=0, stale=None):
    """(q, prompt_k, prompt_v, prompt_lens, comp_k, comp_v, step) on DEVICE. Slots past each
    prompt's length and past `step` hold `stale` (left by an earlier, longer wave) when given."""
    gen = torch.Generator().manual_seed(seed)
    B = P * G
    q = torch.randn(B, nh, d, generator=gen)
    prompt_kv = torch.randn(2, P, Lp, nkv, d, generator=gen)
    comp_kv = torch.randn(2, B, Tc, nkv, d, generator=gen)
    lens = torch.tensor(lens, dtype=torch.int64)
    if stale is not None:
        prompt_kv[:, torch.arange(Lp) >= lens[:, None]] = stale
        comp_kv[:, :, step + 1 :] = stale
    step = torch.tensor(step, dtype=torch.int64)
    pk, pv, ck, cv = (t.to(dtype).contiguous() for t in (*prompt_kv, *comp_kv))
    return tuple(t.to(DEVICE) for t in (q.to(dtype), pk, pv, lens, ck, cv, step))


def _float64_ref(q, pk, pv, lens, ck, cv, step):
    return ops.decode_attention_ref(
        q.double(), pk.double(), pv.double(), lens, ck.double(), cv.double(), step
    )


def _ref_with_rounded_probs(q, pk, pv, lens, ck, cv, step):
    """PyTorch's own low-precision attention: scores and softmax in fp32, probabilities rounded to
    q's dtype before the product with the values (as flash kernels do), output in q's dtype."""
    P, Lp, nkv, d = pk.shape
    B, nh, _ = q.shape
    G, Tc = B // P, ck.shape[1]
    keys = torch.cat([pk.repeat_interleave(G, 0), ck], 1)  # (B, Lp + Tc, nkv, d)
    values = torch.cat([pv.repeat_interleave(G, 0), cv], 1)
    pos = torch.arange(Lp + Tc, device=q.device)
    valid = torch.where(pos < Lp, pos < lens.repeat_interleave(G)[:, None], pos - Lp <= step)
    qg = q.view(B, nkv, nh // nkv, d).float() / math.sqrt(d)  # (B, nkv, rep, d)
    scores = torch.einsum("bkrd,bnkd->bkrn", qg, keys.float())  # (B, nkv, rep, Lp + Tc)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, -1).to(q.dtype).float()
    return torch.einsum("bkrn,bnkd->bkrd", probs, values.float()).reshape(B, nh, d).to(q.dtype)


# (P, G, nh, nkv, d, Lp, Tc, prompt lengths, step): prompt lengths 1, odd and the full capacity,
# the first and the last completion slot, rep = 1, 2, 4 and 7 (nh=14, nkv=2); in the interpreter a
# key block is 16 keys, so 37 and 20 keys end in partial blocks
CASES = {
    "rep1-G1-first-slot": (2, 1, 2, 2, 16, 37, 20, [1, 37], 0),
    "rep2-G3-last-slot": (2, 3, 4, 2, 64, 37, 20, [37, 23], 19),
    "rep7-G3-last-slot": (2, 3, 14, 2, 16, 21, 33, [1, 21], 32),
    "rep7-G1-d64-first-slot": (3, 1, 14, 2, 64, 37, 9, [9, 37, 1], 0),
    "rep4-one-prompt-key-one-slot": (1, 2, 4, 1, 32, 1, 1, [1], 0),
}


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_float64_reference(case, splits):
    inputs = _inputs(*case)
    out = triton_ops.decode_attention_triton(*inputs, splits=splits)
    assert out.shape == inputs[0].shape and out.dtype == torch.float32
    assert (out.double() - _float64_ref(*inputs)).abs().max() <= 1e-5


@pytest.mark.parametrize("splits", [1, 2])
def test_stale_values_past_the_valid_slots_do_not_change_the_result(splits):
    case = (2, 3, 14, 2, 16, 21, 33, [5, 21], 17)
    clean = triton_ops.decode_attention_triton(*_inputs(*case), splits=splits)
    stale = _inputs(*case, stale=3.0e4)
    out = triton_ops.decode_attention_triton(*stale, splits=splits)
    assert torch.equal(out, clean)  # the stale slots are never read
    assert (out.double() - _float64_ref(*stale)).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_error_is_within_twice_pytorchs_own(dtype):
    inputs = _inputs(2, 3, 14, 2, 64, 37, 20, [37, 11], 13, dtype=dtype, seed=1)
    out = triton_ops.decode_attention_triton(*inputs, splits=2)
    want = _float64_ref(*inputs)
    own = (_ref_with_rounded_probs(*inputs).double() - want).abs().max()
    assert out.dtype == dtype
    assert (out.double() - want).abs().max() <= 2 * own + 1e-6


def test_query_heads_may_be_a_strided_view():
    q, *rest = _inputs(2, 3, 14, 2, 16, 21, 33, [5, 21], 17)
    wide = torch.zeros(q.shape[0], q.shape[1], 3 * q.shape[2], device=q.device)
    view = wide[..., 16:32].copy_(q)  # (B, nh, d) with a row stride of 3 d, as a fused qkv gives
    out = triton_ops.decode_attention_triton(view, *rest, splits=1)
    assert (out.double() - _float64_ref(q, *rest)).abs().max() <= 1e-5


def test_public_function_keeps_cpu_tensors_on_the_reference():
    inputs = tuple(t.cpu() for t in _inputs(2, 3, 14, 2, 16, 21, 33, [5, 21], 17))
    assert torch.equal(ops.decode_attention(*inputs), ops.decode_attention_ref(*inputs))


def test_launcher_rejects_what_the_kernel_cannot_read():
    q, pk, pv, lens, ck, cv, step = _inputs(2, 2, 4, 2, 16, 5, 3, [5, 2], 1)
    with pytest.raises(ValueError, match="power of two"):
        triton_ops.decode_attention_triton(*_inputs(2, 2, 4, 2, 24, 5, 3, [5, 2], 1))
    with pytest.raises(ValueError, match="share one of"):
        triton_ops.decode_attention_triton(q, pk.half(), pv, lens, ck, cv, step)
    with pytest.raises(ValueError, match="contiguous"):
        strided = ck.transpose(1, 2).contiguous().transpose(1, 2)  # (B, Tc, nkv, d), not packed
        triton_ops.decode_attention_triton(q, pk, pv, lens, strided, cv, step)
    with pytest.raises(ValueError, match="B % P"):
        triton_ops.decode_attention_triton(q[:3], pk, pv, lens, ck[:3], cv[:3], step)


# real shapes: Qwen2.5-0.5B (nh=14, nkv=2, d=64) and Qwen2.5-7B (nh=28, nkv=4, d=128)
REAL = {"nh14-nkv2-d64": (14, 2, 64), "nh28-nkv4-d128": (28, 4, 128)}


def _real_case(nh, nkv, d, step, seed=0):
    """B=64 rows (16 prompts x 4 samples), prompts of 1..128 tokens (one full), 256 slots."""
    lens = torch.randint(1, 129, (16,), generator=torch.Generator().manual_seed(seed)).tolist()
    lens[0] = 128
    return (16, 4, nh, nkv, d, 128, 256, lens, step)


def _real_inputs(nh, nkv, d, step, seed=0):
    return _inputs(*_real_case(nh, nkv, d, step, seed), torch.bfloat16, seed=seed)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("step", [0, 100, 255])
@pytest.mark.parametrize("heads", REAL.values(), ids=REAL.keys())
def test_bf16_kernel_at_a_real_shape_is_within_twice_pytorchs_own_error(heads, step, splits):
    inputs = _real_inputs(*heads, step, seed=step)
    out = triton_ops.decode_attention_triton(*inputs, splits=splits)
    want = _float64_ref(*inputs)
    own = (_ref_with_rounded_probs(*inputs).double() - want).abs().max()
    assert (out.double() - want).abs().max() <= 2 * own + 1e-3
    assert os.environ.get("TRITON_INTERPRET") != "1"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_captured_in_a_cuda_graph_follows_the_step_changed_in_place(splits):
    q, pk, pv, lens, ck, cv, step = _real_inputs(*REAL["nh14-nkv2-d64"], 0, seed=3)
    args = (q, pk, pv, lens, ck, cv, step)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        triton_ops.decode_attention_triton(*args, splits=splits)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_ops.decode_attention_triton(*args, splits=splits)
    for value in (0, 1, 77, 255, 5):
        step.fill_(value)
        graph.replay()
        want = _float64_ref(*args)
        own = (_ref_with_rounded_probs(*args).double() - want).abs().max()
        assert (out.double() - want).abs().max() <= 2 * own + 1e-3, value


def _rope_inputs(case, dtype=torch.float32, seed=0):
    """The attention inputs of `case` plus this step's k and v (B, nkv, d) before they are in
    the cache, cos and sin (B, d) at each row's position (Llama tables: angles cat(f, f)), and q
    as the (B, nh, d) view of a packed qkv row, as the decode step hands them over."""
    q, pk, pv, lens, ck, cv, step = _inputs(*case, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    B, nh, d = q.shape
    nkv = ck.shape[2]
    packed = torch.randn(B, (nh + 2 * nkv) * d, generator=gen).to(dtype).to(DEVICE)
    q_view = packed[:, : nh * d].view(B, nh, d)
    q_view.copy_(q)
    k = packed[:, nh * d : (nh + nkv) * d].view(B, nkv, d)
    v = packed[:, (nh + nkv) * d :].view(B, nkv, d)
    positions = torch.randint(0, 4096, (B, 1), generator=gen).double()
    freqs = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.cat([positions * freqs, positions * freqs], 1)
    cos, sin = (f(angles).to(dtype).to(DEVICE) for f in (torch.cos, torch.sin))
    return (q_view, k, v, cos, sin, pk, pv, lens, ck, cv, step)


def _rope_reference(inputs):
    """The two-kernel path's result on copies: (attention output, caches after the write)."""
    q, k, v, cos, sin, pk, pv, lens, ck, cv, step = (
        t.clone() if t.is_floating_point() else t for t in inputs
    )
    out = ops.rope_decode_attention_ref(q, k, v, cos, sin, pk, pv, lens, ck, cv, step)
    return out, ck, cv, (q, pk, pv, lens, ck, cv, step)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_rope_in_the_kernel_matches_rope_then_attention(case, splits):
    inputs = _rope_inputs(case)
    q_before, k_before = inputs[0].clone(), inputs[1].clone()
    want, want_ck, want_cv, rotated = _rope_reference(inputs)
    q, k, v, cos, sin, pk, pv, lens, ck, cv, step = inputs
    out = triton_ops.decode_attention_triton(
        q, pk, pv, lens, ck, cv, step, splits, rope=(k, v, cos, sin)
    )
    # the caches: the rotated k and the v at the slot, bitwise as the RoPE kernel writes them
    assert torch.equal(ck, want_ck) and torch.equal(cv, want_cv)
    assert not torch.equal(ck[:, step], k)  # the key was rotated (positions are not all 0)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # read, never written
    assert (out - want).abs().max() <= 1e-5
    assert (out.double() - _float64_ref(*rotated)).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rope_in_the_kernel_rounds_the_rotation_as_the_rope_kernel_in_half_precision(dtype):
    inputs = _rope_inputs(CASES["rep7-G3-last-slot"], dtype=dtype, seed=2)
    want, want_ck, want_cv, rotated = _rope_reference(inputs)
    q, k, v, cos, sin, pk, pv, lens, ck, cv, step = inputs
    out = triton_ops.decode_attention_triton(
        q, pk, pv, lens, ck, cv, step, 2, rope=(k, v, cos, sin)
    )
    assert torch.equal(cv, want_cv)
    slack = 1e-6
    if dtype == torch.float16 or ON_GPU:
        assert torch.equal(ck, want_ck)
    else:  # the interpreter's fp32 copies round the rotated q and k once (k at the write-back),
        # not each product first: an ulp of the products apart, and the output with them
        assert torch.allclose(ck.float(), want_ck.float(), rtol=2**-7, atol=2**-6)
        assert torch.equal(ck[:, :step], want_ck[:, :step])
        slack = 1e-2
    exact = _float64_ref(*rotated)
    own = (_ref_with_rounded_probs(*rotated).double() - exact).abs().max()
    assert (out.double() - exact).abs().max() <= 2 * own + slack


def test_rope_public_function_keeps_cpu_tensors_on_the_two_step_reference():
    inputs = tuple(t.cpu() for t in _rope_inputs(CASES["rep2-G3-last-slot"]))
    want, want_ck, want_cv, _ = _rope_reference(inputs)
    out = ops.rope_decode_attention(*inputs)
    assert torch.equal(out, want)
    assert torch.equal(inputs[8], want_ck) and torch.equal(inputs[9], want_cv)


def test_rope_launcher_rejects_tables_of_the_wrong_shape():
    q, k, v, cos, sin, pk, pv, lens, ck, cv, step = _rope_inputs(CASES["rep2-G3-last-slot"])
    with pytest.raises(ValueError, match="cos and sin must be"):
        triton_ops.decode_attention_triton(
            q, pk, pv, lens, ck, cv, step, rope=(k, v, cos[:, :8], sin)
        )
    with pytest.raises(ValueError, match="expected"):
        triton_ops.decode_attention_triton(
            q, pk, pv, lens, ck, cv, step, rope=(k[:, :1], v, cos, sin)
        )


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("step", [0, 100, 255])
@pytest.mark.parametrize("heads", REAL.values(), ids=REAL.keys())
def test_bf16_rope_in_the_kernel_at_a_real_shape(heads, step, splits):
    inputs = _rope_inputs(_real_case(*heads, step, seed=step), dtype=torch.bfloat16, seed=step)
    _, want_ck, want_cv, rotated = _rope_reference(inputs)
    q, k, v, cos, sin, pk, pv, lens, ck, cv, slot = inputs
    out = triton_ops.decode_attention_triton(
        q, pk, pv, lens, ck, cv, slot, splits, rope=(k, v, cos, sin)
    )
    assert torch.equal(ck, want_ck) and torch.equal(cv, want_cv)  # bitwise the RoPE kernel's
    want = _float64_ref(*rotated)
    own = (_ref_with_rounded_probs(*rotated).double() - want).abs().max()
    assert (out.double() - want).abs().max() <= 2 * own + 1e-3


def test_fp32_takes_blocks_that_fit_shared_memory_or_the_reference_with_one_notice(
    monkeypatch, caplog
):
    """The 256-key blocks at d 64 take ~130 KB in bf16 and 276 KB in fp32 (Triton's count on the
    H100, whose programs may have 227 KB): fp32 keeps the 64-key blocks; where even those do not
    fit (fp32 keys of d 256 on a 99 KB GPU) the reference serves, and says so once."""
    from fastgrpo.kernels import support

    monkeypatch.setattr(triton_ops, "interpreting", lambda: False)
    monkeypatch.setattr(triton_ops, "multiprocessors", lambda *device: 132)
    monkeypatch.setattr(triton_ops, "shared_memory", lambda *device: 227 * 1024)
    monkeypatch.setattr(support, "_noticed", set())
    assert triton_ops.blocks_for(64, 2, 64, itemsize=2) == (256, 4, 3)
    assert triton_ops.blocks_for(64, 2, 64, itemsize=4) == (64, 4, 2)
    q = torch.empty(4, 8, 256)
    assert triton_ops.fits_shared_memory(q, 256) and triton_ops.fits_shared_memory(
        q.bfloat16(), 256
    )
    monkeypatch.setattr(triton_ops, "shared_memory", lambda *device: 99 * 1024)
    assert triton_ops.fits_shared_memory(q.bfloat16(), 256)
    assert not triton_ops.fits_shared_memory(q, 256) and not triton_ops.fits_shared_memory(q, 256)
    notices = [r.getMessage() for r in caplog.records if r.name == "fastgrpo.kernels"]
    assert notices == [
        "fastgrpo: decode attention runs its PyTorch reference for float32 at head dim 256 "
        "(it exceeds shared memory)"
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("heads", REAL.values(), ids=REAL.keys())
def test_fp32_kernel_at_a_real_shape_in_one_wave_matches_float64(heads, rope):
    """64 rows x 2 kv heads is one wave on an H100: the step where bf16 takes the 256-key blocks,
    which in fp32 did not fit shared memory (OutOfResources: 282752 bytes > 232448)."""
    case = _real_case(*heads, 100, seed=1)
    if rope:
        inputs = _rope_inputs(case, dtype=torch.float32, seed=1)
        _, want_ck, want_cv, rotated = _rope_reference(inputs)
        out = ops.rope_decode_attention(*inputs)
        assert torch.equal(inputs[8], want_ck) and torch.equal(inputs[9], want_cv)
    else:
        rotated = _inputs(*case, dtype=torch.float32, seed=1)
        out = ops.decode_attention(*rotated)
    assert triton_ops.kernel_serves(rotated[0], rotated[1])
    assert (out.double() - _float64_ref(*rotated)).abs().max() <= 1e-5

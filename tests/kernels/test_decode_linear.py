"""The decode step's small linears (with the SwiGLU epilogue for gate/up) and the fused RoPE +
KV-cache write, against float64 and the model's own PyTorch ops; the native transformer's packed
decode path with them.

The linear sums in a different order than cuBLAS, so it is held to the same distance from a float64
reference as the model's bf16 ops, not to bitwise equality: on a GPU within 1.5x of the model's
error. Under the interpreter (CPU) the bound is 5x: the 3.9 interpreter rounds fp32 to bf16 by
truncation, which doubles each rounding's error and biases it one way, and the SwiGLU epilogue
rounds four times in a row (gate, up, silu, product; measured up to 4.6x). A wrong bias, block
offset or weight half gives errors of order 1, far above either bound.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, NEEDS_TRITON, ON_GPU, random_model

from fastgrpo.kernels.decode import decode_linear
from fastgrpo.kernels.decode.decode_linear import linear_ref, linear_triton
from fastgrpo.kernels.decode.kv_write import write_kv_ref
from fastgrpo.kernels.layers import rms_norm, rope
from fastgrpo.kernels.layers.rms_norm import SplitSums, add_rms_norm_ref
from fastgrpo.models import transformer
from fastgrpo.models.attention import PackedCausalAttention
from fastgrpo.models.transformer import ModelConfig, RotaryTable
from fastgrpo.rollout.kv_cache import DecodeAttention, KVCache

pytestmark = NEEDS_TRITON
BF16 = torch.bfloat16
INTERPRETER_RATIO = 5.0


def _randn(*shape, seed, scale=1.0, dtype=BF16):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)


def _exact(x, weight, bias, swiglu):
    """float64 of the same bf16 inputs, no rounding anywhere."""
    b = None if bias is None else bias.double()
    out = torch.nn.functional.linear(x.double(), weight.double(), b)
    if swiglu:
        gate, up = out.chunk(2, dim=-1)
        out = torch.nn.functional.silu(gate) * up
    return out


def _relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.double() - exact).norm() / exact.norm())


def _inputs(M, K, N, seed, bias, swiglu):
    rows = 2 * N if swiglu else N
    return (
        _randn(M, K, seed=seed),
        _randn(rows, K, seed=seed + 3, scale=K**-0.5),
        _randn(rows, seed=seed + 4, scale=0.5) if bias else None,
        swiglu,
    )


VARIANTS = {
    "plain": dict(bias=False, swiglu=False),
    "bias": dict(bias=True, swiglu=False),
    "swiglu": dict(bias=False, swiglu=True),
    "bias+swiglu": dict(bias=True, swiglu=True),
}


def _check_against_float64(args, config=None, ratio=1.5 if ON_GPU else INTERPRETER_RATIO):
    out = linear_triton(*args, config=config)
    want = linear_ref(*args)
    exact = _exact(*args)
    assert out.shape == want.shape and out.dtype == BF16
    # as accurate as the model's own bf16 ops, measured from float64 on the same inputs
    own = _relative_error(want, exact)
    assert _relative_error(out, exact) <= ratio * own + 1e-6, (_relative_error(out, exact), own)


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
@pytest.mark.parametrize("M,K,N", [(1, 48, 40), (5, 136, 19), (37, 64, 72)])
def test_decode_linear_is_as_accurate_as_the_models_ops(M, K, N, variant):
    _check_against_float64(_inputs(M, K, N, seed=M + K + N, **VARIANTS[variant]))


@pytest.mark.parametrize(
    "config",
    [dict(BM=16, BN=16, BK=32), dict(BM=32, BN=64, BK=64, num_stages=2)],
    ids=["16x16x32", "32x64x64"],
)
def test_decode_linear_blocks_split_rows_columns_and_k_the_same_way(config):
    # 37 rows over row blocks of 16 or 32, K = 100 with a ragged last block, N not a multiple
    _check_against_float64(_inputs(37, 100, 45, seed=3, bias=True, swiglu=True), config=config)


def test_decode_linear_reads_strided_rows_and_a_packed_weights_halves():
    # x as the slice of a wider buffer (row stride 96), weight rows of a bigger matrix
    x = _randn(6, 96, seed=1)[:, 16:80]
    weight = _randn(50, 64, seed=2, scale=0.1)[10:50]  # (40, 64): 20 gate + 20 up rows
    _check_against_float64((x, weight, None, True))


def test_launcher_says_what_it_cannot_take():
    x = _randn(4, 32, seed=0)
    w = _randn(8, 32, seed=1)
    with pytest.raises(ValueError, match="bfloat16"):
        linear_triton(x.float(), w.float(), None)
    with pytest.raises(ValueError, match="weight"):
        linear_triton(x, w[:, :16], None)
    with pytest.raises(ValueError, match="even"):
        linear_triton(x, w[:7], None, swiglu=True)
    with pytest.raises(ValueError, match="bias"):
        linear_triton(x, w, w[0])


def test_kernel_is_taken_only_where_it_measured_faster_than_cublas():
    x, w = _randn(64, 896, seed=0), _randn(1152, 896, seed=1)
    assert decode_linear.takes(x, w, None) == ON_GPU  # a 0.5B q/k/v at 64 rows, on CUDA
    big_rows = _randn(decode_linear.MAX_ROWS + 1, 896, seed=2)
    assert not decode_linear.takes(big_rows, w, None)
    long_k = _randn(64, 4864, seed=3)  # the 0.5B down_proj
    assert not decode_linear.takes(long_k, _randn(896, 4864, seed=4), None)
    assert not decode_linear.takes(x.float(), w.float(), None)


@pytest.mark.parametrize(
    "M,K,N,config",
    [(5, 300, 19, None), (37, 200, 45, dict(BM=16, BN=16, BK=32, k_per_split=64))],
    ids=["default", "4-ranges"],
)
def test_split_sums_add_up_to_the_product(M, K, N, config):
    x, weight, _, _ = _inputs(M, K, N, seed=K, bias=False, swiglu=False)
    sums = decode_linear.linear_split_sums(x, weight, config)
    if config is not None:  # K = 200 in k ranges of 64: 4 parts, the last one short
        assert sums.partials.shape == (4, M, N)
    assert sums.partials.dtype == torch.float32 and sums.dtype == BF16
    exact = _exact(x, weight, None, False)
    # the parts are fp32 sums of exact products: their total is within fp32 error of float64
    assert (sums.partials.double().sum(0) - exact).abs().max() <= 1e-5 * exact.abs().max()
    own = _relative_error(linear_ref(x, weight, None), exact)
    assert _relative_error(sums.total(), exact) <= 1.5 * own + 1e-6


@pytest.mark.parametrize("H", [24, 896])
def test_norm_kernel_adds_up_split_sums_before_the_residual_add(H):
    parts = _randn(3, 7, H, seed=H, dtype=torch.float32)
    sums = SplitSums(parts, BF16)
    residual = _randn(7, H, seed=H + 1, scale=4.0)
    weight = _randn(H, seed=H + 2, scale=0.2) + 1
    normed, new_residual = rms_norm.add_rms_norm_triton(sums, residual, weight, 1e-6)
    want_normed, want_residual = rms_norm.add_rms_norm_ref(sums, residual, weight, 1e-6)
    assert torch.equal(want_residual, residual + parts.sum(0).to(BF16))  # the model's rounding
    # a different fp32 summation order, and on the interpreter truncating roundings: one bf16 ulp
    # of the sum can become a few after the residual add, the norm and the weight
    gap = (normed.double() - want_normed.double()).abs()
    assert gap.max() <= 4 * torch.finfo(BF16).eps * want_normed.double().abs().max()
    assert (new_residual.double() - want_residual.double()).abs().max() <= (
        2 * torch.finfo(BF16).eps * want_residual.double().abs().max()
    )
    with pytest.raises(ValueError, match="residual"):
        rms_norm.add_rms_norm_triton(sums, None, weight, 1e-6)


def test_norm_linear_is_the_norm_then_the_linear():
    x, residual = _randn(3, 32, seed=5), _randn(3, 32, seed=6, scale=4.0)
    norm_weight, weight = _randn(32, seed=7, scale=0.2) + 1, _randn(16, 32, seed=8, scale=0.2)
    out, new_residual = decode_linear.norm_linear(
        x, residual, norm_weight, 1e-6, weight, None, True
    )
    h, want_residual = add_rms_norm_ref(x, residual, norm_weight, 1e-6)
    assert torch.equal(new_residual, want_residual)
    if not ON_GPU:  # the references, exactly
        assert torch.equal(out, linear_ref(h, weight, None, swiglu=True))


# ----------------------------------------------------------------------------- RoPE + KV write


def _cache(B, Tc, nkv, d, dtype):
    zeros = lambda: torch.zeros(B, Tc, nkv, d, dtype=dtype, device=DEVICE)  # noqa: E731
    return zeros(), zeros()


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
def test_rope_and_kv_write_in_one_kernel_is_rope_then_the_write(dtype):
    B, nh, nkv, d, Tc = 5, 6, 2, 10, 7
    qkv = _randn(B, (nh + 2 * nkv) * d, seed=1, dtype=dtype)  # a packed projection's output
    positions = torch.tensor([3, 0, 9, 100, 4], device=DEVICE)
    inv_freq = 1.0 / (10_000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    cos, sin = RotaryTable(inv_freq).lookup(positions, 128, dtype)
    slot = torch.tensor(4, device=DEVICE)

    def split(t):
        q, k, v = t.split([nh * d, nkv * d, nkv * d], dim=-1)
        return q.view(B, nh, d), k.view(B, nkv, d), v.view(B, nkv, d)

    # against the RoPE kernel then the KV write: bitwise, on the interpreter as on a GPU (the RoPE
    # kernel itself is held to the model's apply_rope in test_fused_decoder_ops.py)
    want_qkv, got_qkv = qkv.clone(), qkv.clone()
    want_k, want_v = _cache(B, Tc, nkv, d, dtype)
    got_k, got_v = _cache(B, Tc, nkv, d, dtype)
    q, k, v = split(want_qkv)
    rope.apply_rope_qk_triton(q, k, cos, sin)
    write_kv_ref(want_k, want_v, k, v, slot)
    rope.rope_write_kv_triton(*split(got_qkv), cos, sin, got_k, got_v, slot)
    assert torch.equal(got_qkv, want_qkv)  # q and k rotated in place, v untouched
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert got_k[:, 4].abs().sum() > 0 and got_k[:, :4].abs().sum() == 0  # only slot 4 written


def test_decode_attention_rotating_and_storing_in_one_call_equals_the_two_calls():
    config = ModelConfig(
        vocab_size=50, hidden_size=24, intermediate_size=32, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=6,
    )  # fmt: skip
    B, Lp, steps = 4, 5, 6
    rotary = RotaryTable(torch.rand(3, generator=torch.Generator().manual_seed(0)))
    outs = []
    for fused in (False, True):
        cache = KVCache.allocate(config, B, Lp, B, steps, torch.float32, DEVICE)
        cache.prompt_k[0].copy_(_randn(B, Lp, 2, 6, seed=1, dtype=torch.float32))
        cache.prompt_v[0].copy_(_randn(B, Lp, 2, 6, seed=2, dtype=torch.float32))
        cache.prompt_lens.copy_(torch.tensor([5, 1, 3, 4]))
        attend = DecodeAttention(cache, torch.tensor(2, device=DEVICE))
        q = _randn(B, 4, 6, seed=3, dtype=torch.float32)
        k, v = (
            _randn(B, 2, 6, seed=4, dtype=torch.float32),
            _randn(B, 2, 6, seed=5, dtype=torch.float32),
        )
        cos, sin = rotary.lookup(torch.tensor([7, 3, 5, 6], device=DEVICE), 16, q.dtype)
        if fused:
            out = attend.rope_and_attend(0, q, k, v, cos, sin)
        else:
            rope.apply_rope_qk_(q, k, cos, sin)
            out = attend(0, q, k, v)
        outs.append((out, cache.comp_k[0].clone(), cache.comp_v[0].clone()))
    for plain, fused in zip(*outs):
        assert torch.equal(plain, fused)


# ----------------------------------------------------------------------------- the model


LLAMA_LIKE = ModelConfig(  # GQA (rep 3), biased q/k/v (Qwen2), 2 layers
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=8,
    attention_bias=True,
    tie_word_embeddings=True,
)


@pytest.fixture
def decode_kernels_here(monkeypatch):
    """The fused path on this device (the interpreter on a CPU) with the decode linear taken for
    every bf16 product of at most MAX_ROWS rows; records each launch's swiglu flag."""
    calls = []
    launcher = decode_linear.linear_triton

    def counted(x, weight, bias, swiglu=False, config=None):
        calls.append(swiglu)
        return launcher(x, weight, bias, swiglu, config)

    monkeypatch.setattr(
        transformer, "use_fused_ops", lambda x, asked: asked and not torch.is_grad_enabled()
    )
    monkeypatch.setattr(
        decode_linear,
        "takes",
        lambda x, w, b: x.dtype == BF16 and x.shape[0] <= decode_linear.MAX_ROWS,
    )
    monkeypatch.setattr(decode_linear, "linear_triton", counted)
    split_launcher = decode_linear.linear_split_sums

    def counted_split(x, weight, config=None):
        calls.append("split")
        return split_launcher(x, weight, dict(BK=16, k_per_split=32))  # 80 = 32 + 32 + 16

    monkeypatch.setattr(
        decode_linear,
        "takes_split_sums",
        lambda x, w, b: b is None and x.dtype == BF16 and x.shape[0] <= decode_linear.MAX_ROWS,
    )
    monkeypatch.setattr(decode_linear, "linear_split_sums", counted_split)
    return calls


def _model_inputs(lengths):
    ids = torch.randint(0, 97, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths]).to(DEVICE)
    attend = PackedCausalAttention.from_lengths(list(lengths), DEVICE, LLAMA_LIKE.layer_windows)
    return ids.to(DEVICE), positions, attend


def test_packed_decode_path_of_the_model_is_as_accurate_as_its_pytorch_forward(
    decode_kernels_here,
):
    model = random_model(LLAMA_LIKE, BF16)
    model.pack_projections()
    exact = random_model(LLAMA_LIKE, torch.float64)
    ids, positions, attend = _model_inputs((5, 1, 9))
    with torch.no_grad():
        plain = model(ids, positions, attend)  # (T, H)
        assert not decode_kernels_here
        fused = model(ids, positions, attend, fused_ops=True)
        want = exact(ids, positions, attend)
    # per layer: q/k/v, o_proj as split sums, gate/up + SiLU (the one with swiglu), down_proj as
    # split sums
    assert decode_kernels_here == [False, "split", True, "split"] * LLAMA_LIKE.num_layers
    own = (plain.double() - want).abs()
    err = (fused.double() - want).abs()
    assert err.mean() <= 1.5 * own.mean() and err.max() <= 2 * own.max()


def test_weights_are_read_in_place_only_when_a_bulk_copy_can_read_them():
    from fastgrpo.kernels.support import tma_readable

    wide = torch.empty(6, 40, dtype=BF16)
    assert tma_readable(wide)  # 80-byte rows
    assert not tma_readable(wide[:, 1:33])  # base 2 bytes past a 16-byte boundary
    assert not tma_readable(torch.empty(6, 36, dtype=BF16))  # 72-byte rows
    assert not tma_readable(wide.t())  # column-major


def test_unpacked_model_keeps_one_gemm_per_projection(decode_kernels_here):
    model = random_model(LLAMA_LIKE, BF16)  # not packed
    ids, positions, attend = _model_inputs((4,))
    with torch.no_grad():
        model(ids, positions, attend, fused_ops=True)
    assert not decode_kernels_here


# ----------------------------------------------------------------------------- GPU

# Qwen2.5-0.5B (H 896, I 4864, q/k/v 1152 with bias) and Qwen2.5-7B (H 3584, I 18944, q/k/v 4608)
REAL = {
    "0.5B-qkv": (896, 1152, True, False),
    "0.5B-o": (896, 896, False, False),
    "0.5B-gate-up": (896, 4864, False, True),
    "0.5B-down": (4864, 896, False, False),
    "7B-qkv": (3584, 4608, True, False),
    "7B-gate-up": (3584, 18944, False, True),
    "7B-down": (18944, 3584, False, False),
}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 64, 256])
@pytest.mark.parametrize("shape", list(REAL), ids=list(REAL))
def test_bf16_decode_linear_at_real_shapes_is_as_accurate_as_torch(shape, M):
    K, N, bias, swiglu = REAL[shape]
    _check_against_float64(_inputs(M, K, N, seed=M + K, bias=bias, swiglu=swiglu))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 64])
@pytest.mark.parametrize(
    "K,N",
    [(4864, 896), (1536, 576), (896, 896), (576, 576)],
    ids=["0.5B-down", "135M-down", "0.5B-o_proj", "135M-o_proj"],
)
def test_bf16_split_sums_at_real_shapes_feed_the_norm_as_the_product_would(K, N, M):
    x, weight, _, _ = _inputs(M, K, N, seed=M + K, bias=False, swiglu=False)
    assert decode_linear.takes_split_sums(x, weight, None)
    sums = decode_linear.linear_to_residual(x, weight, None)
    exact = _exact(x, weight, None, False)
    own = _relative_error(linear_ref(x, weight, None), exact)
    assert _relative_error(sums.total(), exact) <= 1.5 * own + 1e-6
    residual = _randn(M, N, seed=1, scale=4.0)
    norm_weight = _randn(N, seed=2, scale=0.2) + 1
    normed, new_residual = rms_norm.add_rms_norm(sums, residual, norm_weight, 1e-6)
    want_normed, want_residual = rms_norm.add_rms_norm_ref(sums, residual, norm_weight, 1e-6)
    # the fp32 sum of the parts in the kernel's order and in torch's: one bf16 ulp apart at most
    gap = (new_residual.double() - want_residual.double()).abs()
    assert bool((gap <= torch.finfo(BF16).eps * want_residual.double().abs()).all())
    assert (gap == 0).double().mean() >= 0.99
    assert (normed.double() - want_normed.double()).abs().max() <= (
        2 * torch.finfo(BF16).eps * want_normed.double().abs().max()
    )

"""The decode step's fused linears (residual add + RMSNorm + linear, + SwiGLU) and the fused RoPE +
KV-cache write, against float64 and the model's own PyTorch ops; the native transformer's decode
path with them.

The fused linear rounds its input at a different point than the model (x * norm_weight before
the matmul, 1 / rms after it, where the model rounds the normalised row), so it is held to the
same distance from a float64 reference as the model's bf16 ops, not to bitwise equality: on a GPU
within 1.5x of the model's error. Under the interpreter (CPU) the bound is 6x: the 3.9 interpreter
rounds fp32 to bf16 by truncation, which doubles each rounding's error and biases it one way, and
the norm kernel then SwiGLU epilogue round six times in a row (measured up to 5.4x). A wrong
bias, block offset or weight half gives errors of order 1, far above either bound.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, NEEDS_TRITON, ON_GPU

from fastgrpo.kernels import decode_linear, rope
from fastgrpo.kernels.decode_linear import norm_linear_ref, norm_linear_triton
from fastgrpo.kernels.kv_write import write_kv_ref
from fastgrpo.models import transformer
from fastgrpo.models.attention import PackedCausalAttention
from fastgrpo.models.transformer import ModelConfig, RotaryTable, Transformer
from fastgrpo.rollout.kv_cache import DecodeAttention, KVCache

pytestmark = NEEDS_TRITON
BF16 = torch.bfloat16


def _randn(*shape, seed, scale=1.0, dtype=BF16):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)


def _exact(x, residual, norm_weight, eps, weight, bias, swiglu):
    """float64 of the same bf16 inputs, no rounding anywhere."""
    x = x.double() + (0 if residual is None else residual.double())
    if norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    out = torch.nn.functional.linear(x, weight.double(), None if bias is None else bias.double())
    if swiglu:
        gate, up = out.chunk(2, dim=-1)
        out = torch.nn.functional.silu(gate) * up
    return out


def _relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.double() - exact).norm() / exact.norm())


def _inputs(M, K, N, seed, residual, norm, bias, swiglu):
    rows = 2 * N if swiglu else N
    return (
        _randn(M, K, seed=seed),
        _randn(M, K, seed=seed + 1, scale=4.0) if residual else None,
        _randn(K, seed=seed + 2, scale=0.2) + 1 if norm else None,
        1e-6,
        _randn(rows, K, seed=seed + 3, scale=K**-0.5),
        _randn(rows, seed=seed + 4, scale=0.5) if bias else None,
        swiglu,
    )


VARIANTS = {
    "norm+residual": dict(residual=True, norm=True, bias=False, swiglu=False),
    "norm+bias": dict(residual=False, norm=True, bias=True, swiglu=False),
    "norm+residual+swiglu": dict(residual=True, norm=True, bias=False, swiglu=True),
    "norm+bias+swiglu": dict(residual=False, norm=True, bias=True, swiglu=True),
    "plain": dict(residual=False, norm=False, bias=False, swiglu=False),
    "plain+bias": dict(residual=False, norm=False, bias=True, swiglu=False),
}


INTERPRETER_RATIO = 6.0


def _check_against_float64(
    args, config=None, ratio=1.5 if ON_GPU else INTERPRETER_RATIO, fuse_norm=None
):
    x, residual = args[0], args[1]
    out, new_residual = norm_linear_triton(*args, config=config, fuse_norm=fuse_norm)
    want, want_residual = norm_linear_ref(*args)
    exact = _exact(*args)
    assert out.shape == want.shape and out.dtype == BF16
    # as accurate as the model's own bf16 ops, measured from float64 on the same inputs
    own = _relative_error(want, exact)
    assert _relative_error(out, exact) <= ratio * own + 1e-6, (_relative_error(out, exact), own)
    if residual is None:
        assert new_residual is x
    elif ON_GPU:  # x + residual rounded once, as the model rounds it
        assert torch.equal(new_residual, want_residual)
    else:  # the interpreter truncates instead: within one ulp
        gap = (want_residual.double() - new_residual.double()).abs()
        assert bool((gap <= torch.finfo(BF16).eps * want_residual.double().abs()).all())


@pytest.mark.parametrize("fuse_norm", [True, False], ids=["norm-in-prologue", "norm-kernel"])
@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
@pytest.mark.parametrize("M,K,N", [(1, 48, 40), (5, 136, 19), (37, 64, 72)])
def test_fused_linear_is_as_accurate_as_the_models_ops(M, K, N, variant, fuse_norm):
    if fuse_norm and not VARIANTS[variant]["norm"]:
        pytest.skip("no norm to fuse")
    args = _inputs(M, K, N, seed=M + K + N, **VARIANTS[variant])
    _check_against_float64(args, fuse_norm=fuse_norm)


@pytest.mark.parametrize(
    "config",
    [dict(BM=16, BN=16, BK=32), dict(BM=32, BN=64, BK=64, num_stages=2)],
    ids=["16x16x32", "32x64x64"],
)
def test_fused_linear_blocks_split_rows_columns_and_k_the_same_way(config):
    # 37 rows over row blocks of 16 or 32, K = 100 with a ragged last block, N not a multiple
    args = _inputs(37, 100, 45, seed=3, residual=True, norm=True, bias=True, swiglu=True)
    _check_against_float64(args, config=config, fuse_norm=True)
    _check_against_float64(args, config=config, fuse_norm=False)


def test_fused_linear_reads_strided_rows_and_a_packed_weights_halves():
    # x as the q/k/v slice of a wider buffer (row stride 96), weight rows of a bigger matrix
    wide = _randn(6, 96, seed=1)
    x = wide[:, 16:80]
    weight = _randn(50, 64, seed=2, scale=0.1)[10:50]  # (40, 64): 20 gate + 20 up rows
    args = (x, None, _randn(64, seed=3, scale=0.1) + 1, 1e-5, weight, None, True)
    _check_against_float64(args)


def test_launcher_says_what_it_cannot_take():
    x = _randn(4, 32, seed=0)
    w = _randn(8, 32, seed=1)
    with pytest.raises(ValueError, match="bfloat16"):
        norm_linear_triton(x.float(), None, None, 0.0, w.float(), None)
    with pytest.raises(ValueError, match="weight"):
        norm_linear_triton(x, None, None, 0.0, w[:, :16], None)
    with pytest.raises(ValueError, match="residual"):
        norm_linear_triton(x, x, None, 0.0, w, None)
    with pytest.raises(ValueError, match="even"):
        norm_linear_triton(x, None, None, 0.0, w[:7], None, swiglu=True)
    with pytest.raises(ValueError, match="rows"):
        big = _randn(decode_linear.MAX_ROWS + 1, 32, seed=2)
        norm_linear_triton(big, None, None, 0.0, w, None)


def test_public_function_keeps_cpu_and_non_bf16_inputs_on_the_reference():
    args = _inputs(3, 32, 8, seed=5, residual=True, norm=True, bias=False, swiglu=False)
    out, _ = decode_linear.norm_linear(*args)
    if not ON_GPU:  # the reference, exactly
        assert torch.equal(out, norm_linear_ref(*args)[0])
    assert not decode_linear.applies(args[0].float())
    assert not decode_linear.applies(_randn(decode_linear.MAX_ROWS + 1, 8, seed=0))


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


def _random_model(config, dtype, seed=0):
    torch.manual_seed(seed)
    model = Transformer(config)
    for name, p in model.named_parameters():
        p.data = (
            (1 + 0.2 * torch.randn_like(p))
            if name.endswith("norm.weight")
            else 0.1 * torch.randn_like(p)
        )
    return model.to(dtype=dtype, device=DEVICE)


@pytest.fixture
def decode_kernels_here(monkeypatch):
    """The fused decode path on this device (the interpreter on a CPU), counting kernel calls."""
    calls = []
    launcher = decode_linear.norm_linear_triton

    def counted(*args, **kwargs):
        calls.append(bool(kwargs.get("swiglu", args[6] if len(args) > 6 else False)))
        return launcher(*args, **kwargs)

    monkeypatch.setattr(
        transformer, "use_fused_ops", lambda x, asked: asked and not torch.is_grad_enabled()
    )
    monkeypatch.setattr(
        decode_linear, "applies", lambda x: x.dtype == BF16 and x.shape[0] <= decode_linear.MAX_ROWS
    )
    monkeypatch.setattr(decode_linear, "norm_linear_triton", counted)
    return calls


def test_decode_path_of_the_model_is_as_accurate_as_its_pytorch_forward(decode_kernels_here):
    model = _random_model(LLAMA_LIKE, BF16)
    model.pack_projections()
    exact = _random_model(LLAMA_LIKE, torch.float64)
    lengths = (5, 1, 9)
    ids = torch.randint(0, 97, (sum(lengths),), generator=torch.Generator().manual_seed(0)).to(
        DEVICE
    )
    positions = torch.cat([torch.arange(n) for n in lengths]).to(DEVICE)
    attend = PackedCausalAttention.from_lengths(list(lengths), DEVICE, LLAMA_LIKE.layer_windows)
    with torch.no_grad():
        plain = model(ids, positions, attend)  # (T, H)
        assert not decode_kernels_here
        fused = model(ids, positions, attend, fused_ops=True)
        want = exact(ids, positions, attend)
    # per layer: norm + q/k/v, o_proj, norm + gate/up + SiLU (the one with swiglu), down_proj
    assert decode_kernels_here == [False, False, True, False] * LLAMA_LIKE.num_layers
    own = (plain.double() - want).abs()
    err = (fused.double() - want).abs()
    assert err.mean() <= 1.5 * own.mean() and err.max() <= 2 * own.max()


def test_decode_path_needs_packed_projections_and_falls_back_without_them(decode_kernels_here):
    model = _random_model(LLAMA_LIKE, BF16)  # not packed
    ids = torch.arange(4, device=DEVICE)
    attend = PackedCausalAttention.from_lengths([4], DEVICE, LLAMA_LIKE.layer_windows)
    with torch.no_grad():
        model(ids, torch.arange(4, device=DEVICE), attend, fused_ops=True)
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
def test_bf16_fused_linear_at_real_shapes_is_as_accurate_as_torch(shape, M):
    K, N, bias, swiglu = REAL[shape]
    norm = shape.endswith(("qkv", "gate-up"))
    args = _inputs(M, K, N, seed=M + K, residual=norm, norm=norm, bias=bias, swiglu=swiglu)
    _check_against_float64(args, fuse_norm=False)
    if norm:
        _check_against_float64(args, fuse_norm=True)

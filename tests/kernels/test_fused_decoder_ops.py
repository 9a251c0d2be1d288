"""The fused decoder ops (residual add + RMSNorm, RoPE of q and k, SiLU * up) against the model's own
PyTorch arithmetic, and the native transformer with them on and off.

On a CPU the kernels run in Triton's interpreter: fp32 and fp16 within an ulp or two (the
interpreter's numpy exp and its order of summing squares differ from torch's CPU ones), RoPE
bitwise. bf16 only to a few ulps there: the 3.9 interpreter rounds fp32 -> bf16 by truncation (half
up under rtne), where a GPU rounds to nearest even, and two such roundings in a row (normed row,
then times weight; silu, then times up) can be 3 ulps off. On a GPU, in bf16 at real shapes, RoPE and
SiLU * up must be bitwise torch's and RMSNorm within one bf16 ulp.
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_cases import DEVICE, NEEDS_TRITON, ON_GPU, random_model

from fastgrpo.kernels.layers import rms_norm, rope, swiglu
from fastgrpo.models import transformer
from fastgrpo.models.attention import PackedCausalAttention
from fastgrpo.models.transformer import ModelConfig, RMSNorm, RotaryTable

pytestmark = NEEDS_TRITON

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# the most ulps (of the reference) the interpreter may be off: see the top of this file
INTERPRETER_ULPS = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 4}


def _ulps(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|out - ref| in units of ref's ulp (the gap above |ref| in ref's dtype), elementwise."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    size = ref.abs()
    gap = torch.nextafter(size, torch.full_like(size, float("inf"))) - size
    return (out.double() - ref.double()).abs() / gap.double()


def _err(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (out.double() - ref.double()).abs().max()


def _randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)


def _cos_sin(T: int, D: int, dtype, seed: int = 0):
    """(T, D) tables as the model looks them up, at positions scattered over 0..4095."""
    positions = torch.randint(0, 4096, (T,), generator=torch.Generator().manual_seed(seed))
    inv_freq = 1.0 / (10_000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    return RotaryTable(inv_freq).lookup(positions.to(DEVICE), 4096, dtype)


# ----------------------------------------------------------------------------- RMSNorm


def test_reference_is_the_models_residual_add_then_rmsnorm():
    norm = RMSNorm(24, 1e-6)
    norm.weight.data = 1 + 0.1 * torch.randn(24)
    x, residual = torch.randn(2, 5, 24).bfloat16(), torch.randn(2, 5, 24).bfloat16()
    normed, new_residual = rms_norm.add_rms_norm_ref(x, residual, norm.weight, norm.eps)
    assert torch.equal(new_residual, residual + x)
    assert torch.equal(normed, norm(residual + x))
    assert torch.equal(rms_norm.add_rms_norm_ref(x, None, norm.weight, norm.eps)[0], norm(x))


@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "no-add"])
@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("H", [13, 576, 896])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_kernel_matches_the_reference(dtype, H, T, with_residual):
    x = _randn(T, H, dtype=dtype, seed=H + T)
    residual = _randn(T, H, dtype=dtype, seed=H + T + 1, scale=3.0) if with_residual else None
    weight = _randn(H, dtype=dtype, seed=H, scale=0.1) + 1
    normed, new_residual = rms_norm.add_rms_norm_triton(x, residual, weight, 1e-6)
    want_normed, want_residual = rms_norm.add_rms_norm_ref(x, residual, weight, 1e-6)
    assert normed.dtype == dtype and new_residual.shape == (T, H)
    if residual is None:
        assert new_residual is x
    assert _ulps(new_residual, want_residual).max() <= (dtype == torch.bfloat16)
    assert _ulps(normed, want_normed).max() <= INTERPRETER_ULPS[dtype]


def test_add_rms_norm_takes_head_tensors_strided_rows_and_an_fp32_weight():
    q = _randn(7, 6, 10, dtype=torch.float16, seed=0)  # (T, nh, D): the q/k norm of Qwen3
    weight = _randn(10, dtype=torch.float32, seed=1, scale=0.1) + 1
    normed, _ = rms_norm.add_rms_norm_triton(q, None, weight, 1e-6)
    want, _ = rms_norm.add_rms_norm_ref(q, None, weight, 1e-6)
    assert normed.dtype == torch.float32 and normed.shape == q.shape  # fp32 weight * fp16 row
    assert _ulps(normed, want).max() <= INTERPRETER_ULPS[torch.float32]
    wide = _randn(7, 40, dtype=torch.float32, seed=2)
    x, residual = wide[:, :13], wide[:, 20:33]  # (T, 13) rows 40 apart
    normed, new_residual = rms_norm.add_rms_norm_triton(x, residual, weight[:1].expand(13), 1e-5)
    want, want_residual = rms_norm.add_rms_norm_ref(x, residual, weight[:1].expand(13), 1e-5)
    assert torch.equal(new_residual, want_residual)
    assert _ulps(normed, want).max() <= INTERPRETER_ULPS[torch.float32]


# ----------------------------------------------------------------------------- RoPE

# (T, nh, nkv, D): T = 1 and 7, rep 7, 3 and 1, head dims 64, 10 (half 5, not a power of two), 128
ROPE_SHAPES = {
    "T1-nh14-nkv2-d64": (1, 14, 2, 64),
    "T7-nh3-nkv1-d10": (7, 3, 1, 10),
    "T7-nh4-nkv4-d128": (7, 4, 4, 128),
}


@pytest.mark.parametrize("shape", ROPE_SHAPES.values(), ids=ROPE_SHAPES.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_kernel_rotates_q_and_k_in_place_as_apply_rope(dtype, shape):
    T, nh, nkv, D = shape
    q, k = _randn(T, nh, D, dtype=dtype, seed=T), _randn(T, nkv, D, dtype=dtype, seed=T + 1)
    cos, sin = _cos_sin(T, D, dtype, seed=T)
    want_q, want_k = rope.apply_rope_qk_ref(q, k, cos, sin)
    q_ptr, k_ptr = q.data_ptr(), k.data_ptr()
    assert rope.apply_rope_qk_triton(q, k, cos, sin) is None
    assert q.data_ptr() == q_ptr and k.data_ptr() == k_ptr
    if dtype == torch.bfloat16 and not ON_GPU:
        # the interpreter truncates each product and the sum (see the top of the file), and a sum
        # that cancels is far from its own ulp: bound the error by the inputs' ulp instead
        size = torch.stack([q.abs().max(), k.abs().max()]).max()
        bound = 3 * (torch.nextafter(size, size.new_tensor(float("inf"))) - size).double()
        assert max(_err(q, want_q), _err(k, want_k)) <= bound
    else:
        assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_rope_kernel_rotates_strided_heads_of_a_fused_qkv_and_leaves_v_alone():
    T, nh, nkv, D = 7, 6, 2, 16
    qkv = _randn(T, (nh + 2 * nkv) * D, dtype=torch.float32, seed=3)  # (T, (nh + 2 nkv) D)
    q = qkv[:, : nh * D].view(T, nh, D)
    k = qkv[:, nh * D : (nh + nkv) * D].view(T, nkv, D)
    v_before = qkv[:, (nh + nkv) * D :].clone()
    cos, sin = _cos_sin(T, D, torch.float32)
    want_q, want_k = rope.apply_rope_qk_ref(q, k, cos, sin)
    rope.apply_rope_qk_triton(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (nh + nkv) * D :], v_before)


# ----------------------------------------------------------------------------- SiLU * up


@pytest.mark.parametrize("shape", [(1, 13), (7, 576), (3, 4864)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_kernel_matches_silu_times_up(dtype, shape):
    gate = _randn(*shape, dtype=dtype, seed=shape[1], scale=4.0)  # silu's curve and both tails
    up = _randn(*shape, dtype=dtype, seed=shape[1] + 1)
    out = swiglu.silu_mul_triton(gate, up)
    assert out.dtype == dtype and out.shape == shape
    assert _ulps(out, swiglu.silu_mul_ref(gate, up)).max() <= INTERPRETER_ULPS[dtype]


def test_rms_norm_kernel_normalises_the_heads_of_a_packed_qkv_projection():
    qkv = _randn(5, 6 * 16 + 2 * 2 * 16, dtype=torch.float32, seed=3)  # (T, (nh + 2 nkv) * D)
    q = qkv[:, : 6 * 16].view(5, 6, 16)  # (T, nh, D): heads 16 apart, tokens 160 apart
    weight = _randn(16, dtype=torch.float32, seed=4, scale=0.2) + 1
    normed, _ = rms_norm.add_rms_norm_triton(q, None, weight, 1e-6)
    want, _ = rms_norm.add_rms_norm_ref(q, None, weight, 1e-6)
    assert _ulps(normed, want).max() <= INTERPRETER_ULPS[torch.float32]


def test_silu_mul_kernel_reads_the_halves_of_a_packed_gate_up_projection():
    gate_up = _randn(7, 2 * 13, dtype=torch.float32, seed=5, scale=4.0)  # (T, 2I), [gate | up]
    gate, up = gate_up.split(13, dim=-1)  # (T, I) views, rows 2I apart
    out = swiglu.silu_mul_triton(gate, up)
    assert out.is_contiguous() and out.shape == (7, 13)
    assert _ulps(out, swiglu.silu_mul_ref(gate, up)).max() <= INTERPRETER_ULPS[torch.float32]


# ----------------------------------------------------------------------------- launchers


def test_launchers_reject_what_the_kernels_cannot_read():
    x = _randn(4, 8, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm.add_rms_norm_triton(x, None, torch.ones(9, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm.add_rms_norm_triton(x, x.half(), torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="unit stride"):
        rms_norm.add_rms_norm_triton(x.t(), None, torch.ones(4, device=DEVICE), 1e-6)
    q, k = x.view(4, 2, 4), x[:, :4].reshape(4, 1, 4)
    cos, sin = _cos_sin(4, 4, torch.float32)
    with pytest.raises(ValueError, match="share one of"):
        rope.apply_rope_qk_triton(q, k, cos.half(), sin.half())
    with pytest.raises(ValueError, match="even D"):
        rope.apply_rope_qk_triton(x.view(4, 8, 1), x.view(4, 8, 1), cos[:, :1], sin[:, :1])
    with pytest.raises(ValueError, match="contiguous"):
        swiglu.silu_mul_triton(x.t(), x.t())
    with pytest.raises(ValueError, match="share a shape"):
        swiglu.silu_mul_triton(x, x.half())


def test_public_functions_keep_cpu_tensors_on_the_references():
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    weight = torch.rand(8) + 0.5
    for got, want in zip(
        rms_norm.add_rms_norm(x, residual, weight, 1e-6),
        rms_norm.add_rms_norm_ref(x, residual, weight, 1e-6),
    ):
        assert torch.equal(got, want)
    assert torch.equal(swiglu.silu_mul(x, residual), swiglu.silu_mul_ref(x, residual))
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    cos, sin = torch.randn(2, 3, 8)
    want_q, want_k = rope.apply_rope_qk_ref(q, k, cos, sin)
    rope.apply_rope_qk_(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


# ----------------------------------------------------------------------------- the model


def _packed_inputs(config: ModelConfig, lengths=(5, 1, 9), start=(0, 0, 300)):
    """(input_ids (T,), positions (T,), attend) for packed sequences; one starts at 300."""
    ids = torch.randint(0, config.vocab_size, (sum(lengths),), generator=torch.Generator())
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(start, lengths)])  # (T,)
    attend = PackedCausalAttention.from_lengths(list(lengths), DEVICE, config.layer_windows)
    return ids.to(DEVICE), positions.to(DEVICE), attend


@pytest.fixture
def kernels_on_this_device(monkeypatch):
    """Route the model's fused path to the Triton launchers (the interpreter on a CPU), counting
    the calls, so the CPU tests run the fused forward of the GPU."""
    calls = []

    def counted(launcher):
        def call(*args):
            calls.append(launcher.__name__)
            return launcher(*args)

        return call

    monkeypatch.setattr(
        transformer, "use_fused_ops", lambda x, asked: asked and not torch.is_grad_enabled()
    )
    monkeypatch.setattr(transformer, "add_rms_norm", counted(rms_norm.add_rms_norm_triton))
    monkeypatch.setattr(transformer, "apply_rope_qk_", counted(rope.apply_rope_qk_triton))
    monkeypatch.setattr(transformer, "silu_mul", counted(swiglu.silu_mul_triton))
    return calls


QWEN3_LIKE = ModelConfig(  # GQA (rep 3), q/k norm, an odd head dim, 2 layers
    vocab_size=97,
    hidden_size=48,
    intermediate_size=72,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=10,
    qk_norm=True,
    tie_word_embeddings=True,
)


def test_fused_forward_of_a_random_model_gives_its_pytorch_hidden_states(kernels_on_this_device):
    model = random_model(QWEN3_LIKE, torch.float32)
    ids, positions, attend = _packed_inputs(QWEN3_LIKE)
    with torch.enable_grad():
        plain = model(ids, positions, attend, fused_ops=True)  # (T, H), the training path
    assert plain.requires_grad and not kernels_on_this_device
    with torch.no_grad():
        scored = model(ids, positions, attend)  # the trainer's scoring: not asked, not fused
        assert not kernels_on_this_device and torch.equal(scored, plain.detach())
        fused = model(ids, positions, attend, fused_ops=True)
    # per layer: 2 norms + q/k norms, one RoPE, one SiLU * up; then the final norm
    assert len(kernels_on_this_device) == 2 * 6 + 1
    assert (fused - plain.detach()).abs().max() <= 1e-5


def test_fused_ops_serve_only_no_grad_cuda_forwards_that_ask_for_them(monkeypatch):
    x = torch.zeros(2, device=DEVICE)
    with torch.no_grad():
        assert transformer.use_fused_ops(x, asked=True) == ON_GPU
        assert not transformer.use_fused_ops(x, asked=False)  # the trainer's scoring
        monkeypatch.setattr(transformer, "FUSED_OPS", False)  # FASTGRPO_FUSED_OPS=0
        assert not transformer.use_fused_ops(x, asked=True)
    monkeypatch.setattr(transformer, "FUSED_OPS", True)
    assert not transformer.use_fused_ops(x, asked=True)  # grad enabled: the training path


# ----------------------------------------------------------------------------- GPU

# Qwen2.5-0.5B (H 896, I 4864, nh 14, nkv 2, d 64), Qwen3-8B-like (H 4096, nh 32, nkv 8, d 128),
# Qwen2.5-7B (H 3584, I 18944, nh 28, nkv 4, d 128); 64 decode rows and a 3000-token prefill
REAL_T = [64, 3000]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "no-add"])
@pytest.mark.parametrize("H", [64, 896, 3584, 8192])
@pytest.mark.parametrize("T", REAL_T)
def test_bf16_add_rms_norm_at_real_shapes_is_within_two_ulps_of_torch(T, H, with_residual):
    x = _randn(T, H, dtype=torch.bfloat16, seed=T + H)
    residual = _randn(T, H, dtype=torch.bfloat16, seed=T, scale=8.0) if with_residual else None
    weight = _randn(H, dtype=torch.bfloat16, seed=H, scale=0.2) + 1
    normed, new_residual = rms_norm.add_rms_norm_triton(x, residual, weight, 1e-6)
    want_normed, want_residual = rms_norm.add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(new_residual, want_residual)
    # Only the order of the fp32 sum of squares differs, so the normalised value rounds to bf16 at
    # most 1 ulp apart; the multiply by the weight rounds again, which can make that 2 ulps (seen
    # on the H100 at 3000 x 896 and 3000 x 3584: a few elements at 2, none above).
    assert _ulps(normed, want_normed).max() <= 2
    assert (normed == want_normed).float().mean() >= 0.99
    assert os.environ.get("TRITON_INTERPRET") != "1"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads", [(14, 2, 64), (32, 8, 128), (28, 4, 128)], ids=str)
@pytest.mark.parametrize("T", REAL_T)
def test_bf16_rope_at_real_shapes_is_bitwise_apply_rope(T, heads):
    nh, nkv, D = heads
    q = _randn(T, nh, D, dtype=torch.bfloat16, seed=T)
    k = _randn(T, nkv, D, dtype=torch.bfloat16, seed=T + 1)
    cos, sin = _cos_sin(T, D, torch.bfloat16, seed=T)
    want_q, want_k = rope.apply_rope_qk_ref(q, k, cos, sin)
    rope.apply_rope_qk_triton(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("inner", [4864, 18944])
@pytest.mark.parametrize("T", REAL_T)
def test_bf16_silu_mul_at_real_shapes_is_bitwise_silu_times_up(T, inner):
    gate = _randn(T, inner, dtype=torch.bfloat16, seed=T, scale=4.0)
    up = _randn(T, inner, dtype=torch.bfloat16, seed=T + 1)
    assert torch.equal(swiglu.silu_mul_triton(gate, up), swiglu.silu_mul_ref(gate, up))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_bf16_native_transformer_gives_the_same_hidden_states_with_fused_ops_on_and_off(
    monkeypatch,
):
    config = ModelConfig(  # Qwen3-like: GQA (rep 4), q/k norm, 2 layers
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        qk_norm=True,
        tie_word_embeddings=True,
    )
    model = random_model(config, torch.bfloat16)
    ids, positions, attend = _packed_inputs(config, lengths=(64, 1, 37), start=(0, 0, 1000))
    with torch.no_grad():
        assert transformer.use_fused_ops(model.model.embed_tokens.weight, asked=True)
        fused = model(ids, positions, attend, fused_ops=True)  # (T, H)
        plain = model(ids, positions, attend)
        exact = random_model(config, torch.float32)(ids, positions, attend)
    # One ulp of RMSNorm (its sum order is the kernel's only freedom) spreads through the next
    # matmuls like any other bf16 rounding, so fused and plain differ by about bf16's own error
    # (measured in fp16 under the interpreter: max 0.6x, mean 0.34x); both must be as accurate.
    own = (plain.double() - exact.double()).abs()  # (T, H) bf16's own error
    fused_error = (fused.double() - exact.double()).abs()
    assert fused_error.max() <= 1.25 * own.max() and fused_error.mean() <= 1.25 * own.mean()
    assert (fused.double() - plain.double()).abs().max() <= own.max()

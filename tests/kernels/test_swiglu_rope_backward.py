"""The differentiable SiLU * up and RoPE of the training forward (`swiglu.silu_mul_train`,
`rope.rope_qk_train`): forwards against the inference kernels and the model's PyTorch ops,
gradients against float64 autograd.

Forwards run the inference kernels' arithmetic, so they are bitwise those kernels, and within the
interpreter's ulps of torch's ops (see the top of test_fused_decoder_ops.py; bitwise on a GPU).
Gradients are held to quack's rule: the kernel's error against torch autograd in float64 (on
.double() copies of the same inputs and incoming gradient), as max abs error over max abs of the
reference, is at most twice that of torch's own autograd on the low-precision inputs. In fp32
both are 5e-8 to 1.2e-7 (a few fp32 roundings), so a floor of 1e-6 keeps a lucky torch from
failing the kernel.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, NEEDS_TRITON, ON_GPU
from test_fused_decoder_ops import DTYPES, INTERPRETER_ULPS, _cos_sin, _randn, _ulps

from fastgrpo.kernels.layers import rope, swiglu

pytestmark = NEEDS_TRITON

FLOOR = {torch.float32: 1e-6, torch.float16: 0.0, torch.bfloat16: 0.0}


def _relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    """max |got - exact| / max |exact|."""
    return ((got.double() - exact).abs().max() / exact.abs().max()).item()


def _truncated_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 toward zero, as the interpreter rounds fp32 (kept in fp32)."""
    return (x.float().view(torch.int32) & -(1 << 16)).view(torch.float32)


def _assert_within_twice_torchs_error(got, torch_got, exact):
    error, torchs = _relative_error(got, exact), _relative_error(torch_got, exact)
    if got.dtype == torch.bfloat16 and not ON_GPU:
        # The interpreter rounds to bf16 toward zero, up to a whole ulp where a GPU (and torch on
        # the CPU) rounds to nearest, half of one: there SiLU's backward, rounding once, measured
        # up to 3.3x torch's error, and 17x at T=1, where torch's 40 values happened to round
        # well. So there the allowance is the larger of torch's error and that of rounding the
        # exact gradient as the interpreter does (the kernel measured at most 1.0x of that).
        torchs = max(torchs, _relative_error(_truncated_to_bf16(exact), exact))
    assert error <= 2 * torchs + FLOOR[got.dtype], f"kernel {error:.3g}, torch {torchs:.3g}"


# ----------------------------------------------------------------------------- SiLU * up


def _gate_up(T: int, inner: int, dtype, seed: int) -> torch.Tensor:
    """(T, 2I) [gate | up] with gate over silu's curve and both tails."""
    gate = _randn(T, inner, dtype=dtype, seed=seed, scale=4.0)
    return torch.cat([gate, _randn(T, inner, dtype=dtype, seed=seed + 1)], dim=1)


def _torch_silu_mul(gate_up: torch.Tensor, inner: int) -> torch.Tensor:
    gate, up = gate_up.split(inner, dim=-1)
    return swiglu.silu_mul_ref(gate, up)


def _silu_mul_and_grad(op, gate_up, d_out, inner):
    """(out (T, I), d_gate_up (T, 2I)) of op on a fresh leaf copy of gate_up."""
    gate_up = gate_up.detach().clone().requires_grad_()
    out = op(gate_up, inner)
    out.backward(d_out)
    return out.detach(), gate_up.grad


def _check_silu_mul_gradient(T: int, inner: int, dtype, seed: int):
    gate_up, d_out = _gate_up(T, inner, dtype, seed), _randn(T, inner, dtype=dtype, seed=seed + 2)
    out, grad = _silu_mul_and_grad(swiglu.silu_mul_train, gate_up, d_out, inner)
    _, torch_grad = _silu_mul_and_grad(_torch_silu_mul, gate_up, d_out, inner)
    _, exact = _silu_mul_and_grad(_torch_silu_mul, gate_up.double(), d_out.double(), inner)
    assert grad.dtype == dtype and grad.shape == (T, 2 * inner)
    _assert_within_twice_torchs_error(grad, torch_grad, exact)
    return out, gate_up


SILU_SHAPES = [(1, 40), (7, 136), (33, 40)]  # (T, I)


@pytest.mark.parametrize("shape", SILU_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_train_forward_is_the_inference_kernel_on_the_packed_halves(dtype, shape):
    T, inner = shape
    gate_up = _gate_up(T, inner, dtype, seed=T + inner).requires_grad_()
    out = swiglu.silu_mul_train(gate_up, inner)
    assert type(out.grad_fn).__name__ == "_SiluMulTrainBackward"  # the kernel, not the fallback
    assert out.shape == (T, inner) and out.is_contiguous()
    gate, up = gate_up.detach().split(inner, dim=-1)
    assert torch.equal(out.detach(), swiglu.silu_mul_triton(gate, up))
    assert _ulps(out.detach(), swiglu.silu_mul_ref(gate, up)).max() <= INTERPRETER_ULPS[dtype]


@pytest.mark.parametrize("shape", SILU_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_train_gradient_is_within_twice_torchs_error(dtype, shape):
    _check_silu_mul_gradient(*shape, dtype, seed=10 * shape[0] + shape[1])


def test_silu_mul_train_takes_zero_and_one_rows():
    _check_silu_mul_gradient(1, 136, torch.bfloat16, seed=1)
    gate_up = torch.empty(0, 2 * 40, device=DEVICE, requires_grad=True)
    out = swiglu.silu_mul_train(gate_up, 40)
    out.sum().backward()
    assert out.shape == (0, 40) and gate_up.grad.shape == (0, 80)


def test_silu_mul_train_rejects_a_gate_up_of_the_wrong_width():
    with pytest.raises(ValueError, match="2 \\* inner"):
        swiglu.silu_mul_train(torch.zeros(3, 10), 4)


# ----------------------------------------------------------------------------- RoPE

# (T, nh, nkv, D): T = 1, 7 and 33; GQA rep 3 and plain MHA; head dims 16 and 64
ROPE_SHAPES = {
    "T1-nh6-nkv2-d16": (1, 6, 2, 16),
    "T7-nh4-nkv4-d64": (7, 4, 4, 64),
    "T33-nh6-nkv2-d64": (33, 6, 2, 64),
    "T33-nh4-nkv4-d16": (33, 4, 4, 16),
}


def _split_qkv(qkv: torch.Tensor, nh: int, nkv: int, D: int):
    """q (T, nh, D) and k (T, nkv, D): strided views of a packed (T, (nh + 2 nkv) D) projection,
    as the model splits it."""
    T = qkv.shape[0]
    q, k, _ = qkv.split([nh * D, nkv * D, nkv * D], dim=-1)
    return q.view(T, nh, D), k.view(T, nkv, D)


def _rope_and_grad(op, qkv, heads, cos, sin, d_q_rot, d_k_rot):
    """(q_rot, k_rot, d_qkv) of op on q and k of a fresh leaf copy of the packed qkv."""
    qkv = qkv.detach().clone().requires_grad_()
    q_rot, k_rot = op(*_split_qkv(qkv, *heads), cos, sin)
    torch.autograd.backward((q_rot, k_rot), (d_q_rot, d_k_rot))
    return q_rot.detach(), k_rot.detach(), qkv.grad


def _rope_inputs(T: int, nh: int, nkv: int, D: int, dtype, seed: int):
    """(packed qkv (T, (nh + 2 nkv) D), cos, sin (T, D), d_q_rot (T, nh, D), d_k_rot)."""
    qkv = _randn(T, (nh + 2 * nkv) * D, dtype=dtype, seed=seed)
    cos, sin = _cos_sin(T, D, dtype, seed=seed)
    d_q_rot = _randn(T, nh, D, dtype=dtype, seed=seed + 1)
    return qkv, cos, sin, d_q_rot, _randn(T, nkv, D, dtype=dtype, seed=seed + 2)


def _check_rope_gradient(T: int, nh: int, nkv: int, D: int, dtype, seed: int):
    qkv, cos, sin, d_q_rot, d_k_rot = _rope_inputs(T, nh, nkv, D, dtype, seed)
    args = ((nh, nkv, D), cos, sin, d_q_rot, d_k_rot)
    *_, grad = _rope_and_grad(rope.rope_qk_train, qkv, *args)
    *_, torch_grad = _rope_and_grad(rope.apply_rope_qk_ref, qkv, *args)
    double_args = [x.double() if torch.is_tensor(x) else x for x in args]
    *_, exact = _rope_and_grad(rope.apply_rope_qk_ref, qkv.double(), *double_args)
    assert grad.dtype == dtype
    _assert_within_twice_torchs_error(grad, torch_grad, exact)


@pytest.mark.parametrize("shape", ROPE_SHAPES.values(), ids=ROPE_SHAPES.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_qk_train_forward_is_the_in_place_kernel_into_new_tensors(dtype, shape):
    T, nh, nkv, D = shape
    qkv, cos, sin, _, _ = _rope_inputs(T, nh, nkv, D, dtype, seed=T + D)
    before = qkv.clone()
    q, k = _split_qkv(qkv.requires_grad_(), nh, nkv, D)
    q_rot, k_rot = rope.rope_qk_train(q, k, cos, sin)
    assert type(q_rot.grad_fn).__name__ == "_RopeQKTrainBackward"
    assert q_rot.is_contiguous() and k_rot.is_contiguous()
    assert torch.equal(qkv.detach(), before)  # the packed projection is read, not written
    want_q, want_k = q.detach().clone(), k.detach().clone()
    rope.apply_rope_qk_triton(want_q, want_k, cos, sin)
    assert torch.equal(q_rot.detach(), want_q) and torch.equal(k_rot.detach(), want_k)
    torch_q, torch_k = rope.apply_rope_qk_ref(q.detach(), k.detach(), cos, sin)
    if dtype == torch.bfloat16 and not ON_GPU:
        # the interpreter truncates to bf16 (see test_fused_decoder_ops.py): 3 ulps of the inputs
        size = before.abs().max()
        bound = 3 * (torch.nextafter(size, size.new_tensor(float("inf"))) - size).double()
        assert (q_rot.double() - torch_q.double()).abs().max() <= bound
        assert (k_rot.double() - torch_k.double()).abs().max() <= bound
    else:
        assert torch.equal(q_rot.detach(), torch_q) and torch.equal(k_rot.detach(), torch_k)


@pytest.mark.parametrize("shape", ROPE_SHAPES.values(), ids=ROPE_SHAPES.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_qk_train_gradient_of_a_packed_qkv_is_within_twice_torchs_error(dtype, shape):
    _check_rope_gradient(*shape, dtype, seed=sum(shape))


def test_rope_backward_is_the_transpose_of_the_rotation_for_any_table():
    # tables whose two halves differ (not RoPE's angles): the transpose, not just RoPE by -sin
    T, nh, nkv, D = 7, 6, 2, 16
    qkv, _, _, d_q_rot, d_k_rot = _rope_inputs(T, nh, nkv, D, torch.float32, seed=4)
    cos, sin = _randn(T, D, dtype=torch.float32, seed=5), _randn(T, D, dtype=torch.float32, seed=6)
    args = ((nh, nkv, D), cos, sin, d_q_rot, d_k_rot)
    *_, grad = _rope_and_grad(rope.rope_qk_train, qkv, *args)
    double_args = [x.double() if torch.is_tensor(x) else x for x in args]
    *_, exact = _rope_and_grad(rope.apply_rope_qk_ref, qkv.double(), *double_args)
    assert _relative_error(grad, exact) <= FLOOR[torch.float32]


def test_rope_qk_train_leaves_k_without_gradient_when_only_q_rot_is_used():
    T, nh, nkv, D = 7, 6, 2, 16
    qkv, cos, sin, _, _ = _rope_inputs(T, nh, nkv, D, torch.float16, seed=7)
    d_q_rot = _randn(nh, T, D, dtype=torch.float16, seed=8).transpose(0, 1)  # (T, nh, D) strided

    def q_grad(op, qkv, cos, sin, d_q_rot):
        q, k = (x.detach().clone().requires_grad_() for x in _split_qkv(qkv, nh, nkv, D))
        torch.autograd.backward(op(q, k, cos, sin)[0], d_q_rot)
        assert k.grad is None
        return q.grad

    grad = q_grad(rope.rope_qk_train, qkv, cos, sin, d_q_rot)
    torch_grad = q_grad(rope.apply_rope_qk_ref, qkv, cos, sin, d_q_rot)
    exact = q_grad(rope.apply_rope_qk_ref, *(x.double() for x in (qkv, cos, sin, d_q_rot)))
    _assert_within_twice_torchs_error(grad, torch_grad, exact)


def test_rope_qk_train_takes_an_expanded_gradient_and_zero_tokens():
    T, nh, nkv, D = 7, 4, 4, 16
    qkv, cos, sin, _, _ = _rope_inputs(T, nh, nkv, D, torch.float32, seed=9)
    q, k = (t.detach().clone().requires_grad_() for t in _split_qkv(qkv, nh, nkv, D))
    q_rot, k_rot = rope.rope_qk_train(q, k, cos, sin)
    (q_rot.sum() + k_rot.sum()).backward()  # gradients of stride 0
    ones = torch.ones_like(q_rot)
    want_q, want_k = rope.apply_rope_qk_ref(ones, ones, cos, -sin)  # RoPE's angles: by -sin
    assert (q.grad - want_q).abs().max() <= 1e-6 and (k.grad - want_k).abs().max() <= 1e-6
    empty_q, empty_k = q[:0].detach().requires_grad_(), k[:0].detach().requires_grad_()
    q_rot, k_rot = rope.rope_qk_train(empty_q, empty_k, cos[:0], sin[:0])
    (q_rot.sum() + k_rot.sum()).backward()
    assert q_rot.shape == (0, nh, D) and empty_k.grad.shape == (0, nkv, D)


# ----------------------------------------------------------------------------- both


def test_no_grad_forwards_are_the_grad_forwards():
    gate_up = _gate_up(7, 40, torch.bfloat16, seed=11).requires_grad_()
    qkv, cos, sin, _, _ = _rope_inputs(7, 6, 2, 16, torch.bfloat16, seed=12)
    q, k = _split_qkv(qkv.requires_grad_(), 6, 2, 16)
    out, rotated = swiglu.silu_mul_train(gate_up, 40), rope.rope_qk_train(q, k, cos, sin)
    with torch.no_grad():
        out_no_grad = swiglu.silu_mul_train(gate_up, 40)
        rotated_no_grad = rope.rope_qk_train(q, k, cos, sin)
    assert out_no_grad.grad_fn is None and torch.equal(out_no_grad, out.detach())
    for got, want in zip(rotated_no_grad, rotated):
        assert got.grad_fn is None and torch.equal(got, want.detach())


def test_train_ops_keep_dtypes_the_kernels_lack_on_torch_autograd():
    gate_up = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    out = swiglu.silu_mul_train(gate_up, 4)
    assert torch.equal(out, _torch_silu_mul(gate_up, 4))
    assert type(out.grad_fn).__name__ != "_SiluMulTrainBackward"
    q, k = torch.randn(3, 2, 8, dtype=torch.float64), torch.randn(3, 1, 8, dtype=torch.float64)
    cos, sin = torch.randn(2, 3, 8, dtype=torch.float64)
    q_rot, k_rot = rope.rope_qk_train(q.requires_grad_(), k, cos, sin)
    want_q, want_k = rope.apply_rope_qk_ref(q, k, cos, sin)
    assert torch.equal(q_rot, want_q) and torch.equal(k_rot, want_k)
    assert type(q_rot.grad_fn).__name__ != "_RopeQKTrainBackward"


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("inner", [4864, 18944])
def test_bf16_silu_mul_train_at_real_shapes_is_bitwise_forward_within_twice_torchs_grad(inner):
    out, gate_up = _check_silu_mul_gradient(4096, inner, torch.bfloat16, seed=inner)
    assert torch.equal(out, _torch_silu_mul(gate_up, inner))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads", [(14, 2, 64), (28, 4, 128)], ids=str)
def test_bf16_rope_qk_train_at_real_shapes_is_bitwise_forward_within_twice_torchs_grad(heads):
    T, (nh, nkv, D) = 4096, heads
    _check_rope_gradient(T, nh, nkv, D, torch.bfloat16, seed=D)
    qkv, cos, sin, _, _ = _rope_inputs(T, nh, nkv, D, torch.bfloat16, seed=D)
    q, k = _split_qkv(qkv, nh, nkv, D)
    for got, want in zip(
        rope.rope_qk_train(q, k, cos, sin), rope.apply_rope_qk_ref(q, k, cos, sin)
    ):
        assert torch.equal(got, want)


# ----------------------------------------------------------------------------- SiLU * up + down_proj


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("frozen_weight", [False, True])
@pytest.mark.parametrize("T", [1, 9])
def test_silu_mul_linear_train_recomputes_its_input_and_gives_the_same_gradients(
    T, frozen_weight, bias
):
    """The down projection over silu(gate) * up, keeping only gate_up for the backward: outputs
    and gradients as `silu_mul_train` followed by `F.linear` under autograd (fp32)."""
    inner, out_features = 40, 24
    gate_up = _randn(T, 2 * inner, dtype=torch.float32, seed=T)
    weight = _randn(out_features, inner, dtype=torch.float32, seed=T + 1, scale=0.2)
    b = _randn(out_features, dtype=torch.float32, seed=T + 2) if bias else None
    d_out = _randn(T, out_features, dtype=torch.float32, seed=T + 3)

    def run(fused):
        x = gate_up.clone().requires_grad_()
        w = weight.clone().requires_grad_(not frozen_weight)
        bb = None if b is None else b.clone().requires_grad_()
        if fused:
            out = swiglu.silu_mul_linear_train(x, inner, w, bb)
        else:
            out = torch.nn.functional.linear(swiglu.silu_mul_train(x, inner), w, bb)
        out.backward(d_out)
        return out.detach(), x.grad, w.grad, None if bb is None else bb.grad

    got, want = run(True), run(False)
    assert (got[2] is None) == frozen_weight
    for a, b_ in zip(got, want, strict=True):
        if b_ is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b_, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(swiglu.silu_mul_linear_train(gate_up, inner, weight, b), got[0])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_bf16_silu_mul_linear_train_at_a_real_shape_matches_the_two_step_path():
    T, inner, H = 4096, 4864, 896
    gate_up = _randn(T, 2 * inner, dtype=torch.bfloat16, seed=1)
    weight = _randn(H, inner, dtype=torch.bfloat16, seed=2, scale=0.02)
    d_out = _randn(T, H, dtype=torch.bfloat16, seed=3)

    def run(fused):
        x, w = gate_up.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            out = swiglu.silu_mul_linear_train(x, inner, w)
        else:
            out = torch.nn.functional.linear(swiglu.silu_mul_train(x, inner), w)
        out.backward(d_out)
        return out.detach(), x.grad, w.grad

    for name, a, b in zip(("out", "d_gate_up", "d_weight"), run(True), run(False)):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2, msg=name)


@pytest.mark.parametrize("shape", SILU_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_backward_also_gives_the_forwards_activation_bitwise(dtype, shape):
    """`with_act`: the backward kernel recomputes silu(gate) * up for the down projection's weight
    gradient; it must be the forward kernel's value to the bit, and [d_gate | d_up] must not
    change."""
    T, inner = shape
    gate_up = _gate_up(T, inner, dtype, seed=3 * T + inner)
    d_out = _randn(T, inner, dtype=dtype, seed=T + 5)
    d_gate_up, act = swiglu.silu_mul_backward_triton(gate_up, d_out, inner, with_act=True)
    assert torch.equal(act, swiglu.silu_mul_triton(*gate_up.split(inner, dim=-1)))
    assert torch.equal(d_gate_up, swiglu.silu_mul_backward_triton(gate_up, d_out, inner))
    _, torch_grad = _silu_mul_and_grad(_torch_silu_mul, gate_up, d_out, inner)
    _, exact = _silu_mul_and_grad(_torch_silu_mul, gate_up.double(), d_out.double(), inner)
    _assert_within_twice_torchs_error(d_gate_up, torch_grad, exact)

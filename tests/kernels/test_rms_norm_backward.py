"""`add_rms_norm_train`, the differentiable residual add + RMSNorm of the training forward, against
autograd of the model's own PyTorch arithmetic (`add_rms_norm_ref`) in float64.

The rule (as in quack and flash-attention): each gradient's error against the float64 reference
(max abs error over the reference's max abs) is at most twice the error of plain torch autograd on
the same low-precision inputs, plus 4 fp32 eps so that fp32 errors of an ulp or two pass.

On a CPU the kernels run in Triton's interpreter, which rounds fp32 -> bf16 by truncation (see
test_fused_decoder_ops.py): the gradient's one rounding, and that of the normalised row which
d weight multiplies (the forward kernel truncates it too), can be off by a whole bf16 ulp where a
GPU is off by half of one. With a few rows the max error is that of a few elements, so the ratio
to torch's is noisy (up to 5x seen); bf16 under the interpreter gets one bf16 ulp of the largest
gradient (2^-7 of it) on top of the 2x (the excess measured: at most 0.76 of that over 12 seeds of
these shapes). The kernels' arithmetic rounded to nearest, as a GPU rounds, is held to 2x in bf16
on the CPU by `test_the_closed_form_in_fp32_is_within_twice_torch_error`, and the kernels
themselves by the GPU test.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, NEEDS_TRITON, ON_GPU

from fastgrpo.kernels.layers import rms_norm

pytestmark = NEEDS_TRITON

EPS = 1e-6
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 24), (7, 40), (33, 136)]  # (T, H): H not a power of two, T not a multiple of a tile
FLOOR = 4 * torch.finfo(torch.float32).eps


def _allowed(dtype, plain_err: float) -> float:
    """The largest error allowed a kernel gradient whose plain torch counterpart has plain_err."""
    truncation = 2**-7 if dtype == torch.bfloat16 and not ON_GPU else 0.0
    return 2 * plain_err + FLOOR + truncation


def _other_dtype(dtype):
    """A weight dtype unlike x's: fp32 for 16-bit x, bf16 for fp32 x."""
    return torch.bfloat16 if dtype == torch.float32 else torch.float32


def _inputs(T, H, dtype, weight_dtype, with_residual, seed):
    """(x, residual | None, weight) leaves that require grad and the two output gradients
    (d_normed in promote(weight, x) dtype, d_new_residual in x's dtype), on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    residual = 3 * torch.randn(T, H, generator=gen)  # the stream is larger than what is added
    weight = 1 + 0.2 * torch.randn(H, generator=gen)
    d_normed = torch.randn(T, H, generator=gen)
    d_new_residual = torch.randn(T, H, generator=gen)
    out_dtype = torch.promote_types(weight_dtype, dtype)
    leaf = lambda t, dt: t.to(dt).to(DEVICE).requires_grad_()  # noqa: E731
    return (
        leaf(x, dtype),
        leaf(residual, dtype) if with_residual else None,
        leaf(weight, weight_dtype),
        d_normed.to(out_dtype).to(DEVICE),
        d_new_residual.to(dtype).to(DEVICE),
    )


def _grads(fn, x, residual, weight, d_normed, d_new_residual):
    """(outputs, {name: gradient}) of fn(x, residual, weight, EPS) for the output gradients that
    are not None; inputs are first copied to leaves of their own (so fp64 copies may be passed)."""
    leaves = {"x": x, "residual": residual, "weight": weight}
    leaves = {
        k: v.detach().clone().requires_grad_(v.requires_grad)
        for k, v in leaves.items()
        if v is not None
    }
    outputs = fn(leaves["x"], leaves.get("residual"), leaves["weight"], EPS)
    pairs = [(o, d) for o, d in zip(outputs, (d_normed, d_new_residual)) if d is not None]
    wanted = {k: v for k, v in leaves.items() if v.requires_grad}
    grads = torch.autograd.grad(
        [o for o, _ in pairs],
        list(wanted.values()),
        [d.to(o.dtype) for o, d in pairs],
        allow_unused=True,
    )
    return outputs, dict(zip(wanted, grads))


def _double(t):
    return None if t is None else t.detach().double().requires_grad_(t.requires_grad)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _assert_within_twice_torch_error(x, residual, weight, d_normed, d_new_residual):
    """The kernel's gradients against the fp64 reference, within 2x of torch autograd's own
    low-precision error (see the top of the file)."""
    args = (x, residual, weight, d_normed, d_new_residual)
    _, got = _grads(rms_norm.add_rms_norm_train, *args)
    _, plain = _grads(rms_norm.add_rms_norm_ref, *args)
    _, want = _grads(rms_norm.add_rms_norm_ref, *map(_double, args))
    assert got.keys() == want.keys()
    for name in want:
        if want[name] is None:  # the weight, when only new_residual is used
            assert got[name] is None
            continue
        assert got[name].dtype == plain[name].dtype and got[name].shape == want[name].shape
        err, plain_err = _rel_err(got[name], want[name]), _rel_err(plain[name], want[name])
        assert err <= _allowed(x.dtype, plain_err), (name, err, plain_err)
    return got


# ----------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "no-add"])
def test_backward_reference_is_autograd_of_the_forward_reference(with_residual):
    x, residual, weight, d_normed, d_new_residual = map(
        _double, _inputs(5, 24, torch.float32, torch.float32, with_residual, seed=1)
    )
    (_, new_residual), want = _grads(
        rms_norm.add_rms_norm_ref, x, residual, weight, d_normed, d_new_residual
    )
    g, d_weight = rms_norm.add_rms_norm_backward_ref(
        d_normed, d_new_residual, new_residual.detach(), weight.detach(), EPS
    )
    assert torch.allclose(g, want["x"], rtol=1e-12, atol=1e-12)
    assert torch.allclose(d_weight, want["weight"], rtol=1e-12, atol=1e-12)
    if with_residual:
        assert torch.equal(want["residual"], want["x"])  # new_residual = x + residual


@pytest.mark.parametrize("weight_dtype", ["same", "other"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_closed_form_in_fp32_is_within_twice_torch_error(dtype, weight_dtype):
    """What the backward kernel computes on a GPU: fp32 throughout, one rounding to nearest."""
    weight_dtype = dtype if weight_dtype == "same" else _other_dtype(dtype)
    x, residual, weight, d_normed, d_new_residual = _inputs(
        33, 136, dtype, weight_dtype, True, seed=2
    )
    args = (x, residual, weight, d_normed, d_new_residual)
    (_, new_residual), plain = _grads(rms_norm.add_rms_norm_ref, *args)
    _, want = _grads(rms_norm.add_rms_norm_ref, *map(_double, args))
    g, d_weight = rms_norm.add_rms_norm_backward_ref(
        d_normed, d_new_residual, new_residual.detach(), weight.detach(), EPS
    )
    for got, name in [(g, "x"), (d_weight, "weight")]:
        assert _rel_err(got, want[name]) <= 2 * _rel_err(plain[name], want[name])


# ----------------------------------------------------------------------------- the kernels


@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "no-add"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("weight_dtype", ["same", "other"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_train_forward_is_the_no_grad_kernel_and_its_gradients_are_within_twice_torch_error(
    dtype, weight_dtype, shape, with_residual
):
    T, H = shape
    weight_dtype = dtype if weight_dtype == "same" else _other_dtype(dtype)
    x, residual, weight, d_normed, d_new_residual = _inputs(
        T, H, dtype, weight_dtype, with_residual, seed=T * 1000 + H
    )
    normed, new_residual = rms_norm.add_rms_norm_train(x, residual, weight, EPS)
    assert normed.requires_grad and new_residual.requires_grad
    want_normed, want_residual = rms_norm.add_rms_norm_triton(
        x.detach(), None if residual is None else residual.detach(), weight.detach(), EPS
    )
    assert torch.equal(normed, want_normed) and torch.equal(new_residual, want_residual)
    if ON_GPU:  # on a GPU that is the model's no-grad path
        assert torch.equal(normed, rms_norm.add_rms_norm(x, residual, weight, EPS)[0])
    _assert_within_twice_torch_error(x, residual, weight, d_normed, d_new_residual)


@pytest.mark.parametrize("used", ["normed", "new_residual"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "no-add"])
def test_an_unused_output_needs_no_gradient(used, with_residual):
    x, residual, weight, d_normed, d_new_residual = _inputs(
        7, 40, torch.float16, torch.float16, with_residual, seed=3
    )
    if used == "normed":
        d_new_residual = None
    else:
        d_normed = None
    got = _assert_within_twice_torch_error(x, residual, weight, d_normed, d_new_residual)
    if used == "new_residual":  # new_residual = x + residual passes its gradient to both
        assert got["weight"] is None
        assert torch.equal(got["x"], d_new_residual)
        assert residual is None or torch.equal(got["residual"], d_new_residual)


def test_a_summed_output_whose_gradient_is_expanded_gets_the_same_gradients():
    x, residual, weight, _, _ = _inputs(7, 40, torch.float32, torch.float32, True, seed=4)
    normed, new_residual = rms_norm.add_rms_norm_train(x, residual, weight, EPS)
    (normed.sum() + 2 * new_residual.sum()).backward()  # gradients (7, 40) of stride 0
    ones = torch.ones(7, 40, device=DEVICE)
    _, want = _grads(rms_norm.add_rms_norm_train, x, residual, weight, ones, 2 * ones)
    assert torch.equal(x.grad, want["x"]) and torch.equal(residual.grad, want["residual"])
    assert torch.equal(weight.grad, want["weight"])


def test_frozen_weight_gets_no_gradient_and_the_kernel_skips_it(monkeypatch):
    x, residual, weight, d_normed, d_new_residual = _inputs(
        33, 40, torch.bfloat16, torch.bfloat16, True, seed=5
    )
    _, with_weight = _grads(
        rms_norm.add_rms_norm_train, x, residual, weight, d_normed, d_new_residual
    )
    asked = []
    backward = rms_norm._add_rms_norm_backward

    def spy(*args):
        asked.append(args[5:7])  # (need_g, need_d_weight)
        return backward(*args)

    monkeypatch.setattr(rms_norm, "_add_rms_norm_backward", spy)
    frozen = weight.detach()
    _, got = _grads(rms_norm.add_rms_norm_train, x, residual, frozen, d_normed, d_new_residual)
    assert asked == [(True, False)] and got.keys() == {"x", "residual"}
    assert torch.equal(got["x"], with_weight["x"]) and torch.equal(
        got["residual"], with_weight["residual"]
    )
    _, only_weight = _grads(
        rms_norm.add_rms_norm_train, x.detach(), residual.detach(), weight, d_normed, d_new_residual
    )
    assert asked[1] == (False, True) and torch.equal(only_weight["weight"], with_weight["weight"])


@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "no-add"])
def test_no_grad_gives_the_same_outputs_as_the_grad_forward(with_residual):
    x, residual, weight, _, _ = _inputs(7, 40, torch.bfloat16, torch.float32, with_residual, seed=6)
    normed, new_residual = rms_norm.add_rms_norm_train(x, residual, weight, EPS)
    with torch.no_grad():
        normed_ng, new_residual_ng = rms_norm.add_rms_norm_train(x, residual, weight, EPS)
    assert not normed_ng.requires_grad
    assert torch.equal(normed_ng, normed) and torch.equal(new_residual_ng, new_residual)
    if residual is None:
        assert new_residual_ng is x and new_residual.data_ptr() == x.data_ptr()


def test_any_partition_of_the_rows_gives_the_same_gradients():
    """Programs of 1, 2 and 3 tiles (16 rows each at H=40): the last program's tile is partial,
    and with 2 and 3 tiles programs loop; g bitwise, d weight to fp32 summation order."""
    x, residual, weight, d_normed, d_new_residual = _inputs(
        33, 40, torch.float32, torch.float32, True, seed=7
    )
    new_residual = (residual + x).detach()
    rstd = torch.rsqrt(new_residual.pow(2).mean(-1) + EPS)  # (T,)
    want_g, want_dw = rms_norm.add_rms_norm_backward_ref(
        d_normed, d_new_residual, new_residual, weight.detach(), EPS
    )
    results = [
        rms_norm._add_rms_norm_backward(
            d_normed, d_new_residual, new_residual, rstd, weight.detach(), True, True, tiles
        )
        for tiles in (1, 2, 3)
    ]
    for g, d_weight in results:
        assert torch.equal(g, results[0][0])
        assert torch.allclose(g, want_g, rtol=1e-5, atol=1e-6)
        assert torch.allclose(d_weight, want_dw, rtol=1e-5, atol=1e-5)


def test_zero_rows_give_empty_gradients_and_a_zero_weight_gradient():
    x, residual, weight, d_normed, d_new_residual = _inputs(
        0, 24, torch.float16, torch.float32, True, seed=8
    )
    (normed, new_residual), got = _grads(
        rms_norm.add_rms_norm_train, x, residual, weight, d_normed, d_new_residual
    )
    assert normed.shape == new_residual.shape == (0, 24)
    assert got["x"].shape == (0, 24) and torch.equal(got["weight"], torch.zeros_like(weight))


def test_bad_inputs_are_refused_with_value_errors():
    x = torch.randn(4, 8, device=DEVICE)
    weight = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match=r"x must be \(T, H\)"):
        rms_norm.add_rms_norm_train(x.view(2, 2, 8), None, weight, EPS)
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm.add_rms_norm_train(x, x[:3], weight, EPS)
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm.add_rms_norm_train(x, x.half(), weight, EPS)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm.add_rms_norm_train(x, None, torch.ones(9, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="floating point"):
        rms_norm.add_rms_norm_train(x.long(), None, weight, EPS)


def test_cpu_tensors_without_the_interpreter_use_the_reference_by_autograd(monkeypatch):
    monkeypatch.setattr(rms_norm, "interpreting", lambda: False)
    gen = torch.Generator().manual_seed(9)
    x, residual, d_normed, d_new_residual = (torch.randn(5, 12, generator=gen) for _ in range(4))
    weight = 1 + 0.2 * torch.randn(12, generator=gen)
    args = (x.requires_grad_(), residual.requires_grad_(), weight.requires_grad_())
    args += (d_normed, d_new_residual)
    got_out, got = _grads(rms_norm.add_rms_norm_train, *args)
    want_out, want = _grads(rms_norm.add_rms_norm_ref, *args)
    assert all(torch.equal(a, b) for a, b in zip(got_out, want_out))
    assert all(torch.equal(got[k], want[k]) for k in want)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "no-add"])
@pytest.mark.parametrize("shape", [(4096, 896), (4096, 3584)], ids=str)
def test_bf16_gradients_at_real_shapes_are_within_twice_torch_error(
    shape, with_residual, weight_dtype
):
    T, H = shape
    x, residual, weight, d_normed, d_new_residual = _inputs(
        T, H, torch.bfloat16, weight_dtype, with_residual, seed=T + H
    )
    normed, new_residual = rms_norm.add_rms_norm_train(x, residual, weight, EPS)
    with torch.no_grad():
        want_normed, want_residual = rms_norm.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(normed, want_normed) and torch.equal(new_residual, want_residual)
    _assert_within_twice_torch_error(x, residual, weight, d_normed, d_new_residual)

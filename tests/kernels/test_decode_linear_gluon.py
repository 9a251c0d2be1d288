"""The Gluon gate/up kernel of the decode step (Hopper) against the Triton kernel, bit for bit, and
against the float32 reference; where it does not apply, the Triton kernel serves."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import UncompilableKernel

from fastgrpo.kernels.decode import decode_linear
from fastgrpo.kernels.decode import decode_linear_gluon as gluon_gate_up

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _inputs(m, k, n_out, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(2 * n_out, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    return x, weight


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (sm_90)")
@pytest.mark.parametrize(
    "m, k, n_out",
    [(64, 896, 4864), (37, 896, 4864), (1, 896, 4864), (5, 64, 24), (17, 1000, 300), (64, 1024, 8)],
)
@pytest.mark.parametrize("exact", [True, False])
def test_gluon_gate_up_matches_the_triton_kernel(m, k, n_out, exact, monkeypatch):
    """With the exact epilogue bit for bit; with the approximate exp and division at most a rare
    1-ulp bf16 difference. Both within the bf16 path's error of the fp32 reference."""
    monkeypatch.setattr(gluon_gate_up, "EXACT_EPILOGUE", exact)
    x, weight = _inputs(m, k, n_out, seed=m + k + n_out)
    assert gluon_gate_up.applies(x, weight, None)
    out = torch.full((m, n_out), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert gluon_gate_up.launch(x, weight, out)
    want = decode_linear.linear_triton(x, weight, None, swiglu=True)
    if exact:
        assert torch.equal(out, want)
    else:
        differ = out != want
        assert differ.float().mean() <= 1e-3
        ulp = want.float().abs() * 2.0**-7 + 1e-30  # one bf16 ulp bounds it from above
        assert ((out.float() - want.float()).abs() <= ulp)[differ].all()
    ref = decode_linear.linear_ref(x.float(), weight.float(), None, swiglu=True)
    bf16_path = decode_linear.linear_ref(x, weight, None, swiglu=True).float()
    # the kernels round gate, up, silu and the product to bf16 as the model's bf16 ops do
    assert (out.float() - ref).abs().max() <= 2 * (bf16_path - ref).abs().max() + 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (sm_90)")
def test_decode_linear_sends_gate_up_to_the_gluon_kernel_and_the_rest_to_triton(monkeypatch):
    x, weight = _inputs(64, 896, 4864, seed=3)
    launches = []
    real = gluon_gate_up.launch
    monkeypatch.setattr(gluon_gate_up, "launch", lambda *a: launches.append(1) or real(*a))
    out = decode_linear.linear(x, weight, None, swiglu=True)
    assert launches == [1]
    want = decode_linear.linear_triton(x, weight, None, swiglu=True)
    assert (out != want).float().mean() <= 1e-3
    decode_linear.linear(x, weight[:896], None)  # not a gate/up product
    assert launches == [1]


def test_gluon_gate_up_serves_only_hopper_bf16_decode_batches_without_bias():
    cpu_x = torch.zeros(4, 896, dtype=torch.bfloat16)
    cpu_w = torch.zeros(2 * 48, 896, dtype=torch.bfloat16)
    assert not gluon_gate_up.applies(cpu_x, cpu_w, None)
    if ON_HOPPER:
        x, w = cpu_x.cuda(), cpu_w.cuda()
        assert gluon_gate_up.applies(x, w, None)
        assert not gluon_gate_up.applies(x, w, torch.zeros(96, dtype=torch.bfloat16, device="cuda"))
        assert not gluon_gate_up.applies(x.float(), w, None)
        assert not gluon_gate_up.applies(torch.zeros(65, 896, dtype=torch.bfloat16).cuda(), w, None)
        wide = torch.zeros(2 * 48, 1032, dtype=torch.bfloat16, device="cuda")
        assert not gluon_gate_up.applies(torch.zeros(4, 1032).bfloat16().cuda(), wide, None)
        assert not gluon_gate_up.applies(x, w[:95], None)  # odd rows: not a packed gate/up
        strided = torch.zeros(4, 900, dtype=torch.bfloat16, device="cuda")[:, 1:897]
        assert not gluon_gate_up.applies(strided, w, None)  # rows not 16-byte aligned


@pytest.mark.skipif(gluon_gate_up.gluon is None, reason="needs triton's Gluon")
def test_a_gluon_gate_up_that_does_not_compile_warns_once_and_hands_back(monkeypatch):
    monkeypatch.setattr(gluon_gate_up, "_gate_up_kernel", UncompilableKernel())
    monkeypatch.setattr(gluon_gate_up, "multiprocessors", lambda: 132)
    monkeypatch.setattr(gluon_gate_up, "_failed", False)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    weight = torch.zeros(48, 64, dtype=torch.bfloat16)
    out = torch.empty(4, 24, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="unsupported layout"):
        done = gluon_gate_up.launch(x, weight, out)
    assert done is False and gluon_gate_up._failed
    assert not gluon_gate_up.applies(x, weight, None)  # not tried again

"""The backward GEMM kernels (dW accumulation, split-K dH) against plain PyTorch in float64."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, NEEDS_TRITON, ON_GPU

from fastgrpo.kernels.train import lm_head_backward as bwd

pytestmark = NEEDS_TRITON


def _chunk(c, v, h, n, seed):
    """dz (C, V) in a buffer with 16-byte rows, zero past row n; hidden (C, H); weight (V, H)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    buf = torch.zeros(c, -(-v // 8) * 8)
    buf[:n, :v] = torch.randn(n, v, generator=gen)
    dz = buf.to(dtype).to(DEVICE)[:, :v]
    hidden = torch.randn(c, h, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(v, h, generator=gen).to(dtype).to(DEVICE)
    count = torch.tensor(n, dtype=torch.int32, device=DEVICE)
    return dz, hidden, weight, count


@pytest.mark.parametrize("persistent, reduce", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("c, v, h, n", [(37, 151, 48, 37), (37, 151, 48, 20), (40, 1000, 16, 0)])
def test_dw_accumulates_only_the_leading_rows(c, v, h, n, persistent, reduce, monkeypatch):
    """Each schedule: a program per tile, or one per SM looping over tiles; the add into dW by the
    program or by a bulk reduce (on GPUs, into a bf16 dW as the fused loss keeps it; the
    interpreter has no reduce and adds in the program)."""
    # on the GPU, tiles that fit shared memory beside each schedule's epilogue buffers
    tiles = (
        ((256, 128, 64, 8, 3) if reduce else (128, 128, 64, 8, 3))
        if ON_GPU
        else bwd._dw_blocks(h)[:5]
    )
    monkeypatch.setattr(bwd, "_dw_blocks", lambda *_: (*tiles, persistent, reduce))
    dz, hidden, _, count = _chunk(c, v, h, n, seed=c + n)
    start = torch.randn(v, h, generator=torch.Generator().manual_seed(1))
    start = start.to(torch.bfloat16 if reduce and ON_GPU else torch.float32).to(DEVICE)
    got = bwd.add_dw_(start.clone(), dz, hidden, count)
    want = bwd.add_dw_ref(start.double().cpu(), dz.cpu(), hidden.cpu(), n)
    tol = 3e-2 if ON_GPU else 1e-4  # bf16 inputs (and dW) on the GPU, fp32 under the interpreter
    assert torch.allclose(got.double().cpu(), want, atol=tol, rtol=tol)
    if n == 0:
        assert torch.equal(got, start)  # nothing to add: dW untouched


@pytest.mark.parametrize("c, v, h, n", [(37, 151, 48, 37), (37, 151, 48, 20), (33, 1000, 16, 0)])
def test_dh_split_k_matches_reference_and_is_zero_past_n(c, v, h, n):
    dz, _, weight, count = _chunk(c, v, h, n, seed=c + v + n)
    got = bwd.dh(dz, weight, count)
    want = bwd.dh_ref(dz.cpu(), weight.cpu(), n)
    tol = 1e-2 if ON_GPU else 1e-4
    assert torch.allclose(got.double().cpu(), want.double(), atol=tol, rtol=tol)
    assert (got[n:] == 0).all()
    assert torch.equal(got, bwd.dh(dz, weight, count))  # fixed summation order: deterministic


def test_dh_scales_rows_and_writes_into_a_strided_output():
    c, v, h, n = 37, 151, 48, 30
    dz, _, weight, count = _chunk(c, v, h, n, seed=5)
    scale = torch.randn(c, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    out = torch.full((c, h + 5), 7.0, dtype=weight.dtype, device=DEVICE)  # a padded row stride
    got = bwd.dh(dz, weight, count, row_scale=scale, out=out[:, :h])
    want = bwd.dh_ref(dz.cpu(), weight.cpu(), n).double() * scale.cpu().double()[:, None]
    tol = 3e-2 if ON_GPU else 1e-4
    assert got.data_ptr() == out.data_ptr()
    assert torch.allclose(got.double().cpu(), want, atol=tol, rtol=tol)
    assert (out[:, h:] == 7.0).all()  # the padding is left alone

"""The one-kernel KV-cache write against its reference (two index_copy_ calls)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, NEEDS_TRITON

from fastgrpo.kernels.decode import kv_write

pytestmark = NEEDS_TRITON


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "views-of-packed-qkv"])
@pytest.mark.parametrize(
    "B, Tc, nkv, d, slot", [(1, 1, 1, 16, 0), (5, 7, 2, 8, 6), (3, 4, 3, 10, 2)]
)
def test_kv_write_kernel_writes_exactly_the_slot_the_reference_writes(B, Tc, nkv, d, slot, packed):
    torch.manual_seed(B + Tc)
    comp = [torch.randn(B, Tc, nkv, d, device=DEVICE) for _ in range(2)]
    if packed:  # k and v as the heads of one (B, (nh + 2 nkv) d) projection
        qkv = torch.randn(B, (4 + 2 * nkv) * d, device=DEVICE)
        k = qkv[:, 4 * d : (4 + nkv) * d].view(B, nkv, d)
        v = qkv[:, (4 + nkv) * d :].view(B, nkv, d)
    else:
        k, v = torch.randn(2, B, nkv, d, device=DEVICE)
    step = torch.tensor(slot, device=DEVICE)
    want = [c.clone() for c in comp]
    kv_write.write_kv_ref(*want, k, v, step)
    kv_write.write_kv_triton(*comp, k, v, step)
    assert torch.equal(comp[0], want[0]) and torch.equal(comp[1], want[1])
    assert torch.equal(comp[0][:, slot], k) and torch.equal(comp[1][:, slot], v)


def test_kv_write_refuses_what_it_cannot_read():
    comp = torch.zeros(2, 3, 2, 8, device=DEVICE)
    k = torch.zeros(2, 2, 8, device=DEVICE)
    slot = torch.tensor(0, device=DEVICE)
    with pytest.raises(ValueError, match="expected"):
        kv_write.write_kv_triton(comp, comp, k[:, :1], k, slot)
    strided = torch.zeros(2, 8, 2, device=DEVICE).transpose(1, 2)  # (2, 2, 8), d not unit stride
    with pytest.raises(ValueError, match="must be contiguous"):
        kv_write.write_kv_triton(comp, comp, k, strided, slot)
    with pytest.raises(ValueError, match="one dtype"):
        kv_write.write_kv_triton(comp, comp, k, k.double(), slot)

"""The first layer's per-token inputs in one kernel (`kernels.token_inputs`): embedding rows and
the RoPE table rows of each position, against the torch gathers and casts."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, NEEDS_TRITON

from fastgrpo.kernels.layers.token_inputs import embed_and_angles_ref, embed_and_angles_triton

pytestmark = NEEDS_TRITON


@pytest.mark.parametrize("V,H,D,T", [(37, 50, 12, 9), (5, 4100, 64, 3), (11, 8, 16, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_embedding_rows_and_tables_are_the_gathers(V, H, D, T, dtype):
    gen = torch.Generator().manual_seed(V + H)
    weight = torch.randn(V, H, generator=gen).to(dtype).to(DEVICE)
    cos = torch.randn(40, D, generator=gen).to(DEVICE)  # fp32 tables, as RotaryTable keeps them
    sin = torch.randn(40, D, generator=gen).to(DEVICE)
    ids = torch.randint(0, V, (T,), generator=gen).to(DEVICE)
    positions = torch.randint(0, 40, (T,), generator=gen).to(DEVICE)
    got = embed_and_angles_triton(ids, positions, weight, cos, sin, dtype)
    want = embed_and_angles_ref(ids, positions, weight, cos, sin, dtype)
    for name, g, w in zip(("x", "cos", "sin"), got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), name


def test_position_offset_is_added_to_every_position():
    """A decode step's positions: each row's prompt length plus one () slot, added in the kernel."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(9, 16, generator=gen).to(DEVICE)
    cos, sin = (torch.randn(50, 8, generator=gen).to(DEVICE) for _ in range(2))
    ids = torch.randint(0, 9, (6,), generator=gen).to(DEVICE)
    base = torch.randint(0, 30, (6,), generator=gen).to(DEVICE)
    slot = torch.tensor(13, device=DEVICE)
    got = embed_and_angles_triton(ids, base, weight, cos, sin, torch.float32, slot)
    want = embed_and_angles_ref(ids, base + 13, weight, cos, sin, torch.float32)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(got[1], cos[base + 13])  # the offset moved the rows read
    ref = embed_and_angles_ref(ids, base, weight, cos, sin, torch.float32, slot)
    assert all(torch.equal(r, w) for r, w in zip(ref, want))


def test_token_inputs_launcher_says_what_it_cannot_take():
    ids = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    weight, table = torch.zeros(4, 8, device=DEVICE), torch.zeros(5, 4, device=DEVICE)
    with pytest.raises(ValueError, match="positions"):
        embed_and_angles_triton(ids, ids[:2], weight, table, table, torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        embed_and_angles_triton(ids, ids, weight, table.t(), table.t(), torch.float32)
    with pytest.raises(ValueError, match="one value"):
        embed_and_angles_triton(ids, ids, weight, table, table, torch.float32, ids)

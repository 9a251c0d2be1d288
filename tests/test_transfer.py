"""Host-to-device copies through pinned memory."""

from __future__ import annotations

import pytest
import torch

from fastgrpo.transfer import to_device


def test_to_device_on_the_cpu_is_a_plain_copy():
    x = torch.arange(10)
    y = to_device(x, "cpu")
    assert torch.equal(x, y) and y.device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_to_device_on_a_gpu_copies_exactly_even_when_the_host_tensor_is_dropped_at_once():
    """The copy is queued behind GPU work and the host tensor goes out of scope right away: the
    values must still arrive (the pinned block is kept until the copy has read it)."""
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # keep the stream busy so the copies wait in the queue
        busy = torch.tanh(busy @ busy)
    copies = [to_device(torch.arange(i, i + 100_000), "cuda") for i in range(8)]
    torch.cuda.synchronize()
    for i, y in enumerate(copies):
        assert y.device.type == "cuda" and torch.equal(y.cpu(), torch.arange(i, i + 100_000))

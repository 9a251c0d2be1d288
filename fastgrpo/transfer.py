"""Host-to-device copies that do not make the host wait.

A copy from pageable host memory to a GPU blocks the host until the data has left; from pinned
(page-locked) memory with `non_blocking=True` it is queued on the stream like a kernel, and the
host goes on queueing work. torch's caching host allocator keeps a pinned block alive until the
copies that read it have finished, so the host tensor may be dropped at once.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` (on the host) on `device`: through pinned memory, without blocking, for a CUDA
    device; as `tensor.to(device)` otherwise."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)

"""Data-parallel training across processes started by torchrun: one engine per rank, whole prompt
groups per rank, and the batch-wide quantities reduced so that N ranks give the one-process update
for the same global batch.

Imported only where the world size is above 1 (a torchrun job); single-process code paths take
`world=None` and never touch `torch.distributed`.
"""

from fastgrpo.distributed.world import World, join_torchrun

__all__ = ["World", "join_torchrun"]

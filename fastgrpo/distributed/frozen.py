"""A frozen model (the reference of beta > 0) kept as 1/N shards on each rank between uses, whole
only while it scores.

Replicated, the reference costs 2 bytes a parameter on every GPU for the whole step, so it sits on
the update's memory peak (weights, gradients, activations); a 7B reference is 15 GB. Sharded, each
rank keeps 2/N bytes a parameter, and `whole()` puts the full weights back for the reference
phase only (one all-gather of raw bytes per storage), after which the storages shrink to nothing
again: the reference is off the update's peak.

The parameters stay the same tensors (views of the same storages), so the model and its kernels
need not know: between uses their storages hold 0 bytes and reading them is an error.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from fastgrpo.distributed.sharded import _all_gather


class ShardedFrozen:
    """`model`'s parameter storages, each cut into `world.size` pieces of raw bytes; this rank
    keeps its piece and the storages are emptied until `whole()`."""

    def __init__(self, model: torch.nn.Module, world):
        self.model, self.world = model, world
        storages = {}
        for p in model.parameters():
            storage = p.untyped_storage()
            storages.setdefault(storage.data_ptr(), storage)  # packed and tied weights share one
        with torch.no_grad():
            for key, storage in storages.items():
                if not storage.resizable():  # e.g. memory-mapped from a safetensors file
                    storages[key] = _own_copy(model, storage)
        self.storages = list(storages.values())
        self.sizes = [s.nbytes() for s in self.storages]
        self.pieces = []
        with torch.no_grad():
            for storage, size in zip(self.storages, self.sizes):
                piece = -(-size // world.size)
                raw = self._bytes(storage, size)
                start = min(world.rank * piece, size)
                mine = torch.zeros(piece, dtype=torch.uint8, device=raw.device)
                mine[: max(0, min(piece, size - start))] = raw[start : start + piece]
                self.pieces.append(mine)
        self._release()

    @staticmethod
    def _bytes(storage, size: int) -> torch.Tensor:
        raw = torch.empty(0, dtype=torch.uint8, device=storage.device)
        return raw.set_(storage, 0, (size,), (1,))

    def _release(self) -> None:
        for storage in self.storages:
            storage.resize_(0)

    @contextmanager
    def whole(self):
        """The full weights, gathered from every rank's pieces, while the body runs. A
        collective: every rank enters it at the same point of the step."""
        with torch.no_grad():
            for storage, piece in zip(self.storages, self.pieces):
                padded = piece.numel() * self.world.size
                storage.resize_(padded)  # a new allocation: the parameters' views follow it
                _all_gather(self._bytes(storage, padded), piece)
        _repoint_packed(self.model)
        try:
            yield
        finally:
            self._release()


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters and the packed linears' weights and biases (views of shared storages)."""
    from fastgrpo.models.packed import PackedLinears

    out = list(model.parameters())
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, PackedLinears):
                out += [t for t in (value.weight, value.bias) if t is not None]
    return out


def _own_copy(model: torch.nn.Module, storage):
    """A resizable copy of `storage`, which every tensor of the model that used it now uses."""
    fresh = torch.UntypedStorage(storage.nbytes(), device=storage.device)
    fresh.copy_(storage)
    for t in _tensors(model):
        if t.untyped_storage().data_ptr() == storage.data_ptr():
            t.set_(fresh, t.storage_offset(), t.size(), t.stride())
    return fresh


def _repoint_packed(model: torch.nn.Module) -> None:
    """Packed linears check that their parameters still sit where they were packed; after a
    gather they do, in a new allocation: record it (else they fall back to copies)."""
    from fastgrpo.models.packed import PackedLinears

    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, PackedLinears):
                value.pointers = value._pointers()

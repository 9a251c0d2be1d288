"""Replicated weights (`train.parallel: replicated`): the gradient all-reduce, bucket by bucket,
overlapped with the mini-batch's last backward pass as DDP overlaps it.

The gradients are summed in fp32 in one flat buffer laid out in the parameters' order: the fp32
masters' gradient buffer when every trained parameter has a master (bf16 weights, the usual
case: the sums land where AdamW reads them, and each bf16 gradient is freed as soon as it is
copied), else a buffer of this class's own, whose pieces become the gradients at `deliver`.
`overlap.OverlappedReduction` decides when each bucket goes (as soon as its gradients are final,
in one order on every rank); a bucket is all-reduced in place, so no staging copy is held.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastgrpo.distributed import sharded
from fastgrpo.distributed.sharded import _buckets

_all_reduce = dist.all_reduce  # one name for the bucket sends (a test counts them)


class ReplicatedGradients:
    """The summed fp32 gradients of `params` (every trained parameter, in the optimizer's
    order) over the ranks of `world`. `masters` (`precision.MasterWeights`, or None): with a
    master for every parameter, its gradient buffer is the flat buffer."""

    def __init__(self, params: list, world, masters=None, bucket_elements: int | None = None):
        self.params, self.world = list(params), world
        owned = masters is not None and [id(p) for p in masters.params] == [
            id(p) for p in self.params
        ]
        self.masters = masters if owned else None  # the sums go straight into its buffer
        self.other_masters = None if owned else masters  # some parameters have masters
        limit = bucket_elements or sharded.BUCKET_ELEMENTS
        self.buckets = [_buckets(self.params, 1, limit)]
        self.sizes = [p.numel() for p in self.params]
        self._flat: torch.Tensor | None = None  # allocated at a step's first bucket

    def _buffer(self) -> torch.Tensor:
        if self._flat is None:
            if self.masters is not None:
                self._flat = self.masters.open_gradients()
            else:
                total = sum(self.sizes)
                self._flat = torch.empty(total, dtype=torch.float32, device=self.params[0].device)
        return self._flat

    @torch.no_grad()
    def send_gradients(self, group: int, bucket, async_op: bool = False):
        """Copy one bucket's gradients (None: zeros) into the flat fp32 buffer, free them, and
        all-reduce that piece in place; (work, None)."""
        piece = self._buffer()[bucket.offset : bucket.offset + bucket.numel]
        for view, p in zip(piece.split(bucket.sizes), bucket.params):
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            p.grad = None
        return _all_reduce(piece, async_op=async_op), None

    def deliver(self) -> None:
        """After every bucket's all-reduce was waited for: the sums become the gradients AdamW
        reads (the masters' already are, when their buffer is the flat one)."""
        if self.masters is not None:
            self._flat = None  # the masters own it; their release_gradients frees it
            return
        views = [v.view_as(p) for v, p in zip(self._buffer().split(self.sizes), self.params)]
        low = set() if self.other_masters is None else {id(p) for p in self.other_masters.params}
        if low:
            self.other_masters.load_gradients(
                [v for v, p in zip(views, self.params) if id(p) in low]
            )
        for view, p in zip(views, self.params):
            if id(p) not in low:  # a bf16 weight without a master takes the rounded sum
                p.grad = view if view.dtype == p.dtype else view.to(p.dtype)
        self._flat = None

    def release_gradients(self) -> None:
        """No rank had a gradient: drop what was sent (zeros)."""
        if self.masters is not None and self._flat is not None:
            self.masters.release_gradients()
        self._flat = None
        for p in self.params:
            p.grad = None

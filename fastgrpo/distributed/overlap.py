"""The gradient reduction of a data-parallel job overlapped with the last backward pass of each
mini-batch, as DDP does with `no_sync` and bucket hooks: a sharded job's reduce-scatter
(`sharded.ShardedMasters`), a replicated job's all-reduce (`replicated.ReplicatedGradients`).

During that backward a post-accumulate-grad hook counts each parameter's final gradient in; a
bucket (`sharded._Bucket`) whose parameters all have theirs is ready, and ready buckets are sent
(fp32 collectives, `async_op=True`) strictly in one fixed order: the same on every rank, so the
ranks issue the same collectives in the same order whatever their micro-batches. The order is the
one backward mostly completes buckets in, by the first of their parameters in the model, last
first; a bucket ready early waits for those before it. At the optimizer step, `finish` waits for
what was sent and sends, in the same order, every bucket that was not (a rank with no backward in
its last micro-batch sends them all there, zeros for missing gradients).

Only the last micro-batch is overlapped: ranks plan their own micro-batches by a token budget, so
their counts differ, but each has exactly one last micro-batch per mini-batch (or none: then the
step sends everything). Earlier micro-batches accumulate bf16 gradients as before.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

IN_FLIGHT_BUCKETS = 2
"""Buckets sent and not waited for, at most, during the backward: each holds a fp32 staging copy
(128 MiB for a full bucket); unbounded, they would add 2 bytes per parameter (4 of fp32 staging
against the 2 of bf16 gradient freed) at the end of the backward, more than the sharded state
saves on 2 GPUs."""


class OverlappedReduction:
    """Sends `shards`' buckets as their gradients become final in a backward run under
    `last_backward()`; `finish()` at the step sends the rest and waits for all.

    `model_order`: the parameters in the model's order (`model.parameters()`), which fixes the
    order the buckets are sent in."""

    def __init__(self, shards, model_order: list[torch.nn.Parameter]):
        self.shards = shards
        position = {id(p): i for i, p in enumerate(model_order)}
        buckets = [(g, b) for g, group in enumerate(shards.buckets) for b in group]
        # backward reaches a bucket's first parameter (in the model) last: that completes it
        self.order = sorted(buckets, key=lambda gb: -min(position[id(p)] for p in gb[1].params))
        self.index = {id(p): i for i, (_, b) in enumerate(self.order) for p in b.params}
        self._reset()

    def _reset(self) -> None:
        self.arrived = [set() for _ in self.order]  # per bucket, ids of final gradients
        self.sent = 0  # buckets of `order` sent this step: always a prefix
        self.in_flight = []  # (work, fp32 staging) of sends not yet waited for
        self.present = False  # a gradient arrived during the last backward

    @contextmanager
    def last_backward(self):
        """Arms the hooks for one backward pass: the mini-batch's last."""
        handles = [p.register_post_accumulate_grad_hook(self._arrive) for p in self.shards.params]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def _arrive(self, param: torch.Tensor) -> None:
        i = self.index[id(param)]
        if i < self.sent:
            raise RuntimeError(
                "a gradient changed after its bucket's reduce-scatter was sent: only the "
                "mini-batch's last backward pass may run under last_backward(), once"
            )
        self.arrived[i].add(id(param))
        self.present = True
        while self.sent < len(self.order) and self._ready(self.sent):
            while len(self.in_flight) >= IN_FLIGHT_BUCKETS:
                work, _ = self.in_flight.pop(0)
                work.wait()
            self.in_flight.append(self._send(async_op=True))

    def _ready(self, i: int) -> bool:
        return len(self.arrived[i]) == len(self.order[i][1].params)

    def _send(self, async_op: bool):
        g, b = self.order[self.sent]
        self.sent += 1
        return self.shards.send_gradients(g, b, async_op)

    @torch.no_grad()
    def finish(self) -> bool:
        """At the step: send the buckets not sent yet (in the same order), wait for all; False,
        on every rank, when no rank had a gradient (the gradient shards are then released)."""
        present = self.present or any(p.grad is not None for p in self.shards.params)
        while self.sent < len(self.order):
            self._send(async_op=False)
        for work, _ in self.in_flight:
            work.wait()
        self._reset()
        if not self.shards.world.any(present, self.shards.params[0].device):
            self.shards.release_gradients()
            return False
        return True

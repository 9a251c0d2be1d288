"""This process's place in a torchrun job, and the few collectives the trainer needs.

Why these and no more: a GRPO step is data parallel over whole prompt groups. Each rank rolls out,
rewards and scores its own groups; what couples the ranks is (1) the loss normalisers, which count
the global batch's sequences and tokens, (2) the gradients, summed before the optimizer step (each
rank's loss is already divided by the global counts, so the sum is the one-process gradient), and
(3) whatever is batch-wide in the advantages and the metrics. `share` gives each rank every
`size`-th prompt group of the one shared order, so a rank's slice of mini-batch m is exactly its
share of the one-process mini-batch m (see `train.batching.plan_update`).
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0
"""How long a collective may wait for the slowest rank before the job fails (a crashed or hung
rank must end the job, never leave the others waiting for ever)."""


class World:
    """Rank `rank` of `size` processes (`local_rank` on this machine), in the default group."""

    def __init__(self, rank: int, size: int, local_rank: int = 0):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a world of {size}")
        self.rank, self.size, self.local_rank = rank, size, local_rank

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, writes metrics and saves the model."""
        return self.rank == 0

    def share(self, items: Sequence) -> list:
        """This rank's items of a sequence every rank holds in the same order: every `size`-th,
        starting at `rank`."""
        if len(items) % self.size:
            raise ValueError(
                f"{len(items)} items do not split evenly over {self.size} ranks; make the global "
                f"batch (rollout.prompts_per_step) a multiple of the number of processes"
            )
        return list(items[self.rank :: self.size])

    def all_reduce_sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum each tensor over the ranks, in place, in one collective per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            if len(group) == 1 and group[0].is_contiguous():
                dist.all_reduce(group[0])
                continue
            flat = torch.cat([t.reshape(-1) for t in group])
            dist.all_reduce(flat)
            for t, part in zip(group, flat.split([t.numel() for t in group])):
                t.copy_(part.view_as(t))

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of `tensor` over the ranks (a new tensor)."""
        out = tensor.clone()
        dist.all_reduce(out)
        return out

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of `tensor` over the ranks (a new tensor)."""
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out

    def batch_std(self, values: torch.Tensor) -> torch.Tensor:
        """The unbiased std of the values of every rank together (each rank holds its share):
        count, sum and sum of squares summed in float64, as `values.std()` of the whole batch
        would give within rounding."""
        v = values.detach().double().reshape(-1)
        moments = self.sum(
            torch.stack(
                [
                    torch.tensor(float(v.numel()), dtype=v.dtype, device=v.device),
                    v.sum(),
                    (v * v).sum(),
                ]
            )
        )
        n, total, squares = moments.unbind()
        variance = (squares - total * total / n) / (n - 1)
        return variance.clamp(min=0).sqrt().to(values.dtype)

    def leave(self) -> None:
        """Destroy the process group (at the end of training): left to the interpreter's exit,
        gloo's threads can abort the process ("terminate called without an active exception")."""
        if dist.is_initialized():
            dist.destroy_process_group()

    def barrier(self) -> None:
        """Wait for every rank."""
        dist.barrier()

    def gather(self, value) -> list:
        """Every rank's `value` (any picklable object), in rank order, on every rank."""
        values = [None] * self.size
        dist.all_gather_object(values, value)
        return values

    def broadcast(self, value):
        """Rank 0's `value` (any picklable object) on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def any(self, flag: bool, device: torch.device | str) -> bool:
        """Whether `flag` holds on at least one rank."""
        value = torch.tensor(float(flag), device=device)
        dist.all_reduce(value)
        return bool(value.item())

    def __repr__(self) -> str:
        return f"World(rank={self.rank}, size={self.size}, local_rank={self.local_rank})"


def end_rank_process(code: int) -> NoReturn:
    """End a rank of a torchrun job once its command is done: the atexit handlers (logging's,
    torch's, a reward module's), flushed streams, then the exit, skipping only the interpreter's
    finalization. There gloo's worker threads may still hold tensors whose release needs the
    interpreter being torn down, which aborts the process (SIGABRT, "terminate called without an
    active exception") and turns a finished run into a failed job: seen once in CI after a
    2-process FSDP run on the CPU, rare (none in 70 such jobs run here to reproduce it)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def join_torchrun(device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
    """Join the job torchrun started (its RANK, WORLD_SIZE, LOCAL_RANK and rendezvous variables):
    NCCL for CUDA, gloo for the CPU, and a timeout on every collective."""
    try:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError) as error:
        raise RuntimeError(
            "not started by torchrun: RANK and WORLD_SIZE are not set; launch with "
            "`torchrun --nproc-per-node N -m fastgrpo train ...`"
        ) from error
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device_type == "cuda":
        # NVLink multicast off: it has hung collectives on the lent machines (PERFORMANCE.md)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        options = {"device_id": torch.device("cuda", local_rank)} if device_type == "cuda" else {}
        dist.init_process_group(
            backend="nccl" if device_type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            **options,  # NCCL binds this rank's GPU now, instead of guessing it from the rank
        )
    return World(rank, size, local_rank)

"""Sharded optimizer state (`train.parallel: sharded`): every rank keeps the fp32 master weights,
the fp32 gradients and AdamW's two moments of 1/N of the weights; the weights themselves (bf16, or
fp32) stay whole on every rank, because each rank's rollout engine reads them whole.

Bytes per parameter on each GPU, bf16 weights with fp32 masters:
  replicated  2 (weight) + 2 (gradient) + 4 (master) + 8 (moments) + 4 (fp32 gradient, in the step) = 20
  sharded     2 (weight) + 2 (gradient) + 16 / N
so a 7B model needs about 152 GB replicated and 61 GB sharded over 4 GPUs. This is ZeRO stage 2
(FSDP's SHARD_GRAD_OP): the weights are not sharded.

Layout. The parameters AdamW steps fall into the weight-decay group (matrices) and the no-decay
group (vectors); each group is cut into buckets of consecutive parameters of one dtype (about
`BUCKET_ELEMENTS` each), and each bucket is padded to a multiple of N. Rank r holds elements
[r*s, (r+1)*s) of every bucket (s = padded size / N), one flat fp32 tensor per group, which AdamW
steps as a single parameter. One reduce-scatter per bucket sums the ranks' gradients, in fp32,
into the owners' shards (the bf16 gradients are freed bucket by bucket), most of them during the
mini-batch's last backward pass (`overlap.py`); after AdamW, every rank rounds its shard to the
weights' dtype and one all-gather per bucket puts the whole weights back together on every rank:
the weight gather.

In a checkpoint every rank writes its own pieces through torch.distributed.checkpoint, keyed by
the buckets' whole tensors (`checkpoint_tensors`), so a sharded run resumes on any number of
processes; `read_one_process_state` turns them into the one-process format for a run continued
without sharding, and `shards_of` cuts a one-process checkpoint into a rank's pieces.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

BUCKET_ELEMENTS = 1 << 25  # 32M elements: 128 MiB of fp32 in flight per collective

# torch 2.13 renamed the single-tensor collectives; 2.11 (the GPU image) has only the old names
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Bucket:
    """Consecutive parameters of one group and dtype, padded to `shard * ranks` elements; this
    rank's `shard` elements sit at `offset` in its group's flat shard."""

    def __init__(self, params: list[torch.nn.Parameter], ranks: int, offset: int):
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.shard = -(-self.numel // ranks)
        self.padded = self.shard * ranks
        self.offset = offset
        self.dtype = params[0].dtype

    def flat(self, tensors, device=None) -> torch.Tensor:
        """One tensor per parameter (None: zeros) as the bucket's padded flat fp32 tensor, on
        `device` (default: the parameters')."""
        device = self.params[0].device if device is None else device
        out = torch.zeros(self.padded, dtype=torch.float32, device=device)
        views = out[: self.numel].split(self.sizes)
        for view, t in zip(views, tensors):
            if t is not None:
                view.copy_(t.reshape(-1))
        return out

    def pieces(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The padded flat tensor cut back into the parameters' shapes (views)."""
        return [v.view_as(p) for v, p in zip(flat[: self.numel].split(self.sizes), self.params)]


def _buckets(group: list, ranks: int, limit: int) -> list[_Bucket]:
    out, current, size, offset = [], [], 0, 0
    for p in group:
        if current and (size + p.numel() > limit or p.dtype != current[0].dtype):
            out.append(_Bucket(current, ranks, offset))
            offset += out[-1].shard
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        out.append(_Bucket(current, ranks, offset))
    return out


class ShardedMasters:
    """This rank's shard of the fp32 masters (`flats`, one nn.Parameter per non-empty group, for
    AdamW to step) and of their gradients, for the parameters in `groups` (decay, no-decay).

    `send_gradients` for every bucket (`overlap.OverlappedReduction`, during and after the
    backward passes), then the optimizer's clip and step on `flats`, then `gather_weights`;
    `release_gradients` frees the fp32 gradient shards."""

    gradient_scale = 1.0  # the reduce-scatter sums: the shards hold the whole sum's pieces

    def __init__(
        self,
        groups: list[list[torch.nn.Parameter]],
        world,
        rounding: str = "stochastic",
        seed: int = 0,
        bucket_elements: int | None = None,
    ):
        self.world = world
        self.groups = [g for g in groups if g]
        self.params = [p for g in self.groups for p in g]
        if not self.params:
            raise ValueError("ShardedMasters needs at least one parameter")
        limit = self.bucket_elements = bucket_elements or BUCKET_ELEMENTS
        self.buckets = [_buckets(g, world.size, limit) for g in self.groups]
        self.flats = []
        with torch.no_grad():
            for buckets in self.buckets:
                parts = [self._mine(b.flat([p.detach() for p in b.params])) for b in buckets]
                self.flats.append(torch.nn.Parameter(torch.cat(parts)))
        self.stochastic = rounding == "stochastic" and all(
            p.dtype == torch.bfloat16 for p in self.params
        )
        self.seed = seed
        self.generator = torch.Generator(device=self.params[0].device)
        self.gathers = 0  # weight gathers so far: with the seed and rank, the rounding's stream

    def _mine(self, padded: torch.Tensor) -> torch.Tensor:
        shard = padded.numel() // self.world.size
        return padded[self.world.rank * shard : (self.world.rank + 1) * shard]

    def _slice(self, group: int, bucket: _Bucket, flat: torch.Tensor | None = None):
        flat = self.flats[group] if flat is None else flat
        return flat[bucket.offset : bucket.offset + bucket.shard]

    @torch.no_grad()
    def send_gradients(self, group: int, bucket: _Bucket, async_op: bool = False):
        """Reduce-scatter one bucket's gradients (None: zeros), summed in fp32, into this rank's
        gradient shard, and free them; (work, fp32 staging): with `async_op`, the staging must
        live until the work is waited for. `overlap.OverlappedReduction` sends every bucket once
        per step, in one order on every rank."""
        if self.flats[group].grad is None:
            self.flats[group].grad = torch.empty_like(self.flats[group])
        full = bucket.flat([p.grad for p in bucket.params])
        out = self._slice(group, bucket, self.flats[group].grad)
        work = _reduce_scatter(out, full, async_op=async_op)
        for p in bucket.params:
            p.grad = None
        return work, full

    def gradients(self) -> list[torch.Tensor]:
        return [f.grad for f in self.flats]

    def release_gradients(self) -> None:
        for f in self.flats:
            f.grad = None

    @torch.no_grad()
    def gather_weights(self) -> None:
        """Round this rank's masters to the weights' dtype (stochastically for bf16, as
        `MasterWeights.refresh` does) and put every rank's pieces into the whole weights."""
        self.gathers += 1
        if self.stochastic:  # a stream of its own per rank and gather: resumes exactly
            self.generator.manual_seed(
                (self.seed * 1_000_003 + self.world.rank) * 1_000_003 + self.gathers
            )
        for g, buckets in enumerate(self.buckets):
            for b in buckets:
                mine = self._slice(g, b)
                if b.dtype == torch.float32:
                    piece = mine
                elif self.stochastic:  # bf16 is fp32's upper half: add 16 random low bits, cut
                    bits = torch.empty_like(mine).view(torch.int32)
                    bits.random_(0, 1 << 16, generator=self.generator)
                    bits.add_(mine.view(torch.int32)).bitwise_and_(-(1 << 16))
                    piece = bits.view(torch.float32).to(b.dtype)  # exact
                else:
                    piece = mine.to(b.dtype)
                full = torch.empty(b.padded, dtype=b.dtype, device=mine.device)
                _all_gather(full, piece)
                torch._foreach_copy_([p.detach() for p in b.params], b.pieces(full))

    # ------------------------------------------------------------------ checkpoints

    @torch.no_grad()
    def shards_of(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's pieces (one flat fp32 tensor per group, like `flats`) of whole
        per-parameter tensors given in `params` order (a one-process checkpoint's)."""
        out, i = [], 0
        for buckets in self.buckets:
            parts = []
            for b in buckets:
                tensors = values[i : i + len(b.params)]
                i += len(b.params)
                parts.append(self._mine(b.flat(tensors, device="cpu")))  # only mine to the GPU
            out.append(torch.cat(parts).to(self.params[0].device))
        return out

    def checkpoint_tensors(self, adamw, with_moments: bool = True) -> dict:
        """This rank's masters and AdamW moments as DTensors of every bucket's whole (unpadded)
        flat tensor, sharded as `torch.chunk` cuts it: what torch.distributed.checkpoint writes,
        each rank its own pieces, and reads back into the same tensors on any number of ranks
        (the keys depend on the parameters and the bucket size, not on the ranks). The DTensors'
        local tensors are views of the shards, so a load fills them in place."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        if getattr(self, "_mesh", None) is None:
            self._mesh = init_device_mesh(self.params[0].device.type, (self.world.size,))
        kinds = {"master": self.flats}
        if with_moments:
            states = [adamw.state[f] for f in self.flats]
            kinds |= {key: [s[key] for s in states] for key in ("exp_avg", "exp_avg_sq")}
        out = {}
        for kind, shards in kinds.items():
            for g, buckets in enumerate(self.buckets):
                for k, b in enumerate(buckets):
                    valid = max(0, min(b.shard, b.numel - self.world.rank * b.shard))
                    local = self._slice(g, b, shards[g].data)[:valid]
                    out[f"{kind}/{g}/{k}"] = DTensor.from_local(
                        local, self._mesh, [Shard(0)], run_check=False,
                        shape=torch.Size([b.numel]), stride=(1,),
                    )  # fmt: skip
        return out


def group_parameters(params: list, low_precision) -> list[list]:
    """AdamW's two groups (matrices: weight decay; vectors: none) in the order a one-process
    ModelOptimizer steps them: the low-precision parameters' masters first, then the others."""
    order = [p for p in params if low_precision(p)] + [p for p in params if not low_precision(p)]
    return [[p for p in order if p.dim() >= 2], [p for p in order if p.dim() < 2]]


def read_one_process_state(meta: dict, params: list, low_precision) -> dict:
    """A sharded checkpoint's optimizer state (`meta`: what rank 0 saved; `meta["shards"]`: the
    folder torch.distributed.checkpoint wrote) in the one-process format: AdamW's state per
    parameter and the masters of the low-precision ones. Reads whole tensors, so it runs in
    one process, or in each of a replicated job's."""
    import torch.distributed.checkpoint as dcp

    groups = [g for g in group_parameters(params, low_precision) if g]
    layout = [_buckets(g, 1, meta["bucket_elements"]) for g in groups]
    kinds = ("master", "exp_avg", "exp_avg_sq") if meta["stepped"] else ("master",)
    flats = {
        f"{kind}/{g}/{k}": torch.zeros(b.numel)
        for kind in kinds
        for g, buckets in enumerate(layout)
        for k, b in enumerate(buckets)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(flats, checkpoint_id=meta["shards"])
    ordered = [p for g in groups for p in g]
    values = {kind: [] for kind in kinds}
    for kind in kinds:
        for g, buckets in enumerate(layout):
            for k, b in enumerate(buckets):
                values[kind] += [t.clone() for t in b.pieces(flats[f"{kind}/{g}/{k}"])]
    state = {}
    if meta["stepped"]:
        step = torch.tensor(float(meta["step"]))
        state = {
            i: {"step": step.clone(), "exp_avg": avg, "exp_avg_sq": sq}
            for i, (avg, sq) in enumerate(zip(values["exp_avg"], values["exp_avg_sq"]))
        }
    index = {id(p): i for i, p in enumerate(ordered)}
    masters = [values["master"][index[id(p)]] for p in params if low_precision(p)]
    return {
        "adamw": {"state": state, "param_groups": meta["param_groups"]},
        "master_weights": masters,
    }

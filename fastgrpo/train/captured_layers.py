"""The update's decoder layers as CUDA graphs (`train.cuda_graphs`): each micro-batch's forward
and backward through the layers is two graph launches instead of ~3,000 kernel launches.

Why: on a GPU the update of a small model is host-bound. At the 0.5B shape (H100, e2cd957) its
forward and backward passes take ~190 ms of host time for ~128 ms of GPU work, and with LoRA
~250 ms for ~120 ms (benchmarks/lab/profile_update_host.py): Python, autograd and the launches,
not arithmetic, set the pace.

How: a micro-batch's packed layout (`logprobs.pack_layout`) is padded to a bucket (`pad_layout`):
its tokens up to the next multiple of `token_step` (an eighth of the micro-batch budget) and its
sequences up to a multiple of SEQUENCE_STEP by filler sequences whose keys are their own rows (so every packed row and every
key row belongs to exactly one sequence, and every query sees a key), its keys likewise, its
longest lengths up to powers of two. The first time a bucket comes its layers run eagerly; the
second time the layers from the embeddings to the final norm (`Transformer.train_layers`) are
recorded as a forward graph and a backward graph (`_Recorded`, the pattern of
`torch.cuda.make_graphed_callables`), all buckets sharing one memory pool; then replayed. Each
forward replay is followed by its own backward before another bucket replays, which is what
makes sharing the pool safe. The embedding, the RoPE tables and the loss stay eager; the
filler's hidden states are never scored, so its gradients are zero. The update computes every
micro-batch's layout before its passes (`logprobs.layout_of`), so the passes read nothing back
from the GPU and the host queues ahead of it.

The graphs read the weights and LoRA's factors at the addresses they had when recorded; a change
of address (a reload, a repack, a module wrapped) records them again. Each forward graph begins by
refilling the factors from the adapters in place, so a replay needs no host work after an
optimizer step (the check walks a flat list, `_addresses`: per micro-batch, host time ran to
~18 ms at the 0.5B shape with LoRA while the GPU waited at the update's start). Used on one GPU for the
native model without activation checkpointing, LoRA dropout or a layer the flash kernels do not
serve (`why_eager`); elsewhere the layers run eagerly.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from fastgrpo.cuda_graphs import capture
from fastgrpo.models import Transformer
from fastgrpo.models.attention import SharedKeys, flash_serves
from fastgrpo.models.lora_decode import layer_groups
from fastgrpo.models.lora_train import (
    attached_merged,
    cached_factors,
    factors,
    fill_factors_of,
    has_adapter,
)
from fastgrpo.rollout.engine import GRAPH_POOLS_IDLE
from fastgrpo.rollout.types import Rollout
from fastgrpo.train.logprobs import HostLayout, kept_hidden, layout_of

log = logging.getLogger("fastgrpo.train")

BUCKETS_PER_BUDGET = 8  # packed tokens (and key rows) padded to a multiple of budget / this
MIN_TOKEN_STEP = 512
SEQUENCE_STEP = 16  # and the sequences (filler sequences added) to a multiple of this
MAX_GRAPHS = 8  # buckets kept recorded; the least recently used is dropped beyond


def why_eager(model, world=None) -> str | None:
    """Why the update's layers cannot run as CUDA graphs on this model, in words; None: they can
    (the native model on one CUDA GPU, in a dtype and head size the flash kernels take, every
    layer's window too, no activation checkpointing, no LoRA dropout)."""
    if not isinstance(model, Transformer):
        return "a transformers model (the native model's layers only)"
    if model.device.type != "cuda":
        return "not on a CUDA GPU"
    if world is not None and world.size > 1:
        return "several processes"
    if model.activation_checkpointing:
        return "gradient checkpointing"
    config = model.config
    dtype = model.model.embed_tokens.weight.dtype
    if not all(flash_serves(dtype, config.head_dim, w) for w in config.layer_windows or [None]):
        return "a dtype, head size or window the flash kernels do not take"
    if any(getattr(m, "dropout", 0.0) and has_adapter(m) for m in model.modules()):
        return "LoRA dropout"
    return None


def token_step(micro_batch_tokens: int) -> int:
    """The padding step of a micro-batch's tokens for a train.micro_batch_tokens budget: an
    eighth of it (a multiple of 128), at least MIN_TOKEN_STEP. Coarse on purpose: on simulated
    batches of varied lengths at a 12,288-token budget, 512-token steps made 20-66 buckets and
    replayed 6-38% of the micro-batches (the rest ran eagerly or were being recorded); an eighth
    (1,536) made 7-18 buckets and replayed 81-85%, padding the tokens by 7-11%
    (benchmarks/results/graph_buckets_cpu.txt). The quick start's micro-batches of ~700 tokens
    are padded to 1,536: more work for a small model whose update the host, not the GPU, sets."""
    eighth = -(-micro_batch_tokens // BUCKETS_PER_BUDGET)
    return max(MIN_TOKEN_STEP, -(-eighth // 128) * 128)


def _release_idle(idle: list[int]) -> None:
    GRAPH_POOLS_IDLE[0] -= idle[0]


def _power_of_two(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _split(total: int, parts: int) -> np.ndarray:
    """`total` in `parts` near-equal positive pieces, the larger first."""
    base, extra = divmod(total, parts)
    return base + (np.arange(parts) < extra).astype(np.int64)


def pad_layout(
    layout: HostLayout, step: int, sequence_step: int = SEQUENCE_STEP
) -> tuple[HostLayout, tuple]:
    """`layout` padded to its bucket, and the bucket: (tokens, key rows, sequences, longest
    queries, longest keys). Filler sequences (1 to `sequence_step` of them, so the sequences
    come to a multiple of it) take the tokens up to a multiple of `step`, at least one each (id:
    the first row's first token; positions 0, 1, ...), and the key rows likewise, at least as
    many keys as queries each, their own rows repeated; the scored rows are the layout's own."""
    T = layout.tokens.size
    key_rows = layout.key_rows if layout.key_rows is not None else np.arange(T)
    Tk, N = key_rows.size, layout.cu_seqlens.size - 1
    fillers = -(N + 1) % sequence_step + 1
    T_b = -(-(T + fillers) // step) * step
    Tk_b = -(-(Tk + T_b - T) // step) * step
    q_len, k_len = _split(T_b - T, fillers), _split(Tk_b - Tk, fillers)  # k_len >= q_len
    q_start = T + np.cumsum(q_len) - q_len
    own_keys = np.concatenate([s + np.arange(k) % q for s, q, k in zip(q_start, q_len, k_len)])
    positions = np.concatenate([np.arange(q) for q in q_len])
    padded = HostLayout(
        tokens=np.concatenate([layout.tokens, np.zeros(T_b - T, dtype=np.int64)]),
        positions=np.concatenate([layout.positions, positions]),
        scored=layout.scored,
        cu_seqlens=np.concatenate([layout.cu_seqlens, T + np.cumsum(q_len)]),
        cu_seqlens_k=np.concatenate([layout.cu_seqlens_k, Tk + np.cumsum(k_len)]),
        key_rows=np.concatenate([key_rows, own_keys]),
        max_seqlen=_power_of_two(max(layout.max_seqlen, int(q_len.max()))),
        max_seqlen_k=_power_of_two(max(layout.max_seqlen_k, int(k_len.max()))),
        position_bound=max(layout.position_bound, int(q_len.max())),
        kept=layout.kept,
    )
    bucket = (T_b, Tk_b, N + fillers, padded.max_seqlen, padded.max_seqlen_k)
    return padded, bucket


class _Layers(nn.Module):
    """The model's layers and final norm (its parameters: what the graphs' backward gives
    gradients for) as one callable of tensors, for one bucket's longest lengths."""

    def __init__(self, model: Transformer, max_seqlen: int, max_seqlen_k: int):
        super().__init__()
        self.layers, self.norm = model.model.layers, model.model.norm
        self.__dict__["owner"] = model  # not a submodule: its other parameters are not used
        self.max_seqlen, self.max_seqlen_k = max_seqlen, max_seqlen_k

    def forward(self, x, cos, sin, cu_seqlens, cu_seqlens_k, key_rows):
        keys = SharedKeys(key_rows, cu_seqlens_k, self.max_seqlen_k)
        attend = self.owner.packed_attention(cu_seqlens, self.max_seqlen, keys)
        return self.owner.train_layers(x, cos, sin, attend)


class _Recorded:
    """One bucket's layers recorded as a forward graph and a backward graph (the pattern of
    `torch.cuda.make_graphed_callables`): called on new tensors of the recorded shapes, it copies
    them into its static inputs and replays the forward; autograd's backward through it copies
    the output's gradient in and replays the backward, which gives the gradients of x and of the
    layers' trainable weights.

    Unlike make_graphed_callables (torch 2.11), nothing of the recorded autograd graph is kept:
    its weights' gradient nodes were made on the recording stream, and a replay on another
    stream that reached them would synchronise the two for every weight. And the weights'
    gradients are written into buffers all buckets share, so the graphs hold one set of them
    whatever their number (0.67 GiB each at the 0.5B shape, full fine-tuning)."""

    def __init__(
        self, module: _Layers, args: tuple, pool, grad_buffers: list[torch.Tensor], before=None
    ):
        x, *rest = args
        self.static_inputs = [x.detach().requires_grad_(x.requires_grad)] + [
            t.detach().clone() for t in rest
        ]
        self.params = [p for p in module.parameters() if p.requires_grad]
        wrt = [t for t in self.static_inputs if t.requires_grad] + self.params
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with capture(self.forward_graph, pool=pool, capture_error_mode="thread_local"):
            if before is not None:  # recorded at the forward graph's head (LoRA's refill)
                before()
            out = module(*self.static_inputs)
        self.grad_out = torch.empty_like(out)
        first = 1 if x.requires_grad else 0  # grads: x's (if it needs one), then the weights'
        with capture(self.backward_graph, pool=pool, capture_error_mode="thread_local"):
            grads = torch.autograd.grad(out, wrt, self.grad_out, allow_unused=True)
            # the weights' gradients end in buffers every bucket shares (`grad_buffers`, made
            # once outside the pool): the graphs' own die here, and the pool reuses them
            used = [(b, g) for b, g in zip(grad_buffers, grads[first:]) if g is not None]
            if used:
                torch._foreach_copy_([b for b, _ in used], [g for _, g in used])
        self.out = out.detach()  # the recorded autograd graph dies with `out`
        weights = [None if g is None else b for b, g in zip(grad_buffers, grads[first:])]
        self.grads = [grads[0] if first else None] + [None] * len(rest) + weights
        del grads, used

    def __call__(self, *args):
        return _Replay.apply(self, *args, *self.params)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recorded: _Recorded, *inputs):
        for static, given in zip(recorded.static_inputs, inputs):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        recorded.forward_graph.replay()
        ctx.recorded = recorded
        return recorded.out.detach()

    @staticmethod
    def backward(ctx, grad):
        recorded = ctx.recorded
        recorded.grad_out.copy_(grad)
        recorded.backward_graph.replay()
        # copies (one multi-tensor launch): autograd may keep a returned gradient as a weight's
        # .grad, which the next replay would overwrite
        given = [g for g in recorded.grads if g is not None]
        copies = iter(torch._foreach_mul(given, 1.0))
        return None, *(None if g is None else next(copies) for g in recorded.grads)


class CapturedLayers:
    """`kept_hidden` for the update's micro-batches, its layers replayed from CUDA graphs (one
    pair per bucket, recorded the second time a bucket comes). `captures` and `replays` count;
    `pool_bytes` is the memory the graphs hold (`torch.cuda.max_memory_allocated` does not see
    it: the step's peak adds it)."""

    def __init__(self, model: Transformer, step: int = MIN_TOKEN_STEP):
        self.model = model
        self.step = step  # tokens and key rows padded to a multiple of this (`token_step`)
        self.graphs: OrderedDict[tuple, _Recorded | str] = OrderedDict()  # or "seen" once
        self.pool = None
        self.addresses: tuple | None = None
        self._modules = self._packed = self._groups = None  # what `_addresses` walks (`_watch`)
        self.captures = self.replays = 0
        self.failed = False  # a recording raised: the layers run eagerly from then on
        self.grad_buffers: list[torch.Tensor] | None = None
        self.pool_bytes = 0  # what the graphs' memory pool took from the GPU, held from then on
        self._idle = [0]  # its bytes without a live tensor, counted in GRAPH_POOLS_IDLE until
        weakref.finalize(self, _release_idle, self._idle)  # this object (and its pool) goes

    def kept_hidden(self, model, rollout: Rollout) -> torch.Tensor:
        """(n, H) final hidden states predicting the kept completion tokens, as
        `logprobs.kept_hidden` gives them; with autograd (the update), through the graphs."""
        if model is not self.model or not (torch.is_grad_enabled() and model.training):
            return kept_hidden(model, rollout)
        layout = layout_of(rollout)
        if layout is None:
            return kept_hidden(model, rollout)
        padded, bucket = pad_layout(layout, self.step)
        packed = padded.to_device(rollout.prompt_ids.device)
        ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1).view(-1)
        x = model.model.embed_tokens(ids[packed.tokens])  # (T_b, H)
        cos, sin = model.rotary.lookup(packed.positions, padded.position_bound, x.dtype)
        args = (x, cos, sin, packed.cu_seqlens, packed.keys.cu_seqlens, packed.keys.rows)
        layers = self._graphed(bucket, args)
        return layers(*args)[packed.scored]

    def _graphed(self, bucket: tuple, args: tuple):
        """The bucket's layers: eagerly the first time it comes (what lazily initialises the
        kernels for its shapes), recorded the second time (`_Recorded`), replayed after."""
        if self._modules is None or self._addresses() != self.addresses:
            # nothing watched yet, or recorded against other tensors: record again
            self._watch()
            self.graphs.clear()
            self.grad_buffers = None
            self.addresses = self._addresses()
        layers = self.graphs.get(bucket)
        if isinstance(layers, _Recorded):
            self.graphs.move_to_end(bucket)
            self.replays += 1
            return layers
        module = _Layers(self.model, bucket[3], bucket[4])
        if layers is None:  # first seen: eagerly
            self.graphs[bucket] = "seen"
            self._drop_oldest()
            return module
        if self.failed:
            return module
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        if self.grad_buffers is None:  # the weights' gradients, shared by every bucket
            self.grad_buffers = [
                torch.empty_like(p) for p in module.parameters() if p.requires_grad
            ]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        try:
            layers = _Recorded(
                module, args, self.pool, self.grad_buffers, before=self._refill_factors
            )
        except RuntimeError as error:  # an operation CUDA graphs cannot record
            self.failed = True
            log.warning(
                "the update's layers could not be recorded as CUDA graphs (%s); they run "
                "eagerly from now on (train.cuda_graphs=off skips the attempt)",
                str(error).splitlines()[0][:200],
            )
            return module
        grown = max(0, torch.cuda.memory_reserved() - reserved)
        self.pool_bytes += grown
        idle = max(0, grown - (torch.cuda.memory_allocated() - allocated))
        self._idle[0] += idle
        GRAPH_POOLS_IDLE[0] += idle
        self.graphs[bucket] = layers
        self.graphs.move_to_end(bucket)
        self._drop_oldest()
        self.captures += 1
        return layers

    def _drop_oldest(self) -> None:
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)

    def _watch(self) -> None:
        """What the address check walks, taken once per recording: the modules of the layers
        and the final norm, the packed projections, and LoRA's adapted groups (their factors
        made or refilled now: a recording and an eager run read them as they are)."""
        model = self.model
        dtype, device = model.model.embed_tokens.weight.dtype, model.device
        self._modules = list(model.model.layers.modules()) + [model.model.norm]
        self._packed = [(layer.self_attn, "qkv") for layer in model.model.layers] + [
            (layer.mlp, "gate_up") for layer in model.model.layers
        ]
        self._groups = [
            linears
            for layer in model.model.layers
            for linears in layer_groups(layer).values()
            if any(has_adapter(m) for m in linears)
        ]
        for linears in self._groups:
            factors(linears, dtype, device)

    def _addresses(self) -> tuple | None:
        """The addresses the graphs read (every layer parameter, packed projection and LoRA
        factor), the identity of every child module (a module wrapped or replaced since the
        recording changes it) and whether each adapter is on; None before `_watch`. A flat
        walk: no recursion, no refill."""
        if self._modules is None:
            return None
        addresses = [
            p.data_ptr() for m in self._modules for p in m._parameters.values() if p is not None
        ]
        addresses += [id(c) for m in self._modules for c in m._modules.values()]
        addresses += [m.__dict__.get("enabled") for m in self._modules]  # LoRA adapters on/off
        for owner, name in self._packed:  # read live: a repack replaces the object
            packed = getattr(owner, name)
            addresses += [None] if packed is None else [packed.weight.data_ptr(), packed.intact()]
        for f in self._factors():
            addresses += [None] if f is None else [f.a_cat.data_ptr(), f.b_bd.data_ptr()]
        for linears in self._groups:  # the merged weights the trainer's forward reads (LoRA)
            merged = attached_merged(linears)
            addresses.append(None if merged is None else merged.data_ptr())
        return tuple(addresses)

    def _factors(self) -> list:
        """The adapted groups' cached `Factors` as they are (None where there is none)."""
        return [cached_factors(linears) for linears in self._groups]

    def _refill_factors(self) -> None:
        """LoRA's factors from the adapters as they are now, in place: recorded at the head of
        each forward graph, so a replay refills them on the GPU (an optimizer step changes the
        adapters between replays) with no host work."""
        if self._groups:
            fill_factors_of(list(zip(self._factors(), self._groups)))

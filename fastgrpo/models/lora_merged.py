"""The merged copy of a LoRA run (`MergedWeights`): what the rollout engine samples from and
the trainer's adapted GEMMs compute with.

A model that shares every untouched tensor with the trainer's and holds `W + scaling * B A` in
the weights' dtype for each adapted linear (rounded stochastically under
train.bf16_rounding=stochastic), merged again in place after every optimizer step
(`lora_train.AFTER_STEP`), so its CUDA graphs read the same addresses. It attaches its merged
tensors to the trainer's adapted linears (`lora_train.MERGED`): the trainer's forward and input
gradients then use the weights the engine samples from, as full fine-tuning's bf16 copy of its
fp32 masters is used on both sides.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from fastgrpo.cuda_graphs import capture
from fastgrpo.models.lora import SAVED_ORIGINALS, lora_modules, merge_adapters
from fastgrpo.models.lora_decode import layer_groups
from fastgrpo.models.lora_train import AFTER_STEP, MERGED, has_adapter


class MergedWeights:
    """What the rollout engine samples from in a LoRA run: a model sharing every tensor of
    `model` but the adapted linears' weights, which hold W + scaling * B A (`refresh`)."""

    def __init__(self, model: nn.Module, stochastic: bool = False):
        for m in model.modules():  # a previous copy's tensors: not copied, attached again below
            m.__dict__.pop(MERGED, None)
        adapted = lora_modules(model)
        adapted_weights = {id(m.weight) for m in adapted.values()}
        memo = {
            id(t): t
            for t in list(model.parameters()) + list(model.buffers())
            if id(t) not in adapted_weights
        }  # shared, not copied
        packs = _take_packs(model)  # packed weights are not copied either: packed again below
        originals = model.__dict__.pop(SAVED_ORIGINALS, None)  # the reference's, not the engine's
        try:
            self.model = copy.deepcopy(model, memo)
        finally:
            _put_packs(packs)
            if originals is not None:
                model.__dict__[SAVED_ORIGINALS] = originals
        # its own merged tensors in place of the shared bases; the shared tensors keep their
        # requires_grad (the trained modules_to_save are the trainer's own)
        merge_adapters(self.model)
        for layer in self.model.model.layers:  # merged weights: no adapter to add (lora_decode)
            layer.decode_adapters = {}
        self.pairs = [(self.model.get_submodule(n), m) for n, m in adapted.items()]
        if packs:
            self.model.pack_projections()
        self.stochastic = stochastic
        self.version = None
        self._stepped = None  # the adapters' version counters when `_after_step` merged them
        self._graph = None  # (the addresses it was captured with, the merge's CUDA graph)
        self._attach(model)
        hook = _weak_call(self._after_step)  # a step refreshes the copy the trainer reads
        AFTER_STEP.append(hook)
        weakref.finalize(self, AFTER_STEP.remove, hook)

    def _attach(self, model: nn.Module) -> None:
        """Give each adapted group of `model`'s native layers its merged weight (`MERGED`: the
        packed q/k/v or gate/up tensor, or a single linear's), so the trainer's forward computes
        with the weights the engine samples from (`lora_train.merged_weight`)."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
            return
        for layer, copy_layer in zip(layers, self.model.model.layers):
            groups, copies = layer_groups(layer), layer_groups(copy_layer)
            for name, linears in groups.items():
                if not any(has_adapter(m) for m in linears):
                    continue
                for m, twin in zip(linears, copies[name]):  # each alone (the unpacked path)
                    if has_adapter(m):
                        m.__dict__[MERGED] = {1: twin.weight}
                packed = _packed(copy_layer, name) if len(linears) > 1 else None
                if packed is not None:  # the group's packed GEMM
                    linears[0].__dict__.setdefault(MERGED, {})[len(linears)] = packed.weight

    @torch.no_grad()
    def refresh(self) -> None:
        """Merge the current adapters into the engine's weights, in place. On a GPU the merge is
        captured as a CUDA graph after its first run and replayed: one launch instead of ~3 per
        adapted linear (host time the rollout phase spent), while every tensor it reads and
        writes keeps its address (else it is captured again)."""
        addresses = self._addresses()
        if self._graph is not None and self._graph[0] == addresses:
            self._graph[1].replay()
            return
        self._merge()
        if self.pairs and self.pairs[0][0].weight.is_cuda:
            graph = torch.cuda.CUDAGraph()
            with capture(graph, capture_error_mode="thread_local"):
                self._merge()  # recorded, not run: the merge above wrote the same values
            self._graph = (addresses, graph)

    def _merge(self) -> None:
        for plain, lora in self.pairs:
            lora.merge_into(plain.weight, self.stochastic)

    def _addresses(self) -> tuple:
        return tuple(
            t.data_ptr()
            for plain, lora in self.pairs
            for t in (plain.weight, lora.weight, lora.lora_A.weight, lora.lora_B.weight)
        )

    def _after_step(self) -> None:
        """An optimizer step changed the adapters: merge them now (the next forward, the
        trainer's or the engine's, reads the merged weights), noting the adapters' version
        counters, which a fused optimizer step leaves as they were and a load moves."""
        self.refresh()
        self._stepped = self._versions()

    def _versions(self) -> tuple:
        return tuple((m.lora_A.weight._version, m.lora_B.weight._version) for _, m in self.pairs)

    def current(self, version) -> nn.Module:
        """The merged model, refreshed first if the adapters changed since (`version`: anything
        that changes when they do, such as the optimizer's step count) and the step's own merge
        (`_after_step`) has not already merged them as they are."""
        if version != self.version:
            if self._stepped != self._versions():
                self.refresh()
            self._stepped = None
            self.version = version
        return self.model


def _weak_call(method):
    """A callable that runs `method` while its object lives (a hook that keeps nothing alive)."""
    ref = weakref.WeakMethod(method)

    def call():
        bound = ref()
        if bound is not None:
            bound()

    return call


def _packed(layer, name: str):
    """A native layer's packed projection of group `name` (q/k/v or gate/up), or None."""
    owner, attribute = {"qkv": ("self_attn", "qkv"), "gate_up": ("mlp", "gate_up")}[name]
    return getattr(getattr(layer, owner), attribute, None)


def _take_packs(model) -> list:
    """Detach a native model's packed projections (`PackedLinears`): (layer, qkv, gate_up) of
    each packed layer, what `_put_packs` restores."""
    taken = []
    for layer in getattr(getattr(model, "model", None), "layers", []):
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        qkv, gate_up = getattr(attention, "qkv", None), getattr(mlp, "gate_up", None)
        if qkv is not None or gate_up is not None:
            taken.append((layer, qkv, gate_up))
            attention.qkv = mlp.gate_up = None
    return taken


def _put_packs(taken: list) -> None:
    for layer, qkv, gate_up in taken:
        layer.self_attn.qkv, layer.mlp.gate_up = qkv, gate_up

"""Fully sharded training (`train.parallel: fsdp`): torch's FSDP2 (`fully_shard`) shards the
weights, gradients and optimizer state of the trained model over the ranks; each rank's rollout
engine samples from a whole bf16 copy of the weights (`rollout_model`), refreshed after every
optimizer step by a gather, layer by layer (`time/weight_gather`).

Bytes per parameter on each GPU, bf16 weights:
  sharded (ZeRO-2)  2 (weight) + 2 (gradient) + 16 / N
  fsdp              2 (the engine's copy) + 16 / N (fp32 weight, fp32 gradient, two moments)
plus, in the update, one layer's whole bf16 weights and gradients at a time. The fp32 weights
FSDP shards are the master weights: the trainer computes with their bf16 cast (FSDP's
MixedPrecisionPolicy, rounded to nearest) and reduces gradients in fp32.

With `train.fsdp_free_engine_copy` the copy's storage is freed from the end of each rollout
(after the step's rollouts and the abandon check) until one gather at the end of the step, so the
update's activations can use its 2 bytes per parameter; the optimizer steps in between skip their
gathers. The copy comes back at other addresses: the engine captures its CUDA graphs again.

Every rank must run the same sequence of FSDP forwards and backwards (each layer all-gathers its
weights in a forward and reduce-scatters its gradients in a backward), so a rank with fewer
micro-batches than the busiest rank runs idle passes (`idle_pass`; counted at planning time,
`batching.plan_update(lockstep=True)`).

Checkpoints: every rank writes its shards of the fp32 weights and AdamW's moments through
torch.distributed.checkpoint (keyed by parameter name), so a run resumes on any number of
processes; rank 0 writes the whole bf16 model from the engine's copy.
"""

from __future__ import annotations

import copy

import torch

from fastgrpo.models.transformer import Transformer


class FullySharded:
    """`model` (a native Transformer) sharded in place by `fully_shard`, one unit per decoder
    layer and one for the rest (embeddings, final norm, LM head), its weights turned into fp32
    masters; `rollout_model` the whole copy the engine reads, and the checkpoints write."""

    def __init__(self, model: Transformer, world):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            MixedPrecisionPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )

        if not isinstance(model, Transformer):
            raise TypeError("train.parallel=fsdp needs fastgrpo's native model (model.backend)")
        self.model, self.world = model, world
        packed = all(layer.is_packed() for layer in model.model.layers)
        for layer in model.model.layers:  # the trainer's GEMMs read FSDP's gathered weights
            layer.self_attn.qkv = layer.mlp.gate_up = None
        self.rollout_model = copy.deepcopy(model).requires_grad_(False)
        if packed:
            self.rollout_model.pack_projections()
        compute = model.lm_head_weight.dtype  # the loaded weights' (bf16): the trainer's GEMMs
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        mesh = init_device_mesh(model.device.type, (world.size,))
        for layer in model.model.layers:  # one layer in fp32 at a time, then only its shards
            layer.float()
            fully_shard(layer, mesh=mesh, mp_policy=policy)
            register_fsdp_forward_method(layer, "forward_train")  # the CUDA trainer's forward
        for module in self._root_modules():
            module.float()
        fully_shard(model, mesh=mesh, mp_policy=policy)
        # the fp32 shards (DTensors) the optimizer steps: after a forward without gradient the
        # root unit leaves its gathered weights in the model until its next backward, so
        # model.parameters() is not always these
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.units = list(model.model.layers) + [model]
        self._targets = self._engine_tensors()
        storages = {}  # the engine copy's storages (a packed group's parameters share one)
        for p in self.rollout_model.parameters():
            storage = p.untyped_storage()
            storages.setdefault(storage.data_ptr(), (storage, storage.nbytes()))
        self._storages = list(storages.values())
        self.released = False

    def _root_modules(self) -> list[torch.nn.Module]:
        m = self.model
        return [m.model.embed_tokens, m.model.norm] + ([m.lm_head] if hasattr(m, "lm_head") else [])

    def _engine_tensors(self) -> list[list[torch.Tensor]]:
        """For each unit, the engine copy's parameters in the order of the unit's own."""
        engine = dict(self.rollout_model.named_parameters())
        out = []
        for i, unit in enumerate(self.units):
            prefix = "" if unit is self.model else f"model.layers.{i}."
            out.append([engine[prefix + name] for name, _ in self._own(unit)])
        return out

    def _own(self, unit) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters a unit shards itself (the root's exclude the layers')."""
        named = list(unit.named_parameters())
        if unit is self.model:
            named = [(n, p) for n, p in named if not n.startswith("model.layers.")]
        return named

    def release_engine_weights(self) -> None:
        """Free the engine copy's memory until `restore_engine_weights`
        (`train.fsdp_free_engine_copy`): its 2 bytes per parameter are the update's to use. The tensors keep their shapes; their
        storage comes back at other addresses, so the engine captures its graphs again."""
        if not self.released:
            for storage, _ in self._storages:
                storage.resize_(0)
            self.released = True

    def restore_engine_weights(self) -> None:
        """The engine copy whole again if it was released: its storage allocated anew (the
        packed projections take the new addresses), then one gather, whatever optimizer steps the
        step took (their gathers waited for this). A collective while released: every rank calls
        it."""
        if not self.released:
            return
        for storage, nbytes in self._storages:
            storage.resize_(nbytes)
        for layer in self.rollout_model.model.layers:
            for packed in (layer.self_attn.qkv, layer.mlp.gate_up):
                if packed is not None:
                    packed.readdress()
        self.released = False
        self.gather_weights()

    @torch.no_grad()
    def gather_weights(self) -> None:
        """Every unit's weights, gathered whole in the compute dtype (one all-gather a unit),
        into the engine's copy (in place: its CUDA graphs read the same addresses). While the copy
        is released nothing is gathered: `restore_engine_weights` does it once."""
        if self.released:
            return
        for unit, targets in zip(self.units, self._targets):
            unit.unshard()
            torch._foreach_copy_(targets, [p.detach() for _, p in self._own(unit)])
            unit.reshard()

    # ModelOptimizer steps the shards as it steps ShardedMasters': gradients(), the norm and the
    # clip, AdamW, release_gradients(), gather_weights(). FSDP reduces each backward's gradients
    # as a mean over the ranks, and each rank's loss is divided by the global batch's counts
    # already, so the step multiplies them by this to make the sum.
    @property
    def gradient_scale(self) -> float:
        return float(self.world.size)

    def has_gradients(self) -> bool:
        return all(p.grad is not None for p in self.params)

    def gradients(self) -> list[torch.Tensor]:
        """This rank's pieces of the fp32 gradients (views: scaling them scales the shards)."""
        return [p.grad.to_local() for p in self.params]

    def release_gradients(self) -> None:
        for p in self.params:
            p.grad = None

    # ------------------------------------------------------------------ checkpoints

    def stepped(self, adamw) -> bool:
        """Whether `adamw` (over `params`) has stepped yet: its moments exist."""
        return bool(adamw.state.get(self.params[0]))

    def _state(self, adamw, with_moments: bool) -> dict:
        """What torch.distributed.checkpoint writes and reads: the fp32 weight shards and, with
        moments, AdamW's state (made now, zeros, if AdamW has not stepped yet)."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        state = {"model": get_model_state_dict(self.model)}
        if with_moments:
            state["optimizer"] = get_optimizer_state_dict(self.model, adamw)
        return state

    def save(self, adamw, folder) -> None:
        """Every rank writes its shards of the fp32 weights and of AdamW's state. A collective."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(adamw, self.stepped(adamw)), checkpoint_id=folder)

    def load(self, adamw, folder, stepped: bool) -> None:
        """Read the shards `save` wrote (by any number of ranks) into this rank's, then refresh
        the engine's copy. A collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state = self._state(adamw, stepped)
        dcp.load(state, checkpoint_id=folder)
        set_model_state_dict(self.model, state["model"])
        if stepped:
            set_optimizer_state_dict(self.model, adamw, state["optimizer"])
        self.gather_weights()


def idle_pass(model: Transformer, with_grad: bool) -> None:
    """One forward of a single token (and, `with_grad`, a backward of nothing: zero gradients
    for every parameter), so that this rank runs the collectives of a pass the busiest rank runs
    on real rows."""
    device = model.device
    ids = torch.zeros(1, dtype=torch.long, device=device)
    bounds = torch.tensor([0, 1], dtype=torch.int32, device=device)
    with torch.set_grad_enabled(with_grad):
        hidden = model(ids, ids, model.packed_attention(bounds, 1), position_bound=1)
        if with_grad:
            head = model.lm_head_weight  # outside the forward: give it a (zero) gradient too
            ((hidden.float().sum() + head.float().sum()) * 0.0).backward()


def read_fp32_weights(meta: dict, model: torch.nn.Module) -> list[torch.Tensor]:
    """An FSDP checkpoint's fp32 weights (`meta`: what rank 0 saved; `meta["shards"]`: the
    folder torch.distributed.checkpoint wrote), whole, in `model.parameters()` order: in one
    process, for evaluating the masters or inspecting a run."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {
        "model": {n: torch.empty(p.shape, dtype=torch.float32) for n, p in model.named_parameters()}
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(state, checkpoint_id=meta["shards"])
    return list(state["model"].values())

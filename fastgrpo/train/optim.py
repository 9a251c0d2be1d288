"""The optimizer step (AdamW, fused on CUDA, over fp32 masters of bf16 weights) and the schedule."""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path

import torch

from fastgrpo.errors import UserError
from fastgrpo.models.lora_train import adapters_stepped
from fastgrpo.train.precision import LOW_PRECISION, MasterWeights, wants_masters

SHARDS_FOLDER = "optimizer_shards"  # in a sharded job's checkpoint: every rank's pieces


class ModelOptimizer:
    """AdamW over a model's trainable parameters, or over their fp32 masters (`precision.py`).

    `zero_grad`, then backward passes (the last under `last_backward()`), then `step`: the same
    calls with or without masters.
    With a `world` (`distributed.World`, a data-parallel job), `step` first sums the gradients
    over the ranks, each rank's loss being divided by the global batch's counts already. With
    `sharded` as well, each rank keeps the fp32 masters, gradients and moments of 1/N of the
    weights (`distributed/sharded.py`), which every rank writes with `save_shards`. With
    `fully_sharded` (`distributed.fsdp.FullySharded`: the model's parameters are FSDP's fp32
    shards) AdamW steps those shards and the step refreshes the engine's whole copy.
    """

    def __init__(
        self,
        model,
        *,
        learning_rate: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        master_weights: str = "auto",
        rounding: str = "stochastic",
        seed: int = 0,
        world=None,
        sharded: bool = False,
        fully_sharded=None,
    ):
        self.params = [p for p in model.parameters() if p.requires_grad]
        if fully_sharded is not None:
            self.params = fully_sharded.params
        if not self.params:
            raise ValueError("the model has no trainable parameters (requires_grad is off)")
        self.world = world if world is not None and world.size > 1 else None
        self.masters = self.sharded = self.reduction = self.fully_sharded = None
        self.replicated = None
        self.updates = 0  # optimizer steps taken: what has changed the weights
        if sharded and self.world is not None:
            self._shard(learning_rate, weight_decay, betas, eps, rounding, seed)
            return
        stepped = self.params
        if fully_sharded is not None:  # the parameters are fp32 shards already: the masters
            master_weights = "off"
        if wants_masters(master_weights, self.params):  # bf16/fp16 ones get fp32 masters
            low = [p for p in self.params if p.dtype in LOW_PRECISION]
            self.masters = MasterWeights(low, rounding, seed)
            full = [p for p in self.params if p.dtype not in LOW_PRECISION]
            stepped = self.masters.masters + full
        # Biases and norm weights (1-D) take no weight decay, as in common practice.
        groups = [
            {"params": [p for p in stepped if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in stepped if p.dim() < 2], "weight_decay": 0.0},
        ]
        fused = all(p.is_cuda for p in stepped)
        self.adamw = torch.optim.AdamW(
            groups, lr=learning_rate, betas=betas, eps=eps, fused=fused or None
        )
        self._stepped = stepped
        self.fully_sharded = fully_sharded
        if self.world is not None and fully_sharded is None:  # replicated
            from fastgrpo.distributed.overlap import OverlappedReduction
            from fastgrpo.distributed.replicated import ReplicatedGradients

            self.replicated = ReplicatedGradients(self.params, self.world, self.masters)
            self.reduction = OverlappedReduction(self.replicated, self.params)

    @property
    def writes_shards(self) -> bool:
        """Whether every rank writes its own pieces of the optimizer state (`save_shards`)."""
        return self.sharded is not None or self.fully_sharded is not None

    def _shard(self, learning_rate, weight_decay, betas, eps, rounding, seed) -> None:
        from fastgrpo.distributed.overlap import OverlappedReduction
        from fastgrpo.distributed.sharded import ShardedMasters, group_parameters

        groups = group_parameters(self.params, _low_precision)  # as one process steps them
        self.sharded = ShardedMasters(groups, self.world, rounding, seed)
        self.reduction = OverlappedReduction(self.sharded, self.params)
        decays = [weight_decay, 0.0]
        adam_groups = [
            {"params": [flat], "weight_decay": decay}
            for flat, decay in zip(self.sharded.flats, [d for g, d in zip(groups, decays) if g])
        ]
        fused = all(f.is_cuda for f in self.sharded.flats)
        self.adamw = torch.optim.AdamW(
            adam_groups, lr=learning_rate, betas=betas, eps=eps, fused=fused or None
        )

    def last_backward(self):
        """A context for the mini-batch's last backward pass (only that one: ranks may run
        different numbers of micro-batches). In a sharded job each bucket's reduce-scatter
        starts as soon as its gradients are final, overlapping the rest of the backward; else
        it changes nothing."""
        return self.reduction.last_backward() if self.reduction is not None else nullcontext()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(
        self, max_grad_norm: float, loss: torch.Tensor | None = None, timer=None
    ) -> tuple[torch.Tensor | None, bool]:
        """Clip the gradients (max_grad_norm > 0) and step AdamW, unless the gradient norm or
        `loss` is NaN/inf: then the gradients are dropped and nothing changes. Returns the
        gradient norm before clipping as a 0-d tensor on the device (None when nothing had a
        gradient) and whether the step was taken (False: skipped as non-finite). In a
        data-parallel job the gradients are summed over the ranks first, and a step is skipped on
        every rank when it is non-finite on any. `timer` (a PhaseTimer) times a sharded job's
        weight gather as its own phase."""
        norm, taken = self._step(max_grad_norm, loss, timer)
        self.updates += taken and norm is not None
        if taken:
            adapters_stepped()  # LoRA's cached factors (fused AdamW moves no version counter)
        return norm, taken

    def _step(
        self, max_grad_norm: float, loss: torch.Tensor | None = None, timer=None
    ) -> tuple[torch.Tensor | None, bool]:
        """`step` without its count of the steps taken."""
        if self.sharded is not None:
            if not self.reduction.finish():
                return None, True
            return self._step_shards(self.sharded, max_grad_norm, loss, timer)
        if self.fully_sharded is not None:
            if not self.world.any(self.fully_sharded.has_gradients(), self.params[0].device):
                self.zero_grad()  # no rank ran a backward: nothing to step
                self.adamw.step()
                return None, True
            return self._step_shards(self.fully_sharded, max_grad_norm, loss, timer)
        if self.reduction is not None:  # replicated: summed during the last backward
            if not self.reduction.finish():
                return None, True
            self.replicated.deliver()
        elif self.masters is not None and not self.masters.load_gradients():
            return None, True
        grads = [p.grad for p in self._stepped if p.grad is not None]
        if not grads:
            self.adamw.step()  # changes nothing; the schedule sees the optimizer stepped
            return None, True
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        finite = bool(
            (torch.isfinite(norm) if loss is None else torch.isfinite(norm + loss)).item()
        )
        if self.world is not None:  # a rank's own loss may be NaN where the sums are not
            finite = not self.world.any(not finite, norm.device)
        if not finite:  # the one host sync of a step: a NaN step must not reach AdamW
            self.zero_grad()
            if self.masters is not None:
                self.masters.release_gradients()
            return norm, False
        if max_grad_norm > 0:  # as clip_grad_norm_ does, with the norm computed above
            torch._foreach_mul_(grads, (max_grad_norm / (norm + 1e-6)).clamp(max=1.0))
        self.adamw.step()
        if self.masters is not None:
            self.masters.refresh()
            self.masters.release_gradients()
        return norm, True

    def _step_shards(self, shards, max_grad_norm, loss, timer) -> tuple[torch.Tensor, bool]:
        """The step of a job whose ranks each hold gradient shards (`ShardedMasters`, or
        `FullySharded` whose shards hold 1/`gradient_scale` of the sum): the whole gradient's
        norm from every rank's pieces, the clip, AdamW on the shards, then the weight gather."""
        grads = shards.gradients()
        squares = torch.stack(torch._foreach_norm(grads)).square().sum()
        scale = shards.gradient_scale
        norm = self.world.sum(squares).sqrt()  # every rank's shards: the whole gradient's norm
        if scale != 1.0:
            norm = norm * scale
        finite = bool(
            (torch.isfinite(norm) if loss is None else torch.isfinite(norm + loss)).item()
        )
        if self.world.any(not finite, norm.device):
            shards.release_gradients()
            return norm, False
        if max_grad_norm > 0 or scale != 1.0:
            factor = torch.full((), scale, device=norm.device)
            if max_grad_norm > 0:
                factor = factor * (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, factor)
        self.adamw.step()
        shards.release_gradients()
        with timer("weight_gather") if timer is not None else nullcontext():
            shards.gather_weights()
        return norm, True

    def state_dict(self) -> dict:
        """The optimizer's state to save: its moments, masters and rounding stream. A sharded
        job's is only what describes its shards, which every rank writes with `save_shards`."""
        if self.sharded is not None:
            return self._shards_description()
        if self.fully_sharded is not None:
            stepped = self.fully_sharded.stepped(self.adamw)
            return {"shards": SHARDS_FOLDER, "layout": "fsdp", "stepped": stepped}
        state = {"adamw": self.adamw.state_dict()}
        if self.masters is not None:
            state["master_weights"] = self.masters.state_dict()
            state["rounding_rng"] = self.masters.generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        if "adamw" not in state and "shards" not in state:  # from before master weights
            state = {"adamw": state}
        check_layout(state, fsdp=self.fully_sharded is not None)
        if self.fully_sharded is not None:
            return self.fully_sharded.load(self.adamw, state["shards"], state["stepped"])
        if "shards" in state and self.sharded is not None:
            return self._load_checkpoint_shards(state)
        if "shards" in state:  # a sharded run's checkpoint, continued without sharding
            from fastgrpo.distributed.sharded import read_one_process_state

            state = read_one_process_state(state, self.params, _low_precision)
        if self.sharded is not None:  # a one-process (or replicated) checkpoint, now sharded
            return self._load_shards(state)
        self.adamw.load_state_dict(state["adamw"])
        if self.masters is not None and "master_weights" in state:
            self.masters.load_state_dict(state["master_weights"])
        if self.masters is not None and "rounding_rng" in state:
            self.masters.generator.set_state(state["rounding_rng"].cpu())
        # else: no saved masters; they were copied from the loaded model's weights already

    def _has_moments(self) -> bool:
        """Whether AdamW has stepped the shards (its moments exist) yet."""
        return bool(self.adamw.state.get(self.sharded.flats[0]))

    def _set_moments(self, step: float, exp_avg: list, exp_avg_sq: list) -> None:
        """AdamW's state of each flat shard, as its first step would have made it."""
        for flat, avg, sq in zip(self.sharded.flats, exp_avg, exp_avg_sq):
            where = flat.device if flat.is_cuda else "cpu"  # fused AdamW counts on the GPU
            self.adamw.state[flat] = {
                "step": torch.tensor(step, dtype=torch.float32, device=where),
                "exp_avg": avg,
                "exp_avg_sq": sq,
            }

    def _shards_description(self) -> dict:
        stepped = self._has_moments()
        index = {id(p): i for i, p in enumerate(self.sharded.params)}
        groups = [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [index[id(p)] for p in params],
            }
            for group, params in zip(self.adamw.param_groups, self.sharded.groups)
        ]
        step = float(self.adamw.state[self.sharded.flats[0]]["step"]) if stepped else 0.0
        return {"shards": SHARDS_FOLDER, "bucket_elements": self.sharded.bucket_elements,
                "stepped": stepped, "step": step, "param_groups": groups}  # fmt: skip

    def save_shards(self, checkpoint: Path | None) -> None:
        """Every rank writes its masters and moments into the checkpoint folder rank 0 is
        writing (`checkpoint` on rank 0; the others pass None and are told), through
        torch.distributed.checkpoint. A collective."""
        import torch.distributed.checkpoint as dcp

        folder = self.world.broadcast(None if checkpoint is None else str(checkpoint))
        if not Path(folder).is_dir():  # shards written elsewhere would leave a broken checkpoint
            raise RuntimeError(
                f"rank {self.world.rank} cannot see {folder}, the checkpoint rank 0 is writing: "
                "put run.output_dir on a filesystem every machine of the job shares"
            )
        if self.fully_sharded is not None:
            return self.fully_sharded.save(self.adamw, Path(folder) / SHARDS_FOLDER)
        tensors = self.sharded.checkpoint_tensors(self.adamw, with_moments=self._has_moments())
        dcp.save(tensors, checkpoint_id=Path(folder) / SHARDS_FOLDER)

    @torch.no_grad()
    def _load_checkpoint_shards(self, meta: dict) -> None:
        import torch.distributed.checkpoint as dcp

        shards = self.sharded
        if meta["bucket_elements"] != shards.bucket_elements:
            raise ValueError(
                f"the checkpoint's optimizer shards use buckets of {meta['bucket_elements']} "
                f"elements and this fastgrpo {shards.bucket_elements}; resume with the fastgrpo "
                "version that wrote it"
            )
        if meta["stepped"]:  # zeros for the load to fill
            zeros = [[torch.zeros_like(f) for f in shards.flats] for _ in range(2)]
            self._set_moments(meta["step"], *zeros)
        dcp.load(
            shards.checkpoint_tensors(self.adamw, meta["stepped"]), checkpoint_id=meta["shards"]
        )
        shards.gathers = int(meta["step"])  # the rounding's stream goes on where it was

    @torch.no_grad()
    def _load_shards(self, state: dict) -> None:
        shards = self.sharded
        low = [p for p in self.params if _low_precision(p)]
        saved = dict(zip(map(id, low), state.get("master_weights", [])))
        values = [saved.get(id(p), p.detach()) for p in shards.params]  # no masters: the weights
        for flat, piece in zip(shards.flats, shards.shards_of(values)):
            flat.copy_(piece)
        per_param = state["adamw"]["state"]
        if not per_param:
            return
        moments = {
            key: shards.shards_of([per_param[i][key] for i in range(len(shards.params))])
            for key in ("exp_avg", "exp_avg_sq")
        }
        step = float(per_param[0]["step"])
        shards.gathers = int(step)  # the rounding's stream goes on where it was
        self._set_moments(step, moments["exp_avg"], moments["exp_avg_sq"])


def check_layout(state: dict, fsdp: bool) -> None:
    """A UserError naming what to do when a checkpoint's optimizer state was written by FSDP
    and is resumed without it, or the other way round (the two keep different tensors)."""
    written = state.get("layout") == "fsdp"
    if written and not fsdp:
        raise UserError(
            "this checkpoint's optimizer state was written by train.parallel=fsdp; resume it "
            "with --set train.parallel=fsdp under torchrun (any number of processes)"
        )
    if fsdp and not written:
        raise UserError(
            "train.parallel=fsdp resumes only checkpoints written by train.parallel=fsdp (any "
            "number of processes); resume this one with train.parallel=sharded or replicated"
        )


def _low_precision(param) -> bool:
    return param.dtype in LOW_PRECISION


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, kind: str, warmup_steps: int, total_steps: int
):
    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

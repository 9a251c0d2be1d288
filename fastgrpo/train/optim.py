"""The optimizer step (AdamW, fused on CUDA, over fp32 masters of bf16 weights) and the schedule."""

from __future__ import annotations

import math

import torch

from fastgrpo.train.precision import LOW_PRECISION, MasterWeights, wants_masters


class ModelOptimizer:
    """AdamW over a model's trainable parameters, or over their fp32 masters (`precision.py`).

    `zero_grad`, then backward passes, then `step`: the same calls with or without masters.
    With a `world` (`distributed.World`, a data-parallel job), `step` first sums the gradients
    over the ranks, each rank's loss being divided by the global batch's counts already.
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
    ):
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters (requires_grad is off)")
        self.masters = None
        stepped = self.params
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
        self.world = world if world is not None and world.size > 1 else None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self, max_grad_norm: float) -> torch.Tensor | None:
        """Clip the gradients (max_grad_norm > 0) and step AdamW; the gradient norm before
        clipping as a 0-d tensor on the device (None when not clipping or nothing had a gradient)."""
        if self.world is not None and not self._sum_gradients_over_ranks():
            return None
        if self.masters is not None and not self.masters.load_gradients():
            return None
        if self.world is not None and self.masters is not None:
            full = [p.grad for p in self._stepped[len(self.masters.masters) :]]
            self.world.all_reduce_sum_([self.masters.gradient_buffer(), *full])
        norm = None
        if max_grad_norm > 0:
            grads = [p for p in self._stepped if p.grad is not None]
            if grads:
                norm = torch.nn.utils.clip_grad_norm_(grads, max_grad_norm)
        self.adamw.step()
        if self.masters is not None:
            self.masters.refresh()
            self.masters.release_gradients()
        return norm

    def _sum_gradients_over_ranks(self) -> bool:
        """Before a data-parallel step: False (every rank skips it) when no rank has a gradient;
        else each parameter without one here gets zeros, and without masters the gradients are
        summed now (with masters, in fp32 once they are loaded)."""
        present = any(p.grad is not None for p in self.params)
        if not self.world.any(present, self.params[0].device):
            return False
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.masters is None:
            self.world.all_reduce_sum_([p.grad for p in self.params])
        return True

    def state_dict(self) -> dict:
        state = {"adamw": self.adamw.state_dict()}
        if self.masters is not None:
            state["master_weights"] = self.masters.state_dict()
            state["rounding_rng"] = self.masters.generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        if "adamw" not in state:  # a checkpoint from before master weights: AdamW's own state
            state = {"adamw": state}
        self.adamw.load_state_dict(state["adamw"])
        if self.masters is not None and "master_weights" in state:
            self.masters.load_state_dict(state["master_weights"])
        if self.masters is not None and "rounding_rng" in state:
            self.masters.generator.set_state(state["rounding_rng"].cpu())
        # else: no saved masters; they were copied from the loaded model's weights already


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

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

    def step(
        self, max_grad_norm: float, loss: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, bool]:
        """Clip the gradients (max_grad_norm > 0) and step AdamW, unless the gradient norm or
        `loss` is NaN/inf: then the gradients are dropped and nothing changes. Returns the
        gradient norm before clipping as a 0-d tensor on the device (None when nothing had a
        gradient) and whether the step was taken (False: skipped as non-finite). In a
        data-parallel job the gradients are summed over the ranks first, and a step is skipped on
        every rank when it is non-finite on any."""
        if self.world is not None and not self._sum_gradients_over_ranks():
            return None, True
        if self.masters is not None and not self.masters.load_gradients():
            return None, True
        if self.world is not None and self.masters is not None:
            full = [p.grad for p in self._stepped[len(self.masters.masters) :]]
            self.world.all_reduce_sum_([self.masters.gradient_buffer(), *full])
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

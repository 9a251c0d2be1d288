"""The update phase of a GRPO step: K inner epochs over the planned mini-batches, each one
optimizer step over the gradients its micro-batches accumulate.

The rows, the mini-batches and the micro-batches are planned before (`batching.plan_update`), the
reference and old log-probs scored before (`scoring.py`), and the loss chosen once at setup
(`step_loss.choose_loss`); this module runs the forward and backward passes and the steps.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from fastgrpo.kernels.support import interpreting, kernel_dtype, triton
from fastgrpo.train.batching import MicroBatch, MiniBatch
from fastgrpo.train.logprobs import layout_of, lm_head_weight
from fastgrpo.train.optim import ModelOptimizer
from fastgrpo.train.profiling import PhaseTimer
from fastgrpo.train.scoring import run_idle_passes
from fastgrpo.train.step_loss import MicroBatchLoss


def use_fused_lm_head(mode: str, model) -> bool:
    """Whether the update runs the fused LM-head + loss kernels (`mode`: train.fused_lm_head)."""
    on_gpu = model.device.type == "cuda"
    if mode == "on" and triton is None:
        raise ValueError(
            "train.fused_lm_head=on needs Triton: `pip install triton`, or set it to auto"
        )
    if mode == "on" and not (on_gpu or interpreting()):
        raise ValueError(
            f"train.fused_lm_head=on runs Triton kernels, which need the model on a CUDA GPU "
            f"(model.device is {model.device.type}); set train.fused_lm_head=auto or off, or "
            "TRITON_INTERPRET=1 to run the kernels in Triton's (slow) interpreter on the CPU"
        )
    # auto leaves an fp32 LM head to PyTorch: the kernels' fp32 dots run on CUDA cores, ~11x
    # slower than cuBLAS (H100, 4,096 x 576 x 49,152 fwd+bwd: 367 ms against 32)
    return mode == "on" or (
        mode == "auto"
        and triton is not None
        and on_gpu
        and kernel_dtype("the fused LM-head loss", lm_head_weight(model).dtype)
    )


def update_policy(
    model,
    optimizer: ModelOptimizer,
    scheduler,
    plan: list[MiniBatch],
    loss: MicroBatchLoss,
    *,
    num_iterations: int,
    max_grad_norm: float,
    timer: PhaseTimer,
) -> dict:
    """`num_iterations` epochs of one optimizer step per mini-batch; the averaged metrics.

    An optimizer step whose loss or gradient norm is NaN/inf is skipped (the weights and AdamW's
    state stay as they were) and counted in "skipped_steps".
    `timer` gets the phases update (forward and backward passes) and optimizer (clipping, AdamW,
    the bf16 refresh from the fp32 masters and the schedule, summed over the optimizer steps), and
    in a sharded data-parallel job weight_gather (the whole weights put back together).
    """
    totals = _Totals(device=next(model.parameters()).device)
    model.train()
    for mb in {id(mb): mb for mini in plan for mb in mini.micro}.values():
        layout_of(mb.rollout)  # each micro-batch's host read now: none inside the passes
    with timer("update"):
        for mini in [mini for _ in range(num_iterations) for mini in plan]:
            optimizer.zero_grad()
            mini_loss = _accumulate_gradients(model, mini, loss, optimizer, totals)
            with timer("optimizer"):
                norm, stepped = optimizer.step(max_grad_norm, mini_loss, timer)
                totals.add_norm(norm)
                totals.skipped += not stepped
                scheduler.step()  # a skipped step keeps the schedule: it is a step of the run
    return totals.read(steps=num_iterations * len(plan), plan=plan)


def _accumulate_gradients(
    model, mini: MiniBatch, loss: MicroBatchLoss, optimizer: ModelOptimizer, totals: _Totals
) -> torch.Tensor:
    """The micro-batches' backward passes; the mini-batch's loss (0-d, on the device). The last
    runs under `optimizer.last_backward()`: a sharded job reduces gradients during it."""
    total = torch.zeros((), device=totals.weight.device)
    for i, mb in enumerate(mini.micro):
        value, metrics = loss(model, mb, mini.num_sequences, mini.num_tokens)
        if value.requires_grad:  # False when every token is masked (all truncated)
            last = i == len(mini.micro) - 1
            with optimizer.last_backward() if last else nullcontext():
                value.backward()
        value = value.detach()  # the pass's autograd graph dies here (captured_layers needs it)
        totals.add(value, metrics, mb)
        total += value.float()
    run_idle_passes(model, mini.idle_passes, with_grad=True)
    return total


class _Totals:
    """The update's metrics, summed on the device so the host never waits for a micro-batch; one
    read at the end."""

    def __init__(self, device):
        self.sums: dict[str, torch.Tensor] = {}  # token-weighted sums of the loss's metrics
        self.weight = torch.zeros((), device=device)
        self.loss = torch.zeros((), device=device)  # = sum of the optimizer steps' losses
        self.norms: list[torch.Tensor] = []
        self.skipped = 0  # optimizer steps skipped because the loss or gradient was NaN/inf

    def add(self, loss: torch.Tensor, metrics: dict, mb: MicroBatch) -> None:
        self.loss += loss.detach().float()
        tokens = mb.rollout.completion_mask.sum().float()
        self.weight += tokens
        for name, value in metrics.items():  # detached 0-d tensors
            self.sums[name] = self.sums.get(name, 0.0) + value.float() * tokens

    def add_norm(self, norm: torch.Tensor | None) -> None:
        if norm is not None:
            self.norms.append(norm.float())

    def read(self, *, steps: int, plan: list[MiniBatch]) -> dict:
        names = list(self.sums)
        stacked = [self.sums[n] for n in names] + [self.weight, self.loss] + self.norms
        values = torch.stack(stacked).tolist()  # the one sync
        k = len(names)
        sums, (weight, loss), norms = values[:k], values[k : k + 2], values[k + 2 :]
        out = {name: value / weight for name, value in zip(names, sums)} if weight else {}
        out["loss"] = loss / steps  # mean over optimizer steps
        if norms:
            out["grad_norm"] = sum(norms) / len(norms)
        rows = sum(mini.rows for mini in plan)
        active = sum(mb.advantages.numel() for mini in plan for mb in mini.micro)
        out["active_rows_frac"] = active / rows
        out["skipped_steps"] = self.skipped
        return out

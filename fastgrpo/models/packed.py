"""Linears that read one input, packed so that one GEMM computes all of them.

The rollout engine's decode step runs q/k/v and gate/up at 64-256 rows, where each GEMM is a few
microseconds of mostly fixed cost: one GEMM per group instead of three and two saves launches
and reads the input once. The packed weight is the storage of the HF-named parameters, so
training, checkpoints and optimizers see the same parameters as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PackedLinears:
    """Linears of one input packed into one weight (and bias) whose row blocks ARE their
    parameters: one GEMM computes all their outputs. The parameters stay separate leaves with their
    HF names; an optimizer updates them in place, so the packed tensor follows with no copy. If a
    parameter is replaced (`load_state_dict(assign=True)`, `.to()`), `intact()` turns False and
    the model falls back to one GEMM per linear."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears
        self.sizes = [m.out_features for m in linears]
        self.weight = torch.cat([m.weight.detach() for m in linears])  # (sum out, in)
        self._adopt("weight", self.weight)
        self.bias = None
        if linears[0].bias is not None:
            self.bias = torch.cat([m.bias.detach() for m in linears])  # (sum out,)
            self._adopt("bias", self.bias)
        self.pointers = self._pointers()

    def _adopt(self, name: str, packed: torch.Tensor) -> None:
        for m, part in zip(self.linears, packed.split(self.sizes)):
            old = getattr(m, name)
            setattr(m, name, nn.Parameter(part, requires_grad=old.requires_grad))

    def _pointers(self) -> tuple[int, ...]:
        params = [m.weight for m in self.linears] + [
            m.bias for m in self.linears if m.bias is not None
        ]
        return tuple(p.data_ptr() for p in params)

    def intact(self) -> bool:
        return self._pointers() == self.pointers

    def readdress(self) -> None:
        """The packed storage was allocated again in place (resized: its parameters still view
        it, at new addresses): take those as intact."""
        self.pointers = self._pointers()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def packed_linear(x: torch.Tensor, linears: list[nn.Linear], packed: PackedLinears | None):
    """(T, sum out) = x @ [W_1; W_2; ...]^T (+ biases): the outputs of several linears of one
    input by one GEMM, with autograd to each linear's own parameters.

    With `packed` intact the GEMMs read its weight, the storage the parameters are views of, so
    nothing is copied; otherwise the weights are concatenated first (a copy autograd keeps for
    the backward). The backward is one GEMM for x's gradient and one for all the weights'.
    """
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears if m.bias is not None]
    if len(biases) not in (0, len(linears)):
        raise ValueError("packed linears must all have a bias or all have none")
    if packed is None or not packed.intact():
        bias = torch.cat(biases) if biases else None
        return F.linear(x, torch.cat(weights), bias)
    return _PackedLinear.apply(x, packed.weight, packed.bias, *weights, *biases)


class _PackedLinear(torch.autograd.Function):
    """F.linear by a packed weight whose row blocks are the given parameters (`PackedLinears`):
    the gradient of the packed weight (and bias) is split back into the parameters'."""

    @staticmethod
    def forward(ctx, x, packed_weight, packed_bias, *params):
        ctx.save_for_backward(x, packed_weight)
        ctx.sizes = [
            p.shape[0] for p in params[: len(params) // (2 if packed_bias is not None else 1)]
        ]
        ctx.has_bias = packed_bias is not None
        return F.linear(x, packed_weight, packed_bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        n = len(ctx.sizes)
        wants_params = ctx.needs_input_grad[3:]
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None  # (T, in)
        grads = [None] * len(wants_params)
        flat = grad_out.reshape(-1, grad_out.shape[-1])  # (T, sum out)
        if any(wants_params[:n]):
            weight_grads = (flat.t() @ x.reshape(-1, x.shape[-1])).split(ctx.sizes)
            grads[:n] = [g if want else None for g, want in zip(weight_grads, wants_params[:n])]
        if ctx.has_bias and any(wants_params[n:]):
            bias_grads = flat.sum(0).split(ctx.sizes)
            grads[n:] = [g if want else None for g, want in zip(bias_grads, wants_params[n:])]
        return grad_x, None, None, *grads

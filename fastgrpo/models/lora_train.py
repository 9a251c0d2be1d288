"""LoRA inside the training GEMMs: each adapter's low-rank part computed in the autograd Function
of the frozen base linear it belongs to, in the activations' dtype.

For a linear (or a packed group: q/k/v, gate/up) with adapters, the forward is

    y = x W^T + b,   then for each adapted block of columns i:   y_i += (x A_i^T) (s_i B_i)^T

with A and B (fp32 parameters) cast to x's dtype, each GEMM accumulating in fp32 and rounding
once, as bf16 autocast runs peft's layers. Autograd keeps x (the layer keeps it anyway) and the
(tokens, rank) products, nothing of (tokens, out) or an fp32 copy of x; the backward gives x's
gradient in one GEMM plus one rank-R update, and A's and B's as (rank, in) and (out, rank) GEMMs.
The down projection's adapter reads silu(gate) * up, which the fused MLP recomputes in its
backward (`LoraSiluMulLinear`), so its input is never kept either.

On an H200 (7B shape, r=16 on all linears, 8 x 8 x 512 tokens) the adapters' fp32 elementwise
passes over (tokens, out) tensors had taken the update from ~2.3 s (the base's GEMMs) to 5.7 s
and its peak up by ~7 GiB (benchmarks/results/lora_step_h200.txt).

An fp32 model computes the same expressions in fp32 (CPU tests compare with peft there). With
dropout (training), or a base weight that trains, the callers use the plain modules instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastgrpo.kernels.layers.swiglu import (
    _train_kernels_take,
    silu_mul_backward_triton,
    silu_mul_triton,
)


def _adapted(m) -> bool:
    return getattr(m, "enabled", False) and hasattr(m, "lora_A")


def takes(linears) -> bool:
    """Whether the in-GEMM path serves these linears: some adapter enabled, no dropout while
    training, and frozen base weights (and biases)."""
    if not any(_adapted(m) for m in linears):
        return False
    for m in linears:
        if _adapted(m) and m.dropout and m.training:
            return False
        if m.weight.requires_grad or (m.bias is not None and m.bias.requires_grad):
            return False
    return True


class LowRankLinear(torch.autograd.Function):
    """x W^T + b plus s_i (x A_i^T) B_i^T on column blocks `spans` (start, end) of the output.
    `factors`: A_0.. A_k-1, B_0.. B_k-1 (the adapters' parameters); W and b are frozen."""

    @staticmethod
    def forward(ctx, x, weight, bias, spans, scalings, *factors):
        k = len(spans)
        dtype = x.dtype
        a_cat = torch.cat([a.to(dtype) for a in factors[:k]])  # (R, in)
        flat = x.reshape(-1, x.shape[-1])
        low = flat @ a_cat.t()  # (T, R)
        y = F.linear(flat, weight, bias)  # (T, out)
        ranks = [a.shape[0] for a in factors[:k]]
        for (start, end), part, b, s in zip(spans, low.split(ranks, 1), factors[k:], scalings):
            y[:, start:end].addmm_(part, (b * s).to(dtype).t())
        ctx.spans, ctx.scalings, ctx.ranks = spans, scalings, ranks
        ctx.save_for_backward(x, weight, low, a_cat, *factors)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, weight, low, a_cat, *factors = ctx.saved_tensors
        k = len(ctx.spans)
        a_list, b_list = factors[:k], factors[k:]
        dtype = x.dtype
        flat_x = x.reshape(-1, x.shape[-1])
        flat = grad.reshape(-1, grad.shape[-1])
        scaled = [(b * s).to(dtype) for b, s in zip(b_list, ctx.scalings)]
        blocks = [flat[:, start:end] for start, end in ctx.spans]
        d_low = torch.cat([g @ b for g, b in zip(blocks, scaled)], dim=1)  # (T, R)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.addmm(flat @ weight, d_low, a_cat).view_as(x)
        grad_a = (d_low.t() @ flat_x).split(ctx.ranks)  # (r_i, in)
        grad_b = [
            (g.t() @ part).to(b.dtype) * s
            for g, part, b, s in zip(blocks, low.split(ctx.ranks, 1), b_list, ctx.scalings)
        ]  # (out_i, r_i)
        grad_a = [g.to(a.dtype) for g, a in zip(grad_a, a_list)]
        return grad_x, None, None, None, None, *grad_a, *grad_b


def lora_linear(x: torch.Tensor, linears, packed=None) -> torch.Tensor:
    """The linears' outputs side by side (one packed GEMM when `packed`, a `PackedLinears` of
    them, is intact) with their adapters' parts; call only where `takes(linears)`."""
    if packed is not None and packed.intact():
        weight, bias = packed.weight, packed.bias
    elif len(linears) == 1:
        weight, bias = linears[0].weight, linears[0].bias
    else:
        weight = torch.cat([m.weight for m in linears])
        biases = [m.bias for m in linears if m.bias is not None]
        bias = torch.cat(biases) if biases else None
    spans, scalings, a_list, b_list = [], [], [], []
    start = 0
    for m in linears:
        if _adapted(m):
            spans.append((start, start + m.out_features))
            scalings.append(m.scaling)
            a_list.append(m.lora_A.weight)
            b_list.append(m.lora_B.weight)
        start += m.out_features
    return LowRankLinear.apply(x, weight, bias, tuple(spans), tuple(scalings), *a_list, *b_list)


class LoraSiluMulLinear(torch.autograd.Function):
    """down(silu(gate) * up) with down's adapter, keeping gate_up (as the fused MLP does) and the
    (T, r) product: silu(gate) * up is recomputed in the backward by the same kernel."""

    @staticmethod
    def forward(ctx, gate_up, inner, weight, bias, scaling, a, b):
        dtype = gate_up.dtype
        act = silu_mul_triton(*gate_up.split(inner, dim=-1))  # (T, I)
        a_low = a.to(dtype)
        low = act @ a_low.t()  # (T, r)
        out = F.linear(act, weight, bias)
        out.addmm_(low, (b * scaling).to(dtype).t())
        ctx.inner, ctx.scaling = inner, scaling
        ctx.save_for_backward(gate_up, weight, low, a_low, a, b)
        return out

    @staticmethod
    def backward(ctx, d_out):
        gate_up, weight, low, a_low, a, b = ctx.saved_tensors
        d_out = d_out.contiguous()
        d_low = d_out @ (b * ctx.scaling).to(d_out.dtype)  # (T, r)
        d_act = torch.addmm(d_out @ weight, d_low, a_low)  # (T, I)
        d_gate_up, act = silu_mul_backward_triton(gate_up, d_act, ctx.inner, True)
        grad_a = (d_low.t() @ act).to(a.dtype)
        grad_b = (d_out.t() @ low).to(b.dtype) * ctx.scaling
        return d_gate_up, None, None, None, None, grad_a, grad_b


def lora_silu_mul_linear(gate_up: torch.Tensor, inner: int, down) -> torch.Tensor | None:
    """down_proj(silu(gate) * up) with its adapter in the fused MLP's Function; None where that
    path does not serve (no enabled adapter, dropout, a training base, no kernels)."""
    if not takes([down]) or not _train_kernels_take(gate_up):
        return None
    return LoraSiluMulLinear.apply(
        gate_up, inner, down.weight, down.bias, down.scaling, down.lora_A.weight, down.lora_B.weight
    )


class LowRankInput(torch.autograd.Function):
    """x (..., in) times A^T (A: (r, in), fp32) in fp32 -> (..., r), saving x in its own dtype:
    the fp32 copy of x exists only inside the forward and the backward. The same values as
    `F.linear(x.float(), A)`, without keeping a (tokens, in) fp32 tensor per adapter."""

    @staticmethod
    def forward(ctx, x, a):
        ctx.save_for_backward(x, a)
        return F.linear(x.to(a.dtype), a)

    @staticmethod
    def backward(ctx, grad):
        x, a = ctx.saved_tensors
        grad_x = (grad @ a).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_a = None
        if ctx.needs_input_grad[1]:
            grad_a = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(a.dtype)
        return grad_x, grad_a


def _swiglu_in(gate_up: torch.Tensor, inner: int, dtype: torch.dtype):
    gate, up = gate_up.to(dtype).split(inner, dim=-1)
    return gate, up, F.silu(gate)


class SwigluLowRankInput(torch.autograd.Function):
    """(silu(gate) * up) A^T in fp32 for gate_up (..., 2 inner): down_proj's adapter input,
    recomputed in the backward from gate_up instead of kept."""

    @staticmethod
    def forward(ctx, gate_up, inner, a):
        ctx.inner = inner
        ctx.save_for_backward(gate_up, a)
        gate, up, silu = _swiglu_in(gate_up, inner, a.dtype)
        return F.linear(silu * up, a)

    @staticmethod
    def backward(ctx, grad):
        gate_up, a = ctx.saved_tensors
        gate, up, silu = _swiglu_in(gate_up, ctx.inner, a.dtype)
        grad_a = None
        if ctx.needs_input_grad[2]:
            act = (silu * up).reshape(-1, ctx.inner)
            grad_a = grad.reshape(-1, grad.shape[-1]).t() @ act
        grad_gate_up = None
        if ctx.needs_input_grad[0]:
            grad_act = grad @ a  # (..., inner)
            sigmoid = torch.sigmoid(gate)
            grad_gate = grad_act * up * sigmoid * (1 + gate * (1 - sigmoid))
            grad_gate_up = torch.cat([grad_gate, grad_act * silu], dim=-1).to(gate_up.dtype)
        return grad_gate_up, None, grad_a

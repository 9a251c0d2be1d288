"""LoRA inside the training GEMMs: each adapter's low-rank part computed in the autograd Function
of the frozen base linear it belongs to, in the activations' dtype.

For a linear (or a packed group: q/k/v, gate/up) with adapters, the forward is

    y = x W^T + b,   then for each adapted block of columns i:   y_i += s_i (x A_i^T) B_i^T

with A and B (fp32 parameters) cast to x's dtype, each GEMM accumulating in fp32 and rounding
once, as bf16 autocast runs peft's layers (the scaling s_i is the GEMM's alpha). On CUDA the
adapters' gradients come out of their GEMMs in fp32 (`scaled_product`): no bf16 rounding of them,
no cast launched. Autograd keeps x (the layer keeps it anyway) and the
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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastgrpo.kernels.layers.swiglu import (
    _train_kernels_take,
    silu_mul_backward_triton,
    silu_mul_triton,
)


def has_adapter(m) -> bool:
    """Whether linear `m` is a LoRA linear with its adapter switched on."""
    return getattr(m, "enabled", False) and hasattr(m, "lora_A")


def takes(linears) -> bool:
    """Whether the in-GEMM path serves these linears: some adapter enabled, no dropout while
    training, and frozen base weights (and biases)."""
    if not any(has_adapter(m) for m in linears):
        return False
    for m in linears:
        if has_adapter(m) and m.dropout and m.training:
            return False
        if m.weight.requires_grad or (m.bias is not None and m.bias.requires_grad):
            return False
    return True


@dataclass(frozen=True)
class Factors:
    """A group's adapters as two matrices in the activations' dtype: a_cat (R, in), the A's
    stacked, and b_bd (out, R), block-diagonal: adapter i's (s_i / alpha) B_i at its output rows
    and its rank columns (zeros for a linear without adapter), so one GEMM applies every adapter
    of a packed group: y += alpha (x a_cat^T) b_bd^T. `alpha` is the group's scaling s when its
    adapters share one (the usual case: then b_bd holds the B's as they are and the GEMM applies
    s), else 1. `blocks`: (first row, end row, first rank column, end rank column, s) each."""

    a_cat: torch.Tensor
    b_bd: torch.Tensor
    blocks: tuple
    alpha: float


CACHE = "_lora_factors"  # attribute of a group's first linear: (key, Factors)
MERGED = "_lora_merged_weight"  # attribute of an adapted linear: {group size: merged weight}
_STEPS = [0]  # optimizer steps that changed adapters (`adapters_stepped`)
AFTER_STEP: list = []  # callables run after an optimizer step changed adapters (MergedWeights)


def adapters_stepped() -> None:
    """An optimizer changed adapters in place: every cached `Factors` is refilled, and the
    merged copies the trainer computes with are refreshed now (`AFTER_STEP`). Needed because
    fused AdamW (the trainer's on GPUs) leaves the parameters' version counters as they were;
    every other in-place change (a load, a copy) moves them."""
    _STEPS[0] += 1
    for refresh in list(AFTER_STEP):
        refresh()


def merged_weight(linears, packed) -> torch.Tensor | None:
    """The group's merged weight, W + s B A rounded to the activations' dtype as the rollout
    engine reads it (`MergedWeights` attaches it), for the forward and x's gradient: the
    trainer then computes the policy the engine samples, as full fine-tuning's bf16 copy of
    its fp32 masters is; None where none is attached (the base and the low-rank product)."""
    if len(linears) > 1 and (packed is None or not packed.intact()):
        return None  # a group's is attached for its packed GEMM only
    return attached_merged(linears)


def attached_merged(linears) -> torch.Tensor | None:
    """The merged weight `MergedWeights` attached for this group (its packed GEMM's when the
    group has several linears), whether or not the packing is still intact; None if none."""
    return linears[0].__dict__.get(MERGED, {}).get(len(linears))  # {group size: merged weight}


def factors(linears, dtype: torch.dtype, device: torch.device) -> Factors:
    """The group's `Factors`: cached on its first linear, made once and refilled in place after
    an optimizer step (`adapters_stepped`) or any other in-place change of an adapter (its
    version counter), so the casts run once per step instead of in every forward and backward,
    and no new tensors are allocated."""
    adapted = [m for m in linears if has_adapter(m)]
    shapes = (dtype, device) + tuple((id(m.lora_A.weight), m.scaling) for m in adapted)
    key = (
        shapes
        + (_STEPS[0],)
        + tuple((m.lora_A.weight._version, m.lora_B.weight._version) for m in adapted)
    )
    cached = linears[0].__dict__.get(CACHE)
    if cached is not None and cached[0] == key:
        return cached[1]
    if cached is not None and cached[0][: len(shapes)] == shapes:
        fill_factors(cached[1], linears)
        linears[0].__dict__[CACHE] = (key, cached[1])
        return cached[1]
    made = make_factors(linears, dtype, device)
    linears[0].__dict__[CACHE] = (key, made)
    return made


def cached_factors(linears) -> Factors | None:
    """The group's cached `Factors` as they are, without the staleness check or refill that
    `factors` does (None before `factors` made them)."""
    cached = linears[0].__dict__.get(CACHE)
    return None if cached is None else cached[1]


def make_factors(linears, dtype: torch.dtype, device: torch.device) -> Factors:
    """New `Factors` of the group's current adapters (not cached)."""
    adapted = [m for m in linears if has_adapter(m)]
    rank = sum(m.lora_A.weight.shape[0] for m in adapted)
    out = sum(m.out_features for m in linears)
    in_features = linears[0].in_features
    blocks, row, column = [], 0, 0
    for m in linears:
        if has_adapter(m):
            r = m.lora_A.weight.shape[0]
            blocks.append((row, row + m.out_features, column, column + r, m.scaling))
            column += r
        row += m.out_features
    scales = {m.scaling for m in adapted}
    made = Factors(
        torch.empty(rank, in_features, dtype=dtype, device=device),
        torch.zeros(out, rank, dtype=dtype, device=device),
        tuple(blocks),
        scales.pop() if len(scales) == 1 else 1.0,
    )
    fill_factors(made, linears)
    return made


@torch.no_grad()
def fill_factors(f: Factors, linears) -> None:
    """Write the group's current adapters into `f`'s tensors, in place (same blocks: the group's
    adapters are the ones `f` was made for)."""
    fill_factors_of([(f, linears)])


@torch.no_grad()
def fill_factors_of(groups: list) -> None:
    """`fill_factors` for many (Factors, linears) groups with one multi-tensor copy."""
    targets, sources = [], []
    for f, linears in groups:
        adapted = [m for m in linears if has_adapter(m)]
        targets += [f.a_cat[c0:c1] for _, _, c0, c1, _ in f.blocks]
        targets += [f.b_bd[r0:r1, c0:c1] for r0, r1, c0, c1, _ in f.blocks]
        sources += [m.lora_A.weight for m in adapted]
        sources += [
            m.lora_B.weight if s == f.alpha else m.lora_B.weight * (s / f.alpha)
            for m, (*_, s) in zip(adapted, f.blocks)
        ]
    torch._foreach_copy_(targets, sources)


_SCALED_PRODUCT = []  # the way `scaled_product` takes on CUDA (found by `_probe` once)


def scaled_product(a: torch.Tensor, b: torch.Tensor, alpha: float, dtype) -> torch.Tensor:
    """alpha (a @ b) in `dtype`: on CUDA, bf16/fp16 operands give an fp32 result from one GEMM
    (accumulated in fp32, rounded once to fp32: no bf16 copy of an adapter's gradient, no cast)."""
    if a.dtype == dtype or not a.is_cuda:
        return _gemm_then_cast(a, b, alpha, dtype)
    if not _SCALED_PRODUCT:
        _SCALED_PRODUCT.append(_probe(a.device))
    return _SCALED_PRODUCT[0](a, b, alpha, dtype)


def _probe(device):
    """The fastest form of `scaled_product` this torch has for mixed dtypes, checked on a small
    product against fp64: addmm with out_dtype (one GEMM), mm with out_dtype and a scaling,
    else the GEMM in the operands' dtype and a cast."""

    def one_gemm(a, b, alpha, dtype):
        return torch.addmm(a.new_empty((), dtype=dtype), a, b, beta=0, alpha=alpha, out_dtype=dtype)

    def gemm_then_scale(a, b, alpha, dtype):
        return torch.mm(a, b, out_dtype=dtype).mul_(alpha)

    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(24, 40, generator=g).to(device, torch.bfloat16)
    b = torch.randn(40, 16, generator=g).to(device, torch.bfloat16)
    want = 1.5 * (a.double() @ b.double())
    for way in (one_gemm, gemm_then_scale):
        try:
            got = way(a, b, 1.5, torch.float32)
        except (RuntimeError, TypeError):
            continue
        if got.dtype == torch.float32 and torch.allclose(got.double(), want, atol=1e-4):
            return way
    return _gemm_then_cast


def _gemm_then_cast(a, b, alpha, dtype):
    """alpha (a @ b) from a GEMM in the operands' dtype, then cast to `dtype`."""
    return torch.addmm(a.new_empty(()), a, b, beta=0, alpha=alpha).to(dtype)


class LowRankLinear(torch.autograd.Function):
    """x W^T + b + alpha (x a_cat^T) b_bd^T: a frozen (packed) linear and its adapters
    (`Factors`); with `merged` (W + s B A rounded as the engine reads it, `merged_weight`)
    x merged^T + b instead, x's gradient through `merged`, the adapters' gradients the same
    (straight through the rounding). `params`: the A's then the B's, which get gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias, f: Factors, merged, *params):
        flat = x.reshape(-1, x.shape[-1])
        low = flat @ f.a_cat.t()  # (T, R): kept for the B's gradients either way
        if merged is not None:  # the merged weight holds the low-rank part already
            y = F.linear(flat, merged, bias)
            weight = merged
        else:
            y = F.linear(flat, weight, bias)  # (T, out)
            y.addmm_(low, f.b_bd.t(), alpha=f.alpha)
        ctx.f, ctx.merged = f, merged is not None
        ctx.save_for_backward(x, weight, low, *params)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, weight, low, *params = ctx.saved_tensors
        f = ctx.f
        flat = grad.reshape(-1, grad.shape[-1])
        d_low = flat @ f.b_bd  # (T, R): the gradient of low, over alpha
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = flat @ weight
            if not ctx.merged:
                # in place: an out-of-place addmm copies its (T, in) input first (a memcpy per
                # group per micro-batch, ~4 ms of an update at the 0.5B shape)
                grad_x.addmm_(d_low, f.a_cat, alpha=f.alpha)
            grad_x = grad_x.view_as(x)
        grad_a, grad_b = _adapter_grads(flat, d_low, x.reshape(-1, x.shape[-1]), low, f, params)
        return grad_x, None, None, None, None, *grad_a, *grad_b


def _adapter_grads(grad_out, d_low, x, low, f: Factors, params):
    """Each A's and B's gradient in its parameter's dtype: the A's from one (R, in) GEMM (views
    of its rows), each B from a GEMM of its own block, s_i dY_i^T low_i (contiguous, so autograd
    keeps it as the .grad without a copy). `params`: the A's then the B's."""
    k = len(params) // 2
    grad_a_cat = scaled_product(d_low.t(), x, f.alpha, params[0].dtype)  # (R, in)
    grad_a = [grad_a_cat[c0:c1] for _, _, c0, c1, _ in f.blocks]
    grad_b = [
        scaled_product(grad_out[:, r0:r1].t(), low[:, c0:c1], s, b.dtype)
        for (r0, r1, c0, c1, s), b in zip(f.blocks, params[k:])
    ]
    return grad_a, grad_b


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
    adapted = [m for m in linears if has_adapter(m)]
    return LowRankLinear.apply(
        x,
        weight,
        bias,
        factors(linears, x.dtype, x.device),
        merged_weight(linears, packed),
        *[m.lora_A.weight for m in adapted],
        *[m.lora_B.weight for m in adapted],
    )


class LoraSiluMulLinear(torch.autograd.Function):
    """down(silu(gate) * up) with down's adapter, keeping gate_up (as the fused MLP does) and the
    (T, r) product: silu(gate) * up is recomputed in the backward by the same kernel."""

    @staticmethod
    def forward(ctx, gate_up, inner, weight, bias, f: Factors, merged, a, b):
        act = silu_mul_triton(*gate_up.split(inner, dim=-1))  # (T, I)
        low = act @ f.a_cat.t()  # (T, r)
        if merged is not None:  # the merged weight holds the low-rank part already
            out = F.linear(act, merged, bias)
            weight = merged
        else:
            out = F.linear(act, weight, bias)
            out.addmm_(low, f.b_bd.t(), alpha=f.alpha)
        ctx.inner, ctx.f, ctx.merged = inner, f, merged is not None
        ctx.save_for_backward(gate_up, weight, low, a, b)
        return out

    @staticmethod
    def backward(ctx, d_out):
        gate_up, weight, low, a, b = ctx.saved_tensors
        f = ctx.f
        d_out = d_out.contiguous()
        d_low = d_out @ f.b_bd  # (T, r)
        d_act = d_out @ weight  # (T, I)
        if not ctx.merged:
            d_act.addmm_(d_low, f.a_cat, alpha=f.alpha)  # in place
        d_gate_up, act = silu_mul_backward_triton(gate_up, d_act, ctx.inner, True)
        (grad_a,), (grad_b,) = _adapter_grads(d_out, d_low, act, low, f, (a, b))
        return d_gate_up, None, None, None, None, None, grad_a, grad_b


def lora_silu_mul_linear(gate_up: torch.Tensor, inner: int, down) -> torch.Tensor | None:
    """down_proj(silu(gate) * up) with its adapter in the fused MLP's Function; None where that
    path does not serve (no enabled adapter, dropout, a training base, no kernels)."""
    if not takes([down]) or not _train_kernels_take(gate_up):
        return None
    f = factors([down], gate_up.dtype, gate_up.device)
    merged = merged_weight([down], None)
    return LoraSiluMulLinear.apply(
        gate_up, inner, down.weight, down.bias, f, merged, down.lora_A.weight, down.lora_B.weight
    )

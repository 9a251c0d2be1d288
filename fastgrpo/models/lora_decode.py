"""LoRA in the rollout engine without merged copies (`lora.merge_for_rollout: false`).

The engine samples from the policy itself: each packed group of a layer (q/k/v, o_proj, gate/up,
down_proj) adds its adapters to its base GEMM's output in the engine's forward,

    y = x W^T + b,   then   y += alpha (x a_cat^T) b_bd^T

the trainer's own expression (`lora_train.LowRankLinear`: the same `Factors`, in the weights'
dtype, each GEMM rounding once), so engine and trainer log-probs differ only by summation order,
as in full fine-tuning. Merged weights instead round W + s B A to bf16 once, which neither the
trainer nor peft computes.

The factors live in tensors made once and refreshed in place after the adapters change
(`current`), so captured decode graphs keep reading the same addresses across optimizer steps.

Cost and saving: two small GEMMs per adapted group in each decode step and prefill, and the
adapted groups lose the decode kernels' split-K parts and gate/up's SwiGLU epilogue; no copy of
the adapted weights is kept (the merged copies are ~12 GiB at a 7B shape with every linear
adapted). `benchmarks/bench_step.py --lora 16 --lora-rollout both` measures both ways.
"""

from __future__ import annotations

import torch
from torch import nn

from fastgrpo.kernels.decode import decode_linear
from fastgrpo.kernels.layers.rms_norm import add_rms_norm
from fastgrpo.kernels.layers.swiglu import silu_mul
from fastgrpo.models.lora_train import Factors, fill_factors, has_adapter, make_factors


def layer_groups(layer: nn.Module) -> dict[str, list[nn.Linear]]:
    """A decoder layer's linears by the GEMM that computes them in the engine."""
    attn, mlp = layer.self_attn, layer.mlp
    return {
        "qkv": [attn.q_proj, attn.k_proj, attn.v_proj],
        "o_proj": [attn.o_proj],
        "gate_up": [mlp.gate_proj, mlp.up_proj],
        "down_proj": [mlp.down_proj],
    }


class DecodeAdapters:
    """What the rollout engine samples from in a LoRA run that keeps no merged copies: the model
    itself, with each layer's adapters as `Factors` (`layer.decode_adapters`, read by its
    `forward_packed`), refreshed in place after the adapters change."""

    def __init__(self, model: nn.Module):
        layers = model.model.layers
        weight = model.lm_head_weight
        if weight.is_cuda and not all(layer.is_packed() for layer in layers):
            raise ValueError("the engine adds adapters to packed projections: pack them first")
        self.model = model
        self.groups: list[tuple[list[nn.Linear], Factors]] = []
        for layer in layers:  # unpacked (the CPU's eager engine): the LoraLinear modules serve
            if not layer.is_packed():
                continue
            table = {}
            for name, linears in layer_groups(layer).items():
                if any(has_adapter(m) for m in linears):
                    table[name] = make_factors(linears, weight.dtype, weight.device)
                    self.groups.append((linears, table[name]))
            layer.decode_adapters = table
        self.version = None

    def refresh(self) -> None:
        """Write the current adapters into the engine's factors, in place."""
        for linears, f in self.groups:
            fill_factors(f, linears)

    def current(self, version) -> nn.Module:
        """The model, its factors refreshed first if the adapters changed since (`version`:
        anything that changes when they do, such as the optimizer's step count)."""
        if version != self.version:
            self.refresh()
            self.version = version
        return self.model


def _adapted_linear(x: torch.Tensor, weight, bias, f: Factors) -> torch.Tensor:
    """x W^T + b + alpha (x a_cat^T) b_bd^T: the base GEMM (`decode_linear.linear`), then the
    adapters' part added in place, each GEMM rounding once as the trainer's do."""
    out = decode_linear.linear(x, weight, bias)
    return out.addmm_(x @ f.a_cat.t(), f.b_bd.t(), alpha=f.alpha)


# The engine's packed layer (`DecoderLayer.forward_packed`) computes each group through one of
# these; `f` is the group's Factors, or None (no adapter: the decode kernels' own path).


def project_and_attend(attn, h, cos, sin, attend, f: Factors | None) -> torch.Tensor:
    """The packed q/k/v GEMM of normed h, then attention: (T, Hq*D)."""
    if f is None:
        return attn.project_and_attend(h, cos, sin, attend)
    qkv = attn.qkv
    q, k, v = _adapted_linear(h, qkv.weight, qkv.bias, f).split(qkv.sizes, dim=-1)
    return attn.attend_projected(q, k, v, cos, sin, attend, fused=True)


def linear_to_residual(x, linear: nn.Linear, f: Factors | None):
    """o_proj or down_proj, whose only reader is the next norm: split-K parts where the decode
    kernels give them (`decode_linear.linear_to_residual`), the whole product with adapters."""
    if f is None:
        return decode_linear.linear_to_residual(x, linear.weight, linear.bias)
    return _adapted_linear(x, linear.weight, linear.bias, f)


def norm_gate_up_silu(x, residual, norm, gate_up, f: Factors | None):
    """(silu(gate) * up of the packed gate/up GEMM of RMSNorm(x + residual), x + residual): the
    SiLU in the GEMM's epilogue where there is no adapter (`decode_linear.norm_linear`)."""
    if f is None:
        weight, bias = gate_up.weight, gate_up.bias
        return decode_linear.norm_linear(x, residual, norm.weight, norm.eps, weight, bias, True)
    h, residual = add_rms_norm(x, residual, norm.weight, norm.eps)
    both = _adapted_linear(h, gate_up.weight, gate_up.bias, f)
    return silu_mul(*both.split(gate_up.sizes, dim=-1)), residual

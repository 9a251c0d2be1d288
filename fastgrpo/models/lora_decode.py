"""LoRA in the rollout engine without merged copies (`lora.merge_for_rollout: false`).

The engine samples from the policy itself: each packed group of a layer (q/k/v, o_proj, gate/up,
down_proj) adds its adapters to its base GEMM's output in the engine's forward,

    y = x W^T + b,   then   y += (x a_cat^T) b_bd^T

the trainer's own expression (`lora_train.LowRankLinear`: the same `Factors`, in the weights'
dtype, each GEMM rounding once), so engine and trainer log-probs differ only by summation order,
as in full fine-tuning. Merged weights instead round W + s B A to bf16 once, which neither the
trainer nor peft computes.

The factors live in tensors made once and refreshed in place after the adapters change
(`current`), so captured decode graphs keep reading the same addresses across optimizer steps.

Cost and saving: two small GEMMs per adapted group in each decode step and prefill, and the
adapted groups lose the decode kernels' split-K parts and gate/up's SwiGLU epilogue; no copy of
the adapted weights is kept (the merged copies are ~12 GiB at a 7B shape with every linear
adapted). `benchmarks/bench_lora_rollout.py` measures both ways.
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
    """x W^T + b + (x a_cat^T) b_bd^T: the base GEMM (`decode_linear.linear`), then the adapters'
    part added in place, each GEMM rounding once as the trainer's do."""
    return decode_linear.linear(x, weight, bias).addmm_(x @ f.a_cat.t(), f.b_bd.t())


def forward_packed_adapted(layer, x, residual, cos, sin, attend, table: dict):
    """`DecoderLayer.forward_packed` with the adapters of `table` (group name -> Factors) added
    to their groups' GEMMs: returns (MLP output, residual), (T, H) each."""
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    qkv, o_proj, gate_up, down = attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj
    h, residual = add_rms_norm(x, residual, norm1.weight, norm1.eps)  # (T, H) each
    if "qkv" in table:
        q, k, v = _adapted_linear(h, qkv.weight, qkv.bias, table["qkv"]).split(qkv.sizes, dim=-1)
        out = attn.attend_projected(q, k, v, cos, sin, attend, fused=True)  # (T, Hq*D)
    else:
        out = attn.project_and_attend(h, cos, sin, attend)
    if "o_proj" in table:
        x = _adapted_linear(out, o_proj.weight, o_proj.bias, table["o_proj"])
    else:
        x = decode_linear.linear_to_residual(out, o_proj.weight, o_proj.bias)
    h, residual = add_rms_norm(x, residual, norm2.weight, norm2.eps)
    if "gate_up" in table:
        both = _adapted_linear(h, gate_up.weight, gate_up.bias, table["gate_up"])
        act = silu_mul(*both.split(gate_up.sizes, dim=-1))  # (T, I)
    else:
        act = decode_linear.linear(h, gate_up.weight, gate_up.bias, swiglu=True)
    if "down_proj" in table:
        return _adapted_linear(act, down.weight, down.bias, table["down_proj"]), residual
    return decode_linear.linear_to_residual(act, down.weight, down.bias), residual

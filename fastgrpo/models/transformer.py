"""The native decoder for the Llama family (Llama 2/3, Qwen2/2.5, Qwen3, Mistral, SmolLM2).

What: one implementation with per-family flags (q/k/v bias, o_proj bias, q/k RMSNorm, llama3 RoPE
scaling, sliding windows), whose parameter names are exactly the Hugging Face ones, so an HF
safetensors state dict loads with `load_state_dict(strict=True)` and ours saves as an HF checkpoint
(loading and saving: `native_io.py`).

Why: the trainer and the rollout engine share these very parameter tensors (weight "sync" is free)
and the same numerics, so rollout log-probs match trainer log-probs. The model knows nothing of
caches or sequence boundaries: each layer hands its q, k, v (after bias, q/k norm and RoPE) to an
`attend(layer_index, q, k, v)` callback. Training passes `PackedCausalAttention` (packed rows, no
padding); the generation engine passes one that reads and writes its KV cache.

`forward` returns the final hidden states after the last norm, never logits: the loss projects
only the rows it needs through `lm_head_weight` in a fused kernel. Numerics follow transformers:
RMSNorm in fp32 then cast back, RoPE tables in fp32 cast to the activation dtype, rotate_half.

The rollout engine (no gradient, CUDA tensors) asks for fused Triton kernels with the same roundings instead
of the elementwise PyTorch ops, ~20 small kernels per layer that cost ~2 of the 3.3 ms of a 0.5B
decode step at 64 rows on an H100: residual add + RMSNorm, RoPE of q and k in place, SiLU * up
(`fastgrpo/kernels/{rms_norm,rope,swiglu}.py`). That path carries the residual stream beside the
sublayer output between layers, as vLLM does, so each add fuses into the norm after it.
The trainer on CUDA (its training passes and its scoring alike, so the two agree bitwise) takes
`forward_train`: the same fusions as differentiable kernels, with one GEMM for q/k/v and one for
gate/up; an eager training step of the 0.5B model was ~3,500 kernel launches per 4,096-token
micro-batch and host-bound (benchmarks/lab/profile_step.py). FASTGRPO_FUSED_OPS=0 turns both off;
the CPU never takes them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastgrpo import switches
from fastgrpo.kernels.decode import decode_linear
from fastgrpo.kernels.decode.decode_attention import ProjectedParts
from fastgrpo.kernels.layers.rms_norm import add_rms_norm, add_rms_norm_train
from fastgrpo.kernels.layers.rope import apply_rope, apply_rope_qk_, rope_qk_train
from fastgrpo.kernels.layers.swiglu import silu_mul, silu_mul_linear_train
from fastgrpo.kernels.layers.token_inputs import embed_and_angles
from fastgrpo.kernels.support import triton
from fastgrpo.models import lora_decode
from fastgrpo.models.attention import PackedCausalAttention, SharedKeys
from fastgrpo.models.lora import LoraLinear, project
from fastgrpo.models.lora_train import lora_silu_mul_linear
from fastgrpo.models.model_config import (  # noqa: F401 (re-exported: the model's own config)
    SUPPORTED_MODEL_TYPES,
    Llama3RopeScaling,
    ModelConfig,
    UnsupportedModelError,
    is_supported,
)
from fastgrpo.models.packed import PackedLinears

# attend(layer_index, q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, D)) -> (T, Hq, D)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# FASTGRPO_FUSED_OPS=0 keeps the forwards on the PyTorch ops (to bisect)
FUSED_OPS = switches.FUSED_OPS


def use_train_kernels(x: torch.Tensor) -> bool:
    """Whether a trainer forward over x (with or without gradient: its scoring and its training
    passes must agree bitwise) takes the differentiable fused kernels (`forward_train`): CUDA,
    Triton, and FASTGRPO_FUSED_OPS not 0. The CPU keeps the PyTorch ops."""
    return FUSED_OPS and triton is not None and x.is_cuda


def use_fused_ops(x: torch.Tensor, asked: bool) -> bool:
    """Whether a forward over x takes the fused Triton kernels: asked for (the rollout engine does;
    the trainer does not, so its no-grad log-probs stay bitwise those of its gradient pass), no
    gradient, CUDA, Triton."""
    return asked and FUSED_OPS and triton is not None and x.is_cuda and not torch.is_grad_enabled()


# ----------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None):
        """(self(x + residual), x + residual) by one fused kernel; residual None: no add."""
        return add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """(head_dim / 2,) fp32 inverse frequencies on the CPU, llama3-rescaled when configured."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim  # (D/2,)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # Wavelengths shorter than the original context / high_freq_factor keep their frequency,
    # longer than context / low_freq_factor are slowed by `factor`, and in between interpolate.
    context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    slowed = inv_freq / scaling.factor
    smooth = (context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * slowed + smooth * inv_freq
    out = torch.where(wavelen > context / scaling.low_freq_factor, slowed, inv_freq)
    is_medium = (wavelen <= context / scaling.low_freq_factor) & (
        wavelen >= context / scaling.high_freq_factor
    )
    return torch.where(is_medium, blended, out)


class RotaryTable:
    """cos/sin tables in fp32 for positions 0..n-1, grown on demand; not parameters or buffers,
    so `model.to(bfloat16)` cannot round them and state dicts stay exactly the HF ones."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq  # (D/2,)
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def reserve(self, n: int, device: torch.device) -> None:
        if self.cos is not None and self.cos.device == device and self.cos.shape[0] >= n:
            return
        current = 0 if self.cos is None else self.cos.shape[0]
        n = max(n, 2 * current, 256)
        freqs = torch.arange(n, device=device, dtype=torch.float32)[:, None] * self.inv_freq.to(
            device
        )  # (n, D/2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (n, D)
        self.cos, self.sin = angles.cos(), angles.sin()

    def lookup(self, positions: torch.Tensor, bound: int, dtype: torch.dtype):
        self.reserve(bound, positions.device)
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)  # (T, D) each


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, q_size, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv: PackedLinears | None = None  # set by Transformer.pack_projections

    def forward(self, x, cos, sin, attend: Attend, fused: bool = False) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(self.attend_projected(q, k, v, cos, sin, attend, fused))  # (T, H)

    def project_and_attend(self, h, cos, sin, attend: Attend) -> torch.Tensor:
        """The packed q/k/v GEMM, then the fused path's attention, of normed h (T, H): (T, Hq*D).
        An `attend` that adds up split-K parts in its kernel (`takes_projected_parts`: a decode
        step on Hopper) gets the GEMM's parts, and no launch sums them."""
        T = h.shape[0]
        takes = getattr(attend, "takes_projected_parts", None)
        parts_read = (
            self.q_norm is None
            and takes is not None
            and takes(self.layer_index, T, self.num_heads, cos, sin)
        )
        qkv = decode_linear.linear_to_attention(h, self.qkv.weight, self.qkv.bias, parts_read)
        if isinstance(qkv, ProjectedParts):
            out = attend.rope_and_attend_parts(self.layer_index, qkv, self.num_heads, cos, sin)
            return out.reshape(T, self.num_heads * self.head_dim)
        q, k, v = qkv.split(self.qkv.sizes, dim=-1)  # (T, Hq*D), (T, Hkv*D) x 2
        return self.attend_projected(q, k, v, cos, sin, attend, fused=True)

    def attend_projected(self, q, k, v, cos, sin, attend: Attend, fused: bool) -> torch.Tensor:
        """Attention output (T, Hq*D), before o_proj, of projected q (T, Hq*D), k and v
        (T, Hkv*D). On the fused path an `attend` that keeps a KV cache may rotate and store
        in one kernel (`rope_and_attend`)."""
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = k.view(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        if fused:
            if self.q_norm is not None:
                q, k = self.q_norm.add_and_norm(q, None)[0], self.k_norm.add_and_norm(k, None)[0]
            rope_and_attend = getattr(attend, "rope_and_attend", None)
            if rope_and_attend is not None:
                out = rope_and_attend(self.layer_index, q, k, v, cos, sin)  # (T, Hq, D)
            else:
                apply_rope_qk_(q, k, cos, sin)  # in place: q and k are this layer's own tensors
                out = attend(self.layer_index, q, k, v)  # (T, Hq, D)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            out = attend(self.layer_index, q, k, v)  # (T, Hq, D)
        return out.reshape(T, self.num_heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.gate_up: PackedLinears | None = None  # set by Transformer.pack_projections

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)  # (T, I) each
        return self.down_proj(silu_mul(gate, up) if fused else F.silu(gate) * up)  # (T, H)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # LoRA adapters the engine adds to the packed GEMMs, by group (`lora_decode`); empty
        # when it samples from merged weights or there is no LoRA
        self.decode_adapters: dict = {}

    def forward(self, x, cos, sin, attend: Attend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)  # (T, H)
        return x + self.mlp(self.post_attention_layernorm(x))  # (T, H)

    def forward_train(self, x, residual, cos, sin, attend: Attend):
        """The trainer's path on CUDA, with autograd: as `forward`, with each residual add fused
        into the norm after it (as `forward_fused` carries the stream), q/k/v and gate/up each
        one GEMM (`packed_linear`), and one differentiable Triton kernel forward and one backward
        for each add + RMSNorm, the RoPE of q and k, and SiLU * up. ~9 kernels per layer forward
        and ~30 backward, against ~40 and ~85 for the PyTorch ops (benchmarks/lab/profile_step.py).
        Returns (MLP output, residual), (T, H) each."""
        attn, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        h, residual = add_rms_norm_train(x, residual, norm1.weight, norm1.eps)  # (T, H) each
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        qkv = project(h, projections, attn.qkv)  # with LoRA adapters where there are some
        T, D = qkv.shape[0], attn.head_dim
        q, k, v = qkv.split([attn.num_heads * D, attn.num_kv_heads * D, attn.num_kv_heads * D], -1)
        q, k, v = q.view(T, -1, D), k.view(T, -1, D), v.view(T, -1, D)  # (T, heads, D)
        if attn.q_norm is not None:  # Qwen3: RMSNorm over each head
            q = add_rms_norm_train(q.reshape(-1, D), None, attn.q_norm.weight, attn.q_norm.eps)
            k = add_rms_norm_train(k.reshape(-1, D), None, attn.k_norm.weight, attn.k_norm.eps)
            q, k = q[0].view(T, -1, D), k[0].view(T, -1, D)
        q, k = rope_qk_train(q, k, cos, sin)
        out = attend(attn.layer_index, q, k, v)  # (T, Hq, D)
        x = attn.o_proj(out.reshape(T, -1))  # (T, H)
        h, residual = add_rms_norm_train(x, residual, norm2.weight, norm2.eps)
        projections = [mlp.gate_proj, mlp.up_proj]
        gate_up = project(h, projections, mlp.gate_up)  # (T, 2 I)
        down, inner = mlp.down_proj, mlp.gate_proj.out_features
        # down_proj's input, silu(gate) * up, is recomputed in the backward
        out = lora_silu_mul_linear(gate_up, inner, down)  # None: no adapter this path serves
        if out is None:
            out = silu_mul_linear_train(gate_up, inner, down.weight, down.bias)
            if isinstance(down, LoraLinear) and down.enabled:  # its adapter reads that input too
                out = (out.float() + down.delta_of_swiglu(gate_up, inner)).to(out.dtype)
        return out, residual

    def forward_fused(self, x, residual, cos, sin, attend: Attend):
        """The inference path: x is the previous layer's MLP output (the embeddings, with residual
        None, in layer 0) and residual the stream it is still to be added to; each add is fused
        into the norm after it. Returns this layer's (MLP output, residual), (T, H) each; the MLP
        output may be `SplitSums` (see `forward_packed`), which every norm's add takes."""
        if self.is_packed():
            return self.forward_packed(x, residual, cos, sin, attend)
        if self.decode_adapters:  # its factors are read on packed projections only
            raise RuntimeError("the engine's LoRA adapters need intact packed projections")
        h, residual = self.input_layernorm.add_and_norm(x, residual)  # (T, H) each
        x = self.self_attn(h, cos, sin, attend, fused=True)  # (T, H)
        h, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(h, fused=True), residual

    def is_packed(self) -> bool:
        """q/k/v and gate/up are packed (`Transformer.pack_projections`) and still intact."""
        packs = (self.self_attn.qkv, self.mlp.gate_up)
        return all(p is not None and p.intact() for p in packs)

    def forward_packed(self, x, residual, cos, sin, attend: Attend):
        """`forward_fused` over packed projections: residual add + norm, one q/k/v GEMM, o_proj,
        residual add + norm, one gate/up GEMM with SiLU * up, down_proj. At decode batch sizes
        `decode_linear` runs the small ones as Triton kernels (the SiLU in gate/up's epilogue) and
        may return o_proj and down_proj as split-K parts (`SplitSums`) for the next norm to add
        up."""
        attn, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        adapters = self.decode_adapters  # LoRA's Factors by group (`lora_decode`), else empty
        h, residual = add_rms_norm(x, residual, norm1.weight, norm1.eps)  # (T, H) each
        out = lora_decode.project_and_attend(attn, h, cos, sin, attend, adapters.get("qkv"))
        # o_proj and down_proj are each read only by the next norm, which can add up split-K parts
        x = lora_decode.linear_to_residual(out, attn.o_proj, adapters.get("o_proj"))  # (T, H)
        act, residual = lora_decode.norm_gate_up_silu(
            x, residual, norm2, mlp.gate_up, adapters.get("gate_up")
        )  # (T, I), (T, H)
        down = lora_decode.linear_to_residual(act, mlp.down_proj, adapters.get("down_proj"))
        return down, residual


class Decoder(nn.Module):
    """Holds what HF keeps under `model.`: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Transformer(nn.Module):
    """Decoder-only LM with HF parameter names; `forward` gives final hidden states, not logits."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryTable(rope_inv_freq(config))
        self.activation_checkpointing = False
        self.register_load_state_dict_pre_hook(_drop_derived_keys)
        # set by `load_native_model`: where the weights came from (its config.json and
        # generation_config.json are copied into checkpoints) and the generation EOS ids
        self.source_dir: Path | None = None
        self.eos_token_ids: list[int] = []

    @property
    def device(self) -> torch.device:
        return self.lm_head_weight.device

    def pack_projections(self) -> None:
        """q/k/v and gate/up each become views of one packed weight, so the rollout engine's
        forwards run one GEMM per group (`PackedLinears`). Call it before making the optimizer:
        the parameters are new tensors (same values, same names)."""
        for layer in self.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            attention.qkv = PackedLinears([attention.q_proj, attention.k_proj, attention.v_proj])
            mlp.gate_up = PackedLinears([mlp.gate_proj, mlp.up_proj])

    @property
    def lm_head_weight(self) -> nn.Parameter:
        """(V, H): the LM head, which is the embedding matrix when the two are tied."""
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        *,
        position_bound: int | None = None,
        fused_ops: bool = False,
        position_offset: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states (T, H) after the final norm for tokens (T,) at positions (T,)
        (plus `position_offset`, a () tensor, when given: the fused path adds it in its first
        kernel, so a decode step needs no launch to form its positions).

        `position_bound` (> every position) spares the device-to-host read of positions.max()
        that sizes the RoPE table: the rollout engine passes its cache length, so a decode step
        (or a CUDA graph capturing one) never waits on the host. `fused_ops`: take the fused
        inference kernels when they apply (see `use_fused_ops`).
        """
        fused = use_fused_ops(input_ids, fused_ops)
        if position_offset is not None and (position_bound is None or not fused):
            positions, position_offset = positions + position_offset, None
        if position_bound is None:
            position_bound = int(positions.max()) + 1 if positions.numel() else 1
        if fused:  # the embedding rows and tables in one kernel
            weight = self.model.embed_tokens.weight
            rotary = self.rotary
            rotary.reserve(position_bound, input_ids.device)
            x, cos, sin = embed_and_angles(
                input_ids, positions, weight, rotary.cos, rotary.sin, weight.dtype, position_offset
            )  # (T, H), (T, D), (T, D)
            residual = None
            for layer in self.model.layers:
                x, residual = layer.forward_fused(x, residual, cos, sin, attend)
            return self.model.norm.add_and_norm(x, residual)[0]  # (T, H)
        x = self.model.embed_tokens(input_ids)  # (T, H)
        cos, sin = self.rotary.lookup(positions, position_bound, x.dtype)  # (T, D) each
        use_checkpoint = self.activation_checkpointing and torch.is_grad_enabled()
        if use_train_kernels(x):
            return self.train_layers(x, cos, sin, attend)
        for layer in self.model.layers:
            if use_checkpoint:
                x = checkpoint(layer, x, cos, sin, attend, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attend)
        return self.model.norm(x)  # (T, H)

    def train_layers(self, x, cos, sin, attend: Attend) -> torch.Tensor:
        """The trainer's CUDA path after the embedding: every layer's `forward_train` (each
        recomputed in the backward under activation checkpointing) and the final norm; hidden
        states (T, H). `train.captured_layers` records this as CUDA graphs."""
        use_checkpoint = self.activation_checkpointing and torch.is_grad_enabled()
        residual = None
        for layer in self.model.layers:
            if use_checkpoint:
                x, residual = checkpoint(
                    layer.forward_train, x, residual, cos, sin, attend, use_reentrant=False
                )
            else:
                x, residual = layer.forward_train(x, residual, cos, sin, attend)
        norm = self.model.norm
        return add_rms_norm_train(x, residual, norm.weight, norm.eps)[0]  # (T, H)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head_weight)  # (T, V)

    def packed_attention(
        self, cu_seqlens: torch.Tensor, max_seqlen: int, keys: SharedKeys | None = None
    ) -> PackedCausalAttention:
        """The training-time callback for these packed rows (`keys`: where each sequence's keys
        are, when prompts are shared), with this model's sliding windows."""
        return PackedCausalAttention(cu_seqlens, max_seqlen, self.config.layer_windows, keys=keys)


def _drop_derived_keys(module, state_dict, prefix, *args) -> None:
    """HF modules list a tied `lm_head.weight` (checkpoints do not) and old checkpoints keep RoPE
    `inv_freq` buffers; neither is state of ours, so both load as no-ops, as in transformers."""
    for key in [k for k in state_dict if k.startswith(prefix) and k.endswith(DERIVED_SUFFIXES)]:
        del state_dict[key]
    if module.config.tie_word_embeddings:
        state_dict.pop(prefix + "lm_head.weight", None)


DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)

"""Peak GPU memory of a training run, predicted before it starts (`fastgrpo check`).

The prediction adds up what the trainer allocates, from the model's shape and the config, for
one process with the native model:

- weights: the policy's parameters, and a reference model's (beta > 0, full fine-tuning; a LoRA
  run's reference is its own base with the adapters off, which costs nothing). A LoRA run's engine
  samples from merged copies of the adapted linears' weights (`lora_merged.MergedWeights`), unless
  `lora.merge_for_rollout` is false (its factors, `lora_decode`, are too small to count).
- optimizer: per trainable parameter, its gradient in its own dtype (autograd accumulates it over
  the micro-batches) and AdamW's two moments in fp32; for bf16/fp16 parameters the fp32 masters
  too (`precision.MasterWeights`), whose fp32 gradient buffer exists only while the optimizer
  steps, when no activation is alive. With `train.master_weights=off` the moments are in the
  parameters' dtype.
- KV cache: the engine keeps its wave's cache between rollouts: every prompt once and every
  sample's completion slots. When a wave would not fit in 70% of the memory left, the engine
  splits the rows into waves; the cache is then that share of what is left.
- activations: the largest micro-batch of the update plan, with every completion at
  `rollout.max_new_tokens` (the worst case), times what autograd keeps per token and layer on the
  fused training path (`DecoderLayer.forward_train`): the two add + RMSNorm outputs and residuals,
  the packed q/k/v output (v is a view of it), RoPE's q and k, the attention output, gate/up's
  output, and fp32 row statistics; with gradient checkpointing, each layer's two inputs and one
  layer's activations while it is recomputed, with its MLP gradients (at 32,768 tokens of the 7B
  shape ~3 GiB, which the estimate had missed: 4.3% low, now 0.3% high). LoRA adds only its
  (tokens, rank) products (`models/lora_train.py`).
- LM head: the fused loss's logits chunk (at most 640 MiB), the hidden states' gradient in fp32,
  and the head's weight gradient when the head trains.
- CUDA graphs (`train.cuda_graphs`, without gradient checkpointing; `train/captured_layers.py`):
  their pool keeps the activations of a micro-batch padded to its bucket from one step to the
  next (through the optimizer step too; half a padding step counted, the average), and the
  trainable layer weights' gradients that the graphs write (autograd's copies are the gradients
  above). At the 0.5B shape on an H100: 17.98 GiB for 17.79 measured, 9.60 for
  9.36 with LoRA (benchmarks/results/cuda_graphs_step_h100.json).

The peak is the backward's (weights + optimizer state + gradients + KV cache + activations + LM
head) or the optimizer step's (fp32 gradient buffer instead of activations), whichever is larger.
Checked against measured peaks on the lent GPUs (benchmarks/bench_memory.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from fastgrpo.config import Config
from fastgrpo.kernels.train.lm_head_grpo_loss import DEFAULT_CHUNK_BYTES, _chunk_rows
from fastgrpo.models.lora import lora_modules
from fastgrpo.rollout.engine import FREE_MEMORY_SHARE, prompt_capacity, row_bytes, wave_plan
from fastgrpo.rollout.kv_cache import cache_bytes
from fastgrpo.train.batching import plan_micro_batches
from fastgrpo.train.captured_layers import SEQUENCE_STEP, token_step

GIB = 2**30
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
# a part a setting drops, said when a run does not fit: (part, the setting, what it costs)
SAVINGS = (
    (
        "merged weights",
        "lora.merge_for_rollout=false keeps no merged copies",
        "for slower rollouts",
    ),
    (
        "cuda graphs",
        "train.cuda_graphs=off runs the update's layers eagerly",
        "for a slower update on small models",
    ),
)
NEAR_FULL = 0.85
"""Above this share of the GPU the check suggests expandable segments: a 7B LoRA step at 96% of an
H100 ran out of memory with 9.9 GiB reserved but unallocated, and trained with them
(benchmarks/results/long_lora_h100.txt)."""


@dataclass
class MemoryEstimate:
    parts: dict[str, int]  # bytes of each part at the peak
    peak: int
    micro_batch_tokens: int  # the largest micro-batch the estimate assumed
    waves: int  # the rollout's waves (1: all rows at once)

    def lines(
        self,
        device_bytes: int | None = None,
        longest: int | None = None,
        gpu: str = "this GPU's",
        context_limit: int | None = None,
    ) -> list[str]:
        parts = ", ".join(f"{name} {size / GIB:.2f}" for name, size in self.parts.items() if size)
        out = [
            f"predicted peak GPU memory: {self.peak / GIB:.1f} GiB ({parts} GiB; largest "
            f"micro-batch {self.micro_batch_tokens:,} tokens"
            + (f"; the rollout runs in {self.waves} waves" if self.waves > 1 else "")
            + ")"
        ]
        if device_bytes is not None:
            room = device_bytes / GIB
            verdict = "fits" if self.peak <= device_bytes else "does NOT fit"
            out.append(f"  {verdict} {gpu} {room:.0f} GiB")
            for part, setting, cost in SAVINGS:
                size = self.parts.get(part, 0)
                if self.peak > device_bytes and size:
                    out.append(f"  {setting}: {size / GIB:.1f} GiB less, {cost}")
            close = NEAR_FULL * device_bytes < self.peak <= device_bytes
            if close and "expandable_segments:True" not in os.environ.get(ALLOC_CONF, ""):
                out.append(
                    f"  close to the limit: start with {ALLOC_CONF}=expandable_segments:True, "
                    "or the allocator's fragmentation may run out of memory first"
                )
        if longest is not None:
            limit = ""
            if context_limit is not None and longest > context_limit:
                longest, limit = context_limit, ", the model's context limit"
            out.append(
                f"  the longest completion that fits at this batch: ~{longest:,} tokens "
                f"(rollout.max_new_tokens{limit})"
            )
        return out


def _itemsize(model: nn.Module) -> int:
    return next(model.parameters()).element_size()


def _weights(model: nn.Module, config: Config) -> tuple[dict[str, int], int]:
    """(the bytes held throughout, by part; the fp32 gradient buffer the optimizer step adds)."""
    adapted = lora_modules(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    parts = {"weights": total}
    if adapted:  # the reference is the base: only the engine's merged copies, if it keeps them
        if config.lora.merge_for_rollout:
            parts["merged weights"] = sum(
                m.weight.numel() * m.weight.element_size() for m in adapted.values()
            )
    elif config.algo.beta:
        parts["reference"] = total  # a second model of the same shape and dtype
    masters = config.train.master_weights != "off"
    grads = state = step_buffer = 0
    for p in trainable:
        n, size = p.numel(), p.element_size()
        grads += n * size
        if size < 4 and masters:
            state += n * (4 + 8)  # fp32 master and two fp32 moments
            step_buffer += n * 4
        else:
            state += n * 2 * size
    parts["gradients"] = grads
    parts["optimizer"] = state
    return parts, step_buffer


def _largest_micro_batch(config: Config, prompt_len: int, max_new: int) -> int:
    r = config.rollout
    rows = r.prompts_per_step * r.num_generations // config.train.mini_batches
    groups = torch.arange(rows) // r.num_generations
    plan = plan_micro_batches(
        torch.full((rows,), prompt_len),
        torch.full((rows,), max_new),
        config.train.micro_batch_tokens,
        groups,
    )
    return max(
        sum(max_new for _ in batch) + prompt_len * len({int(groups[i]) for i in batch})
        for batch in plan
    )


def _per_token_layer(cfg, itemsize: int, lora_products: int) -> int:
    """Bytes autograd keeps per token in one decoder layer (`forward_train`)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    elements = 4 * h + (q + 2 * kv) + (q + kv) + q + 2 * i
    if cfg.qk_norm:
        elements += q + kv
    return itemsize * elements + 4 * (2 + cfg.num_heads) + lora_products


def _lora_products(model: nn.Module) -> int:
    """Bytes per token and layer of the adapters' (tokens, rank) products, which the in-GEMM
    adapters (`lora_train`) keep in the activations' dtype."""
    adapted = lora_modules(model)
    layers = max(1, model.config.num_layers)
    ranks = sum(m.lora_A.weight.shape[0] for m in adapted.values())
    return _itemsize(model) * ranks // layers


def _kv_cache(config: Config, model, prompt_len: int, max_new: int, free: int | None):
    """(bytes the engine keeps for its largest wave, waves), planned as the engine plans them."""
    cfg, r = model.config, config.rollout
    dtype = next(model.parameters()).dtype
    rows = r.prompts_per_step * r.num_generations
    fit = rows
    if free is not None:
        fit = max(1, int(free * FREE_MEMORY_SHARE) // row_bytes(cfg, dtype, prompt_len, max_new))
    waves = list(wave_plan(r.prompts_per_step, r.num_generations, fit))
    _, prompts, _, samples = waves[0]  # the first wave is the largest
    size = cache_bytes(cfg, prompts, prompt_capacity(prompt_len), prompts * samples, max_new, dtype)
    return size, len(waves)


def estimate_memory(
    config: Config,
    model: nn.Module,
    prompt_len: int,
    max_new_tokens: int | None = None,
    device_bytes: int | None = None,
) -> MemoryEstimate:
    """Predicted peak memory of training `model` (the native Transformer, adapters attached for
    LoRA) with `config`, prompts of `prompt_len` tokens and completions of `max_new_tokens`
    (default rollout.max_new_tokens); `device_bytes`: the GPU's memory, which sets how the
    engine splits a rollout too large for it into waves."""
    cfg = model.config
    max_new = max_new_tokens or config.rollout.max_new_tokens
    size = _itemsize(model)
    parts, step_buffer = _weights(model, config)
    persistent = sum(parts.values())
    free = None if device_bytes is None else max(0, device_bytes - persistent)
    parts["kv cache"], waves = _kv_cache(config, model, prompt_len, max_new, free)
    tokens = _largest_micro_batch(config, prompt_len, max_new)
    per_layer = _per_token_layer(cfg, size, _lora_products(model))
    if config.model.gradient_checkpointing:
        # each layer's two inputs, one layer's recomputed activations, and that layer's MLP
        # gradients while it runs backward: d(silu(gate) * up) (T, I) and d(gate/up) (T, 2I)
        mlp_grads = 3 * cfg.intermediate_size * size
        kept = tokens * (cfg.num_layers * 2 * cfg.hidden_size * size + per_layer + mlp_grads)
    else:
        kept = tokens * cfg.num_layers * per_layer
    kept += tokens * (2 * cfg.hidden_size * size + 8)  # the final norm's, the token ids
    parts["activations"] = kept
    head = model.lm_head_weight
    vocab = head.shape[0]
    chunk = min(_chunk_rows(head, DEFAULT_CHUNK_BYTES), tokens) * vocab * size
    d_head = head.numel() * head.element_size() if head.requires_grad else 0
    parts["lm head"] = chunk + tokens * cfg.hidden_size * 4 + d_head
    graphs = _graph_pool_extra(config, model, tokens, kept)
    if graphs:
        parts["cuda graphs"] = graphs
    backward = sum(parts.values())
    optimizer_step = persistent + parts["kv cache"] + step_buffer
    if graphs:  # the pool holds the activations through the optimizer step too
        optimizer_step += kept + graphs
    return MemoryEstimate(parts, max(backward, optimizer_step), tokens, waves)


def _graph_pool_extra(config: Config, model: nn.Module, tokens: int, activations: int) -> int:
    """What the update's CUDA graphs hold beyond the eager path's activations: the padding of
    the micro-batch to its bucket, and the trainable layer weights' gradients that the graphs
    write (autograd's copies of them are the gradients counted already); 0 where the layers run
    eagerly."""
    if config.train.cuda_graphs == "off" or config.model.gradient_checkpointing:
        return 0
    padding = token_step(config.train.micro_batch_tokens) // 2 + SEQUENCE_STEP  # on average
    layers = getattr(getattr(model, "model", None), "layers", None)
    grads = (
        0
        if layers is None
        else sum(p.numel() * p.element_size() for p in layers.parameters() if p.requires_grad)
    )
    return activations * padding // max(tokens, 1) + grads


def longest_completion(
    config: Config, model: nn.Module, prompt_len: int, device_bytes: int, step: int = 64
) -> int:
    """The largest rollout.max_new_tokens (a multiple of `step`) whose predicted peak fits
    `device_bytes`; 0 when none does."""

    def fits(n: int) -> bool:
        return estimate_memory(config, model, prompt_len, n, device_bytes).peak <= device_bytes

    if not fits(step):
        return 0
    low, high = 1, 2
    while fits(high * step) and high < 2**20:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * step) else (low, mid)
    return low * step

"""The generation engine's KV cache: each prompt once, each sample's completion on its own.

Layout, per layer:
    prompt_k, prompt_v  (P, Lp, nkv, d)   written once by the prefill, read by all G samples
    comp_k, comp_v      (B, Tc, nkv, d)   B = P * G rows; row b belongs to prompt b // G
The prompt caches are the first P rows of (P + 1, Lp, nkv, d) stores: a prefill padded to a
graph's row count writes its padding rows' keys and values into the spare row, which nothing reads.

The model never sees the cache: it calls an attention callback `attend(layer, q, k, v)` with this
step's (or the prefill's) projected, rotated heads. `PrefillAttention` stores the prompt keys and
runs causal attention per prompt; `DecodeAttention` writes one completion slot per row and attends
over the prompt and the completion so far. Both keep their tensors fixed, so a decode step can be
captured in a CUDA graph (the slot is a device tensor, not a Python int).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgrpo.kernels.decode.decode_attention import (
    ProjectedParts,
    decode_attention,
    rope_decode_attention,
    rope_decode_attention_parts,
    takes_projected_parts,
)
from fastgrpo.kernels.decode.kv_write import write_kv


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of keys and values that one token holds across all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


def completion_slots(max_new_tokens: int) -> int:
    """Completion cache slots per row: every sampled token but the last is fed back and needs
    one."""
    return max(max_new_tokens - 1, 1)


def cache_bytes(config, num_prompts, prompt_capacity, rows, max_new_tokens, dtype) -> int:
    """The bytes `KVCache.allocate` takes for these arguments (the prompt stores' spare row
    included)."""
    per_token = kv_bytes_per_token(config, dtype)
    return per_token * (
        (num_prompts + 1) * prompt_capacity + rows * completion_slots(max_new_tokens)
    )


@dataclass
class KVCache:
    prompt_k: list[torch.Tensor]  # per layer (P, Lp, nkv, d): the first P rows of prompt_store_k
    prompt_v: list[torch.Tensor]
    comp_k: list[torch.Tensor]  # per layer (B, Tc, nkv, d)
    comp_v: list[torch.Tensor]
    prompt_lens: torch.Tensor  # (P,) int64
    prompt_store_k: list[torch.Tensor]  # per layer (P + 1, Lp, nkv, d): row P is the spare row
    prompt_store_v: list[torch.Tensor]

    def prompts(self, p: int, b: int) -> KVCache:
        """The first p prompts' caches and the first b rows' (views)."""
        return KVCache(
            [k[:p] for k in self.prompt_k],
            [v[:p] for v in self.prompt_v],
            [k[:b] for k in self.comp_k],
            [v[:b] for v in self.comp_v],
            self.prompt_lens[:p],
            self.prompt_store_k,
            self.prompt_store_v,
        )

    @classmethod
    def allocate(
        cls, config, num_prompts, prompt_capacity, rows, max_new_tokens, dtype, device
    ) -> KVCache:
        """Room for `num_prompts` prompts of up to `prompt_capacity` tokens and `rows` samples."""
        heads = (config.num_kv_heads, config.head_dim)
        layers = range(config.num_layers)
        slots = completion_slots(max_new_tokens)
        new = lambda *shape: torch.zeros(*shape, *heads, dtype=dtype, device=device)  # noqa: E731
        store_k = [new(num_prompts + 1, prompt_capacity) for _ in layers]
        store_v = [new(num_prompts + 1, prompt_capacity) for _ in layers]
        return cls(
            [k[:num_prompts] for k in store_k],
            [v[:num_prompts] for v in store_v],
            [new(rows, slots) for _ in layers],
            [new(rows, slots) for _ in layers],
            torch.zeros(num_prompts, dtype=torch.int64, device=device),
            store_k,
            store_v,
        )


class PrefillAttention:
    """Packed prompts: store each token's k/v at its (prompt, position) slot, then attend causally
    within each prompt. Padding rows after the prompts' tokens (a graphed prefill's) have slots in
    the spare row and belong to no sequence of `attention`."""

    def __init__(self, cache: KVCache, slots: torch.Tensor, attention):
        """`slots` (T,): each token's flat index prompt * Lp + position in the prompt store;
        `attention`: the model's packed causal attention for these prompts."""
        self.cache, self.slots, self.attention = cache, slots, attention

    def __call__(self, layer: int, q, k, v):
        c = self.cache
        c.prompt_store_k[layer].view(-1, *k.shape[1:]).index_copy_(0, self.slots, k)
        c.prompt_store_v[layer].view(-1, *v.shape[1:]).index_copy_(0, self.slots, v)
        return self.attention(layer, q, k, v)


class DecodeAttention:
    """One token per row: write its k/v into completion slot `slot` (a () int64 device tensor,
    advanced in place between steps), then attend over the prompt and slots 0..slot."""

    def __init__(self, cache: KVCache, slot: torch.Tensor):
        self.cache, self.slot = cache, slot

    def __call__(self, layer: int, q, k, v):
        write_kv(self.cache.comp_k[layer], self.cache.comp_v[layer], k, v, self.slot)
        return decode_attention(q, *self._caches(layer), self.slot)

    def rope_and_attend(self, layer: int, q, k, v, cos, sin):
        """As __call__ for q and k not yet rotated: on a GPU the rotation, the KV write and the
        attention are one kernel (`rope_decode_attention`)."""
        return rope_decode_attention(q, k, v, cos, sin, *self._caches(layer), self.slot)

    def takes_projected_parts(self, layer: int, rows: int, nh: int, cos, sin) -> bool:
        """Whether `rope_and_attend_parts` adds up q/k/v's split-K parts in its kernel."""
        c = self.cache
        return takes_projected_parts(rows, nh, cos, sin, c.prompt_k[layer], c.comp_k[layer])

    def rope_and_attend_parts(self, layer: int, qkv: ProjectedParts, nh: int, cos, sin):
        """As `rope_and_attend`, for q, k and v as the packed q/k/v GEMM's split-K parts."""
        caches = self._caches(layer)
        return rope_decode_attention_parts(qkv, nh, cos, sin, *caches, self.slot)

    def _caches(self, layer: int):
        """(prompt_k, prompt_v, prompt_lens, comp_k, comp_v) of one layer, as the kernels take them."""
        c = self.cache
        return c.prompt_k[layer], c.prompt_v[layer], c.prompt_lens, c.comp_k[layer], c.comp_v[layer]

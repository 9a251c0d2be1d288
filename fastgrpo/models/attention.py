"""Attention callbacks for packed training rows, and the reference they are tested against.

What: `PackedCausalAttention(cu_seqlens, max_seqlen)` is the `attend(layer, q, k, v)` callback of
`Transformer.forward` for rows packed back to back (no padding): causal within each sequence,
never across, grouped-query heads, optional per-layer sliding windows. `causal_attention_ref` is
the spec in plain fp32 PyTorch.

Why: packing removes the padding compute of a (B, T) batch; on CUDA in fp16/bf16 one flash
`varlen_attn` call (probed once at import; FASTGRPO_NO_VARLEN=1 turns it off) covers every
sequence, and elsewhere (CPU, fp32) a loop of `scaled_dot_product_attention` per sequence does.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _probe_varlen():
    """(varlen_attn, takes window_size, takes enable_gqa), or None where torch has none.

    torch 2.10 takes `is_causal`; 2.11 takes `window_size` ((-1, 0) is causal) but no
    `enable_gqa`, so k/v are repeated to q's head count; 2.13 takes both.
    FASTGRPO_NO_VARLEN=1 turns it off.
    """
    if os.environ.get("FASTGRPO_NO_VARLEN") == "1":
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "window_size" in params, "enable_gqa" in params


VARLEN = _probe_varlen()
# sequences are padded into one attention call when that at most doubles the tokens attended
PADDED_BATCH_LIMIT = 2
_SDPA_HAS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


def causal_attention_ref(q, k, v, cu_seqlens, window: int | None = None) -> torch.Tensor:
    """The spec: per sequence, softmax(q k^T / sqrt(D)) v in fp32 with a causal (windowed) mask."""
    groups = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    out = torch.empty_like(q)  # (T, Hq, D)
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs = q[start:end].float().transpose(0, 1)  # (Hq, L, D)
        ks = k[start:end].float().repeat_interleave(groups, dim=1).transpose(0, 1)  # (Hq, L, D)
        vs = v[start:end].float().repeat_interleave(groups, dim=1).transpose(0, 1)  # (Hq, L, D)
        scores = qs @ ks.transpose(1, 2) / math.sqrt(q.shape[-1])  # (Hq, L, L)
        scores = scores.masked_fill(~_causal_mask(end - start, window, q.device), float("-inf"))
        out[start:end] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


def _causal_mask(length: int, window: int | None, device) -> torch.Tensor:
    i = torch.arange(length, device=device)
    offset = i[:, None] - i[None, :]  # (L, L): query index minus key index
    visible = offset >= 0
    if window is not None:
        visible &= offset < window
    return visible


class PackedCausalAttention:
    """attend() for packed rows: causal within each sequence, never across; GQA; no padding.

    On CUDA in fp16/bf16 one `torch.nn.attention.varlen.varlen_attn` call (flash) covers every
    sequence; otherwise (CPU, fp32) one masked `scaled_dot_product_attention` over the sequences
    padded to the longest, or, when that would more than double the work, one call per sequence.
    `layer_windows[i]` is layer i's sliding window or None (`ModelConfig.layer_windows`).
    """

    def __init__(
        self,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        layer_windows: Sequence[int | None] | None = None,
        *,
        use_varlen: bool | None = None,
    ):
        self.cu_seqlens = cu_seqlens.to(torch.int32)  # (N + 1,)
        self.max_seqlen = int(max_seqlen)
        self.layer_windows = layer_windows
        self.use_varlen = use_varlen
        self._bounds: list[int] | None = None
        self._padding: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device=None, layer_windows=None):
        cu = torch.tensor([0, *lengths], device=device).cumsum(0)  # (N + 1,)
        return cls(cu, max(lengths), layer_windows)

    def __call__(self, layer_index: int, q, k, v) -> torch.Tensor:
        window = self.layer_windows[layer_index] if self.layer_windows else None
        if window is not None and window >= self.max_seqlen:
            window = None  # every key is inside the window anyway
        if self._varlen_applies(q, window):
            return self._varlen(q, k, v, window)
        N, T = self.cu_seqlens.numel() - 1, q.shape[0]
        if N > 1 and N * self.max_seqlen <= PADDED_BATCH_LIMIT * T:
            return self._sdpa_padded(q, k, v, window)
        return self._sdpa_loop(q, k, v, window)

    def _varlen_applies(self, q, window) -> bool:
        if VARLEN is None or self.use_varlen is False:
            return False
        takes_window, head_dim = VARLEN[1], q.shape[-1]
        return (
            q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16)
            and head_dim % 8 == 0  # what the flash kernels take
            and head_dim <= 256
            and (window is None or takes_window)
        )

    def _varlen(self, q, k, v, window) -> torch.Tensor:
        needs_grad = torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad
        )
        if window is None and not needs_grad:
            return self._flash_forward(q, k, v)
        if needs_grad and FLASH_AUTOGRAD:
            return FlashVarlenCausal.apply(q, k, v, self.cu_seqlens, self.max_seqlen, window)
        varlen_attn, takes_window, takes_gqa = VARLEN
        kwargs = {}
        if k.shape[1] != q.shape[1]:
            if takes_gqa:
                kwargs["enable_gqa"] = True
            else:
                groups = q.shape[1] // k.shape[1]
                k = k.repeat_interleave(groups, dim=1)  # (T, Hq, D)
                v = v.repeat_interleave(groups, dim=1)  # (T, Hq, D)
        if takes_window:  # flash's left window counts keys before the query: HF's window - 1
            kwargs["window_size"] = (-1 if window is None else window - 1, 0)
        else:
            kwargs["is_causal"] = True
        cu, n = self.cu_seqlens, self.max_seqlen
        return varlen_attn(q, k, v, cu, cu, n, n, **kwargs)  # (T, Hq, D)

    def _flash_forward(self, q, k, v) -> torch.Tensor:
        """Inference (no autograd): the flash kernel that `varlen_attn` wraps, called directly.
        It takes grouped-query k/v as they are (no repeat to q's head count, which torch 2.11's
        `varlen_attn` needs), and skips the custom-op and autograd layers, ~0.2 ms of host time
        per call on the H100 machine (benchmarks/profile_rollout_host.py)."""
        cu, n = self.cu_seqlens, self.max_seqlen
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, n, n, 0.0, True, False)[0]

    def _sdpa_padded(self, q, k, v, window) -> torch.Tensor:
        """One `scaled_dot_product_attention` over the sequences padded to the longest, with a
        mask for causality, padding and the window. On a CPU this beats a call per sequence
        (SmolLM2 forward + backward over the quick start's 32 rows of ~60 tokens, 2 cores:
        10.3 -> 8.9 s); padded queries see their sequence's keys, so no row is empty."""
        N, L = self.cu_seqlens.numel() - 1, self.max_seqlen
        if self._padding is None:
            lengths = self.cu_seqlens.diff().long()  # (N,)
            sequence = torch.repeat_interleave(torch.arange(N, device=q.device), lengths)  # (T,)
            slots = sequence * L + packed_positions(self.cu_seqlens).long()  # (T,) in (N*L)
            i = torch.arange(L, device=q.device)
            visible = (i[None, :] <= i[:, None]) & (i[None, :] < lengths[:, None, None])
            self._padding = slots, visible  # visible: (N, L, L), query x key
        slots, visible = self._padding
        if window is not None:
            i = torch.arange(L, device=q.device)
            visible = visible & (i[:, None] - i[None, :] < window)

        def padded(x):  # (T, heads, D) -> (N, heads, L, D), zeros past each sequence
            full = x.new_zeros(N * L, *x.shape[1:]).index_copy(0, slots, x)
            return full.view(N, L, *x.shape[1:]).transpose(1, 2)

        groups = q.shape[1] // k.shape[1]
        qp, kp, vp = padded(q), padded(k), padded(v)
        if groups > 1 and not _SDPA_HAS_GQA:
            kp, vp = kp.repeat_interleave(groups, dim=1), vp.repeat_interleave(groups, dim=1)
        extra = {"enable_gqa": True} if groups > 1 and _SDPA_HAS_GQA else {}
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=visible[:, None], **extra)
        return o.transpose(1, 2).reshape(N * L, *q.shape[1:])[slots]  # (T, Hq, D)

    def _sdpa_loop(self, q, k, v, window) -> torch.Tensor:
        if self._bounds is None:
            self._bounds = self.cu_seqlens.tolist()  # one host read per forward, not per layer
        groups = q.shape[1] // k.shape[1]
        gqa = groups > 1 and _SDPA_HAS_GQA
        outs = []
        for start, end in zip(self._bounds[:-1], self._bounds[1:]):
            qs = q[start:end].transpose(0, 1)  # (Hq, L, D)
            ks = k[start:end].transpose(0, 1)  # (Hkv, L, D)
            vs = v[start:end].transpose(0, 1)  # (Hkv, L, D)
            if groups > 1 and not gqa:
                ks = ks.repeat_interleave(groups, dim=0)  # (Hq, L, D)
                vs = vs.repeat_interleave(groups, dim=0)  # (Hq, L, D)
            extra = {"enable_gqa": True} if gqa else {}
            if window is not None and end - start > window:
                mask = _causal_mask(end - start, window, q.device)  # (L, L)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, **extra)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, **extra)
            outs.append(o.transpose(0, 1))  # (L, Hq, D)
        return torch.cat(outs)  # (T, Hq, D)


class FlashVarlenCausal(torch.autograd.Function):
    """Causal (optionally windowed) flash attention over packed sequences, with autograd, by the
    two ATen flash kernels that `varlen_attn` wraps, called directly.

    Why: on torch 2.11 `varlen_attn` takes no grouped-query k/v, so k and v would be repeated to
    q's head count before the kernel (two copies per layer forward, two reductions backward), and
    its custom-op and autograd layers cost ~0.3 ms of host time per layer's backward on the H100
    machine (benchmarks/profile_step.py). The flash kernels themselves take grouped k/v: the
    forward reads each k/v head for all its query heads, and the backward sums dk/dv over a
    group inside ATen. Same kernels, same numerics as `varlen_attn` on repeated k/v.

    apply(q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, D), cu_seqlens (N + 1,) int32, max_seqlen,
    window or None) -> (T, Hq, D). No dropout; the default 1/sqrt(D) scale.
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen: int, window: int | None):
        left = -1 if window is None else window - 1  # flash counts the keys before the query
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            0.0,
            window is None,
            False,
            window_size_left=left,
            window_size_right=0,
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_state, unused)
        ctx.max_seqlen, ctx.window = max_seqlen, window
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu, rng_state, unused = ctx.saved_tensors
        n, window = ctx.max_seqlen, ctx.window
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            cu,
            cu,
            n,
            n,
            0.0,
            window is None,
            rng_state,
            unused,
            window_size_left=-1 if window is None else window - 1,
            window_size_right=0,
        )
        return dq, dk, dv, None, None, None


# FASTGRPO_FLASH_AUTOGRAD=0 sends training attention through `varlen_attn` instead (to compare)
FLASH_AUTOGRAD = os.environ.get("FASTGRPO_FLASH_AUTOGRAD", "1") != "0"


def packed_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(T,) position of each packed token within its own sequence: 0, 1, ..., 0, 1, ..."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # (N,)
    total = int(cu_seqlens[-1])
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)  # (T,)
    return torch.arange(total, device=cu_seqlens.device) - starts

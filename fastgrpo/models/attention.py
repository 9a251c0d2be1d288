"""Attention callbacks for packed training rows, and the reference they are tested against.

What: `PackedCausalAttention(cu_seqlens, max_seqlen)` is the `attend(layer, q, k, v)` callback of
`Transformer.forward` for rows packed back to back (no padding): causal within each sequence,
never across, grouped-query heads, optional per-layer sliding windows. `causal_attention_ref` is
the spec in plain fp32 PyTorch.

Shared prompts (`SharedKeys`): GRPO samples G completions of each prompt, and the trainer packs
each prompt once, followed by its completions. A completion's queries then attend to keys that
are not contiguous in the packed rows (its prompt's, then its own), so the callback first gathers
each query sequence's keys and values into a key-side layout (`gather_rows`, whose backward sums
the G contributions to a prompt token's k/v in fp32), and the mask is causal aligned to the end
of the keys: query i of a sequence of Lq queries and Lk keys sees keys j <= i + Lk - Lq (flash
attention's convention when the two lengths differ).

Why: packing removes the padding compute of a (B, T) batch; on CUDA in fp16/bf16 one flash
`varlen_attn` call (probed once at import; FASTGRPO_NO_VARLEN=1 turns it off) covers every
sequence, and elsewhere (CPU, fp32) a loop of `scaled_dot_product_attention` per sequence does.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fastgrpo import switches


def _probe_varlen():
    """(varlen_attn, takes window_size, takes enable_gqa), or None where torch has none.

    torch 2.10 takes `is_causal`; 2.11 takes `window_size` ((-1, 0) is causal) but no
    `enable_gqa`, so k/v are repeated to q's head count; 2.13 takes both.
    FASTGRPO_NO_VARLEN=1 turns it off.
    """
    if switches.NO_VARLEN:
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


def flash_serves(dtype: torch.dtype, head_dim: int, window: int | None = None) -> bool:
    """Whether CUDA tensors of this dtype and head size go to the flash kernels (one call over
    every sequence, bounds read on the device: no host sync, so a CUDA graph can capture it)."""
    return (
        VARLEN is not None
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0  # what the flash kernels take
        and head_dim <= 256
        and (window is None or VARLEN[1])
    )


def causal_attention_ref(
    q, k, v, cu_seqlens, window: int | None = None, cu_seqlens_k=None
) -> torch.Tensor:
    """The spec: per sequence, softmax(q k^T / sqrt(D)) v in fp32 with a causal (windowed) mask.

    `cu_seqlens_k` (default: `cu_seqlens`) bounds each sequence's keys in k/v when they are laid
    out apart from the queries; the mask is then aligned to the end of the keys."""
    groups = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    key_bounds = bounds if cu_seqlens_k is None else cu_seqlens_k.tolist()
    out = torch.empty_like(q)  # (T, Hq, D)
    for start, end, k_start, k_end in zip(bounds[:-1], bounds[1:], key_bounds[:-1], key_bounds[1:]):
        qs = q[start:end].float().transpose(0, 1)  # (Hq, Lq, D)
        ks = k[k_start:k_end].float().repeat_interleave(groups, dim=1).transpose(0, 1)
        vs = v[k_start:k_end].float().repeat_interleave(groups, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) / math.sqrt(q.shape[-1])  # (Hq, Lq, Lk)
        visible = _causal_mask(end - start, window, q.device, k_end - k_start)
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


def _causal_mask(length: int, window: int | None, device, keys: int | None = None) -> torch.Tensor:
    """(length, keys) visibility: query i sees key j when 0 <= i + keys - length - j (< window)."""
    keys = length if keys is None else keys
    offset = (  # query index (aligned to the end of the keys) minus key index
        torch.arange(length, device=device)[:, None]
        + (keys - length)
        - torch.arange(keys, device=device)[None, :]
    )
    visible = offset >= 0
    if window is not None:
        visible &= offset < window
    return visible


class SharedKeys:
    """Where each query sequence's keys are: `rows` (Tk,) indexes the packed k/v rows (a prompt's
    rows appear once per completion that attends to them), `cu_seqlens` (N + 1,) bounds each
    sequence's keys in that gathered layout, `max_seqlen` is the longest."""

    def __init__(self, rows: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int):
        self.rows = rows
        self.cu_seqlens = cu_seqlens.to(torch.int32)
        self.max_seqlen = int(max_seqlen)


class _GatherRows(torch.autograd.Function):
    """x[rows] for each x, one autograd node for all; the backward sums repeated rows in fp32 or
    wider (a prompt's k/v gets G gradients)."""

    @staticmethod
    def forward(ctx, rows, *xs):
        ctx.save_for_backward(rows)
        ctx.rows_of_x = [x.shape[0] for x in xs]
        return tuple(x.index_select(0, rows) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        (rows,) = ctx.saved_tensors
        out = []
        for grad, n in zip(grads, ctx.rows_of_x):
            wide = torch.promote_types(grad.dtype, torch.float32)
            total = grad.new_zeros((n, *grad.shape[1:]), dtype=wide)
            out.append(total.index_add_(0, rows, grad.to(wide)).to(grad.dtype))
        return (None, *out)


def gather_rows(rows: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x[rows] for each x (rows may repeat), with a backward that adds up repeats in fp32."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
        return _GatherRows.apply(rows, *xs)
    return tuple(x.index_select(0, rows) for x in xs)


class PackedCausalAttention:
    """attend() for packed rows: causal within each sequence, never across; GQA; no padding.

    On CUDA in fp16/bf16 one `torch.nn.attention.varlen.varlen_attn` call (flash) covers every
    sequence; otherwise (CPU, fp32) one masked `scaled_dot_product_attention` over the sequences
    padded to the longest, or, when that would more than double the work, one call per sequence.
    `layer_windows[i]` is layer i's sliding window or None (`ModelConfig.layer_windows`).
    `keys` (`SharedKeys`): sequences whose keys are not their own query rows (shared prompts).
    """

    def __init__(
        self,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        layer_windows: Sequence[int | None] | None = None,
        *,
        use_varlen: bool | None = None,
        keys: SharedKeys | None = None,
    ):
        self.cu_seqlens = cu_seqlens.to(torch.int32)  # (N + 1,)
        self.max_seqlen = int(max_seqlen)
        self.layer_windows = layer_windows
        self.use_varlen = use_varlen
        self.keys = keys
        # the keys' bounds: the queries' own unless shared
        self.cu_seqlens_k = self.cu_seqlens if keys is None else keys.cu_seqlens
        self.max_seqlen_k = self.max_seqlen if keys is None else keys.max_seqlen
        self._bounds: list[tuple[int, int, int, int]] | None = None
        self._padding: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device=None, layer_windows=None):
        cu = torch.tensor([0, *lengths], device=device).cumsum(0)  # (N + 1,)
        return cls(cu, max(lengths), layer_windows)

    def __call__(self, layer_index: int, q, k, v) -> torch.Tensor:
        window = self.layer_windows[layer_index] if self.layer_windows else None
        if window is not None and window >= self.max_seqlen_k:
            window = None  # every key is inside the window anyway
        if self.keys is not None:
            k, v = gather_rows(self.keys.rows, k, v)  # (Tk, Hkv, D) each
        if self._varlen_applies(q, window):
            return self._varlen(q, k, v, window)
        N, T = self.cu_seqlens.numel() - 1, q.shape[0]
        if N > 1 and N * self.max_seqlen_k <= PADDED_BATCH_LIMIT * max(T, k.shape[0]):
            return self._sdpa_padded(q, k, v, window)
        return self._sdpa_loop(q, k, v, window)

    def _varlen_applies(self, q, window) -> bool:
        if self.use_varlen is False:
            return False
        return q.is_cuda and flash_serves(q.dtype, q.shape[-1], window)

    def _varlen(self, q, k, v, window) -> torch.Tensor:
        needs_grad = torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad
        )
        if window is None and not needs_grad:
            return self._flash_forward(q, k, v)
        if needs_grad and FLASH_AUTOGRAD:
            return FlashVarlenCausal.apply(q, k, v, *self._flash_bounds(), window)
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
        return varlen_attn(q, k, v, *self._flash_bounds(), **kwargs)  # (T, Hq, D)

    def _flash_bounds(self) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), as the flash kernels take them."""
        return self.cu_seqlens, self.cu_seqlens_k, self.max_seqlen, self.max_seqlen_k

    def _flash_forward(self, q, k, v) -> torch.Tensor:
        """Inference (no autograd): the flash kernel that `varlen_attn` wraps, called directly.
        It takes grouped-query k/v as they are (no repeat to q's head count, which torch 2.11's
        `varlen_attn` needs), and skips the custom-op and autograd layers, ~0.2 ms of host time
        per call on the H100 machine (benchmarks/lab/profile_rollout_host.py)."""
        bounds = self._flash_bounds()
        return torch.ops.aten._flash_attention_forward(q, k, v, *bounds, 0.0, True, False)[0]

    def _sdpa_padded(self, q, k, v, window) -> torch.Tensor:
        """One `scaled_dot_product_attention` over the sequences padded to the longest, with a
        mask for causality, padding and the window. On a CPU this beats a call per sequence
        (SmolLM2 forward + backward over the quick start's 32 rows of ~60 tokens, 2 cores:
        10.3 -> 8.9 s); padded queries see their sequence's keys, so no row is empty."""
        N, Lq, Lk = self.cu_seqlens.numel() - 1, self.max_seqlen, self.max_seqlen_k
        if self._padding is None:
            q_lengths = self.cu_seqlens.diff().long()  # (N,)
            k_lengths = self.cu_seqlens_k.diff().long()  # (N,)
            q_slots = _padded_slots(self.cu_seqlens, Lq)  # (T,) in (N*Lq)
            k_slots = _padded_slots(self.cu_seqlens_k, Lk)  # (Tk,) in (N*Lk)
            offset = (  # (N, Lq, Lk): query index (aligned to the end of the keys) - key index
                torch.arange(Lq, device=q.device)[None, :, None]
                + (k_lengths - q_lengths)[:, None, None]
                - torch.arange(Lk, device=q.device)[None, None, :]
            )
            visible = (offset >= 0) & (torch.arange(Lk, device=q.device) < k_lengths[:, None, None])
            self._padding = q_slots, k_slots, visible, offset
        q_slots, k_slots, visible, offset = self._padding
        if window is not None:
            visible = visible & (offset < window)

        def padded(x, slots, L):  # (rows, heads, D) -> (N, heads, L, D), zeros past each sequence
            full = x.new_zeros(N * L, *x.shape[1:]).index_copy(0, slots, x)
            return full.view(N, L, *x.shape[1:]).transpose(1, 2)

        groups = q.shape[1] // k.shape[1]
        qp, kp, vp = padded(q, q_slots, Lq), padded(k, k_slots, Lk), padded(v, k_slots, Lk)
        if groups > 1 and not _SDPA_HAS_GQA:
            kp, vp = kp.repeat_interleave(groups, dim=1), vp.repeat_interleave(groups, dim=1)
        extra = {"enable_gqa": True} if groups > 1 and _SDPA_HAS_GQA else {}
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=visible[:, None], **extra)
        return o.transpose(1, 2).reshape(N * Lq, *q.shape[1:])[q_slots]  # (T, Hq, D)

    def _sdpa_loop(self, q, k, v, window) -> torch.Tensor:
        if self._bounds is None:  # one host read per forward, not per layer
            bounds, key_bounds = self.cu_seqlens.tolist(), self.cu_seqlens_k.tolist()
            self._bounds = list(zip(bounds[:-1], bounds[1:], key_bounds[:-1], key_bounds[1:]))
        groups = q.shape[1] // k.shape[1]
        gqa = groups > 1 and _SDPA_HAS_GQA
        outs = []
        for start, end, k_start, k_end in self._bounds:
            qs = q[start:end].transpose(0, 1)  # (Hq, Lq, D)
            ks = k[k_start:k_end].transpose(0, 1)  # (Hkv, Lk, D)
            vs = v[k_start:k_end].transpose(0, 1)  # (Hkv, Lk, D)
            if groups > 1 and not gqa:
                ks = ks.repeat_interleave(groups, dim=0)  # (Hq, Lk, D)
                vs = vs.repeat_interleave(groups, dim=0)  # (Hq, Lk, D)
            extra = {"enable_gqa": True} if gqa else {}
            Lq, Lk = end - start, k_end - k_start
            if Lq != Lk or (window is not None and Lk > window):
                mask = _causal_mask(Lq, window, q.device, Lk)  # (Lq, Lk)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, **extra)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, **extra)
            outs.append(o.transpose(0, 1))  # (Lq, Hq, D)
        return torch.cat(outs)  # (T, Hq, D)


def _padded_slots(cu_seqlens: torch.Tensor, width: int) -> torch.Tensor:
    """(T,) slot of each packed row in a (N, width) padded layout of its sequences."""
    lengths = cu_seqlens.diff().long()  # (N,)
    sequence = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=lengths.device), lengths
    )
    return sequence * width + packed_positions(cu_seqlens).long()


class FlashVarlenCausal(torch.autograd.Function):
    """Causal (optionally windowed) flash attention over packed sequences, with autograd, by the
    two ATen flash kernels that `varlen_attn` wraps, called directly.

    Why: on torch 2.11 `varlen_attn` takes no grouped-query k/v, so k and v would be repeated to
    q's head count before the kernel (two copies per layer forward, two reductions backward), and
    its custom-op and autograd layers cost ~0.3 ms of host time per layer's backward on the H100
    machine (benchmarks/lab/profile_step.py). The flash kernels themselves take grouped k/v: the
    forward reads each k/v head for all its query heads, and the backward sums dk/dv over a
    group inside ATen. Same kernels, same numerics as `varlen_attn` on repeated k/v.

    apply(q (T, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, D), cu_seqlens_q (N + 1,) int32,
    cu_seqlens_k (N + 1,) int32, max_seqlen_q, max_seqlen_k, window or None) -> (T, Hq, D). The
    causal mask is aligned to the end of each sequence's keys. No dropout; the default 1/sqrt(D)
    scale.
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q: int, max_k: int, window: int | None):
        left = -1 if window is None else window - 1  # flash counts the keys before the query
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,
            window is None,
            False,
            window_size_left=left,
            window_size_right=0,
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state, unused)
        ctx.max_q, ctx.max_k, ctx.window = max_q, max_k, window
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_q, cu_k, rng_state, unused = ctx.saved_tensors
        window = ctx.window
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            cu_q,
            cu_k,
            ctx.max_q,
            ctx.max_k,
            0.0,
            window is None,
            rng_state,
            unused,
            window_size_left=-1 if window is None else window - 1,
            window_size_right=0,
        )
        return dq, dk, dv, None, None, None, None, None


FLASH_AUTOGRAD = True
"""Training attention through `FlashVarlenCausal` (grouped k/v, no repeat); the GPU tests set it
False to check it against torch's `varlen_attn` autograd on repeated k/v, which the windowed
no-gradient path uses."""


def packed_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(T,) position of each packed token within its own sequence: 0, 1, ..., 0, 1, ..."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # (N,)
    total = int(cu_seqlens[-1])
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)  # (T,)
    return torch.arange(total, device=cu_seqlens.device) - starts

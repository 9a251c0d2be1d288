"""Per-token log-probs of completion tokens under a causal LM, without full-sequence logits.

The backbone runs on prompt + completion; only the hidden states that predict completion tokens
(and only unmasked ones, packed) go through the LM head, via `kernels.lm_head_logprob`. The native
transformer runs on packed rows (each row's real prompt tokens and its kept completion tokens, no
padding); a transformers model runs on the padded batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fastgrpo.kernels.train.lm_head_logprob import lm_head_logprob
from fastgrpo.models.attention import SharedKeys
from fastgrpo.models.transformer import Transformer
from fastgrpo.rollout.types import Rollout
from fastgrpo.transfer import to_device


def lm_head_weight(model) -> torch.Tensor:
    """(V, H) LM-head weight of a native or a transformers model."""
    if isinstance(model, Transformer):
        return model.lm_head_weight
    return model.get_output_embeddings().weight


def backbone_of(model):
    """The transformer body returning hidden states (e.g. `LlamaForCausalLM.model`)."""
    body = getattr(model, model.base_model_prefix, None)
    if body is None:
        raise ValueError(f"{type(model).__name__} exposes no base model; it cannot be trained here")
    return body


def trim_padding(rollout: Rollout) -> Rollout:
    """Drop prompt columns that are padding in every row and completion columns after every stop."""
    keep_prompt = rollout.prompt_mask.any(0).nonzero()
    start = int(keep_prompt[0]) if len(keep_prompt) else rollout.prompt_mask.shape[1] - 1
    width = max(int(rollout.completion_mask.sum(-1).max()), 1)
    return Rollout(
        rollout.prompt_ids[:, start:],
        rollout.prompt_mask[:, start:],
        rollout.completion_ids[:, :width],
        rollout.completion_mask[:, :width],
        rollout.finished,
        None if rollout.sampling_logp is None else rollout.sampling_logp[:, :width],
    )


def concat_rollouts(parts: list[Rollout]) -> Rollout:
    """The rows of several rollouts in one: prompts left-padded and completions right-padded (with
    id 0, mask 0) to the widest part, the layout `generate` makes."""
    if len(parts) == 1:
        return parts[0]
    tp = max(r.prompt_ids.shape[1] for r in parts)
    tc = max(r.completion_ids.shape[1] for r in parts)

    def cat(tensors, width, left):
        if any(t is None for t in tensors):
            return None
        pad = lambda t: F.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]))  # noqa: E731
        return torch.cat([pad(t) for t in tensors])

    return Rollout(
        cat([r.prompt_ids for r in parts], tp, left=True),
        cat([r.prompt_mask for r in parts], tp, left=True),
        cat([r.completion_ids for r in parts], tc, left=False),
        cat([r.completion_mask for r in parts], tc, left=False),
        torch.cat([r.finished for r in parts]),
        cat([r.sampling_logp for r in parts], tc, left=False),
    )


def completion_hidden(model, rollout: Rollout) -> torch.Tensor:
    """(B, Tc, H) final hidden states; position t predicts completion token t.

    The rollout should already be trimmed (`trim_padding`); widths are kept as given.
    """
    prompt_len = rollout.prompt_ids.shape[1]
    input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)  # (B, Tp+Tc)
    attention = torch.cat([rollout.prompt_mask, torch.ones_like(rollout.completion_ids)], 1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
    hidden = backbone_of(model)(
        input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=False
    ).last_hidden_state  # (B, Tp+Tc, H)
    return hidden[:, prompt_len - 1 : -1]


def kept_hidden(model, rollout: Rollout) -> torch.Tensor:
    """(n, H) final hidden states that predict the kept completion tokens (mask order: row by row).

    The completion mask of each row must be a prefix (its tokens up to the stop), or all zero;
    prompts are left-padded. The native transformer runs on packed rows (`pack_rows`: each
    distinct prompt once, then its rows' kept completion tokens); a transformers model runs on
    the padded batch.
    """
    if not isinstance(model, Transformer):
        return completion_hidden(model, rollout)[rollout.completion_mask.bool()]
    layout = layout_of(rollout)
    packed = None if layout is None else layout.to_device(rollout.prompt_ids.device)
    if packed is None:  # nothing kept
        return rollout.prompt_ids.new_zeros(
            0, model.config.hidden_size, dtype=model.lm_head_weight.dtype
        )
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1).view(-1)  # (B*(Tp+Tc),)
    attend = model.packed_attention(packed.cu_seqlens, packed.max_seqlen, packed.keys)
    hidden = model(
        ids[packed.tokens], packed.positions, attend, position_bound=packed.position_bound
    )  # (T, H)
    return hidden[packed.scored]


SHARE_PROMPTS = True
"""Rows with the same prompt share one packed copy of it (12288-token micro-batches fit in 11.9
GiB instead of OOM; HISTORY.md, "Shared prompts"); tests flip it to check the unshared packing."""


@dataclass
class PackedRows:
    """A packed training forward over rows of (left-padded prompt, completion).

    tokens (T,): index of each packed token in the rows' flattened (prompt ++ completion) ids;
    positions (T,); cu_seqlens (N + 1,) int32 and max_seqlen: the query sequences; keys: where
    each sequence's keys are when prompts are shared (None: its own rows); scored (n,): the packed
    row whose hidden state predicts each kept completion token, in mask order; position_bound:
    above every position.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    keys: SharedKeys | None
    scored: torch.Tensor
    position_bound: int


@dataclass
class HostLayout:
    """`PackedRows` on the host, as numpy int64 arrays: what `pack_layout` builds and
    `to_device` sends in one copy. `cu_seqlens_k`: the keys' bounds (the queries' own when
    `key_rows` is None)."""

    tokens: np.ndarray
    positions: np.ndarray
    scored: np.ndarray
    cu_seqlens: np.ndarray
    cu_seqlens_k: np.ndarray
    key_rows: np.ndarray | None
    max_seqlen: int
    max_seqlen_k: int
    position_bound: int
    kept: np.ndarray  # (n,) each kept completion token's place in the flattened (B * Tc) rows

    def to_device(self, device) -> PackedRows:
        parts = [self.tokens, self.positions, self.scored, self.cu_seqlens, self.cu_seqlens_k]
        parts += [] if self.key_rows is None else [self.key_rows]
        joined = to_device(torch.from_numpy(np.concatenate(parts)), device)  # one copy
        on_device = joined.split([p.size for p in parts])
        tokens, positions, scored, cu, cu_k = on_device[:5]
        keys = None
        if self.key_rows is not None:
            keys = SharedKeys(on_device[5], cu_k, self.max_seqlen_k)
        return PackedRows(
            tokens=tokens,
            positions=positions,
            cu_seqlens=cu.to(torch.int32),
            max_seqlen=self.max_seqlen,
            keys=keys,
            scored=scored,
            position_bound=self.position_bound,
        )


def prompt_groups(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, share: bool | None = None
) -> torch.Tensor:
    """(B,) int64: rows with the same real prompt tokens get the same number, the rows that
    share a packed prompt; without `share` (default SHARE_PROMPTS), each row its own."""
    if not (SHARE_PROMPTS if share is None else share):
        return torch.arange(prompt_ids.shape[0], device=prompt_ids.device)
    real = prompt_ids.long().masked_fill(~prompt_mask.bool(), -1)  # (B, Tp)
    return torch.unique(real, dim=0, return_inverse=True)[1]


def pack_layout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    share_prompts: bool | None = None,
) -> HostLayout | None:
    """The packed layout of a trainer forward, on the host (None when no row keeps a token);
    `pack_rows` sends it to the device.

    Each row is fed its real prompt tokens and its kept completion tokens but the last (which
    predicts nothing); rows keeping nothing are not fed. With `share_prompts` (default
    SHARE_PROMPTS), rows with the same prompt (GRPO's G samples of one prompt) are packed as that
    prompt once, then each row's completion tokens, whose queries attend to the prompt's keys and
    their own: the prompt is computed once per micro-batch instead of once per row (a third of the
    tokens at prompt 128, completion 256), and the prompt's gradients are the sum over its rows, as
    they would be with copies. One device-to-host read (lengths and groups); the layout itself is
    built on the host and sent in one copy.
    """
    B, Tp = prompt_ids.shape
    width = Tp + completion_mask.shape[1]
    group = prompt_groups(prompt_ids, prompt_mask, share_prompts)
    host = torch.stack([group, prompt_mask.sum(-1).long(), completion_mask.sum(-1).long()])
    group, prompt_len, kept = host.cpu().numpy()  # numpy: the layout is ~40 small host ops
    live = np.flatnonzero(kept > 0)  # rows fed, ascending
    if live.size == 0:
        return None
    if prompt_len[live].min() == 0:
        raise ValueError(
            "a row has an empty prompt: every completion needs a prompt token before it"
        )
    # rows of a group next to each other (in row order), each group after its first row's group
    order = live[np.argsort(group[live], kind="stable")]
    first = np.ones(order.size, dtype=bool)
    first[1:] = group[order][1:] != group[order][:-1]
    gi = np.cumsum(first) - 1  # group number of each ordered row
    members = np.bincount(gi)  # (G,)
    rep = order[first]  # one row of each group, whose prompt tokens are fed
    glen = prompt_len[rep]  # (G,)
    fed = kept[order] - 1  # (R,) completion tokens fed per ordered row
    G, R = rep.size, order.size
    # blocks in packed order: each group's prompt, then its rows' completion tokens
    prompt_block = np.arange(G) + (np.cumsum(members) - members)  # (G,)
    row_block = gi + 1 + np.arange(R)  # (R,)
    length = np.empty(G + R, dtype=np.int64)
    source = np.empty(G + R, dtype=np.int64)
    first_position = np.empty(G + R, dtype=np.int64)
    length[prompt_block], length[row_block] = glen, fed
    source[prompt_block], source[row_block] = rep * width + Tp - glen, order * width + Tp
    first_position[prompt_block], first_position[row_block] = 0, glen[gi]
    tokens, positions = _ranges(source, length), _ranges(first_position, length)
    start = np.cumsum(length) - length  # packed row of each block's first token
    prompt_start = start[prompt_block]  # (G,)
    if members.max() > 1:  # queries per block; keys: the group's prompt, then its own
        key_start = np.empty((G + R, 2), dtype=np.int64)
        key_length = np.empty((G + R, 2), dtype=np.int64)
        key_start[prompt_block] = prompt_start[:, None]
        key_length[prompt_block, 0], key_length[prompt_block, 1] = glen, 0
        key_start[row_block, 0], key_start[row_block, 1] = prompt_start[gi], start[row_block]
        key_length[row_block, 0], key_length[row_block, 1] = glen[gi], fed
        nonempty = length > 0
        q_lengths = length[nonempty]
        key_rows = _ranges(key_start[nonempty].ravel(), key_length[nonempty].ravel())
        k_lengths = key_length[nonempty].sum(1)
    else:  # every prompt has one row: each sequence is its prompt and completion, contiguous
        q_lengths = glen + fed  # one row per group: gi is 0, 1, 2, ...
        key_rows, k_lengths = None, q_lengths
    # scored: a row's first kept token is predicted by its prompt's last token, then its own
    inverse = np.empty(B, dtype=np.int64)
    inverse[order] = np.arange(R)
    i = inverse[live]  # ordered index of each fed row, in row order
    n_kept = kept[live]
    scored = _ranges(start[row_block[i]] - 1, n_kept)
    scored[np.cumsum(n_kept) - n_kept] = prompt_start[gi[i]] + glen[gi[i]] - 1
    cu = np.concatenate([[0], np.cumsum(q_lengths)])
    cu_k = np.concatenate([[0], np.cumsum(k_lengths)])
    return HostLayout(
        tokens=tokens,
        positions=positions,
        scored=scored,
        cu_seqlens=cu,
        cu_seqlens_k=cu_k,
        key_rows=key_rows,
        max_seqlen=int(q_lengths.max()),
        max_seqlen_k=int(k_lengths.max()),
        position_bound=int((first_position + length).max()),
        kept=_ranges(live * completion_mask.shape[1], n_kept),
    )


def pack_rows(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    share_prompts: bool | None = None,
) -> PackedRows | None:
    """`pack_layout` on the device: one copy (None when no row keeps a token)."""
    layout = pack_layout(prompt_ids, prompt_mask, completion_mask, share_prompts)
    return None if layout is None else layout.to_device(prompt_ids.device)


def layout_of(rollout: Rollout, share_prompts: bool | None = None) -> HostLayout | None:
    """`pack_layout` of the rollout's rows, kept on the rollout (for the same tensors, values
    and sharing): the update computes every micro-batch's before its passes, so the passes
    themselves read nothing back from the device and the host can queue ahead of the GPU."""
    share = SHARE_PROMPTS if share_prompts is None else share_prompts
    tensors = (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_mask)
    key = (share, *((t.data_ptr(), t._version, tuple(t.shape)) for t in tensors))
    cached = rollout.__dict__.get(_LAYOUT)
    if cached is not None and cached[0] == key:
        return cached[1]
    layout = pack_layout(*tensors, share)
    rollout.__dict__[_LAYOUT] = (key, layout)
    return layout


_LAYOUT = "_packed_layout"  # a Rollout's attribute: (key, HostLayout or None)


def kept_index(rollout: Rollout) -> torch.Tensor:
    """(n,) int64 on the rollout's device: where each kept completion token is in the flattened
    (B * Tc) completion tensors, in mask order. `x.reshape(-1)[kept_index(r)]` is `x[mask]`
    without the host read a boolean mask costs, from the layout (`layout_of`)."""
    layout = layout_of(rollout)
    kept = np.zeros(0, dtype=np.int64) if layout is None else layout.kept
    return to_device(torch.from_numpy(kept), rollout.prompt_ids.device)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """concatenate([arange(s, s + n) for s, n in zip(starts, lengths)]), without a Python loop."""
    offsets = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return offsets + np.arange(offsets.size)


def unpack(keep: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """(n,) values of the kept positions -> (B, Tc) fp32 with zeros elsewhere."""
    return packed.new_zeros(keep.shape, dtype=torch.float32).masked_scatter(keep, packed.float())


def completion_logprobs(
    model,
    rollout: Rollout,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    fused: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp, entropy) of shape (B, Tc) for the rollout's completion tokens; 0 where masked.

    `fused`: score with the Triton kernel (None: on CUDA when no gradient is needed).
    """
    hidden = kept_hidden(model, rollout)  # (n, H)
    keep = rollout.completion_mask.bool()  # (B, Tc)
    packed_logp, packed_entropy = lm_head_logprob(
        hidden,
        lm_head_weight(model),
        rollout.completion_ids[keep],
        temperature,
        with_entropy,
        fused=fused,
    )  # (n,)
    return unpack(keep, packed_logp), unpack(keep, packed_entropy) if with_entropy else None

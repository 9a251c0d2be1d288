"""Per-token log-probs of completion tokens under a causal LM, without full-sequence logits.

The backbone runs on prompt + completion; only the hidden states that predict completion tokens
(and only unmasked ones, packed) go through the LM head, via `kernels.lm_head_logprob`. The native
transformer runs on packed rows (each row's real prompt tokens and its kept completion tokens, no
padding); a transformers model runs on the padded batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastgrpo.kernels.lm_head_logprob import lm_head_logprob
from fastgrpo.models.attention import packed_positions
from fastgrpo.models.transformer import Transformer
from fastgrpo.rollout.types import Rollout


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

    The completion mask of each row must be a prefix (its tokens up to the stop), or all zero.
    """
    if not isinstance(model, Transformer):
        return completion_hidden(model, rollout)[rollout.completion_mask.bool()]
    Tp = rollout.prompt_ids.shape[1]
    kept = rollout.completion_mask.sum(-1).long()  # (B,)
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)  # (B, Tp+Tc)
    column = torch.arange(ids.shape[1], device=ids.device)  # (Tp+Tc,)
    # fed: the real prompt tokens and the kept completion tokens but the last (it predicts nothing)
    fed = torch.cat([rollout.prompt_mask.bool(), column[Tp:] < (Tp + kept - 1)[:, None]], 1)
    fed &= (kept > 0)[:, None]  # rows with nothing kept are not run at all
    # scored: the positions whose hidden state predicts a kept token
    scored = (column >= Tp - 1) & (column <= (Tp + kept - 2)[:, None])  # (B, Tp+Tc)
    lengths = fed.sum(-1)
    lengths = lengths[lengths > 0]
    if lengths.numel() == 0:
        return ids.new_zeros(0, model.config.hidden_size, dtype=model.lm_head_weight.dtype)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)  # (rows + 1,)
    longest = int(lengths.max())
    attend = model.packed_attention(cu, longest)
    hidden = model(ids[fed], packed_positions(cu), attend, position_bound=longest)  # (T, H)
    return hidden[scored[fed]]


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

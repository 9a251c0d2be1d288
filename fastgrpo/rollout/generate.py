"""One entry point for a rollout: the native engine for native models, HF `generate` otherwise."""

from __future__ import annotations

from fastgrpo.models.transformer import Transformer
from fastgrpo.rollout.hf_generate import hf_rollout
from fastgrpo.rollout.native_generate import native_rollout
from fastgrpo.rollout.types import Rollout


def generate_rollout(model, tokenizer, prompts: list[str], **options) -> Rollout:
    """G completions of each chat-templated prompt, rows grouped by prompt (see `hf_rollout` for
    the options: num_generations, max_new_tokens, stop_ids, temperature, top_k, top_p,
    with_sampling_logp)."""
    if isinstance(model, Transformer):
        return native_rollout(model, tokenizer, prompts, **options)
    return hf_rollout(model, tokenizer, prompts, **options)

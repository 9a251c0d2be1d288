"""Rollout through Hugging Face `generate`: the correct-first engine and the fallback path.

Each prompt is repeated G times and sampled in one batch. The native engine (prefill once, CUDA
graphs, on-device sampling) replaces this behind the same `Rollout` result.
"""

from __future__ import annotations

import torch

from fastgrpo.rollout.types import Rollout, completion_mask


@torch.no_grad()
def hf_rollout(
    model,
    tokenizer,
    prompts: list[str],  # already chat-templated text
    *,
    num_generations: int,
    max_new_tokens: int,
    stop_ids: list[int],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    with_sampling_logp: bool = False,
    row_ids: torch.Tensor | None = None,
) -> Rollout:
    """G completions per prompt, rows grouped by prompt (prompt i owns rows i*G .. i*G+G-1).
    `row_ids` is not used: HF `generate` draws from torch's generator, so a data-parallel rank's
    rows do not repeat what one process would sample (the native engine's do).

    temperature 0 means greedy decoding.
    """
    device = next(model.parameters()).device
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    prompt_ids = encoded["input_ids"].repeat_interleave(num_generations, 0).to(device)  # (B, Tp)
    prompt_mask = encoded["attention_mask"].repeat_interleave(num_generations, 0).to(device)
    sample = temperature > 0
    options = dict(
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        eos_token_id=stop_ids,
        pad_token_id=tokenizer.pad_token_id,
        return_dict_in_generate=True,
        output_logits=with_sampling_logp,
    )
    if sample:
        options.update(temperature=temperature, top_k=top_k or None, top_p=top_p)
    else:  # silence generation_config sampling defaults that do not apply to greedy decoding
        options.update(temperature=None, top_k=None, top_p=None)
    was_training = model.training
    model.eval()
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **options)
    model.train(was_training)
    completion_ids = out.sequences[:, prompt_ids.shape[1] :]  # (B, Tc)
    if completion_ids.shape[1] == 0:
        completion_ids = prompt_ids.new_full((prompt_ids.shape[0], 1), tokenizer.pad_token_id)
    mask, finished = completion_mask(completion_ids, stop_ids)
    sampling_logp = None
    if with_sampling_logp:
        logits = torch.stack(out.logits, dim=1).float() / (
            temperature if sample else 1.0
        )  # (B, Tc, V)
        sampling_logp = (
            torch.log_softmax(logits, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        )
        sampling_logp = sampling_logp * mask
    return Rollout(prompt_ids, prompt_mask, completion_ids, mask, finished, sampling_logp)

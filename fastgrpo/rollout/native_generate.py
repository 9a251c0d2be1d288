"""Rollout through the native engine, returned as the same `Rollout` the HF path gives.

One engine is kept per model (its buffers, and later its CUDA graphs, outlive a step) and reads the
model's own parameters. It lives on the model as a plain attribute, so it dies with the model: a
table keyed weakly by the model would never let go, because the engine refers to its model.
`release_engine` frees it (KV cache, graphs) at once, without waiting for the garbage collector. Per-sample seeds come from torch's default generator, so a seeded run (and
the evaluation's forked RNG) is reproducible exactly as with HF `generate`.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from fastgrpo.rollout.engine import RolloutEngine, sample_seeds
from fastgrpo.rollout.sampling import SamplingParams
from fastgrpo.rollout.types import Rollout
from fastgrpo.transfer import to_device

_ENGINE_ATTRIBUTE = "_fastgrpo_rollout_engine"


def engine_for(model, stop_ids: list[int], pad_id: int) -> RolloutEngine:
    """The model's engine, made on first use (and again if the stop ids or pad id change)."""
    key = (tuple(sorted(set(stop_ids))), pad_id)
    made = model.__dict__.get(_ENGINE_ATTRIBUTE)
    if made is None or made[0] != key:
        release_engine(model)  # the old engine's cache goes before the new one is allocated
        made = key, RolloutEngine(model, stop_ids=stop_ids, pad_id=pad_id)
        model.__dict__[_ENGINE_ATTRIBUTE] = made
    return made[1]


def release_engine(model) -> None:
    """Drop the model's engine, if it has one; the next rollout makes a new one."""
    model.__dict__.pop(_ENGINE_ATTRIBUTE, None)


def left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask), both (B, max length), rows aligned to the right."""
    lengths = np.array([len(r) for r in rows])
    width = int(lengths.max())
    mask = np.arange(width) >= (width - lengths)[:, None]  # (B, width): the right-aligned tokens
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    ids[mask] = np.fromiter(itertools.chain.from_iterable(rows), np.int64, int(lengths.sum()))
    return (
        to_device(torch.from_numpy(ids), device),
        to_device(torch.from_numpy(mask.astype(np.int64)), device),
    )


@torch.no_grad()
def native_rollout(
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
    """G completions per prompt, rows grouped by prompt; temperature 0 means greedy decoding.
    `row_ids` (P * G,): the rows' numbers in the whole batch when these prompts are a share of it
    (data parallel): each row samples with its number's seed, as it would in one process."""
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    engine = engine_for(model, stop_ids, tokenizer.pad_token_id)
    seed = int(torch.randint(0, 2**31 - 1, ()))  # from the default generator: seeded runs repeat
    params = SamplingParams(temperature, top_k, top_p)
    seeds = None if row_ids is None else sample_seeds(seed, row_ids, engine.device)
    out = engine.generate(
        ids,
        num_samples=num_generations,
        max_new_tokens=max_new_tokens,
        params=params,
        seed=seed,
        seeds=seeds,
    )
    width = max(int(out.lengths.max()), 1)
    mask = (torch.arange(width, device=out.lengths.device) < out.lengths[:, None]).float()
    repeated = [row for row in ids for _ in range(num_generations)]
    prompt_ids, prompt_mask = left_pad(repeated, tokenizer.pad_token_id, engine.device)
    logp = out.logp[:, :width] if with_sampling_logp else None
    return Rollout(prompt_ids, prompt_mask, out.tokens[:, :width], mask, out.finished, logp)

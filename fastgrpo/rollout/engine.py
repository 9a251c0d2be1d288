"""The native generation engine: G samples of each prompt from the trainer's own model.

A rollout, for P prompts and G samples each (rows b = p * G + g):
  1. prefill: the P prompts, packed (no padding), run once; their keys and values go into the
     prompt part of the KV cache, shared by the G samples; the last prompt token's logits give
     every sample's first token. On a GPU the prefill is a CUDA graph too, for the packed token
     count rounded up (`decode.prefill_rows`, padding rows computed and dropped): run eagerly, a
     small batch's prefill is mostly the host's launches (where: `_prefill_graph_applies`);
  2. decode: one token per row per step; each step writes one completion slot of the cache,
     samples on the device (counter-based noise: a sample's tokens depend only on its seed) and
     updates lengths and finish flags on the device. The host looks at the finish flags only every
     `check_every` steps, to stop early. On a GPU the step is a CUDA graph (`decode.py`), and each
     look reads the flags copied at the look before, without waiting (`FinishLook`).
Rows that have finished keep stepping (their outputs are masked) while a row of their group of G
runs; once the groups still running fit a smaller bucket of prompts, the wave is compacted to it at
a look (`WaveBuffers.compact`), so finished groups stop costing steps.

The engine reads the model's parameter tensors directly: an optimizer step changes what the next
rollout samples, with no copy. Rows are split into waves whose KV cache fits `memory_bytes`; the
counter-based sampler makes the result the same however the rows are split, up to the kernels a
batch size selects on a GPU (at most 64 rows: the fused LM-head sampler's fp32 logits), whose
roundings can turn a near tie between two tokens the other way.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from fastgrpo.kernels.decode.decode_record import live_groups_into, live_groups_ref
from fastgrpo.models.attention import flash_serves
from fastgrpo.rollout.decode import WaveBuffers, prefill_graph_bytes, prefill_rows
from fastgrpo.rollout.kv_cache import kv_bytes_per_token
from fastgrpo.rollout.sampling import SamplingParams

log = logging.getLogger("fastgrpo.rollout")

DEFAULT_CPU_MEMORY_BYTES = 4 * 2**30
FREE_MEMORY_SHARE = 0.7  # of a GPU's free memory: the budget the rows of a wave must fit
PROMPT_BUCKET = 64  # prompt cache capacity is rounded up to this, so similar batches share buffers
KEEP_WAVE_SHAPES = 2  # wave buffers (KV cache, graph) kept for reuse by later rollouts
PREFILL_GRAPH_SHARE = 16
"""A prefill is captured as a graph only where its pool's estimate is at most 1 / 16 of the memory
budget: the pool stays allocated between rollouts, as the KV cache does."""


def prompt_capacity(prompt_len: int) -> int:
    """The prompt cache's length for prompts of up to `prompt_len` tokens."""
    return -(-prompt_len // PROMPT_BUCKET) * PROMPT_BUCKET


def row_bytes(config, dtype: torch.dtype, prompt_len: int, max_new_tokens: int) -> int:
    """Memory one sample row costs in a wave: its completion cache, its prompt's cache (counted in
    full for every row, an upper bound when G samples share it), and the sampler's fp32 logits
    work."""
    per_token = kv_bytes_per_token(config, dtype)
    return per_token * (prompt_len + max_new_tokens) + 4 * 4 * config.vocab_size


def wave_plan(num_prompts: int, num_samples: int, fit: int):
    """(first prompt, prompts in the wave, first sample, samples per prompt) per wave, for waves of
    at most `fit` rows: whole groups when one fits; otherwise one prompt per wave with its samples
    split."""
    if fit >= num_samples:
        per_wave = fit // num_samples
        for first in range(0, num_prompts, per_wave):
            yield first, min(per_wave, num_prompts - first), 0, num_samples
        return
    for prompt in range(num_prompts):
        for sample in range(0, num_samples, fit):
            yield prompt, 1, sample, min(fit, num_samples - sample)


def available_bytes(device) -> int:
    """Memory a GPU can give PyTorch now: the driver's free memory plus what PyTorch's allocator
    holds unused (freed tensors it keeps for reuse, which the driver counts as taken). A 7B model
    initialised in fp32 and cast to bf16 left ~14 GiB there: counted as taken, it halved the rows
    of each wave at 32,640 tokens (benchmarks/lab/probe_long_lora.py)."""
    free, _ = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + max(0, unused - GRAPH_POOLS_IDLE[0])


# bytes that private CUDA-graph pools (the update's recorded layers, `train/captured_layers.py`)
# reserve without a live tensor in them: unused to PyTorch's counters, yet never free for others
GRAPH_POOLS_IDLE = [0]


_CUT_SHORT = threading.Event()


def cut_rollouts_short(on: bool = True) -> None:
    """While on, every wave ends at its next look at the finish flags (every `check_every`
    decode steps), its rows cut where they are: a stop signal during training abandons the step
    rather than waiting for its rollout (`train/stopping.py`)."""
    if on:
        _CUT_SHORT.set()
    else:
        _CUT_SHORT.clear()


@dataclass
class Generation:
    """What one `generate` call returns, on the model's device."""

    tokens: torch.Tensor  # (B, T) completion tokens; pad id after the stop token
    logp: torch.Tensor  # (B, T) fp32 log-probs of the sampled tokens at the temperature; 0 after
    lengths: torch.Tensor  # (B,) int64 tokens up to and including the stop token
    finished: torch.Tensor  # (B,) bool: True ended at a stop token, False cut at the length limit


def sample_seeds(seed: int, rows: int | torch.Tensor, device) -> torch.Tensor:
    """(rows,) int64 per-sample seeds: distinct for every (seed, row) with seed < 2**31. `rows`
    a count (rows 0, 1, ...) or the rows' numbers in a larger batch (a data-parallel rank's rows
    then sample what they would in one process)."""
    if isinstance(rows, int):
        rows = torch.arange(rows, dtype=torch.int64, device=device)
    return (seed << 32) + rows.to(device=device, dtype=torch.int64)


class RolloutEngine:
    def __init__(
        self,
        model,
        *,
        stop_ids: list[int],
        pad_id: int,
        memory_bytes: int | None = None,
        check_every: int = 8,
        cuda_graphs: bool = True,
        prefill_graphs: bool = True,
        compact: bool = True,
    ):
        if not stop_ids:
            raise ValueError("stop_ids is empty: give at least one token id that ends a completion")
        self.model = model
        self.device = model.lm_head_weight.device
        self.dtype = model.lm_head_weight.dtype
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), device=self.device)
        self.pad_id = pad_id
        self.memory_bytes = memory_bytes
        if check_every < 1:
            raise ValueError(
                f"check_every must be at least 1 (steps between checks), got {check_every}"
            )
        self.check_every = check_every
        self.cuda_graphs = cuda_graphs
        self.prefill_graphs = prefill_graphs
        self.compact = compact
        # where the device runs ahead of the host, the host's looks at the finish flags lag by one
        self.lagged_looks = self.device.type == "cuda"
        self._kept: dict[tuple, WaveBuffers] = {}
        self._warned_length = False

    # ------------------------------------------------------------------ public

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        num_samples: int,
        max_new_tokens: int,
        params: SamplingParams,
        seed: int = 0,
        seeds: torch.Tensor | None = None,
    ) -> Generation:
        """`num_samples` completions of each prompt (token ids), rows grouped by prompt.

        `seeds` (P * num_samples,) int64 overrides the per-sample seeds derived from `seed`.
        """
        self._check(prompts, num_samples, max_new_tokens)
        rows = len(prompts) * num_samples
        if seeds is None:
            seeds = sample_seeds(seed, rows, self.device)
        seeds = seeds.to(self.device)
        parts = []
        for first, count, sample, group in self._waves(prompts, num_samples, max_new_tokens):
            row0 = first * num_samples + sample  # rows of a wave are contiguous
            wave_seeds = seeds[row0 : row0 + count * group]
            wave_prompts = prompts[first : first + count]
            parts.append(self._wave(wave_prompts, group, max_new_tokens, params, wave_seeds))
        return _concat(parts)

    # ------------------------------------------------------------------ planning

    def _check(self, prompts, num_samples, max_new_tokens):
        if not prompts:
            raise ValueError("no prompts given")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("an empty prompt was given: every prompt needs at least one token")
        if num_samples < 1 or max_new_tokens < 1:
            raise ValueError(
                f"num_samples and max_new_tokens must be >= 1, got {num_samples}, {max_new_tokens}"
            )
        limit = self.model.config.max_position_embeddings
        longest = max(len(p) for p in prompts) + max_new_tokens
        windows = [w for w in self.model.config.layer_windows if w is not None]
        if windows and longest > min(windows):
            raise ValueError(
                f"prompt + completion reaches {longest} tokens, past the model's sliding attention "
                f"window ({min(windows)}), which the engine's decode attention does not apply; "
                "shorten prompts or max_new_tokens"
            )
        if limit and longest > limit and not self._warned_length:
            self._warned_length = True  # as transformers does: run, but say so once
            log.warning(
                "prompt + completion reaches %d tokens, past the model's max_position_embeddings "
                "(%d); quality may suffer: shorten prompts or max_new_tokens",
                longest,
                limit,
            )

    def _budget(self) -> int:
        if self.memory_bytes is not None:
            return self.memory_bytes
        if self.device.type == "cuda":
            return int(available_bytes(self.device) * FREE_MEMORY_SHARE)
        return DEFAULT_CPU_MEMORY_BYTES

    def _waves(self, prompts, num_samples, max_new_tokens):
        """`wave_plan` for the rows that fit the budget."""
        longest = max(len(p) for p in prompts)
        per_row = row_bytes(self.model.config, self.dtype, longest, max_new_tokens)
        return wave_plan(len(prompts), num_samples, max(1, self._budget() // per_row))

    # ------------------------------------------------------------------ one wave

    def _wave(self, prompts, group, max_new_tokens, params, seeds) -> Generation:
        wave = self._buffers(len(prompts), group, max(map(len, prompts)), max_new_tokens, params)
        wave.start(prompts, seeds, graph_prefill=self._prefill_graph_applies(prompts))
        look = FinishLook(lagged=self.lagged_looks)
        for t in range(1, max_new_tokens):
            wave.step()
            if t % self.check_every == 0:
                if _CUT_SHORT.is_set():
                    break
                live = look.live_groups(wave.live_finished(), group)
                if live == 0:
                    break
                if self.compact:
                    wave.compact(live)
        return Generation(*wave.result())

    def _prefill_graph_applies(self, prompts) -> bool:
        """Whether this wave's prefill runs as a CUDA graph: graphs on, on a GPU, attention by
        the flash kernels (capturable), and the graph's memory small beside the budget."""
        cfg = self.model.config
        if not (self.cuda_graphs and self.prefill_graphs and self.device.type == "cuda"):
            return False
        if not flash_serves(self.dtype, cfg.head_dim) or any(cfg.layer_windows):
            return False
        rows = prefill_rows(sum(map(len, prompts)))
        itemsize = self.model.lm_head_weight.element_size()
        need = prefill_graph_bytes(cfg, rows, len(prompts), itemsize)
        return need * PREFILL_GRAPH_SHARE <= self._budget()

    def _buffers(self, num_prompts, group, prompt_len, max_new_tokens, params) -> WaveBuffers:
        """Buffers (and graph) for this wave shape: reused when the shape comes again."""
        key = (num_prompts, group, prompt_capacity(prompt_len), max_new_tokens, params)
        wave = self._kept.pop(key, None)
        if wave is None:
            wave = WaveBuffers(
                self.model,
                *key,
                stop_ids=self.stop_ids,
                pad_id=self.pad_id,
                cuda_graph=self.cuda_graphs,
            )
        self._kept[key] = wave  # most recently used last
        while len(self._kept) > KEEP_WAVE_SHAPES:
            self._kept.pop(next(iter(self._kept)))
        return wave

    def release(self) -> None:
        """Free the kept buffers and graphs (the next rollout makes them again)."""
        self._kept.clear()


class FinishLook:
    """The host's look at a wave's finish flags (a device tensor the decode step updates): how many
    groups of G rows still have a row running (0: the wave is done).

    Plain: each look waits for the device and counts the flags as they are. Lagged: each look has
    the device write the count into pinned host memory without waiting, and answers with what the
    look before had written (the first look: every group), so the device always has the steps
    launched since then queued and never drains while the host waits (on an H100, a drained step
    cost ~85 us more). Rows only finish, so a lagged count is an upper bound: a wave whose rows
    have all stopped ends one look later, and a compaction keeps every group still running. On a
    GPU the write is one small kernel (`decode_record.live_groups_into`), not a reduction and a
    copy.
    """

    def __init__(self, *, lagged: bool):
        self.lagged = lagged
        self._copy: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self._looks = 0

    def live_groups(self, finished: torch.Tensor, group: int) -> int:
        """The count for `finished` (the live rows' flags) in groups of `group` rows."""
        if not self.lagged:
            return int(live_groups_ref(finished, group))
        on_gpu = finished.device.type == "cuda"
        if self._copy is None:
            self._copy = torch.zeros((), dtype=torch.int32, pin_memory=on_gpu)
            self._copied = torch.cuda.Event() if on_gpu else None
        seen = finished.numel() // group
        if self._looks:
            if self._copied is not None:
                self._copied.synchronize()
            seen = int(self._copy)
        self._looks += 1
        live_groups_into(finished, group, self._copy)
        if self._copied is not None:
            self._copied.record()
        return seen


def _concat(parts: list[Generation]) -> Generation:
    """One Generation from waves (all waves have the same width)."""
    if len(parts) == 1:
        return parts[0]
    return Generation(
        torch.cat([p.tokens for p in parts]),
        torch.cat([p.logp for p in parts]),
        torch.cat([p.lengths for p in parts]),
        torch.cat([p.finished for p in parts]),
    )

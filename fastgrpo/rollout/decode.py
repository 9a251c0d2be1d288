"""The buffers of one wave of rollout rows, and its decode step, replayable as a CUDA graph.

A decode step reads and writes only tensors that live as long as the buffers: the KV cache, the
token and log-prob outputs, lengths, finish flags, seeds, and the step counters, which are device
tensors advanced in place. So on a GPU the step is captured once (after one eager warm-up step) and
replayed: one launch per token instead of several hundred. Buffers are kept per wave shape
(prompts, samples, prompt capacity, max new tokens, sampling settings) and reused by later
rollouts; the graph reads the model's parameters where they live, so it stays valid across
optimizer steps (in-place updates). If a parameter or the RoPE table moves, the graph is
captured again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from fastgrpo.kernels.decode_record import record_step
from fastgrpo.models.attention import packed_positions
from fastgrpo.rollout.kv_cache import DecodeAttention, KVCache, PrefillAttention
from fastgrpo.rollout.sampling import SamplingParams, sample_from_hidden, sample_tokens
from fastgrpo.transfer import to_device

# FASTGRPO_FOLD_POSITIONS=0 forms a decode step's positions by a torch add (to compare)
FOLD_POSITIONS = os.environ.get("FASTGRPO_FOLD_POSITIONS", "1") != "0"


@dataclass
class DecodeState:
    """Per-row outputs and counters, written in place by each step."""

    tokens: torch.Tensor  # (B, T) int64; pad id after the stop token
    logp: torch.Tensor  # (B, T) fp32; 0 after the stop token
    lengths: torch.Tensor  # (B,) int64
    finished: torch.Tensor  # (B,) bool
    last_token: torch.Tensor  # (B,) int64: the token fed to the next step
    step: torch.Tensor  # () int64: index of the next token to sample (its column in tokens)
    slot: torch.Tensor  # () int64: completion cache slot of the next token fed
    pad_id: int

    @classmethod
    def allocate(cls, rows, max_new_tokens, pad_id, device) -> DecodeState:
        long = dict(dtype=torch.int64, device=device)
        return cls(
            torch.empty(rows, max_new_tokens, **long),
            torch.empty(rows, max_new_tokens, dtype=torch.float32, device=device),
            torch.empty(rows, **long),
            torch.empty(rows, dtype=torch.bool, device=device),
            torch.empty(rows, **long),
            torch.empty((), **long),
            torch.empty((), **long),
            pad_id,
        )

    def reset(self) -> None:
        self.tokens.fill_(self.pad_id)
        for t in (self.logp, self.lengths, self.finished, self.last_token, self.step, self.slot):
            t.zero_()

    def record(self, token, logp, stop_ids, fed: bool) -> None:
        """Keep this step's samples for rows still running; rows that sample a stop token end.
        Then advance `step`, and `slot` when this step fed a token into the cache (`fed`; the
        prefill's first sample is fed by the first decode step, into slot 0). One kernel on CUDA
        (`kernels.decode_record`)."""
        record_step(
            self.tokens, self.logp, self.lengths, self.finished, self.last_token, self.step,
            self.slot, token, logp, stop_ids, self.pad_id, fed,
        )  # fmt: skip


class WaveBuffers:
    """KV cache, decode state and (on a GPU) the captured decode step of one wave shape."""

    def __init__(
        self,
        model,
        num_prompts: int,
        group: int,
        prompt_capacity: int,
        max_new_tokens: int,
        params: SamplingParams,
        stop_ids: torch.Tensor,
        pad_id: int,
        cuda_graph: bool = True,
    ):
        weight = model.lm_head_weight
        self.model, self.group, self.params, self.stop_ids = model, group, params, stop_ids
        self.device = weight.device
        rows = num_prompts * group
        self.cache = KVCache.allocate(
            model.config,
            num_prompts,
            prompt_capacity,
            rows,
            max_new_tokens,
            weight.dtype,
            self.device,
        )
        self.state = DecodeState.allocate(rows, max_new_tokens, pad_id, self.device)
        self.seeds = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.base_positions = torch.zeros(rows, dtype=torch.int64, device=self.device)  # (B,)
        self.attend = DecodeAttention(self.cache, self.state.slot)
        self.position_bound = prompt_capacity + max_new_tokens
        self.use_graph = cuda_graph and self.device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_inputs: tuple | None = None

    def start(self, prompts: list[list[int]], seeds: torch.Tensor) -> None:
        """Prefill the prompts into the cache and sample every row's first token."""
        model, device = self.model, self.device
        if self.graph is not None and self.graph_inputs != self._inputs():
            self.graph = None  # a parameter or the RoPE table moved: capture again
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64)  # (P,)
        cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)  # (P + 1,)
        flat = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)  # (T,)
        positions = packed_positions(cu)  # (T,) position of each token within its prompt
        # numpy's repeat: torch's CPU repeat_interleave took ~2 ms a call on the H100 machine
        prompt = torch.from_numpy(np.repeat(np.arange(len(prompts)), lens.numpy()))  # (T,)
        slots = prompt * self.cache.prompt_k[0].shape[1] + positions  # (T,) in the prompt cache
        self.cache.prompt_lens.copy_(lens)
        self.base_positions.copy_(torch.from_numpy(np.repeat(lens.numpy(), self.group)))
        self.seeds.copy_(seeds)
        self.state.reset()
        cu = to_device(cu, device)
        packed = model.packed_attention(cu, int(lens.max()))
        attend = PrefillAttention(self.cache, to_device(slots, device), packed)
        hidden = model(
            to_device(flat, device),
            to_device(positions, device),
            attend,
            position_bound=self.position_bound,
            fused_ops=True,
        )  # (T, H)
        logits = model.logits(hidden[(cu[1:] - 1).long()])  # (P, V)
        logits = logits.repeat_interleave(self.group, 0)  # (B, V)
        s = self.state
        s.record(*sample_tokens(logits, self.params, self.seeds, s.step), self.stop_ids, fed=False)

    def step(self) -> None:
        """One decode step: replayed from the graph on a GPU (captured on first use)."""
        if not self.use_graph:
            return self._step()
        if self.graph is not None:  # `start` drops it if what it reads has moved
            return self.graph.replay()
        self._capture()

    def _step(self) -> None:
        s, model = self.state, self.model
        # each row's prompt length + this step's slot: added in the step's first kernel, not by
        # a torch add (a plain launch in the chain of programmatic dependent launches)
        folded = dict(position_offset=s.slot) if FOLD_POSITIONS else {}
        positions = self.base_positions if FOLD_POSITIONS else self.base_positions + s.slot
        hidden = model(
            s.last_token,
            positions,
            self.attend,
            position_bound=self.position_bound,
            fused_ops=True,
            **folded,
        )
        # in an eager step a plain launch (cuBLAS, or the fused LM head + sampler): it ends the
        # step's chain of programmatic dependent launches, so every cache write is done before the
        # next step starts, which the Gluon attention's loads before its wait rely on; a captured
        # step gets that order from the end of its graph's replay
        sampled = sample_from_hidden(hidden, model.lm_head_weight, self.params, self.seeds, s.step)
        s.record(*sampled, self.stop_ids, fed=True)

    def _inputs(self) -> tuple:
        """Addresses the graph reads beyond its own buffers: parameters and the RoPE table. Checked
        once per rollout in `start`, not per step: nothing moves them during a rollout."""
        rotary = self.model.rotary
        return (*(p.data_ptr() for p in self.model.parameters()), rotary.cos.data_ptr())

    def _capture(self) -> None:
        """Run this step eagerly on a side stream (warm-up), then capture the next one."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()  # recorded, not run: the next call replays it
        self.graph_inputs = self._inputs()

    def result(self) -> tuple[torch.Tensor, ...]:
        """Copies of (tokens, logp, lengths, finished): the buffers are reused by later waves."""
        s = self.state
        return s.tokens.clone(), s.logp.clone(), s.lengths.clone(), s.finished.clone()

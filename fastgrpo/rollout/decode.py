"""The buffers of one wave of rollout rows, and its decode step, replayable as a CUDA graph.

A decode step reads and writes only tensors that live as long as the buffers: the KV cache, the
token and log-prob outputs, lengths, finish flags, seeds, and the step counters, which are device
tensors advanced in place. So on a GPU the step is captured once (after one eager warm-up step) and
replayed: one launch per token instead of several hundred. Buffers are kept per wave shape
(prompts, samples, prompt capacity, max new tokens, sampling settings) and reused by later
rollouts; the graph reads the model's parameters where they live, so it stays valid across
optimizer steps (in-place updates). If a parameter or the RoPE table moves, the graph is
captured again.

Finished groups compacted out: at the host's looks, once the groups of G rows with a row still
running fit a smaller bucket of prompts (`prompt_buckets`: P, 3P/4, 9P/16, ..., 1), their rows, caches
and prompts move to the front of the buffers (outputs of the rest saved first, at their original
rows) and the steps run on the first rows only, with a graph per bucket. A group, not a row, is the
unit: the decode kernels find a row's prompt as row // G.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fastgrpo.cuda_graphs import capture
from fastgrpo.kernels.decode.decode_record import record_step
from fastgrpo.models.attention import packed_positions
from fastgrpo.rollout.kv_cache import DecodeAttention, KVCache, PrefillAttention
from fastgrpo.rollout.sampling import SamplingParams, sample_from_hidden, sample_tokens
from fastgrpo.transfer import to_device

PREFILL_GRAPHS_KEPT = 2
"""Captured prefills kept per wave shape (one per row bucket, most recently used kept)."""


def prompt_buckets(num_prompts: int) -> list[int]:
    """The live-prompt counts a wave's decode steps run at: P, then each 3/4 of the one before
    (rounded down, at least one less), down to 1 (64: 64, 48, 36, 27, 20, 15, 11, 8, 6, 4, 3, 2, 1).
    Halving left most of a rollout at the first bucket: a group lasts as long as its longest row."""
    sizes = [num_prompts]
    while sizes[-1] > 1:
        sizes.append(min(sizes[-1] - 1, 3 * sizes[-1] // 4) or 1)
    return sizes


def prefill_rows(tokens: int) -> int:
    """The rows a graphed prefill of `tokens` packed prompt tokens runs: rounded up to a multiple
    of 1/8 of the largest power of two <= tokens (at most 12.5% padding), and of 64, so prompts of
    similar total length replay one graph."""
    granule = max(64, 1 << max(0, tokens.bit_length() - 4))
    return -(-tokens // granule) * granule


def prefill_graph_bytes(config, rows: int, num_prompts: int, itemsize: int) -> int:
    """A rough bound on the memory a captured prefill of `rows` tokens keeps in its pool: one
    layer's activations live at once (gate/up's output and the SiLU product, q/k/v, a few
    hidden-sized tensors) and the prompts' logits, in fp32, sampled."""
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    per_row = itemsize * (3 * config.intermediate_size + qkv + 6 * config.hidden_size)
    return rows * per_row + 3 * 4 * num_prompts * config.vocab_size


@dataclass
class PrefillInputs:
    """Packed prompts as the prefill takes them, on the host: `rows` tokens, the prompts' tokens
    first, then padding (token 0 at position 0, each with a slot in the cache's spare row)."""

    tokens: torch.Tensor  # (rows,) int64
    positions: torch.Tensor  # (rows,) int64: each token's position in its prompt
    slots: torch.Tensor  # (rows,) int64: each token's flat slot prompt * Lp + position
    cu: torch.Tensor  # (P + 1,) int32: the prompts' bounds (the padding is in none of them)
    lens: torch.Tensor  # (P,) int64

    @classmethod
    def pack(cls, prompts: list[list[int]], capacity: int, rows: int | None = None):
        """`rows` None: no padding. Else at least the prompts' total token count."""
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64)  # (P,)
        cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)  # (P + 1,)
        total = int(cu[-1])
        rows = total if rows is None else rows
        if rows < total:
            raise ValueError(f"{rows} prefill rows cannot hold {total} prompt tokens")
        tokens = torch.zeros(rows, dtype=torch.int64)
        tokens[:total] = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
        positions = torch.zeros(rows, dtype=torch.int64)
        positions[:total] = packed_positions(cu)
        # numpy's repeat: torch's CPU repeat_interleave took ~2 ms a call on the H100 machine
        prompt = torch.from_numpy(np.repeat(np.arange(len(prompts)), lens.numpy()))  # (total,)
        slots = torch.empty(rows, dtype=torch.int64)
        slots[:total] = prompt * capacity + positions[:total]
        spare = len(prompts) * capacity  # the spare row: distinct slots while the padding fits
        slots[total:] = spare + torch.arange(rows - total) % capacity
        return cls(tokens, positions, slots, cu, lens)


class PrefillGraph:
    """A prefill captured for `rows` tokens of `num_prompts` prompts: its inputs live in one
    device tensor that each replay's host inputs are copied into."""

    def __init__(self, rows: int, num_prompts: int, device):
        self.rows = rows
        self.inputs = torch.empty(3 * rows + num_prompts + 1, dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def load(self, inputs: PrefillInputs) -> None:
        """Copy the host inputs in (one copy from pinned memory, queued on the stream)."""
        host = torch.cat([inputs.tokens, inputs.positions, inputs.slots, inputs.cu.long()])
        self.inputs.copy_(host.pin_memory(), non_blocking=True)

    def views(self) -> tuple[torch.Tensor, ...]:
        """(tokens, positions, slots, cu as int64) in the device tensor."""
        rows = self.rows
        return tuple(self.inputs[i * rows : (i + 1) * rows] for i in range(3)) + (
            self.inputs[3 * rows :],
        )


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

    def rows(self, b: int) -> DecodeState:
        """The first b rows (views; the counters shared)."""
        return DecodeState(
            self.tokens[:b], self.logp[:b], self.lengths[:b], self.finished[:b],
            self.last_token[:b], self.step, self.slot, self.pad_id,
        )  # fmt: skip

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


@dataclass
class LiveRows:
    """The first `prompts` prompts' rows of a wave, as views: what a compacted step reads and
    writes."""

    prompts: int
    state: DecodeState
    seeds: torch.Tensor
    base_positions: torch.Tensor
    attend: DecodeAttention


class WaveBuffers:
    """KV cache, decode state and (on a GPU) the captured decode steps of one wave shape."""

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
        self.position_bound = prompt_capacity + max_new_tokens
        self.use_graph = cuda_graph and self.device.type == "cuda"
        self.num_prompts = num_prompts
        self.live_prompts = num_prompts  # the bucket the steps run at (compaction lowers it)
        self.row_ids = torch.arange(rows, device=self.device)  # each row's original row
        self.compacted = False
        # (tokens, logp, lengths, finished) at the original rows, once a rollout compacted
        self.saved: tuple[torch.Tensor, ...] | None = None
        self._live: dict[int, LiveRows] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # the decode step's, per bucket
        self.graph_inputs: tuple | None = None
        self.prefill_graphs: dict[int, PrefillGraph] = {}  # by row count
        self.prefill_pool = None

    def start(self, prompts: list[list[int]], seeds: torch.Tensor, graph_prefill=False) -> None:
        """Prefill the prompts into the cache and sample every row's first token. With
        `graph_prefill` (and graphs on) the prefill runs `prefill_rows` rows as a CUDA graph,
        captured the first time a row count comes and replayed after: a prefill run eagerly is
        mostly host time at small batches (~0.7 ms of Python per layer on the H100 machine)."""
        captured = self.graphs or self.prefill_graphs
        if captured and self.graph_inputs != self._inputs():
            self.graphs.clear()  # a parameter or the RoPE table moved: capture again
            self.prefill_graphs.clear()
            self.prefill_pool = None  # freed with its last graph: its handle cannot be reused
        capacity = self.cache.prompt_k[0].shape[1]
        graphed = graph_prefill and self.use_graph
        total = sum(len(p) for p in prompts)
        inputs = PrefillInputs.pack(prompts, capacity, prefill_rows(total) if graphed else None)
        self.cache.prompt_lens.copy_(inputs.lens)
        self.base_positions.copy_(torch.from_numpy(np.repeat(inputs.lens.numpy(), self.group)))
        self.seeds.copy_(seeds)
        self.state.reset()
        if self.compacted:  # the rows' order of the last rollout
            self.row_ids.copy_(torch.arange(len(self.row_ids), device=self.device))
        self.live_prompts, self.compacted = self.num_prompts, False
        if not graphed:
            cu = to_device(inputs.cu, self.device)
            tokens, positions, slots = (
                to_device(t, self.device) for t in (inputs.tokens, inputs.positions, inputs.slots)
            )
            return self._prefill(tokens, positions, slots, cu, int(inputs.lens.max()))
        rows = len(inputs.tokens)
        prefill = self.prefill_graphs.pop(rows, None)
        if prefill is None:
            prefill = self._capture_prefill(rows, inputs)
        else:
            prefill.load(inputs)
            prefill.graph.replay()
        self.prefill_graphs[rows] = prefill  # most recently used last
        while len(self.prefill_graphs) > PREFILL_GRAPHS_KEPT:
            self.prefill_graphs.pop(next(iter(self.prefill_graphs)))

    def _prefill(self, tokens, positions, slots, cu, max_len: int) -> None:
        """The prompts' forward (keys and values into the cache) and every row's first sample.
        Padding rows past cu[-1] belong to no prompt: their keys go to the spare row, their
        outputs to no one."""
        model = self.model
        attend = PrefillAttention(self.cache, slots, model.packed_attention(cu, max_len))
        hidden = model(
            tokens, positions, attend, position_bound=self.position_bound, fused_ops=True
        )  # (rows, H)
        logits = model.logits(hidden[(cu[1:] - 1).long()])  # (P, V)
        if self.group > 1:  # each prompt's row for its G samples; repeat_interleave syncs
            logits = logits[:, None].expand(-1, self.group, -1).flatten(0, 1)  # (B, V)
        s = self.state
        s.record(*sample_tokens(logits, self.params, self.seeds, s.step), self.stop_ids, fed=False)

    def _prefill_on(self, prefill: PrefillGraph) -> None:
        """`_prefill` on a prefill graph's input buffers."""
        tokens, positions, slots, cu = prefill.views()
        # max_len: the prompt capacity, a bound on every prompt that fits this wave
        self._prefill(tokens, positions, slots, cu.to(torch.int32), self.cache.prompt_k[0].shape[1])

    def _capture_prefill(self, rows: int, inputs: PrefillInputs) -> PrefillGraph:
        """Run this rollout's prefill eagerly on a new graph's inputs (warm-up), then capture it
        into the wave's prefill memory pool (shared by its prefill graphs: one runs at a time and
        each writes only the cache and the decode state, which live outside the pool)."""
        prefill = PrefillGraph(rows, len(inputs.lens), self.device)
        prefill.load(inputs)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._prefill_on(prefill)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.prefill_pool is None:
            self.prefill_pool = torch.cuda.graph_pool_handle()
        prefill.graph = torch.cuda.CUDAGraph()
        with capture(prefill.graph, pool=self.prefill_pool):
            self._prefill_on(prefill)  # recorded, not run: later rollouts replay it
        self.graph_inputs = self._inputs()  # as the decode graph's (`start` drops both)
        return prefill

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The decode step's graph at all rows (None until captured)."""
        return self.graphs.get(self.num_prompts)

    def live(self) -> LiveRows:
        """Views of the rows of the bucket the steps run at (made once per bucket)."""
        prompts = self.live_prompts
        if prompts not in self._live:
            b = prompts * self.group
            state = self.state.rows(b)
            cache = self.cache.prompts(prompts, b)
            self._live[prompts] = LiveRows(
                prompts, state, self.seeds[:b], self.base_positions[:b],
                DecodeAttention(cache, state.slot),
            )  # fmt: skip
        return self._live[prompts]

    def step(self) -> None:
        """One decode step of the live rows: replayed from the bucket's graph on a GPU (captured
        on first use)."""
        live = self.live()
        if not self.use_graph:
            return self._step(live)
        graph = self.graphs.get(live.prompts)
        if graph is not None:  # `start` drops the graphs if what they read has moved
            return graph.replay()
        self._capture(live)

    def _step(self, live: LiveRows) -> None:
        s, model = live.state, self.model
        # each row's prompt length + this step's slot: added in the step's first kernel, not by
        # a torch add (a plain launch in the chain of programmatic dependent launches)
        folded = dict(position_offset=s.slot)
        positions = live.base_positions
        hidden = model(
            s.last_token,
            positions,
            live.attend,
            position_bound=self.position_bound,
            fused_ops=True,
            **folded,
        )
        # in an eager step a plain launch (cuBLAS, or the fused LM head + sampler): it ends the
        # step's chain of programmatic dependent launches, so every cache write is done before the
        # next step starts, which the Gluon attention's loads before its wait rely on; a captured
        # step gets that order from the end of its graph's replay
        sampled = sample_from_hidden(hidden, model.lm_head_weight, self.params, live.seeds, s.step)
        s.record(*sampled, self.stop_ids, fed=True)

    def compact(self, live_groups: int) -> None:
        """Continue at the smallest bucket that holds `live_groups` prompts (at least the groups
        with a row still running, as a look reported them), if smaller than the current one: each
        current row's outputs are saved at its original row, then the running groups' rows,
        caches and prompts move to the front, in order. No host sync."""
        target = min(b for b in prompt_buckets(self.num_prompts) if b >= max(live_groups, 1))
        p, G = self.live_prompts, self.group
        if target >= p:
            return
        self._save_outputs()
        s, c = self.state, self.cache
        done = s.finished[: p * G].view(p, G).all(1)  # (p,)
        keep = torch.sort(done.to(torch.uint8), stable=True).indices[:target]  # running first
        keep_rows = (keep[:, None] * G + torch.arange(G, device=self.device)).flatten()
        per_row = [s.tokens, s.logp, s.lengths, s.finished, s.last_token, self.seeds]
        per_row += [self.base_positions, self.row_ids, *c.comp_k, *c.comp_v]
        for t in per_row:
            t[: target * G].copy_(t.index_select(0, keep_rows))
        for t in [c.prompt_lens, *c.prompt_k, *c.prompt_v]:
            t[:target].copy_(t.index_select(0, keep))
        self.live_prompts, self.compacted = target, True

    def live_finished(self) -> torch.Tensor:
        """The finish flags of the rows the steps run on."""
        return self.state.finished[: self.live_prompts * self.group]

    def _save_outputs(self) -> None:
        """Write the live rows' outputs so far to their original rows of `saved`."""
        s = self.state
        outputs = (s.tokens, s.logp, s.lengths, s.finished)
        if self.saved is None:
            self.saved = tuple(torch.empty_like(t) for t in outputs)
        b = self.live_prompts * self.group
        rows = self.row_ids[:b]
        for out, t in zip(self.saved, outputs):
            out.index_copy_(0, rows, t[:b])

    def _inputs(self) -> tuple:
        """Addresses the graphs read beyond their own buffers: parameters and the RoPE table (which
        another engine's longer rollout may grow into a new tensor). Checked once per rollout in
        `start`, not per step: nothing moves them during a rollout."""
        rotary = self.model.rotary
        return (*(p.data_ptr() for p in self.model.parameters()), rotary.cos.data_ptr())

    def _capture(self, live: LiveRows) -> None:
        """Run this step eagerly on a side stream (warm-up), then capture the next one."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(live)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capture(graph):
            self._step(live)  # recorded, not run: the next call replays it
        self.graphs[live.prompts] = graph
        self.graph_inputs = self._inputs()

    def result(self) -> tuple[torch.Tensor, ...]:
        """Copies of (tokens, logp, lengths, finished) in the rows' original order: the buffers are
        reused by later waves."""
        s = self.state
        outputs = (s.tokens, s.logp, s.lengths, s.finished)
        if self.compacted:
            self._save_outputs()
            outputs = self.saved
        return tuple(t.clone() for t in outputs)

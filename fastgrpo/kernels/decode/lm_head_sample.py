"""A decode step's LM head and Gumbel-max sampler in one kernel, in Gluon for Hopper GPUs: each
row's token and log-prob straight from the hidden states, with no (B, V) logits in memory.

What: for hidden (B, H) bf16 (B <= `MAX_ROWS`) and the LM-head weight (V, H) bf16, the token and
log-prob that `sample_tokens.sample_tokens_fused(hidden @ weight.T, T, seeds, step)` returns: the
base-2 score z * log2(e) / T plus the same counter-based Gumbel noise, column for column
(`sample_tokens._noise_log2` with the row keys of `_row_keys`; greedy: the raw logit), ties to
the lowest column, and logp = log_softmax(z)[token] in fp32, from fp32 logits (cuBLAS rounds
them to bf16). The plain setting only (no top-k, no top-p).

How: a persistent kernel, one program per SM. Program p computes vocabulary tiles p, p + grid, ...
of 128 columns as two 64 x 64 fp32 accumulators (two warpgroups, each with all rows and half of
each accumulator's columns; two accumulators rather than one keep the noise hashes and the
accumulator from spilling). One ring of stages (hidden's k slice and the tile's weight rows) runs
over all k steps of all of a program's tiles as one sequence, with an mbarrier per stage, so the
next tile's weight streams in while this tile's epilogue hashes its noise and folds each row's
best score, its column, and the running max and sum of exponentials. A small Triton kernel
merges the programs per row (ties: the lowest column).

Why: the cuBLAS LM head at 64 rows of the 0.5B shape (272 MB of weight) took 109 us, then the
sampler, compute-bound (a 32-bit hash, two log2 and an exp2 per column), 27 us more; a plain
Triton fusion took 130 us (each program's epilogue stalled its own loads). Here: 109.5 us for
both, 98.6 greedy, alone in a graph, with one warpgroup (benchmarks/HISTORY.md); two warpgroups
are ~2 us slower alone but -2.9 us per replayed step; with log2 flushing subnormals (no fix-up
instructions around each MUFU.LG2) 104.2 us alone and -6.7 to -7.2 us per replayed step. The
sampling epilogue is still not hidden behind the weight's stream: greedy takes 98 us. In the
decode step, replayed: -12.6 us per step against cuBLAS + the sampler, 12 of 12 rounds
(benchmarks/results/decode_step_ab_h100_v1.txt, section 17; first reverted when the
whole-rollout harness could not see it). Inside a captured step the kernel is launched with
programmatic dependent launch and asks for every stage's weight tile before it waits for the
final norm, the hidden slices after: -2.6 us per replayed step, 8 of 8 rounds, bitwise the same
samples (benchmarks/results/lm_head_sample_pdl_h100_v1.txt). In an eager step the launch is a
plain one, so it ends the chain of programmatic dependent launches as the cuBLAS LM head did:
every cache write of the step is done before the next step's kernels start, which the Gluon
attention's loads before its wait rely on (a graph replay's end gives the same order). The hash
functions are written again in Gluon's dialect: a Gluon kernel cannot call `triton.jit`
functions.

Reference: `lm_head_sample_ref`, fp32 logits by torch, then the torch sampler.
"""

from __future__ import annotations

import torch

from fastgrpo import switches
from fastgrpo.kernels.decode import pdl
from fastgrpo.kernels.decode.pdl import gluon_start, gluon_wait
from fastgrpo.kernels.decode.sample_tokens import check_sampling_args
from fastgrpo.kernels.decode.sampling_ref import SamplingParams, sample_tokens_torch
from fastgrpo.kernels.support import (
    LN2,
    LOG2E,
    bf16_shared_layout,
    gluon,
    is_hopper,
    multiprocessors,
    tma_readable,
    triton,
    warn_not_compiled,
)

if gluon is not None:  # support found triton's Gluon layer; this kernel targets 3.6
    import triton.language as tl
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from fastgrpo.kernels.decode.gumbel_noise_gluon import (
        GOLDEN,
        mix64,
        noise_log2,
        score_scalar,
    )


# FASTGRPO_DECODE_KERNELS=0 keeps a decode step's logits in memory for the torch sampler
ENABLED = switches.DECODE_KERNELS
MAX_ROWS = 64
"""The most rows: all rows share each weight tile in one program (64 = one wgmma's M)."""
BLOCK_B, BLOCK_V, BLOCK_K = 64, 128, 64
NUM_WARPS = 8
"""Two warpgroups, each with all rows and half of every tile's columns (4: one warpgroup): the
epilogue's hashing per warp halves, and two warps per scheduler hide its latencies."""
SMEM_BYTES = 227 * 1024 - 1024  # the H100's limit per block, less the barriers
WEIGHT_BEFORE_WAIT = True
"""Inside a captured decode step, launched with programmatic dependent launch: the ring's first
weight tiles are asked for before the kernel waits for the final norm (the weight is no kernel's
output), the hidden rows after it."""
COMBINE_PDL = True
"""The per-row merge launched with programmatic dependent launch (where `pdl.active()`): it and
the record kernel after it may be put on the SMs before the sampler kernel ends."""
_failed = False  # set when the kernel did not compile here: the logits path serves from then on


def lm_head_sample_ref(hidden, weight, temperature: float, seeds, step):
    """(tokens (B,) int64, logp (B,) fp32): fp32 logits by torch, then the torch sampler."""
    logits = hidden.float() @ weight.float().t()  # (B, V)
    return sample_tokens_torch(logits, SamplingParams(temperature), seeds, step)


if gluon is not None:
    _G_LN2 = gl.constexpr(LN2)

    @gluon.jit
    def _fold(
        acc,
        cols,
        V,
        scale,
        lo2,
        hi2,
        best,
        best_col,
        run_max,
        run_sum,
        GREEDY: gl.constexpr,
        EVEN_V: gl.constexpr,
    ):
        """Fold one accumulator (columns `cols`) into the rows' running state. Order chosen for
        registers: the max / sum of exponentials straight from acc, then the scores (acc dies as
        they are formed), then the best score and its column. z2 at the best column is not kept
        (acc and the scores would both be live); it is rebuilt once at the end from the best score."""
        cols2 = gl.expand_dims(cols, 0)  # [1, SUB_V] int32
        if not EVEN_V:
            acc = gl.where(cols2 < V, acc, float("-inf"))  # columns >= V: z2 and score -inf
        # max(fl(acc * scale)) == fl(max(acc) * scale): rounding is monotone and scale > 0
        new_max = gl.maximum(run_max, gl.max(acc, 1) * scale)
        p = gl.exp2(acc * scale - gl.expand_dims(new_max, 1))
        run_sum = run_sum * gl.exp2(run_max - new_max) + gl.sum(p, 1)
        if GREEDY:
            score = acc
        else:
            score = gl.map_elementwise(score_scalar, acc, cols2.to(gl.uint32), lo2, hi2, scale)
        tile_best = gl.max(score, 1)
        # the lowest column holding the best score (torch.argmax's tie rule)
        tile_col = gl.min(gl.where(score == gl.expand_dims(tile_best, 1), cols2, 2147483647), 1)
        better = tile_best > best  # strict: earlier (lower) columns keep a tie
        best = gl.where(better, tile_best, best)
        best_col = gl.where(better, tile_col, best_col)
        return best, best_col, new_max, run_sum

    @gluon.jit
    def _issue_load(
        h_desc,
        w_desc,
        a_smem,
        b_smem,
        ready,
        step,
        pid,
        n_progs,
        k_tiles,
        BLOCK_V: gl.constexpr,
        BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr,
        HIDDEN: gl.constexpr,
        WEIGHT: gl.constexpr,
    ):
        """Bulk loads of the program's global k step `step` (its tile i = step // k_tiles): the
        hidden rows' k slice (HIDDEN; from L2 after the first tile) and the tile's weight rows
        (WEIGHT). The stage's barrier expects both, set with the weight, so the first fill asks
        for the weight before the PDL wait and for the hidden after it."""
        i = step // k_tiles
        ki = step - i * k_tiles
        tile = pid + i * n_progs
        s = step % STAGES
        bar = ready.index(s)
        if WEIGHT:
            mbarrier.expect(bar, h_desc.block_type.nbytes + w_desc.block_type.nbytes)
        if HIDDEN:
            tma.async_copy_global_to_shared(h_desc, [0, ki * BLOCK_K], bar, a_smem.index(s))
        if WEIGHT:
            tma.async_copy_global_to_shared(
                w_desc, [tile * BLOCK_V, ki * BLOCK_K], bar, b_smem.index(s)
            )

    @gluon.jit
    def _refill(
        h_desc,
        w_desc,
        a_smem,
        b_smem,
        ready,
        issued,
        total,
        g,
        pid,
        n_progs,
        k_tiles,
        BLOCK_V: gl.constexpr,
        BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        """The next load into a free stage, if any is left and the ring has room past step g;
        returns the next load's index."""
        if issued < total:
            if issued < g + STAGES:
                _issue_load(
                    h_desc, w_desc, a_smem, b_smem, ready, issued, pid, n_progs, k_tiles,
                    BLOCK_V, BLOCK_K, STAGES, True, True,
                )  # fmt: skip
                issued += 1
        return issued

    @gluon.jit
    def _lm_head_sample_kernel(
        h_desc,  # hidden (B, H), block [BLOCK_B, BLOCK_K]; rows >= B read as zeros
        w_desc,  # weight (V, H), block [BLOCK_V, BLOCK_K]
        seeds_ptr,  # (B,) int64
        step_ptr,  # (B,) or () int64
        best_ptr,  # (P, B) fp32: the program's best score (base 2; the raw logit when greedy)
        col_ptr,  # (P, B) int32: its column
        zbest_ptr,  # (P, B) fp32: z2 = logit * scale at that column
        max_ptr,  # (P, B) fp32: max of z2
        sum_ptr,  # (P, B) fp32: sum of exp2(z2 - max)
        B,
        V,
        H,
        seed_stride,
        step_stride,  # 0 for a scalar step
        scale,  # log2(e) / T (log2(e) when greedy)
        BLOCK_B: gl.constexpr,
        BLOCK_V: gl.constexpr,
        BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        GREEDY: gl.constexpr,
        EVEN_V: gl.constexpr,
        PDL: gl.constexpr,
    ):
        pid = gl.program_id(0)
        n_progs = gl.num_programs(0)
        SUB_V: gl.constexpr = BLOCK_V // 2  # two accumulators per tile (see the module docstring)
        # one accumulator per SUB_V columns: each warpgroup holds all rows and 1 / WARPGROUPS of
        # the columns (a wgmma's M is 64 per warpgroup), a quad of lanes per row
        WARPGROUPS: gl.constexpr = NUM_WARPS // 4
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0],
            warps_per_cta=[4, WARPGROUPS],
            instr_shape=[16, SUB_V // WARPGROUPS, 16],
        )
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)

        a_smem = gl.allocate_shared_memory(h_desc.dtype, [STAGES, BLOCK_B, BLOCK_K], h_desc.layout)
        b_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_V, BLOCK_K], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
        fence_async_shared()
        gluon_start(PDL)

        n_tiles = gl.cdiv(V, BLOCK_V)
        k_tiles = gl.cdiv(H, BLOCK_K)
        my_tiles = gl.cdiv(n_tiles - pid, n_progs)
        total = my_tiles * k_tiles

        ring = (h_desc, w_desc, a_smem, b_smem, ready)
        tiling = (pid, n_progs, k_tiles, BLOCK_V, BLOCK_K, STAGES)
        # every stage's weight first (no kernel writes it), then the wait for the final norm, then
        # the stages' hidden slices
        for j in gl.static_range(STAGES):
            if j < total:
                _issue_load(*ring, j, *tiling, False, True)
        issued = gl.minimum(total, STAGES)  # run-time i32, loop-carried
        gluon_wait(PDL)
        for j in gl.static_range(STAGES):
            if j < total:
                _issue_load(*ring, j, *tiling, True, False)

        # the row keys (sample_tokens._row_keys), while the first loads fly
        rows = gl.arange(0, BLOCK_B, layout=row_layout)
        row_ok = rows < B
        if GREEDY:
            lo2 = 0  # unused
            hi2 = 0
        else:
            seed = gl.load(seeds_ptr + rows * seed_stride, mask=row_ok, other=0).to(
                gl.uint64, bitcast=True
            )
            stp = gl.load(step_ptr + rows * step_stride, mask=row_ok, other=0).to(
                gl.uint64, bitcast=True
            )
            state = mix64(mix64(seed + GOLDEN) + stp * GOLDEN)
            lo = (state & 0xFFFFFFFF).to(gl.uint32)  # [BLOCK_B]
            hi = (state >> 32).to(gl.uint32)
            lo2 = gl.expand_dims(lo, 1)  # [BLOCK_B, 1]
            hi2 = gl.expand_dims(hi, 1)

        best = gl.full([BLOCK_B], float("-inf"), gl.float32, layout=row_layout)
        best_col = gl.zeros([BLOCK_B], gl.int32, layout=row_layout)
        run_max = gl.full([BLOCK_B], float("-inf"), gl.float32, layout=row_layout)
        run_sum = gl.zeros([BLOCK_B], gl.float32, layout=row_layout)
        offs = gl.arange(0, SUB_V, layout=col_layout)

        g = n_tiles * 0  # the global k step consumed next
        for i in range(0, my_tiles):
            tile = pid + i * n_progs
            acc0 = gl.zeros([BLOCK_B, SUB_V], gl.float32, layout=mma_layout)
            acc1 = gl.zeros([BLOCK_B, SUB_V], gl.float32, layout=mma_layout)
            for ki in range(0, k_tiles):
                stage = g % STAGES
                mbarrier.wait(ready.index(stage), (g // STAGES) & 1)
                a_tile = a_smem.index(stage)
                w_tile = b_smem.index(stage)
                acc0 = warpgroup_mma(
                    a_tile,
                    w_tile.slice(0, SUB_V, dim=0).permute((1, 0)),
                    acc0,
                    use_acc=ki > 0,
                    is_async=True,
                )
                acc1 = warpgroup_mma(
                    a_tile,
                    w_tile.slice(SUB_V, SUB_V, dim=0).permute((1, 0)),
                    acc1,
                    use_acc=ki > 0,
                    is_async=True,
                )
                # this step's two wgmmas may fly; step g - 1's are done
                acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
                # step g - 1's stage is free: refill it (in this tile's last steps: the next tile's)
                issued = _refill(*ring, issued, total, g, *tiling)
                g += 1
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
            # every stage is free now: the ring is full during the epilogue
            issued = _refill(*ring, issued, total, g, *tiling)

            # the epilogue, one accumulator after the other (lower columns first: ties keep them)
            best, best_col, run_max, run_sum = _fold(
                acc0,
                tile * BLOCK_V + offs,
                V,
                scale,
                lo2,
                hi2,
                best,
                best_col,
                run_max,
                run_sum,
                GREEDY,
                EVEN_V,
            )
            best, best_col, run_max, run_sum = _fold(
                acc1,
                tile * BLOCK_V + SUB_V + offs,
                V,
                scale,
                lo2,
                hi2,
                best,
                best_col,
                run_max,
                run_sum,
                GREEDY,
                EVEN_V,
            )

        for st in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(st))
        if GREEDY:
            best_z = best * scale  # z2 at the best column: the same fp32 product as in the tile
        else:
            # z2 = score - noise at the best column: within half an ulp of the score (~1e-6 at
            # |score| ~ 20) of the tile's fl(acc * scale); the log-prob's tolerance is 1e-4
            best_z = best - noise_log2(best_col.to(gl.uint32), lo, hi)
        out = pid * B + rows
        gl.store(best_ptr + out, best, mask=row_ok)
        gl.store(col_ptr + out, best_col, mask=row_ok)
        gl.store(zbest_ptr + out, best_z, mask=row_ok)
        gl.store(max_ptr + out, run_max, mask=row_ok)
        gl.store(sum_ptr + out, run_sum, mask=row_ok)

    @triton.jit
    def _combine_kernel(
        best_ptr,
        col_ptr,
        zbest_ptr,
        max_ptr,
        sum_ptr,  # each (P, B)
        tokens_ptr,  # (B,) int64
        logp_ptr,  # (B,) fp32
        B,
        P,
        P_PAD: tl.constexpr,
        PDL: tl.constexpr = False,  # programmatic dependent launch (kernels.pdl)
    ):
        pdl.start(PDL)
        pdl.wait(PDL)  # the sampler kernel's partials
        row = tl.program_id(0)
        progs = tl.arange(0, P_PAD)
        ok = progs < P
        at = progs * B + row
        best = tl.load(best_ptr + at, mask=ok, other=float("-inf"))
        col = tl.load(col_ptr + at, mask=ok, other=2147483647)
        top = tl.max(best, 0)
        # ties: the lowest COLUMN among the programs with the best score (not the lowest program)
        token = tl.min(tl.where(ok & (best == top), col, 2147483647), 0)
        token = tl.where(token == 2147483647, 0, token)  # every score NaN: column 0 (not reached)
        pick = ok & (col == token)
        z_best = tl.max(
            tl.where(pick, tl.load(zbest_ptr + at, mask=ok, other=float("-inf")), float("-inf")), 0
        )
        prog_max = tl.load(max_ptr + at, mask=ok, other=float("-inf"))
        prog_sum = tl.load(sum_ptr + at, mask=ok, other=0.0)
        top_max = tl.max(prog_max, 0)
        base = tl.where(top_max == float("-inf"), 0.0, top_max)
        total = tl.sum(prog_sum * tl.exp2(prog_max - base), 0)
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logp_ptr + row, (z_best - base - tl.log2(total)) * _G_LN2)


def takes(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel serves these operands as they are: a decode batch of at most MAX_ROWS
    bf16 rows on a Hopper GPU (sm_90), both readable by bulk tensor copies without a copy."""
    return (
        ENABLED
        and not _failed
        and gluon is not None
        and hidden.is_cuda
        and hidden.dim() == 2
        and 0 < hidden.shape[0] <= MAX_ROWS
        and hidden.dtype == weight.dtype == torch.bfloat16
        and is_hopper(hidden.device.index)
        and all(tma_readable(t) for t in (hidden, weight))
        and _stages(hidden.shape[1]) >= 2
    )


def _stages(H: int) -> int:
    """The most ring stages (hidden k slice + weight tile) that fit shared memory, at most 12."""
    per_stage = (BLOCK_B + BLOCK_V) * BLOCK_K * 2
    return min(12, SMEM_BYTES // per_stage)


def lm_head_sample(hidden, weight, temperature: float, seeds, step):
    """(tokens (B,) int64, logp (B,) fp32) as `lm_head_sample_ref`, for operands that `takes`;
    None, with a warning the first time, if the kernel does not compile with this triton (the
    caller then computes the logits and samples them). No host sync: capturable in a CUDA graph,
    replayed with `step` changed in place."""
    global _failed
    B, H = hidden.shape
    V = weight.shape[0]
    check_sampling_args(B, V, hidden.device, temperature, seeds, step)
    greedy = temperature == 0
    programs = min(multiprocessors(hidden.device), triton.cdiv(V, BLOCK_V))
    partials = torch.empty(4, programs, B, dtype=torch.float32, device=hidden.device)
    cols = torch.empty(programs, B, dtype=torch.int32, device=hidden.device)
    tokens = torch.empty(B, dtype=torch.int64, device=hidden.device)
    logp = torch.empty(B, dtype=torch.float32, device=hidden.device)
    # PDL only inside a captured step (see the module docstring: an eager step's chain ends here)
    early = WEIGHT_BEFORE_WAIT and hidden.is_cuda and torch.cuda.is_current_stream_capturing()
    options = pdl.launch_options() if early else {"PDL": False}
    try:
        _lm_head_sample_kernel[(programs,)](
            TensorDescriptor.from_tensor(
                hidden, [BLOCK_B, BLOCK_K], bf16_shared_layout([BLOCK_B, BLOCK_K])
            ),
            TensorDescriptor.from_tensor(
                weight, [BLOCK_V, BLOCK_K], bf16_shared_layout([BLOCK_V, BLOCK_K])
            ),
            seeds,
            step,
            partials[0],
            cols,
            partials[1],
            partials[2],
            partials[3],
            B,
            V,
            H,
            seeds.stride(0),
            step.stride(0) if step.dim() else 0,
            LOG2E if greedy else LOG2E / temperature,
            BLOCK_B=BLOCK_B,
            BLOCK_V=BLOCK_V,
            BLOCK_K=BLOCK_K,
            STAGES=_stages(H),
            NUM_WARPS=NUM_WARPS,
            GREEDY=greedy,
            EVEN_V=V % BLOCK_V == 0,
            num_warps=NUM_WARPS,
            **options,
        )
    except Exception as error:  # a Gluon API this kernel does not match (it was written for 3.6)
        _failed = True
        warn_not_compiled(
            "the Gluon LM-head sampler", error, "cuBLAS logits and the sampler (~13 us per step)"
        )
        return None
    _combine_kernel[(B,)](
        partials[0],
        cols,
        partials[1],
        partials[2],
        partials[3],
        tokens,
        logp,
        B,
        programs,
        P_PAD=triton.next_power_of_2(programs),
        **(pdl.launch_options() if COMBINE_PDL else {}),  # the sampler kernel stays plain
    )
    return tokens, logp

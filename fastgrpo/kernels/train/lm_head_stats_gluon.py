"""The LM-head statistics kernel of the training pass, in Gluon for Hopper GPUs: the same results
as `lm_head_stats._lm_head_stats_kernel` bit for bit, with the copies issued in a better order.

What: for hidden (N, H) and weight (V, H) in bf16, per (vocabulary split, row) the base-2 running
max, sum of exponentials and entropy sum of the logits, and every element's probability relative
to its row's reference, 2^(z2 - reference), stored in bf16 for the gradient GEMMs (see
`lm_head_stats.ChunkStats`). Same tiles (128 rows x 256 vocabulary columns, 64-wide k steps, 8
warps, 3 stages), same split of the vocabulary, same epilogue operations in the same order, so the
statistics and the stored values equal the Triton kernel's exactly (checked on the H100:
tests/kernels/test_lm_head_stats_gluon.py).

Why: the H100 profile of the Triton kernel (benchmarks/results/profile_lm_head_stats_h100_v7.txt)
showed each tile's 64 KB bulk store (TMA) of the probabilities ahead of the next tile's operand
loads in the multiprocessor's copy engine: the k loop's wait for its operands went from 5.7% of the
stall samples when scoring to 21% with the store. Triton's language issues a tile's first loads
after the previous tile's store and cannot be told otherwise. Here one ring of shared-memory stages
runs over all k steps of all of a program's tiles as one sequence, so the next tile's first loads
are issued during this tile's last k steps, before its store. On the H100 (2048-row chunk, H=896,
V=151936): 0.977 ms against 1.082 for the Triton kernel with the store; scoring alone gains
nothing (0.87-0.91 ms either way), so scoring keeps the Triton kernel.

Synchronisation: one mbarrier per stage, armed with both boxes' bytes; the consumer of global k
step g waits on stage g % STAGES with phase (g // STAGES) & 1. At most one wgmma is in flight
(warpgroup_mma_wait(1)), so once step g's wait returns, step g - 1's stage may be refilled. The
store buffer is rewritten only after tma.store_wait(0).

Reference: `lm_head_stats.lm_head_stats_ref` (plain PyTorch), through the same combine as the
Triton kernel; the Triton kernel itself is the CPU (interpreter) and non-Hopper path.
"""

from __future__ import annotations

import torch

from fastgrpo import switches
from fastgrpo.kernels.support import bf16_shared_layout, gluon, is_hopper, triton, warn_not_compiled

if gluon is not None:  # support found triton's Gluon layer; this kernel was written against 3.6
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# FASTGRPO_GLUON=0 keeps the training pass on the Triton kernel
ENABLED = switches.GLUON
CONFIG = (128, 256, 64, 8, 3)
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the Triton kernel's configuration on the
H100 (`lm_head_stats._blocks`), which this kernel must share to agree with it bit for bit."""
_failed = False  # set when the kernel did not compile here: the Triton kernel serves from then on

if gluon is not None:

    @gluon.jit
    def _load_ahead(
        h_desc,
        w_desc,
        a_smem,
        b_smem,
        ready,
        step,
        limit,
        row0,
        split,
        n_splits,
        k_tiles,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        """The bulk loads of global k step `step` (tile index step // k_tiles) into its stage
        when step < limit; returns the next step to load."""
        if step < limit:
            i = step // k_tiles
            ki = step - i * k_tiles
            tile = split + i * n_splits
            s = step % STAGES
            bar = ready.index(s)
            mbarrier.expect(bar, h_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(h_desc, [row0, ki * BLOCK_K], bar, a_smem.index(s))
            tma.async_copy_global_to_shared(
                w_desc, [tile * BLOCK_N, ki * BLOCK_K], bar, b_smem.index(s)
            )
            step += 1
        return step

    @gluon.jit
    def _lm_head_stats_gluon_kernel(
        h_desc,  # hidden (N, H), block [BLOCK_M, BLOCK_K]
        w_desc,  # weight (V, H), block [BLOCK_N, BLOCK_K]
        m_ptr,
        s_ptr,
        pz_ptr,  # each (S, N) fp32
        z_desc,  # (N, V) bf16 relative probabilities, block [BLOCK_M, BLOCK_N]
        ref_ptr,  # (N,) fp32 base-2 reference per row
        N,
        V,
        H,
        scale2,  # log2(e) / temperature
        n_splits,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr,
        NUM_WARPS: gl.constexpr,
        EVEN_V: gl.constexpr,
        WITH_ENTROPY: gl.constexpr,
    ):
        pid_m = gl.program_id(0)
        split = gl.program_id(1)
        row0 = pid_m * BLOCK_M
        # warps stacked along the rows: each warpgroup holds 64 rows x all 256 columns (one
        # m64n256k16 wgmma per k16), as the Triton kernel's accumulator; row sums stay in a quad
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_N, 16]
        )
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)

        a_smem = gl.allocate_shared_memory(h_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], h_desc.layout)
        b_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
        z_smem = gl.allocate_shared_memory(z_desc.dtype, [BLOCK_M, BLOCK_N], z_desc.layout)
        fence_async_shared()

        rows = row0.to(gl.int64) + gl.arange(0, BLOCK_M, layout=row_layout)
        row_ok = rows < N
        reference = gl.load(ref_ptr + rows, mask=row_ok, other=0.0)

        n_tiles = gl.cdiv(V, BLOCK_N)
        k_tiles = gl.cdiv(H, BLOCK_K)
        # this program's tiles: split, split + n_splits, ... below n_tiles (the Triton kernel
        # also computes one tile past V at most and skips it; the statistics are the same)
        my_tiles = gl.cdiv(n_tiles - split, n_splits)
        total = my_tiles * k_tiles

        running_max = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
        running_sum = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
        running_pz = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)

        # the loads of k step `issued` are issued next (a run-time i32, loop-carried); one
        # argument list for the three places that issue them
        issued = n_tiles * 0
        ring = (h_desc, w_desc, a_smem, b_smem, ready)
        tiling = (row0, split, n_splits, k_tiles, BLOCK_N, BLOCK_K, STAGES)
        for _ in gl.static_range(STAGES):  # fill every stage
            issued = _load_ahead(*ring, issued, total, *tiling)

        g = n_tiles * 0  # the global k step consumed next
        for i in range(0, my_tiles):
            tile = split + i * n_splits
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout)
            for ki in range(0, k_tiles):
                stage = g % STAGES
                mbarrier.wait(ready.index(stage), (g // STAGES) & 1)
                acc = warpgroup_mma(
                    a_smem.index(stage),
                    b_smem.index(stage).permute((1, 0)),
                    acc,
                    use_acc=ki > 0,
                    is_async=True,
                )
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                # step g - 1's wgmma is done, its stage is free: refill it (during this tile's
                # last k steps, that is the next tile's first ones)
                issued = _load_ahead(*ring, issued, gl.minimum(total, g + STAGES), *tiling)
                g += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            # every stage is free: one more load of the next tile, queued ahead of this store
            issued = _load_ahead(*ring, issued, gl.minimum(total, g + STAGES), *tiling)

            # the epilogue: `lm_head_stats._fold_tile`'s operations, in its order
            if not EVEN_V:
                if (tile + 1) * BLOCK_N > V:  # only the last tile reaches past V
                    cols = tile.to(gl.int64) * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
                    acc = gl.where(gl.expand_dims(cols < V, 0), acc, -1.0e30 / scale2)
            new_max = gl.maximum(running_max, gl.max(acc, 1) * scale2)
            p = gl.exp2(acc * scale2 - gl.expand_dims(new_max, 1))
            factor = gl.exp2(new_max - reference)
            e = (p * gl.expand_dims(factor, 1)).to(z_desc.dtype)
            tma.store_wait(0)  # the previous tile's store has left the buffer
            z_smem.store(e)
            fence_async_shared()
            tma.async_copy_shared_to_global(z_desc, [row0, tile * BLOCK_N], z_smem)
            alpha = gl.exp2(running_max - new_max)
            running_sum = running_sum * alpha + gl.sum(p, 1)
            if WITH_ENTROPY:
                running_pz = running_pz * alpha + gl.sum(p * acc, 1)
            running_max = new_max

        tma.store_wait(0)
        for st in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(st))
        out = split.to(gl.int64) * N + rows
        gl.store(m_ptr + out, running_max, mask=row_ok)
        gl.store(s_ptr + out, running_sum, mask=row_ok)
        gl.store(pz_ptr + out, running_pz * scale2, mask=row_ok)


def applies(hidden: torch.Tensor, probs_out: torch.Tensor, config: tuple, flags) -> bool:
    """Whether the Gluon kernel serves a training pass's statistics (the store into `probs_out`):
    bf16 on a Hopper GPU (sm_90), the configuration it was written for, every row block (no
    `flags`)."""
    return (
        ENABLED
        and not _failed
        and gluon is not None
        and flags is None
        and hidden.is_cuda
        and hidden.dtype == torch.bfloat16
        and probs_out.dtype == torch.bfloat16
        and tuple(config) == CONFIG
        and is_hopper(hidden.device.index)
    )


def launch(hidden, weight, scale2, stats, probs_out, reference, entropy) -> bool:
    """The statistics of TMA-ready bf16 `hidden` (N, H) and `weight` (V, H) into `stats` (3, S, N)
    and 2^(z2 - reference) into `probs_out` (N, V), as `lm_head_stats._launch_stats` (which checks
    the arguments). False, with a warning the first time, when the kernel does not compile with
    this triton: the caller then launches the Triton kernel."""
    global _failed
    N, H = hidden.shape
    V = weight.shape[0]
    block_m, block_n, block_k, warps, stages = CONFIG
    try:
        _lm_head_stats_gluon_kernel[(triton.cdiv(N, block_m), stats.shape[1])](
            TensorDescriptor.from_tensor(
                hidden, [block_m, block_k], bf16_shared_layout([block_m, block_k])
            ),
            TensorDescriptor.from_tensor(
                weight, [block_n, block_k], bf16_shared_layout([block_n, block_k])
            ),
            stats[0],
            stats[1],
            stats[2],
            TensorDescriptor.from_tensor(
                probs_out, [block_m, block_n], bf16_shared_layout([block_m, block_n])
            ),
            reference,
            N,
            V,
            H,
            scale2,
            stats.shape[1],
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            STAGES=stages,
            NUM_WARPS=warps,
            EVEN_V=V % block_n == 0,
            WITH_ENTROPY=entropy,
            num_warps=warps,
        )
    except Exception as error:  # a Gluon API this kernel does not match (it was written for 3.6)
        _failed = True
        warn_not_compiled(
            "the Gluon LM-head statistics kernel",
            error,
            "the Triton kernel (the same results; ~10% slower with the store)",
        )
        return False
    return True

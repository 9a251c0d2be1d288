"""The decode step's gate/up + SiLU * up in Gluon for Hopper GPUs: the Triton kernel's product with
its activation read once per program and its weight streamed ahead.

What: `launch(x, weight, out)` computes silu(x @ gate.T) * (x @ up.T) into `out` (M, I) for a
decode batch x (M <= 64, K <= 1024) and a packed gate/up weight (2I, K), gate rows first, as
`decode_linear.linear_triton(x, weight, None, swiglu=True)` does; `applies(x, weight, bias)` says
where it serves (bf16 on a Hopper GPU, no bias, those sizes).

How: one program per multiprocessor (fewer when there are fewer tiles), each taking tiles of 16
output columns p, p + P, ...; per tile and 256-wide k step a gate box and an up box of [16, 256]
(8 KB each) come through one ring of 4 shared-memory stages that runs across the program's tiles.
The activation (64 rows x K, zero-filled past M and K) is loaded into shared memory once. The
ring's first loads are issued before the programmatic-dependent-launch wait, as the weight is no
earlier kernel's output. Per k step two m64n16k16 wgmma chains (gate, up) read x and the stage;
each box of x has its own barrier, so the first step waits only for its box, and a step's
products are still running when the next step's are issued: a stage is refilled once the
products that read it are done (`DEPTH`), not right after its own step.

Why: the Triton kernel re-reads the whole activation for every 32 output columns, and Triton's
pipeline starts its weight loads only after the wait. A kernel that only streams this weight
(17.4 MB) with 8 KB boxes takes 7.5 us in a graph of 24, and 1-4 KB boxes are up to 5x slower
(benchmarks/results/spike_stream_gluon_h100_v1.txt). On the H100 at 64 rows of the 0.5B shape:
9.4-9.5 us alone against 10.9 for the Triton kernel, 10.7-10.8 after the norm against 11.2-11.5,
and -12 to -21 us per decode step in four runs of 12-14 paired rounds
(benchmarks/results/gate_up_gluon_h100_v1.txt, whole-rollout harness). A barrier per box of x
and one step's products kept running (DEPTH = 1): -17 and -9 us per step, replayed, bitwise the
same outputs (benchmarks/results/decode_step_ab_h100_v1.txt, section 10).

Numerics: fp32 accumulation over k in the Triton kernel's order, gate and up rounded to bf16,
silu(gate) = gate / (1 + exp(-gate)) rounded to bf16, the product rounded once. The exp and the
division are the GPU's approximate ones (a few fp32 ulps), not libdevice's exp and the IEEE
division of the Triton kernel and torch. With those (`EXACT_EPILOGUE`, which
the GPU tests set) the kernel is the Triton kernel's bit for bit but no faster in
the decode step: its epilogue runs on one warpgroup per multiprocessor, with nothing to hide it.
The approximate epilogue gave the same bf16 outputs on 683,264 of 683,264 elements tested and
-12 to -21 us per step; the GPU tests bound the rare 1-ulp bf16 difference.

Reference: `decode_linear.linear_ref`; the Triton kernel is the path everywhere else.
"""

from __future__ import annotations

import torch

from fastgrpo import switches
from fastgrpo.kernels.decode import pdl
from fastgrpo.kernels.decode.pdl import gluon_start, gluon_wait
from fastgrpo.kernels.support import (
    bf16_shared_layout,
    gluon,
    is_hopper,
    multiprocessors,
    tma_readable,
    triton,
    warn_not_compiled,
)

if gluon is not None:  # support found triton's Gluon layer; this kernel targets 3.6
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.extra import libdevice
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# FASTGRPO_GLUON=0 keeps gate/up on the Triton kernel
ENABLED = switches.GLUON
BLOCK_M, BLOCK_N, BLOCK_K, STAGES = 64, 16, 256, 4
"""Rows (all of a decode batch), output columns per tile, k step, ring stages: x takes up to
4 x 32 KB of shared memory and the ring 4 x 16 KB."""
MAX_K = 1024
EXACT_EPILOGUE = False
"""silu with libdevice's exp and an IEEE division (the Triton kernel's numerics, bit for bit);
off by default: the approximate ones are faster in the step (see Numerics above)."""
DEPTH = 1
"""k steps whose products may still be running when the next step's are issued (0: each step
waits for its own, as the kernel did before: 9 us per decode step slower at 0.5B)."""
_failed = False  # set when the kernel did not compile here: the Triton kernel serves from then on

if gluon is not None:

    @gluon.jit
    def _load_weight(
        w_desc,
        gate_smem,
        up_smem,
        ready,
        i,  # the ring's load index: tile i // K_STEPS of this program, k step i % K_STEPS
        total,
        pid,
        n_programs,
        n_out,
        K_STEPS: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        """The gate and up boxes of load `i` into its stage when i < total; returns i + 1."""
        if i < total:
            t = i // K_STEPS
            k = i - t * K_STEPS
            col0 = (pid + t * n_programs) * BLOCK_N
            stage = i % STAGES
            bar = ready.index(stage)
            mbarrier.expect(bar, 2 * w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                w_desc, [col0, k * BLOCK_K], bar, gate_smem.index(stage)
            )
            tma.async_copy_global_to_shared(
                w_desc, [n_out + col0, k * BLOCK_K], bar, up_smem.index(stage)
            )
        return i + 1

    @gluon.jit
    def _gate_up_kernel(
        x_desc,  # (M, K), block [BLOCK_M, BLOCK_K]
        w_desc,  # (2I, K): gate rows, then up rows; block [BLOCK_N, BLOCK_K]
        out_ptr,  # (M, I) contiguous
        M,
        n_out,  # I: output columns (the gate rows' count)
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        K_STEPS: gl.constexpr,
        STAGES: gl.constexpr,
        DEPTH: gl.constexpr,
        EXACT: gl.constexpr,
        PDL: gl.constexpr,
    ):
        pid = gl.program_id(0)
        n_programs = gl.num_programs(0)
        my_tiles = gl.cdiv(gl.cdiv(n_out, BLOCK_N) - pid, n_programs)
        total = my_tiles * K_STEPS
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [K_STEPS, BLOCK_M, BLOCK_K], x_desc.layout)
        gate_smem = gl.allocate_shared_memory(
            w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout
        )
        up_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        x_ready = gl.allocate_shared_memory(gl.int64, [K_STEPS, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=1)
        for k in gl.static_range(K_STEPS):
            mbarrier.init(x_ready.index(k), count=1)
        fence_async_shared()
        gluon_start(PDL)

        # the weight first (no earlier kernel writes it), then the wait, then x
        ring = (w_desc, gate_smem, up_smem, ready)
        tiling = (pid, n_programs, n_out, K_STEPS, BLOCK_N, BLOCK_K, STAGES)
        issued = total * 0
        for _ in gl.static_range(STAGES):
            issued = _load_weight(*ring, issued, total, *tiling)
        gluon_wait(PDL)
        for k in gl.static_range(K_STEPS):  # a barrier per box: step k needs only box k
            mbarrier.expect(x_ready.index(k), x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                x_desc, [0, k * BLOCK_K], x_ready.index(k), x_smem.index(k)
            )

        rows = gl.arange(0, BLOCK_M, layout=row_layout)
        g = total * 0  # the ring's next load to consume
        for t in range(0, my_tiles):
            acc_gate = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout)
            acc_up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout)
            for k in gl.static_range(K_STEPS):
                stage = g % STAGES
                mbarrier.wait(x_ready.index(k), 0)  # returns at once after the first tile
                mbarrier.wait(ready.index(stage), (g // STAGES) & 1)
                acc_gate = warpgroup_mma(
                    x_smem.index(k), gate_smem.index(stage).permute((1, 0)), acc_gate, is_async=True
                )
                acc_up = warpgroup_mma(
                    x_smem.index(k), up_smem.index(stage).permute((1, 0)), acc_up, is_async=True
                )
                if k >= DEPTH:  # step k - DEPTH's products are done: refill their stage
                    acc_gate, acc_up = warpgroup_mma_wait(
                        num_outstanding=2 * DEPTH, deps=(acc_gate, acc_up)
                    )
                    issued = _load_weight(*ring, issued, total, *tiling)
                g += 1
            acc_gate, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc_gate, acc_up))
            for _ in gl.static_range(DEPTH):  # the stages of the tile's last DEPTH steps
                issued = _load_weight(*ring, issued, total, *tiling)
            # the Triton kernel's epilogue, operation for operation
            gate = acc_gate.to(gl.bfloat16).to(gl.float32)
            up = acc_up.to(gl.bfloat16).to(gl.float32)
            if EXACT:
                silu = gl.div_rn(gate, 1.0 + libdevice.exp(-gate))
            else:
                silu = gate / (1.0 + gl.exp(-gate))
            silu = silu.to(gl.bfloat16).to(gl.float32)
            cols = (pid + t * n_programs) * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
            ptrs = out_ptr + gl.expand_dims(rows.to(gl.int64) * n_out, 1) + gl.expand_dims(cols, 0)
            ok = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < n_out, 0)
            gl.store(ptrs, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)
        for st in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(st))
        for k in gl.static_range(K_STEPS):
            mbarrier.invalidate(x_ready.index(k))


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the Gluon kernel serves this gate/up product: bf16 x (M <= 64, K <= 1024) and
    packed weight (2I, K) on a Hopper GPU (sm_90), both readable in place by bulk tensor copies,
    no bias."""
    return (
        ENABLED
        and not _failed
        and gluon is not None
        and bias is None
        and x.is_cuda
        and x.dim() == 2
        and weight.dim() == 2
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and 0 < x.shape[0] <= BLOCK_M
        and 0 < x.shape[1] <= MAX_K
        and weight.shape[1] == x.shape[1]
        and weight.shape[0] % 2 == 0
        and weight.shape[0] > 0
        and tma_readable(x)
        and tma_readable(weight)
        and is_hopper(x.device.index)
    )


def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> bool:
    """silu(x @ gate.T) * (x @ up.T) into `out` (M, I) where `applies`. False, with a warning the
    first time, when the kernel does not compile with this triton: the caller then launches the
    Triton kernel."""
    global _failed
    M, K = x.shape
    n_out = weight.shape[0] // 2
    k_steps = triton.cdiv(K, BLOCK_K)
    programs = min(multiprocessors(), triton.cdiv(n_out, BLOCK_N))
    options = pdl.launch_options()
    try:
        _gate_up_kernel[(programs,)](
            TensorDescriptor.from_tensor(
                x, [BLOCK_M, BLOCK_K], bf16_shared_layout([BLOCK_M, BLOCK_K])
            ),
            TensorDescriptor.from_tensor(
                weight, [BLOCK_N, BLOCK_K], bf16_shared_layout([BLOCK_N, BLOCK_K])
            ),
            out,
            M,
            n_out,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            K_STEPS=k_steps,
            STAGES=STAGES,
            DEPTH=min(DEPTH, k_steps),  # a tile's steps: the most to keep running
            EXACT=EXACT_EPILOGUE,
            num_warps=4,
            enable_fp_fusion=False,
            **options,
        )
    except Exception as error:  # a Gluon API this kernel does not match (it was written for 3.6)
        _failed = True
        warn_not_compiled(
            "the Gluon gate/up kernel",
            error,
            "the Triton kernel (the same results, ~20 us per decode step slower at 0.5B)",
        )
        return False
    return True

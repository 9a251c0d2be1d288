"""What a forward's first layer reads about each token, in one kernel: its embedding row and the
cos / sin rows of its position, cast to the activation dtype.

What: `embed_and_angles(ids, positions, embed_weight, cos_table, sin_table, dtype)` returns
(x (T, H), cos (T, D), sin (T, D)) equal to `embed_weight[ids]` and `cos_table[positions]`,
`sin_table[positions]` cast to `dtype` (the model's `embed_tokens` and `RotaryTable.lookup`).
With `position_offset` (a () tensor) the positions are `positions + position_offset`, added in
the kernel: a decode step's positions are each row's prompt length plus the step's slot.

Why: as torch ops these are five kernels (one gather for the embedding, a gather and a cast for
each table) at the start of every decode step; plain launches between the step's Triton kernels
also break their programmatic-dependent-launch chain. One program per token copies all three
rows: at 64 rows of the 0.5B model on an H100 a decode step took 1.051 ms against 1.061 with the
torch ops (three pairs in one run, benchmarks/results/rollout_ab_h100_v2.txt).

Reference: `embed_and_angles_ref`, the torch ops, also the CPU path. The results are copies and
the same rounding of fp32 to the activation dtype, so bitwise equal on a GPU.
"""

from __future__ import annotations

import torch

from fastgrpo import switches
from fastgrpo.kernels.decode import pdl
from fastgrpo.kernels.support import interpreting, triton

if triton is not None:
    import triton.language as tl

# FASTGRPO_FUSED_OPS=0 keeps the torch gathers on CUDA too
ENABLED = switches.FUSED_OPS


def embed_and_angles_ref(
    ids, positions, embed_weight, cos_table, sin_table, dtype, position_offset=None
):
    """(embed_weight[ids], cos_table[positions], sin_table[positions]), the tables cast to dtype;
    `position_offset` (()), when given, is added to every position first."""
    if position_offset is not None:
        positions = positions + position_offset
    x = torch.nn.functional.embedding(ids, embed_weight)
    return x, cos_table[positions].to(dtype), sin_table[positions].to(dtype)


if triton is not None:

    @triton.jit
    def _embed_and_angles_kernel(
        ids_ptr,  # (T,) int64
        pos_ptr,  # (T,) int64
        offset_ptr,  # () int64 added to every position, read when HAS_OFFSET
        w_ptr,  # (V, H) rows at stride_w
        cos_ptr,
        sin_ptr,  # (N, D) contiguous tables
        x_ptr,  # (T, H) contiguous
        cos_out_ptr,
        sin_out_ptr,  # (T, D) contiguous
        stride_w,
        H,
        D,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
        PDL: tl.constexpr = False,  # programmatic dependent launch (kernels.pdl)
    ):
        pdl.start(PDL)
        pdl.wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        row = tl.load(ids_ptr + t)
        pos = tl.load(pos_ptr + t)
        if HAS_OFFSET:
            pos += tl.load(offset_ptr)
        cols = tl.arange(0, BLOCK_H)
        for first in range(0, H, BLOCK_H):
            ok = first + cols < H
            x = tl.load(w_ptr + row * stride_w + first + cols, mask=ok)
            tl.store(x_ptr + t * H + first + cols, x, mask=ok)
        dims = tl.arange(0, BLOCK_D)
        ok_d = dims < D
        dtype = cos_out_ptr.dtype.element_ty
        c = tl.load(cos_ptr + pos * D + dims, mask=ok_d)
        s = tl.load(sin_ptr + pos * D + dims, mask=ok_d)
        tl.store(cos_out_ptr + t * D + dims, c.to(dtype), mask=ok_d)
        tl.store(sin_out_ptr + t * D + dims, s.to(dtype), mask=ok_d)


def embed_and_angles_triton(
    ids, positions, embed_weight, cos_table, sin_table, dtype, position_offset=None
):
    """As `embed_and_angles_ref`, by one Triton launch (one program per token). No host sync;
    ids and positions must be in range (the kernel does not check them, as a gather would)."""
    if triton is None:
        raise RuntimeError("the Triton token-input kernel needs `pip install triton`")
    T, H, D = ids.shape[0], embed_weight.shape[1], cos_table.shape[1]
    if positions.shape != ids.shape or ids.dim() != 1:
        raise ValueError(f"ids and positions (T,) expected, got {ids.shape}, {positions.shape}")
    if embed_weight.stride(1) != 1 or not (cos_table.is_contiguous() and sin_table.is_contiguous()):
        raise ValueError("the embedding needs unit stride on H and the tables must be contiguous")
    if sin_table.shape != cos_table.shape:
        raise ValueError(f"cos and sin tables differ: {cos_table.shape}, {sin_table.shape}")
    if position_offset is not None and position_offset.numel() != 1:
        raise ValueError(f"position_offset must hold one value, got {tuple(position_offset.shape)}")
    x = torch.empty(T, H, dtype=embed_weight.dtype, device=ids.device)
    out_dtype = torch.float32 if interpreting() and dtype == torch.bfloat16 else dtype
    cos = torch.empty(T, D, dtype=out_dtype, device=ids.device)
    sin = torch.empty_like(cos)
    if T:
        _embed_and_angles_kernel[(T,)](
            ids,
            positions,
            positions if position_offset is None else position_offset,
            embed_weight,
            cos_table,
            sin_table,
            x,
            cos,
            sin,
            embed_weight.stride(0),
            H,
            D,
            BLOCK_H=min(4096, triton.next_power_of_2(H)),
            BLOCK_D=triton.next_power_of_2(D),
            HAS_OFFSET=position_offset is not None,
            num_warps=4,
            **pdl.launch_options(),
        )
    if out_dtype != dtype:  # the interpreter's casts to bf16 truncate: round as torch does
        cos, sin = cos.to(dtype), sin.to(dtype)
    return x, cos, sin


def embed_and_angles(
    ids, positions, embed_weight, cos_table, sin_table, dtype, position_offset=None
):
    """The kernel on CUDA, else the reference."""
    args = (ids, positions, embed_weight, cos_table, sin_table, dtype, position_offset)
    if ENABLED and triton is not None and ids.is_cuda:
        return embed_and_angles_triton(*args)
    return embed_and_angles_ref(*args)

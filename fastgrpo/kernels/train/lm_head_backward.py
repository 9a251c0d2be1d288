"""The two backward GEMMs of the fused LM-head loss, skipping rows whose gradient is zero.

What: for one chunk of rows with `dz` (C, V) (bf16, rows 16-byte aligned: d(loss)/d(logits), or
the fused loss's relative probabilities, whose row scale it applies separately), hidden states
(C, H) and the LM-head weight (V, H):
- `add_dw_(dw, dz, hidden, n_rows)`: dW += dz[:n]^T @ hidden[:n], accumulated in fp32 inside the
  kernel, then added to `dw`: an fp32 dW by the program (read, add, write); a bf16 dW by a bulk
  tensor reduce that adds the tile, rounded to bf16, in L2 (the program never reads dW; two
  roundings per chunk instead of one, within the fused loss's error budget: benchmarks/HISTORY.md);
- `dh(dz, weight, n_rows)`: dH = dz @ W in fp32 (C, H), split over the vocabulary (split-K) into
  fixed partial sums that are added in a fixed order, so the result is deterministic.
`n_rows` is a device tensor: only the first n rows can carry a gradient (the caller orders rows so),
and the kernels read it on the device, so skipping them needs no host sync. Row blocks past n do no
GEMM work at all; rows past n inside the last block must contribute nothing: zeros in `dz` (or, for
dW, in `hidden`; for dH, a zero `row_scale`).

Why: a GRPO batch often has whole groups at zero advantage (and masked rows); cuBLAS would still
spend 4*N*H*V FLOPs on their zero gradients, because its shapes are fixed on the host.

Reference: `add_dw_ref` and `dh_ref` below (plain PyTorch on the first n rows).
"""

from __future__ import annotations

import torch

from fastgrpo.kernels.support import (
    TensorDescriptor,
    aligned_empty,
    interpreting,
    multiprocessors,
    tma_ready,
    triton,
)

if triton is not None:
    import triton.language as tl


def add_dw_ref(dw, dz, hidden, n_rows):
    n = int(n_rows)
    dw += (dz[:n].double().t() @ hidden[:n].double()).to(dw.dtype)
    return dw


def dh_ref(dz, weight, n_rows):
    n = int(n_rows)
    out = torch.zeros(dz.shape[0], weight.shape[1], dtype=torch.float32, device=dz.device)
    out[:n] = (dz[:n].double() @ weight.double()).float()
    return out


if triton is not None:

    @triton.jit
    def _dw_tile(
        z_desc,
        h_desc,
        dw_desc,
        tile,
        n_hb,
        k_tiles,
        BLOCK_V: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_R: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        REDUCE: tl.constexpr,
    ):
        """dW[tile] += dz[:n, tile's rows]^T @ hidden[:n, tile's columns] (k_tiles row blocks)."""
        pid_v = tile // n_hb  # tiles of one vocabulary block are neighbours: dz read once
        pid_h = tile - pid_v * n_hb
        acc = tl.zeros([BLOCK_V, BLOCK_H], tl.float32)
        for ki in range(0, k_tiles):
            a = z_desc.load([ki * BLOCK_R, pid_v * BLOCK_V])  # (BR, BV)
            b = h_desc.load([ki * BLOCK_R, pid_h * BLOCK_H])  # (BR, BH)
            acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT_PRECISION)
        if REDUCE:  # the add happens in L2 (bulk tensor reduce): no read of dW by the program
            dw_desc.atomic_add([pid_v * BLOCK_V, pid_h * BLOCK_H], acc.to(dw_desc.dtype))
        else:
            prev = dw_desc.load([pid_v * BLOCK_V, pid_h * BLOCK_H]).to(tl.float32)
            dw_desc.store([pid_v * BLOCK_V, pid_h * BLOCK_H], (prev + acc).to(dw_desc.dtype))

    @triton.jit
    def _dw_kernel(
        z_desc,  # (C, V) dz, blocks (BLOCK_R, BLOCK_V)
        h_desc,  # (C, H) hidden, blocks (BLOCK_R, BLOCK_H)
        dw_desc,  # (V, H) accumulated gradient, blocks (BLOCK_V, BLOCK_H)
        n_ptr,  # () int32: rows that can carry a gradient
        V,
        H,
        BLOCK_V: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_R: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        PERSISTENT: tl.constexpr,  # one program per SM over tiles pid, pid + grid, ...
        REDUCE: tl.constexpr,
    ):
        n_hb = tl.cdiv(H, BLOCK_H)
        n_rows = tl.load(n_ptr)
        k_tiles = tl.cdiv(n_rows, BLOCK_R)
        if PERSISTENT:
            n_tiles = tl.cdiv(V, BLOCK_V) * n_hb
            if n_rows > 0:  # one pipelined loop over (tile, row block): next tile's loads early
                for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=True):
                    _dw_tile(
                        z_desc,
                        h_desc,
                        dw_desc,
                        tile,
                        n_hb,
                        k_tiles,
                        BLOCK_V,
                        BLOCK_H,
                        BLOCK_R,
                        DOT_PRECISION,
                        REDUCE,
                    )
        elif n_rows > 0:
            _dw_tile(
                z_desc,
                h_desc,
                dw_desc,
                tl.program_id(0),
                n_hb,
                k_tiles,
                BLOCK_V,
                BLOCK_H,
                BLOCK_R,
                DOT_PRECISION,
                REDUCE,
            )

    @triton.jit
    def _dh_kernel(
        z_desc,  # (C, V) dz, blocks (BLOCK_R, BLOCK_V)
        w_desc,  # (V, H) weight, blocks (BLOCK_V, BLOCK_H)
        part_desc,  # (S * C_pad, H) fp32 partial sums, blocks (BLOCK_R, BLOCK_H)
        n_ptr,
        C_pad,  # C rounded up to BLOCK_R: each split's rows start on a block
        V,
        k_per_split,  # vocabulary columns per split, a multiple of BLOCK_V
        BLOCK_R: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_V: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_h = tl.program_id(1)
        split = tl.program_id(2)
        n_rows = tl.load(n_ptr)
        acc = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
        if pid_m * BLOCK_R < n_rows:
            k0 = split * k_per_split
            k1 = tl.minimum(k0 + k_per_split, V)
            for k in range(k0, k1, BLOCK_V):
                a = z_desc.load([pid_m * BLOCK_R, k])  # (BR, BV)
                b = w_desc.load([k, pid_h * BLOCK_H])  # (BV, BH)
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        part_desc.store([split * C_pad + pid_m * BLOCK_R, pid_h * BLOCK_H], acc)

    @triton.jit
    def _merge_splits_kernel(
        part_ptr,  # (S * C_pad, H) fp32 partial sums, row stride stride_part
        stride_part,
        scale_ptr,  # (C,) fp32 row scale, read when SCALED
        out_ptr,  # (C, H) any dtype, row stride stride_out
        stride_out,
        C,
        C_pad,
        H,
        S,
        SCALED: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """out[r] = scale[r] * sum over splits of part[:, r], the splits added in a fixed order."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = cols < H
        acc = tl.zeros([BLOCK_H], tl.float32)
        for i in range(0, S):
            acc += tl.load(part_ptr + (i * C_pad + row) * stride_part + cols, mask=ok, other=0.0)
        if SCALED:
            acc *= tl.load(scale_ptr + row)
        tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _dw_blocks(H: int, itemsize: int = 2, dw_itemsize: int = 4):
    """(BLOCK_V, BLOCK_H, BLOCK_R, num_warps, num_stages[, persistent[, reduce]]) for operands of
    `itemsize` bytes and a dW of `dw_itemsize`. Measured on the H100
    (benchmarks/lab/tune_lm_head_backward.py, 2048-row chunks; results v2 to v4):
    - bf16 dW (the fused loss's default): the add into dW by a bulk tensor reduce in L2, so the
      programs never read dW: 256x128 tiles with 4 stages at H=896 (0.904 ms, 0.928 with the
      program's read-add-write; cuBLAS 0.910); at H=3584 128x256 tiles, one program per SM
      looping over tiles in one pipelined loop (3.42 ms, against 3.83; cuBLAS 3.33);
    - fp32 dW: the read-add-write in the program (an fp32 tile to reduce would not fit shared
      memory beside the pipeline): 256x128 with 4 stages at H=896 (1.05 ms, cuBLAS 1.03),
      128x256 at H=3584 (4.09 ms, cuBLAS 3.73)."""
    if interpreting():
        return 32, 16, 16, 4, 1
    if itemsize == 4:  # fp32 operands: half the k step, to fit shared memory
        return 128, 128, 32, 8, 3
    if dw_itemsize == 2:
        return (256, 128, 64, 8, 4, False, True) if H <= 1024 else (128, 256, 64, 8, 3, True, True)
    return (256, 128, 64, 8, 4) if H <= 1024 else (128, 256, 64, 8, 3)


def _dh_blocks(H: int, itemsize: int = 2):
    """(BLOCK_R, BLOCK_H, BLOCK_V, num_warps, num_stages). Measured on the H100
    (benchmarks/lab/tune_lm_head_backward.py, 2048-row chunks; results v2 to v5): at H=896, 256x128
    tiles with 4 stages (0.835 ms with 7 splits, against 0.882 for 128x256 tiles, whose last column
    block is half empty; cuBLAS 0.862); at H=3584, 128x256 tiles (3.1-3.4 ms, cuBLAS 3.2-3.3)."""
    if interpreting():
        return 16, 16, 32, 4, 1
    if itemsize == 4:  # fp32 operands: smaller tiles, to fit shared memory
        return 128, 128, 32, 8, 3
    return (256, 128, 64, 8, 4) if H <= 1024 else (128, 256, 64, 8, 3)


def _dh_splits(H: int) -> int:
    """Vocabulary splits for dH, chosen with `_dh_blocks` so that the programs make whole waves
    on the H100's 132 SMs: at H=896, 8 row blocks x 7 column blocks x 7 splits = 392 programs
    (2.97 waves); at H=3584, 4 (of 2, 4, 7, 8, 12 and 33). The fp32 partial sums take splits x C x
    H x 4 bytes."""
    if interpreting():
        return 3
    return 7 if H <= 1024 else 4


def _precision(t):
    return "ieee" if t.dtype == torch.float32 else "tf32"


def add_dw_(dw, dz, hidden, n_rows):
    """dw (V, H) += dz[:n]^T @ hidden[:n] in place; dz (C, V), hidden (C, H); n_rows () int32."""
    C, V = dz.shape
    H = hidden.shape[1]
    config = _dw_blocks(H, dz.element_size(), dw.element_size())
    block_v, block_h, block_r, warps, stages, *extra = config
    persistent, reduce = (list(extra) + [False, False])[:2]
    hidden = tma_ready(hidden)
    tiles = triton.cdiv(V, block_v) * triton.cdiv(H, block_h)
    programs = multiprocessors(dz.device) if dz.is_cuda else 3
    grid = (min(tiles, programs) if persistent else tiles,)
    _dw_kernel[grid](
        TensorDescriptor.from_tensor(dz, [block_r, block_v]),
        TensorDescriptor.from_tensor(hidden, [block_r, block_h]),
        TensorDescriptor.from_tensor(dw, [block_v, block_h]),
        n_rows,
        V,
        H,
        BLOCK_V=block_v,
        BLOCK_H=block_h,
        BLOCK_R=block_r,
        DOT_PRECISION=_precision(dz),
        PERSISTENT=bool(persistent),
        REDUCE=bool(reduce) and not interpreting(),
        num_warps=warps,
        num_stages=stages,
    )
    return dw


def dh(dz, weight, n_rows, row_scale=None, out=None):
    """dz[:n] @ weight (C, H), zeros past n; dz (C, V), weight (V, H); n_rows () int32.

    Each row is multiplied by `row_scale` (C,) when given; the result is written into `out` (C, H,
    unit column stride, any dtype) when given, else returned in fp32."""
    C, V = dz.shape
    H = weight.shape[1]
    block_r, block_h, block_v, warps, stages = _dh_blocks(H, dz.element_size())
    splits = _dh_splits(H)
    k_per_split = triton.cdiv(triton.cdiv(V, splits), block_v) * block_v
    splits = triton.cdiv(V, k_per_split)
    c_pad = triton.cdiv(C, block_r) * block_r
    part = aligned_empty(splits * c_pad, H, dtype=torch.float32, device=dz.device)
    weight = tma_ready(weight)
    grid = (triton.cdiv(C, block_r), triton.cdiv(H, block_h), splits)
    _dh_kernel[grid](
        TensorDescriptor.from_tensor(dz, [block_r, block_v]),
        TensorDescriptor.from_tensor(weight, [block_v, block_h]),
        TensorDescriptor.from_tensor(part, [block_r, block_h]),
        n_rows,
        c_pad,
        V,
        k_per_split,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
        BLOCK_V=block_v,
        DOT_PRECISION=_precision(dz),
        num_warps=warps,
        num_stages=stages,
    )
    if out is None:
        out = torch.empty(C, H, dtype=torch.float32, device=dz.device)
    if C:
        block = min(1024, triton.next_power_of_2(H))
        _merge_splits_kernel[(C, triton.cdiv(H, block))](
            part,
            part.stride(0),
            part if row_scale is None else row_scale,
            out,
            out.stride(0),
            C,
            c_pad,
            H,
            splits,
            SCALED=row_scale is not None,
            BLOCK_H=block,
        )
    return out

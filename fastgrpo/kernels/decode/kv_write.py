"""Write one decode step's keys and values into the completion KV cache, in one kernel.

What: for every row b, `comp_k[b, slot] = k[b]` and `comp_v[b, slot] = v[b]`, with `slot` a
() int64 device tensor (it advances between CUDA-graph replays, so it is read on the device).

Why: as two `index_copy_` calls this was 2 x 2.8 us per layer of a 0.5B decode step at 64 rows on
an H100, 0.13 ms of a 1.72 ms step (benchmarks/results/profile_decode_step_h100_v3.txt); one
kernel reads both sources once and saves a launch per layer.

Reference: `write_kv_ref`, the two `index_copy_` calls.
"""

from __future__ import annotations

import torch

from fastgrpo.kernels.decode import pdl
from fastgrpo.kernels.support import triton

if triton is not None:
    import triton.language as tl


def write_kv_ref(comp_k, comp_v, k, v, slot) -> None:
    """comp_k, comp_v (B, Tc, nkv, d); k, v (B, nkv, d); slot () int64."""
    index = slot.view(1)
    comp_k.index_copy_(1, index, k.unsqueeze(1))
    comp_v.index_copy_(1, index, v.unsqueeze(1))


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        ck_ptr,
        cv_ptr,  # (B, Tc, nkv * d) contiguous each
        k_ptr,
        v_ptr,  # (B, nkv * d) rows, unit stride inside a row
        slot_ptr,
        stride_k,
        stride_v,  # elements between rows of k and of v
        Tc,
        WIDTH: tl.constexpr,  # nkv * d
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = False,  # programmatic dependent launch (kernels.pdl)
    ):
        pdl.start(PDL)
        pdl.wait(PDL)
        b = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr)
        cols = tl.arange(0, BLOCK)
        ok = cols < WIDTH
        dest = (b * Tc + slot) * WIDTH + cols
        tl.store(ck_ptr + dest, tl.load(k_ptr + b * stride_k + cols, mask=ok), mask=ok)
        tl.store(cv_ptr + dest, tl.load(v_ptr + b * stride_v + cols, mask=ok), mask=ok)


def _rows(t: torch.Tensor) -> int | None:
    """Elements between rows of a (B, nkv, d) tensor whose rows are each contiguous, else None."""
    B, nkv, d = t.shape
    if t.stride(2) == 1 and (nkv == 1 or t.stride(1) == d):
        return t.stride(0)
    return None


def check_cache_write(comp_k, comp_v, k, v) -> None:
    """Shapes, layout and dtypes a kernel writing k, v (B, nkv, d) into the contiguous completion
    caches (B, Tc, nkv, d) assumes; a clear error otherwise."""
    B, Tc, nkv, d = comp_k.shape
    if comp_v.shape != comp_k.shape or k.shape != (B, nkv, d) or v.shape != (B, nkv, d):
        raise ValueError(
            f"caches (B, Tc, nkv, d) and k, v (B, nkv, d) expected, got {tuple(comp_k.shape)}, "
            f"{tuple(comp_v.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (comp_k.is_contiguous() and comp_v.is_contiguous()):
        raise ValueError("the caches must be contiguous")
    if len({comp_k.dtype, comp_v.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError("caches and k, v must share one dtype")


def write_kv_triton(comp_k, comp_v, k, v, slot) -> None:
    """As `write_kv_ref`, by one Triton launch with one program per row."""
    if triton is None:
        raise RuntimeError("the Triton KV write needs `pip install triton`")
    check_cache_write(comp_k, comp_v, k, v)
    B, Tc, nkv, d = comp_k.shape
    stride_k, stride_v = _rows(k), _rows(v)
    if stride_k is None or stride_v is None:
        raise ValueError("each row of k and v (nkv x d) must be contiguous")
    _write_kv_kernel[(B,)](
        comp_k,
        comp_v,
        k,
        v,
        slot,
        stride_k,
        stride_v,
        Tc,
        WIDTH=nkv * d,
        BLOCK=triton.next_power_of_2(nkv * d),
        num_warps=1 if nkv * d <= 256 else 4,
        **pdl.launch_options(),
    )


def write_kv(comp_k, comp_v, k, v, slot) -> None:
    """The kernel on CUDA tensors it can read, else the reference."""
    if (
        triton is not None
        and k.is_cuda
        and comp_k.is_contiguous()
        and comp_v.is_contiguous()
        and _rows(k) is not None
        and _rows(v) is not None
    ):
        return write_kv_triton(comp_k, comp_v, k, v, slot)
    return write_kv_ref(comp_k, comp_v, k, v, slot)

"""Softmax statistics of LM-head logits straight from the GEMM accumulator, never stored as [N, V].

What: for rows of `hidden` (N, H) against `weight` (V, H) at a temperature, one Triton kernel tiles
the logits GEMM and, in its epilogue, folds each fp32 tile into running per-row statistics: max,
sum of exponentials, the target's logit and the sum of p*z (for entropy). The vocabulary is split
across programs so that small N still fills the GPU; `combine_stats` merges the splits. The result
is the fp32 log-prob of each target and, optionally, each row's entropy.

Why: scoring (reference and old log-probs, evaluation) needs only these O(N) numbers. Computing
them from the fp32 accumulator keeps the log-prob accurate to ~1e-6 even with bf16 inputs, costs
2*N*H*V FLOPs and no [N, V] memory. The training kernel uses the same statistics code, so its
log-probs are bitwise those of scoring and the PPO ratio is exactly 1 on-policy.

Reference: `lm_head_stats_ref` (below) computes the same statistics with plain PyTorch in fp32.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path serves
    triton = None

LOG2E = 1.4426950408889634


def lm_head_stats_ref(hidden, weight, targets, temperature: float = 1.0):
    """(logp, entropy, lse), each (N,) fp32, from materialised fp32 logits: the spec."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    logits = (hidden.to(dtype) @ weight.to(dtype).t()) / temperature  # (N, V)
    lse = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - lse
    probs = torch.softmax(logits, -1)
    entropy = lse - (probs * logits).sum(-1)
    return logp, entropy, lse


def combine_stats(m, s, t, pz):
    """Merge per-split statistics (S, N) into (logp, entropy, lse), each (N,) fp32."""
    top = m.max(0).values  # (N,)
    scale = torch.exp(m - top)  # (S, N)
    total = (s * scale).sum(0)
    lse = top + torch.log(total)
    logp = t.sum(0) - lse
    entropy = lse - (pz * scale).sum(0) / total
    return logp, entropy, lse


if triton is not None:

    @triton.jit
    def _lm_head_stats_kernel(
        h_ptr,
        w_ptr,
        tgt_ptr,  # (N, H), (V, H), (N,)
        m_ptr,
        s_ptr,
        t_ptr,
        pz_ptr,  # each (S, N) fp32
        z_ptr,  # (N, V) logits at the temperature (bf16 on GPUs), written only when STORE_LOGITS
        N,
        V,
        H,
        stride_hn,
        stride_wv,
        stride_zn,
        inv_temp,
        n_splits,
        tiles_per_split,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        STORE_LOGITS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no silent tf32)
    ):
        pid_m = tl.program_id(0)
        split = tl.program_id(1)
        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < N
        targets = tl.load(tgt_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        k_range = tl.arange(0, BLOCK_K)
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        target_logit = tl.zeros([BLOCK_M], tl.float32)
        running_pz = tl.zeros([BLOCK_M], tl.float32)
        # tiles split, split + S, ...; the last may lie past V (then fully masked, adding nothing)
        for i in range(0, tiles_per_split):
            tile = split + i * n_splits
            cols = tile.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < V
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, H, BLOCK_K):
                ks = k0 + k_range
                k_ok = ks < H
                a = tl.load(
                    h_ptr + rows[:, None] * stride_hn + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                b = tl.load(
                    w_ptr + cols[:, None] * stride_wv + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
            z = acc * inv_temp  # (BM, BN) logits at the temperature
            if STORE_LOGITS:  # for the gradient pass; the statistics below stay fp32
                tl.store(
                    z_ptr + rows[:, None] * stride_zn + cols[None, :],
                    z.to(z_ptr.dtype.element_ty),
                    mask=row_ok[:, None] & col_ok[None, :],
                )
            z = tl.where(col_ok[None, :], z, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(z, 1))
            alpha = tl.exp2((running_max - new_max) * 1.4426950408889634)
            p = tl.exp2((z - new_max[:, None]) * 1.4426950408889634)
            running_sum = running_sum * alpha + tl.sum(p, 1)
            running_pz = running_pz * alpha + tl.sum(p * tl.where(col_ok[None, :], z, 0.0), 1)
            hit = cols[None, :] == targets[:, None]
            target_logit += tl.sum(tl.where(hit, z, 0.0), 1)
            running_max = new_max
        out = split.to(tl.int64) * N + rows
        tl.store(m_ptr + out, running_max, mask=row_ok)
        tl.store(s_ptr + out, running_sum, mask=row_ok)
        tl.store(t_ptr + out, target_logit, mask=row_ok)
        tl.store(pz_ptr + out, running_pz, mask=row_ok)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _blocks(H: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for this device."""
    if _interpreting():
        return 16, 32, 16, 4, 1
    # Measured on the H100 (benchmarks/tune_lm_head_stats.py): for scoring alone, 256-wide vocabulary
    # tiles win at H=3584 (18.9 vs 22.4 ms) and lose at H=896 (12.3 vs 10.8 ms); in the fused
    # training call at H=3584 they lost (68.7 vs 64.5 ms). Scoring and training must share one
    # configuration to agree bitwise, so 128 everywhere for now.
    return 128, 128, 64, 8, 3


def _num_splits(V: int, block_n: int) -> int:
    """Vocabulary splits per row block: a function of V alone, so that any chunking of the rows
    gives bitwise the same statistics (scoring and training then agree exactly)."""
    n_tiles = triton.cdiv(V, block_n)
    return max(1, min(32, n_tiles // 64, n_tiles))


def lm_head_stats_triton(hidden, weight, targets, temperature: float = 1.0, logits_out=None):
    """(logp, entropy, lse), each (N,) fp32, with the Triton kernel. No autograd.

    `logits_out` (N, V) (bf16 on GPUs), when given, receives the logits at the temperature.
    """
    if triton is None:
        raise RuntimeError("the Triton LM-head kernel needs `pip install triton`")
    N, H = hidden.shape
    V = weight.shape[0]
    if weight.shape[1] != H or targets.shape != (N,):
        raise ValueError(
            f"hidden (N, H), weight (V, H), targets (N,) expected; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}"
        )
    if _interpreting() and hidden.dtype == torch.bfloat16:
        # The interpreter (numpy) has no bf16; fp32 copies are exact, and the GPU's bf16 dot
        # multiplies exactly and accumulates in fp32, so the function computed is the same.
        hidden, weight = hidden.float(), weight.float()
    hidden = hidden.contiguous() if hidden.stride(1) != 1 else hidden
    weight = weight.contiguous() if weight.stride(1) != 1 else weight
    block_m, block_n, block_k, warps, stages = _blocks(H)
    splits = _num_splits(V, block_n)
    stats = torch.empty(4, splits, N, dtype=torch.float32, device=hidden.device)
    store = logits_out is not None
    if store and (logits_out.shape != (N, V) or logits_out.stride(1) != 1):
        raise ValueError(f"logits_out must be a row-major ({N}, {V}) tensor")
    if N > 0:
        grid = (triton.cdiv(N, block_m), splits)
        _lm_head_stats_kernel[grid](
            hidden,
            weight,
            targets,
            stats[0],
            stats[1],
            stats[2],
            stats[3],
            logits_out if store else stats,
            N,
            V,
            H,
            hidden.stride(0),
            weight.stride(0),
            logits_out.stride(0) if store else 0,
            1.0 / temperature,
            splits,
            triton.cdiv(triton.cdiv(V, block_n), splits),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            STORE_LOGITS=store,
            DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
            num_warps=warps,
            num_stages=stages,
        )
    return combine_stats(*stats)

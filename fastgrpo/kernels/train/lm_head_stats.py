"""Softmax statistics of LM-head logits straight from the GEMM accumulator, never stored as [N, V].

What: for rows of `hidden` (N, H) against `weight` (V, H) at a temperature, one Triton kernel tiles
the logits GEMM and, in its epilogue, folds each fp32 tile into running per-row statistics: max,
sum of exponentials and the sum of p*z (for entropy). The vocabulary is split across programs so
that small N still fills the GPU; a combine kernel merges the splits (`combine_stats` is its
reference). A small second kernel takes each target's logit as one dot product of the row with its
target's weight row (cheaper than a compare in every tile of the epilogue). The result is the fp32
log-prob of each target and, optionally, each row's entropy.

Why: scoring (reference and old log-probs, evaluation) needs only these O(N) numbers. Computing
them from the fp32 accumulator keeps the log-prob accurate to ~1e-6 even with bf16 inputs, costs
2*N*H*V FLOPs and no [N, V] memory. The training kernel uses the same statistics code, so its
log-probs are bitwise those of scoring and the PPO ratio is exactly 1 on-policy.

Reference: `lm_head_stats_ref` (below) computes the same statistics with plain PyTorch in fp32.
"""

from __future__ import annotations

import torch

from fastgrpo.kernels.support import (
    LN2,
    LOG2E,
    TensorDescriptor,
    interpreting,
    multiprocessors,
    tma_ready,
    triton,
)
from fastgrpo.kernels.train import lm_head_stats_gluon

if triton is not None:
    import triton.language as tl

    from fastgrpo.kernels.support import LN2_CONSTEXPR


def lm_head_stats_ref(hidden, weight, targets, temperature: float = 1.0):
    """(logp, entropy, lse), each (N,) fp32, from materialised fp32 logits: the spec."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    logits = (hidden.to(dtype) @ weight.to(dtype).t()) / temperature  # (N, V)
    lse = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - lse
    probs = torch.softmax(logits, -1)
    entropy = lse - (probs * logits).sum(-1)
    return logp, entropy, lse


def combine_stats(m, s, pz, t):
    """The reference of `_combine_kernel`: merge per-split base-2 statistics m, s, pz (S, N) and
    the target's t (N,) into (logp, entropy, lse), each (N,) fp32.

    The kernel keeps its statistics in base 2 (z2 = log2(e) * logits / T, so each tile needs one
    exp2 and no extra multiply): m the running max of z2, s the sum of 2^(z2 - m), pz the sum of
    2^(z2 - m) * z2; t is the target's z2.
    """
    top = m.max(0).values  # (N,)
    scale = torch.exp2(m - top)  # (S, N)
    total = (s * scale).sum(0)
    lse2 = top + torch.log2(total)
    logp = (t - lse2) * LN2
    entropy = (lse2 - (pz * scale).sum(0) / total) * LN2
    return logp, entropy, lse2 * LN2


if triton is not None:

    @triton.jit
    def _dot_step(
        h_desc,
        w_desc,
        row0,
        tile,
        ki,
        acc,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """acc += hidden[row block, k step] @ weight[tile's columns, k step]^T, both operands by
        bulk tensor copies (TMA): out-of-range rows and columns arrive as zeros."""
        a = h_desc.load([row0, ki * BLOCK_K])
        b = w_desc.load([tile * BLOCK_N, ki * BLOCK_K])
        return tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)

    @triton.jit
    def _fold_tile(
        acc,
        z_desc,
        row0,
        tile,
        V,
        scale2,
        reference,
        running_max,
        running_sum,
        running_pz,
        BLOCK_N: tl.constexpr,
        EVEN_V: tl.constexpr,
        STORE_PROBS: tl.constexpr,
        WITH_ENTROPY: tl.constexpr,
    ):
        """Fold one fp32 logits tile into the running base-2 statistics (and store it).

        Per element: a max, one fused multiply-add into exp2 and an add (plus a multiply-add for
        the entropy): the max is taken on the raw accumulator (scale2 > 0 commutes with it), and
        the target's logit comes from its own kernel, not from a compare in every tile. The store
        (for the gradient pass) is 2^(z2 - reference) per element, the tile's exponentials times
        one factor per row.
        """
        if not EVEN_V:  # only the last tile reaches past V
            if (tile + 1) * BLOCK_N > V:  # a large finite floor: 2^(floor - max) is 0, 0 * floor 0
                cols = tile.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
                acc = tl.where((cols < V)[None, :], acc, -1.0e30 / scale2)
        new_max = tl.maximum(running_max, tl.max(acc, 1) * scale2)
        p = tl.exp2(acc * scale2 - new_max[:, None])
        if STORE_PROBS:  # TMA store, clipped at N and V
            factor = tl.exp2(new_max - reference)
            z_desc.store([row0, tile * BLOCK_N], (p * factor[:, None]).to(z_desc.dtype))
        alpha = tl.exp2(running_max - new_max)
        running_sum = running_sum * alpha + tl.sum(p, 1)
        if WITH_ENTROPY:
            # sum of p * acc (raw); scaled to base-2 units once, at the store
            running_pz = running_pz * alpha + tl.sum(p * acc, 1)
        return new_max, running_sum, running_pz

    @triton.jit
    def _target_logit_kernel(
        h_ptr,
        stride_h,
        w_ptr,
        stride_w,
        tgt_ptr,
        out_ptr,  # (N,) fp32: scale2 * hidden[r] . weight[targets[r]]
        N,
        H,
        V,
        scale2,
        BLOCK_R: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """The base-2 logit of each row's target: one gathered weight row per row, fp32 sums."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < N
        targets = tl.load(tgt_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        ok = row_ok & (targets >= 0) & (targets < V)
        acc = tl.zeros([BLOCK_R], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            both = ok[:, None] & (cols < H)[None, :]
            h = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=both, other=0.0)
            w = tl.load(w_ptr + targets[:, None] * stride_w + cols[None, :], mask=both, other=0.0)
            acc += tl.sum(h.to(tl.float32) * w.to(tl.float32), 1)
        tl.store(out_ptr + rows, acc * scale2, mask=row_ok)

    @triton.jit
    def _combine_kernel(
        m_ptr,
        s_ptr,
        pz_ptr,  # each (S, N) fp32 per-split statistics
        t_ptr,  # (N,) the target's base-2 logit
        logp_ptr,
        ent_ptr,
        lse_ptr,  # out, each (N,) fp32
        N,
        S,
        BLOCK: tl.constexpr,
    ):
        """`combine_stats` in one launch (the splits are added in a fixed order)."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = rows < N
        top = tl.full([BLOCK], float("-inf"), tl.float32)
        for i in range(0, S):
            top = tl.maximum(top, tl.load(m_ptr + i * N + rows, mask=ok, other=0.0))
        total = tl.zeros([BLOCK], tl.float32)
        weighted = tl.zeros([BLOCK], tl.float32)
        for i in range(0, S):
            scale = tl.exp2(tl.load(m_ptr + i * N + rows, mask=ok, other=0.0) - top)
            total += tl.load(s_ptr + i * N + rows, mask=ok, other=0.0) * scale
            weighted += tl.load(pz_ptr + i * N + rows, mask=ok, other=0.0) * scale
        lse2 = top + tl.log2(total)
        t = tl.load(t_ptr + rows, mask=ok, other=0.0)
        tl.store(logp_ptr + rows, (t - lse2) * LN2_CONSTEXPR, mask=ok)
        tl.store(ent_ptr + rows, (lse2 - weighted / total) * LN2_CONSTEXPR, mask=ok)
        tl.store(lse_ptr + rows, lse2 * LN2_CONSTEXPR, mask=ok)

    @triton.jit
    def _lm_head_stats_kernel(
        h_desc,
        w_desc,  # tensor descriptors of hidden (N, H) and weight (V, H), blocks (BM, BK), (BN, BK)
        m_ptr,
        s_ptr,
        pz_ptr,  # each (S, N) fp32
        z_desc,  # (N, V) 2^(z2 - reference) (bf16 on GPUs), written when STORE_PROBS
        ref_ptr,  # (N,) fp32 base-2 reference per row, read when STORE_PROBS
        flags_ptr,  # (row blocks,) int32, read when ONLY_FLAGGED: blocks at 0 do nothing
        N,
        V,
        H,
        scale2,  # log2(e) / temperature, a run-time argument
        n_splits,
        tiles_per_split,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_V: tl.constexpr,  # V % BLOCK_N == 0: no partially filled vocabulary tile
        STORE_PROBS: tl.constexpr,
        ONLY_FLAGGED: tl.constexpr,
        WITH_ENTROPY: tl.constexpr,
        DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no silent tf32)
    ):
        pid_m = tl.program_id(0)
        split = tl.program_id(1)
        if ONLY_FLAGGED:
            if tl.load(flags_ptr + pid_m) == 0:
                return
        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < N
        reference = tl.zeros([BLOCK_M], tl.float32)
        if STORE_PROBS:
            reference = tl.load(ref_ptr + rows, mask=row_ok, other=0.0)
        n_tiles = tl.cdiv(V, BLOCK_N)
        k_tiles = tl.cdiv(H, BLOCK_K)
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        running_pz = tl.zeros([BLOCK_M], tl.float32)
        row0 = pid_m * BLOCK_M
        # tiles split, split + S, ...; the last may lie past V (then skipped)
        for i in range(0, tiles_per_split):
            tile = split + i * n_splits
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for ki in range(0, k_tiles):
                acc = _dot_step(
                    h_desc, w_desc, row0, tile, ki, acc, BLOCK_N, BLOCK_K, DOT_PRECISION
                )
            if tile < n_tiles:
                running_max, running_sum, running_pz = _fold_tile(
                    acc,
                    z_desc,
                    row0,
                    tile,
                    V,
                    scale2,
                    reference,
                    running_max,
                    running_sum,
                    running_pz,
                    BLOCK_N,
                    EVEN_V,
                    STORE_PROBS,
                    WITH_ENTROPY,
                )
        out = split.to(tl.int64) * N + rows
        tl.store(m_ptr + out, running_max, mask=row_ok)
        tl.store(s_ptr + out, running_sum, mask=row_ok)
        tl.store(pz_ptr + out, running_pz * scale2, mask=row_ok)


def _blocks(H: int, itemsize: int = 2) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, maxnreg]) for this device and operand
    size (fp32 operands take twice the shared memory per tile)."""
    if interpreting():
        return 16, 32, 16, 4, 1
    if itemsize == 4:
        return 128, 128, 32, 8, 3
    # Measured on the H100 with TMA loads (benchmarks/lab/tune_lm_head_stats.py, benchmarks/HISTORY.md): 128x256
    # tiles, 64-wide k steps, 8 warps, 3 stages are the fastest at H=896 and H=3584 for scoring
    # (7.4 and 14.1 ms) and inside the fused training call. Scoring and training must share one
    # configuration to agree bitwise.
    return 128, 256, 64, 8, 3


def _num_splits(V: int, block_n: int) -> int:
    """Vocabulary splits per row block: a function of V (and the device) alone, so that any
    chunking of the rows gives bitwise the same statistics (scoring and training agree exactly).
    On a GPU, a quarter of the multiprocessor count: every 4 row blocks then fill whole waves."""
    n_tiles = triton.cdiv(V, block_n)
    if interpreting() or not torch.cuda.is_available():
        return max(1, min(32, n_tiles // 64, n_tiles))
    sms = multiprocessors()
    return max(1, min(max(1, sms // 4), n_tiles // 16, n_tiles))


def _prepare(hidden, weight, targets):
    """Checked, TMA-ready (hidden, weight) for the kernels."""
    if triton is None:
        raise RuntimeError("the Triton LM-head kernel needs `pip install triton`")
    N, H = hidden.shape
    if weight.shape[1] != H or targets.shape != (N,):
        raise ValueError(
            f"hidden (N, H), weight (V, H), targets (N,) expected; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}"
        )
    if interpreting() and hidden.dtype == torch.bfloat16:
        # The interpreter (numpy) has no bf16; fp32 copies are exact, and the GPU's bf16 dot
        # multiplies exactly and accumulates in fp32, so the function computed is the same.
        hidden, weight = hidden.float(), weight.float()
    return tma_ready(hidden), tma_ready(weight)


def _target_logits(hidden, weight, targets, scale2):
    """(N,) fp32 base-2 logit of each row's target (0 where the target is outside [0, V))."""
    N, H = hidden.shape
    out = torch.empty(N, dtype=torch.float32, device=hidden.device)
    if N > 0:
        rows_per_program = 16
        _target_logit_kernel[(triton.cdiv(N, rows_per_program),)](
            hidden,
            hidden.stride(0),
            weight,
            weight.stride(0),
            targets,
            out,
            N,
            H,
            weight.shape[0],
            scale2,
            BLOCK_R=rows_per_program,
            BLOCK_H=min(256, triton.next_power_of_2(H)),
        )
    return out


def _combine(stats, target):
    """(logp, entropy, lse) from the per-split statistics, by `_combine_kernel`."""
    N = target.shape[0]
    out = torch.empty(3, N, dtype=torch.float32, device=target.device)
    if N > 0:
        block = 128
        _combine_kernel[(triton.cdiv(N, block),)](
            stats[0],
            stats[1],
            stats[2],
            target,
            out[0],
            out[1],
            out[2],
            N,
            stats.shape[1],
            BLOCK=block,
        )
    return out[0], out[1], out[2]


def _new_stats(hidden, weight):
    """An uninitialised (3, S, N) fp32 buffer for the per-split statistics m, s, pz."""
    block_n = _blocks(hidden.shape[1], hidden.element_size())[1]
    splits = _num_splits(weight.shape[0], block_n)
    return torch.empty(3, splits, hidden.shape[0], dtype=torch.float32, device=hidden.device)


def _launch_stats(
    hidden, weight, scale2, stats, *, probs_out=None, reference=None, flags=None, entropy=True
):
    """The statistics kernel over prepared (hidden, weight) into `stats` (3, S, N), and with
    `probs_out` the relative probabilities (on Hopper GPUs by `lm_head_stats_gluon`'s kernel,
    whose results are the same bit for bit)."""
    N, H = hidden.shape
    V = weight.shape[0]
    block_m, block_n, block_k, warps, stages, *extra = _blocks(H, hidden.element_size())
    store = probs_out is not None
    if store and (
        probs_out.shape != (N, V)
        or probs_out.stride(1) != 1
        or (probs_out.stride(0) * probs_out.element_size()) % 16
        or probs_out.data_ptr() % 16
    ):
        raise ValueError(
            f"probs_out must be a row-major ({N}, {V}) tensor with 16-byte aligned rows "
            "(a view of a buffer whose row length is a multiple of 8)"
        )
    if N == 0:
        return
    config = (block_m, block_n, block_k, warps, stages, *extra)
    if store and lm_head_stats_gluon.applies(hidden, probs_out, config, flags):
        if lm_head_stats_gluon.launch(hidden, weight, scale2, stats, probs_out, reference, entropy):
            return
    options = {"maxnreg": extra[0]} if extra and extra[0] else {}
    _lm_head_stats_kernel[(triton.cdiv(N, block_m), stats.shape[1])](
        TensorDescriptor.from_tensor(hidden, [block_m, block_k]),
        TensorDescriptor.from_tensor(weight, [block_n, block_k]),
        stats[0],
        stats[1],
        stats[2],
        TensorDescriptor.from_tensor(probs_out if store else hidden, [block_m, block_n]),
        reference if store else stats,
        flags if flags is not None else stats,
        N,
        V,
        H,
        scale2,
        stats.shape[1],
        triton.cdiv(triton.cdiv(V, block_n), stats.shape[1]),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_V=V % block_n == 0,
        STORE_PROBS=store,
        ONLY_FLAGGED=flags is not None,
        WITH_ENTROPY=entropy,
        DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32",
        num_warps=warps,
        num_stages=stages,
        **options,
    )


def lm_head_stats_triton(
    hidden, weight, targets, temperature: float = 1.0, with_entropy: bool = True
):
    """(logp, entropy | None, lse), each (N,) fp32, with the Triton kernel. No autograd.

    Without `with_entropy` the epilogue skips the entropy sum and None is returned in its place.
    """
    stats = ChunkStats(hidden, weight, targets, temperature, with_entropy=with_entropy)
    return stats.logp, stats.entropy if with_entropy else None, stats.lse


class ChunkStats:
    """Statistics of a chunk of rows (logp, entropy, lse, the target's base-2 logit) and, for the
    gradient pass, its relative probabilities. Scoring (`lm_head_stats_triton`) is the same call
    without `probs`, so both get bitwise the same statistics.

    `probs` (C, V), when given, receives e = 2^(z2 - t2) = p / p_target per element (z2 the base-2
    logits at the temperature, t2 the target's): the statistics kernel writes it from the
    exponentials it takes anyway, one multiply per element, and the gradient GEMMs read it as it
    is, scaled per row (see `lm_head_grpo_loss`). A row whose target is very unlikely (p_target
    below 2^-60, `SAFE_LOG2_RATIO`) could overflow that form, so `rescale_rows_` recomputes such
    rows against the row's own log-sum-exp instead (e = p), on the device and only for the row
    blocks that hold one.
    """

    SAFE_LOG2_RATIO = 60.0

    def __init__(self, hidden, weight, targets, temperature, probs=None, with_entropy=True):
        self.hidden, self.weight = _prepare(hidden, weight, targets)
        self.scale2 = LOG2E / temperature
        self.probs = probs
        self.block_m = _blocks(self.hidden.shape[1], self.hidden.element_size())[0]
        stats = _new_stats(self.hidden, self.weight)
        self.target2 = _target_logits(self.hidden, self.weight, targets, self.scale2)
        _launch_stats(
            self.hidden,
            self.weight,
            self.scale2,
            stats,
            probs_out=probs,
            reference=self.target2,
            entropy=with_entropy,
        )
        self.logp, self.entropy, self.lse = _combine(stats, self.target2)
        self._stats = stats

    def rescale_rows_(self, reference, flags):
        """Rewrite the flagged row blocks' probabilities against `reference` (N,) base-2."""
        _launch_stats(
            self.hidden,
            self.weight,
            self.scale2,
            self._stats,
            probs_out=self.probs,
            reference=reference,
            flags=flags,
            entropy=False,
        )

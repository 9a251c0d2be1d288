"""The sampler's counter-based Gumbel noise in Gluon's dialect, for the fused LM-head sampler
(`lm_head_sample`): a Gluon kernel cannot call `triton.jit` functions, so the hashes of
`sample_tokens` are written again here, bit for bit the same noise column for column.
"""

from __future__ import annotations

from fastgrpo.kernels.support import LOG2E, gluon

if gluon is not None:
    from triton.experimental.gluon import language as gl

    # splitmix64 and lowbias32 constants, as sample_tokens
    GOLDEN = gl.constexpr(0x9E3779B97F4A7C15)
    _MUL1 = gl.constexpr(0xBF58476D1CE4E5B9)
    _MUL2 = gl.constexpr(0x94D049BB133111EB)
    _LOWBIAS_MUL1 = gl.constexpr(0x7FEB352D)
    _LOWBIAS_MUL2 = gl.constexpr(0x846CA68B)
    _R_SCALE = gl.constexpr(2.0**-32)
    _R_MIN = gl.constexpr(2.0**-33)
    _R_MAX = gl.constexpr(1.0 - 2.0**-24)
    _SERIES_BELOW = gl.constexpr(1.0 / 32)
    _G_LOG2E = gl.constexpr(LOG2E)

    @gluon.jit
    def mix64(x):
        x ^= x >> 30
        x *= _MUL1
        x ^= x >> 27
        x *= _MUL2
        x ^= x >> 31
        return x

    @gluon.jit
    def lowbias32(x):
        x ^= x >> 16
        x *= _LOWBIAS_MUL1
        x ^= x >> 15
        x *= _LOWBIAS_MUL2
        x ^= x >> 16
        return x

    @gluon.jit
    def fast_log2(x):
        # lg2.approx.ftz.f32: one MUFU.LG2, as libdevice.fast_log2f in sample_tokens. Without .ftz
        # ptxas adds three instructions per call for subnormal inputs, which never come here (the
        # inputs are >= 2**-33): -6.9 us alone, ~-7 us per replayed decode step (benchmarks/HISTORY.md)
        return gl.inline_asm_elementwise(
            "lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1
        )

    @gluon.jit
    def noise_log2(cols, lo, hi):
        """sample_tokens._noise_log2 (FAST): -log2(L), L = -log2(1 - r), r from 32 hashed bits.
        cols: uint32 (any shape), lo / hi: uint32 broadcastable to it."""
        bits = lowbias32(lowbias32(cols ^ lo) ^ hi)
        r = gl.minimum(gl.maximum(bits.to(gl.float32) * _R_SCALE, _R_MIN), _R_MAX)
        series = r * (1.0 + r * (0.5 + r * (1.0 / 3 + r * (0.25 + r * 0.2)))) * _G_LOG2E
        small = r < _SERIES_BELOW
        big = -fast_log2(gl.where(small, 0.5, 1.0 - r))
        return -fast_log2(gl.where(small, series, big))

    @gluon.jit
    def score_scalar(a, col, lo, hi, scale):
        """One element's score, a * scale + noise: map_elementwise lowers this depth first (one
        element's whole hash at a time) instead of op by op over the whole tile, which keeps a few
        hash chains live instead of BLOCK_B * BLOCK_V / 128 of them."""
        return a * scale + noise_log2(col, lo, hi)

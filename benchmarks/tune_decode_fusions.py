"""The decode step's fused kernels against the launches they replace, at the 0.5B shape, 64 rows.

- q/k/v: the decode linear then RoPE + KV write (two launches), against `qkv_rope_write_triton`
  (RoPE and the cache write in the linear's epilogue), and the linear alone;
- o_proj, residual add + RMSNorm, gate/up + SiLU (three launches), against
  `linear_norm_linear_triton` (the norm split into the two linears' epilogues), and the two
  linears alone.
Each op is timed as in `tune_decode_linear.py`: 24 calls, each with its own weights, in one CUDA
graph. Prints a table, then one JSON line. Run on a CUDA GPU:
    python benchmarks/tune_decode_fusions.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_rollout import print_result_line  # noqa: E402
from tune_decode_linear import LAYERS, time_per_call  # noqa: E402

from fastgrpo.kernels import decode_linear, rope  # noqa: E402
from fastgrpo.kernels.rms_norm import add_rms_norm_triton  # noqa: E402

M, H, INNER, NQ, NKV, D, TC = 64, 896, 4864, 14, 2, 64, 256


def weights(rows, cols, scale=None):
    scale = cols**-0.5 if scale is None else scale
    return [
        torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * scale for _ in range(LAYERS)
    ]


def main():
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    h = torch.randn(M, H, **bf16)
    qkv_w, qkv_b = weights((NQ + 2 * NKV) * D, H), weights((NQ + 2 * NKV) * D, 1, 0.5)
    cos, sin = torch.rand(M, D, **bf16), torch.rand(M, D, **bf16)
    caches = [torch.zeros(M, TC, NKV, D, **bf16) for _ in range(2 * LAYERS)]
    slot = torch.tensor(5, device="cuda")
    o_w, gu_w = weights(H, NQ * D), weights(2 * INNER, H)
    attn, residual = torch.randn(M, NQ * D, **bf16), torch.randn(M, H, **bf16)
    norm_w = torch.ones(H, **bf16)

    def qkv_alone(i):
        return decode_linear.linear_triton(h, qkv_w[i], qkv_b[i][:, 0])

    def qkv_then_rope(i):
        q, k, v = qkv_alone(i).split([NQ * D, NKV * D, NKV * D], dim=-1)
        q, k, v = q.view(M, NQ, D), k.view(M, NKV, D), v.view(M, NKV, D)
        rope.rope_write_kv_triton(q, k, v, cos, sin, caches[2 * i], caches[2 * i + 1], slot)

    def qkv_rope_fused(i):
        decode_linear.qkv_rope_write_triton(
            h, qkv_w[i], qkv_b[i][:, 0], cos, sin, caches[2 * i], caches[2 * i + 1], slot, NQ, NKV
        )

    def o_norm_gate_up(i):
        x = decode_linear.linear_triton(attn, o_w[i], None)
        normed, _ = add_rms_norm_triton(x, residual, norm_w, 1e-6)
        return decode_linear.linear_triton(normed, gu_w[i], None, swiglu=True)

    def o_gate_up_alone(i):
        x = decode_linear.linear_triton(attn, o_w[i], None)
        return decode_linear.linear_triton(x, gu_w[i], None, swiglu=True)

    def norm_between(i):
        return decode_linear.linear_norm_linear_triton(
            attn, o_w[i], None, residual, norm_w, 1e-6, gu_w[i], None, swiglu=True
        )

    cases = {
        "q/k/v linear alone": qkv_alone,
        "q/k/v linear, then RoPE + KV write": qkv_then_rope,
        "q/k/v + RoPE + KV write, one kernel": qkv_rope_fused,
        "o_proj, gate/up alone (no norm)": o_gate_up_alone,
        "o_proj, add + norm, gate/up": o_norm_gate_up,
        "o_proj + add, gate/up * rstd": norm_between,
    }
    results = []
    for name, step in cases.items():
        us = time_per_call(step)
        results.append(dict(case=name, us=us))
        print(f"{name:<40} {us:7.2f} us per layer", flush=True)
    print_result_line("tune_decode_fusions", results)


if __name__ == "__main__":
    main()

"""The decode-attention kernel at the rollout benchmark's shapes, over key splits per (row, kv head).

Shapes (random bf16 caches): A, the 0.5B model (14 q heads, 2 kv heads, d 64) at 64 rows, prompt
128, halfway through 256 new tokens (128 completion keys); D's 8 prompts x 8 samples at the same
point; C, the 7B model (28 q heads, 4 kv heads, d 128) at 64 rows, prompt 256, halfway through 512.
Each split count and block shape is timed as in `tune_decode_linear.py`: 24 calls (one per layer, each with its own
cache) in one CUDA graph; with the floor of the bytes of keys and values read, at the copy
bandwidth measured in the same run. Prints a table, then one JSON line. Run on a CUDA GPU:
    python -m benchmarks.lab.tune_decode_attention
"""

from __future__ import annotations

import itertools
import sys

import torch

from benchmarks.bench_rollout import copy_bandwidth, print_result_line  # noqa: E402
from benchmarks.lab.tune_decode_linear import LAYERS, time_per_call  # noqa: E402
from fastgrpo.kernels.decode import decode_attention_triton  # noqa: E402

# (BLOCK_N, num_warps, num_stages)
BLOCKS = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (64, 8, 2), (128, 8, 2), (256, 4, 3)]
# name: (prompts, samples, q heads, kv heads, head dim, prompt length, completion slots, step)
SHAPES = {
    "A 0.5B 64x1": (64, 1, 14, 2, 64, 128, 255, 128),
    "D 0.5B 8x8": (8, 8, 14, 2, 64, 128, 255, 128),
    "C 7B 64x1": (64, 1, 28, 4, 128, 256, 511, 256),
}


def measure(name, bandwidth):
    P, G, nh, nkv, d, Lp, Tc, step = SHAPES[name]
    B = P * G
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, nh, d, **bf16)
    layers = [
        dict(
            pk=torch.randn(P, Lp, nkv, d, **bf16),
            pv=torch.randn(P, Lp, nkv, d, **bf16),
            ck=torch.randn(B, Tc, nkv, d, **bf16),
            cv=torch.randn(B, Tc, nkv, d, **bf16),
        )
        for _ in range(LAYERS)
    ]
    lens = torch.full((P,), Lp, device="cuda", dtype=torch.int64)
    at = torch.tensor(step, device="cuda")
    # bytes read: each prompt's keys and values once (its G rows share them through L2), each
    # row's completion keys and values up to the step
    nbytes = 2 * nkv * d * 2 * (P * Lp + B * (step + 1))
    floor_us = nbytes / bandwidth * 1e6
    rows = []
    default_blocks = decode_attention_triton.blocks_for(B, nkv, d)
    default = decode_attention_triton.num_splits(B, nkv, Lp + Tc, default_blocks[0], q.device)
    for splits, blocks in itertools.product((1, 2, 3, 4), BLOCKS):

        def call(i, splits=splits, blocks=blocks):
            c = layers[i]
            return decode_attention_triton.decode_attention_triton(
                q, c["pk"], c["pv"], lens, c["ck"], c["cv"], at, splits=splits, blocks=blocks
            )

        try:
            us = time_per_call(call)
        except Exception as error:  # out of shared memory or registers: skip it
            print(f"  {splits} {blocks}: {type(error).__name__}", file=sys.stderr)
            continue
        rows.append(
            dict(
                shape=name, splits=splits, blocks=blocks, us=us, floor_us=floor_us, default=default
            )
        )
        mark = "  (default)" if (splits, blocks) == (default, default_blocks) else ""
        print(
            f"{name:<14} splits {splits} blocks {blocks}: {us:6.2f} us (floor {floor_us:5.2f})"
            f"{mark}",
            flush=True,
        )
    best = min(rows, key=lambda r: r["us"])
    print(f"{name:<14} best: splits {best['splits']} blocks {best['blocks']} {best['us']:6.2f} us")
    return rows


def main():
    bandwidth = copy_bandwidth()
    results = []
    for name in SHAPES:
        results += measure(name, bandwidth)
    print_result_line("tune_decode_attention", results, copy_bandwidth_tb_s=bandwidth / 1e12)


if __name__ == "__main__":
    main()

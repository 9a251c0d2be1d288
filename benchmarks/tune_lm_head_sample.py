"""The fused LM-head sampler (`kernels/lm_head_sample.py`) over block configurations, against what it
replaces: the cuBLAS LM head writing bf16 logits, then the fused sampler reading them.

At the 0.5B decode shape (64 rows, H=896, V=151936, bf16), each variant is captured 8 times in one
CUDA graph (so launch costs are those of a decode step's graph) and the replay time is divided by 8.
Prints a table, then one JSON line. Run on a CUDA GPU:  python benchmarks/tune_lm_head_sample.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastgrpo.kernels import lm_head_sample as ops  # noqa: E402
from fastgrpo.kernels.sample_tokens import sample_tokens_fused  # noqa: E402

CONFIGS = [  # (BLOCK_V, BLOCK_K, num_warps, num_stages)
    (128, 64, 4, 3),
    (128, 64, 4, 4),
    (128, 128, 4, 3),
    (64, 128, 4, 4),
    (256, 64, 4, 3),
    (256, 64, 8, 3),
    (128, 64, 8, 3),
    (256, 32, 8, 4),
]
REPEAT = 8


def graph_us(fn):
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPEAT)
    return sorted(times)[len(times) // 2]


def main():
    B, H, V = 64, 896, 151936
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, H, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=gen) * 3 / H**0.5).bfloat16()
    seeds = torch.arange(B, device="cuda")
    step = torch.tensor(5, device="cuda")
    rows = [
        {
            "variant": "cuBLAS logits + fused sampler",
            "us": graph_us(lambda: sample_tokens_fused(F.linear(x, w), 1.0, seeds, step)),
        },
        {"variant": "cuBLAS logits alone", "us": graph_us(lambda: F.linear(x, w))},
    ]
    for config in CONFIGS:
        row = {"variant": "lm_head_sample", "config": config}
        try:
            row["us"] = graph_us(lambda c=config: ops.lm_head_sample(x, w, 1.0, seeds, step, c))
        except Exception as error:  # a configuration that does not fit shared memory
            row["error"] = str(error).splitlines()[0][:100]
        rows.append(row)
    floor_us = w.numel() * 2 / 2.9e12 * 1e6
    print(f"weight read at 2.9 TB/s: {floor_us:.1f} us")
    for r in rows:
        what = f"{r['variant']} {r.get('config', '')}"
        print(f"{what:<48} {r['error']}" if "error" in r else f"{what:<48} {r['us']:8.1f} us")
    print(
        json.dumps(
            {"bench": "tune_lm_head_sample", "gpu": torch.cuda.get_device_name(), "rows": rows}
        )
    )


if __name__ == "__main__":
    main()

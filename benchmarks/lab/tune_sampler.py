"""The decode step's token sampler at a real vocabulary: the fused Triton sampler
(`kernels/decode/sample_tokens.py`) at several block configurations against the torch sampler.

Each sampler is timed as it runs in a decode step: 24 calls on 24 different logits buffers (so
the logits are not all in L2) captured in one CUDA graph, the graph replayed; the time per call is
the replay time over 24. The floor is one read of the bf16 logits at the measured copy bandwidth.
Prints a table, then one JSON line. Run on a CUDA GPU:
    python -m benchmarks.lab.tune_sampler [--rows 64 256]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.bench_rollout import copy_bandwidth, print_result_line  # noqa: E402
from benchmarks.lab.tune_decode_linear import LAYERS, time_per_call  # noqa: E402
from fastgrpo.kernels.decode.sample_tokens import _blocks, sample_tokens_fused  # noqa: E402
from fastgrpo.rollout.sampling import SamplingParams, sample_tokens_torch  # noqa: E402

VOCAB = 151936
CONFIGS = list(itertools.product((512, 1024, 2048), (2, 4, 8), (4, 8)))


def measure(rows: int, bandwidth: float) -> dict:
    logits = [
        torch.randn(rows, VOCAB, device="cuda").mul_(4).to(torch.bfloat16) for _ in range(LAYERS)
    ]
    seeds = torch.arange(rows, device="cuda")
    step = torch.tensor(7, device="cuda")
    floor_us = rows * VOCAB * 2 / bandwidth * 1e6
    row = dict(rows=rows, vocab=VOCAB, floor_us=floor_us)
    params = SamplingParams(1.0)
    row["torch_us"] = time_per_call(lambda i: sample_tokens_torch(logits[i], params, seeds, step))
    row["default"] = list(_blocks())
    row["fused_us"] = time_per_call(lambda i: sample_tokens_fused(logits[i], 1.0, seeds, step))
    row["greedy_us"] = time_per_call(lambda i: sample_tokens_fused(logits[i], 0.0, seeds, step))
    sweep = []
    for blocks in CONFIGS:
        us = time_per_call(
            lambda i, blocks=blocks: sample_tokens_fused(logits[i], 1.0, seeds, step, blocks)
        )
        sweep.append(dict(blocks=list(blocks), us=us))
    best = min(sweep, key=lambda s: s["us"])
    row["best"], row["best_us"], row["sweep"] = best["blocks"], best["us"], sweep
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    results = []
    for rows in args.rows:
        row = measure(rows, bandwidth)
        results.append(row)
        print(
            f"B={rows:<4} V={VOCAB}  floor {row['floor_us']:6.2f} us  torch {row['torch_us']:8.2f}"
            f"  fused {row['fused_us']:6.2f} {row['default']}  greedy {row['greedy_us']:6.2f}"
            f"  best {row['best_us']:6.2f} {row['best']}",
            flush=True,
        )
    print_result_line("tune_sampler", results, copy_bandwidth_tb_s=bandwidth / 1e12)


if __name__ == "__main__":
    main()

"""Rows per chunk of the fused LM-head loss: time and peak extra memory of one fwd+bwd call.

Larger chunks mean fewer launches and fuller GEMMs but a larger buffer of (rows, V) probabilities (2 * V bytes per row)
and larger dH partial sums (~20 * H bytes per row). This sweeps the chunk size on the issue's
shapes so the default budget (`lm_head_grpo_loss.DEFAULT_CHUNK_BYTES`) can be chosen from
measurements. Prints a table, then one JSON line. Run on a CUDA GPU:
    python -m benchmarks.lab.tune_chunk_rows [--rows 2048 3072 4096]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks.bench_logprob import SHAPES, fused_loss, make_inputs, measure  # noqa: E402
from fastgrpo.kernels.train.lm_head_grpo_loss import DEFAULT_CHUNK_BYTES, _chunk_rows  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2048, 2560, 3072, 4096])
    args = parser.parse_args()
    results = []
    for n, h, v in SHAPES:
        inputs = make_inputs(n, h, v)
        default = _chunk_rows(inputs[1], DEFAULT_CHUNK_BYTES)
        for rows in sorted(set(args.rows) | {default}):
            call = lambda *x, rows=rows: fused_loss(*x, chunk=rows)  # noqa: E731
            ms, peak, _ = measure(call, inputs)
            results.append(
                {
                    "shape": [n, h, v],
                    "chunk_rows": rows,
                    "default": rows == default,
                    "ms": ms,
                    "peak_gib": peak,
                }
            )
            mark = " (default)" if rows == default else ""
            print(f"{n:>6} x {h:<5} rows {rows:>5}{mark:<10} {ms:8.2f} ms  {peak:6.3f} GiB")
            torch.cuda.empty_cache()
        del inputs
        torch.cuda.empty_cache()
    print(
        json.dumps(
            {
                "bench": "tune_chunk_rows",
                "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "commit": os.environ.get("FASTGRPO_COMMIT", "unknown"),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()

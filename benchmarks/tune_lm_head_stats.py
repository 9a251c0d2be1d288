"""Block-size sweep for the LM-head statistics kernel (scoring: log-prob + entropy).

Times each (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) on the issue's shapes and prints a table,
then one JSON line. The chosen default lives in `fastgrpo.kernels.lm_head_stats._blocks`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastgrpo.kernels import lm_head_stats as ops  # noqa: E402

CONFIGS = [
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 128, 128, 8, 3),
    (64, 256, 64, 4, 4),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (256, 128, 64, 8, 4),
]
SHAPES = [(16384, 896, 151936), (8192, 3584, 152064)]


def main():
    rows = []
    for n, h, v in SHAPES:
        hidden = torch.randn(n, h, device="cuda").bfloat16()
        weight = (torch.randn(v, h, device="cuda") / h**0.5).bfloat16()
        targets = torch.randint(0, v, (n,), device="cuda")
        for config in CONFIGS:
            ops._blocks = lambda _h, c=config: c
            try:
                ms = do_bench(
                    lambda args=(hidden, weight, targets): ops.lm_head_stats_triton(*args),
                    warmup=25,
                    rep=300,
                    return_mode="median",
                )
                rows.append(
                    {
                        "shape": [n, h, v],
                        "config": config,
                        "ms": ms,
                        "tflops": 2 * n * h * v / ms / 1e9,
                    }
                )
            except Exception as error:  # a config that does not compile (shared memory) is skipped
                rows.append({"shape": [n, h, v], "config": config, "error": str(error)[:120]})
    for r in rows:
        print(
            r["shape"],
            r["config"],
            f"{r['ms']:.2f} ms {r['tflops']:.0f} TFLOP/s" if "ms" in r else r["error"],
        )
    print(
        json.dumps(
            {"bench": "tune_lm_head_stats", "gpu": torch.cuda.get_device_name(), "rows": rows}
        )
    )


if __name__ == "__main__":
    main()

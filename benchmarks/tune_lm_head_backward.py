"""Block-size sweep for the backward GEMM kernels (dW accumulation, split-K dH) against cuBLAS.

One chunk of 2048 rows at the issue's shapes, every row with a gradient: times `add_dw_` (fp32 dW)
and `dh` for each configuration, and cuBLAS's `addmm(out_dtype=fp32)` / `mm` for the same work.
Prints a table, then one JSON line. The chosen defaults live in
`fastgrpo.kernels.lm_head_backward._dw_blocks` and `_dh_blocks`.
Run on a CUDA GPU:  python benchmarks/tune_lm_head_backward.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastgrpo.kernels import lm_head_backward as bwd  # noqa: E402
from fastgrpo.kernels.lm_head_grpo_loss import _add_matmul_f32_  # noqa: E402

DW_CONFIGS = [  # (BLOCK_V, BLOCK_H, BLOCK_R, warps, stages)
    (256, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 8, 3),
    (128, 128, 128, 8, 3),
    (256, 128, 64, 16, 3),
    (256, 128, 64, 8, 4),
    (128, 256, 64, 8, 4),
    (256, 256, 64, 16, 3),
]
DH_CONFIGS = [  # (BLOCK_R, BLOCK_H, BLOCK_V, warps, stages, vocabulary splits)
    (128, 128, 64, 8, 4, 8),
    (128, 256, 64, 8, 3, 4),
    (128, 128, 64, 8, 4, 12),
    (128, 128, 64, 8, 4, 33),
    (128, 256, 64, 8, 3, 12),
    (128, 128, 128, 8, 3, 12),
    (64, 128, 64, 4, 4, 12),
    (256, 128, 64, 8, 3, 4),
    (256, 128, 64, 8, 3, 8),
    (256, 128, 64, 8, 4, 8),
    (256, 256, 64, 16, 3, 4),
]
SHAPES = [(2048, 896, 151936), (2048, 3584, 152064)]


def bench(fn):
    return do_bench(fn, warmup=10, rep=200, return_mode="median")


def sweep(c, h, v):
    rows = []
    dz = torch.randn(c, v, device="cuda").bfloat16()
    hidden = torch.randn(c, h, device="cuda").bfloat16()
    weight = torch.randn(v, h, device="cuda").bfloat16()
    dw = torch.zeros(v, h, device="cuda")
    n = torch.tensor(c, dtype=torch.int32, device="cuda")
    tflop = 2 * c * h * v / 1e12
    want_dh = torch.mm(dz, weight).float()
    for name, fn in (
        ("cuBLAS dW addmm fp32", lambda: _add_matmul_f32_(dw, dz.t(), hidden)),
        ("cuBLAS dH mm", lambda: torch.mm(dz, weight)),
    ):
        ms = bench(fn)
        rows.append({"shape": [c, h, v], "kernel": name, "ms": ms, "tflops": tflop / ms * 1e3})
    for config in DW_CONFIGS:
        bwd._dw_blocks = lambda *_, x=config: x
        row = {"shape": [c, h, v], "kernel": "triton dW", "config": config}
        try:
            row["ms"] = bench(lambda: bwd.add_dw_(dw, dz, hidden, n))
            row["tflops"] = tflop / row["ms"] * 1e3
        except Exception as error:
            row["error"] = str(error).splitlines()[0][:100]
        rows.append(row)
    for config in DH_CONFIGS:
        bwd._dh_blocks = lambda *_, x=config: x[:5]
        bwd._dh_splits = lambda x=config: x[5]
        row = {"shape": [c, h, v], "kernel": "triton dH", "config": config}
        try:
            got = bwd.dh(dz, weight, n)
            row["max_rel_err"] = ((got - want_dh).abs().max() / want_dh.abs().max()).item()
            row["ms"] = bench(lambda: bwd.dh(dz, weight, n))
            row["tflops"] = tflop / row["ms"] * 1e3
        except Exception as error:
            row["error"] = str(error).splitlines()[0][:100]
        rows.append(row)
    return rows


def main():
    rows = []
    for c, h, v in SHAPES:
        rows += sweep(c, h, v)
        torch.cuda.empty_cache()
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        what = f"{r['kernel']} {r.get('config', '')}"
        if "error" in r:
            print(f"{shape:<18} {what:<44} {r['error']}")
        else:
            print(f"{shape:<18} {what:<44} {r['ms']:7.3f} ms {r['tflops']:5.0f} TFLOP/s")
    print(
        json.dumps(
            {"bench": "tune_lm_head_backward", "gpu": torch.cuda.get_device_name(), "rows": rows}
        )
    )


if __name__ == "__main__":
    main()

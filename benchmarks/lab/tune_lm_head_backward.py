"""Block-size sweep for the backward GEMM kernels (dW accumulation, split-K dH) against cuBLAS.

One chunk of 2048 rows at the issue's shapes, every row with a gradient: times `add_dw_` (dW in
fp32 or, with `--dw-dtype bfloat16`, in bf16 as the fused loss keeps it up to 16 chunks) and `dh`
for each configuration, and cuBLAS's `addmm` / `mm` for the same work. Prints a table, then one
JSON line. The chosen defaults live in `fastgrpo.kernels.train.lm_head_backward._dw_blocks` and
`_dh_blocks`. A dW configuration may end in persistent (one program per SM, one pipelined loop
over tiles) and reduce (the add into dW done by a bulk tensor reduce in L2) flags.
Run on a CUDA GPU:  python -m benchmarks.lab.tune_lm_head_backward [--dw-configs "256,128,64,8,4,1,1"]
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from fastgrpo.kernels.train import lm_head_backward as bwd  # noqa: E402
from fastgrpo.kernels.train.lm_head_chunk_grads import add_matmul_f32_  # noqa: E402

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


def _configs(text):
    return [tuple(int(x) for x in c.split(",")) for c in text.split(";")] if text else []


def sweep(c, h, v, dw_configs, dh_configs, dw_dtype):
    rows = []
    dz = torch.randn(c, v, device="cuda").bfloat16()
    hidden = torch.randn(c, h, device="cuda").bfloat16()
    weight = torch.randn(v, h, device="cuda").bfloat16()
    dw = torch.zeros(v, h, device="cuda", dtype=dw_dtype)
    n = torch.tensor(c, dtype=torch.int32, device="cuda")
    tflop = 2 * c * h * v / 1e12
    want_dh = torch.mm(dz, weight).float()
    # dW is added to a non-zero start, as from the second chunk on (a reduce rounds twice there)
    start_dw = (torch.randn(512, h, device="cuda") * (c**0.5)).to(dw_dtype)
    want_dw = start_dw.float() + (dz.t()[:512].float() @ hidden.float())
    if dw_dtype == torch.float32:
        cublas_dw = ("cuBLAS dW addmm fp32", lambda: add_matmul_f32_(dw, dz.t(), hidden))
    else:
        cublas_dw = ("cuBLAS dW addmm bf16", lambda: torch.addmm(dw, dz.t(), hidden, out=dw))
    for name, fn in (cublas_dw, ("cuBLAS dH mm", lambda: torch.mm(dz, weight))):
        ms = bench(fn)
        rows.append({"shape": [c, h, v], "kernel": name, "ms": ms, "tflops": tflop / ms * 1e3})
    for config in dw_configs:
        bwd._dw_blocks = lambda *_, x=config: x
        row = {"shape": [c, h, v], "kernel": "triton dW", "config": config}
        try:
            first = torch.zeros_like(dw)
            first[:512] = start_dw
            got = bwd.add_dw_(first, dz, hidden, n)[:512].float()
            row["max_rel_err"] = ((got - want_dw).abs().max() / want_dw.abs().max()).item()
            row["ms"] = bench(lambda: bwd.add_dw_(dw, dz, hidden, n))
            row["tflops"] = tflop / row["ms"] * 1e3
        except Exception as error:
            row["error"] = str(error).splitlines()[0][:100]
        rows.append(row)
    for config in dh_configs:
        bwd._dh_blocks = lambda *_, x=config: x[:5]
        bwd._dh_splits = lambda *_, x=config: x[5]
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    parser.add_argument(
        "--dw-configs", help="e.g. 256,128,64,8,4;256,128,64,8,3,1,1 (an empty string for none)"
    )
    parser.add_argument("--dh-configs", help="e.g. 128,256,64,8,3,4 (an empty string for none)")
    parser.add_argument("--dw-dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dw_configs = DW_CONFIGS if args.dw_configs is None else _configs(args.dw_configs)
    dh_configs = DH_CONFIGS if args.dh_configs is None else _configs(args.dh_configs)
    rows = []
    for shape in args.shapes.split(","):
        c, h, v = (int(x) for x in shape.split("x"))
        rows += sweep(c, h, v, dw_configs, dh_configs, getattr(torch, args.dw_dtype))
        torch.cuda.empty_cache()
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        what = f"{r['kernel']} {r.get('config', '')}"
        if "error" in r:
            print(f"{shape:<18} {what:<44} {r['error']}")
        else:
            err = f"  err {r['max_rel_err']:.2e}" if "max_rel_err" in r else ""
            print(f"{shape:<18} {what:<44} {r['ms']:7.3f} ms {r['tflops']:5.0f} TFLOP/s{err}")
    print(
        json.dumps(
            {"bench": "tune_lm_head_backward", "gpu": torch.cuda.get_device_name(), "rows": rows}
        )
    )


if __name__ == "__main__":
    main()

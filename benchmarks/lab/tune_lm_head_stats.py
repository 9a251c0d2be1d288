"""Block-size and vocabulary-split sweep for the LM-head statistics kernel.

For each (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) and number of vocabulary splits, times scoring
(log-prob + entropy) and the fused GRPO loss forward + backward (which runs the same kernel with the
logits store) on the issue's shapes, checks the log-probs against the fp32 reference, and prints a
table, then one JSON line. The chosen defaults live in `fastgrpo.kernels.train.lm_head_stats._blocks`
and `_num_splits`. Run on a CUDA GPU:  python -m benchmarks.lab.tune_lm_head_stats [--shapes 16384x896]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from triton.testing import do_bench

from benchmarks.bench_logprob import fused_loss, make_inputs  # noqa: E402
from fastgrpo.kernels.train import lm_head_stats as ops  # noqa: E402

CONFIGS = [
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 128, 8, 3),
    (256, 128, 64, 8, 3),
    (256, 128, 64, 16, 3),
    (128, 256, 64, 8, 3),
    (128, 256, 64, 16, 3),
    (256, 256, 64, 16, 2),
]


def sweep_shape(n, h, v, *, train, configs, splits_list):
    default_splits = ops._num_splits
    inputs = make_inputs(n, h, v)
    hidden, weight, targets = inputs[0].detach(), inputs[1].detach(), inputs[2]
    want = ops.lm_head_stats_ref(hidden[:512], weight, targets[:512])[0]

    def step():
        inputs[0].grad = inputs[1].grad = None
        fused_loss(*inputs).backward()

    rows = []
    for config, splits in itertools.product(configs, splits_list):
        ops._blocks = lambda *_, c=config: c
        ops._num_splits = default_splits if splits is None else (lambda _v, _b, s=splits: s)
        row = {
            "shape": [n, h, v],
            "config": config,
            "splits": splits or "auto",
        }
        try:
            logp = ops.lm_head_stats_triton(hidden[:512], weight, targets[:512])[0]
            row["logp_err"] = (logp - want).abs().max().item()
            row["score_ms"] = do_bench(
                lambda: ops.lm_head_stats_triton(hidden, weight, targets),
                warmup=10,
                rep=200,
                return_mode="median",
            )
            row["score_tflops"] = 2 * n * h * v / row["score_ms"] / 1e9
            if train:
                row["train_ms"] = do_bench(step, warmup=3, rep=300, return_mode="median")
        except Exception as error:  # a config that does not compile (shared memory)
            row["error"] = str(error).splitlines()[0][:120]
        rows.append(row)
        print(json.dumps(row), flush=True)
    ops._num_splits = default_splits
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16384x896x151936,8192x3584x152064")
    parser.add_argument("--no-train", action="store_true", help="time scoring only")
    parser.add_argument("--configs", help="e.g. 128,128,64,8,3;128,128,128,8,3")
    parser.add_argument("--splits", default="auto,18,66")
    args = parser.parse_args()
    configs = (
        [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";")]
        if args.configs
        else CONFIGS
    )
    splits_list = [None if s == "auto" else int(s) for s in args.splits.split(",")]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    for n, h, v in shapes:
        rows += sweep_shape(
            n,
            h,
            v,
            train=not args.no_train,
            configs=configs,
            splits_list=splits_list,
        )
        torch.cuda.empty_cache()
    print(
        f"{'shape':<20} {'config':<24} {'splits':>6} {'score ms':>9} {'TFLOP/s':>8} {'train ms':>9}"
    )
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        if "error" in r:
            print(f"{shape:<20} {str(r['config']):<24} {r['splits']:>6} {r['error']}")
            continue
        print(
            f"{shape:<20} {str(r['config']):<24} {r['splits']:>6} "
            f"{r['score_ms']:>9.2f} "
            f"{r['score_tflops']:>8.0f} {r.get('train_ms', float('nan')):>9.2f}"
        )
    print(
        json.dumps(
            {"bench": "tune_lm_head_stats", "gpu": torch.cuda.get_device_name(), "rows": rows}
        )
    )


if __name__ == "__main__":
    main()

"""Run the LM-head statistics kernel a few times at one shape and configuration, for `ncu`.

    ncu --kernel-name regex:lm_head_stats --launch-skip 2 --launch-count 1 \
        python -m benchmarks.lab.profile_lm_head_stats --shape 16384x896x151936 --config 128,128,128,8,3
"""

from __future__ import annotations

import argparse

import torch

from fastgrpo.kernels.support import aligned_empty  # noqa: E402
from fastgrpo.kernels.train import lm_head_stats as ops  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="16384x896x151936")
    parser.add_argument("--config", default=None, help="BLOCK_M,BLOCK_N,BLOCK_K,warps,stages")
    parser.add_argument(
        "--store",
        action="store_true",
        help="the training path: also store the relative probabilities (bf16)",
    )
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()
    n, h, v = (int(x) for x in args.shape.split("x"))
    if args.config:
        config = tuple(int(x) for x in args.config.split(","))
        ops._blocks = lambda *_: config
    hidden = torch.randn(n, h, device="cuda").bfloat16()
    weight = (torch.randn(v, h, device="cuda") / h**0.5).bfloat16()
    targets = torch.randint(0, v, (n,), device="cuda")
    probs = aligned_empty(n, v, device="cuda", dtype=torch.bfloat16) if args.store else None
    for _ in range(args.calls):
        if args.store:  # the training path: also stores the relative probabilities
            ops.ChunkStats(hidden, weight, targets, 1.0, probs)
        else:
            ops.lm_head_stats_triton(hidden, weight, targets)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

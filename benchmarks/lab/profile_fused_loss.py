"""Where the fused LM-head loss spends its GPU time: torch.profiler over a few calls, one table of
kernels by total CUDA time. Run on a CUDA GPU:
    python -m benchmarks.lab.profile_fused_loss [--shape 16384x896x151936] [--beta 0.04]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_logprob import SETTINGS, fused_loss, make_inputs  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="16384x896x151936")
    parser.add_argument("--beta", type=float, default=SETTINGS["beta"])
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    n, h, v = (int(x) for x in args.shape.split("x"))
    inputs = make_inputs(n, h, v)
    settings = {**SETTINGS, "beta": args.beta}

    def step():
        inputs[0].grad = inputs[1].grad = None
        fused_loss(*inputs, settings=settings).backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.calls):
            step()
        torch.cuda.synchronize()
    print(f"{args.calls} calls at {args.shape}, beta {args.beta}; times are totals over the calls")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    )


if __name__ == "__main__":
    main()

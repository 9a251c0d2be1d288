"""What a kernel boundary costs inside a CUDA graph: replays of a graph of back-to-back launches of
a kernel that does nothing (each program stores one int), with and without programmatic dependent
launch (PDL), at several grid sizes. Per launch this is the floor under every kernel of a decode
step (~220 per step at workload A of bench_rollout.py). Prints a table, then one JSON line. Run
on a CUDA GPU:
    python benchmarks/bench_graph_launches.py [--launches 220]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_rollout import print_result_line  # noqa: E402

from fastgrpo.kernels import pdl  # noqa: E402


@triton.jit
def _noop_kernel(out_ptr, PDL: tl.constexpr):
    pdl.start(PDL)
    pdl.wait(PDL)
    pid = tl.program_id(0)
    tl.store(out_ptr + pid, pid)


def time_graph(launches: int, grid: int, warps: int, use_pdl: bool, replays: int = 200) -> float:
    """Microseconds per launch of a graph of `launches` back-to-back no-op kernels."""
    out = torch.zeros(max(grid, 1), dtype=torch.int32, device="cuda")
    options = {"PDL": True, "launch_pdl": True} if use_pdl else {"PDL": False}

    def body():
        for _ in range(launches):
            _noop_kernel[(grid,)](out, num_warps=warps, **options)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / replays / launches)
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=220)
    args = parser.parse_args()
    rows = []
    for use_pdl in (False, True):
        for grid, warps in ((1, 4), (132, 4), (304, 4), (528, 8)):
            us = time_graph(args.launches, grid, warps, use_pdl)
            rows.append(dict(pdl=use_pdl, grid=grid, warps=warps, us_per_launch=us))
            print(
                f"PDL {int(use_pdl)}  grid {grid:4d} x {warps} warps  {us:6.2f} us per launch  "
                f"({us * args.launches:7.1f} us for {args.launches})",
                flush=True,
            )
    print_result_line("graph_launches", rows, launches=args.launches)


if __name__ == "__main__":
    main()

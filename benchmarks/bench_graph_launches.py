"""What a kernel boundary costs inside a CUDA graph: replays of a graph of back-to-back launches of
a kernel that does nothing (each program stores one int), with and without programmatic dependent
launch (PDL), at several grid sizes. Per launch this is the floor under every kernel of a decode
step (~220 per step at workload A of bench_rollout.py). Against it, what the same number of
grid-wide barriers costs inside one persistent kernel (one program per multiprocessor), the
boundary a persistent decode-layer kernel would have instead. Prints a table, then one JSON line.
Run on a CUDA GPU:
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


@triton.jit
def _grid_barriers_kernel(count_ptr, generation_ptr, out_ptr, rounds, programs):
    """`rounds` grid-wide barriers: each program reads the generation, arrives on the counter; the
    last to arrive resets the counter and advances the generation, the others spin until it moves.
    The counter is back at 0 at the end, so graph replays stay valid."""
    pid = tl.program_id(0)
    for _ in range(rounds):
        generation = tl.load(generation_ptr, volatile=True)
        tl.debug_barrier()  # every thread's earlier writes before the arrival
        arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == programs - 1:
            tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_add(generation_ptr, 1, sem="release", scope="gpu")
        else:
            while tl.load(generation_ptr, volatile=True) == generation:
                pass
            tl.atomic_add(generation_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
    tl.store(out_ptr + pid, pid)


@triton.jit
def _grid_barriers_counted_kernel(count_ptr, out_ptr, rounds, programs):
    """As `_grid_barriers_kernel` with one atomic per arrival: an int64 counter that only grows
    (no reset, so replays stay valid); barrier b of a program is passed once the counter reaches
    the next multiple of `programs` above the value its arrival returned."""
    pid = tl.program_id(0)
    for _ in range(rounds):
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
        target = (arrived // programs + 1) * programs
        while tl.load(count_ptr, volatile=True) < target:
            pass
        tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
    tl.store(out_ptr + pid, pid)


def time_graph(launches: int, grid: int, warps: int, use_pdl: bool, replays: int = 200) -> float:
    """Microseconds per launch of a graph of `launches` back-to-back no-op kernels; with use_pdl
    None, per barrier of one persistent kernel of `grid` programs passing `launches` barriers (a
    counter and a generation), with "counted" the same with one growing counter."""
    out = torch.zeros(max(grid, 1), dtype=torch.int32, device="cuda")
    options = {"PDL": True, "launch_pdl": True} if use_pdl else {"PDL": False}
    sync = torch.zeros(2, dtype=torch.int32, device="cuda")
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")

    def body():
        if use_pdl is None:
            _grid_barriers_kernel[(grid,)](sync[0:], sync[1:], out, launches, grid, num_warps=warps)
            return
        if use_pdl == "counted":
            _grid_barriers_counted_kernel[(grid,)](counter, out, launches, grid, num_warps=warps)
            return
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
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for use_pdl in (False, True):
        for grid, warps in ((1, 4), (sms, 4), (304, 4), (528, 8)):
            us = time_graph(args.launches, grid, warps, use_pdl)
            rows.append(dict(pdl=use_pdl, grid=grid, warps=warps, us_per_launch=us))
            print(
                f"PDL {int(use_pdl)}  grid {grid:4d} x {warps} warps  {us:6.2f} us per launch  "
                f"({us * args.launches:7.1f} us for {args.launches})",
                flush=True,
            )
    for kind, warps in (("generation", 4), ("generation", 8), ("counted", 4), ("counted", 8)):
        us = time_graph(args.launches, sms, warps, None if kind == "generation" else kind)
        rows.append(dict(persistent=kind, grid=sms, warps=warps, us_per_barrier=us))
        print(
            f"one persistent kernel ({kind:10s}), grid {sms} x {warps} warps: {us:6.2f} us per "
            f"grid barrier ({us * args.launches:7.1f} us for {args.launches})",
            flush=True,
        )
    print_result_line("graph_launches", rows, launches=args.launches)


if __name__ == "__main__":
    main()

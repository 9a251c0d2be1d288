"""What a kernel boundary costs inside a CUDA graph: replays of a graph of back-to-back launches of
a kernel that does nothing (each program stores one int), with and without programmatic dependent
launch (PDL), at several grid sizes. Per launch this is the floor under every kernel of a decode
step (~220 per step at workload A of bench_rollout.py). Against it, what the same number of
grid-wide barriers costs inside one persistent kernel (one program per multiprocessor), the
boundary a persistent decode-layer kernel would have instead. Prints a table, then one JSON line.
Run on a CUDA GPU:
    python -m benchmarks.lab.bench_graph_launches [--launches 220]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmarks.bench_rollout import print_result_line  # noqa: E402
from benchmarks.lab.tune_decode_linear import time_per_call  # noqa: E402
from fastgrpo.kernels.decode import pdl  # noqa: E402

REPLAYS = 200


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=220)
    args = parser.parse_args()
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(max(528, sms), dtype=torch.int32, device="cuda")
    for use_pdl in (False, True):
        options = {"PDL": True, "launch_pdl": True} if use_pdl else {"PDL": False}
        for grid, warps in ((1, 4), (sms, 4), (304, 4), (528, 8)):

            def launch(_, grid=grid, warps=warps, options=options):
                _noop_kernel[(grid,)](out, num_warps=warps, **options)

            us = time_per_call(launch, REPLAYS, calls=args.launches)
            rows.append(dict(pdl=use_pdl, grid=grid, warps=warps, us_per_launch=us))
            print(
                f"PDL {int(use_pdl)}  grid {grid:4d} x {warps} warps  {us:6.2f} us per launch  "
                f"({us * args.launches:7.1f} us for {args.launches})",
                flush=True,
            )
    generation = torch.zeros(2, dtype=torch.int32, device="cuda")  # counter, generation
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    for kind, warps in (("generation", 4), ("generation", 8), ("counted", 4), ("counted", 8)):

        def barriers(_, kind=kind, warps=warps):
            if kind == "generation":
                _grid_barriers_kernel[(sms,)](
                    generation[0:], generation[1:], out, args.launches, sms, num_warps=warps
                )
            else:
                _grid_barriers_counted_kernel[(sms,)](
                    counter, out, args.launches, sms, num_warps=warps
                )

        us = time_per_call(barriers, REPLAYS, calls=1) / args.launches
        rows.append(dict(persistent=kind, grid=sms, warps=warps, us_per_barrier=us))
        print(
            f"one persistent kernel ({kind:10s}), grid {sms} x {warps} warps: {us:6.2f} us per "
            f"grid barrier ({us * args.launches:7.1f} us for {args.launches})",
            flush=True,
        )
    print_result_line("graph_launches", rows, launches=args.launches)


if __name__ == "__main__":
    main()

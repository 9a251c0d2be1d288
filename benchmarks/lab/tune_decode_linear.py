"""The decode step's linears at 64 and 256 rows: the fused kernel (`kernels/decode/decode_linear.py`) at
several block configurations against what it replaces (add_rms_norm + cuBLAS + silu_mul). Both
sides run the add_rms_norm kernel before q/k/v and gate/up, so the difference is the linear (and,
for gate/up, the SiLU * up kernel that the kernel's epilogue replaces). For down_proj and o_proj
also the pair (the product, the norm that reads it) with the product as split-K parts the norm
adds up.

Each op is timed as it runs in a decode step: 24 calls (one per layer, each with its own weights, so
nothing stays in L2 between calls) captured in one CUDA graph, the graph replayed; the time per call
is the replay time over 24. Prints a table, then one JSON line. Run on a CUDA GPU:
    python -m benchmarks.lab.tune_decode_linear [--rows 64 256] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F

from benchmarks.bench_rollout import copy_bandwidth, print_result_line  # noqa: E402
from fastgrpo.kernels.decode import decode_linear  # noqa: E402
from fastgrpo.kernels.layers.rms_norm import add_rms_norm, add_rms_norm_triton  # noqa: E402
from fastgrpo.kernels.layers.swiglu import silu_mul_triton  # noqa: E402

LAYERS = 24
# name: (K, N, norm + residual, bias, swiglu)
OPS = {
    "0.5B qkv": (896, 1152, True, True, False),
    "0.5B o_proj": (896, 896, False, False, False),
    "0.5B gate_up": (896, 4864, True, False, True),
    "0.5B down": (4864, 896, False, False, False),
    "7B qkv": (3584, 4608, True, True, False),
    "7B o_proj": (3584, 3584, False, False, False),
    "7B gate_up": (3584, 18944, True, False, True),
    "7B down": (18944, 3584, False, False, False),
}
CONFIGS = [
    dict(BN=bn, BK=bk, num_warps=w, num_stages=s)
    for bn, bk, (w, s) in itertools.product((16, 32, 64, 128), (64, 128), ((4, 3), (4, 5), (8, 4)))
] + [  # 256-wide k steps: half the k loop's barrier round trips at K = 896 (not yet measured)
    dict(BN=bn, BK=256, num_warps=4, num_stages=s) for bn, s in itertools.product((16, 32), (2, 3))
]


def make_layers(M, K, N, norm, bias, swiglu, warm=False):
    """x, residual and LAYERS weight sets; with `warm` all LAYERS calls share one set, so the
    weight is read from L2 after the first call (what a prefetch ahead can at best give)."""
    rows = 2 * N if swiglu else N
    dev, bf16 = "cuda", torch.bfloat16
    layers = []
    for _ in range(1 if warm else LAYERS):
        layers.append(
            dict(
                weight=torch.randn(rows, K, device=dev, dtype=bf16) * K**-0.5,
                bias=torch.randn(rows, device=dev, dtype=bf16) if bias else None,
                norm_weight=torch.ones(K, device=dev, dtype=bf16) if norm else None,
            )
        )
    x = torch.randn(M, K, device=dev, dtype=bf16)
    residual = torch.randn(M, K, device=dev, dtype=bf16) if norm else None
    return x, residual, layers * LAYERS if warm else layers


def unfused(x, residual, layer, swiglu):
    """What the decode step ran before: add_rms_norm kernel, cuBLAS, silu_mul kernel."""
    h = x
    if layer["norm_weight"] is not None:
        h, _ = add_rms_norm_triton(x, residual, layer["norm_weight"], 1e-6)
    out = F.linear(h, layer["weight"], layer["bias"])
    if swiglu:
        gate, up = out.chunk(2, dim=-1)
        out = silu_mul_triton(gate, up)
    return out


def kernel(x, residual, layer, swiglu, config):
    """The packed decode path with the Triton linear: add_rms_norm kernel, then the kernel."""
    h = x
    if layer["norm_weight"] is not None:
        h, _ = add_rms_norm_triton(x, residual, layer["norm_weight"], 1e-6)
    return decode_linear.linear_triton(h, layer["weight"], layer["bias"], swiglu, config)


def time_per_call(step, replays=50, calls=LAYERS) -> float:
    """Microseconds per call of `step(i)`, calls i = 0 .. calls - 1 captured in one CUDA graph
    (24 by default, one per layer), the graph replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):  # warm-up: compile and autotune outside the capture
            step(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            step(i)
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
        times.append(start.elapsed_time(end) * 1000 / replays / calls)
    return sorted(times)[len(times) // 2]


def measure_op(name: str, M: int, quick: bool, bandwidth: float, warm: bool = False) -> dict:
    K, N, norm, bias, swiglu = OPS[name]
    x, residual, layers = make_layers(M, K, N, norm, bias, swiglu, warm)
    floor_us = layers[0]["weight"].numel() * 2 / bandwidth * 1e6
    row = dict(op=name, rows=M, floor_us=floor_us, warm=warm)
    row["unfused_us"] = time_per_call(lambda i: unfused(x, residual, layers[i], swiglu))

    def run(config):
        return time_per_call(lambda i: kernel(x, residual, layers[i], swiglu, config))

    row["kernel_us"] = run(None)
    if name.endswith(("down", "o_proj")):
        # the product and the residual add + norm that reads it (the next layer's, for down_proj;
        # the post-attention one, for o_proj): cuBLAS or the kernel, against split-K parts that
        # the norm adds up
        norm_weight = torch.ones(N, device="cuda", dtype=torch.bfloat16)
        stream = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)

        def cublas_then_norm(i):
            out = F.linear(x, layers[i]["weight"])
            return add_rms_norm(out, stream, norm_weight, 1e-6)

        def kernel_then_norm(i):
            out = decode_linear.linear_triton(x, layers[i]["weight"], None)
            return add_rms_norm(out, stream, norm_weight, 1e-6)

        def split_then_norm(i):
            sums = decode_linear.linear_split_sums(x, layers[i]["weight"])
            return add_rms_norm(sums, stream, norm_weight, 1e-6)

        row["cublas_then_norm_us"] = time_per_call(cublas_then_norm)
        row["kernel_then_norm_us"] = time_per_call(kernel_then_norm)
        row["split_sums_then_norm_us"] = time_per_call(split_then_norm)
        row["split_k"] = decode_linear.split_k_config(M, N, K)
        split_sweep = []
        k_splits = (256, 512, 1024) if K > 1024 else (128, 256, 384, 512)
        for bn, k_split, stages in itertools.product((16, 32, 64, 128), k_splits, (3, 5)):
            config = dict(BN=bn, BK=128, k_per_split=k_split, num_stages=stages)

            def split_config_then_norm(i, config=config):
                sums = decode_linear.linear_split_sums(x, layers[i]["weight"], config)
                return add_rms_norm(sums, stream, norm_weight, 1e-6)

            try:
                us = time_per_call(split_config_then_norm)
            except Exception as error:  # out of shared memory: skip it
                print(f"  {config}: {type(error).__name__}", file=sys.stderr)
                continue
            split_sweep.append(dict(config=config, us=us))
        if split_sweep and not quick:
            best = min(split_sweep, key=lambda s: s["us"])
            row["split_best"], row["split_best_us"] = best["config"], best["us"]
            row["split_sweep"] = split_sweep
    row["default"] = decode_linear.pick_config(M, N, K, swiglu)
    row["taken"] = decode_linear.takes(x, layers[0]["weight"], layers[0]["bias"])
    sweep = []
    for config in [] if quick else CONFIGS:
        try:
            sweep.append(dict(config=config, us=run(config)))
        except Exception as error:  # out of shared memory or registers: skip it
            print(f"  {config}: {type(error).__name__}", file=sys.stderr)
    if sweep:
        best = min(sweep, key=lambda s: s["us"])
        row["best"], row["best_us"], row["sweep"] = best["config"], best["us"], sweep
    return row


def gate_up_grid(bandwidth: float) -> dict:
    """0.5B gate/up at 64 rows: (1) rows per program (BM) and warps, which CONFIGS leave at 64
    and 4, and (2) the same kernel at widths giving 132, 152 and 264 programs of 32 columns, to see
    whether 152 programs on 132 multiprocessors lose time to the second, partial wave."""
    x, residual, layers = make_layers(64, 896, 4864, True, False, True)
    sweep = []
    for bm, bn, bk, w, s in itertools.product(
        (16, 32, 64), (16, 32, 64), (64, 128), (2, 4), (4, 6)
    ):
        config = dict(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=s)
        try:
            us = time_per_call(lambda i, c=config: kernel(x, residual, layers[i], True, c))
        except Exception as error:  # out of shared memory or registers: skip it
            print(f"  {config}: {type(error).__name__}", file=sys.stderr)
            continue
        sweep.append(dict(config=config, us=us))
    best = min(sweep, key=lambda r: r["us"])
    widths = []
    for n in (4224, 4864, 8448):  # 132, 152 and 264 programs of 32 columns
        x, _, layers = make_layers(64, 896, n, False, False, True)
        us = time_per_call(lambda i, x=x, layers=layers: kernel(x, None, layers[i], True, None))
        nbytes = layers[0]["weight"].numel() * 2
        widths.append(dict(N=n, us=us, tb_s=nbytes / us / 1e6, floor_us=nbytes / bandwidth * 1e6))
        print(f"  gate/up width {n}: {us:6.2f} us, {nbytes / us / 1e6:5.2f} TB/s", flush=True)
    print(f"gate_up grid sweep: best {best['us']:6.2f} us {best['config']}", flush=True)
    return dict(op="0.5B gate_up grid", rows=64, best=best, sweep=sweep, widths=widths)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--quick", action="store_true", help="default configuration only")
    parser.add_argument("--ops", nargs="+", default=list(OPS), help="names from OPS")
    parser.add_argument("--gate-up-grid", action="store_true", help="only gate_up_grid()")
    parser.add_argument(
        "--warm", action="store_true", help="one weight set for all calls: read from L2"
    )
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    results = []
    if args.gate_up_grid:
        results.append(gate_up_grid(bandwidth))
        args.ops = []
    for name in args.ops:
        for M in args.rows:
            row = measure_op(name, M, args.quick, bandwidth, args.warm)
            results.append(row)
            best = f"{row['best_us']:7.2f} {row['best']}" if "best" in row else ""
            taken = "taken" if row["taken"] else "cuBLAS kept"
            split = (
                f"  + norm: cuBLAS {row['cublas_then_norm_us']:6.2f}, kernel "
                f"{row['kernel_then_norm_us']:6.2f}, split-K parts "
                f"{row['split_sums_then_norm_us']:6.2f}"
                if "split_k" in row
                else ""
            )
            if "split_best" in row:
                split += f" (best split {row['split_best_us']:6.2f} {row['split_best']})"
            print(
                f"{name:<13} M={M:<4} floor {row['floor_us']:6.2f} us  cuBLAS path "
                f"{row['unfused_us']:7.2f}  kernel {row['kernel_us']:7.2f} ({taken}){split}  "
                f"best {best}",
                flush=True,
            )
            torch.cuda.empty_cache()
    print_result_line("tune_decode_linear", results, copy_bandwidth_tb_s=bandwidth / 1e12)


if __name__ == "__main__":
    main()

"""Where a GRPO step's time goes, per phase: wall time, GPU busy time, kernels and launches.

Runs bench_step's workload (0.5B shape, 8 x 8 completions of 256 forced tokens, beta 0.04) for a
few warm-up steps, then records one step with torch.profiler and reads its Chrome trace:

- per phase (the trainer's `grpo/<phase>` ranges): wall ms, GPU busy ms (the union of the kernel
  intervals inside the range), the number of kernels, and the CPU time spent in CUDA launch calls.
  A phase whose GPU busy time is far below its wall time is host-bound: the GPU waits for Python
  and the launch path, not for arithmetic;
- the kernels of the update phase that take the most GPU time.

On a CUDA GPU:  python -m benchmarks.lab.profile_step [--micro-batch-tokens N] [--top 25]
Smoke test on CPU:  python -m benchmarks.lab.profile_step --tiny --device cpu --warmup 0
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import re
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.bench_step import PHASES, synthetic_trainer  # noqa: E402
from fastgrpo.config import TrainConfig  # noqa: E402
from fastgrpo.train import profiling  # noqa: E402
from fastgrpo.train.step import grpo_step  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def idle_gaps(events: list[dict], start: float, end: float, least_us: float = 200.0) -> list:
    """The GPU's idle gaps inside [start, end) of at least `least_us`, longest first: each with the
    kernel that ended the wait and the project's Python functions on the host stack when that
    kernel was launched (the host work the GPU waited for; needs a trace recorded with_stack)."""
    kernels = sorted(
        (e for e in events if e.get("cat") == "kernel" and start <= e["ts"] < end),
        key=lambda e: e["ts"],
    )
    launches = {
        e["args"].get("correlation"): e
        for e in events
        if e.get("cat") == "cuda_runtime" and start <= e["ts"] < end
    }
    python = [e for e in events if e.get("cat") == "python_function" and "fastgrpo" in e["name"]]
    gaps, reach = [], start
    for k in kernels:
        if k["ts"] - reach >= least_us:
            launch = launches.get(k["args"].get("correlation"))
            at = launch["ts"] if launch else k["ts"]
            stack = sorted(
                (p for p in python if p["ts"] <= at < p["ts"] + p["dur"]), key=lambda p: p["ts"]
            )
            where = " > ".join(re.sub(r".*fastgrpo/", "", p["name"]) for p in stack[-3:])
            gaps.append(((k["ts"] - reach) / 1e3, k["name"][:50], where or "-"))
        reach = max(reach, k["ts"] + k["dur"])
    if end - reach >= least_us:
        gaps.append(((end - reach) / 1e3, "(phase end)", "-"))
    return sorted(gaps, reverse=True)


def summarize(trace: dict, top: int) -> dict:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ranges = {
        e["name"].removeprefix("grpo/"): (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].removeprefix("grpo/") in PHASES
    }
    kernels = [e for e in events if e.get("cat") == "kernel"]
    launches = [e for e in events if e.get("cat") == "cuda_runtime" and e["name"] in LAUNCHES]
    phases = {}
    for name, (start, end) in ranges.items():
        inside = [(k["ts"], k["ts"] + k["dur"]) for k in kernels if start <= k["ts"] < end]
        calls = [c["dur"] for c in launches if start <= c["ts"] < end]
        phases[name] = {
            "wall_ms": (end - start) / 1e3,
            "gpu_busy_ms": busy_time(inside) / 1e3,
            "kernels": len(inside),
            "launch_cpu_ms": sum(calls) / 1e3,
        }
    start, end = ranges.get("update", (0, 0))
    by_name: dict[str, list[float]] = defaultdict(list)
    for k in kernels:
        if start <= k["ts"] < end:
            by_name[k["name"]].append(k["dur"])
    heaviest = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    return {
        "phases": phases,
        "update_gaps": idle_gaps(events, start, end),
        "update_kernels": [
            {"name": name[:110], "count": len(d), "total_ms": sum(d) / 1e3} for name, d in heaviest
        ],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("0.5B", "1.5B"), default="0.5B")
    parser.add_argument("--micro-batch-tokens", type=int, default=TrainConfig.micro_batch_tokens)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=25, help="update kernels listed")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--cuda-graphs", choices=("auto", "off"), default="auto", help="train.cuda_graphs"
    )
    parser.add_argument(
        "--cprofile", type=int, default=0, help="also run a step under cProfile; rows to print"
    )
    parser.add_argument(
        "--gaps", type=int, default=0, help="list the update's N longest GPU idle gaps"
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model shape (CPU smoke test)")
    parser.add_argument(
        "--lora", type=int, default=0, metavar="R", help="LoRA rank R on all linears"
    )
    args = parser.parse_args()
    profiling.SYNCHRONIZE_PHASES = True  # kernels are attributed to phases by time
    if args.tiny:
        args.shape = "tiny"
    args.prompts, args.samples, args.prompt_len, args.completion_len = 8, 8, 128, 256
    args.steps = 1
    device = torch.device(args.device)
    config, trainer, examples = synthetic_trainer(args, device, lora_rank=args.lora)
    torch.manual_seed(0)
    for _ in range(args.warmup):
        grpo_step(config, trainer, examples)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        torch.cuda.synchronize()
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, with_stack=args.gaps > 0) as profiler:
        record = grpo_step(config, trainer, examples)
        if device.type == "cuda":
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(path))
        result = summarize(json.loads(path.read_text()), args.top)
    print(
        f"shape {args.shape}, micro_batch_tokens {args.micro_batch_tokens}, beta {args.beta}, "
        f"LoRA rank {args.lora or '-'}"
    )
    print(f"{'phase':<14} {'wall ms':>9} {'GPU busy':>9} {'kernels':>8} {'launch CPU ms':>14}")
    for name, p in result["phases"].items():
        print(
            f"{name:<14} {p['wall_ms']:>9.1f} {p['gpu_busy_ms']:>9.1f} {p['kernels']:>8} "
            f"{p['launch_cpu_ms']:>14.1f}"
        )
    print(f"\nupdate phase, heaviest kernels ({args.top}):")
    for k in result["update_kernels"]:
        print(f"{k['total_ms']:>9.2f} ms {k['count']:>6}x  {k['name']}")
    if args.gaps:
        gaps = result["update_gaps"]
        print(
            f"\nupdate phase, GPU idle: {sum(g[0] for g in gaps):.1f} ms in {len(gaps)} gaps "
            f"of >= 0.2 ms; the {args.gaps} longest (ms, next kernel, host stack at its launch):"
        )
        for ms, kernel, where in gaps[: args.gaps]:
            print(f"{ms:>8.2f}  {kernel:<50}  {where}")
    print("\nwhole step, CPU ops by self CPU time:")
    print(
        profiler.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60
        )
    )
    if args.cprofile:  # Python's view of the host time: which functions issue the launches
        host = cProfile.Profile()
        host.enable()
        grpo_step(config, trainer, examples)
        if device.type == "cuda":
            torch.cuda.synchronize()
        host.disable()
        for order in ("tottime", "cumtime"):
            text = io.StringIO()
            pstats.Stats(host, stream=text).sort_stats(order).print_stats(args.cprofile)
            print(f"===== one step under cProfile, by {order}")
            print(text.getvalue())
    timing = {key: value for key, value in record.items() if key.startswith("time/")}
    result.pop("update_gaps")
    print(json.dumps({"micro_batch_tokens": args.micro_batch_tokens, **result, **timing}))


if __name__ == "__main__":
    main()

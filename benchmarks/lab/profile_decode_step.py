"""Kernel-level profile of the engine's decode steps.

0.5B shape, random bf16 weights, prompt 128, 33 new tokens (--new-tokens), 64 rows (64 prompts x
1 sample, or e.g. 8 x 8 with --prompts 8 --samples 8). Default: eager steps (no CUDA graph, so
each kernel runs alone) and the top CUDA kernels. With --graph: the steps replayed from the
captured graph, as a rollout runs them, and per kernel its count and mean duration inside the
replay (with programmatic dependent launch a kernel starts before the previous one ends, so
durations overlap) and its "frontier" time (how far its end moves past the ends of all kernels
before it: its share of the step when kernels form a chain) and the idle time just before it
starts (no kernel running), the decode step's span and how much of it no kernel covers.
Run on a CUDA GPU:
    python -m benchmarks.lab.profile_decode_step [--prompts P --samples G] [--graph] [--new-tokens T]
"""

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_rollout import PARAMS, native_model, prompts_of  # noqa: E402
from fastgrpo.rollout.engine import RolloutEngine  # noqa: E402

NEW_TOKENS = 33


def around_boundaries(window, step_start: int, step_len: int, width: int = 6) -> str:
    """Start, duration and idle time before each kernel around the step that starts at index
    `step_start` of the window: its first kernels, and the kernels on both sides of every kernel
    that is neither a decode linear, an attention nor a norm (the LM head, the sampler, torch's)."""
    steps_kernels = window[step_start - width : step_start + step_len + width]
    t0 = window[step_start].time_range.start
    routine = ("_decode_linear_kernel", "_decode_attention_kernel", "_add_rms_norm_kernel")
    show = set(range(width * 2))
    for i, e in enumerate(steps_kernels):
        if e.name not in routine:
            show |= {i - 2, i - 1, i, i + 1, i + 2}
    lines = [f"{'timeline of one step':<60} {'start us':>9} {'dur us':>8} {'idle before':>11}"]
    reach = steps_kernels[0].time_range.start
    last = -1
    for i, e in enumerate(steps_kernels):
        if i in show:
            if last >= 0 and i != last + 1:
                lines.append("  ...")
            idle = max(0.0, e.time_range.start - reach)
            lines.append(
                f"  {e.name[:58]:<58} {e.time_range.start - t0:9.1f} "
                f"{e.time_range.elapsed_us():8.2f} {idle:11.1f}"
            )
            last = i
        reach = max(reach, e.time_range.end)
    return "\n".join(lines)


def replay_table(prof, steps: int, timeline: bool = False) -> str:
    """Per kernel name: launches per step and mean duration; then the step's span and idle share.
    The span runs from the first to the last kernel of the decode steps (the prefill's kernels,
    before the first replayed step, are left out by taking the last `steps` x per-step kernels)."""
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    if not kernels:
        return "no CUDA kernels recorded"
    # each decode step ends with its bookkeeping kernel (after the sampler); the decode steps are
    # the kernels after the prefill's
    ends = [i for i, e in enumerate(kernels) if e.name == "_record_step_kernel"]
    if len(ends) < steps + 1:
        return f"found {len(ends)} step-end kernels for {steps} steps: cannot split steps"
    first, last = ends[-steps - 1] + 1, ends[-1]
    window = kernels[first : last + 1]
    per_name = defaultdict(list)
    # each kernel's "frontier" share: how far it moves the latest end of all kernels so far, in
    # start order. In a chain of dependent kernels that is its share of the step's time; the
    # shares add up to the time some kernel is running.
    frontier = defaultdict(float)
    idle_before = defaultdict(float)  # time no kernel ran just before this kernel started
    covered, reach = 0.0, window[0].time_range.start
    for e in window:
        per_name[e.name].append(e.time_range.elapsed_us())
        idle_before[e.name] += max(0.0, e.time_range.start - reach)
        start, end = max(e.time_range.start, reach), e.time_range.end
        if end > start:
            covered += end - start
            frontier[e.name] += end - start
        reach = max(reach, end)
    head = f"{'kernel':<60} {'per step':>8} {'mean us':>8} {'us/step':>8} {'frontier':>8}"
    lines = [head + f" {'idle before':>11}"]
    rows = sorted(per_name.items(), key=lambda kv: -frontier[kv[0]])
    for name, durations in rows:
        total = sum(durations) / steps
        lines.append(
            f"{name[:60]:<60} {len(durations) / steps:8.1f} "
            f"{sum(durations) / len(durations):8.2f} {total:8.1f} {frontier[name] / steps:8.1f}"
            f" {idle_before[name] / steps:11.1f}"
        )
    if timeline:
        step_len = len(window) // steps
        lines.append(around_boundaries(window, step_len * (steps // 2), step_len))
    span = window[-1].time_range.end - window[0].time_range.start
    lines.append(
        f"{len(window) / steps:.1f} kernels per step; step span {span / steps:.1f} us; "
        f"no kernel running {100 * (1 - covered / span):.1f}% of it"
    )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--graph", action="store_true", help="profile the graph replay")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="tokens per row")
    parser.add_argument(
        "--timeline", action="store_true", help="with --graph: the kernels of one step in order"
    )
    args = parser.parse_args()
    model = native_model("0.5B")
    prompts = prompts_of(args.prompts, 128, model.config.vocab_size)
    never = model.config.vocab_size
    engine = RolloutEngine(model, stop_ids=[never], pad_id=0, cuda_graphs=args.graph)

    def run(new_tokens):
        engine.generate(
            prompts, num_samples=args.samples, max_new_tokens=new_tokens, params=PARAMS, seed=1
        )
        torch.cuda.synchronize()

    run(args.new_tokens)  # compiles, and captures the graph of this wave shape
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(args.new_tokens)
    if args.graph:
        print(
            replay_table(prof, args.new_tokens - 2, args.timeline)
        )  # the replayed steps, less one at the edge
        return
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=25, max_name_column_width=70
    )
    print(table)


if __name__ == "__main__":
    main()

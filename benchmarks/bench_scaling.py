"""Data-parallel scaling of the whole GRPO step: 1, 2, 4, ... processes (GPUs) of one machine.

Weak scaling (the default): every process holds `--prompts-per-gpu` prompts x `--samples`
completions, so the global batch grows with the processes; the figure of merit is completion
tokens per second of the whole job (ideal: N times one process's). Strong scaling (`--strong`):
one global batch of `--prompts` prompts, split over the processes; ideal: s/step falls N-fold.

The workload is bench_step.py's (0.5B shape by default, random bf16 weights, prompt 128, every
completion forced to `--completion-len` tokens, beta 0.04, one optimizer step per rollout, a
hashed reward so that every row trains), and what is timed is `grpo_step` of a Trainer made by
`build_trainer` with the job's `World`, as `fastgrpo train --nproc N` runs it. Each process count
is one torchrun job (`--worker`), whose rank 0 prints its row.

    python -m benchmarks.bench_scaling                   # 1, 2, 4 ... up to the visible GPUs
    python -m benchmarks.bench_scaling --strong --prompts 32
    python -m benchmarks.bench_scaling --shape 7B --parallel sharded --beta 0 --gradient-checkpointing --counts 4
    python -m benchmarks.bench_scaling --tiny --device cpu --counts 1 2 --steps 1 --warmup 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.bench_rollout import SHAPES, print_result_line
from benchmarks.bench_step import (
    PHASES,
    fastgrpo_trainer,
    random_prompts,
    synchronize,
    synthetic_tokenizer,
)
from fastgrpo.config import TrainConfig
from fastgrpo.distributed.world import end_rank_process
from fastgrpo.train.step import grpo_step


def worker(args) -> None:
    """One torchrun job: time the step of this many processes; rank 0 prints a JSON row."""
    from fastgrpo.distributed import join_torchrun

    world = join_torchrun("cuda" if args.device == "cuda" else "cpu")
    device = torch.device(f"cuda:{world.local_rank}" if args.device == "cuda" else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    total = args.prompts if args.strong else args.prompts_per_gpu * world.size
    vocab = SHAPES[args.shape]["vocab_size"]
    tokenizer = synthetic_tokenizer(vocab)
    prompts = random_prompts(total, args.prompt_len, vocab, tokenizer)  # the same on every rank
    args.prompts = total
    # one process runs as `fastgrpo train` does: build_trainer keeps no World of size 1
    config, trainer, examples = fastgrpo_trainer(args, device, dtype, tokenizer, prompts, world)
    seconds, records = [], []
    for _ in range(args.warmup + args.steps):
        synchronize(device)
        if world.size > 1:
            world.barrier()
        start = time.perf_counter()
        records.append(grpo_step(config, trainer, examples))
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    timed, median = records[args.warmup :], statistics.median(seconds[args.warmup :])
    tokens = statistics.median(r["completion/mean_length"] for r in timed) * total * args.samples
    row = {
        "processes": world.size,
        "prompts": total,
        "seconds_per_step": median,
        "completion_tokens_per_s": tokens / median,
        "peak_memory_gib": max(r["peak_memory_gib"] for r in timed),  # the largest rank's
        "phases": {
            p: statistics.median(r[f"time/{p}"] for r in timed)
            for p in (*PHASES, "weight_gather")
            if f"time/{p}" in timed[0]
        },
        "parallel": trainer.parallel + (", engine copy freed" if args.free_engine_copy else ""),
    }
    if world.is_main:
        print("ROW " + json.dumps(row), flush=True)
    world.leave()
    end_rank_process(0)  # as a training rank ends: gloo's threads can abort the teardown


WORKER_OPTIONS = ("shape", "prompts_per_gpu", "prompts", "samples", "prompt_len",
                  "completion_len", "beta", "micro_batch_tokens", "master_weights", "steps",
                  "warmup", "device", "parallel")  # fmt: skip


def error_tail(stderr: str, lines: int = 60) -> str:
    """What a failed torchrun job said: its ranks' own lines (tracebacks are tagged `[rankN]:`)
    when there are any, else the end of its stderr; long enough to hold a whole traceback."""
    ranks = [line for line in stderr.splitlines() if line.startswith("[rank")]
    return "\n".join((ranks or stderr.splitlines())[-lines:])


def run_job(args, processes: int) -> dict:
    """One torchrun job of `processes` workers; rank 0's row."""
    argv = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in WORKER_OPTIONS]
    argv += ["--strong"] * args.strong + ["--gradient-checkpointing"] * args.gradient_checkpointing
    argv += ["--free-engine-copy"] * args.free_engine_copy
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={processes}", "-m", "benchmarks.bench_scaling", "--worker", *argv]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)  # join_torchrun: no NVLS
    rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if done.returncode or not rows:
        sys.exit(f"{processes} processes failed:\n" + error_tail(done.stderr))
    return json.loads(rows[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("0.5B", "1.5B", "7B", "tiny"), default="0.5B")
    parser.add_argument(
        "--parallel",
        choices=("auto", "replicated", "sharded", "fsdp"),
        default="auto",
        help="train.parallel: the optimizer state replicated or sharded, or FSDP (weights too)",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each layer in the backward pass (the 7B shape needs it)",
    )
    parser.add_argument(
        "--free-engine-copy",
        action="store_true",
        help="train.fsdp_free_engine_copy: with fsdp, the update uses the engine copy's memory",
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model shape (CPU smoke test)")
    parser.add_argument("--strong", action="store_true", help="one global batch split N ways")
    parser.add_argument("--prompts-per-gpu", type=int, default=8, help="weak scaling")
    parser.add_argument("--prompts", type=int, default=32, help="strong scaling: the global batch")
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--completion-len", type=int, default=256, help="forced length")
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--micro-batch-tokens", type=int, default=TrainConfig.micro_batch_tokens)
    parser.add_argument("--master-weights", choices=("auto", "fp32", "off"), default="auto")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--counts", type=int, nargs="+", help="process counts (default 1, 2, 4..)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.shape = "tiny"
    if args.worker:
        return worker(args)
    visible = torch.cuda.device_count() if args.device == "cuda" else 2
    counts = args.counts or [n for n in (1, 2, 4, 8) if n <= visible]
    rows = [run_job(args, n) for n in counts]
    base = rows[0]
    print(f"{'processes':>9} {'prompts':>7} {'s/step':>7} {'tok/s':>9} {'x 1':>6} {'peak GiB':>8} "
          f"{'gather s':>8}  parallel")  # fmt: skip
    for row in rows:
        speedup = row["completion_tokens_per_s"] / base["completion_tokens_per_s"]
        row["speedup"] = (
            speedup if not args.strong else base["seconds_per_step"] / row["seconds_per_step"]
        )
        print(f"{row['processes']:>9} {row['prompts']:>7} {row['seconds_per_step']:>7.3f} "
              f"{row['completion_tokens_per_s']:>9,.0f} {row['speedup']:>6.2f} "
              f"{row['peak_memory_gib']:>8.2f} {row['phases'].get('weight_gather', 0):>8.3f}  "
              f"{row['parallel'].split(':')[-1].split(',')[0].strip() or 'one process'}")  # fmt: skip
    workload = {k: getattr(args, k) for k in ("shape", "strong", "prompts_per_gpu", "prompts",
                                              "samples", "prompt_len", "completion_len", "beta",
                                              "parallel", "gradient_checkpointing",
                                              "micro_batch_tokens")}  # fmt: skip
    print_result_line("scaling", rows, device=args.device if args.device == "cpu" else None,
                      workload=workload)  # fmt: skip


if __name__ == "__main__":
    main()

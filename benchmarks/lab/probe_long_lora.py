"""Whether a LoRA run trains completions of a given length at 64 completions per step on one GPU:
the step's peak memory measured (beside `fastgrpo check`'s prediction), and its update's time.

A whole step at the 7B shape's longest completion (32,640 new tokens after a 128-token prompt,
the context of 32,768) is 64 x 32,640 decode steps and 64 micro-batches of 32,768 tokens, more
than a device call's ten minutes. What sets the peak is not how many completions train but what is
held while one of them does, so the probe runs the real pieces in two parts:

1. the rollout of the step's 64 rows (8 prompts x 8) at max_new_tokens, cut short at the engine's
   first look (`cut_rollouts_short`, what a stop signal uses): the engine allocates its KV cache
   for every wave of the step and keeps it between steps, as in training;
2. a GRPO step (reference scoring, update, optimizer step) on `--rows` completions of exactly that
   length (random tokens: the rollout phase is replaced), with the engine's buffers still held.
   Each micro-batch holds one completion (it is longer than train.micro_batch_tokens), so the
   peak is that of the step with 64; the update's time per completion, times 64, is its update's.

On a CUDA GPU:  python -m benchmarks.lab.probe_long_lora [--shape 7B] [--completion-len 32640]
  [--lora-rollout both]
Smoke test on CPU:  python -m benchmarks.lab.probe_long_lora --tiny --device cpu
  --completion-len 64
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch

from benchmarks.bench_rollout import SHAPES, print_result_line
from benchmarks.bench_step import (
    fastgrpo_trainer,
    memory_baseline,
    random_prompts,
    synchronize,
    synthetic_tokenizer,
)
from fastgrpo.data import Example
from fastgrpo.rollout.engine import cut_rollouts_short
from fastgrpo.rollout.types import Rollout
from fastgrpo.train import step as step_module
from fastgrpo.train.memory_estimate import estimate_memory
from fastgrpo.train.step import grpo_step, sample_completions


def full_length_rollout(rows: int, prompt_len: int, length: int, vocab: int, stop_ids, device):
    """`rows` completions of exactly `length` random tokens (none a stop token), cut at the limit,
    after one random prompt of `prompt_len` tokens."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, vocab, (1, prompt_len), generator=g).expand(rows, -1)
    completion = torch.randint(1, vocab, (rows, length), generator=g)
    for stop in stop_ids:  # replace stop tokens by another id
        completion[completion == stop] = 1
    return Rollout(
        prompt.contiguous().to(device),
        torch.ones(rows, prompt_len, dtype=torch.int64, device=device),
        completion.to(device),
        torch.ones(rows, length, dtype=torch.float32, device=device),
        torch.zeros(rows, dtype=torch.bool, device=device),
    )


def probe(args, merge: bool, device, dtype) -> dict:
    vocab = SHAPES[args.shape]["vocab_size"]
    tokenizer = synthetic_tokenizer(vocab)
    prompts = random_prompts(args.prompts, args.prompt_len, vocab, tokenizer)
    baseline = memory_baseline(device)
    config, trainer, examples = fastgrpo_trainer(
        args, device, dtype, tokenizer, prompts, lora_rank=args.lora, lora_merge=merge
    )
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    estimate = estimate_memory(config, trainer.model, args.prompt_len, device_bytes=total or None)
    # 1. the step's rollout buffers, allocated and kept: a rollout cut short at its first look
    synchronize(device)
    before = torch.cuda.memory_allocated(device) if total else 0
    start = time.perf_counter()
    cut_rollouts_short(True)
    try:
        sample_completions(config, trainer.rollout_model, tokenizer, trainer.stop_ids, examples)
    finally:
        cut_rollouts_short(False)
    synchronize(device)
    allocate_s = time.perf_counter() - start
    engine_bytes = (torch.cuda.memory_allocated(device) - before) if total else 0
    # 2. a step on full-length completions, the buffers still held
    config.rollout.num_generations = args.rows
    rollout = full_length_rollout(
        args.rows, args.prompt_len, args.completion_len, vocab, trainer.stop_ids, device
    )
    one = [Example(prompt=prompts[0], answer="0")]
    with mock.patch.object(step_module, "sample_completions", lambda *a, **k: rollout):
        record = grpo_step(config, trainer, one)
    peak = record.get("peak_memory_gib")
    row = {
        "rollout": "merged" if merge else "adapters",
        "completion_len": args.completion_len,
        "peak_gib": None if peak is None else peak - baseline / 2**30,
        "predicted_peak_gib": estimate.peak / 2**30,
        "predicted_parts_gib": {k: v / 2**30 for k, v in estimate.parts.items()},
        "engine_buffers_gib": engine_bytes / 2**30,  # measured: KV cache, decode state, graphs
        "rollout_waves": estimate.waves,
        "allocate_seconds": allocate_s,
        "rows_trained": args.rows,
        "reference_s_per_completion": record["time/reference"] / args.rows,
        "update_s_per_completion": record["time/update"] / args.rows,
        "optimizer_s": record["time/optimizer"],
    }
    row["update_of_64_s"] = 64 * (
        row["reference_s_per_completion"] + row["update_s_per_completion"]
    )
    del trainer
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("0.5B", "1.5B", "7B"), default="7B")
    parser.add_argument("--tiny", action="store_true", help="a tiny model shape (CPU smoke test)")
    parser.add_argument("--completion-len", type=int, default=32640)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rows", type=int, default=2, help="full-length completions trained")
    parser.add_argument("--lora", type=int, default=16, metavar="R")
    parser.add_argument("--lora-rollout", choices=("merged", "adapters", "both"), default="both")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.tiny:
        args.shape = "tiny"
    # bench_step's workload: 8 prompts x 8 completions, beta 0.04, checkpointing
    args.prompts, args.samples, args.beta = 8, 8, 0.04
    args.warmup, args.steps, args.gradient_checkpointing = 0, 1, True
    args.micro_batch_tokens, args.master_weights = 12288, "auto"
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    merges = {"merged": [True], "adapters": [False], "both": [True, False]}[args.lora_rollout]
    rows = [probe(args, merge, device, dtype) for merge in merges]
    print(
        f"{'engine':<9} {'peak GiB':>9} {'predicted':>9} {'KV GiB':>7} {'predicted':>9} "
        f"{'waves':>6} {'s/completion':>13}"
    )
    for r in rows:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        per = r["reference_s_per_completion"] + r["update_s_per_completion"]
        print(
            f"{r['rollout']:<9} {peak:>9} {r['predicted_peak_gib']:>9.2f} "
            f"{r['engine_buffers_gib']:>7.2f} {r['predicted_parts_gib']['kv cache']:>9.2f} "
            f"{r['rollout_waves']:>6} {per:>13.2f}"
        )
    workload = {"shape": args.shape, "prompts": 8, "samples": 8, "prompt_len": args.prompt_len}
    print_result_line("probe_long_lora", rows, device=device, workload=workload)


if __name__ == "__main__":
    main()

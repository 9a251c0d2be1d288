"""`fastgrpo check`'s memory prediction against measured peaks, on a CUDA GPU.

For each workload (bench_step.py's: random weights of a real shape, forced completion lengths,
every row trained), it trains `--warmup` steps and then one more, and puts the peak GPU memory of
that last step (torch.cuda.max_memory_allocated, as `peak_memory_gib` in metrics.jsonl) beside
`train.memory_estimate.estimate_memory` for the same config and model. The issue's bar: within
15%. Prints a table, then one JSON line.

Run on a CUDA GPU:  python -m benchmarks.bench_memory [--cases NAME ...]
"""

from __future__ import annotations

import argparse
import gc

import torch

from benchmarks.bench_rollout import SHAPES, print_result_line
from benchmarks.bench_step import random_prompts, run_fastgrpo, synthetic_tokenizer

BASE = dict(
    shape="0.5B", prompts=8, samples=8, prompt_len=128, completion_len=256, beta=0.04,
    micro_batch_tokens=12288, master_weights="auto", gradient_checkpointing=False, lora=0,
)  # fmt: skip
CASES = {
    "0.5B": {},
    "0.5B 2048 tokens": dict(completion_len=2048),
    "0.5B masters off, beta 0": dict(master_weights="off", beta=0.0),
    "0.5B LoRA r=16": dict(lora=16),
    "1.5B": dict(shape="1.5B"),
    "1.5B 16 prompts, checkpointing": dict(shape="1.5B", prompts=16, gradient_checkpointing=True),
    "7B LoRA r=16, 512 tokens, checkpointing": dict(
        shape="7B", lora=16, completion_len=512, gradient_checkpointing=True
    ),
}
TOLERANCE = 0.15


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for name in args.cases:
        case = argparse.Namespace(**{**BASE, **CASES[name]}, warmup=args.warmup, steps=1)
        vocab = SHAPES[case.shape]["vocab_size"]
        tokenizer = synthetic_tokenizer(vocab)
        prompts = random_prompts(case.prompts, case.prompt_len, vocab, tokenizer)
        row = run_fastgrpo(case, device, torch.bfloat16, tokenizer, prompts, lora_rank=case.lora)
        gc.collect()
        torch.cuda.empty_cache()
        measured, predicted = row["peak_memory_gib"], row["predicted_peak_gib"]
        error = predicted / measured - 1
        rows.append(
            {"case": name, "measured_gib": measured, "predicted_gib": predicted, "error": error,
             "seconds_per_step": row["seconds_per_step"], "workload": vars(case)}
        )  # fmt: skip
        print(f"{name:<42} measured {measured:6.2f}  predicted {predicted:6.2f}  {error:+.1%}")
    worst = max(abs(r["error"]) for r in rows)
    print(
        f"worst error {worst:.1%} (bar: {TOLERANCE:.0%}): {'met' if worst <= TOLERANCE else 'MISSED'}"
    )
    print_result_line("memory", rows, device=device, workload={"tolerance": TOLERANCE})


if __name__ == "__main__":
    main()

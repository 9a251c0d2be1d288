"""Rollouts whose completions end at different lengths, with finished groups compacted out of the
wave and without (`RolloutEngine(compact=...)`), on the same prompts and seeds.

Workload: Qwen2.5-0.5B shape, random bf16 weights, 64 prompts x 4 samples (256 rows), prompt 128
tokens, at most 512 new tokens. Lengths: the stop ids are every STRIDE-th token id, so each step
ends a row with a probability of about 1 / STRIDE (a random model's next token is close to
uniform) and a group of 4 lasts as long as its longest row. Both settings must give the same
tokens (the sampler's noise depends only on each row's seed and step). Prints a table (seconds per
rollout, completion tokens per second, the lengths), then one JSON line.
Run on a CUDA GPU:  python benchmarks/bench_compaction.py [--stride 200]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_rollout import PARAMS, native_model, print_result_line, prompts_of, timed  # noqa: E402

from fastgrpo.rollout.engine import RolloutEngine  # noqa: E402

PROMPTS, SAMPLES, PROMPT_LEN, NEW_TOKENS = 64, 4, 128, 512


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stride", type=int, default=200, help="every STRIDE-th id stops a row")
    args = parser.parse_args()
    model = native_model("0.5B")
    vocab = model.config.vocab_size
    prompts = prompts_of(PROMPTS, PROMPT_LEN, vocab)
    stops = list(range(0, vocab, args.stride))
    outs, results = {}, []
    for compact in (False, True):
        engine = RolloutEngine(model, stop_ids=stops, pad_id=0, compact=compact)

        def run(engine=engine):
            return engine.generate(
                prompts, num_samples=SAMPLES, max_new_tokens=NEW_TOKENS, params=PARAMS, seed=1
            )

        seconds = timed(run)
        out = outs[compact] = run()
        lengths = out.lengths.float()
        groups = out.lengths.view(PROMPTS, SAMPLES).max(1).values.float()
        row = {
            "method": "compacted" if compact else "every row to the end",
            "seconds": seconds,
            "completion_tokens_per_s": out.lengths.sum().item() / seconds,
            "mean_length": lengths.mean().item(),
            "mean_group_longest": groups.mean().item(),
            "longest": out.lengths.max().item(),
        }
        results.append(row)
        print(
            f"{row['method']:<22} {seconds:7.3f} s per rollout  "
            f"{row['completion_tokens_per_s']:9,.0f} completion tokens/s  mean length "
            f"{row['mean_length']:.0f}, groups' longest {row['mean_group_longest']:.0f}, "
            f"longest {row['longest']}"
        )
    same = all(
        torch.equal(getattr(outs[True], f), getattr(outs[False], f))
        for f in ("tokens", "lengths", "finished")
    )
    logp_diff = (outs[True].logp - outs[False].logp).abs().max().item()
    speedup = results[0]["seconds"] / results[1]["seconds"]
    print(f"same tokens: {same}; max |logp diff| {logp_diff:.2e}; {speedup:.2f}x")
    print_result_line(
        "compaction",
        results,
        workload=dict(
            shape="0.5B",
            prompts=PROMPTS,
            samples=SAMPLES,
            prompt_len=PROMPT_LEN,
            max_new_tokens=NEW_TOKENS,
            stop_stride=args.stride,
        ),  # fmt: skip
        same_tokens=same,
        max_logp_diff=logp_diff,
        speedup=speedup,
    )


if __name__ == "__main__":
    main()

"""Rollouts whose completions end at different lengths, with finished groups compacted out of the
wave and without (`RolloutEngine(compact=...)`), on the same prompts and seeds.

Workload: Qwen2.5-0.5B shape, random bf16 weights, 64 prompts x 4 samples (256 rows), prompt 128
tokens, at most 512 new tokens. Lengths: the stop ids are every STRIDE-th token id, so each step
ends a row with a probability of about 1 / STRIDE (a random model's next token is close to
uniform) and a group of 4 lasts as long as its longest row. The sampler's noise depends only on
each row's seed and step, but a batch size may select other kernels (at most 64 rows: the fused
LM-head sampler with fp32 logits; more: cuBLAS's bf16 logits), so a row can sample another token
where two scores are that close, and its completion goes another way from there: the share of
rows whose completions are identical is reported, and the lengths' statistics. Also the replayed
decode step at each bucket the compacted rollout ran at (slots 0-254, `replayed_step_ms`). Prints a table, then one
JSON line.
Run on a CUDA GPU:  python -m benchmarks.lab.bench_compaction [--stride 200]
"""

from __future__ import annotations

import argparse

from benchmarks.bench_rollout import PARAMS, native_model, print_result_line, prompts_of, timed  # noqa: E402
from benchmarks.lab.ab_decode_step import replayed_step_ms  # noqa: E402
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
    same_rows = (outs[True].tokens == outs[False].tokens).all(1).float().mean().item()
    speedup = results[0]["seconds"] / results[1]["seconds"]
    print(f"rows with identical completions: {same_rows:.1%}; compacted {speedup:.2f}x as fast")
    (wave,) = engine._kept.values()  # the compacted engine's
    buckets = {}
    for prompts in sorted(wave.graphs, reverse=True):
        wave.live_prompts = prompts  # the next rollout's start sets it back
        buckets[prompts * SAMPLES] = replayed_step_ms(wave)
        print(
            f"  replayed step at {prompts * SAMPLES:3d} rows: {buckets[prompts * SAMPLES]:.3f} ms"
        )
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
        rows_identical=same_rows,
        speedup=speedup,
        replayed_step_ms_by_rows=buckets,
    )


if __name__ == "__main__":
    main()

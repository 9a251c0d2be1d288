"""Where a whole rollout's decode steps spend time beyond the replayed step (workload A).

Why: `bench_rollout.py` times A from whole rollouts, (t(256 tokens) - t(1 token)) / 255, and in
session 15 read 30-60 us per step above the same step replayed back to back
(`ab_decode_step.py --replay`). This script runs A's rollouts with a CUDA event recorded before
every decode step's graph replay (and one after the rollout), so each step's GPU time, any idle
gap after it included, is known. Steps are grouped by what follows them on the host: the steps
after which the host checks the finish flags (every `check_every` steps; the GPU drains while the
host waits) and the others. For comparison: the same steps replayed back to back (as
`--replay`), and the whole-rollout figure. Prints a table, then one JSON line.
Run on a CUDA GPU:
    python -m benchmarks.lab.profile_rollout_steps [--rollouts 5] [--check-every 8] [--plain-looks]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.bench_rollout import (  # noqa: E402
    PARAMS,
    StepEvents,
    native_model,
    print_result_line,
    prompts_of,
    timed,
)
from benchmarks.lab.ab_decode_step import NEW_TOKENS, forced_length_engine, replayed_step_ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=5)
    parser.add_argument("--check-every", type=int, default=8)
    parser.add_argument(
        "--plain-looks",
        action="store_true",
        help="the host waits for the device at each look at the finish flags (not lagged)",
    )
    args = parser.parse_args()
    model = native_model("0.5B")
    prompts = prompts_of(64, 128, model.config.vocab_size)
    engine = forced_length_engine(model, check_every=args.check_every)
    engine.lagged_looks = not args.plain_looks

    def rollout(new_tokens=NEW_TOKENS):
        return engine.generate(
            prompts, num_samples=1, max_new_tokens=new_tokens, params=PARAMS, seed=1
        )

    whole = (timed(rollout) - timed(lambda: rollout(1))) / (NEW_TOKENS - 1) * 1e3
    checked, unchecked, host = [], [], []
    for _ in range(args.rollouts):
        torch.cuda.synchronize()
        with StepEvents() as steps:
            rollout()
            steps.mark()  # after the last step (and the result's copies)
        torch.cuda.synchronize()
        marks = steps.marks
        for i in range(len(marks) - 2):  # the last interval holds the result's copies
            ms = marks[i][1].elapsed_time(marks[i + 1][1])
            # step t = i + 1 of the rollout; the host checks after steps t % check_every == 0
            (checked if (i + 1) % args.check_every == 0 else unchecked).append(ms)
            host.append((marks[i + 1][0] - marks[i][0]) * 1e3)

    wave = next(w for key, w in engine._kept.items() if key[3] == NEW_TOKENS)
    replayed = [replayed_step_ms(wave) for _ in range(args.rollouts)]

    every = checked + unchecked
    rows = [
        ("whole rollouts, (t(256) - t(1)) / 255", whole),
        ("steps in rollouts, event to event, all", statistics.mean(every)),
        ("  steps the host checks after", statistics.mean(checked)),
        ("  the other steps", statistics.mean(unchecked)),
        ("the same steps replayed back to back", statistics.mean(replayed)),
        ("host time between two steps' launches", statistics.mean(host)),
    ]
    for name, ms in rows:
        print(f"{name:<42} {ms:8.3f} ms")
    print_result_line(
        "profile_rollout_steps",
        [dict(measure=name, ms=ms) for name, ms in rows],
        check_every=args.check_every,
        lagged_looks=engine.lagged_looks,
        rollouts=args.rollouts,
        checked_steps_ms=checked,
    )


if __name__ == "__main__":
    main()

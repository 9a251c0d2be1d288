"""Kernel-level profile of the engine's decode steps (no CUDA graph, so each kernel shows).

0.5B shape, random bf16 weights, prompt 128, 33 new tokens, 64 rows (64 prompts x 1 sample, or
e.g. 8 x 8 with --prompts 8 --samples 8); prints the top CUDA kernels.
Run on a CUDA GPU:  python benchmarks/profile_decode_step.py [--prompts P --samples G]
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_rollout import PARAMS, native_model, prompts_of  # noqa: E402

from fastgrpo.rollout.engine import RolloutEngine  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=1)
    args = parser.parse_args()
    model = native_model("0.5B")
    prompts = prompts_of(args.prompts, 128, model.config.vocab_size)
    never = model.config.vocab_size
    engine = RolloutEngine(model, stop_ids=[never], pad_id=0, cuda_graphs=False)

    def run(new_tokens):
        engine.generate(
            prompts, num_samples=args.samples, max_new_tokens=new_tokens, params=PARAMS, seed=1
        )
        torch.cuda.synchronize()

    run(8)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(33)
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=25, max_name_column_width=70
    )
    print(table)


if __name__ == "__main__":
    main()

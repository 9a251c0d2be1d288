"""Host (Python) time of a rollout, by cProfile: where the whole-rollout workload D spends the
time that is not GPU work. Two cases on the 0.5B shape, 8 prompts x 8 samples, 128-token prompts:
prefill and setup alone (1 new token, CUDA graphs on), and an eager rollout of 4 tokens (no graphs),
5 calls each after 2 warm-up calls. Prints pstats tables (tottime, then cumtime). On a CUDA GPU:
    python -m benchmarks.lab.profile_rollout_host
"""

from __future__ import annotations

import cProfile
import io
import pstats

import torch

from benchmarks.bench_rollout import PARAMS, native_model, prompts_of  # noqa: E402
from fastgrpo.rollout.engine import RolloutEngine  # noqa: E402


def profile(model, prompts, graphs: bool, new_tokens: int, calls: int = 5) -> None:
    never = model.config.vocab_size
    engine = RolloutEngine(model, stop_ids=[never], pad_id=0, cuda_graphs=graphs)

    def run():
        engine.generate(prompts, num_samples=8, max_new_tokens=new_tokens, params=PARAMS, seed=1)

    run()
    run()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        run()
    torch.cuda.synchronize()
    profiler.disable()
    for order in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(40)
        print(f"===== CUDA graphs {graphs}, {new_tokens} new tokens, {calls} calls, by {order}")
        print(text.getvalue())


def main():
    model = native_model("0.5B")
    prompts = prompts_of(8, 128, model.config.vocab_size)
    profile(model, prompts, graphs=True, new_tokens=1)
    profile(model, prompts, graphs=False, new_tokens=4)


if __name__ == "__main__":
    main()

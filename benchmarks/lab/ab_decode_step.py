"""Small changes to the decode step, compared in one process: workload A of bench_rollout.py (0.5B
shape, 64 rows, prompt 128, 256 new tokens) with each variant in turn, over several rounds.

Why: separate `bench_rollout.py` runs of one configuration spread by 2-4% (new weights, new
allocations, another process), which hides the 10-30 us a kernel-level change moves. Here every
variant runs on the same weights and prompts, the rounds alternate the variants, and each round's
difference to the baseline is a paired sample: the table gives the mean and the spread of those.
Each round starts one variant later than the one before, so that an effect of a variant's place
in the round falls on every variant alike (once, the same settings measured 21 us apart as the
first and the last of a round: results/decode_step_ab_h100_v1.txt, section 8); give a multiple of
the variant count as --rounds.

A variant sets module attributes (the settings the decode kernels read at each launch) and gets a
fresh engine, so its graph is captured with them.
Variants (`--variants`, the first is the baseline):
  default                 the settings as committed
  default-again           the same, measured as if it were a change (the harness's own noise)
  attention-256-8-3       the Triton decode attention with 256-key blocks, 8 warps, 3 stages,
                          one split (the Gluon one off)
  attention-512-8-2       the same with 512-key blocks, 8 warps, 2 stages
  gate-up-bn16            the Triton gate/up kernel with 16 output columns per program (32 as
                          committed), the Gluon one off
  gluon-gate-up-off       gate/up by the Triton kernel instead of the Gluon one (Hopper)
  gluon-gate-up-exact     the Gluon gate/up with libdevice's exp and the IEEE division
  gate-up-depth0          the Gluon gate/up waiting for each k step's products before the next
                          step (the kernel before session 15)
  o-proj-whole            o_proj as one product per column block (SHORT_K_RANGE = 0), not
                          split-K parts that the norm after it adds up
  lm-head-sampler-off     the LM head by cuBLAS and the sampler on its logits, not the fused
                          Gluon kernel
  combine-plain           the fused LM-head sampler's per-row merge as a plain launch
  lm-head-plain           the fused LM-head sampler as a plain launch in the captured step too,
                          its weight asked for only at its start (as before session 18)
  norm-4-warps            the decode norms with one warp per 256 columns (4 at H = 896), as
                          before f5463af
  gluon-attention-off     the decode attention by the Triton kernel instead of the Gluon one
                          (Hopper)
  attention-3-stages      the Gluon attention with 3 ring stages (96 KB: two programs may share a
                          multiprocessor), as before session 18
  attention-all-early     the Gluon attention asking for every block of its first fill before the
                          PDL wait, ahead of this step's q, k and v, as before session 18
  attention-whole-blocks  the Gluon attention reading a last, partial block of keys whole, not
                          in 32-key boxes (d = 64 only)
  pdl-off                 programmatic dependent launch off: a known loss (~57 us per step in
                          results/rollout_pdl_ab_h100_v1.txt), to show the harness sees one
With --replay each variant's engine is made once and its captured step is timed alone with CUDA
events (`Replayed`), round after round: no prefill, allocation or host check in the samples.
Prints a table, then one JSON line. Run on a CUDA GPU:
    python -m benchmarks.lab.ab_decode_step [--rounds 8] [--variants default attention-256-8-3 ...]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.bench_rollout import PARAMS, native_model, print_result_line, prompts_of, timed  # noqa: E402
from fastgrpo.kernels.decode import (  # noqa: E402
    decode_attention_gluon,
    decode_attention_triton,
    decode_linear,
    decode_linear_gluon,
    lm_head_sample,
    pdl,
)
from fastgrpo.kernels.layers import rms_norm  # noqa: E402
from fastgrpo.rollout.engine import RolloutEngine  # noqa: E402

NEW_TOKENS = 256
_committed_pick_config = decode_linear.pick_config


def _gate_up_bn16(M: int, N: int, K: int, swiglu: bool) -> dict:
    config = _committed_pick_config(M, N, K, swiglu)
    return dict(config, BN=16) if swiglu else config


VARIANTS = {
    "default": {},
    "default-again": {},
    "attention-256-8-3": {
        (decode_attention_triton, "BLOCKS"): (256, 8, 3),
        (decode_attention_triton, "SPLITS"): 1,
        (decode_attention_gluon, "ENABLED"): False,
    },
    "attention-512-8-2": {
        (decode_attention_triton, "BLOCKS"): (512, 8, 2),
        (decode_attention_triton, "SPLITS"): 1,
        (decode_attention_gluon, "ENABLED"): False,
    },
    "gate-up-bn16": {
        (decode_linear, "pick_config"): _gate_up_bn16,
        (decode_linear_gluon, "ENABLED"): False,
    },
    "gluon-gate-up-off": {(decode_linear_gluon, "ENABLED"): False},
    "gluon-gate-up-exact": {(decode_linear_gluon, "EXACT_EPILOGUE"): True},
    "gate-up-depth0": {(decode_linear_gluon, "DEPTH"): 0},
    "o-proj-whole": {(decode_linear, "SHORT_K_RANGE"): 0},
    "qkv-whole": {(decode_linear, "QKV_K_RANGE"): 0},
    "lm-head-sampler-off": {(lm_head_sample, "ENABLED"): False},
    "combine-plain": {(lm_head_sample, "COMBINE_PDL"): False},
    "lm-head-plain": {(lm_head_sample, "WEIGHT_BEFORE_WAIT"): False},
    "lm-head-4-warps": {(lm_head_sample, "NUM_WARPS"): 4},
    "norm-4-warps": {(rms_norm, "DECODE_COLUMNS_PER_WARP"): 256},
    "gluon-attention-off": {(decode_attention_gluon, "ENABLED"): False},
    "attention-3-stages": {
        (decode_attention_gluon, "blocks"): lambda d: (128, 3) if d <= 64 else (64, 3)
    },
    "attention-all-early": {(decode_attention_gluon, "EARLY_BLOCKS"): 4},
    "attention-whole-blocks": {(decode_attention_gluon, "PART_ROWS"): 128},
    "pdl-off": {(pdl, "ENABLED"): False},
}


def apply(patches: dict) -> dict:
    """Set the attributes; return what they were."""
    before = {key: getattr(*key) for key in patches}
    for (module, name), value in patches.items():
        setattr(module, name, value)
    return before


def forced_length_engine(model, **options) -> RolloutEngine:
    """An engine whose stop id no sample can equal, so every completion runs to its limit."""
    return RolloutEngine(model, stop_ids=[model.config.vocab_size], pad_id=0, **options)


def replayed_step_ms(wave) -> float:
    """ms per step of a wave's captured step replayed for A's decode steps back to back from the
    first one (its step counters set back), between two CUDA events."""
    state = wave.state
    state.step.fill_(1)  # the first decode step: column 1 sampled, slot 0 fed
    state.slot.fill_(0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(NEW_TOKENS - 1):
        wave.step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (NEW_TOKENS - 1)


def step_ms(model, prompts) -> float:
    """ms per decode step of a fresh engine (its graphs captured under the current settings)."""
    engine = forced_length_engine(model)

    def seconds(new_tokens):
        return timed(
            lambda: engine.generate(
                prompts, num_samples=1, max_new_tokens=new_tokens, params=PARAMS, seed=1
            )
        )

    return (seconds(NEW_TOKENS) - seconds(1)) / (NEW_TOKENS - 1) * 1e3


class Replayed:
    """A variant's decode step captured once under its settings, then timed alone: the wave's
    step counters are set back to the first decode step and its graph replayed for all of A's
    decode steps back to back, between two CUDA events (no prefill, no host checks)."""

    def __init__(self, model, prompts, patches: dict):
        before = apply(patches)
        try:
            self.engine = forced_length_engine(model)
            self.engine.generate(  # captures the step's graph under these settings
                prompts, num_samples=1, max_new_tokens=NEW_TOKENS, params=PARAMS, seed=1
            )
        finally:
            apply(before)
        (self.wave,) = self.engine._kept.values()
        self.step_ms()  # warm-up

    def step_ms(self) -> float:
        return replayed_step_ms(self.wave)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument(
        "--replay",
        action="store_true",
        help="time each variant's captured step replayed alone (CUDA events), not whole rollouts",
    )
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="NAME"
    )
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the spread needs two paired samples)")
    model = native_model("0.5B")
    prompts = prompts_of(64, 128, model.config.vocab_size)
    times = {name: [] for name in args.variants}
    if args.replay:
        replayed = {name: Replayed(model, prompts, VARIANTS[name]) for name in args.variants}
    for r in range(args.rounds):
        # each round starts one variant later, so every variant takes each place as often
        shift = r % len(args.variants)
        for name in args.variants[shift:] + args.variants[:shift]:
            if args.replay:
                times[name].append(replayed[name].step_ms())
                continue
            before = apply(VARIANTS[name])
            try:
                times[name].append(step_ms(model, prompts))
            finally:
                apply(before)
            torch.cuda.empty_cache()
        print(f"round {r}: " + "  ".join(f"{n} {t[-1]:.3f}" for n, t in times.items()), flush=True)
    base = args.variants[0]
    results = []
    print(f"{'variant':<20} {'mean ms':>8} {'vs ' + base + ' (us)':>22} {'sd (us)':>8} {'wins':>5}")
    for name, ms in times.items():
        diffs = [1e3 * (a - b) for a, b in zip(ms, times[base])]
        mean_diff, sd = statistics.mean(diffs), statistics.stdev(diffs)
        wins = sum(d < 0 for d in diffs)
        print(
            f"{name:<20} {statistics.mean(ms):8.3f} {mean_diff:22.1f} {sd:8.1f} "
            f"{wins:>2}/{len(diffs)}"
        )
        results.append(
            dict(variant=name, ms_per_step=ms, mean_diff_us=mean_diff, sd_diff_us=sd, wins=wins)
        )
    mode = "replayed steps" if args.replay else "whole rollouts"
    print_result_line("ab_decode_step", results, baseline=base, rounds=args.rounds, mode=mode)


if __name__ == "__main__":
    main()

"""Same-process A/B of LM-head kernel configurations in the whole fused GRPO loss call.

Run-to-run noise on the lent GPUs is 2-4%, larger than most configuration changes, so each variant
is timed in alternation (A B A B ...) within one process on the same inputs. A variant sets any of
the kernels' configuration functions:

    --variant "old:dh=128,256,64,8,3,4"  --variant "new:dh=256,128,64,8,4,7"
    --variant "x:dw=256,128,64,8,4,0,1;stats=128,256,64,8,3"

dh = (BLOCK_R, BLOCK_H, BLOCK_V, warps, stages, splits); dw = `lm_head_backward._dw_blocks`'s tuple;
stats = `lm_head_stats._blocks`'s tuple; gluon = 0 or 1 (the training pass's statistics by the Gluon
kernel on Hopper, `lm_head_stats_gluon`). A variant with no settings runs the defaults. Prints the
median forward + backward time of each variant per round, then one JSON line.
Run on a CUDA GPU:  python -m benchmarks.lab.ab_lm_head_configs --shape 16384x896x151936 --variant ...
"""

from __future__ import annotations

import argparse
import statistics

from triton.testing import do_bench

from benchmarks.bench_logprob import fused_loss, make_inputs  # noqa: E402
from benchmarks.bench_rollout import print_result_line  # noqa: E402
from fastgrpo.kernels.train import lm_head_backward as bwd  # noqa: E402
from fastgrpo.kernels.train import lm_head_stats as stats  # noqa: E402
from fastgrpo.kernels.train import lm_head_stats_gluon  # noqa: E402

DEFAULTS = {
    "dh_blocks": bwd._dh_blocks,
    "dh_splits": bwd._dh_splits,
    "dw_blocks": bwd._dw_blocks,
    "stats_blocks": stats._blocks,
    "gluon": lm_head_stats_gluon.ENABLED,
}


def parse_variant(text):
    """'name:key=a,b,c;key=...' -> (name, {key: tuple of ints})."""
    name, _, body = text.partition(":")
    settings = {}
    for part in filter(None, body.split(";")):
        key, _, value = part.partition("=")
        if key not in ("dh", "dw", "stats", "gluon"):
            raise SystemExit(f"unknown setting {key!r} in {text!r}: use dh, dw, stats or gluon")
        settings[key] = tuple(int(x) for x in value.split(","))
    return name, settings


def apply(settings):
    bwd._dh_blocks = DEFAULTS["dh_blocks"]
    bwd._dh_splits = DEFAULTS["dh_splits"]
    bwd._dw_blocks = DEFAULTS["dw_blocks"]
    stats._blocks = DEFAULTS["stats_blocks"]
    lm_head_stats_gluon.ENABLED = bool(settings.get("gluon", (DEFAULTS["gluon"],))[0])
    if "dh" in settings:
        bwd._dh_blocks = lambda *_, c=settings["dh"]: c[:5]
        bwd._dh_splits = lambda *_, c=settings["dh"]: c[5]
    if "dw" in settings:
        bwd._dw_blocks = lambda *_, c=settings["dw"]: c
    if "stats" in settings:
        stats._blocks = lambda *_, c=settings["stats"]: c


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="16384x896x151936")
    parser.add_argument("--variant", action="append", required=True, help="name:key=...;key=...")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    n, h, v = (int(x) for x in args.shape.split("x"))
    variants = [parse_variant(t) for t in args.variant]
    inputs = make_inputs(n, h, v)

    def step():
        inputs[0].grad = inputs[1].grad = None
        fused_loss(*inputs).backward()

    times = {name: [] for name, _ in variants}
    for r in range(args.rounds):
        for name, settings in variants:
            apply(settings)
            ms = do_bench(step, warmup=3, rep=300, return_mode="median")
            times[name].append(ms)
            print(f"round {r}  {name:<16} {ms:8.3f} ms", flush=True)
    apply({})
    print(f"{'variant':<16} {'median ms':>10} {'min':>8} {'max':>8}")
    for name, t in times.items():
        print(f"{name:<16} {statistics.median(t):10.3f} {min(t):8.3f} {max(t):8.3f}")
    results = [dict(variant=name, settings=s, ms=times[name]) for name, s in variants]
    print_result_line("ab_lm_head_configs", results, shape=[n, h, v])


if __name__ == "__main__":
    main()

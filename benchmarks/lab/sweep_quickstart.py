"""Sweep settings of the quick-start preset: held-out accuracy before/after for each, in parallel.

Each variant is a full `fastgrpo train` run (a subprocess), so this measures exactly what users
run. Used to choose the preset's learning rate, batch and temperature; on a GPU the whole sweep
takes minutes. Prints a table, then one JSON line.

    python -m benchmarks.lab.sweep_quickstart --model PATH_OR_NAME --device cuda --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

VARIANTS = {
    "default": [],
    "lr1e-5_p8": ["train.learning_rate=1e-5", "rollout.prompts_per_step=8"],
    "lr2e-5_p8": ["rollout.prompts_per_step=8"],
    "lr3e-5": ["train.learning_rate=3e-5"],
    "lr5e-5": ["train.learning_rate=5e-5"],
    "t1.0": ["rollout.temperature=1.0"],
    "lr1e-5": ["train.learning_rate=1e-5"],
    "steps60": ["train.steps=60"],
    "lr1.5e-5": ["train.learning_rate=1.5e-5"],
    "lr7e-6": ["train.learning_rate=7e-6"],
    "lr1e-5_p6": ["train.learning_rate=1e-5", "rollout.prompts_per_step=6"],
    "lr1e-5_cos": ["train.learning_rate=1e-5", "train.lr_scheduler=cosine", "train.warmup_steps=3"],
}


def run_variant(name: str, overrides: list[str], seed: int, args) -> dict:
    out_dir = Path(args.out) / f"{name}-s{seed}"
    command = [
        sys.executable,
        "-m",
        "fastgrpo",
        "train",
        "--set",
        f"model.name={args.model}",
        "--set",
        f"model.device={args.device}",
        "--set",
        f"model.dtype={args.dtype}",
        "--set",
        f"run.output_dir={out_dir}",
        "--set",
        "run.progress=false",
        "--set",
        f"train.seed={seed}",
        "--set",
        f"eval.num_problems={args.eval_problems}",
    ]
    for item in overrides:
        command += ["--set", item]
    start = time.time()
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"}
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"variant": name, "seed": seed, "error": done.stderr[-800:]}
    summary = json.loads(lines[-1])
    if not args.keep_runs:  # each run folder holds ~2 GB of checkpoints
        shutil.rmtree(out_dir, ignore_errors=True)
    return {
        "variant": name,
        "seed": seed,
        "before": summary["accuracy_before"],
        "after": summary["accuracy_after"],
        "seconds": round(time.time() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--out", default="runs/sweep")
    parser.add_argument("--keep-runs", action="store_true", help="keep each run folder")
    args = parser.parse_args()
    jobs = [
        (name, VARIANTS[name], int(seed))
        for name in args.variants.split(",")
        for seed in args.seeds.split(",")
    ]
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda job: run_variant(*job, args), jobs))
    print(f"{'variant':<12} {'seed':>4} {'before':>7} {'after':>7} {'seconds':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<12} {r['seed']:>4} error: {r['error'][-200:]}")
        else:
            print(
                f"{r['variant']:<12} {r['seed']:>4} {r['before']:>7.3f} {r['after']:>7.3f} {r['seconds']:>8}"
            )
    print(
        json.dumps(
            {"sweep": results, "model": args.model, "device": args.device, "dtype": args.dtype}
        )
    )


if __name__ == "__main__":
    main()

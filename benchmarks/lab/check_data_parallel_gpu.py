"""Data parallel on GPUs, a correctness check: a tiny random Llama trained 2 steps by one process
and by `fastgrpo train --nproc N`, in fp32 (where the two must agree) and in bf16 (where it must
run: NCCL, fp32 master gradients summed, fused kernels per rank).

    python -m benchmarks.lab.check_data_parallel_gpu --nproc 2 [--parallel sharded]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.bench_scaling import error_tail
from fastgrpo.train.checkpoint import latest_checkpoint
from tests.conftest import build_tiny_model
from tests.train.test_training_run import tiny_overrides, write_test_rewards


def train(model_dir, run_dir, rewards, dtype, nproc, parallel="auto") -> float:
    extra = {"model.device": "cuda", "model.dtype": dtype, "rollout.prompts_per_step": 4,
             "train.mini_batches": 2, "algo.beta": 0.04, "rewards": rewards,
             "train.parallel": parallel}  # fmt: skip
    sets = [f"--set={s}" for s in tiny_overrides(model_dir, run_dir, steps=2, **extra)]
    command = [sys.executable, "-m", "fastgrpo", "train", *sets]
    if nproc > 1:
        command[4:4] = ["--nproc", str(nproc)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(command[:6])} failed:\n" + error_tail(done.stderr))
    return time.perf_counter() - start


def weights(run_dir) -> dict:
    folder = latest_checkpoint(run_dir) / "model"
    return {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--parallel", default="auto", choices=("auto", "replicated", "sharded", "fsdp")
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    model_dir = str(build_tiny_model(root / "model"))
    rewards = f"['{write_test_rewards(root)}:digit_share']"
    rows = []
    for dtype in ("float32", "bfloat16"):
        one, many = root / f"one-{dtype}", root / f"many-{dtype}"
        seconds = [
            train(model_dir, one, rewards, dtype, 1),
            train(model_dir, many, rewards, dtype, args.nproc, args.parallel),
        ]
        a, b = weights(one), weights(many)
        diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        start = load_file(f"{model_dir}/model.safetensors")
        moved = max(float((a[k].float() - start[k].float()).abs().max()) for k in start)
        rows.append({"dtype": dtype, "max_weight_diff": diff, "max_weight_moved": moved,
                     "seconds_1": seconds[0], f"seconds_{args.nproc}": seconds[1]})  # fmt: skip
        print(f"{dtype:9} max |w_1 - w_{args.nproc}| {diff:.2e}   max |w - w0| {moved:.2e}   "
              f"wall {seconds[0]:.1f} s / {seconds[1]:.1f} s")  # fmt: skip
    print(json.dumps({"bench": "check_data_parallel_gpu", "gpus": torch.cuda.device_count(),
                      "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "nproc": args.nproc, "parallel": args.parallel, "results": rows}))  # fmt: skip


if __name__ == "__main__":
    main()

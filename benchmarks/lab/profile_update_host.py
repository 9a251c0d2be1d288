"""The update phase's host time against its GPU time, full fine-tuning and LoRA side by side.

For each mode: bench_step's 0.5B workload (8 x 8 completions of 256 tokens, beta 0.04) warms up,
then per step the update's forward and backward passes (`_accumulate_gradients`) are timed twice:
the host's time to issue them, and the time until the GPU has run them (a synchronisation right
after). Equal numbers mean the GPU waits for the host (host-bound). Then one step runs under
`torch.cuda.set_sync_debug_mode("warn")` (every host read of the device inside the update is
listed by where it happens), and one under cProfile (Python functions by own time, update only).

On a CUDA GPU:  python -m benchmarks.lab.profile_update_host [--lora 16] [--rows 40]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
import warnings
from collections import Counter

import torch

from benchmarks.bench_step import synchronize, synthetic_trainer
from fastgrpo.train import update as update_module
from fastgrpo.train.step import grpo_step


def run(args, lora_rank: int) -> dict:
    device = torch.device(args.device)
    config, trainer, examples = synthetic_trainer(args, device, lora_rank=lora_rank)
    original = update_module._accumulate_gradients
    host, total, syncs, profiler = [], [], Counter(), [None]

    def timed(*a, **k):
        synchronize(device)
        start = time.perf_counter()
        if profiler[0] is not None:
            profiler[0].enable()
        out = original(*a, **k)
        if profiler[0] is not None:
            profiler[0].disable()
        host.append(time.perf_counter() - start)
        synchronize(device)
        total.append(time.perf_counter() - start)
        return out

    update_module._accumulate_gradients = timed
    try:
        torch.manual_seed(0)
        for _ in range(args.warmup):
            grpo_step(config, trainer, examples)
        host.clear(), total.clear()
        steps = []
        for _ in range(args.steps):
            synchronize(device)
            start = time.perf_counter()
            record = grpo_step(config, trainer, examples)
            synchronize(device)
            steps.append(time.perf_counter() - start)
        phases = {k: round(v * 1e3, 1) for k, v in record.items() if k.startswith("time/")}
        timing = {
            "host_ms": [round(h * 1e3, 1) for h in host],
            "gpu_done_ms": [round(t * 1e3, 1) for t in total],
        }
        # host reads of the device inside the update
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            update_module._accumulate_gradients = lambda *a, **k: original(*a, **k)
            try:
                grpo_step(config, trainer, examples)
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
                update_module._accumulate_gradients = timed
        for w in caught:
            if "synchroniz" in str(w.message):
                syncs[f"{w.filename}:{w.lineno}"] += 1
        profiler[0] = cProfile.Profile()
        grpo_step(config, trainer, examples)
        text = io.StringIO()
        pstats.Stats(profiler[0], stream=text).sort_stats("tottime").print_stats(args.rows)
        return {
            "mode": (f"LoRA r={lora_rank}" if lora_rank else "full")
            + f", cuda_graphs {args.cuda_graphs}",
            "s_per_step": sorted(steps)[len(steps) // 2],
            "phases_ms": phases,
            "update_fwd_bwd": timing,
            "syncs": dict(syncs),
            "cprofile": text.getvalue(),
        }
    finally:
        update_module._accumulate_gradients = original


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="0.5B")
    p.add_argument("--lora", type=int, default=16)
    p.add_argument("--rows", type=int, default=40)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batch-tokens", type=int, default=12288)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--cuda-graphs", choices=("auto", "off"), default="auto", help="train.cuda_graphs"
    )
    p.add_argument("--tiny", action="store_true", help="a tiny model shape (CPU smoke test)")
    args = p.parse_args()
    args.prompts, args.samples, args.prompt_len, args.completion_len, args.beta = (
        8,
        8,
        128,
        256,
        0.04,
    )
    args.master_weights, args.gradient_checkpointing, args.zero_variance = "auto", False, 0.0
    args.dynamic_sampling = False
    if args.tiny:
        args.shape = "tiny"
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{gpu}, torch {torch.__version__}")
    rows = []
    for rank in (0, args.lora):
        r = run(args, rank)
        rows.append(r)
        print(f"\n===== {r['mode']}: {r['s_per_step']:.3f} s/step; phases {r['phases_ms']}")
        print(
            f"update fwd+bwd per mini-batch: host {r['update_fwd_bwd']['host_ms']} ms, "
            f"GPU done {r['update_fwd_bwd']['gpu_done_ms']} ms"
        )
        print(f"syncs inside a step: {r['syncs']}")
        print(r["cprofile"])
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(json.dumps([{k: v for k, v in r.items() if k != "cprofile"} for r in rows]))


if __name__ == "__main__":
    main()

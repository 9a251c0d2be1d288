"""How often the update's CUDA graphs would replay on batches of varied lengths, by padding step.

`train/captured_layers.py` pads each micro-batch to a bucket and records a bucket's layers the
second time it comes (the first runs eagerly), keeping MAX_GRAPHS. A bucket that rarely comes
back costs an eager pass and a recording and saves nothing, so the padding steps decide whether
real runs gain. This simulates the trainer's planning and packing (`batching.plan_micro_batches`,
`logprobs.pack_layout`, `captured_layers.pad_layout`) on random prompt and completion lengths,
on the CPU (no model: layouts only), and counts per padding step the micro-batches that would run
eagerly, be recorded, or replay.

python -m benchmarks.lab.sim_graph_buckets [--steps 50]
"""

from __future__ import annotations

import argparse
import json
from collections import OrderedDict

import numpy as np
import torch

from fastgrpo.train.batching import plan_micro_batches
from fastgrpo.train.captured_layers import MAX_GRAPHS, pad_layout, token_step
from fastgrpo.train.logprobs import pack_layout, prompt_groups

WORKLOADS = {  # prompts, samples, prompt lengths, completion lengths (uniform, inclusive)
    "quick start (4 x 8, prompt 40-70, completion 3-16)": (4, 8, (40, 70), (3, 16)),
    "GSM8K-like (8 x 8, prompt 80-200, completion 50-300)": (8, 8, (80, 200), (50, 300)),
    "GSM8K-like (16 x 8, prompt 80-200, completion 50-500)": (16, 8, (80, 200), (50, 500)),
    "long (8 x 8, prompt 100-300, completion 200-2000)": (8, 8, (100, 300), (200, 2000)),
}


def batch(rng, prompts: int, samples: int, prompt_lengths, completion_lengths):
    """(prompt_ids, prompt_mask, completion_mask) of one step's rows, prompts left-padded."""
    Tp, Tc = prompt_lengths[1], completion_lengths[1]
    ids, masks, kept = [], [], []
    for length in rng.integers(prompt_lengths[0], Tp + 1, prompts):
        prompt = torch.from_numpy(rng.integers(1, 1000, Tp))
        mask = (torch.arange(Tp) >= Tp - int(length)).long()
        for k in rng.integers(completion_lengths[0], Tc + 1, samples):
            ids.append(prompt * mask)
            masks.append(mask)
            kept.append((torch.arange(Tc) < int(k)).long())
    return torch.stack(ids), torch.stack(masks), torch.stack(kept)


def simulate(rng, workload, budget: int, step: int, steps: int) -> dict:
    kept_graphs: OrderedDict[tuple, str] = OrderedDict()
    counts = {"eager": 0, "recorded": 0, "replayed": 0}
    buckets, real, padded = set(), 0, 0
    for _ in range(steps):
        prompt_ids, prompt_mask, completion_mask = batch(rng, *workload)
        groups = prompt_groups(prompt_ids, prompt_mask)
        plan = plan_micro_batches(prompt_mask.sum(-1), completion_mask.sum(-1), budget, groups)
        for rows in plan:
            index = torch.tensor(rows)
            layout = pack_layout(prompt_ids[index], prompt_mask[index], completion_mask[index])
            _, bucket = pad_layout(layout, step)
            buckets.add(bucket)
            real, padded = real + layout.tokens.size, padded + bucket[0]
            state = kept_graphs.get(bucket)
            counts["eager" if state is None else "recorded" if state == "seen" else "replayed"] += 1
            kept_graphs[bucket] = "seen" if state is None else "recorded"
            kept_graphs.move_to_end(bucket)
            while len(kept_graphs) > MAX_GRAPHS:
                kept_graphs.popitem(last=False)
    total = sum(counts.values())
    return {
        **counts,
        "replayed_share": counts["replayed"] / total,
        "buckets": len(buckets),
        "padding_share": padded / real - 1,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--budget", type=int, default=12288, help="train.micro_batch_tokens")
    args = parser.parse_args()
    steps = sorted({512, token_step(args.budget), 2 * token_step(args.budget)})
    rows = []
    print(f"{'workload':<55} {'step':>5} {'eager':>6} {'rec.':>5} {'replay':>7} {'share':>6} "
          f"{'buckets':>8} {'padding':>8}")  # fmt: skip
    for name, workload in WORKLOADS.items():
        for step in steps:
            rng = np.random.default_rng(0)  # the same batches for every step
            r = simulate(rng, workload, args.budget, step, args.steps)
            rows.append({"workload": name, "step": step, **r})
            print(
                f"{name:<55} {step:>5} {r['eager']:>6} {r['recorded']:>5} {r['replayed']:>7} "
                f"{r['replayed_share']:>6.0%} {r['buckets']:>8} {r['padding_share']:>8.1%}"
            )
    print(json.dumps({"bench": "sim_graph_buckets", "budget": args.budget, "steps": args.steps,
                      "max_graphs": MAX_GRAPHS, "results": rows}))  # fmt: skip


if __name__ == "__main__":
    main()

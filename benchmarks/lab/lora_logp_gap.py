"""Where a LoRA run's sampler-trainer log-prob gap comes from, on the bench's own workload
(`bench_step.py`'s 0.5B shape, 8 prompts x 8 x 256 tokens, LoRA r=16 on every linear, and the
full fine-tune beside it).

At step 0 and after 22 steps, one rollout of the bench's prompts by the engine (what the trainer
samples from) is scored by `completion_logprobs` (the old log-probs' path, fused LM head) in
several ways, each against the engine's own log-probs of its samples (mean and max |difference|):

- LoRA, `merged forward`: the trainer as it runs, its adapted GEMMs reading the merged weights
  the engine samples from (`lora_train.merged_weight`);
- LoRA, `low-rank`: the same model with the merged weights detached, so the trainer computes the
  bf16 base plus the low-rank product apart (the path before the merged forward);
- LoRA, `plain merged`: the engine's merged copy itself scored as a plain model, i.e. full
  fine-tuning's path on the same weights;
- full: the full fine-tune's trainer.

`--learning-rate` sets train.learning_rate for both runs (1e-30: steps that move no weight, a
control for what training itself does to the gap). `--full-trains` freezes all of the full
fine-tune but the embedding and LM head (`head`), all but those (`body`) or all but the norms
(`norms`): which of its updates move the gap. Prints a table and a final JSON line.

    python -m benchmarks.lab.lora_logp_gap [--learning-rate 1e-30] [--full-trains body]
"""

from __future__ import annotations

import argparse
import json

import torch

import benchmarks.bench_step as bench
from fastgrpo.config import TrainConfig
from fastgrpo.models.lora_train import MERGED
from fastgrpo.train.logprobs import completion_logprobs
from fastgrpo.train.step import grpo_step, sample_completions

STEPS = (0, 22)


def engine_rollout(config, trainer, examples):
    """A rollout of the examples by the trainer's engine, with the sampler's log-probs."""
    config.algo.importance_sampling_correction = True
    try:
        return sample_completions(
            config, trainer.rollout_model, trainer.tokenizer, trainer.stop_ids, examples
        )
    finally:
        config.algo.importance_sampling_correction = False


def gaps(model, rollout, attached: dict, fused: bool) -> tuple[float, float, torch.Tensor]:
    """(mean, max) |trainer - sampler| over the kept tokens, and the trainer's log-probs, with
    `attached` ({module: merged weights}) set on the model while it scores."""
    for module, merged in attached.items():
        module.__dict__[MERGED] = merged
    try:
        with torch.no_grad():
            logp, _ = completion_logprobs(model, rollout, fused=fused)
    finally:
        for module in attached:
            module.__dict__.pop(MERGED, None)
    keep = rollout.completion_mask.bool()
    diff = (logp - rollout.sampling_logp)[keep].abs()
    return diff.mean().item(), diff.max().item(), logp[keep]


def trains(name: str, part: str) -> bool:
    """Whether parameter `name` of the full fine-tune trains under `--full-trains part`."""
    head = "embed_tokens" in name or "lm_head" in name
    return {"all": True, "head": head, "body": not head, "norms": "norm" in name}[part]


def measure(args, device, lora_rank: int) -> list[dict]:
    original, original_model = bench.step_config, bench.random_native_model
    made = []

    def random_model(*a, **k):
        model = original_model(*a, **k)
        if not made and not lora_rank:  # the policy; the reference is made second
            for name, param in model.named_parameters():
                param.requires_grad_(trains(name, args.full_trains))
        made.append(model)
        return model

    def step_config(a):
        config = original(a)
        if args.learning_rate is not None:
            config.train.learning_rate = args.learning_rate
        return config

    bench.step_config, bench.random_native_model = step_config, random_model
    try:
        config, trainer, examples = bench.synthetic_trainer(args, device, lora_rank=lora_rank)
    finally:
        bench.step_config, bench.random_native_model = original, original_model
    torch.manual_seed(0)
    fused = device.type == "cuda"
    rows, done = [], 0
    for steps in STEPS:
        for _ in range(steps - done):
            grpo_step(config, trainer, examples)
        done = steps
        rollout = engine_rollout(config, trainer, examples)
        model = trainer.model
        merged = {m: m.__dict__.pop(MERGED) for m in model.modules() if MERGED in m.__dict__}
        ways = {}
        if lora_rank:
            ways["LoRA, merged forward"] = gaps(model, rollout, merged, fused)
            ways["LoRA, low-rank"] = gaps(model, rollout, {}, fused)
            ways["LoRA, plain merged"] = gaps(trainer.lora_rollout.model, rollout, {}, fused)
        else:
            ways["full"] = gaps(model, rollout, {}, fused)
        for module, weight in merged.items():  # as the trainer had them
            module.__dict__[MERGED] = weight
        same = None
        if lora_rank:
            a, c = ways["LoRA, merged forward"][2], ways["LoRA, plain merged"][2]
            same = bool(torch.equal(a, c))
        for name, (mean, worst, _) in ways.items():
            row = {"way": name, "steps": steps, "mean": mean, "max": worst}
            if same is not None and name == "LoRA, merged forward":
                row["bitwise_plain_merged"] = same
            rows.append(row)
    del trainer
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learning-rate", type=float, default=None, help="(default: the bench's)")
    parser.add_argument("--full-trains", choices=("all", "head", "body", "norms"), default="all")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (CPU smoke test)")
    cli = parser.parse_args()
    args = argparse.Namespace(
        shape="tiny" if cli.tiny else "0.5B",
        prompts=8,
        samples=8,
        prompt_len=128,
        completion_len=256,
        beta=0.04,
        micro_batch_tokens=TrainConfig.micro_batch_tokens,
        steps=max(STEPS),
        warmup=0,
        master_weights="auto",
        cuda_graphs="auto",
        learning_rate=cli.learning_rate,
        full_trains=cli.full_trains,
    )
    device = torch.device(cli.device)
    rows = measure(args, device, 16) + measure(args, device, 0)
    print(f"{'way':24s} {'steps':>5s} {'mean':>10s} {'max':>10s}")
    for r in rows:
        note = "  (bitwise the plain merged model's)" if r.get("bitwise_plain_merged") else ""
        print(f"{r['way']:24s} {r['steps']:5d} {r['mean']:10.3e} {r['max']:10.3e}{note}")
    record = {"lab": "lora_logp_gap", "learning_rate": cli.learning_rate, "rows": rows}
    print(json.dumps(record | {"full_trains": cli.full_trains}))


if __name__ == "__main__":
    main()

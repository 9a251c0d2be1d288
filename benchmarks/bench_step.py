"""One whole GRPO step, end to end: fastgrpo's trainer, and Hugging Face TRL's GRPOTrainer.

Workload as in issue 5 and benchmarks/PEERS.md ("End to end"): Qwen2.5-0.5B shape (or --shape 1.5B),
random weights (bf16 on a GPU, fp32 on the CPU), 8 prompts x 8 completions, prompt 128 tokens,
every completion forced to 256 tokens, one optimizer update per rollout (num_iterations 1, one
mini-batch), beta 0.04 (a frozen reference model scores every completion), no gradient
checkpointing, AdamW (by default over fp32 master weights of the bf16 ones: --master-weights).

What is timed is what users run: `grpo_step` of `fastgrpo.train.step` on a Trainer made by
`build_trainer`, as `fastgrpo train` makes it; only the models (random weights) and the tokenizer
come from here.

Forced lengths. The tokenizer is synthetic: the words "t0" .. "t{V-1}" are the model's V token ids,
and its one special token (EOS and pad) has id V, which the model cannot sample: its logits have
V entries. No completion stops early, so every method does the same work (bench_rollout.py forces
lengths the same way, with a stop id of V). Prompts are random words, 128 tokens each, with no chat
template; completions are decoded to text for the rewards, as in a real run. TRL gets the same
tokenizer, whose EOS id TRL gives `generate`, so its completions are forced the same way.

Reward. The reward hashes the completion text to [0, 1): distinct completions get distinct
rewards (almost surely), so within every group the rewards differ and every advantage is
non-zero. With ties, the work of a step would depend on luck: at beta 0 the trainer leaves
zero-advantage rows out of the update, and the fused LM-head backward skips rows whose gradient
is zero. Here every row is trained, as in TRL, which never skips.

TRL (--trl, when `trl` and `datasets` import): GRPOTrainer on a Qwen2ForCausalLM of the same shape
and weight distribution, saved to a temporary folder from which TRL loads the policy and the
reference; per-device batch x gradient accumulation = all rows, so one generation and one
optimizer step per TRL step, as here; TRL's defaults changed to match: loss_type "grpo" (not
"dapo"), no gradient checkpointing, constant learning rate; bf16 autocast. Its step time is the
wall time between TRL's step ends. Seen working on the CPU with trl 1.16.0 and datasets 4.8.0
(datasets 5.2.0's Dataset.from_dict failed there, on Python 3.11, pickling pyarrow's MonthDayNano),
and on the lent H100 with trl 1.16.0, datasets 4.8.5, dill 0.4.1 and multiprocess 0.70.19 carried
as wheels (the image has pyarrow, pandas, xxhash and fsspec): results/step_trl_h100.json.

Reported per method: seconds per step (median of the timed steps, after warm-up steps that pay
for allocation, Triton compilation and CUDA graph capture), completion tokens/s, fastgrpo's
phases (its time/* step metrics, medians), and peak GPU memory (torch.cuda.max_memory_allocated,
less what the process held before the method started). Prints a table, then one JSON line.

Run on a CUDA GPU:  python -m benchmarks.bench_step [--shape 1.5B] [--trl] [--lora 16 [--no-full]]
Smoke test on CPU:  python -m benchmarks.bench_step --tiny --device cpu --steps 1 --warmup 0
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_rollout import (  # noqa: E402
    SHAPES,
    hf_config,
    print_result_line,
    random_native_model,
    randomize,
)
from fastgrpo.config import Config, TrainConfig, validate  # noqa: E402
from fastgrpo.data import Example  # noqa: E402
from fastgrpo.train.memory_estimate import estimate_memory  # noqa: E402
from fastgrpo.train.step import grpo_step  # noqa: E402
from fastgrpo.train.trainer import attach_adapters, build_trainer, lora_settings  # noqa: E402

END = "<|endoftext|>"  # EOS and pad; its id, the vocabulary size, is one the model cannot sample
PHASES = ("rollout", "reward", "reference", "old_logprobs", "update", "optimizer")


def distinct_reward(prompts, completions, **columns) -> list[float]:
    """A deterministic hash of each completion's text, in [0, 1): distinct texts, distinct
    rewards, so no group has ties and no advantage is zero (see the module docstring)."""
    digests = (hashlib.blake2b(text.encode(), digest_size=8).digest() for text in completions)
    return [int.from_bytes(d, "big") / 2**64 for d in digests]


def tied_reward(share: float):
    """`distinct_reward`, except that a `share` of prompts (chosen by a hash of the prompt, so
    prompts drawn later are tied at the same rate) gives every completion the same reward: those
    groups teach nothing, as on a task that is too easy or too hard (--zero-variance)."""

    def reward(prompts, completions, **columns) -> list[float]:
        scores = distinct_reward(prompts, completions)
        for i, prompt in enumerate(prompts):
            digest = hashlib.blake2b(str(prompt).encode(), digest_size=8).digest()
            if int.from_bytes(digest, "big") / 2**64 < share:
                scores[i] = 0.5
        return scores

    return reward


def synthetic_tokenizer(vocab_size: int):
    """Words "t0" .. "t{V-1}" are ids 0 .. V-1, split on whitespace; END (id V) is EOS and pad."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab_size)}
    words[END] = vocab_size
    core = Tokenizer(models.WordLevel(vocab=words, unk_token=END))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=END, pad_token=END, unk_token=END
    )
    tokenizer.padding_side = "left"
    return tokenizer


def random_prompts(count: int, length: int, vocab_size: int, tokenizer, seed: int = 0) -> list[str]:
    """`count` prompts of `length` random words; each is exactly `length` tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (count, length), generator=gen).tolist()
    texts = [" ".join(f"t{i}" for i in row) for row in ids]
    lengths = {len(row) for row in tokenizer(texts, add_special_tokens=False)["input_ids"]}
    assert lengths == {length}, lengths
    return texts


def step_config(args) -> Config:
    """The trainer's settings for this workload; everything else is fastgrpo's default."""
    config = Config()
    config.rollout.prompts_per_step = args.prompts
    config.rollout.num_generations = args.samples
    config.rollout.max_new_tokens = args.completion_len
    config.rollout.temperature = 1.0
    config.algo.beta = args.beta
    config.train.num_iterations = 1
    config.train.mini_batches = 1
    config.train.micro_batch_tokens = args.micro_batch_tokens
    config.train.steps = args.warmup + args.steps
    config.model.gradient_checkpointing = getattr(args, "gradient_checkpointing", False)
    config.train.master_weights = getattr(args, "master_weights", "auto")
    config.train.parallel = getattr(args, "parallel", "auto")  # bench_scaling.py's jobs
    config.train.fsdp_free_engine_copy = getattr(args, "free_engine_copy", False)
    config.train.cuda_graphs = getattr(args, "cuda_graphs", "auto")
    share = getattr(args, "zero_variance", 0.0)
    config.rewards = [{"function": tied_reward(share) if share else distinct_reward}]
    config.algo.dynamic_sampling = getattr(args, "dynamic_sampling", False)
    validate(config)
    return config


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_baseline(device) -> int:
    """Bytes held now (other methods' leftovers); the peak counter restarts from here."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_gib(device, baseline: int) -> float | None:
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated(device) - baseline) / 2**30


def fastgrpo_trainer(
    args, device, dtype, tokenizer, prompts, world=None, lora_rank=0, lora_merge=True
):
    """(config, trainer, examples) for this workload: random policy (and reference) models;
    `world`: the data-parallel job the trainer is a rank of (bench_scaling.py); `lora_rank`:
    adapters of that rank on every linear layer (alpha = 2 x rank), the reference the base;
    `lora_merge`: lora.merge_for_rollout."""
    config = step_config(args)
    model = random_native_model(args.shape, device, dtype)
    lora = None
    if lora_rank:
        config.lora.rank, config.lora.alpha = lora_rank, 2.0 * lora_rank
        config.lora.merge_for_rollout = lora_merge
        lora = lora_settings(config)
        attach_adapters(model, lora)
    ref_model = random_native_model(args.shape, device, dtype) if args.beta and not lora else None
    trainer = build_trainer(config, model, tokenizer, ref_model, world=world, lora=lora)
    return config, trainer, [Example(prompt=text, answer="0") for text in prompts]


def synthetic_trainer(args, device, lora_rank=0):
    """`fastgrpo_trainer` for this workload with its own synthetic tokenizer and random prompts,
    in bf16 on a GPU and fp32 on a CPU: what the lab scripts and tests build to profile a step."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vocab = SHAPES[args.shape]["vocab_size"]
    tokenizer = synthetic_tokenizer(vocab)
    prompts = random_prompts(args.prompts, args.prompt_len, vocab, tokenizer)
    return fastgrpo_trainer(args, device, dtype, tokenizer, prompts, lora_rank=lora_rank)


def run_fastgrpo(args, device, dtype, tokenizer, prompts, lora_rank=0, lora_merge=True) -> dict:
    baseline = memory_baseline(device)
    config, trainer, examples = fastgrpo_trainer(
        args, device, dtype, tokenizer, prompts, lora_rank=lora_rank, lora_merge=lora_merge
    )
    torch.manual_seed(0)
    seconds, records = [], []
    drawn = iter(range(1, 10**6))  # dynamic sampling's further batches: fresh random prompts
    vocab = SHAPES[args.shape]["vocab_size"]

    def more_examples():
        texts = random_prompts(args.prompts, args.prompt_len, vocab, tokenizer, seed=next(drawn))
        return [Example(prompt=text, answer="0") for text in texts]

    for _ in range(args.warmup + args.steps):
        synchronize(device)
        start = time.perf_counter()
        records.append(grpo_step(config, trainer, examples, more_examples))
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    timed = records[args.warmup :]
    peak = None
    if device.type == "cuda":  # grpo_step restarts the peak counter as each step starts
        peak = max(r["peak_memory_gib"] for r in timed) - baseline / 2**30
    name = (
        "fastgrpo" if args.master_weights == "auto" else f"fastgrpo, masters {args.master_weights}"
    )
    if lora_rank:
        name = f"fastgrpo, LoRA r={lora_rank}" + ("" if lora_merge else ", adapters in the engine")
    if config.algo.dynamic_sampling:
        name += ", dynamic sampling"
    row = summary(
        name,
        seconds[args.warmup :],
        [r["completion/mean_length"] * len(examples) * args.samples for r in timed],
        peak,
        lengths=(
            min(r["completion/min_length"] for r in timed),
            max(r["completion/max_length"] for r in timed),
        ),
    )
    if device.type == "cuda":  # fastgrpo check's prediction for this workload, beside the peak
        total = torch.cuda.get_device_properties(device).total_memory
        estimate = estimate_memory(config, trainer.model, args.prompt_len, device_bytes=total)
        row["predicted_peak_gib"] = estimate.peak / 2**30
    row["phases"] = {p: statistics.median(r[f"time/{p}"] for r in timed) for p in PHASES}
    row["zero_std_groups"] = statistics.mean(r["frac_zero_std_groups"] for r in timed)
    if config.algo.dynamic_sampling:
        row["rollouts_per_step"] = statistics.mean(r["dynamic_sampling/rounds"] for r in timed)
    row["logp_gap"] = sampler_gap(config, trainer, examples)
    del trainer
    return row


def sampler_gap(config, trainer, examples) -> dict:
    """|sampler - trainer| log-probs of one more step's tokens (mean, max): that step scores the
    old log-probs (importance_sampling_correction's metrics); untimed."""
    config.algo.importance_sampling_correction = True
    config.algo.importance_sampling_mode = "token_mask"
    record = grpo_step(config, trainer, examples)
    config.algo.importance_sampling_correction = False
    key = "sampling/sampling_logp_difference/"
    return {"mean": record[key + "mean"], "max": record[key + "max"]}


def summary(method, seconds, tokens, peak, *, lengths) -> dict:
    median = statistics.median(seconds)
    return {
        "method": method,
        "seconds_per_step": median,
        "step_seconds": seconds,
        "completion_tokens_per_s": statistics.median(tokens) / median,
        "peak_memory_gib": peak,
        "completion_length": [int(n) for n in lengths],
    }


def trl_batch_rows(args) -> int:
    """TRL's per-device batch: the largest divisor of the step's rows that fits the token budget
    fastgrpo's micro-batches use, so both accumulate gradients over similar micro-batches."""
    rows = args.prompts * args.samples
    fits = max(1, args.micro_batch_tokens // (args.prompt_len + args.completion_len))
    return max(d for d in range(1, rows + 1) if rows % d == 0 and d <= fits)


def run_trl(args, device, dtype, tokenizer, prompts) -> dict | None:
    """TRL's GRPOTrainer on the same workload: one optimizer step per generation of all rows."""
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as error:
        print(f"note: TRL left out ({error}); `pip install trl` to compare")
        return None
    baseline = memory_baseline(device)
    with tempfile.TemporaryDirectory(prefix="bench_step_trl_") as folder:
        return trl_steps(args, device, dtype, tokenizer, prompts, Path(folder), baseline)


def trl_steps(args, device, dtype, tokenizer, prompts, folder: Path, baseline: int) -> dict:
    import trl
    from datasets import Dataset
    from transformers import PrinterCallback, Qwen2ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    with torch.device(device):  # TRL loads the policy and the reference from a folder
        model = Qwen2ForCausalLM(hf_config(args.shape)).to(dtype)  # no EOS id of its own
    randomize(model)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    del model

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []  # after each step (and at the start)

        def on_train_begin(self, *_, **__):
            synchronize(device)
            self.ends.append(time.perf_counter())

        def on_step_end(self, trainer_args, state, control, **__):
            synchronize(device)
            self.ends.append(time.perf_counter())
            if state.global_step == args.warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

    rows = trl_batch_rows(args)
    config = GRPOConfig(
        output_dir=str(folder / "out"),
        model_init_kwargs={"dtype": str(dtype).removeprefix("torch.")},
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=args.prompts * args.samples // rows,  # one update per rollout
        num_generations=args.samples,
        max_completion_length=args.completion_len,
        num_iterations=1,
        beta=args.beta,
        loss_type="grpo",
        temperature=1.0,
        learning_rate=TrainConfig.learning_rate,
        lr_scheduler_type="constant",
        adam_beta2=TrainConfig.adam_beta2,
        gradient_checkpointing=args.gradient_checkpointing,
        bf16=dtype == torch.bfloat16,
        use_cpu=device.type == "cpu",
        cache_implementation=args.trl_cache,
        max_steps=args.warmup + args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    peft_config = None
    if args.lora:  # peft's adapters on every linear layer; TRL's reference is the base then
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
            target_modules="all-linear", task_type="CAUSAL_LM",
        )  # fmt: skip
    clock = StepClock()
    trainer = GRPOTrainer(
        model=str(folder / "model"),
        reward_funcs=[distinct_reward],
        args=config,
        # every step's prompts in one epoch: no epoch boundaries between the steps
        train_dataset=Dataset.from_dict({"prompt": prompts * (args.warmup + args.steps)}),
        processing_class=tokenizer,
        callbacks=[clock],
        peft_config=peft_config,
    )
    trainer.remove_callback(PrinterCallback)  # its per-step log lines would bury the table
    assert trainer.args.gradient_checkpointing == args.gradient_checkpointing  # TRL's default: on
    trainer.train()
    steps = [(b - a) for a, b in zip(clock.ends, clock.ends[1:])][args.warmup :]
    logs = [entry for entry in trainer.state.log_history if "completions/min_length" in entry]
    logs = logs[args.warmup :]
    row = summary(
        "TRL GRPOTrainer"
        + (f" + peft LoRA r={args.lora}" if args.lora else "")
        + (f", {args.trl_cache} cache" if args.trl_cache else ""),
        steps,
        [e["completions/mean_length"] * args.prompts * args.samples for e in logs],
        peak_gib(device, baseline),
        lengths=(
            min(e["completions/min_length"] for e in logs),
            max(e["completions/max_length"] for e in logs),
        ),
    )
    row["zero_std_groups"] = max(e.get("frac_reward_zero_std", 0.0) for e in logs)
    row["trl"] = trl.__version__
    row["per_device_train_batch_size"] = rows
    del trainer
    return row


def print_table(results, forced: int) -> None:
    print(
        f"{'method':<44} {'s/step':>8} {'tok/s':>9} {'peak GiB':>9} {'predicted':>9}  "
        + " ".join(f"{p:>12}" for p in PHASES)
    )
    for r in results:
        peak = "-" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}"
        predicted = r.get("predicted_peak_gib")
        predicted = "-" if predicted is None else f"{predicted:.2f}"
        phases = r.get("phases", {})
        cells = " ".join(f"{phases[p]:>12.4f}" if p in phases else f"{'-':>12}" for p in PHASES)
        print(
            f"{r['method']:<44} {r['seconds_per_step']:>8.3f} "
            f"{r['completion_tokens_per_s']:>9,.0f} {peak:>9} {predicted:>9}  {cells}"
        )
        if r.get("zero_std_groups") or "rollouts_per_step" in r:
            print(
                f"  groups of equal rewards in the trained batch: {r['zero_std_groups']:.1%}"
                + (
                    f"; rollouts per step {r['rollouts_per_step']:.2f}"
                    if "rollouts_per_step" in r
                    else ""
                )
            )
        if "logp_gap" in r:
            gap = r["logp_gap"]
            print(f"  |sampler - trainer| log-probs: mean {gap['mean']:.2e}, max {gap['max']:.2e}")
        if r["completion_length"] != [forced, forced]:
            print(f"  warning: completion lengths {r['completion_length']}, not all {forced}")
    if len(results) == 2:
        ratio = results[1]["seconds_per_step"] / results[0]["seconds_per_step"]
        print(f"{results[1]['method']} takes {ratio:.2f}x the time of {results[0]['method']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("0.5B", "1.5B", "7B"), default="0.5B")
    parser.add_argument("--tiny", action="store_true", help="a tiny model shape (CPU smoke test)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--completion-len", type=int, default=256, help="forced length")
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient (0: no ref)")
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=TrainConfig.micro_batch_tokens,
        help="train.micro_batch_tokens (default: fastgrpo's default)",
    )
    parser.add_argument(
        "--master-weights",
        choices=("auto", "fp32", "off"),
        default="auto",
        help="train.master_weights (auto: fp32 masters of the bf16 weights)",
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--cuda-graphs",
        choices=("auto", "off"),
        default="auto",
        help="train.cuda_graphs: the update's layers as CUDA graphs (auto) or eager (off)",
    )
    parser.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer")
    parser.add_argument(
        "--lora", type=int, default=0, metavar="R", help="also a LoRA run: rank R, all linears"
    )
    parser.add_argument(
        "--lora-rollout",
        choices=("merged", "adapters", "both"),
        default="merged",
        help="lora.merge_for_rollout true (merged), false (adapters), or a run of each",
    )
    parser.add_argument(
        "--no-full", action="store_true", help="skip the full fine-tune (with --lora: 7B)"
    )
    parser.add_argument(
        "--trl-cache", choices=("static",), help="TRL's cache_implementation for generate"
    )
    parser.add_argument(
        "--zero-variance",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="this share of prompts gets one reward for all its completions (0.47: the quick start's)",
    )
    parser.add_argument(
        "--dynamic-sampling",
        dest="also_dynamic_sampling",
        action="store_true",
        help="also a run with algo.dynamic_sampling (with --zero-variance: what it costs)",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="model.gradient_checkpointing (and TRL's): recompute each layer in the backward",
    )
    args = parser.parse_args()
    if args.tiny:
        args.shape = "tiny"
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vocab = SHAPES[args.shape]["vocab_size"]
    tokenizer = synthetic_tokenizer(vocab)
    prompts = random_prompts(args.prompts, args.prompt_len, vocab, tokenizer)

    results = [] if args.no_full else [run_fastgrpo(args, device, dtype, tokenizer, prompts)]
    for merge in {"merged": [True], "adapters": [False], "both": [True, False]}[args.lora_rollout]:
        if args.lora:
            run = run_fastgrpo(args, device, dtype, tokenizer, prompts, args.lora, merge)
            results.append(run)
    if args.also_dynamic_sampling:
        sampling = argparse.Namespace(**{**vars(args), "dynamic_sampling": True})
        results.append(run_fastgrpo(sampling, device, dtype, tokenizer, prompts))
    if args.trl:
        trl_row = run_trl(args, device, dtype, tokenizer, prompts)
        if trl_row is not None:
            results.append(trl_row)
    print_table(results, args.completion_len)
    workload = {
        "shape": args.shape,
        "dtype": str(dtype).removeprefix("torch."),
        "prompts": args.prompts,
        "samples": args.samples,
        "prompt_len": args.prompt_len,
        "completion_len": args.completion_len,
        "beta": args.beta,
        "micro_batch_tokens": args.micro_batch_tokens,
        "master_weights": args.master_weights,
        "lora_rank": args.lora,
        "lora_rollout": args.lora_rollout,
        "cuda_graphs": args.cuda_graphs,
        "gradient_checkpointing": args.gradient_checkpointing,
        "zero_variance": args.zero_variance,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    print_result_line("step", results, device=device, workload=workload)


if __name__ == "__main__":
    main()

"""Learning against TRL on a real model: held-out accuracy before and after the default job.

The job is the quick start's (`fastgrpo train` with its defaults: SmolLM2-135M-Instruct on the
arithmetic task, 30 GRPO steps of 4 prompts x 8 samples, lr 1e-5), evaluated greedily on the
first 200 held-out problems every 10 steps by fastgrpo's own evaluator, the same for every run.

- fastgrpo runs with its default settings for the device (on a GPU: bf16 weights stepped through
  fp32 master weights), in this process: first a cold run (seed 0: Triton compiles its kernels),
  then one run per seed, warm. `--nproc N` runs each as `fastgrpo train --nproc N` (data
  parallel over N GPUs, the same global batch), a process per run.
- TRL's GRPOTrainer (when `trl` and `datasets` import) runs the same settings, prompts, reward
  and evaluation with fp32 parameters, one run per seed.

Training time is the sum of the 30 steps' times (rollout, reward, update), evaluations left out.
Prints a table, then one JSON line; `--out` receives the JSON and an accuracy-against-time PNG
(matplotlib; `--plot RESULT.json` redraws a PNG from a saved result).

    python -m benchmarks.bench_learning --model SmolLM2-135M-Instruct.Q4_1.gguf --out DIR
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_rollout import commit  # noqa: E402
from benchmarks.bench_scaling import error_tail
from fastgrpo.config import load_config  # noqa: E402
from fastgrpo.distributed.fsdp import read_fp32_weights
from fastgrpo.distributed.sharded import read_one_process_state
from fastgrpo.models import load_model, stop_token_ids
from fastgrpo.models.loading import load_tokenizer
from fastgrpo.models.sources import resolve_device, resolve_dtype, resolve_model
from fastgrpo.rewards import RewardSet, math_accuracy
from fastgrpo.rollout import release_engine
from fastgrpo.train import run_training
from fastgrpo.train.checkpoint import latest_checkpoint, load_trainer_state
from fastgrpo.train.evaluate import evaluate
from fastgrpo.train.trainer import build_task_data


def job_overrides(args, seed: int) -> list[str]:
    """The default job, evaluated on args.eval_problems problems every args.eval_every steps."""
    return [
        f"model.name={args.model}",
        f"model.device={args.device}",
        f"train.seed={seed}",
        f"train.steps={args.steps}",
        f"eval.num_problems={args.eval_problems}",
        f"eval.every_steps={args.eval_every}",
        "run.progress=false",
        "run.save_every=0",
    ] + list(args.set)


def fastgrpo_precision(args, seed: int) -> str:
    config = load_config(overrides=job_overrides(args, seed))
    dtype = resolve_dtype(config.model.dtype, resolve_device(config.model.device))
    masters = dtype != torch.float32 and config.train.master_weights != "off"
    rounding = f", {config.train.bf16_rounding} rounding" if masters else ""
    return str(dtype).removeprefix("torch.") + (
        f" + fp32 master weights{rounding}" if masters else ""
    )


def held_out_accuracy(args, seed: int, model, tokenizer) -> float:
    """fastgrpo's evaluation of the job (greedy, the first args.eval_problems problems)."""
    config = load_config(overrides=job_overrides(args, seed))
    scores = evaluate(
        model,
        tokenizer,
        build_task_data(config).eval[: args.eval_problems],
        rewards=RewardSet.from_specs(config.rewards),
        stop_ids=stop_token_ids(tokenizer, model),
        system_prompt=config.task.system_prompt,
        max_new_tokens=config.eval.max_new_tokens or config.rollout.max_new_tokens,
        batch_size=config.eval.batch_size,
        seed=seed,
    )
    return scores["accuracy"]


def masters_accuracy(args, seed: int, out_dir: Path) -> float | None:
    """The trained fp32 master weights (the final checkpoint's), evaluated in fp32: how much of
    the bf16 model's accuracy is its bf16 inference. None for a run without masters."""
    state = load_trainer_state(latest_checkpoint(out_dir))["optimizer"]
    model, tokenizer, _ = load_model(args.model, dtype="float32", device=args.device)
    if state.get("layout") == "fsdp":  # FSDP's shards are the fp32 weights themselves
        state = {"master_weights": read_fp32_weights(state, model)}
    elif "shards" in state:  # a sharded job's: every parameter was bf16 with an fp32 master
        state = read_one_process_state(state, list(model.parameters()), lambda p: True)
    if not state.get("master_weights"):
        return None
    with torch.no_grad():
        params = [p for p in model.parameters() if p.requires_grad]  # ModelOptimizer's order
        for param, master in zip(params, state["master_weights"], strict=True):
            param.copy_(master)
    accuracy = held_out_accuracy(args, seed, model, tokenizer)
    release_engine(model)  # its KV cache would stay until a garbage collection
    del model
    return accuracy


def train_fastgrpo(args, seed: int, out_dir: Path) -> None:
    """The job in this process, or (`--nproc N`) as `fastgrpo train --nproc N` runs it."""
    overrides = job_overrides(args, seed) + [f"run.output_dir={out_dir}"]
    if args.nproc == 1:
        run_training(None, overrides=overrides)
        return
    command = [sys.executable, "-m", "fastgrpo", "train", "--nproc", str(args.nproc)]
    done = subprocess.run(
        command + [f"--set={o}" for o in overrides], capture_output=True, text=True
    )
    if done.returncode:
        sys.exit(f"fastgrpo train --nproc {args.nproc} failed:\n" + error_tail(done.stderr))


def run_fastgrpo(args, seed: int, out_dir: Path) -> dict:
    start = time.perf_counter()
    train_fastgrpo(args, seed, out_dir)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/step" in r]
    evals = {r["step"]: r["accuracy"] for r in records if r.get("kind") == "eval"}
    after = {r["when"]: r["accuracy"] for r in records if r.get("kind") == "eval"}["after"]
    elapsed, curve = 0.0, [(0.0, evals[0])]
    for record in steps:
        elapsed += record["time/step"]
        if record["step"] in evals:
            curve.append((elapsed, evals[record["step"]]))
    return {
        "method": "fastgrpo",
        "seed": seed,
        "before": evals[0],
        "after": after,
        "train_seconds": elapsed,
        "wall_seconds": wall,
        "peak_memory_gib": max(r["peak_memory_gib"] for r in steps),
        "curve": curve,
        "precision": fastgrpo_precision(args, seed),
        "after_fp32_eval": masters_accuracy(args, seed, out_dir),
    }


def run_trl(args, seed: int, out_dir: Path, autocast: bool = False) -> dict:
    """TRL's GRPOTrainer on the same job with fp32 parameters (`autocast`: its bf16 mixed
    precision, bf16 compute over the fp32 parameters); fastgrpo's evaluator."""
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from fastgrpo.data import render_prompt

    config = load_config(overrides=job_overrides(args, seed))
    task = build_task_data(config)
    source = resolve_model(args.model)  # TRL loads the policy itself, from this folder
    tokenizer = load_tokenizer(source)
    model_dir = source.path
    r, t, a = config.rollout, config.train, config.algo
    device = torch.device(args.device if args.device != "auto" else "cuda")

    class Clock(TrainerCallback):
        """Step ends and evaluations; the evaluations' time is left out of the training time."""

        def __init__(self):
            self.elapsed = 0.0
            self.curve: list[tuple[float, float]] = []
            self.last = None

        def evaluate(self, trainer_model) -> float:
            trainer_model.eval()
            accuracy = held_out_accuracy(args, seed, trainer_model, tokenizer)
            trainer_model.train()
            return accuracy

        def on_train_begin(self, _args, state, control, model=None, **__):
            self.curve.append((0.0, self.evaluate(model)))
            torch.cuda.synchronize(device)
            self.last = time.perf_counter()

        def on_step_end(self, _args, state, control, model=None, **__):
            torch.cuda.synchronize(device)
            now = time.perf_counter()
            self.elapsed += now - self.last
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                self.curve.append((self.elapsed, self.evaluate(model)))
            torch.cuda.synchronize(device)
            self.last = time.perf_counter()

    prompts = [render_prompt(tokenizer, ex.prompt, config.task.system_prompt) for ex in task.train]
    answers = [ex.columns["answer"] for ex in task.train]
    trl_config = GRPOConfig(
        output_dir=str(out_dir),
        model_init_kwargs={"dtype": "float32"},
        per_device_train_batch_size=r.prompts_per_step * r.num_generations,
        gradient_accumulation_steps=1,
        num_generations=r.num_generations,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        num_iterations=t.num_iterations,
        beta=a.beta,
        epsilon=a.epsilon_low,
        loss_type=a.loss_type,
        scale_rewards=a.scale_rewards,
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_eps,
        max_grad_norm=t.max_grad_norm,
        gradient_checkpointing=False,
        bf16=autocast,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
    )
    clock = Clock()
    torch.cuda.reset_peak_memory_stats(device)

    def accuracy(prompts, completions, answer, **_):
        return math_accuracy(prompts, completions, answer)

    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[accuracy],
        args=trl_config,
        train_dataset=Dataset.from_dict({"prompt": prompts, "answer": answers}),
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    import trl

    row = {
        "method": f"TRL {trl.__version__} GRPOTrainer, fp32"
        + (" + bf16 autocast" if autocast else ""),
        "seed": seed,
        "before": clock.curve[0][1],
        "after": clock.curve[-1][1],
        "train_seconds": clock.elapsed,
        "wall_seconds": wall,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "curve": clock.curve,
        "precision": "float32 weights, bf16 autocast" if autocast else "float32",
    }
    bf16_copy = copy.deepcopy(trainer.model).to(torch.bfloat16).eval()
    row["after_bf16_eval"] = held_out_accuracy(args, seed, bf16_copy, tokenizer)
    del trainer, bf16_copy
    torch.cuda.empty_cache()
    return row


def summarize(rows: list[dict]) -> dict:
    out = {
        "before_mean": statistics.mean(r["before"] for r in rows),
        "after_mean": statistics.mean(r["after"] for r in rows),
        "train_seconds_mean": statistics.mean(r["train_seconds"] for r in rows),
    }
    for key in ("after_fp32_eval", "after_bf16_eval"):
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            out[key + "_mean"] = statistics.mean(values)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    colors = {"fastgrpo": "tab:blue"}
    for row in result["runs"]:
        if row.get("cold"):
            continue
        name = (
            "fastgrpo"
            if row["method"] == "fastgrpo"
            else row["method"].split(" GRPO")[0]
            + (" (bf16 autocast)" if "autocast" in row["method"] else " (fp32)")
        )
        color = colors.get(
            row["method"], "tab:green" if "autocast" in row["method"] else "tab:orange"
        )
        times, accuracies = zip(*row["curve"])
        axes.plot(
            times,
            accuracies,
            marker="o",
            color=color,
            alpha=0.8,
            label=name if row["seed"] == result["seeds"][0] else None,
        )
    axes.set_xscale("symlog", linthresh=1.0)
    axes.set_xlabel("training time, s (evaluation left out; symlog scale)")
    axes.set_ylabel(f"held-out accuracy ({result['eval_problems']} problems, greedy)")
    axes.set_title(
        f"SmolLM2-135M-Instruct, arithmetic, {result['steps']} GRPO steps, "
        f"seeds {result['seeds']}\n{result['gpu']}",
        fontsize=9,
    )
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def print_table(result: dict) -> None:
    print(
        f"\n{'method':<34} {'seed':>5} {'before':>7} {'after':>7} {'other':>6} {'train s':>8} "
        f"{'wall s':>7} {'peak GiB':>9}"
    )
    print("(other: the trained weights evaluated in the other precision, fp32 or bf16)")
    for row in result["runs"]:
        seed = f"{row['seed']}" + (" cold" if row.get("cold") else "")
        other = row.get("after_fp32_eval", row.get("after_bf16_eval"))
        other = "-" if other is None else f"{other:.3f}"
        print(
            f"{row['method']:<34} {seed:>5} {row['before']:>7.3f} {row['after']:>7.3f} "
            f"{other:>6} {row['train_seconds']:>8.1f} {row['wall_seconds']:>7.1f} "
            f"{row['peak_memory_gib']:>9.2f}"
        )
    for name, summary in result["summary"].items():
        print(
            f"{name}: mean before {summary['before_mean']:.3f}, after "
            f"{summary['after_mean']:.3f}, training {summary['train_seconds_mean']:.1f} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eval-problems", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--set", action="append", default=[], help="extra fastgrpo overrides")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=("fastgrpo", "trl", "trl-autocast"),
        default=["fastgrpo", "trl"],
        help="trl: TRL with fp32 parameters; trl-autocast: the same under TRL's bf16 autocast",
    )
    parser.add_argument("--nproc", type=int, default=1, help="fastgrpo's job on N GPUs (torchrun)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_learning"))
    parser.add_argument("--plot", type=Path, help="redraw the PNG of a saved result JSON")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    if "fastgrpo" in args.methods:
        cold = run_fastgrpo(args, args.seeds[0], args.out / "fastgrpo-cold")
        runs.append({**cold, "cold": True})
        for seed in args.seeds:
            runs.append(run_fastgrpo(args, seed, args.out / f"fastgrpo-s{seed}"))
            print(f"fastgrpo seed {seed}: {runs[-1]['before']:.3f} -> {runs[-1]['after']:.3f}")
    trl_methods = [m for m in args.methods if m.startswith("trl")]
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as error:
        if trl_methods:
            print(f"note: TRL left out ({error}); `pip install trl datasets` to compare")
        trl_methods = []
    for method in trl_methods:
        for seed in args.seeds:
            autocast = method == "trl-autocast"
            runs.append(run_trl(args, seed, args.out / f"{method}-s{seed}", autocast))
            print(f"{method} seed {seed}: {runs[-1]['before']:.3f} -> {runs[-1]['after']:.3f}")
    warm = [r for r in runs if not r.get("cold")]
    summary = {
        method: summarize([r for r in warm if r["method"] == method])
        for method in dict.fromkeys(r["method"] for r in warm)
    }
    for row in runs:
        if row.get("cold"):
            summary["fastgrpo"]["cold_train_seconds"] = row["train_seconds"]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    result = {
        "benchmark": "bench_learning",
        "gpu": gpu,
        "torch": torch.__version__,
        "commit": commit(),
        "steps": args.steps,
        "processes": args.nproc,
        "eval_problems": args.eval_problems,
        "seeds": args.seeds,
        "overrides": args.set,
        "runs": runs,
        "summary": summary,
    }
    print_table(result)
    (args.out / "bench_learning.json").write_text(json.dumps(result, indent=1))
    try:
        plot(result, args.out / "bench_learning.png")
    except ImportError:
        print("note: no matplotlib; redraw later with --plot")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))


if __name__ == "__main__":
    main()

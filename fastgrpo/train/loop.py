"""The GRPO training loop, top to bottom: the one place that knows every phase of a step.

prompts -> G completions each -> rewards -> advantages -> reference / old log-probs
  -> K inner epochs x mini-batches x token-budget micro-batches (accumulate, clip, AdamW step)
  -> metrics, checkpoint
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from fastgrpo.algo import group_advantages, zero_std_fraction
from fastgrpo.config import Config, ConfigError, config_from_dict, validate
from fastgrpo.data import DatasetError, PromptSampler, TaskData, build_task, render_prompt
from fastgrpo.models import Transformer, load_model, stop_token_ids
from fastgrpo.rewards import RewardSet, math_accuracy
from fastgrpo.rollout import generate_rollout
from fastgrpo.train.checkpoint import (
    latest_checkpoint,
    load_trainer_state,
    save_checkpoint,
    set_rng_state,
)
from fastgrpo.train.evaluate import decode_completions, evaluate, reward_columns
from fastgrpo.train.metrics import MetricsLog, peak_memory_gib
from fastgrpo.train.optim import ModelOptimizer, build_scheduler
from fastgrpo.train.precision import rounded_away_fraction
from fastgrpo.train.profiling import PhaseTimer, StepProfiler, profiled_steps
from fastgrpo.train.update import update_policy, use_fused_lm_head
from fastgrpo.transfer import to_device

log = logging.getLogger("fastgrpo.train")


@dataclass
class TrainResult:
    run_dir: Path
    steps: int  # optimizer-loop steps completed (global, including resumed ones)
    eval_before: dict | None = None
    eval_after: dict | None = None
    history: list[dict] = field(default_factory=list)
    interrupted: bool = False
    profile_trace: Path | None = None  # the Chrome trace of run.profile_steps steps, if any


@dataclass
class Trainer:
    """Everything a step works with, built once by `build_trainer`."""

    model: object
    ref_model: object | None  # frozen reference; None when beta == 0
    tokenizer: object
    optimizer: ModelOptimizer  # AdamW, over fp32 masters of bf16 weights by default
    scheduler: object
    rewards: RewardSet
    stop_ids: list[int]


# ----------------------------------------------------------------------------- setup


def build_task_data(config: Config) -> TaskData:
    t = config.task
    options = dict(
        seed=t.seed,
        num_train=t.num_train,
        num_eval=t.num_eval,
        prompt_template=t.prompt_template,
        path=t.path,
        prompt_field=t.prompt_field,
        answer_field=t.answer_field,
        train_split=t.train_split,
        eval_split=t.eval_split,
    )
    if t.name == "arithmetic":
        options.update(
            min_value=t.min_value,
            max_value=t.max_value,
            num_operands=t.num_operands,
            operations=t.operations,
        )
    try:
        return build_task(t.name, **{k: v for k, v in options.items() if v is not None})
    except DatasetError:
        raise
    except ValueError as error:  # a knob the task refuses: say which section it belongs to
        raise ConfigError(f"task: {error}") from error


def build_rewards(config: Config) -> RewardSet:
    try:
        return RewardSet.from_specs(config.rewards)
    except ValueError as error:
        raise ConfigError(f"rewards: {error}") from error


def load_configured_model(config: Config, name: str | None = None):
    """(model, tokenizer, source) for `name` (default: model.name) with the config's model settings."""
    m = config.model
    return load_model(
        name or m.name,
        dtype=m.dtype,
        device=m.device,
        revision=m.revision,
        trust_remote_code=m.trust_remote_code,
        backend=m.backend,
    )


def check_fused_lm_head(config: Config, model) -> None:
    """A ConfigError now if train.fused_lm_head asks for kernels that cannot run on `model`."""
    try:
        use_fused_lm_head(config, model)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def build_trainer(
    config: Config, model, tokenizer, ref_model=None, *, rewards: RewardSet | None = None
) -> Trainer:
    """The Trainer for an already-made policy `model` (and, when algo.beta != 0, its frozen
    reference `ref_model`, None otherwise): sets the model up for training as configured and
    builds the optimizer, schedule, rewards (default: config.rewards) and stop ids.

    `train` builds its Trainer here; so can a caller with its own models, such as
    benchmarks/bench_step.py, and then run `grpo_step` exactly as `train` does.
    """
    check_fused_lm_head(config, model)
    if (ref_model is None) != (config.algo.beta == 0):
        raise ValueError(
            f"algo.beta={config.algo.beta} needs "
            + ("a frozen reference model" if ref_model is None else "no reference model (None)")
        )
    native = isinstance(model, Transformer)
    if config.model.gradient_checkpointing and native:
        model.activation_checkpointing = True
    elif config.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if not native:
        model.config.use_cache = True
    if ref_model is not None:
        ref_model.requires_grad_(False).eval()
    t = config.train
    check_training_precision(config, model)
    optimizer = ModelOptimizer(
        model,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
        master_weights=t.master_weights,
        rounding=t.bf16_rounding,
    )
    scheduler = build_scheduler(
        optimizer.adamw,
        kind=t.lr_scheduler,
        warmup_steps=t.warmup_steps,
        total_steps=t.steps * t.num_iterations * t.mini_batches,
    )
    return Trainer(
        model,
        ref_model,
        tokenizer,
        optimizer,
        scheduler,
        rewards if rewards is not None else build_rewards(config),
        stop_token_ids(tokenizer, model),
    )


def check_training_precision(config: Config, model) -> None:
    """Refuse fp16 training; warn when train.master_weights=off would round the updates away."""
    params = [p for p in model.parameters() if p.requires_grad]
    if any(p.dtype == torch.float16 for p in params):
        raise ConfigError(
            "model.dtype=float16 cannot train here: fp16 gradients underflow without loss "
            "scaling, which fastgrpo does not do. Use model.dtype=bfloat16 (same memory and "
            "speed, fp32's range; the default on GPUs that have it) or float32."
        )
    if config.train.master_weights == "off":
        lost = rounded_away_fraction(params, config.train.learning_rate)
        if lost > 0.5:
            log.warning(
                "train.master_weights=off: a step of lr %.3g is below half a bf16 ulp for %.0f%% "
                "of the weights, so AdamW's updates to them round away; use "
                "train.master_weights=auto (fp32 master weights) or a larger learning rate",
                config.train.learning_rate,
                100 * lost,
            )


def check_run_dir(config: Config, resume: bool) -> Path:
    """The run folder, after making sure a new run would not overwrite an old one."""
    run_dir = Path(config.run.output_dir)
    if resume:
        if latest_checkpoint(run_dir) is None:
            raise ConfigError(f"--resume: {run_dir} holds no checkpoint to continue from.")
    elif latest_checkpoint(run_dir) is not None:
        raise ConfigError(
            f"{run_dir} already holds a run. Continue it with `fastgrpo train --resume {run_dir}`, "
            f"or start a new one elsewhere with --set run.output_dir=runs/NEW."
        )
    return run_dir


def write_run_config(run_dir: Path, config: Config) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


def load_resume_config(run_dir: str | Path) -> Config:
    """The config a run folder was started with, pointed at that folder."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--resume: {run_dir} has no config.yaml; is it a fastgrpo run folder?")
    data = yaml.safe_load(path.read_text())
    config = config_from_dict(data)
    config.run.output_dir = str(run_dir)
    config.run.profile_steps = 0  # a profile is asked for per command (--profile), not inherited
    validate(config)
    return config


# ----------------------------------------------------------------------------- the loop


def train(config: Config, *, resume: bool = False) -> TrainResult:
    """Run GRPO training as configured; `resume` continues the run in `config.run.output_dir`."""
    run_dir = check_run_dir(config, resume)
    torch.manual_seed(config.train.seed)
    task = build_task_data(config)
    rewards = build_rewards(config)
    checkpoint = latest_checkpoint(run_dir) if resume else None
    model_name = str(checkpoint / "model") if checkpoint else config.model.name
    model, tokenizer, _ = load_configured_model(config, model_name)
    check_fused_lm_head(config, model)  # fail here, before loading the reference or any rollout
    ref_model = None
    if config.algo.beta != 0:
        ref_model, _, _ = load_configured_model(config)
    sampler = PromptSampler(
        len(task.train), config.rollout.prompts_per_step, seed=config.train.seed
    )
    trainer = build_trainer(config, model, tokenizer, ref_model, rewards=rewards)
    optimizer, scheduler = trainer.optimizer, trainer.scheduler
    step = 0
    if checkpoint is not None:
        state = load_trainer_state(checkpoint)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        step = state["step"]

    write_run_config(run_dir, config)  # only now: bad settings above leave no trace behind
    result = TrainResult(run_dir=run_dir, steps=step)
    metrics = MetricsLog(
        run_dir, total_steps=config.train.steps, start_step=step, show_progress=config.run.progress
    )
    profiler = StepProfiler(
        run_dir, profiled_steps(config.run.profile_steps, step, config.train.steps), model.device
    )
    evaluate_now = _evaluator(config, trainer, task, metrics)
    if config.eval.before and step == 0:
        result.eval_before = evaluate_now(step, "before")
    else:  # resumed: the evaluation before training is in the run's metrics already
        result.eval_before = metrics.find(kind="eval", when="before")
    stop = _StopRequest()
    try:
        while step < config.train.steps and not stop.requested:
            examples = [task.train[i] for i in sampler.next_batch()]
            with profiler.step(step + 1):
                record = grpo_step(config, trainer, examples)
            step += 1
            if step == profiler.last:
                _report_trace(result, metrics, profiler.finish())
            record["step"] = step
            metrics.log(record)
            result.history.append(record)
            if (
                config.eval.every_steps
                and step % config.eval.every_steps == 0
                and step < config.train.steps
            ):
                evaluate_now(step, "during")
            if (
                stop.requested
                or step == config.train.steps
                or (config.run.save_every and step % config.run.save_every == 0)
            ):
                state = {
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "sampler": sampler.state_dict(),
                }
                where = save_checkpoint(
                    run_dir,
                    step,
                    model=model,
                    tokenizer=tokenizer,
                    trainer_state=state,
                    config=config.to_dict(),
                    keep=config.run.keep_checkpoints,
                )
                if stop.requested:
                    metrics.write(
                        f"interrupted: saved {where}; continue with `fastgrpo train --resume {run_dir}`"
                    )
    finally:
        stop.restore()
        _report_trace(result, metrics, profiler.finish())  # stopped early: what was recorded
    result.steps = step
    result.interrupted = stop.requested
    if config.eval.after and not stop.requested and step == config.train.steps:
        result.eval_after = evaluate_now(step, "after")
    metrics.close()
    return result


def _report_trace(result: TrainResult, metrics: MetricsLog, path: Path | None) -> None:
    if path is not None:
        result.profile_trace = path
        metrics.write(f"profile: wrote {path} (open it in https://ui.perfetto.dev)")


def _evaluator(config: Config, trainer: Trainer, task: TaskData, metrics: MetricsLog):
    problems = task.eval[: config.eval.num_problems]

    def run(step: int, when: str) -> dict | None:
        if not problems:
            return None
        start = time.perf_counter()
        scores = evaluate(
            trainer.model,
            trainer.tokenizer,
            problems,
            rewards=trainer.rewards,
            stop_ids=trainer.stop_ids,
            system_prompt=config.task.system_prompt,
            temperature=config.eval.temperature,
            max_new_tokens=config.eval.max_new_tokens or config.rollout.max_new_tokens,
            batch_size=config.eval.batch_size,
            seed=config.train.seed,
        )
        metrics.log(
            {
                "kind": "eval",
                "when": when,
                "step": step,
                **scores,
                "time/eval": time.perf_counter() - start,
            }
        )
        metrics.write(
            f"eval ({when}, step {step}): accuracy {scores['accuracy']:.3f} "
            f"mean reward {scores['reward_mean']:.3f} on {scores['num_problems']} held-out problems"
        )
        return scores

    return run


class _StopRequest:
    """First Ctrl-C asks the loop to save and stop after the current step; a second one aborts."""

    def __init__(self):
        self.requested = False
        self._previous = signal.getsignal(signal.SIGINT)
        try:
            signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: leave Ctrl-C alone
            self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning(
            "Ctrl-C: finishing this step, saving a checkpoint and exiting (Ctrl-C again to abort)"
        )

    def restore(self):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


# ----------------------------------------------------------------------------- one step


def grpo_step(config: Config, trainer: Trainer, examples: list) -> dict:
    """One GRPO step on a batch of prompts; returns its metrics."""
    model, tokenizer, rewards = trainer.model, trainer.tokenizer, trainer.rewards
    r, a = config.rollout, config.algo
    timer = PhaseTimer(model.device)
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.device)
    step_start = time.perf_counter()
    with timer("rollout"):
        texts = [render_prompt(tokenizer, ex.prompt, config.task.system_prompt) for ex in examples]
        rollout = generate_rollout(
            model,
            tokenizer,
            texts,
            num_generations=r.num_generations,
            max_new_tokens=r.max_new_tokens,
            stop_ids=trainer.stop_ids,
            temperature=r.temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            with_sampling_logp=a.importance_sampling_correction,
        )

    with timer("reward"):
        completions = decode_completions(tokenizer, rollout)
        prompts = [ex.prompt for ex in examples for _ in range(r.num_generations)]
        columns = reward_columns(examples, r.num_generations)
        scored = rewards(prompts, completions, columns)
        reward = to_device(torch.tensor(scored.total, dtype=torch.float32), model.device)  # (B,)
        correct = rewards.values_of(math_accuracy, scored)  # the default reward: scored above
        if correct is None:
            correct = math_accuracy(prompts, completions, **columns)
        accuracy = sum(correct) / len(completions)
        advantages = group_advantages(
            reward, r.num_generations, scale=a.scale_rewards, baseline=a.baseline
        )  # (B,)

    if a.mask_truncated_completions:  # a cut-off answer teaches nothing reliable: leave it out
        rollout.completion_mask = rollout.completion_mask * rollout.finished.unsqueeze(1)
    update_metrics = update_policy(config, trainer, rollout, advantages, timer)

    lengths = rollout.lengths
    record = {
        "reward/mean": reward.mean().item(),
        "reward/std": reward.std().item() if reward.numel() > 1 else 0.0,
        "accuracy": accuracy,
        "frac_zero_std_groups": zero_std_fraction(reward, r.num_generations).item(),
        **{f"rewards/{name}": sum(v) / len(v) for name, v in scored.per_reward.items()},
        **{f"reward_failures/{name}": n for name, n in scored.failures.items() if n},
        "completion/mean_length": lengths.mean().item(),
        "completion/min_length": lengths.min().item(),
        "completion/max_length": lengths.max().item(),
        "completion/truncated_frac": (~rollout.finished).float().mean().item(),
        **update_metrics,
        "lr": trainer.scheduler.get_last_lr()[0],
        **timer.times,
    }
    step_time = time.perf_counter() - step_start
    record["time/step"] = step_time
    record["tokens_per_s"] = lengths.sum().item() / step_time
    record["peak_memory_gib"] = peak_memory_gib(model.device)
    return record

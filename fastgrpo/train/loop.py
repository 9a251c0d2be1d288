"""The GRPO training loop, top to bottom: the one place that knows every phase of a step.

prompts -> G completions each -> rewards -> advantages -> reference / old log-probs
  -> K inner epochs x mini-batches x token-budget micro-batches (accumulate, clip, AdamW step)
  -> metrics, checkpoint
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from fastgrpo.algo import group_advantages, zero_std_fraction
from fastgrpo.config import Config, ConfigError
from fastgrpo.data import PromptSampler, render_prompt
from fastgrpo.errors import RunStopped, UserError
from fastgrpo.models import Transformer
from fastgrpo.rewards.rollout_rewards import score_rollout
from fastgrpo.rollout import generate_rollout, release_engine
from fastgrpo.train.batching import plan_update
from fastgrpo.train.checkpoint import (
    checkpoint_size,
    checkpoint_step,
    latest_checkpoint,
    load_trainer_state,
    remove_partial_checkpoints,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from fastgrpo.train.dynamic_sampling import Sampled, fill_informative
from fastgrpo.train.evaluate import run_evaluator
from fastgrpo.train.guards import RunGuard
from fastgrpo.train.metrics import MetricsLog, SilentMetrics, peak_memory_gib, read_records
from fastgrpo.train.parallel import gather_record, join_world, local_main_first
from fastgrpo.train.profiling import PhaseTimer, StepProfiler, profiled_steps
from fastgrpo.train.reporting import make_reporters
from fastgrpo.train.resume import (
    changed_settings,
    record_changes,
    restore_optimizer,
)
from fastgrpo.train.scoring import correct_sampling_logp, score_old, score_reference
from fastgrpo.train.stopping import Interrupted, StepAbandoned, StopRequest
from fastgrpo.train.trainer import (
    Trainer,
    attach_adapters,
    build_rewards,
    build_task_data,
    build_trainer,
    check_enough_prompts,
    check_fused_lm_head,
    load_configured_model,
    lora_settings,
)
from fastgrpo.train.update import update_policy
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
    stop_signal: int | None = None  # the signal that stopped it (SIGINT, SIGTERM), if one did
    finished_before: bool = False  # resumed a run that had finished: nothing was done
    profile_trace: Path | None = None  # the Chrome trace of run.profile_steps steps, if any


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
    """config.yaml, replaced atomically: a kill mid-write leaves the previous one."""
    run_dir.mkdir(parents=True, exist_ok=True)
    temporary = run_dir / ".config.yaml.tmp"
    temporary.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    os.replace(temporary, run_dir / "config.yaml")


def finished_result(run_dir: Path, config: Config, step: int) -> TrainResult | None:
    """For a resumed run at `step`: a result saying there is nothing to do when it has trained
    every step and has its final evaluation (if one is wanted), else None."""
    if step > config.train.steps:
        raise ConfigError(
            f"train.steps={config.train.steps} is below the {step} steps {run_dir} has trained "
            f"already; to train on, raise it, e.g. --set train.steps={step + 10}."
        )
    if step < config.train.steps:
        return None
    path = run_dir / "metrics.jsonl"
    records = read_records(path) if path.is_file() else []
    evals = {r.get("when"): r for r in records if r.get("kind") == "eval"}
    after = evals.get("after")
    if config.eval.after and not (after and after.get("step") == step):
        return None  # stopped during its final evaluation: that is what is left to do
    scores = {
        w: {k: v for k, v in r.items() if k not in ("kind", "when", "step")}
        for w, r in evals.items()
    }
    return TrainResult(
        run_dir, step, scores.get("before"), scores.get("after"), finished_before=True
    )


# ----------------------------------------------------------------------------- the loop


def train(config: Config, *, resume: bool = False, trust_run_code: bool = False) -> TrainResult:
    """Run GRPO training as configured; `resume` continues the run in `config.run.output_dir`
    (`trust_run_code`: also from a trainer state that needs full unpickling, see checkpoint.py).

    SIGINT or SIGTERM while steps run: the step finishes, a checkpoint is saved and the result
    says `interrupted`; before the first step or during the final evaluation: `Interrupted`.

    Started by torchrun with more than one process, each process is a rank of one data-parallel
    job (`grpo_step`); rank 0 writes the run folder, the metrics and the checkpoints."""
    world = join_world(config)
    try:
        return _start(config, resume, trust_run_code, world)
    finally:
        if world is not None:
            world.leave()


def _start(config: Config, resume: bool, trust_run_code: bool, world) -> TrainResult:
    """`train` from its run folder's checks on (in a data-parallel job, on every rank)."""
    run_dir = check_run_dir(config, resume)  # on every rank, before any rank writes
    if world is not None:
        world.barrier()
    checkpoint = latest_checkpoint(run_dir) if resume else None
    changes = changed_settings(checkpoint, config) if checkpoint else {}
    if checkpoint is not None:
        done = finished_result(run_dir, config, checkpoint_step(checkpoint))
        if done is not None:
            return done
    removed = remove_partial_checkpoints(run_dir) if world is None or world.is_main else []
    if removed:
        log.warning("removed %s: checkpoint writes an earlier process never finished", removed)
    stop = StopRequest()
    try:
        return _train(config, run_dir, checkpoint, changes, stop, trust_run_code, world)
    except Interrupted as interrupt:
        interrupt.detail = interrupt.detail or (
            f"stopped before the first step; {run_dir} is as it was"
            if checkpoint
            else "stopped before the first step; nothing was trained"
        )
        raise
    finally:
        stop.restore()


def _train(
    config: Config,
    run_dir: Path,
    checkpoint: Path | None,
    changes: dict,
    stop: StopRequest,
    trust_run_code: bool,
    world=None,
) -> TrainResult:
    main = world is None or world.is_main
    torch.manual_seed(config.train.seed)  # the same on every rank: rows draw by their number
    task = build_task_data(config)
    check_enough_prompts(config, task)
    rewards = build_rewards(config)
    lora = lora_settings(config)  # None: full fine-tuning
    model_name = str(checkpoint / "model") if checkpoint and not lora else config.model.name
    with local_main_first(world):  # a GGUF is converted (a hub model downloaded) once a machine
        model, tokenizer, _ = load_configured_model(config, model_name)
    check_fused_lm_head(config, model)  # fail here, before loading the reference or any rollout
    if lora is not None:  # the base frozen, the adapters new or read from where the run left off
        saved = checkpoint / "model" if checkpoint else config.lora.adapter
        attach_adapters(model, lora, saved, seed=config.train.seed)
    ref_model = None
    if config.algo.beta != 0 and lora is None:  # LoRA's reference: the base, adapters off
        ref_model, _, _ = load_configured_model(config)
    sampler = PromptSampler(
        len(task.train), config.rollout.prompts_per_step, seed=config.train.seed
    )
    trainer = build_trainer(
        config, model, tokenizer, ref_model, rewards=rewards, world=world, lora=lora
    )
    optimizer, scheduler = trainer.optimizer, trainer.scheduler
    step = 0
    if checkpoint is not None:
        state = load_trainer_state(checkpoint, trust=trust_run_code)
        restore_optimizer(optimizer, scheduler, state["optimizer"], state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        step = state["step"]
        processes = world.size if world is not None else 1
        if state.get("processes", 1) != processes:  # any count continues it (resharded)
            changes = {**changes, "processes": (state.get("processes", 1), processes)}

    result = TrainResult(run_dir=run_dir, steps=step)
    if main:
        # a reporter not installed stops the run here, before the run folder is written
        reporters = make_reporters(config.run.report_to, run_dir, config.to_dict())
        write_run_config(run_dir, config)  # only now: bad settings above leave no trace behind
        metrics = MetricsLog(
            run_dir,
            total_steps=config.train.steps,
            start_step=step,
            show_progress=config.run.progress,
            reporters=reporters,
        )
    else:
        metrics = SilentMetrics()
    if trainer.parallel:
        metrics.write(trainer.parallel)
    if checkpoint is not None and main:
        record_changes(run_dir, step, changes)
        for key, (old, new) in changes.items():
            metrics.write(f"resume: {key} {old!r} -> {new!r} from step {step + 1}")
    profiled = profiled_steps(config.run.profile_steps, step, config.train.steps) if main else []
    profiler = StepProfiler(run_dir, profiled, model.device)
    evaluate_now = run_evaluator(config, trainer, task, metrics)
    if config.eval.before and step == 0:
        result.eval_before = evaluate_now(step, "before")
    else:  # resumed: the evaluation before training is in the run's metrics already
        result.eval_before = metrics.find(kind="eval", when="before")
    guard = RunGuard(
        max_nonfinite_steps=config.train.max_nonfinite_steps,
        max_reward_failure_frac=config.train.max_reward_failure_frac,
        max_failing_reward_steps=config.train.max_failing_reward_steps,
        completions_per_step=config.rollout.prompts_per_step * config.rollout.num_generations,
        last_checkpoint=lambda: latest_checkpoint(run_dir),
    )
    stop.during_steps = True
    # after each rollout: a stop signal on any rank abandons the step (`stopping`)
    if world is not None:
        trainer.abandon_step = lambda: world.any(stop.requested, model.device)
    else:
        trainer.abandon_step = lambda: stop.requested

    def save(step: int) -> None:
        optimizer_state = optimizer.state_dict()
        # a sharded job's ranks each write their optimizer shards into rank 0's folder
        shards = optimizer.save_shards if optimizer.writes_shards else None
        if not main:
            if shards is not None:
                shards(None)
            return
        state = {
            "optimizer": optimizer_state,
            "scheduler": scheduler.state_dict(),
            "sampler": sampler.state_dict(),
            "processes": world.size if world is not None else 1,
        }
        where = save_checkpoint(
            run_dir,
            step,
            # whole where FSDP shards `model`; a LoRA run's adapters (peft's files)
            model=model if lora else trainer.rollout_model,
            adapters=lora,
            base_model=config.model.name,
            tokenizer=tokenizer,
            trainer_state=state,
            config=config.to_dict(),
            keep=config.run.keep_checkpoints,
            write_shards=shards,
        )
        metrics.write(
            f"checkpoint: saved {where} ({checkpoint_size(where)}; the newest "
            f"run.keep_checkpoints={config.run.keep_checkpoints} are kept)"
        )
        if stop.requested:
            metrics.write(
                f"interrupted: saved {where}; continue with `fastgrpo train --resume {run_dir}`"
            )

    try:
        while step < config.train.steps and not stop.requested:
            before = sampler.state_dict(), rng_state()
            examples = [task.train[i] for i in sampler.next_batch()]
            more = lambda: [task.train[i] for i in sampler.next_batch()]  # noqa: E731
            try:
                with profiler.step(step + 1):
                    record = grpo_step(config, trainer, examples, more)
            except StepAbandoned:  # as if the step had not begun: saved, it is taken on resume
                sampler.load_state_dict(before[0])
                set_rng_state(before[1])
                stop.requested = True
                saved = latest_checkpoint(run_dir)
                if step and (saved is None or checkpoint_step(saved) != step):
                    save(step)
                elif main:
                    metrics.write(
                        f"interrupted during step {step + 1}'s rollout: "
                        + (f"{saved} holds step {step}" if step else "no step had finished")
                    )
                break
            step += 1
            if step == profiler.last:
                _report_trace(result, metrics, profiler.finish())
            record["step"] = step
            metrics.log(record)
            result.history.append(record)
            guard.check(record)  # before this step's checkpoint
            if world is not None and world.any(stop.requested, model.device):
                stop.requested = True  # a signal seen by any rank stops every rank here
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
                save(step)
    except Interrupted as interrupt:  # the second signal: no step to finish, nothing saved
        saved = latest_checkpoint(run_dir)
        interrupt.detail = f"aborted at step {step}; " + (
            f"the latest checkpoint is {saved}" if saved else "no checkpoint was saved"
        )
        raise
    except RunStopped:
        metrics.close()
        release_engine(trainer.rollout_model)
        raise
    finally:
        stop.during_steps = False
        _report_trace(result, metrics, profiler.finish())  # stopped early: what was recorded
    result.steps = step
    result.interrupted, result.stop_signal = stop.requested, stop.signum
    if config.eval.after and not stop.requested and step == config.train.steps:
        try:
            result.eval_after = evaluate_now(step, "after")
        except Interrupted as interrupt:
            interrupt.detail = (
                f"stopped during the final evaluation; all {step} steps are saved, and "
                f"`fastgrpo train --resume {run_dir}` runs the evaluation"
            )
            raise
    if main and config.run.plots:
        _write_plots(run_dir, metrics)
    if main and config.run.push_to_hub and not stop.requested and step == config.train.steps:
        _push(run_dir, config.run.push_to_hub, metrics)
    metrics.close()
    release_engine(trainer.rollout_model)  # its KV cache and graphs go now, not at the next GC
    return result


def _write_plots(run_dir: Path, metrics) -> None:
    from fastgrpo.train.plots import plot_run  # matplotlib, only now

    try:
        written = plot_run(run_dir)
    except UserError as error:  # no matplotlib: the run is fine without its pictures
        metrics.write(f"plots: skipped ({error})")
        return
    metrics.write(f"plots: wrote {', '.join(str(p) for p in written)}")


def _push(run_dir: Path, repo_id: str, metrics) -> None:
    from fastgrpo.train.hub import HubError, push

    try:
        metrics.write(f"hub: uploaded {push(run_dir, repo_id)}")
    except HubError as error:  # the run is done and saved: say so, do not fail it
        metrics.write(f"hub: {error}")


def _report_trace(result: TrainResult, metrics: MetricsLog, path: Path | None) -> None:
    if path is not None:
        result.profile_trace = path
        metrics.write(f"profile: wrote {path} (open it in https://ui.perfetto.dev)")


# ----------------------------------------------------------------------------- one step


def grpo_step(config: Config, trainer: Trainer, examples: list, more_examples=None) -> dict:
    """One GRPO step on a batch of prompts, phase by phase; returns its metrics.

    In a data-parallel job (`trainer.world`) `examples` is the global batch: this rank takes its
    share of whole prompt groups, each row sampling with its number in the global batch, and the
    batch-wide quantities (reward std, loss normalisers, gradients, metrics) are reduced over the
    ranks, so the step is the one-process step of the same batch. With algo.dynamic_sampling,
    `more_examples()` gives the next batch of prompts when groups of equal rewards were dropped."""
    model, r, t, world = trainer.model, config.rollout, config.train, trainer.world
    timer = PhaseTimer(model.device)
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.device)
    step_start = time.perf_counter()
    sampled = roll_out_and_reward(config, trainer, examples, timer)
    sampling_stats = {}
    if config.algo.dynamic_sampling and more_examples is not None:
        sampled, sampling_stats = fill_informative(
            sampled,
            lambda: roll_out_and_reward(config, trainer, more_examples(), timer),
            want=len(sampled.examples),
            max_rounds=config.algo.dynamic_sampling_max_rounds,
        )
        if sampling_stats["dynamic_sampling/short"] and not trainer.warned_short_batch:
            trainer.warned_short_batch = True
            log.warning(
                "dynamic sampling: %d of %d groups have equal rewards after %d rollouts "
                "(algo.dynamic_sampling_max_rounds); they fill the batch (said once: "
                "dynamic_sampling/short in metrics.jsonl counts them every step)",
                sampling_stats["dynamic_sampling/short"],
                len(sampled.examples),
                sampling_stats["dynamic_sampling/rounds"],
            )
    examples, rollout, scores = sampled.examples, sampled.rollout, sampled.scores
    with timer("reward"):
        reward = to_device(torch.tensor(scores.result.total, dtype=torch.float32), model.device)
        batch_std = world.batch_std(reward) if world is not None else None  # all ranks' rows
        advantages = group_advantages(
            reward,
            r.num_generations,
            scale=config.algo.scale_rewards,
            baseline=config.algo.baseline,
            batch_std=batch_std,
        )  # (B,)
    if config.algo.mask_truncated_completions:  # a cut-off answer teaches nothing reliable
        rollout.completion_mask = rollout.completion_mask * rollout.finished.unsqueeze(1)
    with timer("reference"):  # the plan of mini- and micro-batches is timed here too
        plan = plan_update(
            rollout,
            advantages,
            mini_batches=t.mini_batches,
            token_budget=t.micro_batch_tokens,
            zero_gradient_rows=trainer.loss_settings.zero_gradient_rows_possible,
            packed=isinstance(model, Transformer),
            world=world,
            lockstep=trainer.lockstep,
        )
        with trainer.reference() as reference:
            if reference is not None:
                score_reference(
                    reference,
                    plan,
                    temperature=r.temperature,
                    token_budget=t.micro_batch_tokens,
                    fused=trainer.fused,
                )
    a = config.algo
    correcting = a.importance_sampling_correction
    with timer("old_logprobs"):
        # else the ratio is 1 by construction; the IS modes but token_truncate need them first
        if (
            t.num_iterations > 1
            or t.mini_batches > 1
            or (correcting and a.importance_sampling_mode != "token_truncate")
        ):
            score_old(model, plan, temperature=r.temperature, fused=trainer.fused)
        mismatch = {}
        if correcting:
            mismatch = correct_sampling_logp(
                plan, a.importance_sampling_mode, a.importance_sampling_cap
            )
    update = update_policy(
        model,
        trainer.optimizer,
        trainer.scheduler,
        plan,
        trainer.loss,
        num_iterations=t.num_iterations,
        max_grad_norm=t.max_grad_norm,
        timer=timer,
    )
    record = step_record(rollout, reward, scores, update, r.num_generations)
    record.update(sampling_stats)
    record.update(mismatch)
    record["lr"] = trainer.scheduler.get_last_lr()[0]
    record.update(timer.times)
    step_time = time.perf_counter() - step_start
    record["time/step"] = step_time
    record["tokens_per_s"] = rollout.lengths.sum().item() / step_time
    record["peak_memory_gib"] = peak_memory_gib(model.device)
    if world is not None:  # the whole batch's record, on every rank (the guards read it)
        record["reward/std"] = batch_std.item()
        record = gather_record(record, world)
    return record


def roll_out_and_reward(config: Config, trainer: Trainer, examples: list, timer) -> Sampled:
    """The rollout and reward phases of a batch of prompts (in a data-parallel job, the global
    batch: this rank's share of it)."""
    r, world = config.rollout, trainer.world
    row_ids = None
    if world is not None:
        mine = world.share(range(len(examples)))
        examples = [examples[i] for i in mine]
        g = r.num_generations
        row_ids = torch.tensor([i * g + j for i in mine for j in range(g)])
    with timer("rollout"):
        rollout = sample_completions(
            config, trainer.rollout_model, trainer.tokenizer, trainer.stop_ids, examples, row_ids
        )
    if trainer.abandon_step is not None and trainer.abandon_step():
        raise StepAbandoned  # a stop signal cut this rollout (or another rank's) short
    with timer("reward"):
        scores = score_rollout(
            trainer.rewards,
            trainer.tokenizer,
            examples,
            rollout,
            r.num_generations,
            max_completion_length=r.max_new_tokens,
        )
    return Sampled(examples, rollout, scores, r.num_generations)


def sample_completions(
    config: Config, model, tokenizer, stop_ids: list[int], examples: list, row_ids=None
):
    """The rollout phase: `rollout.num_generations` completions of each example's prompt by
    `model` (`row_ids`: the rows' numbers in a data-parallel job's global batch)."""
    r = config.rollout
    texts = [render_prompt(tokenizer, ex.prompt, config.task.system_prompt) for ex in examples]
    return generate_rollout(
        model,
        tokenizer,
        texts,
        num_generations=r.num_generations,
        max_new_tokens=r.max_new_tokens,
        stop_ids=stop_ids,
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        with_sampling_logp=config.algo.importance_sampling_correction,
        row_ids=row_ids,
    )


def step_record(rollout, reward, scores, update: dict, num_generations: int) -> dict:
    """The step's metrics: rewards, accuracy, lengths, and the update's averages."""
    lengths = rollout.lengths
    result = scores.result
    return {
        "reward/mean": reward.mean().item(),
        "reward/std": reward.std().item() if reward.numel() > 1 else 0.0,
        "accuracy": scores.accuracy,
        "frac_zero_std_groups": zero_std_fraction(reward, num_generations).item(),
        **{f"rewards/{name}": sum(v) / len(v) for name, v in result.per_reward.items()},
        **{f"reward_failures/{name}": n for name, n in result.failures.items() if n},
        **{f"reward_errors/{name}": text for name, text in result.errors.items()},
        "completion/mean_length": lengths.mean().item(),
        "completion/min_length": lengths.min().item(),
        "completion/max_length": lengths.max().item(),
        "completion/truncated_frac": (~rollout.finished).float().mean().item(),
        **update,
    }

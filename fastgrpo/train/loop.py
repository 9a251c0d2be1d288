"""The GRPO training loop: the run's setup and resume, its steps (`step.grpo_step`, phase by
phase), evaluations, checkpoints, and what a stop signal or a failing guard does to them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from fastgrpo.config import Config, ConfigError
from fastgrpo.data import PromptSampler
from fastgrpo.errors import RunStopped, UserError
from fastgrpo.rollout import release_engine
from fastgrpo.switches import started_by_launcher
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
from fastgrpo.train.evaluate import run_evaluator
from fastgrpo.train.guards import RunGuard
from fastgrpo.train.metrics import MetricsLog, SilentMetrics, read_records
from fastgrpo.train.parallel import join_world, local_main_first
from fastgrpo.train.profiling import StepProfiler, profiled_steps
from fastgrpo.train.reporting import make_reporters
from fastgrpo.train.resume import (
    changed_settings,
    record_changes,
    restore_optimizer,
)
from fastgrpo.train.step import grpo_step
from fastgrpo.train.stopping import Interrupted, StepAbandoned, StopRequest, hang_dump_after
from fastgrpo.train.trainer import (
    attach_adapters,
    build_rewards,
    build_task_data,
    build_trainer,
    check_enough_prompts,
    check_fused_lm_head,
    load_configured_model,
    lora_settings,
    update_layers_note,
)

log = logging.getLogger("fastgrpo.train")

SLOW_SAVE_S = 20.0
"""A checkpoint that takes longer is said once: torchrun kills its ranks 30 s after passing on a
stop signal (many schedulers give SIGTERM a short grace too), and the save after a stop may not
finish in time; the previous checkpoint then stays."""


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
        result = _start(config, resume, trust_run_code, world)
        if world is not None and result.interrupted:
            # stopped ranks exit non-zero, and torchrun stops the others when one does: none
            # goes before rank 0 has finished its checkpoint
            world.barrier()
        return result
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
    stop = StopRequest(dump_after=hang_dump_after(world))
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
    note = update_layers_note(config, trainer)
    if note is not None:
        metrics.write(note)
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

    slow_save_said = False

    def save(step: int) -> None:
        nonlocal slow_save_said
        start = time.perf_counter()
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
        seconds = time.perf_counter() - start
        metrics.write(
            f"checkpoint: saved {where} ({checkpoint_size(where)} in {seconds:.1f} s; the newest "
            f"run.keep_checkpoints={config.run.keep_checkpoints} are kept)"
        )
        if seconds > SLOW_SAVE_S and not slow_save_said and not started_by_launcher():
            slow_save_said = True
            log.warning(
                "a checkpoint took %.0f s: after a stop signal (Ctrl-C, SIGTERM) torchrun kills the "
                "ranks 30 s later, so that save may not finish; the previous checkpoint then stays "
                "(run.save_every=%d sets how far back that is)",
                seconds,
                config.run.save_every,
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

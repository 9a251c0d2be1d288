"""One GRPO step, phase by phase: the one place that knows every phase of a step.

prompts -> G completions each -> rewards -> advantages -> reference / old log-probs
  -> K inner epochs x mini-batches x token-budget micro-batches (accumulate, clip, AdamW step)
  -> the step's metrics

`loop.py` runs the steps (with checkpoints, evaluation and signals); the benchmarks time
`grpo_step` on a Trainer as the loop makes it.
"""

from __future__ import annotations

import logging
import time

import torch

from fastgrpo.algo import group_advantages, zero_std_fraction
from fastgrpo.config import Config
from fastgrpo.data import render_prompt
from fastgrpo.models import Transformer
from fastgrpo.rewards.rollout_rewards import score_rollout
from fastgrpo.rollout import generate_rollout
from fastgrpo.train.batching import plan_update
from fastgrpo.train.dynamic_sampling import Sampled, fill_informative
from fastgrpo.train.metrics import peak_memory_gib
from fastgrpo.train.parallel import gather_record
from fastgrpo.train.profiling import PhaseTimer
from fastgrpo.train.scoring import correct_sampling_logp, score_old, score_reference
from fastgrpo.train.stopping import StepAbandoned
from fastgrpo.train.trainer import Trainer
from fastgrpo.train.update import update_policy
from fastgrpo.transfer import to_device

log = logging.getLogger("fastgrpo.train")


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
    fully_sharded = trainer.fully_sharded
    if fully_sharded is not None and t.fsdp_free_engine_copy:  # gathered again after the update
        fully_sharded.release_engine_weights()
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
    if fully_sharded is not None and fully_sharded.released:  # the engine's copy, whole again
        with timer("weight_gather"):
            fully_sharded.restore_engine_weights()
    record = step_record(rollout, reward, scores, update, r.num_generations)
    record.update(sampling_stats)
    record.update(mismatch)
    record["lr"] = trainer.scheduler.get_last_lr()[0]
    record.update(timer.times)
    step_time = time.perf_counter() - step_start
    record["time/step"] = step_time
    record["tokens_per_s"] = rollout.lengths.sum().item() / step_time
    record["peak_memory_gib"] = peak_memory_gib(model.device)
    if trainer.captured is not None:  # the graphs' pool, which the allocator's peak leaves out
        record["peak_memory_gib"] += trainer.captured.pool_bytes / 2**30
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

"""Held-out evaluation: accuracy and mean reward of a model on a task split."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from fastgrpo.data import Example, render_prompt
from fastgrpo.rewards import RewardSet
from fastgrpo.rewards.rollout_rewards import reward_columns, score_rollout
from fastgrpo.rollout import generate_rollout
from fastgrpo.train.parallel import gather_eval_scores

if TYPE_CHECKING:
    from fastgrpo.config import Config
    from fastgrpo.data import TaskData
    from fastgrpo.train.trainer import Trainer


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    examples: list[Example],
    *,
    rewards: RewardSet,
    stop_ids: list[int],
    system_prompt: str | None = None,
    temperature: float = 0.0,
    max_new_tokens: int = 64,
    batch_size: int = 64,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    samples: list | None = None,
) -> dict:
    """{"accuracy", "reward_mean", "num_problems", "mean_length", "truncated"} over `examples`.

    Sampling (temperature > 0) draws from a forked RNG seeded with `seed`, so evaluating never
    changes the training run's random stream and is repeatable. If `samples` is a list, the
    (prompt, completion, answer) triples are appended to it.
    """
    correct, reward_total, length_total, truncated = 0.0, 0.0, 0.0, 0
    devices = [model.device] if model.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            texts = [render_prompt(tokenizer, ex.prompt, system_prompt) for ex in chunk]
            rollout = generate_rollout(
                model,
                tokenizer,
                texts,
                num_generations=1,
                max_new_tokens=max_new_tokens,
                stop_ids=stop_ids,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
            )
            scores = score_rollout(rewards, tokenizer, chunk, rollout, 1, max_new_tokens)
            correct += sum(scores.correct)
            reward_total += sum(scores.result.total)
            length_total += rollout.lengths.sum().item()
            truncated += int((~rollout.finished).sum())
            if samples is not None:
                prompts = [ex.prompt for ex in chunk]
                answers = reward_columns(chunk, 1)["answer"]
                samples.extend(zip(prompts, scores.completions, answers))
    n = max(len(examples), 1)
    return {
        "accuracy": correct / n,
        "reward_mean": reward_total / n,
        "num_problems": len(examples),
        "mean_length": length_total / n,
        "truncated": truncated / n,
    }


def run_evaluator(config: Config, trainer: Trainer, task: TaskData, metrics):
    """The training run's evaluation: `run(step, when)` evaluates the first eval.num_problems
    held-out problems, logs the scores to `metrics` (a MetricsLog) and returns them. In a
    data-parallel job each rank evaluates every N-th problem and
    the scores of the whole set are combined (rank 0 logs them)."""
    problems = task.eval[: config.eval.num_problems]
    world = trainer.world
    mine = problems if world is None else problems[world.rank :: world.size]

    def run(step: int, when: str) -> dict | None:
        if not problems:
            return None
        start = time.perf_counter()
        with metrics.paused():  # the progress bar's ETA counts training steps only
            scores = evaluate(
                trainer.rollout_model,
                trainer.tokenizer,
                mine,
                rewards=trainer.rewards,
                stop_ids=trainer.stop_ids,
                system_prompt=config.task.system_prompt,
                temperature=config.eval.temperature,
                max_new_tokens=config.eval.max_new_tokens or config.rollout.max_new_tokens,
                batch_size=config.eval.batch_size,
                seed=config.train.seed,
            )
        if world is not None:
            scores = gather_eval_scores(scores, world)
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

"""Rewards of a rollout: its completions decoded, each task record's columns repeated for its
samples, every reward called, and which answers are right (the accuracy the trainer and the
evaluation report)."""

from __future__ import annotations

from dataclasses import dataclass

from fastgrpo.rewards.math import math_accuracy
from fastgrpo.rewards.registry import RewardResult, RewardSet


@dataclass
class RolloutRewards:
    completions: list[str]  # each row's decoded text
    result: RewardResult  # weighted totals (one per row), each reward's values, failures
    correct: list[float]  # 1.0 where a row's final answer equals the reference

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct)


def decode_completions(tokenizer, rollout) -> list[str]:
    """Completion text of each row, cut after its stop token, special tokens removed."""
    lengths = rollout.completion_mask.sum(-1).long().tolist()
    # numpy rows: transformers turns each into a list in one call, where a list of ints is
    # checked element by element (~7 ms of a 64 x 256-token batch)
    rows = [ids[:n] for ids, n in zip(rollout.completion_ids.cpu().numpy(), lengths)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def reward_columns(examples: list, repeat: int) -> dict[str, list]:
    """Each record's columns (answer, ...) as lists with one value per completion."""
    keys = dict.fromkeys(key for ex in examples for key in ex.columns)
    return {key: [ex.columns.get(key) for ex in examples for _ in range(repeat)] for key in keys}


def score_rollout(
    rewards: RewardSet,
    tokenizer,
    examples: list,
    rollout,
    samples: int,
    max_completion_length: int | None = None,
) -> RolloutRewards:
    """The rewards of a rollout of `samples` rows per example, rows grouped by example. Besides
    the data's columns, rewards get `completion_lengths` (tokens) and `max_completion_length`
    (the limit, default the rollout's width)."""
    completions = decode_completions(tokenizer, rollout)
    prompts = [ex.prompt for ex in examples for _ in range(samples)]
    columns = reward_columns(examples, samples)
    limit = max_completion_length or rollout.completion_ids.shape[1]
    columns["completion_lengths"] = rollout.lengths.tolist()
    columns["max_completion_length"] = [limit] * len(completions)
    result = rewards(prompts, completions, columns)
    correct = rewards.values_of(math_accuracy, result)  # the default reward: scored above
    if correct is None:
        correct = math_accuracy(prompts, completions, **columns)
    return RolloutRewards(completions, result, correct)

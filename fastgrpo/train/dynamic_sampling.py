"""DAPO's dynamic sampling (`algo.dynamic_sampling`): a group whose completions all got the same
reward has zero advantage everywhere and teaches nothing, so it is dropped and more prompts are
rolled out until the batch holds `rollout.prompts_per_step` groups with different rewards, or
`algo.dynamic_sampling_max_rounds` rollouts have been made.

The batch keeps its size either way (the mini-batch split and the loss normalisers stay what the
config says): when the rounds run out it is filled up with groups of equal rewards, the earliest
first, and the step's record says so (`dynamic_sampling/short`). Each extra round draws a whole
`prompts_per_step` batch from the prompt sampler, so the run moves through its data faster, and
a resumed run continues the sampler where it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastgrpo.rewards.registry import RewardResult
from fastgrpo.rewards.rollout_rewards import RolloutRewards
from fastgrpo.rollout.types import Rollout
from fastgrpo.train.logprobs import concat_rollouts


@dataclass
class Sampled:
    """Prompt groups rolled out and rewarded: `samples` rows per example, grouped by example."""

    examples: list
    rollout: Rollout
    scores: RolloutRewards
    samples: int

    def informative(self) -> list[bool]:
        """Per group: whether its rewards differ (the group has a non-zero advantage)."""
        total, g = self.scores.result.total, self.samples
        return [len(set(total[i * g : (i + 1) * g])) > 1 for i in range(len(self.examples))]

    def groups(self, chosen: list[int]) -> Sampled:
        """The groups `chosen` (indices), in that order."""
        g = self.samples
        rows = [i * g + j for i in chosen for j in range(g)]
        scores, result = self.scores, self.scores.result
        return Sampled(
            [self.examples[i] for i in chosen],
            self.rollout.rows(rows),
            RolloutRewards(
                [scores.completions[r] for r in rows],
                RewardResult(
                    [result.total[r] for r in rows],
                    {k: [v[r] for r in rows] for k, v in result.per_reward.items()},
                    dict(result.failures),
                    dict(result.errors),
                ),
                [scores.correct[r] for r in rows],
            ),
            g,
        )


def concat(parts: list[Sampled]) -> Sampled:
    """The groups of several batches in one, in order (failures summed, first errors kept)."""
    if len(parts) == 1:
        return parts[0]
    failures, errors = {}, {}
    for part in parts:
        for name, n in part.scores.result.failures.items():
            failures[name] = failures.get(name, 0) + n
        for name, text in part.scores.result.errors.items():
            errors.setdefault(name, text)
    names = parts[0].scores.result.per_reward
    return Sampled(
        [ex for p in parts for ex in p.examples],
        concat_rollouts([p.rollout for p in parts]),
        RolloutRewards(
            [c for p in parts for c in p.scores.completions],
            RewardResult(
                [t for p in parts for t in p.scores.result.total],
                {k: [v for p in parts for v in p.scores.result.per_reward[k]] for k in names},
                failures,
                errors,
            ),
            [c for p in parts for c in p.scores.correct],
        ),
        parts[0].samples,
    )


def fill_informative(
    first: Sampled, more: Callable[[], Sampled], want: int, max_rounds: int
) -> tuple[Sampled, dict]:
    """`want` groups, those with differing rewards first, from `first` and up to `max_rounds`
    - 1 further batches made by `more()`; and the step's dynamic-sampling metrics."""
    rounds, seen = [first], [first.informative()]
    while sum(sum(flags) for flags in seen) < want and len(rounds) < max_rounds:
        rounds.append(more())
        seen.append(rounds[-1].informative())
    every = concat(rounds)
    flags = [flag for flags in seen for flag in flags]
    good = [i for i, flag in enumerate(flags) if flag]
    chosen = good[:want]
    short = want - len(chosen)
    chosen = sorted(chosen + [i for i, flag in enumerate(flags) if not flag][:short])
    stats = {
        "dynamic_sampling/rounds": len(rounds),
        "dynamic_sampling/dropped_groups": len(flags) - want,
        "dynamic_sampling/equal_reward_groups": len(flags) - len(good),
        "dynamic_sampling/short": short,
    }
    return every.groups(chosen), stats

"""DAPO dynamic sampling: groups of equal rewards dropped, more prompts rolled out until the batch
holds informative groups only, or the rounds run out (then equal-reward groups fill it)."""

from __future__ import annotations

import json

import pytest
import torch

from fastgrpo.config import ConfigError
from fastgrpo.data import Example
from fastgrpo.rewards.registry import RewardResult
from fastgrpo.rewards.rollout_rewards import RolloutRewards
from fastgrpo.rollout.types import Rollout
from fastgrpo.train import load_resume_config, run_training
from fastgrpo.train.checkpoint import latest_checkpoint
from fastgrpo.train.dynamic_sampling import Sampled, fill_informative
from tests.train.test_training_run import tiny_overrides, weights

G = 2


def batch(name: str, rewards: list[list[float]], width: int) -> Sampled:
    """Groups of G rows named name0, name1, ...; completions `width` tokens wide."""
    rows = len(rewards) * G
    rollout = Rollout(
        torch.full((rows, 3), 7), torch.ones(rows, 3, dtype=torch.long),
        torch.arange(rows * width).view(rows, width), torch.ones(rows, width),
        torch.ones(rows, dtype=torch.bool),
    )  # fmt: skip
    total = [r for group in rewards for r in group]
    result = RewardResult(total, {"r": list(total)}, {"r": 1}, {"r": f"error in {name}"})
    completions = [f"{name}{i // G}" for i in range(rows)]
    examples = [Example(prompt=f"{name}{i}", answer="0") for i in range(len(rewards))]
    return Sampled(examples, rollout, RolloutRewards(completions, result, total), G)


def test_equal_reward_groups_are_replaced_by_informative_ones_from_more_rollouts():
    first = batch("a", [[1, 1], [0, 1], [0, 0], [1, 0]], width=3)  # groups 1 and 3 teach
    later = iter([batch("b", [[0, 0], [1, 1], [1, 0], [0, 0]], width=5)])
    got, stats = fill_informative(first, lambda: next(later), want=4, max_rounds=2)
    assert [ex.prompt for ex in got.examples] == ["a0", "a1", "a3", "b2"]  # short by one: a0
    assert stats == {
        "dynamic_sampling/rounds": 2,
        "dynamic_sampling/dropped_groups": 4,
        "dynamic_sampling/equal_reward_groups": 5,
        "dynamic_sampling/short": 1,
    }
    # rows follow their groups, in the order of arrival: a0 (filler), a1, a3, b2
    assert got.scores.completions == ["a0", "a0", "a1", "a1", "a3", "a3", "b2", "b2"]
    assert got.scores.result.total == [1, 1, 0, 1, 1, 0, 1, 0]
    assert got.scores.result.failures == {"r": 2} and got.scores.result.errors == {
        "r": "error in a"
    }
    assert got.rollout.completion_ids.shape == (8, 5)  # padded to the widest round
    assert got.rollout.completion_mask[:6, 3:].sum() == 0 and got.rollout.completion_mask[6:].all()


def test_a_batch_full_of_informative_groups_takes_one_round_and_drops_nothing():
    first = batch("a", [[0, 1], [1, 0]], width=2)
    got, stats = fill_informative(first, lambda: pytest.fail("no second round"), 2, 3)
    assert got.examples == first.examples and stats["dynamic_sampling/rounds"] == 1
    assert stats["dynamic_sampling/dropped_groups"] == stats["dynamic_sampling/short"] == 0


EQUAL_ON_SOME = '''
def half_equal(prompts, completions, **kwargs):
    """Equal rewards (0.5) for prompts whose text has an even digit count, else the digits' share."""
    return [0.5 if sum(c.isdigit() for c in p) % 2 == 0
            else sum(c.isdigit() for c in text) / max(len(text), 1)
            for p, text in zip(prompts, completions)]
'''


def overrides(tiny_model_dir, tmp_path, run, steps, **extra):
    (tmp_path / "equal.py").write_text(EQUAL_ON_SOME)
    settings = {"rewards": f"['{tmp_path / 'equal.py'}:half_equal']", "algo.dynamic_sampling": True,
                "rollout.prompts_per_step": 4, **extra}  # fmt: skip
    return tiny_overrides(tiny_model_dir, run, steps=steps, **settings)


def test_a_run_with_dynamic_sampling_trains_on_informative_groups_and_resumes_exactly(
    tiny_model_dir, tmp_path
):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    result = run_training(None, overrides=overrides(tiny_model_dir, tmp_path, straight, 3))
    records = result.history
    assert any(r["dynamic_sampling/rounds"] > 1 for r in records)
    for r in records:
        assert r["dynamic_sampling/equal_reward_groups"] > 0 or r["dynamic_sampling/rounds"] == 1
        if not r["dynamic_sampling/short"]:
            assert r["frac_zero_std_groups"] == 0.0  # only groups that teach were trained on
    run_training(None, overrides=overrides(tiny_model_dir, tmp_path, halves, 2))
    config = load_resume_config(str(halves), ["train.steps=3"], trust_run_code=True)
    run_training(config, resume=True, trust_run_code=True)
    a, b = weights(latest_checkpoint(straight)), weights(latest_checkpoint(halves))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    lines = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    assert all("dynamic_sampling/rounds" in x for x in lines if x.get("step") and "loss" in x)


def test_dynamic_sampling_in_a_data_parallel_job_is_refused_in_one_line(tiny_model_dir, tmp_path):
    from tests.distributed.test_data_parallel_training import torchrun_train

    sets = [f"--set={s}" for s in overrides(tiny_model_dir, tmp_path, tmp_path / "run", 1)]
    done = torchrun_train(sets, timeout=120)
    assert done.returncode != 0
    assert done.stderr.count("algo.dynamic_sampling runs in one process for now") >= 1
    with pytest.raises(ConfigError, match="dynamic_sampling_max_rounds"):
        run_training(
            None,
            overrides=overrides(
                tiny_model_dir,
                tmp_path,
                tmp_path / "r2",
                1,
                **{"algo.dynamic_sampling_max_rounds": 0},
            ),
        )

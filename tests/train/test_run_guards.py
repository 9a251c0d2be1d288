"""Runs that train on nothing stop instead of finishing with exit code 0 (issue 28, item 8): a
NaN/inf step is skipped and counted, k of them in a row stop the run with the last good
checkpoint intact, and a reward failing on most completions k steps in a row stops the run with
its error."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fastgrpo.cli import main
from fastgrpo.errors import RunStopped
from fastgrpo.train import run_training
from fastgrpo.train import step as step_module
from fastgrpo.train.checkpoint import checkpoint_dirs
from fastgrpo.train.guards import RunGuard
from fastgrpo.train.optim import ModelOptimizer
from tests.train.test_training_run import tiny_overrides, weights, write_test_rewards

FAILING_REWARDS = """
def always_raises(prompts, completions, **kwargs):
    raise KeyError("no field 'solution' in this record")


def fails_on_the_first(prompts, completions, **kwargs):
    return [None] + [0.5] * (len(completions) - 1)
"""


def train_argv(overrides: list[str]) -> list[str]:
    argv = ["train"]
    for item in overrides:
        argv += ["--set", item]
    return argv


def train_records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind", "train") == "train"]


def poison_steps(monkeypatch, steps: set[int]) -> None:
    """Every loss of the GRPO steps numbered in `steps` becomes NaN (so do its gradients)."""
    original, calls = step_module.update_policy, []

    def update(model, optimizer, scheduler, plan, loss, **kwargs):
        calls.append(1)
        if len(calls) in steps:
            real = loss

            def loss(*args):
                value, metrics = real(*args)
                return value * math.nan, metrics

        return original(model, optimizer, scheduler, plan, loss, **kwargs)

    monkeypatch.setattr(step_module, "update_policy", update)


def test_nan_steps_are_skipped_and_k_in_a_row_stop_the_run_keeping_the_last_good_checkpoint(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    run_dir = tmp_path / "run"
    rewards = write_test_rewards(tmp_path)
    poison_steps(monkeypatch, {2, 4, 5, 6})
    overrides = tiny_overrides(
        tiny_model_dir,
        run_dir,
        steps=10,
        **{
            "rewards": f"[{rewards}:digit_share]",
            "run.save_every": 1,
            "run.keep_checkpoints": 10,
            "train.max_nonfinite_steps": 3,
        },
    )
    assert main(train_argv(overrides)) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: training stopped at step 6")
    assert "train.max_nonfinite_steps=3" in err and "step_000005" in err
    assert [r["skipped_steps"] for r in train_records(run_dir)] == [0, 1, 0, 1, 1, 1]
    saved = {int(path.name[5:]): weights(path) for path in checkpoint_dirs(run_dir)}
    assert sorted(saved) == [1, 2, 3, 4, 5]  # none for step 6, which stopped the run
    for name, value in saved[5].items():
        assert torch.isfinite(value).all(), name
        assert torch.equal(value, saved[3][name])  # steps 4 and 5 were skipped
        assert torch.equal(saved[2][name], saved[1][name])  # so was step 2
    assert any(not torch.equal(saved[3][n], saved[2][n]) for n in saved[3])  # step 3 trained


def test_a_nan_gradient_leaves_the_weights_and_adamw_state_alone(tiny_model):
    model, _ = tiny_model
    optimizer = ModelOptimizer(
        model, learning_rate=1e-2, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    next(model.parameters()).grad[0] = math.inf
    norm, stepped = optimizer.step(max_grad_norm=1.0)
    assert not stepped and not torch.isfinite(norm)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert not optimizer.adamw.state  # no moments were made from the NaN step
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    norm, stepped = optimizer.step(max_grad_norm=1.0, loss=torch.tensor(math.nan))
    assert not stepped and all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    _, stepped = optimizer.step(max_grad_norm=1.0, loss=torch.tensor(0.5))
    assert stepped and any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_reward_raising_on_every_completion_stops_the_run_with_its_error(
    tiny_model_dir, tmp_path, capsys
):
    module = tmp_path / "failing.py"
    module.write_text(FAILING_REWARDS)
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(
        tiny_model_dir,
        run_dir,
        steps=10,
        **{"rewards": f"[math_accuracy, {module}:always_raises]", "run.save_every": 1},
    )
    assert main(train_argv(overrides)) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: training stopped at step 3: reward 'always_raises' failed")
    assert "on 8 of 8 completions in 3 steps in a row" in err
    assert "KeyError: \"no field 'solution' in this record\"" in err
    records = train_records(run_dir)
    assert len(records) == 3 and records[0]["reward_failures/always_raises"] == 8
    assert [int(p.name[5:]) for p in checkpoint_dirs(run_dir)] == [1, 2]


def test_a_reward_failing_on_few_completions_does_not_stop_the_run(tiny_model_dir, tmp_path):
    module = tmp_path / "failing.py"
    module.write_text(FAILING_REWARDS)
    result = run_training(
        None,
        overrides=tiny_overrides(
            tiny_model_dir, tmp_path / "run", steps=4, rewards=f"[{module}:fails_on_the_first]"
        ),
    )
    assert result.steps == 4
    assert [r["reward_failures/fails_on_the_first"] for r in result.history] == [1, 1, 1, 1]


def test_guard_counts_only_steps_in_a_row():
    guard = RunGuard(
        max_nonfinite_steps=2,
        max_reward_failure_frac=0.5,
        max_failing_reward_steps=2,
        completions_per_step=8,
        last_checkpoint=lambda: None,
    )
    failing = {"reward_failures/r": 5, "reward_errors/r": "ValueError: first"}
    guard.check({"step": 1, "skipped_steps": 1, **failing})
    guard.check({"step": 2, "skipped_steps": 0, "reward_failures/r": 4})  # 4 of 8: not more
    guard.check({"step": 3, "skipped_steps": 1, **failing})
    with pytest.raises(RunStopped, match="NaN/inf in 2 steps in a row"):
        guard.check({"step": 4, "skipped_steps": 1})
    guard = RunGuard(
        max_nonfinite_steps=9,
        max_reward_failure_frac=0.5,
        max_failing_reward_steps=2,
        completions_per_step=8,
        last_checkpoint=lambda: None,
    )
    guard.check({"step": 1, **failing})
    with pytest.raises(RunStopped, match="its first error: ValueError: first"):
        guard.check({"step": 2, "reward_failures/r": 8, "reward_errors/r": "ValueError: 2nd"})

"""A reward that never returns cannot stall training (issue 31, item 7): each call past
train.reward_timeout scores 0 and counts in reward_failures/<name>, the run finishes, and the
process exits although the reward's thread still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastgrpo.train import run_training
from tests.train.test_training_run import tiny_overrides, write_test_rewards

HANGING_REWARDS = """
import asyncio, threading


def never_returns(prompts, completions, **kwargs):
    threading.Event().wait()  # no one sets it


async def never_returns_async(prompts, completions, **kwargs):
    await asyncio.Event().wait()
"""
REPO = Path(__file__).resolve().parents[2]


def hanging_reward_overrides(model_dir, tmp_path, steps: int) -> list[str]:
    hanging = tmp_path / "hanging.py"
    hanging.write_text(HANGING_REWARDS)
    rewards = (
        f"['{write_test_rewards(tmp_path)}:digit_share', '{hanging}:never_returns', "
        f"'{hanging}:never_returns_async']"
    )
    settings = {"rewards": rewards, "train.reward_timeout": 0.5, "run.save_every": 0}
    return tiny_overrides(model_dir, tmp_path / "run", steps=steps, **settings)


def test_a_run_whose_rewards_never_return_finishes_with_their_failures_counted(
    tiny_model_dir, tmp_path
):
    start = time.perf_counter()
    result = run_training(None, overrides=hanging_reward_overrides(tiny_model_dir, tmp_path, 2))
    assert result.steps == 2 and not result.interrupted
    assert time.perf_counter() - start < 60  # ~0.5 s a step waiting, not forever
    late = "RewardTimeout: returned nothing within 0.5 s (train.reward_timeout)"
    for record in result.history:
        assert record["reward_failures/never_returns"] == 8  # every completion of the step
        assert record["reward_failures/never_returns_async"] == 8
        assert record["reward_errors/never_returns"] == late
        assert record["rewards/never_returns"] == 0.0
        assert "reward_failures/digit_share" not in record
        assert record["reward/mean"] == pytest.approx(record["rewards/digit_share"])  # +0, +0


@pytest.mark.slow  # ~5 s: a fresh process imports torch and transformers
def test_the_command_line_exits_after_a_run_whose_reward_never_returns(tiny_model_dir, tmp_path):
    argv = [sys.executable, "-m", "fastgrpo", "train"]
    for item in hanging_reward_overrides(tiny_model_dir, tmp_path, 1):
        argv += ["--set", item]
    start = time.perf_counter()
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=120,  # a process held open by the reward's thread would hang here
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert time.perf_counter() - start < 90
    assert "'never_returns' is still running after 0.5 s" in done.stderr
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["reward_failures/never_returns"] == 8

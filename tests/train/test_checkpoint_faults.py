"""Faults during a run lose nothing: failed and killed checkpoint writes, a full disk, SIGTERM
mid-step, and Ctrl-C or SIGTERM before the first step."""

from __future__ import annotations

import importlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_training_run import tiny_overrides, weights, write_test_rewards

import fastgrpo
from fastgrpo.cli import main
from fastgrpo.train import checkpoint as checkpoint_module
from fastgrpo.train import load_resume_config, run_training
from fastgrpo.train import loop as loop_module
from fastgrpo.train import step as step_module
from fastgrpo.train.checkpoint import CheckpointError, checkpoint_dirs, latest_checkpoint

# the module, not the function of the same name that fastgrpo.train exports
evaluate_module = importlib.import_module("fastgrpo.train.evaluate")


def cli_args(model_dir, run_dir, steps, **extra) -> list[str]:
    args = ["train"]
    for item in tiny_overrides(model_dir, run_dir, steps=steps, **{"run.save_every": 1, **extra}):
        args += ["--set", item]
    return args


def orphans(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob(".*"))


def train_steps(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind", "train") == "train"]


def assert_same_run(straight_dir, run_dir):
    """The same steps, in order, with the same numbers and the same final weights."""
    want, got = train_steps(straight_dir), train_steps(run_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert all(r["grad_norm"] > 0 for r in want)  # every step moved the weights
    for a, b in zip(want, got):
        for key in ("reward/mean", "loss", "grad_norm", "lr"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (b["step"], key)
    final_a, final_b = weights(latest_checkpoint(straight_dir)), weights(latest_checkpoint(run_dir))
    for name, value in final_a.items():
        assert torch.allclose(final_b[name], value, atol=1e-6), name


# ----------------------------------------------------------------------------- failed writes


def test_a_checkpoint_write_failing_part_way_says_why_and_loses_nothing(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    run_dir = tmp_path / "run"
    real_save, calls = torch.save, []

    def failing_save(obj, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:  # the second checkpoint: half a file, then torch's error
            with open(path, "wb") as file:
                file.write(b"PK\x03\x04 partial")
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing "
                "file data/0: file write failed"
            )
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", failing_save)
    assert main(cli_args(tiny_model_dir, run_dir, steps=3)) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "step_000002" in err and "file write failed" in err and "enforce fail" not in err
    assert "step_000001, is intact" in err and "--resume" in err
    assert orphans(run_dir) == []
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step_000001"]
    monkeypatch.undo()
    resumed = run_training(load_resume_config(run_dir), resume=True)
    assert resumed.steps == 3 and [r["step"] for r in train_steps(run_dir)] == [1, 2, 3]


def test_a_full_disk_is_refused_before_writing_and_keeps_the_last_checkpoint(
    tiny_model_dir, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    real_usage, checks = shutil.disk_usage, []

    def usage(path):
        checks.append(path)
        total, used, free = real_usage(path)
        return type(real_usage(path))(total, used, free if len(checks) < 2 else 2**20)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    with pytest.raises(CheckpointError, match="not enough disk space for checkpoint step_000002"):
        run_training(
            None,
            overrides=tiny_overrides(tiny_model_dir, run_dir, steps=3, **{"run.save_every": 1}),
        )
    assert orphans(run_dir) == []
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step_000001"]


def test_temporaries_of_killed_writes_are_removed_when_a_run_resumes(
    tiny_model_dir, tmp_path, caplog
):
    run_dir = tmp_path / "run"
    run_training(None, overrides=tiny_overrides(tiny_model_dir, run_dir, steps=1))
    for name in (".step_000002.k3x9a", ".step_000001.deleting"):
        (run_dir / "checkpoints" / name / "model").mkdir(parents=True)
        (run_dir / "checkpoints" / name / "model" / "model.safetensors").write_bytes(b"half")
    result = run_training(load_resume_config(run_dir, ["train.steps=2"]), resume=True)
    assert result.steps == 2 and orphans(run_dir) == []
    assert ".step_000002.k3x9a" in caplog.text


# ----------------------------------------------------------------------------- signals


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("phase", ["loading", "first_eval"])
def test_a_stop_signal_before_the_first_step_exits_with_one_line(
    tiny_model_dir, tmp_path, monkeypatch, capsys, signum, phase
):
    run_dir = tmp_path / "run"
    owner = loop_module if phase == "loading" else evaluate_module  # the run's evaluator
    target = "load_configured_model" if phase == "loading" else "evaluate"
    original = getattr(owner, target)

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signum)  # arrives while this phase runs
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, target, interrupted)
    previous = signal.getsignal(signum)
    assert main(cli_args(tiny_model_dir, run_dir, steps=2, **{"eval.before": True})) == 128 + signum
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"interrupted ({signal.Signals(signum).name}): stopped before the first step; nothing was trained"
    )
    assert latest_checkpoint(run_dir) is None
    assert signal.getsignal(signum) == previous  # the handlers are given back


DRIVER = '''
"""`fastgrpo ARGS` that SIGKILLs itself at checkpoint-write event number $KILL_AT (before or
after each write, rename and delete of a checkpoint write; a killed file write leaves half a file)."""
import os, signal, sys
from fastgrpo.train import checkpoint

count, kill_at = 0, int(os.environ.get("KILL_AT", "0"))


def tick(path=None):
    global count
    count += 1
    if count == kill_at:
        if path is not None and os.path.isfile(path):
            os.truncate(path, os.path.getsize(path) // 2)
        os.kill(os.getpid(), signal.SIGKILL)


def wrap(owner, name, file_arg=None):
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        tick()
        result = original(*args, **kwargs)
        tick(args[file_arg] if file_arg is not None else None)
        return result

    setattr(owner, name, wrapped)


wrap(checkpoint, "save_native_model")
wrap(checkpoint.torch, "save", file_arg=1)
wrap(checkpoint.os, "replace")
wrap(checkpoint, "_remove")
wrap(checkpoint.yaml, "safe_dump")
from fastgrpo.cli import main
sys.exit(main(sys.argv[1:]))
'''


# subprocesses import this checkout's fastgrpo, whatever else is installed
ENV = {**os.environ, "PYTHONPATH": str(Path(fastgrpo.__file__).parents[1])}


def run_driver(tmp_path, args, **env) -> subprocess.CompletedProcess:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    return subprocess.run(
        [sys.executable, str(driver), *args],
        env={**ENV, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_kill_9_at_random_points_of_checkpoint_writes_then_resume_equals_a_straight_run(
    tiny_model_dir, tmp_path
):
    steps = 5
    extra = {"run.save_every": 1, "rewards": f"['{write_test_rewards(tmp_path)}:digit_share']"}
    straight = tmp_path / "straight"
    run_training(None, overrides=tiny_overrides(tiny_model_dir, straight, steps=steps, **extra))
    run_dir = tmp_path / "run"
    chooser = random.Random(28)
    kills, left_behind = 0, []
    for _ in range(3):  # each process is killed at a random write event of its own
        args = ["train", "--resume", str(run_dir), "--trust-run-code"]  # our own reward file
        if latest_checkpoint(run_dir) is None:  # killed before its first checkpoint: start again
            args = cli_args(tiny_model_dir, run_dir, steps=steps, **extra)
        done = run_driver(tmp_path, args, KILL_AT=str(chooser.randint(3, 30)))
        assert done.returncode in (-signal.SIGKILL, 0), done.stderr[-2000:]
        kills += done.returncode == -signal.SIGKILL
        left_behind += orphans(run_dir) if (run_dir / "checkpoints").is_dir() else []
    assert kills >= 2 and left_behind  # some kills landed inside a checkpoint write
    config = load_resume_config(run_dir, trust_run_code=True)
    assert run_training(config, resume=True).steps == steps
    assert orphans(run_dir) == []
    assert_same_run(straight, run_dir)


SLOW_REWARD = '''
import os, time
calls = 0


def mark_then_wait(prompts, completions, **kwargs):
    """On call $MARK_AT: write the file $MARK (the parent's cue) and wait a second, mid-step."""
    global calls
    calls += 1
    if str(calls) == os.environ.get("MARK_AT"):
        open(os.environ["MARK"], "w").close()
        time.sleep(1.0)
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]
'''


@pytest.mark.slow
def test_sigterm_mid_step_saves_and_resume_equals_a_straight_run(tiny_model_dir, tmp_path):
    reward = tmp_path / "slow_reward.py"
    reward.write_text(SLOW_REWARD)
    extra = {"rewards": f"['{reward}:mark_then_wait']", "run.save_every": 10}
    straight = tmp_path / "straight"
    run_training(None, overrides=tiny_overrides(tiny_model_dir, straight, steps=3, **extra))
    run_dir, mark = tmp_path / "run", tmp_path / "in_step_2"
    args = [sys.executable, "-m", "fastgrpo", *cli_args(tiny_model_dir, run_dir, 3, **extra)]
    process = subprocess.Popen(
        args,
        env={**ENV, "MARK_AT": "2", "MARK": str(mark)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not mark.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, err[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["interrupted"] and summary["steps"] == 2
    assert latest_checkpoint(run_dir).name == "step_000002"
    config = load_resume_config(run_dir, trust_run_code=True)  # our own reward file
    assert run_training(config, resume=True).steps == 3
    assert_same_run(straight, run_dir)


def test_a_stop_signal_in_the_final_evaluation_exits_and_resume_runs_only_that_evaluation(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    run_dir = tmp_path / "run"
    original = evaluate_module.evaluate

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    monkeypatch.setattr(evaluate_module, "evaluate", interrupted)
    assert main(cli_args(tiny_model_dir, run_dir, steps=2, **{"eval.after": True})) == 143
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "final evaluation" in err and "--resume" in err
    assert latest_checkpoint(run_dir).name == "step_000002"
    monkeypatch.undo()
    assert main(["train", "--resume", str(run_dir)]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("kind", "train") == "train"] == [1, 2]
    assert [(r["when"], r["step"]) for r in records if r.get("kind") == "eval"] == [("after", 2)]


def test_sigterm_during_a_rollout_abandons_the_step_saves_the_last_and_resume_equals_a_straight_run(
    tiny_model_dir, tmp_path, monkeypatch
):
    """SIGTERM while step 2 rolls out: the engine cuts its waves at the next look (9 tokens: the
    prefill's and 8 decode steps, not the 40 asked), the step is dropped, step 1 is saved, and the run resumed takes
    steps 2 and 3 as a straight run does (the prompt order and random state went back)."""
    rewards = f"['{write_test_rewards(tmp_path)}:digit_share']"
    extra = {"rewards": rewards, "rollout.max_new_tokens": 40, "run.save_every": 10}
    straight = tmp_path / "straight"
    run_training(None, overrides=tiny_overrides(tiny_model_dir, straight, steps=3, **extra))
    original, calls, lengths = step_module.sample_completions, [], []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # step 2's rollout
            os.kill(os.getpid(), signal.SIGTERM)
        rollout = original(*args, **kwargs)
        lengths.append(int(rollout.lengths.max()))
        return rollout

    monkeypatch.setattr(step_module, "sample_completions", signalled)
    run_dir = tmp_path / "run"
    result = run_training(None, overrides=tiny_overrides(tiny_model_dir, run_dir, steps=3, **extra))
    assert result.interrupted and result.steps == 1 and len(calls) == 2
    assert lengths[0] == 40 and lengths[1] <= 9  # the tiny model rambles: only the cut stops it
    assert latest_checkpoint(run_dir).name == "step_000001"
    assert [r["step"] for r in train_steps(run_dir)] == [1]
    monkeypatch.undo()
    config = load_resume_config(run_dir, trust_run_code=True)
    assert run_training(config, resume=True).steps == 3
    assert_same_run(straight, run_dir)

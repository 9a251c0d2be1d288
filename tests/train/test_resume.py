"""Resuming a run: changed settings take effect or are refused, finished runs stay finished, a
cut-off metrics line is dropped, and nothing in a run folder runs code unasked."""

from __future__ import annotations

import json
import pickle
import random

import numpy as np
import pytest
import torch
import yaml
from test_training_run import tiny_overrides, weights, write_test_rewards

from fastgrpo.cli import main
from fastgrpo.config import ConfigError
from fastgrpo.train import load_resume_config, run_training
from fastgrpo.train import loop as loop_module
from fastgrpo.train import step as step_module
from fastgrpo.train.checkpoint import STATE_FILE, latest_checkpoint, load_trainer_state


def train_tiny(model_dir, run_dir, steps=2, **extra):
    return run_training(None, overrides=tiny_overrides(model_dir, run_dir, steps=steps, **extra))


def resume(run_dir, *overrides, trust=False):
    config = load_resume_config(run_dir, overrides, trust_run_code=trust)
    return run_training(config, resume=True, trust_run_code=trust)


def lrs_in_force(monkeypatch) -> list[list[float]]:
    """The AdamW param groups' learning rates at each update (what really steps the weights)."""
    seen = []
    original = step_module.update_policy

    def spy(model, optimizer, *args, **kwargs):
        seen.append([group["lr"] for group in optimizer.adamw.param_groups])
        return original(model, optimizer, *args, **kwargs)

    monkeypatch.setattr(step_module, "update_policy", spy)
    return seen


# ----------------------------------------------------------------------------- changed settings


def test_resume_with_a_new_learning_rate_trains_at_it_and_records_the_change(
    tiny_model_dir, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    train_tiny(tiny_model_dir, run_dir, steps=2, **{"train.learning_rate": 1e-5})
    seen = lrs_in_force(monkeypatch)
    result = resume(run_dir, "train.learning_rate=1e-3", "train.steps=3")
    assert result.steps == 3
    assert seen == [[1e-3, 1e-3]]  # both param groups (decayed and not) step at the new lr
    assert result.history[0]["lr"] == 1e-3
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["learning_rate"] == 1e-3
    changes = [json.loads(line) for line in (run_dir / "config_changes.jsonl").open()]
    assert changes == [
        {"after_step": 2, "key": "train.steps", "from": 2, "to": 3},
        {"after_step": 2, "key": "train.learning_rate", "from": 1e-5, "to": 1e-3},
    ]


def test_a_longer_cosine_schedule_on_resume_gives_the_lr_of_a_run_started_with_it(
    tiny_model_dir, tmp_path, monkeypatch
):
    cosine = {"train.lr_scheduler": "cosine", "train.warmup_steps": 1}
    seen = lrs_in_force(monkeypatch)
    train_tiny(tiny_model_dir, tmp_path / "straight", steps=4, **cosine)
    want = seen[2:]
    train_tiny(tiny_model_dir, tmp_path / "run", steps=2, **cosine)
    seen.clear()
    resume(tmp_path / "run", "train.steps=4")
    assert seen == want and want[0][0] > 0


@pytest.mark.parametrize(
    "override",
    ["rollout.num_generations=2", "algo.loss_type=dapo", "train.seed=1", "task.max_value=9"],
)
def test_resume_refuses_to_change_what_the_checkpoint_was_trained_with(
    tiny_model_dir, tmp_path, override, capsys
):
    run_dir = tmp_path / "run"
    train_tiny(tiny_model_dir, run_dir, steps=1)
    config_before = (run_dir / "config.yaml").read_text()
    assert (
        main(["train", "--resume", str(run_dir), "--set", override, "--set", "train.steps=2"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and override.split("=")[0] in err
    assert (run_dir / "config.yaml").read_text() == config_before
    assert not (run_dir / "config_changes.jsonl").exists()
    assert latest_checkpoint(run_dir).name == "step_000001"


# ----------------------------------------------------------------------------- finished runs


def test_resuming_a_finished_run_does_nothing_unless_steps_are_raised(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    run_dir = tmp_path / "run"
    train_tiny(tiny_model_dir, run_dir, steps=1, **{"eval.after": True})
    metrics = (run_dir / "metrics.jsonl").read_text()
    loads = []
    monkeypatch.setattr(loop_module, "load_configured_model", lambda *a: loads.append(a))
    assert main(["train", "--resume", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "nothing to do" in out and "train.steps" in out
    assert not loads  # not even the model was loaded
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # no second final evaluation
    with pytest.raises(ConfigError, match="below the 1 steps"):
        resume(run_dir, "train.steps=0")
    monkeypatch.undo()
    result = resume(run_dir, "train.steps=2")
    assert result.steps == 2 and len(result.history) == 1 and not result.finished_before
    whens = [
        (r["when"], r["step"])
        for r in map(json.loads, open(run_dir / "metrics.jsonl"))
        if r.get("kind") == "eval"
    ]
    assert whens == [("after", 1), ("after", 2)]


def test_a_run_stopped_in_its_final_evaluation_resumes_to_that_evaluation_only(
    tiny_model_dir, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    train_tiny(tiny_model_dir, run_dir, steps=1)  # eval.after off: as if it stopped there
    result = resume(run_dir, "eval.after=true")
    assert result.steps == 1 and result.history == [] and result.eval_after is not None
    evals = [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if r.get("kind")]
    assert [(r["when"], r["step"]) for r in evals] == [("after", 1)]


# ----------------------------------------------------------------------------- metrics


def test_a_cut_off_last_metrics_line_is_dropped_with_a_warning_on_resume(
    tiny_model_dir, tmp_path, caplog
):
    run_dir = tmp_path / "run"
    train_tiny(tiny_model_dir, run_dir, steps=1)
    with open(run_dir / "metrics.jsonl", "a") as file:
        file.write('{"reward/mean": 0.25, "step": 2, "acc')  # the disk filled mid-write
    result = resume(run_dir, "train.steps=2")
    assert result.steps == 2
    assert "cut off mid-write" in caplog.text
    steps = [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")]
    assert steps == [1, 2]


# ----------------------------------------------------------------------------- code in a run


def test_trainer_state_loads_without_unpickling_python_objects(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    train_tiny(tiny_model_dir, run_dir, steps=1)
    state = torch.load(latest_checkpoint(run_dir) / STATE_FILE, weights_only=True)
    assert state["step"] == 1 and state["format"] == 2


class _Payload:
    """Unpickling this calls open(marker, "w"): a stand-in for any code a pickle can run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_crafted_trainer_state_does_not_run_on_resume(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    train_tiny(tiny_model_dir, run_dir, steps=1)
    marker = tmp_path / "pwned"
    path = latest_checkpoint(run_dir) / STATE_FILE
    state = torch.load(path, weights_only=True)
    torch.save({**state, "extra": _Payload(marker)}, path)
    assert main(["train", "--resume", str(run_dir), "--set", "train.steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--trust-run-code" in err and STATE_FILE in err
    assert not marker.exists()


def test_an_older_trainer_state_resumes_only_when_trusted(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    train_tiny(tiny_model_dir, run_dir, steps=1)
    path = latest_checkpoint(run_dir) / STATE_FILE
    state = load_trainer_state(latest_checkpoint(run_dir))
    # the format before: Python's and numpy's RNG states as their own objects
    random.seed(3)
    np.random.seed(3)
    state["rng"].update(python=random.getstate(), numpy=np.random.get_state())
    del state["format"]
    torch.save(state, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    with pytest.raises(ConfigError, match="--trust-run-code"):
        resume(run_dir, "train.steps=2")
    result = resume(run_dir, "train.steps=2", trust=True)
    assert result.steps == 2
    assert torch.load(latest_checkpoint(run_dir) / STATE_FILE, weights_only=True)["step"] == 2


def test_resume_shows_reward_code_from_the_run_folder_and_needs_trust_for_it(
    tiny_model_dir, tmp_path, capsys, caplog
):
    run_dir = tmp_path / "run"
    spec = f"{write_test_rewards(tmp_path)}:digit_share"
    train_tiny(tiny_model_dir, run_dir, steps=1, rewards=f"['{spec}']")
    assert main(["train", "--resume", str(run_dir), "--set", "train.steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and spec in err and "--trust-run-code" in err
    assert latest_checkpoint(run_dir).name == "step_000001"
    for extra in (["--trust-run-code"], ["--set", f"rewards=['{spec}']"]):  # trusted or named
        caplog.clear()
        steps = 2 if extra[0] == "--trust-run-code" else 3
        args = ["train", "--resume", str(run_dir), "--set", f"train.steps={steps}", *extra]
        assert main(args) == 0
        assert spec in caplog.text  # the code it runs is shown either way
    assert latest_checkpoint(run_dir).name == "step_000003"
    final = weights(latest_checkpoint(run_dir))
    assert all(torch.isfinite(v).all() for v in final.values())


# ----------------------------------------------------------------------------- eval of a run


def write_task_folder(folder):
    folder.mkdir()
    for split, count in (("train", 8), ("test", 10)):
        rows = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(count)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_eval_of_a_run_or_checkpoint_folder_uses_the_runs_own_task_and_settings(
    tiny_model_dir, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    task = write_task_folder(tmp_path / "task")
    train_tiny(tiny_model_dir, run_dir, steps=1, **{"task.name": "jsonl", "task.path": task})
    capsys.readouterr()
    for model in (run_dir, latest_checkpoint(run_dir), latest_checkpoint(run_dir) / "model"):
        assert main(["eval", "--model", str(model)]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["task"] == "jsonl"  # not the default arithmetic task
        assert result["num_problems"] == 4  # the run's eval.num_problems, not the default 100
        assert result["model"] == str(latest_checkpoint(run_dir) / "model")
    assert main(["eval", "--model", str(run_dir), "--set", "eval.num_problems=2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["num_problems"] == 2


def test_eval_of_a_run_folder_with_reward_code_needs_trust(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    spec = f"{write_test_rewards(tmp_path)}:digit_share"
    train_tiny(tiny_model_dir, run_dir, steps=1, rewards=f"['{spec}']")
    capsys.readouterr()
    assert main(["eval", "--model", str(run_dir), "--num", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and spec in err and "--trust-run-code" in err
    assert main(["eval", "--model", str(run_dir), "--num", "2", "--trust-run-code"]) == 0


def test_a_damaged_trainer_state_is_named_in_one_line(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    train_tiny(tiny_model_dir, run_dir, steps=1)
    path = latest_checkpoint(run_dir) / STATE_FILE
    path.write_bytes(path.read_bytes()[:100])
    assert main(["train", "--resume", str(run_dir), "--set", "train.steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot be read" in err and "step_000001" in err


def test_resume_refuses_to_move_the_run_to_another_folder(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    train_tiny(tiny_model_dir, run_dir, steps=1)
    args = ["train", "--resume", str(run_dir), "--output-dir", str(tmp_path / "elsewhere")]
    assert main([*args, "--set", "train.steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "copy the folder" in err
    assert not (tmp_path / "elsewhere").exists()

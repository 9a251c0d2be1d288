"""run.report_to: every step's and evaluation's numbers in TensorBoard's event files and in a
W&B run (a stand-in module: W&B itself needs an account), and one line when one is missing."""

from __future__ import annotations

import sys
import types

import pytest

from fastgrpo.config import ConfigError, load_config
from fastgrpo.train import run_training
from tests.train.test_training_run import tiny_overrides

EXTRA = {"eval.before": True, "eval.after": True, "eval.num_problems": 2}


def test_tensorboard_holds_every_step_and_evaluation(tiny_model_dir, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    over = tiny_overrides(
        tiny_model_dir, run, steps=2, **EXTRA, **{"run.report_to": "[tensorboard]"}
    )
    result = run_training(None, overrides=over)
    events = EventAccumulator(str(run / "tensorboard")).Reload()
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [1, 2]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in result.history])
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 2]
    assert "time/rollout" in events.Tags()["scalars"]


def test_wandb_gets_every_record_at_its_step_and_finishes(tiny_model_dir, tmp_path, monkeypatch):
    logged, runs = [], []

    class Run:
        def log(self, values, step):
            logged.append((step, values))

        def finish(self):
            runs.append("finished")

    def init(**kwargs):
        runs.append(kwargs)
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    run = tmp_path / "run"
    over = tiny_overrides(tiny_model_dir, run, steps=2, **EXTRA, **{"run.report_to": "[wandb]"})
    run_training(None, overrides=over)
    assert runs[0]["name"] == "run" and runs[0]["resume"] == "allow"
    assert runs[0]["config"]["train"]["steps"] == 2 and runs[-1] == "finished"
    steps = [(step, "eval/accuracy" in values, "loss" in values) for step, values in logged]
    assert steps == [(0, True, False), (1, False, True), (2, False, True), (2, True, False)]


def test_an_unknown_or_missing_reporter_is_one_line_and_writes_nothing(
    tiny_model_dir, tmp_path, monkeypatch
):
    with pytest.raises(ConfigError, match="'run.report_to' names 'mlflow'; choose from"):
        load_config(overrides=["run.report_to=[mlflow]"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="wandb needs the wandb package: pip install wandb"):
        run_training(
            None, overrides=tiny_overrides(tiny_model_dir, run, **{"run.report_to": "[wandb]"})
        )
    assert not (run / "config.yaml").exists()

"""The progress bar: its rate and ETA leave evaluations out, and lines written while it is up
(evaluations, checkpoints) appear whole above it, even when stdout buffers (issue 28, item 10)."""

from __future__ import annotations

import sys
import time

from fastgrpo.train import run_training
from fastgrpo.train.metrics import MetricsLog
from tests.train.test_training_run import tiny_overrides


class Terminal:
    """One screen that an unbuffered stderr and a block-buffered stdout (a pipe) both write to."""

    def __init__(self):
        self.text = ""
        self.stderr = Stream(self, buffered=False)
        self.stdout = Stream(self, buffered=True)


class Stream:
    def __init__(self, terminal: Terminal, buffered: bool):
        self.terminal, self.buffered, self.pending = terminal, buffered, ""

    def write(self, text: str) -> int:
        self.pending += text
        if not self.buffered:
            self.flush()
        return len(text)

    def flush(self) -> None:
        self.terminal.text += self.pending
        self.pending = ""

    def isatty(self) -> bool:
        return False


def test_evaluation_time_counts_neither_in_the_rate_nor_in_the_eta(tmp_path):
    log = MetricsLog(tmp_path, total_steps=10, start_step=0, show_progress=True)
    with log.paused():  # an evaluation before the first step
        time.sleep(0.6)
    time.sleep(0.15)  # the step itself
    log.log({"step": 1, "reward/mean": 0.5})
    elapsed, rate = log.bar.format_dict["elapsed"], log.bar.format_dict["rate"]
    log.close()
    assert elapsed < 0.5
    assert rate > 3  # 1 step in ~0.15 s; with the evaluation counted it would be ~1.3 step/s


def test_lines_written_under_the_bar_appear_whole_and_in_order_above_it(tmp_path, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal.stderr)
    monkeypatch.setattr(sys, "stdout", terminal.stdout)
    log = MetricsLog(tmp_path, total_steps=3, start_step=0, show_progress=True)
    log.write("eval (before, step 0): accuracy 0.250")
    log.log({"step": 1, "reward/mean": 0.5})
    log.write("checkpoint: saved step_000001")
    shown_before_the_end = terminal.text
    log.close()
    terminal.stdout.flush()
    lines = [line.split("\r")[-1] for line in terminal.text.split("\n")]  # what a screen shows
    assert "eval (before, step 0): accuracy 0.250" in lines
    assert "checkpoint: saved step_000001" in lines
    # in order: not held back by stdout's buffer until the bar has moved on (or the run ended)
    assert shown_before_the_end.index("eval (before") < shown_before_the_end.index("1/3")
    assert "checkpoint: saved" in shown_before_the_end


def test_each_checkpoint_line_states_its_size_and_time(tiny_model_dir, tmp_path, capsys):
    overrides = tiny_overrides(tiny_model_dir, tmp_path / "run", steps=2, **{"run.save_every": 1})
    run_training(None, overrides=overrides)
    lines = [line for line in capsys.readouterr().out.splitlines() if "checkpoint:" in line]
    assert len(lines) == 2
    assert "step_000001 (" in lines[0] and " MB in " in lines[0]
    assert " s; the newest run.keep_checkpoints=2" in lines[0]

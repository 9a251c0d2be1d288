"""`fastgrpo plot RUN_DIR` and the pictures a run draws at its end."""

from __future__ import annotations

import pytest

from fastgrpo.cli import main
from fastgrpo.train import run_training
from tests.train.test_training_run import tiny_overrides

pytest.importorskip("matplotlib")


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_a_run_draws_its_plots_at_the_end_and_the_command_redraws_them(
    tiny_model_dir, tmp_path, capsys
):
    run = tmp_path / "run"
    overrides = tiny_overrides(tiny_model_dir, run, steps=2, **{"run.plots": True})
    run_training(None, overrides=overrides)
    pictures = [run / "plots" / "by_step.png", run / "plots" / "by_time.png"]
    assert all(png_size(p) == (1170, 585) for p in pictures)  # 13 x 6.5 inches at 90 dpi
    for p in pictures:
        p.unlink()
    assert main(["plot", str(run)]) == 0
    assert all(p.is_file() for p in pictures)
    assert "by_time.png" in capsys.readouterr().out


def test_plot_of_a_folder_without_metrics_is_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "holds no metrics.jsonl" in capsys.readouterr().err

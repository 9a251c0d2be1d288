"""Metrics to TensorBoard and Weights & Biases (`run.report_to`), beside `metrics.jsonl`.

Each reporter receives every record the run writes: a training step's numbers under their own
names, an evaluation's under `eval/` (at the step it ran after). Both are optional extras: a run
that asks for one that is not installed stops before it starts, with the `pip install` to run.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from fastgrpo.config import ConfigError


def numbers(record: dict) -> dict[str, float]:
    """The record's numeric values to plot, eval ones under `eval/`; bookkeeping keys left out."""
    prefix = "eval/" if record.get("kind") == "eval" else ""
    return {
        f"{prefix}{key}": float(value)
        for key, value in record.items()
        if key not in ("step", "kind")
        and isinstance(value, int | float)
        and not isinstance(value, bool)
    }


class TensorBoardReporter:
    """Scalars in RUN_DIR/tensorboard/ (`tensorboard --logdir RUN_DIR/tensorboard`)."""

    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "run.report_to: tensorboard needs the tensorboard package: pip install tensorboard"
            ) from None
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, record: dict) -> None:
        step = int(record.get("step", 0))
        for key, value in numbers(record).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbReporter:
    """A W&B run named after the run folder (project: WANDB_PROJECT, default "fastgrpo"),
    resumed by a resumed run; WANDB_MODE=offline keeps it on disk."""

    def __init__(self, run_dir: Path, config: dict):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "run.report_to: wandb needs the wandb package: pip install wandb "
                "(then `wandb login`, or WANDB_MODE=offline)"
            ) from None
        run_dir = Path(run_dir).resolve()
        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "fastgrpo"),
            name=run_dir.name,
            id=hashlib.sha1(str(run_dir).encode()).hexdigest()[:16],  # the same on resume
            resume="allow",
            dir=str(run_dir),
            config=config,
        )

    def log(self, record: dict) -> None:
        self.run.log(numbers(record), step=int(record.get("step", 0)))

    def close(self) -> None:
        self.run.finish()


def make_reporters(names: list[str], run_dir: Path, config: dict) -> list:
    """The reporters `run.report_to` names (validated with the config), ready to log."""
    return [
        TensorBoardReporter(run_dir) if name == "tensorboard" else WandbReporter(run_dir, config)
        for name in dict.fromkeys(names)
    ]

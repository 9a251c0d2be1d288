"""Pictures of a run from its metrics.jsonl: `fastgrpo plot RUN_DIR`, and at the end of a run.

Two PNGs in RUN_DIR/plots/, the same six panels against the step and against training time (the
steps' seconds summed, evaluations left out): reward and accuracy (held-out evaluations as
points), completion length, truncated fraction, KL and entropy, clip fractions, seconds per
phase. Needs matplotlib (`pip install matplotlib`), an optional extra.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from fastgrpo.errors import UserError
from fastgrpo.train.metrics import read_records

PANELS = (
    ("reward and accuracy", ("reward/mean", "accuracy")),
    ("completion length (tokens)", ("completion/mean_length", "completion/max_length")),
    ("truncated fraction", ("completion/truncated_frac",)),
    ("KL and entropy", ("kl", "entropy")),
    ("clip fractions", ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")),
    (
        "seconds per phase",
        tuple(
            f"time/{p}"
            for p in ("rollout", "reward", "reference", "old_logprobs", "update", "optimizer")
        ),
    ),  # fmt: skip
)


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write RUN_DIR/plots/by_step.png and by_time.png; their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plots need matplotlib: `pip install matplotlib`") from None
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir} holds no metrics.jsonl; give a run folder")
    records = read_records(path)
    steps = [r for r in records if r.get("kind", "train") == "train" and "step" in r]
    if not steps:
        raise UserError(f"{path} holds no training steps yet")
    evals = [r for r in records if r.get("kind") == "eval"]
    clock = dict(zip([r["step"] for r in steps],
                     itertools.accumulate(r.get("time/step", 0.0) for r in steps)))  # fmt: skip
    clock[0] = 0.0
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for axis, label in (("step", "step"), ("time", "training time, s (evaluations left out)")):
        x_of = (lambda s: s) if axis == "step" else (lambda s: clock.get(s, 0.0))  # noqa: E731
        figure, grid = plt.subplots(2, 3, figsize=(13, 6.5))
        for ax, (title, keys) in zip(grid.flat, PANELS):
            for key in keys:
                points = [(x_of(r["step"]), r[key]) for r in steps if r.get(key) is not None]
                if points:
                    ax.plot(*zip(*points), label=key, linewidth=1.2)
            if title.startswith("reward"):
                held = [(x_of(r["step"]), r["accuracy"]) for r in evals if "accuracy" in r]
                if held:
                    ax.plot(*zip(*held), "o-", color="black", label="held-out accuracy")
            ax.set_title(title, fontsize=10)
            ax.set_xlabel(label, fontsize=8)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
        figure.suptitle(f"{Path(run_dir).resolve().name}: {len(steps)} steps", fontsize=11)
        figure.tight_layout()
        target = out_dir / f"by_{axis}.png"
        figure.savefig(target, dpi=90)
        plt.close(figure)
        written.append(target)
    return written

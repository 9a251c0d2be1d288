"""`python -m benchmarks.bench_step` runs end to end on a tiny model on the CPU and reports what it claims."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PHASES = {"rollout", "reward", "reference", "old_logprobs", "update", "optimizer"}


def test_bench_step_times_real_grpo_steps_with_forced_completion_lengths():
    args = ["--tiny", "--device", "cpu", "--steps", "1", "--warmup", "0"]
    args += ["--prompts", "2", "--samples", "4", "--prompt-len", "16", "--completion-len", "24"]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_step", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("method") for line in lines)  # the table
    report = json.loads(lines[-1])
    assert report["bench"] == "step" and report["gpu"] == "cpu"
    assert report["torch"] and "commit" in report
    assert report["workload"]["completion_len"] == 24 and report["workload"]["beta"] == 0.04
    (row,) = report["results"]
    assert row["method"] == "fastgrpo"
    assert row["completion_length"] == [24, 24]  # no completion stopped early
    assert row["zero_std_groups"] == 0  # distinct rewards in every group
    assert row["seconds_per_step"] > 0 and row["peak_memory_gib"] is None  # no GPU
    tokens_per_s = 2 * 4 * 24 / row["seconds_per_step"]
    assert abs(row["completion_tokens_per_s"] - tokens_per_s) < 1e-6 * tokens_per_s
    assert set(row["phases"]) == PHASES
    assert sum(row["phases"].values()) <= row["seconds_per_step"]

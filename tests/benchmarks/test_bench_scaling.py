"""bench_scaling.py runs its torchrun jobs and reports a row per process count (CPU smoke test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_scaling_benchmark_reports_one_row_per_process_count():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_scaling",
            "--tiny",
            "--device",
            "cpu",
            "--counts",
            "1",
            "2",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--prompts-per-gpu",
            "2",
            "--samples",
            "2",
            "--completion-len",
            "8",
            "--prompt-len",
            "8",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    rows = result["results"]
    assert [r["processes"] for r in rows] == [1, 2]
    assert [r["prompts"] for r in rows] == [2, 4]  # weak scaling: the batch grows with them
    assert all(r["completion_tokens_per_s"] > 0 for r in rows)

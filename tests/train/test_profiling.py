"""Step profiling: per-phase times (optimizer apart), NVTX ranges, `--profile N` Chrome traces."""

from __future__ import annotations

import json
import time

import pytest
import torch
from test_training_run import tiny_overrides, weights, write_test_rewards

from fastgrpo.cli import build_parser, main
from fastgrpo.config import ConfigError, load_config
from fastgrpo.train import profiling, run_training
from fastgrpo.train.checkpoint import latest_checkpoint
from fastgrpo.train.profiling import PhaseTimer, profiled_steps

PHASES = ("rollout", "reward", "reference", "old_logprobs", "update", "optimizer")


def cli_args(overrides: list[str]) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def train_records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind", "train") == "train"]


def test_profile_writes_a_chrome_trace_of_the_step_after_the_first_and_changes_no_result(
    tiny_model_dir, tmp_path, capsys
):
    rewards = f"['{write_test_rewards(tmp_path)}:digit_share']"
    settings = {"rewards": rewards, "algo.beta": 0.04}
    plain = tiny_overrides(tiny_model_dir, tmp_path / "plain", steps=2, **settings)
    profiled = tiny_overrides(tiny_model_dir, tmp_path / "profiled", steps=2, **settings)
    run_training(None, overrides=plain)
    assert main(["train", "--profile", "1", *cli_args(profiled)]) == 0

    trace = tmp_path / "profiled" / "profile" / "trace_steps_2-2.json"  # step 1 warms up
    assert f"wrote {trace}" in capsys.readouterr().out
    assert list((tmp_path / "profiled" / "profile").iterdir()) == [trace]
    events = json.loads(trace.read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert {"grpo/step 2", *(f"grpo/{p}" for p in PHASES)} <= names
    assert "grpo/step 1" not in names
    assert not (tmp_path / "plain" / "profile").exists()

    plain_records, profiled_records = (train_records(tmp_path / n) for n in ("plain", "profiled"))
    assert len(plain_records) == len(profiled_records) == 2
    for want, got in zip(plain_records, profiled_records):
        for key, value in want.items():
            if not key.startswith("time/") and key not in ("tokens_per_s", "peak_memory_gib"):
                assert got[key] == value, key
    final_plain = weights(latest_checkpoint(tmp_path / "plain"))
    final_profiled = weights(latest_checkpoint(tmp_path / "profiled"))
    assert all(torch.equal(final_profiled[k], v) for k, v in final_plain.items())

    # resuming does not profile again unless asked to; then step 4 warms up and 5 is recorded
    # (--trust-run-code: the run's config names a reward file, our own)
    resume = ["train", "--resume", str(tmp_path / "profiled"), "--trust-run-code"]
    assert main([*resume, "--set", "train.steps=3"]) == 0
    assert list((tmp_path / "profiled" / "profile").iterdir()) == [trace]
    assert main([*resume, "--set", "train.steps=5", "--profile", "1"]) == 0
    assert (tmp_path / "profiled" / "profile" / "trace_steps_5-5.json").is_file()


def test_a_one_step_run_profiles_its_only_step(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(tiny_model_dir, run_dir, steps=1, **{"run.profile_steps": 3})
    result = run_training(None, overrides=overrides)
    assert result.profile_trace == run_dir / "profile" / "trace_steps_1-1.json"
    assert json.loads(result.profile_trace.read_text())["traceEvents"]


def test_step_metrics_time_every_phase_with_the_optimizer_apart(tiny_model_dir, tmp_path):
    settings = {"train.num_iterations": 2, "train.mini_batches": 2, "algo.beta": 0.04}
    overrides = tiny_overrides(tiny_model_dir, tmp_path / "run", steps=1, **settings)
    record = run_training(None, overrides=overrides).history[0]
    times = [key for key in record if key.startswith("time/")]
    assert times == [f"time/{p}" for p in PHASES] + ["time/step"]
    assert all(record[key] > 0 for key in times)
    # the four optimizer steps are in time/optimizer, not in time/update
    assert sum(record[f"time/{p}"] for p in PHASES) <= record["time/step"]


def test_each_phase_is_an_nvtx_range_where_cuda_is_available(tiny_model_dir, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(profiling, "NVTX", True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(name))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(None))
    run_training(None, overrides=tiny_overrides(tiny_model_dir, tmp_path / "run", steps=1))
    pushed = [name for name in calls if name is not None]
    # a phase may be several ranges (the reward's scoring and its advantages; the optimizer's
    # steps): each phase appears, in the step's order
    assert list(dict.fromkeys(pushed)) == ["grpo/step 1", *(f"grpo/{p}" for p in PHASES)]
    depth = 0
    for name in calls:  # every range is closed, innermost first
        depth += 1 if name is not None else -1
        assert depth >= 0
    assert depth == 0


def sleep_in_nested_phases(timer: PhaseTimer) -> None:
    """0.02 s in "update" itself, around two 0.05 s "optimizer" phases nested in it."""
    with timer("update"):
        time.sleep(0.02)
        for _ in range(2):
            with timer("optimizer"):
                time.sleep(0.05)


def test_phase_timer_leaves_nested_phases_out_of_the_outer_one_and_adds_up_repeats():
    timer = PhaseTimer(torch.device("cpu"))
    sleep_in_nested_phases(timer)
    assert list(timer.times) == ["time/update", "time/optimizer"]
    assert timer.times["time/optimizer"] >= 0.1
    assert 0.02 <= timer.times["time/update"] < timer.times["time/optimizer"]


@pytest.mark.parametrize(
    "num_steps, start, total, expected",
    [
        (1, 0, 3, (2, 2)),  # the first step warms up: skip it
        (5, 0, 3, (2, 3)),  # no more steps than the run has
        (2, 0, 1, (1, 1)),  # a one-step run profiles that step
        (2, 2, 6, (4, 5)),  # resumed after step 2: step 3 is this process's warm-up
        (1, 4, 5, (5, 5)),  # resumed with one step left
        (0, 0, 3, None),
        (1, 3, 3, None),  # nothing left to run
    ],
)
def test_profiled_steps_skip_the_warm_up_step_unless_it_is_the_only_one(
    num_steps, start, total, expected
):
    assert profiled_steps(num_steps, start, total) == expected


def test_negative_profile_steps_is_refused_with_what_to_fix(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"'run.profile_steps' is -1; it must be >= 0 \(set 0"):
        load_config(None, ["run.profile_steps=-1"])
    run_dir = tmp_path / "run"
    assert main(["train", "--profile", "-1", "--set", f"run.output_dir={run_dir}"]) == 2
    assert "run.profile_steps" in capsys.readouterr().err
    assert not run_dir.exists()


def test_train_profile_flag_is_parsed():
    args = build_parser().parse_args(["train", "--profile", "3"])
    assert args.profile == 3
    assert build_parser().parse_args(["train"]).profile is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_phase_timer_on_a_gpu_reads_event_spans_once_at_the_end():
    """CUDA events instead of a synchronisation at each boundary: host-only phases span the host's
    time (the GPU is idle when their markers are recorded), nesting is left out of the outer
    phase, and a phase of GPU work gets that work's time even though the host left it at once."""
    timer = PhaseTimer(torch.device("cuda"))
    sleep_in_nested_phases(timer)
    x = torch.randn(4096, 4096, device="cuda")
    start = time.perf_counter()
    with timer("gpu"):
        for _ in range(50):
            x = torch.tanh(x @ x)
    queued = time.perf_counter() - start  # the host only queued the work
    times = timer.times
    assert list(times) == ["time/update", "time/optimizer", "time/gpu"]
    assert 0.099 <= times["time/optimizer"] < 0.2
    assert 0.019 <= times["time/update"] < times["time/optimizer"]
    assert times["time/gpu"] > queued  # 50 GEMMs of 4096^3 take longer than queueing them

"""`fastgrpo train --nproc 2` on the CPU (torchrun, gloo): the same run as one process.

Every rank rolls out its share of the prompt groups, each row sampling with its number in the
global batch, so the two processes see the one process's rollout; with the batch-wide reductions
the weights after the run match. Rank 0 alone writes the run folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from fastgrpo.train import run_training
from fastgrpo.train.checkpoint import latest_checkpoint
from fastgrpo.train.optim import SHARDS_FOLDER
from tests.train.test_training_run import tiny_overrides, write_test_rewards

EXTRA = {
    "rollout.prompts_per_step": 4,
    "train.mini_batches": 2,
    "algo.beta": 0.04,
    "algo.scale_rewards": "batch",
}


def weights(run_dir) -> dict:
    folder = latest_checkpoint(run_dir) / "model"
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


PARALLEL = ["replicated", "sharded", "fsdp"]

AT_EXIT_MARKER = """
import atexit
import os
from pathlib import Path

atexit.register(lambda: (Path(__file__).parent / f"exited_{os.environ['RANK']}").touch())

def zero(prompts, completions, **kwargs):
    return [0.0] * len(completions)
"""


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [*PARALLEL, "fsdp, engine copy freed"])
def test_two_processes_train_the_weights_one_process_trains(tiny_model_dir, tmp_path, parallel):
    """... and with the engine's copy freed during each update (train.fsdp_free_engine_copy: two
    mini-batches a step, so an optimizer step runs while the copy is away), the same too."""
    one, two = tmp_path / "one", tmp_path / "two"
    extra = {**EXTRA, "rewards": f"['{write_test_rewards(tmp_path)}:digit_share']"}
    extra |= {"eval.before": True, "eval.after": True, "eval.num_problems": 5}  # split 3 + 2
    run_training(None, overrides=tiny_overrides(tiny_model_dir, one, steps=2, **extra))
    if parallel == "fsdp, engine copy freed":
        parallel, extra["train.fsdp_free_engine_copy"] = "fsdp", True
    extra["train.parallel"] = parallel
    (tmp_path / "at_exit.py").write_text(AT_EXIT_MARKER)  # a reward of 0 that marks the exit
    extra["rewards"] = extra["rewards"][:-1] + f", '{tmp_path / 'at_exit.py'}:zero']"
    sets = [f"--set={item}" for item in tiny_overrides(tiny_model_dir, two, steps=2, **extra)]
    done = torchrun_train(sets)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("run folder:") == 1  # rank 0 reports the job
    said = {"fsdp": "fully sharded (FSDP) weights, gradients and"}.get(parallel, parallel)
    assert done.stdout.count(f"data parallel over 2 processes: {said} optimizer state") == 1
    # each rank ends without the interpreter's teardown, yet after its atexit handlers
    assert sorted(p.name for p in tmp_path.glob("exited_*")) == ["exited_0", "exited_1"]
    a, b = weights(one), weights(two)
    assert a.keys() == b.keys()
    start = load_file(f"{tiny_model_dir}/model.safetensors")
    assert max(float((a[k] - start[k]).abs().max()) for k in start) > 1e-4  # it trained
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
    records = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step") and r.get("kind", "train") == "train"]
    assert [r["step"] for r in steps] == [1, 2]  # one record per step: rank 0 writes
    straight = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    for mine, theirs in zip(steps, [r for r in straight if r.get("kind", "train") == "train"]):
        assert mine["completion/mean_length"] == pytest.approx(theirs["completion/mean_length"])
        assert mine["reward/std"] == pytest.approx(theirs["reward/std"], rel=1e-5)
    # the ranks evaluate a share each (3 and 2 problems): the whole set's scores, logged once
    evals = [[r for r in rs if r.get("kind") == "eval"] for rs in (straight, records)]
    assert [e["when"] for e in evals[1]] == ["before", "after"]
    for mine, theirs in zip(evals[1], evals[0], strict=True):
        assert mine["num_problems"] == theirs["num_problems"] == 5
        for key in ("accuracy", "reward_mean", "mean_length", "truncated"):
            assert mine[key] == pytest.approx(theirs[key], abs=1e-9), key


def torchrun_train(sets: list[str], *extra: str, timeout: float = 300, cache=None, nproc=2):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env["OMP_NUM_THREADS"] = "1"
    if cache is not None:
        env["FASTGRPO_CACHE"] = str(cache)
    return subprocess.run(
        [sys.executable, "-m", "fastgrpo", "train", "--nproc", str(nproc), *extra, *sets],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_two_process_run_resumed_takes_the_step_an_uninterrupted_one_takes(
    tiny_model_dir, tmp_path, parallel
):
    extra = {**EXTRA, "rewards": f"['{write_test_rewards(tmp_path)}:digit_share']"}
    extra["train.parallel"] = parallel
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    sets = lambda run, steps: [  # noqa: E731
        f"--set={s}" for s in tiny_overrides(tiny_model_dir, run, steps=steps, **extra)
    ]
    assert torchrun_train(sets(straight, 2)).returncode == 0
    assert torchrun_train(sets(halves, 1)).returncode == 0
    resumed = torchrun_train(["--set=train.steps=2"], "--resume", str(halves), "--trust-run-code")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = weights(straight), weights(halves)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_a_setting_no_rank_can_run_is_one_line_on_every_rank(tiny_model_dir, tmp_path):
    sets = [
        f"--set={s}"
        for s in tiny_overrides(tiny_model_dir, tmp_path / "run", **{"rollout.prompts_per_step": 3})
    ]
    done = torchrun_train(sets, timeout=120)
    assert done.returncode != 0
    # every rank refuses it before any process-group work; torchrun may stop the slower rank
    # (still importing, on a loaded machine) before it prints, so one line is all that is sure
    assert done.stderr.count("must be a multiple of the 2 processes") >= 1
    assert "Connection closed" not in done.stderr and "ProcessGroup" not in done.stderr
    assert not (tmp_path / "run").exists()


DYING_REWARD = """
import os

def dies_on_rank_1(prompts, completions, **kwargs):
    if os.environ.get("RANK") == "1":
        os._exit(3)  # a crash no Python handler sees
    return [0.0] * len(completions)
"""


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_job_with_its_rank_named(tiny_model_dir, tmp_path):
    (tmp_path / "dying.py").write_text(DYING_REWARD)
    rewards = f"['{tmp_path / 'dying.py'}:dies_on_rank_1']"
    sets = [
        f"--set={s}"
        for s in tiny_overrides(tiny_model_dir, tmp_path / "run", **{**EXTRA, "rewards": rewards})
    ]
    done = torchrun_train(sets, timeout=180)  # rank 0 waits in a collective: torchrun ends it
    assert done.returncode != 0
    assert "rank      : 1" in done.stderr and "exitcode  : 3" in done.stderr


def test_a_gpu_index_under_torchrun_is_one_line_before_joining(monkeypatch):
    from fastgrpo.config import Config, ConfigError
    from fastgrpo.train.parallel import join_world

    config = Config()
    config.model.device = "cuda:0"
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="LOCAL_RANK"):
        join_world(config)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert join_world(config) is None  # one process: no job to join


@pytest.mark.slow
@pytest.mark.parametrize("parallel", PARALLEL[:2])  # fsdp: the next test
def test_a_two_process_run_resumed_by_one_process_continues_the_same_run(
    tiny_model_dir, tmp_path, parallel
):
    """A checkpoint holds the one-process state (a sharded job gathers it) and every row samples
    by its global number: another process count continues the run (within fp32 summation
    noise), and the change is recorded."""
    extra = {**EXTRA, "rewards": f"['{write_test_rewards(tmp_path)}:digit_share']"}
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    run_training(None, overrides=tiny_overrides(tiny_model_dir, straight, steps=2, **extra))
    two = {**extra, "train.parallel": parallel}
    sets = [f"--set={s}" for s in tiny_overrides(tiny_model_dir, halves, steps=1, **two)]
    assert torchrun_train(sets).returncode == 0
    shards = halves / "checkpoints" / "step_000001" / SHARDS_FOLDER
    assert len(list(shards.glob("*.distcp"))) == (2 if parallel == "sharded" else 0)
    from fastgrpo.train import load_resume_config

    config = load_resume_config(str(halves), ["train.steps=2"], trust_run_code=True)
    run_training(config, resume=True, trust_run_code=True)
    a, b = weights(straight), weights(halves)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
    changes = [
        json.loads(line) for line in (halves / "config_changes.jsonl").read_text().splitlines()
    ]
    assert {"after_step": 1, "key": "processes", "from": 2, "to": 1} in changes


@pytest.mark.slow
def test_an_fsdp_run_of_two_processes_resumed_by_three_continues_the_same_run(
    tiny_model_dir, tmp_path
):
    """DCP reshards FSDP's per-parameter pieces by name: three processes read what two wrote,
    and the run goes on as one process's (within fp32 summation noise), the change recorded."""
    extra = {**EXTRA, "rewards": f"['{write_test_rewards(tmp_path)}:digit_share']"}
    extra["rollout.prompts_per_step"] = 12  # 6 groups per mini-batch: 3 or 2 per rank
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    run_training(None, overrides=tiny_overrides(tiny_model_dir, straight, steps=2, **extra))
    two = {**extra, "train.parallel": "fsdp"}
    sets = [f"--set={s}" for s in tiny_overrides(tiny_model_dir, halves, steps=1, **two)]
    assert torchrun_train(sets).returncode == 0
    resumed = torchrun_train(
        ["--set=train.steps=2"], "--resume", str(halves), "--trust-run-code", nproc=3
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume: processes 2 -> 3" in resumed.stdout
    assert len(list((latest_checkpoint(halves) / SHARDS_FOLDER).glob("*.distcp"))) == 3
    a, b = weights(straight), weights(halves)
    after_one = load_file(halves / "checkpoints" / "step_000001" / "model" / "model.safetensors")
    assert max(float((b[k] - after_one[k]).abs().max()) for k in b) > 1e-4  # step 2 was taken
    # fp32 sums in another order: uninterrupted 2- and 3-process runs of this batch are 1.4e-6
    # off one process (relative); lost or misplaced moments change the step itself
    for name in a:
        assert float((b[name] - a[name]).norm() / a[name].norm()) < 1e-5, name
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_an_fsdp_checkpoint_resumed_without_fsdp_says_how_to_resume_it(tiny_model_dir, tmp_path):
    """FSDP's checkpoint keeps per-parameter shards that only FSDP reads: one line, and the run
    folder is as it was."""
    extra = {**EXTRA, "rewards": f"['{write_test_rewards(tmp_path)}:digit_share']"}
    run = tmp_path / "run"
    two = {**extra, "train.parallel": "fsdp"}
    sets = [f"--set={s}" for s in tiny_overrides(tiny_model_dir, run, steps=1, **two)]
    done = torchrun_train(sets)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fully sharded (FSDP) weights, gradients and optimizer state" in done.stdout
    assert len(list((latest_checkpoint(run) / SHARDS_FOLDER).glob("*.distcp"))) == 2
    # the shards read back whole in one process are the (fp32) weights rank 0 wrote
    from fastgrpo.distributed.fsdp import read_fp32_weights
    from fastgrpo.models import load_model
    from fastgrpo.train.checkpoint import load_trainer_state

    meta = load_trainer_state(latest_checkpoint(run), trust=True)["optimizer"]
    model = load_model(str(latest_checkpoint(run) / "model"), device="cpu", dtype="float32")[0]
    read = read_fp32_weights(meta, model)
    assert len(read) == len(list(model.parameters()))
    for mine, theirs in zip(read, model.parameters()):
        torch.testing.assert_close(mine, theirs.detach(), rtol=0, atol=0)
    before = sorted(str(p) for p in run.rglob("*"))
    resumed = subprocess.run(
        [sys.executable, "-m", "fastgrpo", "train", "--resume", str(run), "--trust-run-code",
         "--set=train.steps=2"], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert "resume it with --set train.parallel=fsdp under torchrun" in resumed.stderr
    assert sorted(str(p) for p in run.rglob("*")) == before


@pytest.mark.slow
def test_the_default_model_on_a_fresh_machine_is_converted_once_and_trains_on_two_ranks(tmp_path):
    """The real SmolLM2 GGUF with an empty cache: local rank 0 converts it while rank 1 waits
    (transformers writes no weights on rank 1, whose conversion once left a folder without
    config.json in the cache), then both train."""
    sets = [f"--set={item}" for item in (
        "train.steps=1", "eval.num_problems=0", "run.progress=false", "run.plots=false",
        "rollout.max_new_tokens=16", f"run.output_dir={tmp_path / 'run'}")]  # fmt: skip
    done = torchrun_train(sets, cache=tmp_path / "cache")
    assert done.returncode == 0, done.stderr[-3000:]
    converted = list((tmp_path / "cache" / "models").iterdir())
    assert [p.name for p in converted] == ["smollm2-135m-instruct"]  # no partial folders left
    assert (converted[0] / "config.json").is_file() and any(converted[0].glob("*.safetensors"))
    assert done.stderr.count("converting ") == 1  # one rank converted it


@pytest.mark.slow
def test_a_one_process_run_resumed_by_two_sharded_processes_continues_the_same_run(
    tiny_model_dir, tmp_path
):
    """The one-process checkpoint's masters and moments are cut into the two ranks' shards."""
    extra = {**EXTRA, "rewards": f"['{write_test_rewards(tmp_path)}:digit_share']"}
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    run_training(None, overrides=tiny_overrides(tiny_model_dir, straight, steps=2, **extra))
    run_training(None, overrides=tiny_overrides(tiny_model_dir, halves, steps=1, **extra))
    resumed = torchrun_train(
        ["--set=train.steps=2", "--set=train.parallel=sharded"],
        "--resume", str(halves), "--trust-run-code",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume: processes 1 -> 2" in resumed.stdout
    a, b = weights(straight), weights(halves)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_to_the_launcher_saves_every_ranks_shards_and_the_run_resumes(
    tiny_model_dir, tmp_path, signum
):
    """Ctrl-C (or a scheduler's SIGTERM) to `fastgrpo train --nproc 2` reaches every rank, not
    torchrun (`fastgrpo.launch`): they finish the step, write the checkpoint (rank 0 the model,
    each rank its optimizer shards) and exit 0, so torchrun reports no failure; the launcher
    exits 128 + the signal's number; the run then resumes."""
    extra = {**EXTRA, "rewards": f"['{write_test_rewards(tmp_path)}:digit_share']"}
    run = tmp_path / "run"
    sets = [f"--set={s}" for s in tiny_overrides(tiny_model_dir, run, steps=500, **extra)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "fastgrpo", "train", "--nproc", "2", *sets],
        env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not any('"time/step"' in line for line in _lines(run / "metrics.jsonl")):
        assert launcher.poll() is None and time.monotonic() < deadline, "no step was taken"
        time.sleep(0.5)
    launcher.send_signal(signum)
    out, err = launcher.communicate(timeout=150)
    assert launcher.returncode == 128 + signum, out[-2000:] + err[-2000:]
    assert "ChildFailedError" not in err, err[-3000:]
    saved = latest_checkpoint(run)
    assert saved is not None, out[-1500:] + err[-3000:]
    assert len(list((saved / SHARDS_FOLDER).glob("*.distcp"))) == 2
    assert "interrupted: saved" in out
    step = int(saved.name.split("_")[-1])
    resumed = torchrun_train(
        [f"--set=train.steps={step + 1}"], "--resume", str(run), "--trust-run-code"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert latest_checkpoint(run).name == f"step_{step + 1:06d}"


def _lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("parallel", PARALLEL[:2])
def test_a_two_process_lora_run_trains_the_adapters_one_process_trains(
    tiny_model_dir, tmp_path, parallel
):
    """The adapters' optimizer state replicated or sharded, the base frozen on every rank, the
    reference the base with adapters off on each: the one-process adapters."""
    extra = {**EXTRA, "rewards": f"['{write_test_rewards(tmp_path)}:digit_share']"}
    extra |= {"lora.rank": 4, "lora.alpha": 8, "train.learning_rate": 1e-2}
    one, two = tmp_path / "one", tmp_path / "two"
    run_training(None, overrides=tiny_overrides(tiny_model_dir, one, steps=2, **extra))
    extra["train.parallel"] = parallel
    sets = [f"--set={s}" for s in tiny_overrides(tiny_model_dir, two, steps=2, **extra)]
    done = torchrun_train(sets)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = (
        load_file(latest_checkpoint(run) / "model" / "adapter_model.safetensors")
        for run in (one, two)
    )
    assert a.keys() == b.keys() and len(a) == 28
    assert max(float(v.abs().max()) for k, v in a.items() if ".lora_B." in k) > 1e-4
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_two_process_lora_run_resumed_takes_the_step_an_uninterrupted_one_takes(
    tiny_model_dir, tmp_path
):
    """The adapters' sharded optimizer state (auto) and the peft files resume on 2 processes."""
    extra = {**EXTRA, "rewards": f"['{write_test_rewards(tmp_path)}:digit_share']"}
    extra |= {"lora.rank": 4, "lora.alpha": 8, "train.learning_rate": 1e-2}
    sets = lambda run, steps: [  # noqa: E731
        f"--set={s}" for s in tiny_overrides(tiny_model_dir, run, steps=steps, **extra)
    ]
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    assert torchrun_train(sets(straight, 2)).returncode == 0
    assert torchrun_train(sets(halves, 1)).returncode == 0
    resumed = torchrun_train(["--set=train.steps=2"], "--resume", str(halves), "--trust-run-code")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = (
        load_file(latest_checkpoint(run) / "model" / "adapter_model.safetensors")
        for run in (straight, halves)
    )
    assert max(float(v.abs().max()) for k, v in a.items() if ".lora_B." in k) > 1e-4
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


SIGNAL_IN_ROLLOUT = """
import os, signal
import fastgrpo.train.step as step

_sample, _calls = step.sample_completions, [0]


def _signalled(*args, **kwargs):  # with SIGNAL_AT=N, rank 0 alone gets SIGTERM in rollout N
    _calls[0] += 1
    if str(_calls[0]) == os.environ.get("SIGNAL_AT") and os.environ.get("RANK") == "0":
        os.kill(os.getpid(), signal.SIGTERM)
    return _sample(*args, **kwargs)


step.sample_completions = _signalled


def digit_share(prompts, completions, **kwargs):
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]
"""


@pytest.mark.slow
def test_a_signal_to_one_rank_mid_rollout_abandons_the_step_on_every_rank_and_resume_is_exact(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Rank 0 is signalled while step 2 rolls out: its waves end at the next look, both ranks
    agree after the rollout to drop the step, save step 1 (rank 0 the model, each rank its
    optimizer shards) and exit; resumed, the run takes steps 2 and 3 as a straight run does."""
    (tmp_path / "signal.py").write_text(SIGNAL_IN_ROLLOUT)
    rewards = f"['{tmp_path / 'signal.py'}:digit_share']"
    extra = {**EXTRA, "rollout.max_new_tokens": 40, "run.save_every": 10}
    straight, run = tmp_path / "straight", tmp_path / "run"
    sets = lambda folder: [  # noqa: E731
        f"--set={s}"
        for s in tiny_overrides(tiny_model_dir, folder, steps=3, **extra, rewards=rewards)
    ]
    done = torchrun_train(sets(straight))
    assert done.returncode == 0, done.stderr[-3000:]
    monkeypatch.setenv("SIGNAL_AT", "2")
    stopped = torchrun_train(sets(run))
    monkeypatch.delenv("SIGNAL_AT")
    assert stopped.returncode != 0 and "interrupted: saved" in stopped.stdout, stopped.stderr[
        -3000:
    ]
    saved = latest_checkpoint(run)
    assert saved.name == "step_000001"
    assert len(list((saved / SHARDS_FOLDER).glob("*.distcp"))) == 2
    steps = [
        json.loads(line)["step"] for line in _lines(run / "metrics.jsonl") if '"time/step"' in line
    ]
    assert steps == [1]
    resumed = torchrun_train([], "--resume", str(run), "--trust-run-code")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = weights(straight), weights(run)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)

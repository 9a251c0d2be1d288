"""`fastgrpo train --nproc N` (`fastgrpo/launch.py`): its torchrun command, and a stop signal
relayed to the rank processes themselves, with torchrun left unsignalled (CPU, real torchrun)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from fastgrpo.config import ConfigError
from fastgrpo.launch import child_processes, signal_ranks, torchrun_command

RANK_SCRIPT = """
import os, pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
rank = os.environ["RANK"]
def stop(signum, frame):
    mark = os.environ.get("FASTGRPO_STARTED_BY_LAUNCHER", "")
    relayed = bool(mark) and os.path.exists(mark)  # the launcher's mark of a stop it relayed
    time.sleep(2)  # a save that takes its time: torchrun must not cut it short
    (out / f"rank{rank}.stopped").write_text(f"{signal.Signals(signum).name} {relayed}")
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
(out / f"rank{rank}.pid").write_text(str(os.getpid()))
time.sleep(120)
"""


def test_the_torchrun_command_drops_nproc_and_refuses_what_cannot_run(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    command = torchrun_command(3, ["train", "--nproc", "3", "cfg.yaml", "--nproc=3", "--set=a=1"])
    assert command[1:] == [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
        "-m", "fastgrpo", "train", "cfg.yaml", "--set=a=1",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="--nproc 0: give the number of processes"):
        torchrun_command(0, ["train"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="inside a torchrun job"):
        torchrun_command(2, ["train"])


def test_a_refused_launch_leaves_nothing_behind(monkeypatch, tmp_path):
    import tempfile

    from fastgrpo.launch import run_under_torchrun

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ConfigError, match="--nproc 0"):
        run_under_torchrun(0, ["train"])
    assert list(tmp_path.iterdir()) == []


def _start_torchrun(tmp_path) -> tuple[subprocess.Popen, list[int]]:
    """torchrun with 2 ranks of RANK_SCRIPT, its grace period after a signal set to 1 s; the
    ranks' process ids once both run."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = "1"
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(script), str(tmp_path)],
        env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("rank*.pid"))) < 2:
        if torchrun.poll() is not None or time.monotonic() > deadline:
            os.killpg(torchrun.pid, signal.SIGKILL)
            pytest.fail("the ranks did not start: " + torchrun.communicate()[0][-2000:])
        time.sleep(0.2)
    return torchrun, sorted(int(p.read_text()) for p in tmp_path.glob("rank*.pid"))


def _finish(torchrun: subprocess.Popen) -> str:
    try:
        return torchrun.communicate(timeout=60)[0]
    finally:
        if torchrun.poll() is None:
            os.killpg(torchrun.pid, signal.SIGKILL)


LISTS_PROCESSES = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="lists processes through /proc"
)


@LISTS_PROCESSES
def test_a_stop_reaches_every_rank_and_not_torchrun_which_then_ends_cleanly(tmp_path):
    """The ranks get the signal and take the 2 s their "save" needs; torchrun, not signalled,
    exits 0 after them."""
    torchrun, ranks = _start_torchrun(tmp_path)
    assert child_processes(torchrun.pid) == ranks
    assert sorted(signal_ranks(torchrun.pid, signal.SIGINT)) == ranks
    out = _finish(torchrun)
    assert torchrun.returncode == 0, out[-2000:]
    assert [(tmp_path / f"rank{r}.stopped").read_text() for r in (0, 1)] == ["SIGINT False"] * 2


@LISTS_PROCESSES
@pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 12),
    reason="torchrun's grace period is set from torch 2.12 on",
)
def test_the_same_stop_sent_to_torchrun_is_cut_short_by_its_grace_period(tmp_path):
    """The control: signalled itself, torchrun kills the ranks 1 s later, inside their save."""
    torchrun, _ = _start_torchrun(tmp_path)
    torchrun.send_signal(signal.SIGINT)
    out = _finish(torchrun)
    assert torchrun.returncode != 0
    assert not list(tmp_path.glob("rank*.stopped")), out[-2000:]


LAUNCHER = """
import sys
from fastgrpo import launch
launch.torchrun_command = lambda nproc, given: [
    sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *given
]
sys.exit(launch.run_under_torchrun(2, sys.argv[1:]))
"""


@LISTS_PROCESSES
@pytest.mark.parametrize("signals", [1, 2], ids=["one-signal", "two-signals"])
def test_the_launcher_relays_one_stop_to_the_ranks_and_a_second_to_torchrun(tmp_path, signals):
    """`run_under_torchrun` over ranks of RANK_SCRIPT: one SIGTERM reaches the ranks with the
    launcher's mark, they take their 2 s and the launcher exits 143; a second one goes to
    torchrun, which kills them mid-save (grace period 1 s)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = "1"
    env["TMPDIR"] = str(tmp_path)  # where the launcher makes its folder (gone at the end)
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(script), str(tmp_path)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert launcher.poll() is None and time.monotonic() < deadline, "no ranks started"
            time.sleep(0.2)
        assert len(list(tmp_path.glob("fastgrpo-launch-*"))) == 1
        for _ in range(signals):
            launcher.send_signal(signal.SIGTERM)
            time.sleep(0.3)
        out = launcher.communicate(timeout=60)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    stopped = sorted(p.read_text() for p in tmp_path.glob("rank*.stopped"))
    if signals == 1:
        assert launcher.returncode == 128 + signal.SIGTERM, out[-2000:]
        assert stopped == ["SIGTERM True"] * 2
    else:
        assert launcher.returncode not in (0, 128 + signal.SIGTERM) and stopped == [], out[-2000:]
    assert not list(tmp_path.glob("fastgrpo-launch-*"))

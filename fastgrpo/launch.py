"""`fastgrpo train --nproc N`: the same command as N processes under torchrun, with stop signals
relayed to the ranks themselves.

torchrun, once signalled, gives its ranks 30 s (torch < 2.12 fixes it; later ones take
`--shutdown-timeout`) and then kills them, so a rank that was asked to finish its step and save
had to do both inside that time: a 7B step's update plus its checkpoint need not. So the first
Ctrl-C or SIGTERM to this launcher goes to the rank processes (torchrun's children, read from
/proc), not to torchrun: each rank finishes or drops its step, every rank saves its part and they
exit in their own time; torchrun, never signalled, then ends. A second signal goes to torchrun,
which stops the ranks at once (their second signal: abort, the previous checkpoint intact).
Where the ranks cannot be listed (no /proc), the first signal goes to torchrun as before. The
ranks a relayed stop ended exit 0 (the file `STARTED_BY_LAUNCHER` names exists then), so torchrun
reports no failure; this launcher returns 128 + the signal's number, as a shell would for one
process. A rank signalled by anything else exits 128 + its signal's number, and so does the job.

torchrun runs in a session of its own, so that a terminal's Ctrl-C reaches it only through here
(and a scheduler's signal to this process's group does not reach it twice).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from fastgrpo.config import ConfigError
from fastgrpo.switches import STARTED_BY_LAUNCHER


def torchrun_command(nproc: int, given: list[str]) -> list[str]:
    """torchrun's command line for `fastgrpo <given>` in `nproc` processes (`--nproc` dropped)."""
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: give the number of processes, 1 or more")
    if "WORLD_SIZE" in os.environ:
        raise ConfigError("--nproc inside a torchrun job: drop --nproc, torchrun started it")
    argv, rest = [], iter(given)
    for arg in rest:
        if arg == "--nproc":
            next(rest, None)
        elif not arg.startswith("--nproc="):
            argv.append(arg)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "fastgrpo", *argv]  # fmt: skip


def child_processes(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux: /proc/PID/task/*/children); [] where /proc
    does not list them."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return sorted(set(children))


def signal_ranks(torchrun_pid: int, signum: int) -> list[int]:
    """Send `signum` to each rank process torchrun started; the ranks reached."""
    reached = []
    for pid in child_processes(torchrun_pid):
        try:
            os.kill(pid, signum)
            reached.append(pid)
        except ProcessLookupError:  # it had just ended
            continue
    return reached


def run_under_torchrun(nproc: int, given: list[str]) -> int:
    """Run `fastgrpo <given>` as `nproc` ranks; torchrun's exit code, or 128 + the signal's
    number for a run stopped by a signal (the shell's convention)."""
    command = torchrun_command(nproc, given)  # a bad --nproc is refused before anything is made
    folder = Path(tempfile.mkdtemp(prefix="fastgrpo-launch-"))
    mark = folder / "stop-relayed"  # made before a relayed signal: the ranks then exit 0
    try:
        launcher = subprocess.Popen(
            command, env={**os.environ, STARTED_BY_LAUNCHER: str(mark)}, start_new_session=True
        )
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    relayed: list[int] = []

    def relay(signum, _frame):
        if not relayed:
            mark.touch()
            if signal_ranks(launcher.pid, signum):
                relayed.append(signum)
                return
            mark.unlink()
        relayed.append(signum)
        launcher.send_signal(signum)  # the second signal, or no rank to reach: torchrun stops them

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, relay)
    try:
        code = launcher.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if code < 0:  # torchrun killed by a signal
        return 128 - code
    return 128 + relayed[0] if relayed and code == 0 else code

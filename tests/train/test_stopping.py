"""What a stop signal does to the process itself (`train/stopping.py`): in a torchrun job, a rank
still running a while after the first signal writes every thread's stack to stderr, so a rank
stuck after a stop says where before torchrun kills it; a rank that stops in time writes none."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from fastgrpo.train.stopping import StopRequest

    def stuck_here():
        time.sleep(float(sys.argv[1]))

    stop = StopRequest(dump_after=0.5)
    stop.during_steps = True
    os.kill(os.getpid(), signal.SIGINT)  # the first signal: finish the step, then stop
    stuck_here()
    stop.restore()
    time.sleep(1.0)  # after restore: no stack is written any more
    print("requested", stop.requested)
    """
)


def run_child(seconds: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(seconds)], capture_output=True, text=True, timeout=60
    )


def test_a_rank_still_running_after_a_stop_signal_writes_where_it_is():
    done = run_child(2.0)
    assert done.returncode == 0, done.stderr
    assert "requested True" in done.stdout
    assert "stuck_here" in done.stderr  # the main thread's frame, from faulthandler's dump


def test_a_rank_that_stops_in_time_writes_no_stacks():
    done = run_child(0.0)
    assert done.returncode == 0, done.stderr
    assert "stuck_here" not in done.stderr and "Thread" not in done.stderr

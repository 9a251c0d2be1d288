"""Ctrl-C and SIGTERM during training: save and stop at the next safe point, or stop cleanly.

While steps run, the first SIGINT or SIGTERM asks the loop to save a checkpoint and return. A
signal during a step's rollout cuts the rollout short (`rollout.engine.cut_rollouts_short`) and
abandons the step (`StepAbandoned`: nothing of it is applied, and the prompt order and random
state go back to where the step began), so the checkpoint is the last finished step's and comes
within a look of the engine rather than after the whole step: a launcher's grace period
(torchrun waits 30 s after SIGTERM, then kills) need not cover a long rollout. Under
`fastgrpo train --nproc` the signal reaches the ranks, not torchrun (`fastgrpo.launch`), and there
is no such deadline. A signal after the
rollout lets the step finish first. A second signal aborts. Outside the steps (loading the model, the evaluations before
and after) there is no step to finish, so a signal raises `Interrupted` at once; the command
line turns it into one line and exit code 128 + the signal number (130 for Ctrl-C, 143 for
SIGTERM), the codes shells use for a process a signal ended.
"""

from __future__ import annotations

import faulthandler
import logging
import signal

from fastgrpo.rollout.engine import cut_rollouts_short
from fastgrpo.switches import started_by_launcher

log = logging.getLogger("fastgrpo.train")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
HANG_DUMP_S = 25.0
"""In a torchrun job, a rank still running this long after a stop signal writes every thread's
stack to stderr (torchrun kills the ranks at 30 s): a rank stuck in a collective says where."""
HANG_DUMP_LAUNCHED_S = 300.0
"""The same under `fastgrpo train --nproc`, whose ranks have no deadline (`fastgrpo.launch`):
long enough for a large model's update and checkpoint."""


def hang_dump_after(world) -> float | None:
    """Seconds after a stop signal at which a rank writes its threads' stacks; None alone."""
    if world is None:
        return None
    return HANG_DUMP_LAUNCHED_S if started_by_launcher() else HANG_DUMP_S


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived where no step could be finished first; `detail` says what is saved."""

    def __init__(self, signum: int, detail: str = ""):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.detail = detail


class StepAbandoned(Exception):
    """A stop signal arrived during this step's rollout (on any rank): the step is dropped before
    anything of it is applied."""


class StopRequest:
    """Catches SIGINT and SIGTERM from creation to `restore()`; `during_steps` chooses between
    "finish the step, then stop" (True) and "stop now" (False, the start)."""

    def __init__(self, dump_after: float | None = None):
        self.dump_after = dump_after  # seconds after the first signal to write the stacks
        self.requested = False
        self.signum: int | None = None
        self.during_steps = False
        self._previous = {}
        try:
            for number in SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        except ValueError:  # not the main thread: signals stay as they are
            self.restore()

    def _handle(self, signum, frame):
        if not self.during_steps or self.requested:
            raise Interrupted(signum)
        self.requested, self.signum = True, signum
        cut_rollouts_short()
        if self.dump_after is not None:
            faulthandler.dump_traceback_later(self.dump_after)
        log.warning(
            "%s: saving a checkpoint and exiting after this step, or now if it is still rolling "
            "out (once more to abort)",
            "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name,
        )

    def restore(self):
        cut_rollouts_short(False)
        if self.dump_after is not None:
            faulthandler.cancel_dump_traceback_later()
        for number, previous in self._previous.items():
            signal.signal(number, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

"""Ctrl-C and SIGTERM during training: save and stop after the current step, or stop cleanly.

While steps run, the first SIGINT or SIGTERM asks the loop to finish its step, save a checkpoint
and return; a second one aborts. Outside the steps (loading the model, the evaluations before
and after) there is no step to finish, so a signal raises `Interrupted` at once; the command
line turns it into one line and exit code 128 + the signal number (130 for Ctrl-C, 143 for
SIGTERM), the codes shells use for a process a signal ended.
"""

from __future__ import annotations

import logging
import signal

log = logging.getLogger("fastgrpo.train")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived where no step could be finished first; `detail` says what is saved."""

    def __init__(self, signum: int, detail: str = ""):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.detail = detail


class StopRequest:
    """Catches SIGINT and SIGTERM from creation to `restore()`; `during_steps` chooses between
    "finish the step, then stop" (True) and "stop now" (False, the start)."""

    def __init__(self):
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
        log.warning(
            "%s: finishing this step, saving a checkpoint and exiting (once more to abort)",
            "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name,
        )

    def restore(self):
        for number, previous in self._previous.items():
            signal.signal(number, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

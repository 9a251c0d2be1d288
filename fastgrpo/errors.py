"""The two kinds of error a run ends with on purpose, without a traceback.

`UserError`: the input is wrong (a config key, a data file or record, a model file); the message
names it and the fix, and the CLI prints it as one line and exits 2. `RunStopped`: training went
wrong in a way that would waste the rest of the run (NaN/inf steps, a reward failing on most
completions); the message says why and which checkpoint holds the last good weights, and the CLI
exits 1. Anything else is fastgrpo's own bug and keeps its traceback.

This module imports nothing, so the CLI can catch these before torch is loaded.
"""


class UserError(ValueError):
    """Bad input; the message names the key, file or record and how to fix it."""


class RunStopped(RuntimeError):
    """Training stopped early on purpose; the message says why and what was kept."""

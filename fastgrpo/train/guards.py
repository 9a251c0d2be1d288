"""Stop a run that has stopped learning, instead of letting it "finish" with exit code 0.

Two ways a run can go on for hours while training on nothing:
  - steps whose loss or gradient norm is NaN/inf: the update skips them (`optim.ModelOptimizer`
    leaves the weights and AdamW's state alone), and `train.max_nonfinite_steps` of them in a row
    stop the run;
  - a reward that fails (raises, returns None/NaN, or passes `train.reward_timeout`) on most
    completions: `RewardSet` scores those 0, so the advantages are 0 and nothing is learned;
    more than `train.max_reward_failure_frac` of a step's completions in
    `train.max_failing_reward_steps` steps in a row stop the run with the reward's first error.
The guard reads only the step's metrics record, which the host holds already: no device work.
Stopping raises `RunStopped` before the step's checkpoint, so the newest checkpoint on disk is
the last one written from good steps.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastgrpo.errors import RunStopped


class RunGuard:
    def __init__(
        self,
        *,
        max_nonfinite_steps: int,
        max_reward_failure_frac: float,
        max_failing_reward_steps: int,
        completions_per_step: int,
        last_checkpoint: Callable[[], Path | None],
    ):
        self.max_nonfinite_steps = max_nonfinite_steps
        self.max_failure_frac = max_reward_failure_frac
        self.max_failing_steps = max_failing_reward_steps
        self.completions = completions_per_step
        self.last_checkpoint = last_checkpoint  # looked up only when the run stops
        self.nonfinite_run = 0  # steps in a row with a skipped optimizer step
        self.failing_runs: dict[str, int] = {}  # reward -> steps in a row it failed too often
        self.first_errors: dict[str, str] = {}  # reward -> its first error in that run

    def check(self, record: dict) -> None:
        """Count this step's record; RunStopped when a limit is reached."""
        step = record["step"]
        self.nonfinite_run = self.nonfinite_run + 1 if record.get("skipped_steps") else 0
        if self.nonfinite_run >= self.max_nonfinite_steps:
            last = self.last_checkpoint()
            kept = (
                f"the newest checkpoint, {last}, holds the last good weights"
                if last is not None
                else "no checkpoint was written"
            )
            raise RunStopped(
                f"training stopped at step {step}: the loss or gradient norm was NaN/inf in "
                f"{self.nonfinite_run} steps in a row (train.max_nonfinite_steps="
                f"{self.max_nonfinite_steps}); those steps were skipped and {kept}. Lower "
                "train.learning_rate or use model.dtype=float32, and check the rewards"
            )
        self._check_rewards(record, step)

    def _check_rewards(self, record: dict, step: int) -> None:
        prefix = "reward_failures/"
        failing = {
            key[len(prefix) :]: count
            for key, count in record.items()
            if key.startswith(prefix) and count > self.max_failure_frac * self.completions
        }
        for name in list(self.failing_runs):
            if name not in failing:
                del self.failing_runs[name], self.first_errors[name]
        for name, count in failing.items():
            self.failing_runs[name] = self.failing_runs.get(name, 0) + 1
            error = record.get(f"reward_errors/{name}", "no error text")
            self.first_errors.setdefault(name, error)
            if self.failing_runs[name] >= self.max_failing_steps:
                last = self.last_checkpoint()
                kept = f"the newest checkpoint is {last}" if last else "no checkpoint was written"
                raise RunStopped(
                    f"training stopped at step {step}: reward '{name}' failed on {count} of "
                    f"{self.completions} completions in {self.failing_runs[name]} steps in a row "
                    f"(train.max_reward_failure_frac={self.max_failure_frac}, "
                    f"train.max_failing_reward_steps={self.max_failing_steps}), so those steps "
                    f"learned nothing from it; its first error: {self.first_errors[name]}. "
                    f"Fix the reward function; {kept}"
                )

"""Step metrics: a JSONL file in the run folder and a progress bar with ETA and key numbers.

The bar's rate and ETA count training steps only: evaluations run `paused()`, so a 60 s
evaluation before the first step does not make a 3.5 min run announce 22 min. Lines written
while the bar is up (evaluations, checkpoints, log warnings) clear it, are flushed, and it is
drawn again below them, also when stdout is a pipe that buffers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from fastgrpo.config import ConfigError

log = logging.getLogger("fastgrpo.train")

BAR_KEYS = (
    ("reward", "reward/mean"),
    ("acc", "accuracy"),
    ("kl", "kl"),
    ("len", "completion/mean_length"),
    ("s/step", "time/step"),
)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux: the process's peak resident memory
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLog:
    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        start_step: int,
        show_progress: bool,
        reporters=(),
    ):
        self.reporters = list(reporters)  # TensorBoard, W&B (`reporting.py`): each record too
        self.path = Path(run_dir) / "metrics.jsonl"
        self._keep_until(start_step)
        self.file = open(self.path, "a")
        self.bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc="train",
            unit="step",
            disable=not show_progress,
            dynamic_ncols=True,
            file=sys.stderr,
        )
        self._redirect = contextlib.ExitStack()
        if show_progress:  # log warnings go above the bar instead of through it
            self._redirect.enter_context(logging_redirect_tqdm())

    def _keep_until(self, step: int) -> None:
        """On resume, steps after the checkpoint are redone: drop their stale lines (atomically,
        so a kill now loses nothing)."""
        if not self.path.exists():
            return
        kept = [r for r in read_records(self.path) if r.get("step", 0) <= step]
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        temporary.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(temporary, self.path)

    def find(self, **match) -> dict | None:
        """The last record written so far whose fields equal `match`."""
        self.file.flush()
        found = None
        for record in read_records(self.path):
            if all(record.get(k) == v for k, v in match.items()):
                found = record
        return found

    def log(self, record: dict) -> None:
        clean = {k: _plain(v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        for reporter in self.reporters:
            reporter.log(clean)
        if "step" in record and record.get("kind", "train") == "train":
            self.bar.set_postfix(
                {short: _fmt(clean[key]) for short, key in BAR_KEYS if key in clean}, refresh=False
            )
            self.bar.update(1)

    def write(self, text: str) -> None:
        """A line on stdout above the bar; flushed before the bar is drawn again."""
        with tqdm.external_write_mode(file=sys.stdout):
            print(text, flush=True)

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (an evaluation) counts neither in the bar's rate nor its ETA."""
        start = time.time()
        try:
            yield
        finally:
            if not self.bar.disable:  # a disabled bar keeps no clock
                spent = time.time() - start
                self.bar.start_t += spent
                self.bar.last_print_t += spent

    def close(self) -> None:
        self._redirect.close()
        self.bar.close()
        self.file.close()
        for reporter in self.reporters:
            reporter.close()
        self.reporters = []


class SilentMetrics:
    """The metrics of a data-parallel rank other than 0: nothing is written or shown (rank 0
    writes the job's records, combined over the ranks)."""

    def find(self, **match) -> dict | None:
        return None

    def log(self, record: dict) -> None:
        pass

    def write(self, text: str) -> None:
        pass

    @contextlib.contextmanager
    def paused(self):
        yield

    def close(self) -> None:
        pass


def read_records(path: Path) -> list[dict]:
    """The JSON records of a metrics file. A cut-off last line (a crash or a full disk mid-write)
    is left out with a warning; a bad line elsewhere is an error naming file and line."""
    lines = Path(path).read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise ConfigError(
                    f"{path}:{number} is not a JSON record; repair or delete that line"
                ) from None
            log.warning(
                "%s: dropping its last line, cut off mid-write (%d characters)", path, len(line)
            )
    return records


def _plain(value):
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)

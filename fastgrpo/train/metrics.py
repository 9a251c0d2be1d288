"""Step metrics: a JSONL file in the run folder and a progress bar with ETA and key numbers."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
from pathlib import Path

import torch
from tqdm import tqdm

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
    def __init__(self, run_dir: Path, *, total_steps: int, start_step: int, show_progress: bool):
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
        if "step" in record and record.get("kind", "train") == "train":
            self.bar.set_postfix(
                {short: _fmt(clean[key]) for short, key in BAR_KEYS if key in clean}, refresh=False
            )
            self.bar.update(1)

    def write(self, text: str) -> None:
        self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
        self.file.close()


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

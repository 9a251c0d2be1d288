"""Every FASTGRPO_* environment variable, in one place.

Three switches turn a family of kernels off, to bisect a numerical problem or to work around a
compiler or driver that breaks one; each default is the path measured fastest (the README's table,
with the measurement behind it). They are read once, at import: a module copies the value it needs
into an attribute of its own, which tests flip with monkeypatch. FASTGRPO_CACHE, FASTGRPO_DEBUG
and FASTGRPO_STARTED_BY_LAUNCHER (the launcher's mark on its ranks) are read when used.

Settled comparisons are not switches: the losing path is deleted, or, where it is also another
device's or shape's path, kept as that fallback with a module attribute the lab's A/B scripts set.
"""

from __future__ import annotations

import os
from pathlib import Path


def _on(name: str) -> bool:
    """A switch that is on unless set to 0."""
    return os.environ.get(name, "1") != "0"


# fused norm / RoPE / SwiGLU / token-input kernels in the model's forwards (training and prefill)
FUSED_OPS = _on("FASTGRPO_FUSED_OPS")
# the rollout engine's decode-step kernels: attention, small linears, sampler, bookkeeping
DECODE_KERNELS = _on("FASTGRPO_DECODE_KERNELS")
# the Hopper kernels written in Gluon (decode attention, decode gate/up, LM-head statistics)
GLUON = _on("FASTGRPO_GLUON")
# programmatic dependent launch between the decode step's kernels (Hopper)
PDL = _on("FASTGRPO_PDL")
# torch's varlen attention (FASTGRPO_NO_VARLEN=1: per-sequence SDPA, for a torch without it)
NO_VARLEN = os.environ.get("FASTGRPO_NO_VARLEN") == "1"


def cache_root() -> Path:
    """Where converted models are cached (FASTGRPO_CACHE, else ~/.cache/fastgrpo)."""
    return Path(os.environ.get("FASTGRPO_CACHE") or Path.home() / ".cache" / "fastgrpo")


STARTED_BY_LAUNCHER = "FASTGRPO_STARTED_BY_LAUNCHER"  # set by `fastgrpo train --nproc` (launch.py)


def started_by_launcher() -> bool:
    """This process is a rank that `fastgrpo train --nproc` started: torchrun, never signalled by
    that launcher, sets no deadline after a stop signal."""
    return bool(os.environ.get(STARTED_BY_LAUNCHER))


def stop_relayed_by_launcher() -> bool:
    """The stop signal this rank got came from `fastgrpo train --nproc`, which then returns
    128 + the signal's number for the job: the rank exits 0 (torchrun would call a non-zero exit
    a failure). The launcher's mark: the file FASTGRPO_STARTED_BY_LAUNCHER names exists."""
    path = os.environ.get(STARTED_BY_LAUNCHER)
    return bool(path) and Path(path).exists()


def debug() -> bool:
    """FASTGRPO_DEBUG set: configuration errors raise with their traceback."""
    return bool(os.environ.get("FASTGRPO_DEBUG"))

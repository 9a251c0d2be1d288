"""The mode of files fastgrpo writes."""

from __future__ import annotations

import os
from pathlib import Path


def make_readable(path: Path) -> None:
    """Give a written file the mode the umask gives new files (safetensors writes it 0600,
    so nobody else could load a model from a shared folder)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)

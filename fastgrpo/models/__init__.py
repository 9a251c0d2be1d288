"""Model loading (HF, hub ids, GGUF, built-in names); the native model arrives here later."""

from fastgrpo.models.loading import (
    ModelNotFoundError,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_model,
    stop_token_ids,
)

__all__ = [
    "ModelNotFoundError",
    "load_model",
    "resolve_device",
    "resolve_dtype",
    "resolve_model",
    "stop_token_ids",
]

"""Models: the native Llama-family transformer and its loading; HF loading for everything else.

`transformer` holds the native decoder (its shape and flags: `model_config`) (Llama 2/3, Qwen2/2.5/3, Mistral, SmolLM2) that the trainer
and rollout engine share; `native_io` reads and writes it as safetensors; `attention` holds the
packed-sequence attention callback; `sources` resolves names (built-ins, hub ids, local
directories, GGUF), devices and dtypes; `loading` loads a model (native, or Hugging Face for
architectures `is_supported` says no to) and its tokenizer.
"""

from fastgrpo.models.attention import PackedCausalAttention, SharedKeys, causal_attention_ref
from fastgrpo.models.loading import load_model, stop_token_ids
from fastgrpo.models.model_config import ModelConfig, UnsupportedModelError, is_supported
from fastgrpo.models.native_io import load_native_model, save_native_model
from fastgrpo.models.sources import (
    ModelFileError,
    ModelNotFoundError,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from fastgrpo.models.transformer import Transformer

__all__ = [
    "ModelConfig",
    "ModelFileError",
    "ModelNotFoundError",
    "PackedCausalAttention",
    "SharedKeys",
    "Transformer",
    "UnsupportedModelError",
    "causal_attention_ref",
    "is_supported",
    "load_model",
    "load_native_model",
    "resolve_device",
    "resolve_dtype",
    "resolve_model",
    "save_native_model",
    "stop_token_ids",
]

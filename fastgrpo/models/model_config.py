"""What a native model is: its shape and per-family flags (`ModelConfig`), read from a Hugging
Face `config.json`, and which architectures the native transformer implements.

Llama, Qwen2/2.5, Qwen3, Mistral and SmolLM2 differ in a few flags: q/k/v bias, o_proj bias,
q/k RMSNorm, llama3 RoPE scaling, sliding windows. Anything else takes the `transformers` path.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class UnsupportedModelError(ValueError):
    """The checkpoint is not one the native transformer implements; use the Hugging Face path."""


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent RoPE interpolation (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: Llama3RopeScaling | None = None
    attention_bias: bool = False  # bias on q/k/v
    o_proj_bias: bool = False  # Llama's and Qwen3's `attention_bias` also biases o_proj
    mlp_bias: bool = False  # Llama's `mlp_bias`
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None  # None unless some layer actually slides
    sliding_layers: tuple[int, ...] = ()  # the layers that slide when sliding_window is set
    pad_token_id: int | None = None  # as in HF: that embedding row gets no gradient

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: the sliding window (each query sees that many keys, itself included) or None."""
        sliding = set(self.sliding_layers) if self.sliding_window is not None else set()
        return tuple(self.sliding_window if i in sliding else None for i in range(self.num_layers))

    @classmethod
    def from_hf(cls, config) -> ModelConfig:
        """From a transformers `PretrainedConfig` or a config.json dict (transformers 4.x or 5.x)."""
        cfg = config if isinstance(config, dict) else config.to_dict()
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} has no native implementation (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}); such models still train through the "
                f"Hugging Face path."
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"{model_type} with hidden_act={cfg['hidden_act']!r}: the native transformer has "
                f"only SiLU-gated MLPs; this model still trains through the Hugging Face path."
            )
        try:
            hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
            layers, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
            intermediate = cfg["intermediate_size"]
        except KeyError as missing:
            raise ValueError(f"the {model_type} config has no {missing} entry") from None
        max_positions = cfg.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[model_type]
        theta, scaling = _rope_settings(cfg, model_type, max_positions)
        bias = bool(cfg.get("attention_bias", False))
        window, sliding_layers = _sliding_settings(cfg, model_type, layers)
        head_dim = cfg.get("head_dim") or (128 if model_type == "qwen3" else hidden // heads)
        pad = cfg.get("pad_token_id")
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            # Qwen2 always biases q/k/v (never o_proj); Mistral never; Llama and Qwen3 follow
            # `attention_bias` on all four projections.
            attention_bias={"qwen2": True, "mistral": False}.get(model_type, bias),
            o_proj_bias=bias if model_type in ("llama", "qwen3") else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=max_positions,
            sliding_window=window,
            sliding_layers=sliding_layers,
            pad_token_id=pad if isinstance(pad, int) and 0 <= pad < vocab else None,
        )


_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "mistral": 131072}


def _rope_settings(cfg: dict, model_type: str, max_positions: int):
    """(theta, llama3 scaling or None) from `rope_parameters` (5.x) or `rope_theta`/`rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise UnsupportedModelError(
            f"{model_type} with per-layer-type RoPE parameters is not implemented natively; "
            f"this model still trains through the Hugging Face path."
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", cfg.get("rope_theta") or 10_000.0))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise UnsupportedModelError(
            f"{model_type} with partial_rotary_factor={partial} is not implemented natively; "
            f"this model still trains through the Hugging Face path."
        )
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings") or max_positions
            ),
        )
        return theta, scaling
    raise UnsupportedModelError(
        f"{model_type} with rope scaling type {rope_type!r} is not implemented natively (only "
        f"'default' and 'llama3'); this model still trains through the Hugging Face path."
    )


def _sliding_settings(cfg: dict, model_type: str, layers: int):
    """(window or None, sliding layer indices), as each transformers model decides them."""
    if model_type == "mistral":  # every layer, whenever a window is set (4096 when absent)
        window = cfg.get("sliding_window", 4096)
        return (window, tuple(range(layers))) if window else (None, ())
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if model_type in ("qwen2", "qwen3") and window:  # layers from max_window_layers on slide
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention"
            for i in range(layers)
        ]
        sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
        return (window, sliding) if sliding else (None, ())
    return None, ()


def is_supported(config) -> bool:
    """Whether the native transformer implements this HF config (a `PretrainedConfig` or dict)."""
    try:
        ModelConfig.from_hf(config)
    except UnsupportedModelError:
        return False
    return True

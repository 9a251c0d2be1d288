"""Typed run configuration: dataclass sections, YAML presets, dotted `--set` overrides, validation.

A config is plain data. The defaults are the CPU quick start (SmolLM2-135M-Instruct on the
built-in arithmetic task); presets in `configs/` hold only their differences from these defaults.
Every error names the offending key, what was wrong and how to fix it, and an unknown key gets the
nearest valid one suggested, so a typo never silently trains the wrong thing.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message says what to change."""


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"  # built-in name, hub id, local HF directory or .gguf file
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    gradient_checkpointing: bool = False
    revision: str | None = None
    trust_remote_code: bool = False
    backend: str = "auto"  # auto (native for the Llama family, else transformers) | native | hf


@dataclass
class TaskConfig:
    name: str = "arithmetic"  # arithmetic | gsm8k | jsonl | parquet | hf
    path: str | None = None  # file, directory or `datasets` id (not used by arithmetic)
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    train_split: str = "train"
    eval_split: str = "test"
    num_train: int | None = None
    num_eval: int | None = None
    prompt_template: str | None = None  # None: the task's own template
    system_prompt: str | None = None  # None: whatever the chat template adds by itself
    seed: int = 0
    # arithmetic only
    min_value: int = 0
    max_value: int = 20
    num_operands: int = 2
    operations: str = "+-"


@dataclass
class RolloutConfig:
    prompts_per_step: int = 4
    num_generations: int = 8  # G samples per prompt (TRL: num_generations)
    max_new_tokens: int = 16  # TRL: max_completion_length
    temperature: float = 0.7
    top_k: int = 0  # 0: off
    top_p: float = 1.0


@dataclass
class AlgoConfig:
    loss_type: str = "grpo"  # grpo | dr_grpo | dapo | bnpo | gspo | cispo
    beta: float = 0.0  # KL coefficient; 0 loads no reference model
    kl_estimator: str = "k3"  # k1 | k2 | k3
    epsilon_low: float = 0.2  # TRL: epsilon
    epsilon_high: float | None = None  # None: same as epsilon_low
    delta: float | None = None  # two-sided clip of the ratio (None: off)
    importance_sampling_level: str = "token"  # token | sequence
    scale_rewards: str = "group"  # group | batch | none
    baseline: str = "mean"  # mean | leave_one_out
    entropy_coef: float = 0.0
    mask_truncated_completions: bool = False
    importance_sampling_correction: bool = False  # truncated IS for rollout/trainer mismatch
    importance_sampling_cap: float = 2.0


@dataclass
class TrainConfig:
    steps: int = 30
    learning_rate: float = 1e-5
    lr_scheduler: str = "constant"  # constant | linear | cosine
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0: no clipping
    num_iterations: int = 1  # K inner epochs over each rollout batch
    mini_batches: int = 1  # optimizer steps per inner epoch
    # token budget of one forward/backward (the native model: tokens fed, each shared prompt once;
    # transformers models: padded rows); fewer, larger micro-batches cost less host time per step
    # (benchmarks/HISTORY.md, issue 5); lower it for larger models or longer completions
    micro_batch_tokens: int = 12288
    fused_lm_head: str = "auto"  # auto (Triton on CUDA) | on | off: fused LM-head loss kernels
    # auto | fp32: AdamW steps fp32 masters of bf16 weights, fp32 moments (the bf16 weights are
    # refreshed from them after each step); off: AdamW updates bf16 weights in place, which
    # rounds updates below half a bf16 ulp away (most of them at lr 1e-5)
    master_weights: str = "auto"
    # stochastic | nearest: how the bf16 weights are rounded from the fp32 masters after a step
    # (stochastic: unbiased, so updates below half an ulp still reach the weights the rollout
    # and the loss use; it learned more in benchmarks/results/bf16_rounding_ab_h200.txt)
    bf16_rounding: str = "stochastic"
    seed: int = 0


@dataclass
class EvalConfig:
    num_problems: int = 100  # first N of the task's eval split
    temperature: float = 0.0  # 0: greedy
    max_new_tokens: int | None = None  # None: rollout.max_new_tokens
    batch_size: int = 64
    before: bool = True  # evaluate before training
    after: bool = True  # evaluate after training
    every_steps: int = 0  # 0: only before/after


@dataclass
class RunConfig:
    output_dir: str = "runs/default"
    save_every: int = 10  # steps between checkpoints (0: only at the end)
    keep_checkpoints: int = 2
    progress: bool = True
    profile_steps: int = 0  # N: trace N steps (after the first) into <output_dir>/profile/


def _default_rewards() -> list[Any]:
    return [{"name": "math_accuracy", "weight": 1.0}]


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    # each: a built-in name or "module:function", or {name|function: ..., weight: float}
    rewards: list[Any] = field(default_factory=_default_rewards)

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Defaults, then the YAML file at `path`, then `key.sub=value` overrides; validated."""
    data: dict = {}
    if path is not None:
        data = read_yaml(path)
    config = config_from_dict(data)
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(config, key, value)
    validate(config)
    return config


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        hint = ""
        presets = (
            sorted(p.name for p in Path("configs").glob("*.yaml"))
            if Path("configs").is_dir()
            else []
        )
        if presets:
            hint = f" Presets in ./configs: {', '.join(presets)}."
        raise ConfigError(f"config file not found: {path}.{hint}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path} must hold a mapping of sections (model:, task:, ...), not {type(data).__name__}"
        )
    return data


def config_from_dict(data: dict) -> Config:
    config = Config()
    for key, value in _flatten(data):
        set_dotted(config, key, value)
    return config


def _flatten(data: dict, prefix: str = ""):
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        section = getattr(Config(), key, None) if not prefix else None
        if isinstance(value, dict) and dataclasses.is_dataclass(section):
            yield from _flatten(value, dotted + ".")
        else:
            yield dotted, value


def parse_override(item: str) -> tuple[str, Any]:
    """`algo.beta=0.0` -> ("algo.beta", 0.0); the value is read as YAML (numbers, bools, lists)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. algo.beta=0.0")
    key, text = item.split("=", 1)
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return key.strip(), value


def all_keys() -> list[str]:
    keys = []
    for section in dataclasses.fields(Config):
        sub = getattr(Config(), section.name)
        if dataclasses.is_dataclass(sub):
            keys += [f"{section.name}.{f.name}" for f in dataclasses.fields(sub)]
        else:
            keys.append(section.name)
    return keys


def _unknown_key(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.5)
    if not close:  # try the last part alone: `beta` -> `algo.beta`
        tail = {k.split(".")[-1]: k for k in all_keys()}
        match = difflib.get_close_matches(key.split(".")[-1], tail, n=1, cutoff=0.6)
        close = [tail[match[0]]] if match else []
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ConfigError(
        f"unknown config key '{key}'.{hint} List every key with `fastgrpo config --keys`."
    )


def set_dotted(config: Config, key: str, value: Any) -> None:
    parts = key.split(".")
    target: Any = config
    for part in parts[:-1]:
        if not dataclasses.is_dataclass(target) or part not in _field_names(target):
            raise _unknown_key(key)
        target = getattr(target, part)
    name = parts[-1]
    if not dataclasses.is_dataclass(target) or name not in _field_names(target):
        raise _unknown_key(key)
    if dataclasses.is_dataclass(getattr(target, name)):
        raise ConfigError(
            f"'{key}' is a section; set one of its keys, e.g. '{key}.{_field_names(getattr(target, name))[0]}'"
        )
    hint = typing.get_type_hints(type(target))[name]
    setattr(target, name, _coerce(key, value, hint))


def _field_names(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check `value` against the annotation `hint`; ints widen to floats, nothing else converts."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0])
    if hint is Any or typing.get_origin(hint) is list:
        if typing.get_origin(hint) is list and not isinstance(value, list):
            value = [value]
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `5e-5` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, bool) and key in _CHOICES:  # YAML 1.1 reads on/off as bools
            word = "on" if value else "off"
            if word in _CHOICES[key]:
                return word
            raise ConfigError(f"'{key}' is {word!r}; choose one of {', '.join(_CHOICES[key])}.")
    raise ConfigError(f"'{key}' must be {hint.__name__}, got {value!r} ({type(value).__name__})")


# ----------------------------------------------------------------------------- validation

_CHOICES = {
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.backend": ("auto", "native", "hf"),
    "task.name": ("arithmetic", "gsm8k", "jsonl", "parquet", "hf"),
    "algo.loss_type": ("grpo", "dr_grpo", "dapo", "bnpo", "gspo", "cispo"),
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.importance_sampling_level": ("token", "sequence"),
    "algo.scale_rewards": ("group", "batch", "none"),
    "algo.baseline": ("mean", "leave_one_out"),
    "train.lr_scheduler": ("constant", "linear", "cosine"),
    "train.fused_lm_head": ("auto", "on", "off"),
    "train.master_weights": ("auto", "fp32", "off"),
    "train.bf16_rounding": ("stochastic", "nearest"),
}

# key -> (lowest allowed, inclusive?)
_LOWER_BOUNDS = {
    "rollout.prompts_per_step": (1, True),
    "rollout.num_generations": (2, True),
    "rollout.max_new_tokens": (1, True),
    "rollout.temperature": (0.0, False),
    "rollout.top_k": (0, True),
    "rollout.top_p": (0.0, False),
    "algo.beta": (0.0, True),
    "algo.epsilon_low": (0.0, True),
    "algo.epsilon_high": (0.0, True),
    "algo.delta": (1.0, False),
    "algo.entropy_coef": (0.0, True),
    "algo.importance_sampling_cap": (1.0, True),
    "train.steps": (0, True),
    "train.learning_rate": (0.0, True),
    "train.warmup_steps": (0, True),
    "train.weight_decay": (0.0, True),
    "train.adam_eps": (0.0, False),
    "train.max_grad_norm": (0.0, True),
    "train.num_iterations": (1, True),
    "train.mini_batches": (1, True),
    "train.micro_batch_tokens": (1, True),
    "task.num_train": (1, True),
    "task.num_eval": (1, True),
    "eval.num_problems": (0, True),
    "eval.temperature": (0.0, True),
    "eval.max_new_tokens": (1, True),
    "eval.batch_size": (1, True),
    "eval.every_steps": (0, True),
    "run.save_every": (0, True),
    "run.keep_checkpoints": (1, True),
    "run.profile_steps": (0, True),
}

# key -> what the value means, added to its range error
_BOUND_HINTS = {
    "rollout.num_generations": "GRPO compares samples within a group",
    "run.profile_steps": "set 0 for no profiling, or N to record N steps with torch.profiler",
}


def _get(config: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def validate(config: Config) -> None:
    for key, choices in _CHOICES.items():
        value = _get(config, key)
        if value not in choices:
            close = difflib.get_close_matches(str(value), choices, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"'{key}' is {value!r}; choose one of {', '.join(choices)}.{hint}")
    for key, (low, inclusive) in _LOWER_BOUNDS.items():
        value = _get(config, key)
        if value is None:
            continue
        if value < low or (value == low and not inclusive):
            relation = ">=" if inclusive else ">"
            extra = f" ({_BOUND_HINTS[key]})" if key in _BOUND_HINTS else ""
            raise ConfigError(f"'{key}' is {value}; it must be {relation} {low}{extra}.")
    for key in ("rollout.top_p", "algo.epsilon_low"):
        if _get(config, key) > 1.0:
            raise ConfigError(f"'{key}' is {_get(config, key)}; it must be <= 1.")
    _validate_batches(config)
    if config.task.name in ("jsonl", "parquet", "hf") and not config.task.path:
        raise ConfigError(
            f"task.name={config.task.name} needs task.path (a file, directory or dataset id)."
        )
    if not (
        config.model.device in ("auto", "cpu", "cuda") or config.model.device.startswith("cuda:")
    ):
        raise ConfigError(
            f"'model.device' is {config.model.device!r}; use auto, cpu, cuda or cuda:N."
        )
    if not config.rewards:
        raise ConfigError(
            "'rewards' is empty; name at least one reward, e.g. rewards: [math_accuracy]."
        )


def _validate_batches(config: Config) -> None:
    rows = config.rollout.prompts_per_step * config.rollout.num_generations
    mini = config.train.mini_batches
    if rows % mini:
        raise ConfigError(
            f"train.mini_batches={mini} does not divide the {rows} completions of a step "
            f"(rollout.prompts_per_step={config.rollout.prompts_per_step} x "
            f"rollout.num_generations={config.rollout.num_generations}); choose a divisor of {rows}."
        )
    if config.algo.loss_type == "cispo" and config.algo.epsilon_high is None:
        raise ConfigError(
            "algo.loss_type=cispo caps the importance weight at algo.epsilon_high itself (as TRL does); "
            "set it, e.g. --set algo.epsilon_high=5.0"
        )

"""Typed run configuration: dataclass sections, YAML presets, dotted `--set` overrides, validation.

A config is plain data. The defaults are the CPU quick start (SmolLM2-135M-Instruct on the
built-in arithmetic task); presets in `configs/` hold only their differences from these defaults.
Every error names the offending key, what was wrong and how to fix it, and an unknown key gets the
nearest valid one suggested, so a typo never silently trains the wrong thing.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fastgrpo.errors import UserError


class ConfigError(UserError):
    """A configuration problem; the message says what to change."""


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"  # built-in name, hub id, local HF directory or .gguf file
    dtype: str = "auto"  # auto (bf16 on GPUs, fp32 on CPUs) | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    gradient_checkpointing: bool = False  # recompute activations in the backward to save memory
    revision: str | None = None  # hub branch, tag or commit of model.name (None: the default)
    trust_remote_code: bool = False  # let transformers run the model repository's own code
    backend: str = "auto"  # auto (native for the Llama family, else transformers) | native | hf


@dataclass
class TaskConfig:
    name: str = "arithmetic"  # arithmetic | gsm8k | jsonl | parquet | hf
    path: str | None = None  # file, directory or `datasets` id (not used by arithmetic)
    prompt_field: str = "prompt"  # the records' field holding the prompt
    answer_field: str = "answer"  # the records' field holding the reference answer
    train_split: str = "train"  # file name (without suffix) or hub split of the training data
    eval_split: str = "test"  # file name (without suffix) or hub split of the held-out data
    num_train: int | None = None  # training problems to use (None: all)
    num_eval: int | None = None  # held-out problems to keep (None: the task's default)
    prompt_template: str | None = None  # prompt format: {prompt}, {field} (None: the task's)
    system_prompt: str | None = None  # system message (None: what the chat template adds itself)
    seed: int = 0  # seed of the problems drawn and of the splits carved
    # arithmetic only
    min_value: int = 0  # arithmetic: smallest operand
    max_value: int = 20  # arithmetic: largest operand
    num_operands: int = 2  # arithmetic: numbers in each expression
    operations: str = "+-"  # arithmetic: operators to draw from, any of + - *


@dataclass
class RolloutConfig:
    prompts_per_step: int = 4  # prompts sampled per training step
    num_generations: int = 8  # G samples per prompt (TRL: num_generations)
    max_new_tokens: int = 16  # longest completion in tokens (TRL: max_completion_length)
    temperature: float = 0.7  # sampling temperature of the rollouts
    top_k: int = 0  # sample among the k likeliest tokens (0: off)
    top_p: float = 1.0  # nucleus sampling mass (1: off)


@dataclass
class AlgoConfig:
    loss_type: str = "grpo"  # grpo | dr_grpo | dapo | bnpo | gspo | cispo
    beta: float = 0.0  # KL coefficient; 0 loads no reference model
    kl_estimator: str = "k3"  # k1 | k2 | k3: estimator of the KL to the reference
    epsilon_low: float = 0.2  # lower clip of the ratio, 1 - epsilon_low (TRL: epsilon)
    epsilon_high: float | None = None  # upper clip, 1 + epsilon_high (None: epsilon_low)
    delta: float | None = None  # two-sided clip of the ratio (None: off)
    importance_sampling_level: str = "token"  # token | sequence (GSPO): where the ratio is taken
    scale_rewards: str = "group"  # group | batch | none: whose std divides the advantages
    baseline: str = "mean"  # mean | leave_one_out: what is subtracted from a reward
    entropy_coef: float = 0.0  # weight of the entropy bonus in the loss
    mask_truncated_completions: bool = False  # cut-off completions get no gradient
    dynamic_sampling: bool = False  # DAPO: drop equal-reward groups, roll out more prompts
    dynamic_sampling_max_rounds: int = 3  # rollouts a step may make to fill its batch
    importance_sampling_correction: bool = False  # weight tokens by trainer/sampler log-prob ratio
    importance_sampling_mode: str = "token_truncate"  # token|sequence _truncate|_mask (TRL's)
    importance_sampling_cap: float = 2.0  # cap of that importance weight


@dataclass
class TrainConfig:
    steps: int = 30  # GRPO steps of the run
    learning_rate: float = 1e-5  # AdamW's peak learning rate
    lr_scheduler: str = "constant"  # constant | linear | cosine
    warmup_steps: int = 0  # optimizer steps of linear warm-up
    weight_decay: float = 0.0  # AdamW's decoupled weight decay (matrices only)
    adam_beta1: float = 0.9  # AdamW's decay rate of the gradient mean
    adam_beta2: float = 0.99  # AdamW's decay rate of the squared-gradient mean
    adam_eps: float = 1e-8  # AdamW's denominator floor
    max_grad_norm: float = 1.0  # clip the gradient norm to this (0: no clipping)
    num_iterations: int = 1  # K inner epochs over each rollout batch
    mini_batches: int = 1  # optimizer steps per inner epoch
    # token budget of one forward/backward (the native model: tokens fed, each shared prompt once;
    # transformers models: padded rows); fewer, larger micro-batches cost less host time per step
    # (benchmarks/HISTORY.md, issue 5); lower it for larger models or longer completions
    micro_batch_tokens: int = 12288  # tokens per forward/backward pass
    fused_lm_head: str = "auto"  # auto (Triton on CUDA) | on | off: fused LM-head loss kernels
    # auto: on one GPU, each micro-batch's forward and backward through the native model's layers
    # replay CUDA graphs (recorded per padded size), not ~3,000 launches from Python
    cuda_graphs: str = "auto"  # auto | off: the update's layers as CUDA graphs
    # auto | fp32: AdamW steps fp32 masters of bf16 weights, fp32 moments (the bf16 weights are
    # refreshed from them after each step); off: AdamW updates bf16 weights in place, which
    # rounds updates below half a bf16 ulp away (most of them at lr 1e-5)
    master_weights: str = "auto"  # auto | fp32 | off: fp32 master weights of bf16 weights
    # stochastic | nearest: how the bf16 weights are rounded from the fp32 masters after a step
    # (stochastic: unbiased, so updates below half an ulp still reach the weights the rollout
    # and the loss use; it learned more in benchmarks/results/bf16_rounding_ab_h200.txt)
    bf16_rounding: str = "stochastic"  # stochastic | nearest: rounding of bf16 weights
    seed: int = 0  # seed of the prompt order and of the sampling
    # several processes (torchrun): sharded keeps 1/N of the fp32 masters, gradients and AdamW
    # moments on each GPU (ZeRO-2; the weights stay whole for the rollout engines); replicated
    # keeps all of it on every GPU (DDP); fsdp shards the weights and gradients too (FSDP2; the
    # engines sample from a whole bf16 copy); auto: sharded (measured faster and smaller than
    # replicated), fsdp where sharded state would take more than half of a GPU
    parallel: str = "auto"  # auto | replicated | sharded (optimizer state) | fsdp (weights too)
    # with fsdp: free the engine's whole bf16 copy of the weights from the end of each rollout to
    # the next weight gather, so the update can use its memory (the engine then captures its
    # CUDA graphs again every rollout)
    fsdp_free_engine_copy: bool = False  # fsdp: the update uses the engine copy's memory
    # a step whose loss or gradient norm is NaN/inf is skipped; this many in a row stop the run
    max_nonfinite_steps: int = 3  # stop after this many skipped (NaN/inf) steps in a row
    # a reward failing (raising, or giving NaN/None) on more than this fraction of a step's
    # completions for max_failing_reward_steps steps in a row stops the run
    max_reward_failure_frac: float = 0.5  # stop when a reward fails on more of the completions
    max_failing_reward_steps: int = 3  # steps in a row a reward may fail that often
    # a reward call still running after this many seconds scores 0 for its completions and
    # counts as failing (above); its thread is abandoned, so a hung reward cannot stall the run
    reward_timeout: float | None = 60.0  # seconds each reward call may take (None: no limit)


@dataclass
class LoraConfig:
    rank: int = 0  # adapter rank r (peft's r); 0: no LoRA, every weight trains
    alpha: float = 8.0  # peft's lora_alpha: the update is scaled by alpha / rank
    dropout: float = 0.0  # peft's lora_dropout, on the adapters' input while training
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # or q_proj, ...
    use_rslora: bool = False  # scale by alpha / sqrt(rank) instead (rank-stabilised LoRA)
    modules_to_save: list[str] = field(default_factory=list)  # trained whole: embed_tokens, lm_head
    adapter: str | None = None  # a peft LoRA adapter folder to start from (its settings apply)
    # false: the engine adds the adapters in its own GEMMs instead of sampling from merged bf16
    # copies of the adapted weights (saves their memory, slower rollouts)
    merge_for_rollout: bool = True  # the engine samples from merged copies (false: no copies)


@dataclass
class EvalConfig:
    num_problems: int = 100  # evaluate on the first N of the task's eval split
    temperature: float = 0.0  # sampling temperature of evaluations (0: greedy)
    max_new_tokens: int | None = None  # longest completion (None: rollout.max_new_tokens)
    batch_size: int = 64  # problems per generation batch
    before: bool = True  # evaluate before training
    after: bool = True  # evaluate after training
    every_steps: int = 0  # evaluate every N steps as well (0: only before/after)


@dataclass
class RunConfig:
    output_dir: str = "runs/default"  # the run folder: config, metrics, checkpoints
    save_every: int = 10  # steps between checkpoints (0: only at the end)
    keep_checkpoints: int = 2  # newest checkpoints kept (each holds weights and optimizer state)
    progress: bool = True  # show a progress bar
    profile_steps: int = 0  # N: trace N steps (after the first) into <output_dir>/profile/
    plots: bool = True  # write <output_dir>/plots/*.png at the end (needs matplotlib)
    push_to_hub: str | None = None  # ORG/NAME: upload the final model and a model card at the end
    report_to: list[str] = field(default_factory=list)  # also log to: tensorboard, wandb


def _default_rewards() -> list[Any]:
    return [{"name": "math_accuracy", "weight": 1.0}]


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # null: no LoRA (full fine-tuning)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    # each: a built-in name or "module:function", or {name|function: ..., weight: float}
    rewards: list[Any] = field(default_factory=_default_rewards)  # reward functions, summed

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
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path} is not UTF-8 text ({error}); re-save it as UTF-8") from error
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
        if value is None and dataclasses.is_dataclass(section):  # `lora: null`: the defaults
            continue
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
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads `5e-5` (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and not math.isfinite(number):
            extra = f" ({_BOUND_HINTS[key]})" if key in _BOUND_HINTS else ""
            raise ConfigError(f"'{key}' is {number}; give a finite number{extra}.")
        if number is not None:
            return number
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

# TRL's vllm_importance_sampling_mode values (fastgrpo/algo/rollout_correction.py applies them)
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

_CHOICES = {
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.backend": ("auto", "native", "hf"),
    "task.name": ("arithmetic", "gsm8k", "jsonl", "parquet", "hf"),
    "algo.loss_type": ("grpo", "dr_grpo", "dapo", "bnpo", "gspo", "cispo"),
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.importance_sampling_level": ("token", "sequence"),
    "algo.importance_sampling_mode": IMPORTANCE_SAMPLING_MODES,
    "algo.scale_rewards": ("group", "batch", "none"),
    "algo.baseline": ("mean", "leave_one_out"),
    "train.lr_scheduler": ("constant", "linear", "cosine"),
    "train.fused_lm_head": ("auto", "on", "off"),
    "train.cuda_graphs": ("auto", "off"),
    "train.master_weights": ("auto", "fp32", "off"),
    "train.bf16_rounding": ("stochastic", "nearest"),
    "train.parallel": ("auto", "replicated", "sharded", "fsdp"),
}

REPORTERS = ("tensorboard", "wandb")  # run.report_to

# The allowed range of every numeric key: "[" or "]" includes a bound, "(" or ")" excludes it.
# A value outside trains nothing useful (lr 10 destroys the model in a step) or crashes later.
RANGES = {
    "task.num_train": "[1, inf)",
    "task.num_eval": "[1, inf)",
    "task.seed": "[0, inf)",
    "task.min_value": "[-1000000000, 1000000000]",
    "task.max_value": "[-1000000000, 1000000000]",
    "task.num_operands": "[2, 16]",
    "rollout.prompts_per_step": "[1, inf)",
    "rollout.num_generations": "[2, inf)",
    "rollout.max_new_tokens": "[1, inf)",
    "rollout.temperature": "(0, 10]",
    "rollout.top_k": "[0, inf)",
    "rollout.top_p": "(0, 1]",
    "algo.beta": "[0, 10]",
    "algo.epsilon_low": "[0, 1]",
    "algo.epsilon_high": "[0, 100]",
    "algo.delta": "(1, 100]",
    "algo.entropy_coef": "[0, 1]",
    "algo.importance_sampling_cap": "[1, 100]",
    "algo.dynamic_sampling_max_rounds": "[1, 100]",
    "train.steps": "[0, inf)",
    "train.learning_rate": "[0, 1]",  # 0 is a dry run: every phase, no change to the weights
    "train.warmup_steps": "[0, inf)",
    "train.weight_decay": "[0, 1]",
    "train.adam_beta1": "[0, 1)",
    "train.adam_beta2": "[0, 1)",
    "train.adam_eps": "(0, 1]",
    "train.max_grad_norm": "[0, inf)",
    "train.num_iterations": "[1, inf)",
    "train.mini_batches": "[1, inf)",
    "train.micro_batch_tokens": "[1, inf)",
    "train.seed": "[0, inf)",
    "train.max_nonfinite_steps": "[1, inf)",
    "train.max_reward_failure_frac": "[0, 1]",
    "train.max_failing_reward_steps": "[1, inf)",
    "train.reward_timeout": "(0, inf)",
    "eval.num_problems": "[0, inf)",
    "eval.temperature": "[0, 10]",
    "eval.max_new_tokens": "[1, inf)",
    "eval.batch_size": "[1, inf)",
    "eval.every_steps": "[0, inf)",
    "lora.rank": "[0, inf)",
    "lora.alpha": "(0, inf)",
    "lora.dropout": "[0, 1)",
    "run.save_every": "[0, inf)",
    "run.keep_checkpoints": "[1, inf)",
    "run.profile_steps": "[0, inf)",
}

# key -> what the value means, added to its range error
_BOUND_HINTS = {
    "rollout.num_generations": "GRPO compares samples within a group",
    "run.profile_steps": "set 0 for no profiling, or N to record N steps with torch.profiler",
    "train.max_grad_norm": "0 turns clipping off",
    "train.max_reward_failure_frac": "1 never stops the run for a failing reward",
    "train.reward_timeout": "seconds a reward call may take; null for no limit",
}


def in_range(value: float, interval: str) -> bool:
    """Whether `value` lies in `interval`, written like "[0, 1)"."""
    low, high = (float(bound) for bound in interval[1:-1].split(","))
    above = value >= low if interval[0] == "[" else value > low
    below = value <= high if interval[-1] == "]" else value < high
    return above and below


def _check_range(config: Config, key: str, interval: str) -> None:
    value = _get(config, key)
    if value is None or in_range(value, interval):
        return
    extra = f" ({_BOUND_HINTS[key]})" if key in _BOUND_HINTS else ""
    default = _get(Config(), key)
    raise ConfigError(
        f"'{key}' is {value}; it must be {describe_range(interval)}{extra}; "
        f"the default is {default}."
    )


def describe_range(interval: str) -> str:
    """ "[0, inf)" -> ">= 0", "(0, 1]" -> "in (0, 1]"."""
    low = interval[1:-1].split(",")[0]
    if interval.endswith("inf)"):
        return f"{'>=' if interval[0] == '[' else '>'} {low}"
    return f"in {interval}"


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
    for key, interval in RANGES.items():
        _check_range(config, key, interval)
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
    unknown = [name for name in config.run.report_to if name not in REPORTERS]
    if unknown:
        raise ConfigError(
            f"'run.report_to' names {unknown[0]!r}; choose from {', '.join(REPORTERS)} "
            "(or [] for metrics.jsonl alone)"
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

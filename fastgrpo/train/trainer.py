"""Everything a GRPO step works with, built once: the task's data, the rewards, the models, the
optimizer and schedule, and the loss path (`Trainer`, made by `build_trainer`).

`fastgrpo.train.loop.train` builds its Trainer here; so can a caller with its own models, such as
benchmarks/bench_step.py, and then run `grpo_step` exactly as `train` does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fastgrpo.config import Config, ConfigError
from fastgrpo.data import DatasetError, TaskData, build_task
from fastgrpo.models import Transformer, load_model, stop_token_ids
from fastgrpo.models.lora import (
    LoraError,
    LoraSettings,
    adapters_off,
    add_adapters,
    load_adapters,
    read_adapter_settings,
)
from fastgrpo.models.lora_decode import DecodeAdapters
from fastgrpo.models.lora_merged import MergedWeights
from fastgrpo.rewards import RewardSet
from fastgrpo.train.captured_layers import CapturedLayers, token_step, why_eager
from fastgrpo.train.logprobs import kept_hidden
from fastgrpo.train.optim import ModelOptimizer, build_scheduler
from fastgrpo.train.parallel import choose_parallel
from fastgrpo.train.precision import rounded_away_fraction
from fastgrpo.train.step_loss import LossSettings, MicroBatchLoss, choose_loss
from fastgrpo.train.update import use_fused_lm_head

log = logging.getLogger("fastgrpo.train")


@dataclass
class Trainer:
    """Everything a step works with, built once by `build_trainer`."""

    model: object
    ref_model: object | None  # frozen reference; None when beta == 0
    tokenizer: object
    optimizer: ModelOptimizer  # AdamW, over fp32 masters of bf16 weights by default
    scheduler: object
    rewards: RewardSet
    stop_ids: list[int]
    loss_settings: LossSettings
    loss: MicroBatchLoss  # chosen once: the reference or a fused LM-head path
    fused: bool  # the fused LM-head kernels score and train
    world: object | None = None  # the data-parallel job (distributed.World), None in one process
    parallel: str = ""  # a data-parallel job's choice of train.parallel, in words
    # sharded jobs: the reference kept as shards, whole only while it scores (distributed/frozen.py)
    reference_shards: object | None = None
    # fsdp jobs: the sharded model and the whole copy its engine samples from (distributed/fsdp.py)
    fully_sharded: object | None = None
    # LoRA runs: the adapters' settings, and what the engine samples from: merged weights, or
    # the policy with its adapters added in the engine's GEMMs (lora.merge_for_rollout false)
    lora: LoraSettings | None = None
    lora_rollout: MergedWeights | DecodeAdapters | None = None
    # the update's layers as CUDA graphs (train.cuda_graphs), None where they run eagerly
    captured: CapturedLayers | None = None
    warned_short_batch: bool = False  # dynamic sampling said once that it ran out of rounds
    # set by the training loop: after each rollout, whether a stop signal abandons the step
    abandon_step: Callable[[], bool] | None = None

    @property
    def rollout_model(self):
        """The model the engine samples from and evaluation scores: the policy itself, except
        under FSDP (its whole bf16 copy) and with LoRA (the adapters merged into a copy of the
        adapted weights, or the engine's copy of the factors, refreshed here after they
        change)."""
        if self.lora_rollout is not None:
            return self.lora_rollout.current(self.optimizer.updates)
        return self.model if self.fully_sharded is None else self.fully_sharded.rollout_model

    @contextmanager
    def reference(self):
        """The frozen reference model for the block (None when beta is 0): whole again where it
        is sharded, and the policy with its adapters off in a LoRA run."""
        if self.lora is not None and self.loss_settings.beta != 0:
            with adapters_off(self.model) as base:
                yield base
        elif self.reference_shards is not None:
            with self.reference_shards.whole():
                yield self.ref_model
        else:
            yield self.ref_model

    @property
    def lockstep(self) -> bool:
        """Whether every rank must run as many forwards and backwards as the busiest (FSDP)."""
        return self.fully_sharded is not None


def build_task_data(config: Config) -> TaskData:
    t = config.task
    options = dict(
        seed=t.seed,
        num_train=t.num_train,
        num_eval=t.num_eval,
        prompt_template=t.prompt_template,
        path=t.path,
        prompt_field=t.prompt_field,
        answer_field=t.answer_field,
        train_split=t.train_split,
        eval_split=t.eval_split,
    )
    if t.name == "arithmetic":
        options.update(
            min_value=t.min_value,
            max_value=t.max_value,
            num_operands=t.num_operands,
            operations=t.operations,
        )
    try:
        return build_task(t.name, **{k: v for k, v in options.items() if v is not None})
    except DatasetError:
        raise
    except ValueError as error:  # a knob the task refuses: say which section it belongs to
        raise ConfigError(f"task: {error}") from error


def check_enough_prompts(config: Config, task: TaskData) -> None:
    """A step samples rollout.prompts_per_step distinct training prompts: refuse fewer."""
    have, need = len(task.train), config.rollout.prompts_per_step
    if have >= need:
        return
    where = f"task.path={config.task.path}" if config.task.path else f"task.name={config.task.name}"
    raise ConfigError(
        f"{where} gives {have} training record(s) but rollout.prompts_per_step={need} needs at "
        f"least {need} (a single file also gives task.num_eval records, default 10%, to eval): "
        f"add records or set rollout.prompts_per_step={max(have, 1)}"
    )


def build_rewards(config: Config) -> RewardSet:
    try:
        return RewardSet.from_specs(config.rewards, timeout=config.train.reward_timeout)
    except ValueError as error:
        raise ConfigError(f"rewards: {error}") from error


def load_configured_model(config: Config, name: str | None = None):
    """(model, tokenizer, source) for `name` (default: model.name) with the config's model settings."""
    m = config.model
    return load_model(
        name or m.name,
        dtype=m.dtype,
        device=m.device,
        revision=m.revision,
        trust_remote_code=m.trust_remote_code,
        backend=m.backend,
    )


def lora_settings(config: Config) -> LoraSettings | None:
    """The run's LoRA settings (None: full fine-tuning): the `lora` section's, or those of the
    adapter `lora.adapter` names, which the run continues."""
    c = config.lora
    if c.adapter is None:
        if c.rank == 0:
            return None
        return LoraSettings(
            c.rank,
            c.alpha,
            c.dropout,
            list(c.target_modules),
            c.use_rslora,
            list(c.modules_to_save),
        )
    try:
        settings = read_adapter_settings(c.adapter)
    except LoraError as error:
        raise ConfigError(f"lora.adapter: {error}") from None
    if c.rank not in (0, settings.rank):
        raise ConfigError(
            f"lora.rank={c.rank} but the adapter lora.adapter={c.adapter} has rank "
            f"{settings.rank}; drop lora.rank (the adapter's settings apply)"
        )
    return settings


def attach_adapters(model, settings: LoraSettings, folder=None, *, seed: int = 0) -> None:
    """Freeze `model` and give it the adapters `settings` describe: new (B = 0, so the model is
    unchanged), or read from `folder` (a checkpoint's, or a peft adapter to continue)."""
    try:
        add_adapters(model, settings, seed=seed)
        if folder is not None:
            load_adapters(model, folder)
    except LoraError as error:
        raise ConfigError(f"lora: {error}") from None


def check_lora(config: Config) -> None:
    """A ConfigError now for a LoRA run this layout cannot do."""
    if config.train.parallel == "fsdp":
        raise ConfigError(
            "lora with train.parallel=fsdp: the base is frozen and the adapters are small, so "
            "shard nothing; use train.parallel=auto"
        )


def _eager_layers_reason(config: Config, model, fused: bool, world) -> str | None:
    """Why the update runs its layers eagerly, in words; None: as CUDA graphs, where
    train.cuda_graphs allows and they serve the fused loss (`captured_layers.why_eager`)."""
    if config.train.cuda_graphs == "off":
        return "train.cuda_graphs=off"
    if not fused:
        return "the fused LM-head loss is off"
    return why_eager(model, world)


def _captured_layers(config: Config, model, fused: bool, world) -> CapturedLayers | None:
    """The update's layers as CUDA graphs where they can be; None: they run eagerly."""
    if _eager_layers_reason(config, model, fused, world) is None:
        return CapturedLayers(model, token_step(config.train.micro_batch_tokens))
    return None


def update_layers_note(config: Config, trainer: Trainer) -> str | None:
    """The run log's line on how the update runs its layers on a GPU (None on the CPU)."""
    model = trainer.model
    if getattr(model, "device", torch.device("cpu")).type != "cuda":
        return None
    if trainer.captured is not None:
        step = trainer.captured.step
        return f"update: the layers replay CUDA graphs, micro-batches padded to {step}-token steps"
    reason = _eager_layers_reason(config, model, trainer.fused, trainer.world)
    return f"update: the layers run eagerly ({reason})"


def check_fused_lm_head(config: Config, model) -> bool:
    """Whether the update runs the fused LM-head kernels on `model`; a ConfigError now if
    train.fused_lm_head asks for kernels that cannot run there."""
    try:
        return use_fused_lm_head(config.train.fused_lm_head, model)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def build_trainer(
    config: Config,
    model,
    tokenizer,
    ref_model=None,
    *,
    rewards: RewardSet | None = None,
    world=None,
    lora: LoraSettings | None = None,
) -> Trainer:
    """The Trainer for an already-made policy `model` (and, when algo.beta != 0, its frozen
    reference `ref_model`, None otherwise): sets the model up for training as configured and
    builds the optimizer, schedule, rewards (default: config.rewards) and stop ids.

    `train` builds its Trainer here; so can a caller with its own models, such as
    benchmarks/bench_step.py, and then run `grpo_step` exactly as `train` does.
    """
    fused = check_fused_lm_head(config, model)
    needs_reference = config.algo.beta != 0 and lora is None  # LoRA: the base, adapters off
    if (ref_model is None) == needs_reference:
        raise ValueError(
            f"algo.beta={config.algo.beta}{' with LoRA' if lora else ''} needs "
            + ("a frozen reference model" if ref_model is None else "no reference model (None)")
        )
    if lora is not None:
        check_lora(config)
    native = isinstance(model, Transformer)
    if config.model.gradient_checkpointing and native:
        model.activation_checkpointing = True
    elif config.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if lora is not None:  # the frozen embeddings' output must carry gradient into the layers
            model.enable_input_require_grads()
    if not native:
        model.config.use_cache = True
    if ref_model is not None:
        ref_model.requires_grad_(False).eval()
    t = config.train
    check_training_precision(config, model)
    chosen, parallel, fully_sharded = "", "", None
    if world is not None and world.size > 1:
        chosen, parallel = choose_parallel(config, model, world)
    if chosen == "fsdp":
        from fastgrpo.distributed.fsdp import FullySharded

        fully_sharded = FullySharded(model, world)
    optimizer = ModelOptimizer(
        model,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_eps,
        master_weights=t.master_weights,
        rounding=t.bf16_rounding,
        seed=t.seed,
        world=world,
        sharded=chosen == "sharded",
        fully_sharded=fully_sharded,
    )
    scheduler = build_scheduler(
        optimizer.adamw,
        kind=t.lr_scheduler,
        warmup_steps=t.warmup_steps,
        total_steps=t.steps * t.num_iterations * t.mini_batches,
    )
    settings = LossSettings.from_config(config)
    reference_shards = None
    if chosen in ("sharded", "fsdp") and ref_model is not None:
        from fastgrpo.distributed.frozen import ShardedFrozen

        reference_shards = ShardedFrozen(ref_model, world)
    # the native engine reads merged weights or adds the adapters itself; HF generate runs the
    # adapted model as it is
    captured = _captured_layers(config, model, fused, world)
    lora_rollout = None
    if lora is not None and native:
        merge = config.lora.merge_for_rollout
        stochastic = config.train.bf16_rounding == "stochastic"
        lora_rollout = MergedWeights(model, stochastic) if merge else DecodeAdapters(model)
    return Trainer(
        model,
        ref_model,
        tokenizer,
        optimizer,
        scheduler,
        rewards if rewards is not None else build_rewards(config),
        stop_token_ids(tokenizer, model),
        settings,
        choose_loss(settings, fused, kept_hidden if captured is None else captured.kept_hidden),
        fused,
        world if world is not None and world.size > 1 else None,
        parallel,
        reference_shards,
        fully_sharded,
        lora,
        lora_rollout,
        captured,
    )


def check_training_precision(config: Config, model) -> None:
    """Refuse fp16 training; warn when train.master_weights=off would round the updates away."""
    params = [p for p in model.parameters() if p.requires_grad]
    if any(p.dtype == torch.float16 for p in params):
        raise ConfigError(
            "model.dtype=float16 cannot train here: fp16 gradients underflow without loss "
            "scaling, which fastgrpo does not do. Use model.dtype=bfloat16 (same memory and "
            "speed, fp32's range; the default on GPUs that have it) or float32."
        )
    if config.train.master_weights == "off":
        lost = rounded_away_fraction(params, config.train.learning_rate)
        if lost > 0.5:
            log.warning(
                "train.master_weights=off: a step of lr %.3g is below half a bf16 ulp for %.0f%% "
                "of the weights, so AdamW's updates to them round away; use "
                "train.master_weights=auto (fp32 master weights) or a larger learning rate",
                config.train.learning_rate,
                100 * lost,
            )

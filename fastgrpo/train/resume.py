"""Continuing a run: which settings may change, what code a run folder's config would run, and
putting the optimizer and schedule back so that the resumed run trains as its config says.

Settings that only steer how training goes on (steps, learning rate and schedule, optimizer
constants, clipping, sampling temperature and length, micro-batch size, reward time limit,
evaluation, saving, logging, device) may change on resume: they apply from the next step, config.yaml says the new
value, and each change is appended to the run folder's `config_changes.jsonl` as
`{"after_step": N, "key": ..., "from": ..., "to": ...}` (N: the checkpoint resumed from).
Every other setting (model, task, rewards, group shape, algorithm, precision, seed) made the
checkpoint's state what it is: a resume that changes one is refused, naming it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import yaml

from fastgrpo.config import (
    Config,
    ConfigError,
    config_from_dict,
    parse_override,
    set_dotted,
    validate,
)

log = logging.getLogger("fastgrpo.train")

CHANGES_FILE = "config_changes.jsonl"

CHANGEABLE = frozenset(
    {
        "model.device",
        "model.gradient_checkpointing",
        "rollout.max_new_tokens",
        "rollout.temperature",
        "rollout.top_k",
        "rollout.top_p",
        "train.steps",
        "train.learning_rate",
        "train.lr_scheduler",
        "train.warmup_steps",
        "train.weight_decay",
        "train.adam_beta1",
        "train.adam_beta2",
        "train.adam_eps",
        "train.max_grad_norm",
        "train.micro_batch_tokens",
        "train.fused_lm_head",
        "train.cuda_graphs",
        "train.parallel",  # replicated and sharded continue each other; fsdp only itself (one line)
        "train.reward_timeout",  # a run stopped by a slow reward resumes with a longer limit
        "eval.num_problems",
        "eval.temperature",
        "eval.max_new_tokens",
        "eval.batch_size",
        "eval.before",
        "eval.after",
        "eval.every_steps",
        "run.save_every",
        "run.keep_checkpoints",
        "run.progress",
        "run.plots",
    }
)
# where the run is and what this command profiles: neither is a property of the run
PER_COMMAND = frozenset({"run.output_dir", "run.profile_steps"})


def _flat(data: dict) -> dict:
    out = {}
    for section, value in data.items():
        if isinstance(value, dict):
            out.update({f"{section}.{k}": v for k, v in value.items()})
        else:
            out[section] = value
    return out


def _read_config(path: Path) -> Config:
    try:
        return config_from_dict(yaml.safe_load(path.read_text()) or {})
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None


def changed_settings(checkpoint: Path, config: Config) -> dict[str, tuple]:
    """{key: (old, new)} of `config` against the config `checkpoint` was saved with; a
    ConfigError naming every key that may not change on resume."""
    saved_path = checkpoint / "config.yaml"
    if not saved_path.is_file():  # written beside every checkpoint; the run's own as a fallback
        saved_path = checkpoint.parent.parent / "config.yaml"
    old, new = _flat(_read_config(saved_path).to_dict()), _flat(config.to_dict())
    changes = {k: (old[k], new[k]) for k in new if k not in PER_COMMAND and old[k] != new[k]}
    fixed = [f"{k} ({a!r} -> {b!r})" for k, (a, b) in changes.items() if k not in CHANGEABLE]
    if fixed:
        raise ConfigError(
            f"--resume cannot change {', '.join(fixed)}: the checkpoint was trained with the old "
            f"value. Drop that --set, or start a new run from these weights with "
            f"--set model.name={checkpoint} --set run.output_dir=runs/NEW."
        )
    return changes


def record_changes(run_dir: Path, step: int, changes: dict[str, tuple]) -> None:
    """Append `changes` to config_changes.jsonl as applying after `step`; records of an earlier
    resume from this same checkpoint or a later one are replaced (that work is being redone)."""
    path = Path(run_dir) / CHANGES_FILE
    kept = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # cut off mid-write
                continue
            if record.get("after_step", 0) < step:
                kept.append(record)
    kept += [{"after_step": step, "key": k, "from": a, "to": b} for k, (a, b) in changes.items()]
    if kept or path.is_file():
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text("".join(json.dumps(r) + "\n" for r in kept))
        temporary.replace(path)


# ----------------------------------------------------------------------------- optimizer state


def restore_optimizer(optimizer, scheduler, optimizer_state: dict, scheduler_state: dict) -> None:
    """Load the saved moments, masters and schedule position, keeping the hyperparameters the
    trainer was built with from the current config: the learning rate (and its schedule), betas,
    eps and weight decay in force are the config's, never silently the old run's."""
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.adamw.param_groups]
    optimizer.load_state_dict(optimizer_state)
    groups = optimizer.adamw.param_groups  # new dicts: loading replaces them
    for group, fresh in zip(groups, settings):
        group.update(fresh)
    # the position in the schedule is the saved one; the curve (base lr, kind, warmup, length)
    # is the config's: the lr is what a run started with this config would use at this step
    state = {**scheduler_state, "base_lrs": list(scheduler.base_lrs)}
    position = state["last_epoch"]
    lrs = [base * fn(position) for base, fn in zip(state["base_lrs"], scheduler.lr_lambdas)]
    state["_last_lr"] = lrs
    scheduler.load_state_dict(state)
    for group, lr in zip(groups, lrs):
        group["lr"] = lr


# ----------------------------------------------------------------------------- code in a config


def code_named(config: Config) -> list[str]:
    """What in `config` runs Python code beyond fastgrpo's own: reward functions from files or
    modules, and a model's own code (model.trust_remote_code)."""
    from fastgrpo.rewards.registry import BUILTIN_REWARDS

    found = []
    for spec in config.rewards:
        target = spec if not isinstance(spec, dict) else spec.get("function") or spec.get("name")
        if isinstance(target, str) and target.strip() not in BUILTIN_REWARDS:
            found.append(f"reward {target.strip()}")
    if config.model.trust_remote_code:
        found.append("model.trust_remote_code (Python files that come with the model)")
    return found


def check_run_code(config: Config, yours: Config, source: Path, *, trust: bool) -> None:
    """Show the code that `config`, read from the folder `source`, will run; refuse (ConfigError)
    when some of it is not named by `yours` (what the user wrote on the command line) and
    `trust` is off."""
    named = code_named(config)
    if not named:
        return
    theirs = [c for c in named if c not in code_named(yours)]
    if theirs and not trust:
        raise ConfigError(
            f"{source}/config.yaml runs code: {'; '.join(theirs)}. Read it; if you trust it, "
            f"run the command again with --trust-run-code."
        )
    log.warning("the config of %s runs code: %s", source, "; ".join(named))


def load_resume_config(
    run_dir: str | Path, overrides=(), *, trust_run_code: bool = False
) -> Config:
    """The config a run folder last ran with, pointed at that folder, with `overrides` applied
    (`section.key=value`); refused when it runs code the overrides do not name, unless trusted."""
    run_dir = Path(run_dir)
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--resume: {run_dir} has no config.yaml; is it a fastgrpo run folder?")
    config = _read_config(path)
    config.run.output_dir = str(run_dir)
    config.run.profile_steps = 0  # a profile is asked for per command (--profile), not inherited
    for item in overrides:
        key, value = parse_override(item)
        if key == "run.output_dir" and Path(str(value)) != run_dir:
            raise ConfigError(
                f"--resume continues the run in {run_dir}; to train elsewhere, copy the folder "
                f"and resume the copy."
            )
        set_dotted(config, key, value)
    validate(config)
    yours = Config()  # what the command line itself names
    for item in overrides:
        key, value = parse_override(item)
        if key in ("rewards", "model.trust_remote_code"):
            set_dotted(yours, key, value)
    check_run_code(config, yours, run_dir, trust=trust_run_code)
    return config

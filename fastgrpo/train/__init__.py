"""The training loop, optimizer, checkpoints, metrics and evaluation.

`fastgrpo.train` is both this package and the function that runs training: the module is made
callable so that `fastgrpo.train(config)` and `fastgrpo.train.loop` both work.
"""

import sys
import types
from pathlib import Path

from fastgrpo.train.evaluate import evaluate
from fastgrpo.train.loop import TrainResult
from fastgrpo.train.resume import load_resume_config
from fastgrpo.train.step import grpo_step


def run_training(
    config=None, *, resume: bool = False, overrides=(), trust_run_code: bool = False
) -> TrainResult:
    """Train from a `Config`, a dict of sections, a YAML path, or None (the quick-start defaults).

    `resume`: continue the run in run.output_dir (build its config with `load_resume_config`);
    `trust_run_code`: also load a trainer state that needs full unpickling (an older format)."""
    from fastgrpo.config import (
        Config,
        config_from_dict,
        load_config,
        parse_override,
        set_dotted,
        validate,
    )
    from fastgrpo.train.loop import train as _train

    if config is None or isinstance(config, (str, Path)):
        config = load_config(config)
    elif isinstance(config, dict):
        config = config_from_dict(config)
    elif not isinstance(config, Config):
        raise TypeError(
            f"config must be a Config, dict, YAML path or None, not {type(config).__name__}"
        )
    for item in overrides:
        set_dotted(config, *parse_override(item))
    validate(config)
    return _train(config, resume=resume, trust_run_code=trust_run_code)


class _CallableModule(types.ModuleType):
    def __call__(self, config=None, **kwargs) -> TrainResult:
        return run_training(config, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["TrainResult", "evaluate", "grpo_step", "load_resume_config", "run_training"]

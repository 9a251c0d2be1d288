"""fastgrpo: GRPO-family reinforcement learning for language models, fast and lean.

    import fastgrpo
    result = fastgrpo.train("configs/quickstart.yaml")       # or a Config, a dict, or None
    result.eval_before, result.eval_after

`fastgrpo.rewards.math_accuracy`, `fastgrpo.algo.policy_loss` and friends are the building blocks.
The subpackages that need torch are imported on first use, so that `fastgrpo --help` and
`fastgrpo config` start in a fraction of a second.
"""

import importlib

__version__ = "0.1.0"

from fastgrpo.config import Config, ConfigError, load_config  # noqa: E402

_LAZY = ("algo", "rewards", "train")


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(f"fastgrpo.{name}")
    raise AttributeError(f"module 'fastgrpo' has no attribute {name!r}")


__all__ = ["Config", "ConfigError", "algo", "load_config", "rewards", "train", "__version__"]

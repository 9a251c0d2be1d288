"""fastgrpo: GRPO-family reinforcement learning for language models, fast and lean.

    import fastgrpo
    result = fastgrpo.train("configs/quickstart.yaml")       # or a Config, a dict, or None
    result.eval_before, result.eval_after

`fastgrpo.rewards.math_accuracy`, `fastgrpo.algo.policy_loss` and friends are the building blocks.
"""

__version__ = "0.1.0"

from fastgrpo import algo, rewards, train  # noqa: E402
from fastgrpo.config import Config, ConfigError, load_config  # noqa: E402

__all__ = ["Config", "ConfigError", "algo", "load_config", "rewards", "train", "__version__"]

"""Generation engines producing `Rollout`s: HF generate today, the native engine later."""

from fastgrpo.rollout.hf_generate import generate_rollout
from fastgrpo.rollout.types import Rollout, completion_mask

__all__ = ["Rollout", "completion_mask", "generate_rollout"]

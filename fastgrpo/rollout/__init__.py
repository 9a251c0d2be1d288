"""Generation engines producing `Rollout`s: the native engine, and HF generate as the fallback."""

from fastgrpo.rollout.generate import generate_rollout
from fastgrpo.rollout.native_generate import release_engine
from fastgrpo.rollout.sampling import SamplingParams, sample_tokens
from fastgrpo.rollout.types import Rollout, completion_mask

__all__ = [
    "Rollout",
    "SamplingParams",
    "completion_mask",
    "generate_rollout",
    "release_engine",
    "sample_tokens",
]

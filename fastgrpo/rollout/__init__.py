"""Generation engines producing `Rollout`s: HF generate today, the native engine later."""

from fastgrpo.rollout.hf_generate import generate_rollout
from fastgrpo.rollout.sampling import SamplingParams, sample_tokens
from fastgrpo.rollout.types import Rollout, completion_mask

__all__ = ["Rollout", "SamplingParams", "completion_mask", "generate_rollout", "sample_tokens"]

"""Runs with the importance-sampling correction in TRL's modes: the old log-probs are scored for
every mode but token_truncate, each step reports the sampler/trainer mismatch, and a tight cap
masks tokens."""

from __future__ import annotations

import pytest

from fastgrpo.train import run_training
from tests.train.test_training_run import tiny_overrides, write_test_rewards


@pytest.mark.parametrize("mode", ["token_mask", "sequence_truncate"])
def test_a_run_reports_the_mismatch_and_what_the_correction_did(tiny_model_dir, tmp_path, mode):
    rewards = f"['{write_test_rewards(tmp_path)}:digit_share']"
    settings = {"algo.importance_sampling_correction": True, "algo.importance_sampling_mode": mode,
                "algo.importance_sampling_cap": 1.0, "rewards": rewards}  # fmt: skip
    result = run_training(
        None, overrides=tiny_overrides(tiny_model_dir, tmp_path / "r", 2, **settings)
    )
    for record in result.history:
        gap = record["sampling/sampling_logp_difference/mean"]
        assert 0 < gap < 1e-3  # fp32 engine and trainer: different kernels, nearly equal
        assert record["sampling/sampling_logp_difference/max"] >= gap
        # cap 1: every ratio above 1 is masked (token_mask) or capped (sequence_truncate)
        assert 0 <= record["sampling/corrected_frac"] < 0.95
        assert record["sampling/importance_sampling_ratio/max"] <= 1.0
    if mode == "token_mask":  # some tokens' ratios passed 1 and were masked
        assert any(r["sampling/corrected_frac"] > 0 for r in result.history)
        assert min(r["sampling/importance_sampling_ratio/min"] for r in result.history) == 0.0
    assert "time/old_logprobs" in result.history[0]

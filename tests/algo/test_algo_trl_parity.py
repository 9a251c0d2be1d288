"""Values worked out by hand from the formulas of TRL's GRPOTrainer (huggingface/trl,
``trl/trainer/grpo_trainer.py``, ``_compute_loss`` and the advantage code in
``_generate_and_score_completions``, read at commit f2cd577). Nothing from TRL is imported or
re-implemented; each test states the TRL rule it pins down and the arithmetic.
"""

import math

import torch

from fastgrpo.algo import group_advantages, policy_loss

LN2 = math.log(2.0)


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


def one_row(ratios, advantage, logp_value=-1.0):
    logp = torch.full((1, len(ratios)), logp_value, requires_grad=True)
    old = logp.detach() - torch.tensor([ratios]).log()
    return logp, old, torch.tensor([advantage]), torch.ones(1, len(ratios), dtype=torch.bool)


def test_cispo_caps_the_ratio_at_epsilon_high_itself_not_one_plus_epsilon_high():
    # TRL: weight = clamp(coef_1, max=epsilon_high).detach(); loss_t = -weight * A * logp;
    # cispo aggregates like dapo (sum / active tokens). ScaleRL's recommended epsilon_high = 5.
    # ratios [5.5, 4], A = 1, logp = -1: weights [5, 4] -> token losses [5, 4] -> 9 / 2 = 4.5
    # (a cap of 1 + 5 = 6 would give (5.5 + 4) / 2 = 4.75)
    logp, old, adv, mask = one_row([5.5, 4.0], 1.0)
    loss, metrics = policy_loss(logp, old, None, adv, mask, loss_type="cispo", epsilon_high=5.0)
    close(loss, 4.5)
    close(metrics["clip_ratio/high_mean"], 0.5)  # TRL's cispo_clip_ratio: ratio > 5 with A > 0


def test_delta_is_applied_to_coef_1_after_coef_2_is_taken_from_the_unclamped_ratio():
    # TRL: coef_2 = clamp(r, 0.8, 1.2) first, then coef_1 = clamp(r, max=delta).
    # The order only shows when delta < 1 + epsilon_high; r = 3, delta = 1.1:
    #   A = +1 -> -min(1.1, 1.2) = -1.1
    #   A = -1 -> -min(-1.1, -1.2) = 1.2   (clamping coef_2 after delta would give 1.1)
    logp, old, _, mask = one_row([3.0], 1.0)
    close(policy_loss(logp, old, None, torch.tensor([1.0]), mask, delta=1.1)[0], -1.1)
    close(policy_loss(logp, old, None, torch.tensor([-1.0]), mask, delta=1.1)[0], 1.2)


def test_tis_weight_multiplies_the_surrogate_but_not_the_kl_term():
    # TRL: per_token_loss *= importance_sampling_ratio, *then* per_token_loss += beta * k3.
    # A = 0 so the surrogate is 0; is-ratio 2 must not scale beta * k3(d = ln2) = 0.1 (ln2 - 0.5)
    logp, _, _, mask = one_row([1.0], 0.0)
    ref = logp.detach() - LN2
    sampling = logp.detach() - LN2  # exp(old - sampling) = 2
    loss, metrics = policy_loss(
        logp, None, ref, torch.zeros(1), mask, beta=0.1, sampling_logp=sampling
    )
    close(loss, 0.1 * (LN2 - 0.5))
    close(metrics["is_ratio_mean"], 2.0)


def test_sequence_level_ratio_is_the_exp_of_the_masked_mean_log_ratio():
    # TRL: log_w = sum(log_ratio * mask) / clamp(sum(mask), 1) per row.
    # log ratios [ln 2, 0] -> mean ln2/2 -> ratio sqrt(2) = 1.414 > 1.2; A = -1 keeps it:
    # loss = -min(-sqrt2, -1.2) = sqrt(2)
    logp, old, adv, mask = one_row([2.0, 1.0], -1.0)
    loss, _ = policy_loss(logp, old, None, adv, mask, importance_sampling_level="sequence")
    close(loss, math.sqrt(2.0))


def test_batch_scaled_advantages_use_the_std_of_the_rewards():
    # TRL scale_rewards="batch": (r - group mean) / (nanstd(rewards) + 1e-4), nanstd unbiased.
    # rewards [0, 1, 1, 1], G = 2: centred [-0.5, 0.5, 0, 0];
    # reward mean 0.75, squared deviations 0.5625 + 3 * 0.0625 = 0.75, / 3 = 0.25 -> std 0.5
    adv = group_advantages(torch.tensor([0.0, 1.0, 1.0, 1.0]), 2, scale="batch")
    d = 0.5 + 1e-4
    close(adv, [-0.5 / d, 0.5 / d, 0.0, 0.0])


def test_dr_grpo_uses_the_local_row_count_times_max_completion_length():
    # TRL: sum(loss_t * mask) / (B * max_completion_length); on-policy loss_t = -A = -1.
    # 2 tokens, B = 1, max_completion_length 8 -> -2 / 8
    logp, _, adv, mask = one_row([1.0, 1.0], 1.0)
    loss, _ = policy_loss(logp, None, None, adv, mask, loss_type="dr_grpo", max_completion_length=8)
    close(loss, -0.25)

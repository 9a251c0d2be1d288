"""Hand-worked values of policy_loss for every loss type and option.

Shared fixture (B = 2, T = 3), row 1's last token is padding:

    logp   = [[-1, -2, -0.5], [-1, -3, -7]]
    ratio  = [[ 1, 1.5, 0.5], [0.5, 1.5, 9]]      (old_logp = logp - ln ratio)
    A      = [1, -2]
    mask   = [[1, 1, 1], [1, 1, 0]]

Clipped per-token loss -min(r*A, clamp(r, 0.8, 1.2)*A) with epsilon 0.2:
    row 0 (A =  1): r=1 -> -1 ; r=1.5 -> -min(1.5, 1.2) = -1.2 ; r=0.5 -> -min(0.5, 0.8) = -0.5
                    sum -2.7, mean -0.9
    row 1 (A = -2): r=0.5 -> -min(-1, -1.6) = 1.6 ; r=1.5 -> -min(-3, -2.4) = 3
                    sum 4.6, mean 2.3
    masked sum 1.9 over 5 tokens.
"""

import math

import pytest
import torch

from fastgrpo.algo import policy_loss

LN2 = math.log(2.0)


def make_batch(ratio=None):
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -3.0, -7.0]], requires_grad=True)
    if ratio is None:
        ratio = torch.tensor([[1.0, 1.5, 0.5], [0.5, 1.5, 9.0]])
    old_logp = logp.detach() - ratio.log()
    advantages = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return logp, old_logp, advantages, mask


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


# --- loss types -------------------------------------------------------------------------------


def test_grpo_averages_per_sequence_token_means():
    logp, old, adv, mask = make_batch()
    loss, _ = policy_loss(logp, old, None, adv, mask, loss_type="grpo")
    close(loss, (-0.9 + 2.3) / 2)  # 0.7


def test_grpo_gradient_is_zero_on_clipped_tokens_and_minus_ratio_times_advantage_elsewhere():
    # unclipped d/dlogp of -r*A is -r*A, divided by (len * B):
    # row 0: r=1 -> -1/6 ; r=1.5 clipped high -> 0 ; r=0.5 -> -0.5/6
    # row 1: r=0.5 clipped low -> 0 ; r=1.5 -> -(1.5)(-2)/(2*2) = 0.75 ; padding -> 0
    logp, old, adv, mask = make_batch()
    policy_loss(logp, old, None, adv, mask, loss_type="grpo")[0].backward()
    close(logp.grad, [[-1 / 6, 0.0, -0.5 / 6], [0.0, 0.75, 0.0]])


def test_bnpo_divides_the_masked_token_sum_by_the_token_count():
    logp, old, adv, mask = make_batch()
    close(policy_loss(logp, old, None, adv, mask, loss_type="bnpo")[0], 1.9 / 5)  # 0.38


def test_dapo_with_symmetric_epsilon_equals_bnpo():
    logp, old, adv, mask = make_batch()
    close(policy_loss(logp, old, None, adv, mask, loss_type="dapo")[0], 1.9 / 5)


def test_dapo_with_a_wider_upper_epsilon_lets_positive_advantage_ratios_grow():
    # epsilon_high 0.6 -> upper bound 1.6: row 0 r=1.5 now -1.5 (was -1.2); row 0 sum -3.0
    # row 1 r=1.5 with A<0: -min(-3, -3) = 3 ; r=0.5 still clipped low at 0.8 -> 1.6 ; sum 4.6
    logp, old, adv, mask = make_batch()
    loss, metrics = policy_loss(logp, old, None, adv, mask, loss_type="dapo", epsilon_high=0.6)
    close(loss, (-3.0 + 4.6) / 5)  # 0.32
    close(metrics["clip_ratio/high_mean"], 0.0)  # 1.5 < 1.6
    close(metrics["clip_ratio/low_mean"], 0.2)  # row 1, r=0.5 < 0.8 with A<0


def test_a_wider_lower_epsilon_stops_clipping_negative_advantage_low_ratios():
    # epsilon_low 0.6, epsilon_high 0.2 -> bounds [0.4, 1.2]
    # row 0: -1, -1.2, -0.5 (sum -2.7) ; row 1: r=0.5 -> -min(-1, -1) = 1 ; r=1.5 -> 3 (sum 4)
    logp, old, adv, mask = make_batch()
    loss, metrics = policy_loss(
        logp, old, None, adv, mask, loss_type="bnpo", epsilon_low=0.6, epsilon_high=0.2
    )
    close(loss, (-2.7 + 4.0) / 5)  # 0.26
    close(metrics["clip_ratio/low_mean"], 0.0)
    close(metrics["clip_ratio/high_mean"], 0.2)


def test_dr_grpo_divides_by_batch_size_times_max_completion_length():
    logp, old, adv, mask = make_batch()
    loss, _ = policy_loss(logp, old, None, adv, mask, loss_type="dr_grpo", max_completion_length=4)
    close(loss, 1.9 / (2 * 4))  # 0.2375


def test_clip_metrics_count_low_and_high_clipped_tokens_over_masked_tokens():
    # low: row 1 r=0.5 with A<0 ; high: row 0 r=1.5 with A>0 ; padding (r=9) ignored
    # ratio_mean = (1 + 1.5 + 0.5 + 0.5 + 1.5) / 5 = 1
    logp, old, adv, mask = make_batch()
    _, metrics = policy_loss(logp, old, None, adv, mask)
    close(metrics["clip_ratio/low_mean"], 0.2)
    close(metrics["clip_ratio/high_mean"], 0.2)
    close(metrics["clip_ratio/region_mean"], 0.4)
    close(metrics["ratio_mean"], 1.0)
    assert set(metrics) == {
        "ratio_mean",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
    }
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_delta_caps_the_unclipped_ratio_of_negative_advantage_tokens():
    # delta 1.4: row 1 r=1.5, A=-2: coef_1 -> 1.4, -min(-2.8, -2.4) = 2.8 ; row 1 mean (1.6+2.8)/2
    # row 0 r=1.5, A=1: -min(1.4, 1.2) = -1.2 unchanged ; grpo = (-0.9 + 2.2) / 2 = 0.65
    logp, old, adv, mask = make_batch()
    loss, _ = policy_loss(logp, old, None, adv, mask, delta=1.4)
    close(loss, 0.65)
    loss.backward()
    # the capped token has no gradient any more (was 0.75 without delta)
    close(logp.grad, [[-1 / 6, 0.0, -0.5 / 6], [0.0, 0.0, 0.0]])


# --- sequence-level ratio (GSPO) --------------------------------------------------------------

# log ratios: row 0 [0.6, 0, -0.3] -> mean 0.1 ; row 1 [0.9, 0.3, pad] -> mean 0.6
SEQ_RATIO = torch.tensor([[0.6, 0.0, -0.3], [0.9, 0.3, 5.0]]).exp()


def test_gspo_uses_one_ratio_per_sequence_from_the_mean_log_ratio():
    # row 0: s = e^0.1 = 1.105 inside [0.8, 1.2], A=1 -> every token -e^0.1, mean -e^0.1
    # row 1: s = e^0.6 = 1.822 > 1.2 but A<0 so min keeps it: 2 e^0.6 per token
    # gspo = (-e^0.1 + 2 e^0.6) / 2 = 1.269534
    logp, old, adv, mask = make_batch(SEQ_RATIO)
    loss, metrics = policy_loss(logp, old, None, adv, mask, loss_type="gspo")
    close(loss, (-math.exp(0.1) + 2 * math.exp(0.6)) / 2)
    # ratio_mean is token-weighted: (3 e^0.1 + 2 e^0.6) / 5
    close(metrics["ratio_mean"], (3 * math.exp(0.1) + 2 * math.exp(0.6)) / 5)
    loss.backward()
    # d s/d logp_t = s / len: row 0 -> -e^0.1 / 3 / 2 ; row 1 -> 2 * e^0.6 / 2 / 2
    g0, g1 = -math.exp(0.1) / 6, math.exp(0.6) / 2
    close(logp.grad, [[g0, g0, g0], [g1, g1, 0.0]])


def test_grpo_with_sequence_level_sampling_equals_gspo():
    logp, old, adv, mask = make_batch(SEQ_RATIO)
    gspo, _ = policy_loss(logp, old, None, adv, mask, loss_type="gspo")
    seq, _ = policy_loss(logp, old, None, adv, mask, importance_sampling_level="sequence")
    close(seq, gspo.item())


def test_sequence_level_ratio_with_dapo_weights_sequences_by_length():
    # (3 tokens * -e^0.1 + 2 tokens * 2 e^0.6) / 5
    logp, old, adv, mask = make_batch(SEQ_RATIO)
    loss, _ = policy_loss(
        logp, old, None, adv, mask, loss_type="dapo", importance_sampling_level="sequence"
    )
    close(loss, (-3 * math.exp(0.1) + 4 * math.exp(0.6)) / 5)


# --- CISPO ------------------------------------------------------------------------------------


def test_cispo_weights_logp_by_the_detached_ratio_capped_at_epsilon_high():
    # cap 1.3: weights row 0 [1, 1.3, 0.5], row 1 [0.5, 1.3]
    # row 0: -w * 1 * logp = [1, 2.6, 0.25]       sum  3.85
    # row 1: -w * -2 * logp = 2w * [-1, -3] = [-1, -7.8]  sum -8.8
    # loss = (3.85 - 8.8) / 5 = -0.99 ; grad = -w * A / 5 (no lower clip: row 1 r=0.5 still moves)
    logp, old, adv, mask = make_batch()
    loss, metrics = policy_loss(logp, old, None, adv, mask, loss_type="cispo", epsilon_high=1.3)
    close(loss, -0.99)
    loss.backward()
    close(logp.grad, [[-0.2, -0.26, -0.1], [0.2, 0.52, 0.0]])
    close(metrics["clip_ratio/high_mean"], 0.2)  # row 0 r=1.5 > 1.3 with A>0
    close(metrics["clip_ratio/low_mean"], 0.0)
    close(metrics["clip_ratio/region_mean"], 0.2)


def test_cispo_cap_falls_back_to_epsilon_low_when_epsilon_high_is_none():
    # cap 0.2 caps every ratio: row 0: 0.2 * [1, 2, 0.5] sum 0.7 ; row 1: 0.4 * [-1, -3] sum -1.6
    logp, old, adv, mask = make_batch()
    loss, _ = policy_loss(logp, old, None, adv, mask, loss_type="cispo")
    close(loss, (0.7 - 1.6) / 5)  # -0.18


# --- truncated importance sampling ------------------------------------------------------------


def test_tis_multiplies_each_token_loss_by_the_capped_old_over_sampling_ratio():
    # is = exp(old - sampling) = [[3 -> 2 (cap), 0.5, 1], [1, 1, pad]]
    # row 0: [-1*2, -1.2*0.5, -0.5*1] = [-2, -0.6, -0.5] mean -3.1/3 ; row 1 mean 2.3
    # grpo = (-31/30 + 69/30) / 2 = 19/30 ; is_ratio_mean = (2 + 0.5 + 1 + 1 + 1) / 5 = 1.1
    logp, old, adv, mask = make_batch()
    is_ratio = torch.tensor([[3.0, 0.5, 1.0], [1.0, 1.0, 50.0]])
    sampling = old - is_ratio.log()
    loss, metrics = policy_loss(logp, old, None, adv, mask, sampling_logp=sampling)
    close(loss, 19 / 30)
    close(metrics["is_ratio_mean"], 1.1)
    loss.backward()
    # row 0 token 0: -r * A * is / (3 * 2) = -2/6 ; token 2: -0.5 * 1 / 6 ; row 1 token 1: 0.75
    close(logp.grad, [[-1 / 3, 0.0, -0.5 / 6], [0.0, 0.75, 0.0]])


def test_tis_cap_can_be_raised():
    # cap 2.5: row 0 = [-2.5, -0.6, -0.5] mean -1.2 ; grpo = (-1.2 + 2.3) / 2 = 0.55
    logp, old, adv, mask = make_batch()
    sampling = old - torch.tensor([[3.0, 0.5, 1.0], [1.0, 1.0, 50.0]]).log()
    loss, metrics = policy_loss(
        logp, old, None, adv, mask, sampling_logp=sampling, importance_sampling_cap=2.5
    )
    close(loss, 0.55)
    close(metrics["is_ratio_mean"], (2.5 + 0.5 + 1 + 1 + 1) / 5)


# --- KL penalty -------------------------------------------------------------------------------

# d = logp - ref: row 0 [ln2, -ln2, 0], row 1 [ln2, 0, pad]
# k3 = [[ln2 - 0.5, 1 - ln2, 0], [ln2 - 0.5, 0]] : row 0 sum 0.5, row 1 sum ln2 - 0.5


def make_ref(logp):
    return logp.detach() - torch.tensor([[LN2, -LN2, 0.0], [LN2, 0.0, 3.0]])


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        # row means: k3 [0.5/3, (ln2-0.5)/2] ; k1 [0, ln2/2] ; k2 [ln2^2/3, ln2^2/4]
        ("k3", 0.1 * (0.5 / 3 + (LN2 - 0.5) / 2) / 2),
        ("k1", 0.1 * (0.0 + LN2 / 2) / 2),
        ("k2", 0.1 * (LN2**2 / 3 + LN2**2 / 4) / 2),
    ],
)
def test_beta_adds_the_chosen_kl_estimator_to_every_token(estimator, expected):
    logp, _, _, mask = make_batch()
    zero_adv = torch.zeros(2)
    loss, metrics = policy_loss(
        logp, None, make_ref(logp), zero_adv, mask, beta=0.1, kl_estimator=estimator
    )
    close(loss, expected)
    assert "kl" in metrics


def test_kl_metric_is_the_masked_token_mean_of_the_estimator():
    # k3 masked sum = 0.5 + (ln2 - 0.5) = ln2 over 5 tokens
    logp, _, _, mask = make_batch()
    _, metrics = policy_loss(logp, None, make_ref(logp), torch.zeros(2), mask, beta=0.1)
    close(metrics["kl"], LN2 / 5)


def test_kl_is_added_after_the_clipped_surrogate():
    # bnpo: 1.9/5 from the surrogate + 0.1 * ln2/5 from k3
    logp, old, adv, mask = make_batch()
    loss, _ = policy_loss(logp, old, make_ref(logp), adv, mask, loss_type="bnpo", beta=0.1)
    close(loss, 1.9 / 5 + 0.1 * LN2 / 5)


def test_reference_without_beta_is_logged_but_does_not_change_the_loss():
    logp, old, adv, mask = make_batch()
    loss, metrics = policy_loss(logp, old, make_ref(logp), adv, mask)
    close(loss, 0.7)
    close(metrics["kl"], LN2 / 5)


# --- entropy bonus ----------------------------------------------------------------------------

ENTROPY = [[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]]


@pytest.mark.parametrize(
    ("loss_type", "expected"),
    [
        ("grpo", -0.1 * (2.0 + 4.5) / 2),  # row means 2 and 4.5
        ("bnpo", -0.1 * 15 / 5),  # masked sum 1+2+3+4+5 = 15
        ("dr_grpo", -0.1 * 15 / (2 * 4)),
    ],
)
def test_entropy_bonus_is_subtracted_and_aggregated_like_the_loss(loss_type, expected):
    logp, _, _, mask = make_batch()
    entropy = torch.tensor(ENTROPY, requires_grad=True)
    loss, metrics = policy_loss(
        logp,
        None,
        None,
        torch.zeros(2),
        mask,
        loss_type=loss_type,
        max_completion_length=4,
        entropy=entropy,
        entropy_coef=0.1,
    )
    close(loss, expected)
    close(metrics["entropy"], 3.0)  # 15 / 5


def test_entropy_bonus_gradient_flows_into_entropy():
    # grpo: d loss / d entropy = -0.1 / (len * B): row 0 -0.1/6, row 1 -0.1/4, padding 0
    logp, _, _, mask = make_batch()
    entropy = torch.tensor(ENTROPY, requires_grad=True)
    loss, _ = policy_loss(logp, None, None, torch.zeros(2), mask, entropy=entropy, entropy_coef=0.1)
    loss.backward()
    close(entropy.grad, [[-0.1 / 6] * 3, [-0.1 / 4, -0.1 / 4, 0.0]])


def test_entropy_without_coefficient_is_only_logged():
    logp, old, adv, mask = make_batch()
    loss, metrics = policy_loss(logp, old, None, adv, mask, entropy=torch.tensor(ENTROPY))
    close(loss, 0.7)
    close(metrics["entropy"], 3.0)


# --- validation -------------------------------------------------------------------------------


def call(**overrides):
    logp, old, adv, mask = make_batch()
    args = {"logp": logp, "old_logp": old, "ref_logp": None, "advantages": adv, "mask": mask}
    args.update(overrides)
    return policy_loss(**args)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loss_type": "ppo"}, "grpo, bnpo, dr_grpo, dapo, gspo, cispo"),
        ({"ref_logp": torch.zeros(2, 3), "kl_estimator": "k9"}, "k1, k2, k3"),
        ({"importance_sampling_level": "batch"}, "token, sequence"),
        ({"old_logp": torch.zeros(2, 4)}, r"old_logp must have shape \(B, T\) = \(2, 3\)"),
        ({"ref_logp": torch.zeros(3, 3)}, "ref_logp must have shape"),
        ({"mask": torch.ones(2, 2)}, "mask must have shape"),
        ({"entropy": torch.ones(2)}, "entropy must have shape"),
        ({"sampling_logp": torch.ones(1, 3)}, "sampling_logp must have shape"),
        ({"advantages": torch.ones(2, 1)}, r"advantages must have shape \(B,\)"),
        ({"logp": torch.zeros(6)}, "logp must be a floating"),
        ({"beta": 0.1}, "ref_logp is required"),
        ({"entropy_coef": 0.1}, "entropy is required"),
        ({"epsilon_low": -0.1}, "epsilon_low"),
        ({"epsilon_low": 1.5}, "epsilon_low"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"loss_type": "cispo", "epsilon_high": 0.0}, "epsilon_high"),
        ({"delta": 1.0}, "delta"),
        ({"loss_type": "dr_grpo"}, "max_completion_length"),
        ({"num_sequences": 0}, "num_sequences"),
        ({"num_tokens": 0}, "num_tokens"),
        ({"importance_sampling_cap": 0.0}, "importance_sampling_cap"),
    ],
)
def test_invalid_arguments_raise_value_errors_that_name_the_problem(overrides, message):
    with pytest.raises(ValueError, match=message):
        call(**overrides)

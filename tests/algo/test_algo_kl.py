"""Hand-worked checks of the per-token KL estimators."""

import math

import pytest
import torch

from fastgrpo.algo import KL_ESTIMATORS, kl_penalty

LN2 = math.log(2.0)
# d = logp - ref_logp = [0, ln 2, -ln 2]
LOGP = torch.tensor([[-1.0, -1.0 + LN2, -1.0 - LN2]])
REF = torch.tensor([[-1.0, -1.0, -1.0]])


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


def test_k1_is_the_plain_log_ratio():
    close(kl_penalty(LOGP, REF, "k1"), [[0.0, LN2, -LN2]])


def test_k2_is_half_the_squared_log_ratio():
    close(kl_penalty(LOGP, REF, "k2"), [[0.0, 0.5 * LN2**2, 0.5 * LN2**2]])


def test_k3_is_exp_minus_log_ratio_plus_log_ratio_minus_one():
    # d = ln2:  exp(-ln2) + ln2 - 1 = 0.5 - 1 + ln2 = 0.193147
    # d = -ln2: exp(ln2) - ln2 - 1  = 2 - 1 - ln2   = 0.306853
    close(kl_penalty(LOGP, REF, "k3"), [[0.0, LN2 - 0.5, 1.0 - LN2]])


def test_k3_is_the_default_estimator():
    close(kl_penalty(LOGP, REF), [[0.0, LN2 - 0.5, 1.0 - LN2]])


def test_gradients_of_each_estimator_with_respect_to_logp():
    # d/dlogp: k1 -> 1 ; k2 -> d ; k3 -> 1 - exp(-d)  (= 0, 0.5, -1 at d = 0, ln2, -ln2)
    expected = {"k1": [[1.0, 1.0, 1.0]], "k2": [[0.0, LN2, -LN2]], "k3": [[0.0, 0.5, -1.0]]}
    for name in KL_ESTIMATORS:
        logp = LOGP.clone().requires_grad_(True)
        kl_penalty(logp, REF, name).sum().backward()
        close(logp.grad, expected[name])


def test_unknown_estimator_and_shape_mismatch_raise_value_error():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(LOGP, REF, "k4")
    with pytest.raises(ValueError, match="same shape"):
        kl_penalty(LOGP, REF[:, :2], "k3")

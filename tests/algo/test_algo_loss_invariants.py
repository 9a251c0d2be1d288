"""Invariants of policy_loss that must hold for every loss type (random but seeded inputs)."""

import pytest
import torch

from fastgrpo.algo import LOSS_TYPES, policy_loss

B, T, L = 4, 5, 6  # rows, columns, max_completion_length (for dr_grpo)
LENGTHS = [5, 2, 4, 1]  # completion length of each row


def make_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)  # (B, T) bool
    logp = -torch.rand(B, T, generator=g) * 3 - 0.1  # (B, T)
    old = logp - (torch.rand(B, T, generator=g) - 0.5) * 0.8  # ratios spread over ~[0.67, 1.5]
    ref = logp - (torch.rand(B, T, generator=g) - 0.5)
    sampling = old - (torch.rand(B, T, generator=g) - 0.5) * 2.0  # is-ratios over ~[0.37, 2.7]
    entropy = torch.rand(B, T, generator=g) * 2
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    return {
        "logp": logp,
        "old_logp": old,
        "ref_logp": ref,
        "advantages": adv,
        "mask": mask,
        "sampling_logp": sampling,
        "entropy": entropy,
    }


def options(loss_type):
    return {
        "loss_type": loss_type,
        "beta": 0.05,
        "epsilon_high": 3.0 if loss_type == "cispo" else 0.28,
        "max_completion_length": L,
        "entropy_coef": 0.01,
    }


def loss_and_grads(inputs, **kwargs):
    logp = inputs["logp"].clone().requires_grad_(True)
    entropy = inputs["entropy"].clone().requires_grad_(True)
    loss, metrics = policy_loss(**{**inputs, "logp": logp, "entropy": entropy}, **kwargs)
    loss.backward()
    return loss.detach(), logp.grad, entropy.grad, metrics


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_zero_advantages_without_kl_or_entropy_give_zero_gradient(loss_type):
    inputs = make_inputs()
    inputs["advantages"] = torch.zeros(B)
    logp = inputs["logp"].clone().requires_grad_(True)
    loss, _ = policy_loss(
        logp,
        inputs["old_logp"],
        None,
        inputs["advantages"],
        inputs["mask"],
        loss_type=loss_type,
        max_completion_length=L,
    )
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logp.grad) == 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_padded_columns_with_garbage_change_neither_loss_nor_gradients(loss_type):
    inputs = make_inputs()
    base_loss, base_grad, base_egrad, base_metrics = loss_and_grads(inputs, **options(loss_type))
    pad = 3
    garbage = {
        "logp": 50.0,
        "old_logp": -1e4,
        "ref_logp": float("inf"),
        "sampling_logp": float("nan"),
        "entropy": 1e6,
    }
    padded = {
        "advantages": inputs["advantages"],
        "mask": torch.cat([inputs["mask"], torch.zeros(B, pad, dtype=torch.bool)], 1),
    }
    for name, value in garbage.items():
        padded[name] = torch.cat([inputs[name], torch.full((B, pad), value)], 1)
    loss, grad, egrad, metrics = loss_and_grads(padded, **options(loss_type))
    torch.testing.assert_close(loss, base_loss)
    torch.testing.assert_close(grad[:, :T], base_grad)
    torch.testing.assert_close(egrad[:, :T], base_egrad)
    assert torch.count_nonzero(grad[:, T:]) == 0 and torch.count_nonzero(egrad[:, T:]) == 0
    for key, value in base_metrics.items():
        torch.testing.assert_close(metrics[key], value)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("split", [(1, 3), (2, 2), (3, 1), (1, 1, 2)])
def test_micro_batches_with_global_normalisers_sum_to_the_full_batch_loss_and_gradient(
    loss_type, split
):
    inputs = make_inputs(seed=1)
    kwargs = options(loss_type)
    full_loss, full_grad, full_egrad, _ = loss_and_grads(inputs, **kwargs)

    logp = inputs["logp"].clone().requires_grad_(True)
    entropy = inputs["entropy"].clone().requires_grad_(True)
    num_tokens = int(inputs["mask"].sum())  # 5 + 2 + 4 + 1 = 12
    total, start = torch.zeros(()), 0
    for size in split:
        rows = slice(start, start + size)
        micro = {k: v[rows] for k, v in inputs.items()}
        micro.update(logp=logp[rows], entropy=entropy[rows])
        loss, _ = policy_loss(**micro, **kwargs, num_sequences=B, num_tokens=num_tokens)
        loss.backward()
        total = total + loss.detach()
        start += size
    torch.testing.assert_close(total, full_loss)
    torch.testing.assert_close(logp.grad, full_grad)
    torch.testing.assert_close(entropy.grad, full_egrad)


def test_num_tokens_may_be_a_tensor():
    inputs = make_inputs()
    a, *_ = loss_and_grads(inputs, **options("dapo"), num_tokens=torch.tensor(12.0))
    b, *_ = loss_and_grads(inputs, **options("dapo"), num_tokens=12)
    torch.testing.assert_close(a, b)


def test_float_mask_of_zeros_and_ones_equals_bool_mask():
    inputs = make_inputs()
    as_bool, grad_bool, *_ = loss_and_grads(inputs, **options("grpo"))
    inputs["mask"] = inputs["mask"].float()
    as_float, grad_float, *_ = loss_and_grads(inputs, **options("grpo"))
    torch.testing.assert_close(as_float, as_bool)
    torch.testing.assert_close(grad_float, grad_bool)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("same_as_logp", [False, True])
def test_ratio_is_exactly_one_on_policy(loss_type, same_as_logp):
    inputs = make_inputs()
    old = inputs["logp"].clone() if same_as_logp else None
    _, metrics = policy_loss(
        inputs["logp"].requires_grad_(True),
        old,
        None,
        inputs["advantages"],
        inputs["mask"],
        loss_type=loss_type,
        max_completion_length=L,
        epsilon_high=0.5 if loss_type == "cispo" else None,
    )
    assert metrics["ratio_mean"].item() == 1.0
    if loss_type != "cispo":  # cispo's cap 0.5 < 1 clips every positive-advantage token
        assert metrics["clip_ratio/region_mean"].item() == 0.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_grpo_gradient_is_the_policy_gradient_minus_a_over_length(level):
    # at ratio 1 nothing is clipped and d(-r*A)/dlogp = -A, so grad = -A_b / (len_b * B)
    inputs = make_inputs()
    logp = inputs["logp"].clone().requires_grad_(True)
    loss, _ = policy_loss(
        logp, None, None, inputs["advantages"], inputs["mask"], importance_sampling_level=level
    )
    loss.backward()
    lengths = torch.tensor(LENGTHS, dtype=torch.float32).unsqueeze(1)
    expected = -inputs["advantages"].unsqueeze(1) / (lengths * B) * inputs["mask"]
    torch.testing.assert_close(logp.grad, expected)


def test_on_policy_loss_value_is_minus_the_mean_advantage_for_grpo():
    # every token's loss is -A_b, so each sequence mean is -A_b: -(1 - 0.5 + 2 - 1.5) / 4 = -0.25
    inputs = make_inputs()
    loss, _ = policy_loss(inputs["logp"], None, None, inputs["advantages"], inputs["mask"])
    torch.testing.assert_close(loss, torch.tensor(-0.25))

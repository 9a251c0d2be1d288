"""Fused LM-head + GRPO loss against the reference: loss, log-probs and both gradients."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, LOSS_VARIANTS, ON_GPU, variant_id

from fastgrpo.algo import policy_loss
from fastgrpo.kernels.train import lm_head_chunk_grads as chunk_grads
from fastgrpo.kernels.train import lm_head_grpo_loss as fused
from fastgrpo.kernels.train.lm_head_logprob import lm_head_logprob_ref

pytestmark = pytest.mark.skipif(fused.triton is None, reason="needs triton")
VARIANTS = LOSS_VARIANTS


def _batch(seed, n_seq=3, t=5, h=32, v=151, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_seq * t, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) / h**0.5
    targets = torch.randint(0, v, (n_seq * t,), generator=gen)
    mask = torch.ones(n_seq, t)
    mask[0, 3:] = 0  # a short sequence
    mask[2, 1:] = 0  # T=1 in effect
    advantages = torch.tensor([1.0, -0.5, 0.0])[:n_seq]
    noise = torch.randn(n_seq * t, generator=gen, dtype=torch.float64) * 0.1
    return hidden.to(dtype), weight.to(dtype), targets, mask, advantages, noise


@pytest.mark.parametrize("settings", VARIANTS, ids=variant_id)
def test_reference_weighted_token_loss_equals_algo_policy_loss(settings):
    hidden, weight, targets, mask, advantages, noise = _batch(0, dtype=torch.float64)
    hidden.requires_grad_()
    logp, entropy = lm_head_logprob_ref(hidden, weight, targets, 0.8, with_entropy=True)
    old, ref = (logp.detach() + noise), (logp.detach() - noise)
    b, t = mask.shape
    want, _ = policy_loss(
        logp.view(b, t),
        old.view(b, t),
        ref.view(b, t),
        advantages,
        mask,
        entropy=entropy.view(b, t),
        max_completion_length=t,
        **settings,
    )
    weights = fused.token_weights(
        mask, settings["loss_type"], max_completion_length=t, dtype=torch.float64
    ).reshape(-1)
    got, _, _ = fused.lm_head_grpo_loss_ref(
        hidden,
        weight,
        targets,
        weights,
        advantages.repeat_interleave(t).double(),
        old_logp=old,
        ref_logp=ref,
        temperature=0.8,
        **settings,
    )
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    assert torch.allclose(
        torch.autograd.grad(got, hidden)[0], torch.autograd.grad(want, hidden)[0], atol=1e-10
    )


@pytest.mark.parametrize("settings", VARIANTS, ids=variant_id)
@pytest.mark.parametrize("chunk_rows", [4, 128])
def test_fused_loss_and_gradients_match_the_float64_reference(settings, chunk_rows):
    _check_fused_against_reference(settings, chunk_rows)


def test_fused_loss_with_rows_not_16_byte_aligned_matches_the_reference():
    _check_fused_against_reference(VARIANTS[2], 4, h=13)  # 13 x 4 bytes: padded buffers


@pytest.mark.parametrize("settings", VARIANTS[:2], ids=lambda s: s["loss_type"])
def test_fused_loss_with_torch_backward_gemms_matches_the_reference(monkeypatch, settings):
    monkeypatch.setattr(fused, "BACKWARD_GEMMS", "cublas")
    _check_fused_against_reference(settings, 4)


@pytest.mark.parametrize("settings", VARIANTS[:1] + VARIANTS[-1:], ids=variant_id)
def test_fused_loss_with_very_unlikely_targets_matches_the_reference(settings):
    """Rows whose target has p < 2^-60 are stored against their log-sum-exp instead of the
    target's logit (the relative form p / p_target would overflow); only their row blocks are
    recomputed, the other blocks keep the first pass's values."""
    _check_fused_against_reference(settings, 128, t=12, unlikely_rows=3)


def _check_fused_against_reference(settings, chunk_rows, h=32, t=5, unlikely_rows=0):
    hidden, weight, targets, mask, advantages, noise = _batch(1, h=h, t=t)
    if unlikely_rows:  # peaked rows whose target is their least likely token
        hidden[:unlikely_rows] *= 25
        targets[:unlikely_rows] = (hidden[:unlikely_rows] @ weight.t()).argmin(-1)
    t = mask.shape[1]
    weights = fused.token_weights(mask, settings["loss_type"], max_completion_length=t).reshape(-1)
    adv = advantages.repeat_interleave(t)
    with torch.no_grad():
        base, _ = lm_head_logprob_ref(hidden, weight, targets, 0.8)
    old, ref = (base + noise.float()), (base - noise.float())
    h, w = hidden.to(DEVICE).clone().requires_grad_(), weight.to(DEVICE).clone().requires_grad_()
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    loss, logp, entropy = fused.fused_token_loss(
        h,
        w,
        dev(targets),
        dev(weights),
        dev(adv),
        dev(old),
        dev(ref),
        None,
        0.8,
        chunk_rows,
        settings,
    )
    loss.backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want, want_logp, want_entropy = fused.lm_head_grpo_loss_ref(
        h64,
        w64,
        targets,
        weights.double(),
        adv.double(),
        old_logp=old.double(),
        ref_logp=ref.double(),
        temperature=0.8,
        **settings,
    )
    want.backward()
    if unlikely_rows:
        assert (want_logp[:unlikely_rows] < -60 * 0.6931).all()  # the case under test happens
        assert (want_logp[unlikely_rows:] > -60 * 0.6931).all()
    assert abs(loss.item() - want.item()) <= 1e-5 * max(abs(want.item()), 1e-3)
    assert (logp.cpu().double() - want_logp).abs().max() <= 1e-4
    assert (entropy.cpu().double() - want_entropy).abs().max() <= 1e-4
    assert torch.allclose(h.grad.cpu().double(), h64.grad, atol=1e-4, rtol=1e-3)
    assert torch.allclose(w.grad.cpu().double(), w64.grad, atol=1e-4, rtol=1e-3)


def _plain_grpo_loss(h, w, targets, mask, advantages):
    """The fused "grpo" loss of a `_batch` on the device (no old / ref log-probs, T = 1)."""
    t = mask.shape[1]
    weights = fused.token_weights(mask, "grpo").reshape(-1)
    loss, _, _ = fused.fused_token_loss(
        h,
        w,
        targets.to(DEVICE),
        weights.to(DEVICE),
        advantages.repeat_interleave(t).to(DEVICE),
        None,
        None,
        None,
        1.0,
        128,
        {"loss_type": "grpo"},
    )
    return loss


def test_frozen_weight_gets_no_gradient_and_masked_rows_none():
    hidden, weight, targets, mask, advantages, _ = _batch(2)
    t = mask.shape[1]
    h = hidden.to(DEVICE).clone().requires_grad_()
    _plain_grpo_loss(h, weight.to(DEVICE), targets, mask, advantages).backward()
    grad = h.grad.cpu().view(3, t, -1)
    assert (grad[0, 3:] == 0).all() and (grad[2] == 0).all()  # masked rows; zero advantage
    assert grad[1].abs().sum() > 0


def test_training_log_probs_are_bitwise_the_scoring_log_probs():
    from fastgrpo.kernels.train.lm_head_stats import lm_head_stats_triton

    hidden, weight, targets, mask, advantages, _ = _batch(3)
    t = mask.shape[1]
    args = [x.to(DEVICE) for x in (hidden, weight, targets)]
    scored, _, _ = lm_head_stats_triton(*args, 0.7)
    weights = fused.token_weights(mask, "grpo").reshape(-1).to(DEVICE)
    _, trained, _ = fused.fused_token_loss(
        *args,
        weights,
        advantages.repeat_interleave(t).to(DEVICE),
        None,
        None,
        None,
        0.7,
        4,
        {"loss_type": "grpo"},
    )
    assert torch.equal(scored, trained)


def test_fused_loss_works_inside_a_torch_compiled_caller():
    hidden, weight, targets, mask, advantages, _ = _batch(4)
    t = mask.shape[1]
    weights = fused.token_weights(mask, "grpo").reshape(-1).to(DEVICE)
    adv = advantages.repeat_interleave(t).to(DEVICE)
    targets = targets.to(DEVICE)

    def caller(h, w):
        loss, _, _ = fused.lm_head_grpo_loss(
            h, w, targets, weights, adv, fused=True, loss_type="grpo", beta=0.0
        )
        return loss * 2

    grads = []
    for fn in (caller, torch.compile(caller)):
        h = hidden.to(DEVICE).clone().requires_grad_()
        out = fn(h, weight.to(DEVICE))
        out.backward()
        grads.append((out.detach(), h.grad))
    assert torch.equal(grads[0][0], grads[1][0])
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-6)


@pytest.mark.parametrize("chunk_rows", [4, 128])
def test_two_pass_fused_path_matches_reference_for_sequence_level_gspo(chunk_rows):
    hidden, weight, targets, mask, advantages, noise = _batch(5)
    b, t = mask.shape
    keep = mask.bool()
    with torch.no_grad():
        base, _ = lm_head_logprob_ref(hidden, weight, targets, 0.9)
    old = (base + noise.float()).view(b, t)

    def gspo(logp, entropy):
        full = torch.zeros(b, t, dtype=logp.dtype, device=logp.device).masked_scatter(
            keep.to(logp.device), logp
        )
        ent = torch.zeros_like(full).masked_scatter(keep.to(logp.device), entropy)
        loss, _ = policy_loss(
            full,
            old.to(full),
            None,
            advantages.to(full),
            mask.to(full.device),
            entropy=ent,
            loss_type="gspo",
            epsilon_low=3e-4,
            epsilon_high=4e-4,
            entropy_coef=0.01,
        )
        return loss

    rows = keep.reshape(-1)
    h = hidden[rows].to(DEVICE).clone().requires_grad_()
    w = weight.to(DEVICE).clone().requires_grad_()
    loss, logp, _ = fused._fused_apply(
        h, w, targets[rows].to(DEVICE), 0.9, chunk_rows, None, gspo, None, True
    )
    loss.backward()
    h64, w64 = hidden[rows].double().requires_grad_(), weight.double().requires_grad_()
    want, want_logp, _ = fused.lm_head_policy_loss(
        h64, w64, targets[rows], gspo, temperature=0.9, fused=False
    )
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-5 * max(abs(want.item()), 1e-3)
    assert (logp.cpu().double() - want_logp).abs().max() <= 1e-4
    assert torch.allclose(h.grad.cpu().double(), h64.grad, atol=1e-4, rtol=1e-3)
    assert torch.allclose(w.grad.cpu().double(), w64.grad, atol=1e-4, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp32_dw", [True, False])
def test_bf16_gradients_within_twice_the_plain_bf16_error_across_chunks(monkeypatch, fp32_dw):
    """bf16 inputs, 4 chunks: dW summed in fp32, or in bf16 (one rounding per chunk), both within
    2x of the error of plain PyTorch in bf16 (bf16 logits, autograd) against float64."""
    if fp32_dw:
        monkeypatch.setattr(fused, "MAX_LOW_PRECISION_CHUNKS", 0)
    gen = torch.Generator(device="cuda").manual_seed(11)
    n, h, v, seq = 2048, 256, 32003, 128
    hidden = torch.randn(n, h, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=gen) * 2 / h**0.5).bfloat16()
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    adv = torch.randn(n // seq, device="cuda", generator=gen).repeat_interleave(seq)
    weights = torch.full((n,), 1.0 / n, device="cuda")
    settings = dict(loss_type="grpo", beta=0.04, kl_estimator="k3")
    old = -torch.rand(n, device="cuda", generator=gen) * 5 - 5
    ref = old + 0.05 * torch.randn(n, device="cuda", generator=gen)

    def grads(hid, w, fused_path):
        hid, w = hid.clone().requires_grad_(), w.clone().requires_grad_()
        if fused_path:
            loss = fused.fused_token_loss(
                hid, w, targets, weights, adv, old, ref, None, 1.0, 512, settings
            )[0]
        else:
            wide = torch.promote_types(hid.dtype, torch.float32)  # fp32, or fp64 for fp64
            logits = (hid @ w.t()).to(wide)  # bf16 logits on the plain bf16 path
            logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
            per = fused.per_token_loss(logp, old, ref, adv, None, None, **settings)
            loss = (weights.to(per.dtype) * per).sum()
        loss.backward()
        return hid.grad.double(), w.grad.double()

    want = grads(hidden.double(), weight.double(), False)
    got = grads(hidden, weight, True)
    plain = grads(hidden, weight, False)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    for g, p, w in zip(got, plain, want):
        assert rel(g, w) <= 2 * rel(p, w)


def test_second_backward_through_the_fused_loss_is_refused_clearly():
    hidden, weight, targets, mask, advantages, _ = _batch(4)
    h = hidden.to(DEVICE).requires_grad_()
    t = mask.shape[1]
    weights = fused.token_weights(mask, "grpo").reshape(-1).to(DEVICE)
    adv = advantages.repeat_interleave(t).to(DEVICE)
    loss, _, _ = fused.fused_token_loss(
        h, weight.to(DEVICE), targets.to(DEVICE), weights, adv, None, None, None, 1.0, 8, {}
    )
    (2 * loss).backward(retain_graph=True)
    first = h.grad.clone()
    with pytest.raises(RuntimeError, match="call backward once per forward"):
        loss.backward()
    # the gradient handed over was scaled by the incoming gradient (2), once
    h.grad = None
    again, _, _ = fused.fused_token_loss(
        h, weight.to(DEVICE), targets.to(DEVICE), weights, adv, None, None, None, 1.0, 8, {}
    )
    again.backward()
    assert torch.allclose(first, 2 * h.grad)


def test_backward_scaling_by_the_incoming_gradient():
    """The gradients are made in the forward call; backward multiplies them by the incoming
    gradient on the device, and leaves them untouched when it is exactly 1."""
    x = torch.randn(70, 13, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    same = chunk_grads.scale_by_(x.clone(), torch.ones((), device=DEVICE))
    assert torch.equal(same, x)
    half = chunk_grads.scale_by_(x.clone(), torch.full((), -0.5, device=DEVICE))
    assert torch.equal(half, x * -0.5)
    strided = torch.zeros(70, 16, device=DEVICE)
    strided[:, :13] = x
    chunk_grads.scale_by_(strided[:, :13], torch.full((), 3.0, device=DEVICE))
    assert torch.equal(strided[:, :13], x * 3.0) and (strided[:, 13:] == 0).all()


def test_fused_gradients_scale_with_the_loss():
    hidden, weight, targets, mask, advantages, _ = _batch(3)
    grads = []
    for factor in (1.0, -2.5):
        h = hidden.to(DEVICE).clone().requires_grad_()
        w = weight.to(DEVICE).clone().requires_grad_()
        (_plain_grpo_loss(h, w, targets, mask, advantages) * factor).backward()
        grads.append((h.grad, w.grad))
    assert grads[0][0].abs().sum() > 0
    assert torch.allclose(grads[1][0], grads[0][0] * -2.5, rtol=1e-6, atol=1e-9)
    assert torch.allclose(grads[1][1], grads[0][1] * -2.5, rtol=1e-6, atol=1e-9)

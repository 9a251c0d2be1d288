"""Rollout masks, log-prob consistency between sampling and training, and the LM-head reference."""

from __future__ import annotations

import pytest
import torch

from fastgrpo.kernels.train.lm_head_logprob import lm_head_logprob_ref
from fastgrpo.models import stop_token_ids
from fastgrpo.rollout import Rollout, completion_mask, generate_rollout
from fastgrpo.train.logprobs import completion_logprobs, trim_padding

STOP = 9


def test_completion_mask_keeps_tokens_through_the_first_stop_token():
    ids = torch.tensor([[5, 6, STOP, 7, STOP], [1, STOP, STOP, STOP, STOP]])
    mask, finished = completion_mask(ids, [STOP])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert finished.tolist() == [True, True]


def test_completion_mask_keeps_every_token_of_a_length_truncated_row():
    ids = torch.tensor([[5, 6, 7, 8], [STOP, 1, 2, 3]])
    mask, finished = completion_mask(ids, [STOP, 42])
    assert mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    assert finished.tolist() == [False, True]


def test_completion_mask_accepts_several_stop_ids():
    ids = torch.tensor([[5, 42, 7], [5, 6, STOP]])
    mask, finished = completion_mask(ids, [STOP, 42])
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert finished.all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rows", [1, 5])
def test_lm_head_logprob_ref_matches_float64_log_softmax(temperature, rows):
    torch.manual_seed(rows)
    hidden = torch.randn(rows, 24, dtype=torch.float64)
    weight = torch.randn(151, 24, dtype=torch.float64)  # odd vocabulary size
    targets = torch.randint(0, 151, (rows,))
    logp, entropy = lm_head_logprob_ref(
        hidden.float(), weight.float(), targets, temperature, with_entropy=True, chunk_rows=2
    )
    logits = hidden @ weight.t() / temperature
    want = torch.log_softmax(logits, -1)
    assert torch.allclose(logp.double(), want.gather(-1, targets[:, None]).squeeze(-1), atol=1e-5)
    want_entropy = -(want.exp() * want).sum(-1)
    assert torch.allclose(entropy.double(), want_entropy, atol=1e-5)


def test_lm_head_logprob_ref_gradient_matches_float64_autograd():
    torch.manual_seed(0)
    hidden = torch.randn(7, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(67, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 67, (7,))
    upstream = torch.randn(7, dtype=torch.float64)
    logp, _ = lm_head_logprob_ref(hidden, weight, targets, 0.8, chunk_rows=3)
    grads = torch.autograd.grad((logp * upstream).sum(), (hidden, weight))
    want = torch.log_softmax(hidden @ weight.t() / 0.8, -1).gather(-1, targets[:, None]).squeeze(-1)
    want_grads = torch.autograd.grad((want * upstream).sum(), (hidden, weight))
    for got, ref in zip(grads, want_grads):
        assert torch.allclose(got, ref, atol=1e-10)


def _rollout(model, tokenizer, temperature=1.0, with_sampling_logp=False, max_new_tokens=12):
    torch.manual_seed(1)
    prompts = [
        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    ]
    return generate_rollout(
        model,
        tokenizer,
        prompts,
        num_generations=3,
        max_new_tokens=max_new_tokens,
        stop_ids=stop_token_ids(tokenizer, model),
        temperature=temperature,
        with_sampling_logp=with_sampling_logp,
    )


def test_rollout_groups_rows_by_prompt_and_masks_after_the_stop(tiny_model):
    model, tokenizer = tiny_model
    rollout = _rollout(model, tokenizer)
    assert rollout.completion_ids.shape[0] == 6
    # rows 0-2 share prompt 0, rows 3-5 share prompt 1
    assert torch.equal(rollout.prompt_ids[0], rollout.prompt_ids[2])
    assert not torch.equal(rollout.prompt_ids[0], rollout.prompt_ids[3])
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for ids, mask, done in zip(rollout.completion_ids, rollout.completion_mask, rollout.finished):
        kept = ids[mask.bool()]
        assert (kept[:-1] != eos).all()  # no stop token before the last kept one
        assert bool(done) == bool(kept[-1] == eos)


def test_sampling_logprobs_match_trainer_logprobs_in_float32(tiny_model):
    model, tokenizer = tiny_model
    rollout = _rollout(model, tokenizer, temperature=0.7, with_sampling_logp=True)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, rollout, temperature=0.7)
    mask = rollout.completion_mask.bool()
    assert (logp[mask] < 0).all()
    assert torch.allclose(logp[mask], rollout.sampling_logp[mask], atol=1e-4)


def test_logprobs_with_and_without_grad_are_bitwise_equal(tiny_model):
    model, tokenizer = tiny_model
    rollout = trim_padding(_rollout(model, tokenizer))
    with torch.no_grad():
        scored, _ = completion_logprobs(model, rollout, temperature=1.0)
    trained, _ = completion_logprobs(model, rollout, temperature=1.0, with_entropy=True)
    assert trained.requires_grad
    assert torch.equal(scored, trained.detach())  # the PPO ratio is exactly 1 on-policy


def test_extra_padding_does_not_change_completion_logprobs(tiny_model):
    model, tokenizer = tiny_model
    rollout = trim_padding(_rollout(model, tokenizer))
    pad = tokenizer.pad_token_id
    b = rollout.prompt_ids.shape[0]
    padded = Rollout(
        torch.cat([torch.full((b, 5), pad), rollout.prompt_ids], 1),
        torch.cat([torch.zeros(b, 5, dtype=rollout.prompt_mask.dtype), rollout.prompt_mask], 1),
        torch.cat([rollout.completion_ids, torch.full((b, 4), pad)], 1),
        torch.cat([rollout.completion_mask, torch.zeros(b, 4)], 1),
        rollout.finished,
    )
    with torch.no_grad():
        base, _ = completion_logprobs(model, rollout)
        more, _ = completion_logprobs(model, padded)
    assert torch.allclose(base, more[:, : base.shape[1]], atol=1e-5)
    assert (more[:, base.shape[1] :] == 0).all()


def test_reference_scoring_over_merged_micro_batches_gives_each_micro_batchs_logprobs(tiny_model):
    """`scoring.score_groups` runs several training micro-batches (different widths after trimming) as
    one forward; each gets the log-probs its own forward gives, in its own width."""
    from fastgrpo.train.batching import MicroBatch
    from fastgrpo.train.scoring import score_groups

    model, tokenizer = tiny_model
    rollout = _rollout(model, tokenizer, with_sampling_logp=True)
    micro = [
        MicroBatch(trim_padding(rollout.rows(rows)), torch.ones(len(rows)))
        for rows in ([0, 1], [3], [2, 4, 5])
    ]
    got = score_groups(model, micro, 40_000, 0.7, fused=False)  # all three fit one forward
    assert len(got) == 3
    for mb, logp in zip(micro, got):
        with torch.no_grad():
            want, _ = completion_logprobs(model, mb.rollout, temperature=0.7)
        assert logp.shape == want.shape
        torch.testing.assert_close(logp, want, rtol=0, atol=1e-5)
    # one forward per micro-batch: the same values
    for a, b in zip(score_groups(model, micro, 1, 0.7, fused=False), got):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_shared_prompts_give_the_per_row_logprobs_and_gradients(tiny_model):
    """`pack_rows` packs each prompt once for its rows; log-probs and parameter gradients equal
    those of a forward that copies the prompt into every row, rows keeping one token or none
    included, and the shared forward feeds each prompt's tokens once."""
    from fastgrpo.train.logprobs import pack_rows

    model, tokenizer = tiny_model
    rollout = trim_padding(_rollout(model, tokenizer, max_new_tokens=8))
    mask = rollout.completion_mask.clone()
    mask[1] = 0  # keeps nothing: not fed at all
    mask[4, 1:] = 0  # keeps one token: predicted by its prompt's last token only
    rollout = Rollout(
        rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, mask, rollout.finished
    )
    results = []
    for share in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("fastgrpo.train.logprobs.SHARE_PROMPTS", share)
            model.zero_grad()
            logp, entropy = completion_logprobs(model, rollout, with_entropy=True)
            (logp.sum() + entropy.sum()).backward()
        results.append((logp.detach(), [p.grad.clone() for p in model.parameters()]))
    (shared, shared_grads), (copied, copied_grads) = results
    torch.testing.assert_close(shared, copied, rtol=0, atol=1e-5)
    assert (shared[1] == 0).all() and (shared[4, 1:] == 0).all() and shared[4, 0] < 0
    for a, b in zip(shared_grads, copied_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

    prompt_len = rollout.prompt_mask.sum(-1)
    fed = mask.sum(-1) - 1  # completion tokens fed per row
    live = fed >= 0
    layouts = [pack_rows(rollout.prompt_ids, rollout.prompt_mask, mask, s) for s in (True, False)]
    # rows 0, 2 share prompt 0 (row 1 is not fed), rows 3-5 prompt 1
    want_shared = int(prompt_len[0] + prompt_len[3] + fed[live].sum())
    assert layouts[0].tokens.numel() == want_shared
    assert layouts[1].tokens.numel() == int((prompt_len + fed)[live].sum())
    assert layouts[1].keys is None and layouts[0].keys is not None

"""An fp32 model on a CUDA GPU (`model.dtype=float32`): the rollout engine generates and the trainer's
forward, fused LM-head loss and backward run, each against its PyTorch reference at fp32 tolerance.

The kernels were tuned for bf16; in fp32 each either runs with blocks that fit shared memory
(decode attention; the LM-head GEMMs in IEEE fp32, not TF32) or leaves the work to its reference
(the decode linears, the Gluon kernels). The model is SmolLM2-135M's shape (d 64, GQA 9/3, tied
49152-token vocabulary) with random weights at HF's initializer range.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig

from fastgrpo.kernels import support
from fastgrpo.kernels.train.lm_head_grpo_loss import lm_head_grpo_loss
from fastgrpo.kernels.train.lm_head_logprob import lm_head_logprob, lm_head_logprob_ref
from fastgrpo.models import transformer
from fastgrpo.models.transformer import ModelConfig, Transformer
from fastgrpo.rollout.engine import RolloutEngine
from fastgrpo.rollout.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
V = SMOLLM2_135M["vocab_size"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_hf(LlamaConfig(**SMOLLM2_135M)))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)  # logits of std ~0.5: a spread, not a one-hot, distribution
    model = model.cuda()
    model.pack_projections()  # as the trainer does: the engine's decode linears see packed weights
    return model


def packed(rows: list[list[int]]):
    """(tokens (T,), positions (T,), cu_seqlens (S + 1,), longest) of rows packed end to end."""
    sizes = [len(r) for r in rows]
    flat = torch.tensor([t for r in rows for t in r], device="cuda")
    positions = torch.cat([torch.arange(n, device="cuda") for n in sizes])
    cu = torch.tensor([0, *sizes], device="cuda").cumsum(0)
    return flat, positions, cu, max(sizes)


def test_fp32_rollout_gives_tokens_in_range_whose_log_probs_match_the_trainers(
    model, monkeypatch, caplog
):
    monkeypatch.setattr(support, "_noticed", set())
    prompts = [[(31 * p + 7 * i + 1) % V for i in range(5 + 9 * p)] for p in range(8)]
    engine = RolloutEngine(model, stop_ids=[V - 1], pad_id=0)
    out = engine.generate(prompts, num_samples=4, max_new_tokens=24, params=SamplingParams(1.0))
    # 32 rows x 3 kv heads: one wave, where bf16 decode attention takes its 256-key blocks
    assert out.tokens.shape == (32, 24) and out.logp.dtype == torch.float32
    assert ((out.tokens >= 0) & (out.tokens < V)).all()
    assert (out.lengths > 0).all() and len(set(out.tokens[:, 0].tolist())) > 8

    rows = [prompts[b // 4] + out.tokens[b, : int(out.lengths[b])].tolist() for b in range(32)]
    flat, positions, cu, longest = packed(rows)
    with torch.no_grad():
        hidden = model(flat, positions, model.packed_attention(cu, longest))  # (T, H)
        logits = model.logits(hidden).double()  # (T, V)
    want = torch.zeros_like(out.logp, dtype=torch.float64)
    for b in range(32):
        start, n = int(cu[b]) + len(prompts[b // 4]) - 1, int(out.lengths[b])
        logp = logits[start : start + n].log_softmax(-1)
        want[b, :n] = logp.gather(-1, out.tokens[b, :n, None]).squeeze(-1)
    mask = torch.arange(24, device="cuda") < out.lengths[:, None]
    error = (out.logp.double() - want)[mask].abs().max().item()
    assert error <= 1e-4, error  # fp32 throughout: bf16 would be ~1e-2
    assert math.isfinite(error) and (out.logp[mask] < 0).all()
    notices = [r.getMessage() for r in caplog.records if r.name == "fastgrpo.kernels"]
    assert any("decode_linear runs its PyTorch reference for float32" in n for n in notices)
    assert not any("decode attention" in n for n in notices), notices  # it fits, it serves


def _training_pass(model, flat, positions, cu, longest, targets, completion, advantages, fused):
    """(loss, logp, hidden, {name: grad}) of one forward and backward of the GRPO loss on the
    completion rows, fused (Triton training kernels + fused LM-head loss) or all PyTorch."""
    model.zero_grad(set_to_none=True)
    with pytest.MonkeyPatch.context() as patch:
        if not fused:
            patch.setattr(transformer, "use_train_kernels", lambda x: False)
        hidden = model(flat, positions, model.packed_attention(cu, longest))  # (T, H)
        rows = hidden[completion]  # (N, H)
        weights = torch.full((rows.shape[0],), 1.0 / rows.shape[0], device="cuda")
        loss, logp, _ = lm_head_grpo_loss(
            rows, model.lm_head_weight, targets, weights, advantages, fused=fused, beta=0.0
        )
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), logp.detach(), hidden.detach(), grads


def test_fp32_training_forward_and_fused_loss_backward_match_the_pytorch_path(model):
    gen = torch.Generator(device="cuda").manual_seed(1)
    sizes = [48, 33, 64, 17, 40, 56, 25, 60]
    rows = [torch.randint(0, V, (n,), device="cuda", generator=gen).tolist() for n in sizes]
    flat, positions, cu, longest = packed(rows)
    # the last 12 tokens of each row are its completion: rows predicting them, and their targets
    completion = torch.cat([torch.arange(int(e) - 13, int(e) - 1, device="cuda") for e in cu[1:]])
    targets = flat[completion + 1]
    advantages = torch.randn(len(sizes), generator=gen, device="cuda").repeat_interleave(12)

    args = (model, flat, positions, cu, longest, targets, completion, advantages)
    loss, logp, hidden, grads = _training_pass(*args, fused=True)
    want_loss, want_logp, want_hidden, want_grads = _training_pass(*args, fused=False)

    assert (hidden - want_hidden).abs().max() <= 1e-3  # final-norm outputs of std ~1
    assert (logp - want_logp).abs().max() <= 1e-4
    assert abs(loss - want_loss) <= 1e-5 + 1e-4 * abs(want_loss)
    assert grads.keys() == want_grads.keys() and len(grads) == len(list(model.parameters()))
    for name, grad in grads.items():
        want = want_grads[name]
        assert torch.isfinite(grad).all() and grad.abs().max() > 0, name
        error = ((grad - want).norm() / want.norm()).item()
        assert error <= 1e-3, (name, error)  # fp32 (IEEE, not TF32) on both paths


def test_fp32_scoring_asked_of_the_statistics_kernel_is_at_fp32_precision(model):
    """By default fp32 scoring takes the reference (cuBLAS is faster at the same precision);
    train.fused_lm_head=on asks for the kernel, which multiplies in IEEE fp32, not TF32."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    hidden = torch.randn(777, 576, device="cuda", generator=gen)
    targets = torch.randint(0, V, (777,), device="cuda", generator=gen)
    with torch.no_grad():
        logp, entropy = lm_head_logprob(hidden, model.lm_head_weight, targets, 0.7, True, True)
    want_logp, want_entropy = lm_head_logprob_ref(
        hidden.double(), model.lm_head_weight.double(), targets, 0.7, True
    )
    assert (logp.double() - want_logp).abs().max() <= 1e-4  # TF32 would be off by ~1e-2
    assert (entropy.double() - want_entropy).abs().max() <= 1e-4


def test_fp32_training_run_on_cuda_keeps_fp32_weights(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from fastgrpo.train import run_training
    from fastgrpo.train.checkpoint import latest_checkpoint

    overrides = [
        f"model.name={tiny_model_dir}",
        "model.device=cuda",
        "model.dtype=float32",
        f"run.output_dir={tmp_path / 'run'}",
        "run.progress=false",
        "train.steps=2",
        "rollout.prompts_per_step=2",
        "rollout.num_generations=4",
        "rollout.max_new_tokens=8",
        "eval.before=false",
        "eval.after=false",
        "algo.beta=0.04",
    ]
    result = run_training(None, overrides=overrides)
    assert result.steps == 2
    assert all(math.isfinite(record["loss"]) for record in result.history)
    saved = load_file(str(latest_checkpoint(tmp_path / "run") / "model" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in saved.values())

"""The trainer's fused forward (`DecoderLayer.forward_train`: differentiable add + RMSNorm, RoPE
and SiLU * up kernels, one GEMM for q/k/v and one for gate/up) against the PyTorch ops of
`DecoderLayer.forward`: hidden states and every parameter's gradient.

On a CPU the kernels run in Triton's interpreter, in fp32, where the two paths differ only in the
order of fp32 sums; on a GPU, in bf16, the fused path must be within twice the PyTorch path's
error against an fp64 copy of the model.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, NEEDS_TRITON, ON_GPU, random_model
from test_fused_decoder_ops import QWEN3_LIKE, _packed_inputs

from fastgrpo.models import transformer
from fastgrpo.models.transformer import ModelConfig

pytestmark = NEEDS_TRITON

QWEN2_LIKE = ModelConfig(  # q/k/v biases, untied head, 2 layers
    vocab_size=101,
    hidden_size=40,
    intermediate_size=56,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=10,
    attention_bias=True,
)


def _forward_and_grads(model, ids, positions, attend, train_kernels: bool, monkeypatch):
    monkeypatch.setattr(transformer, "use_train_kernels", lambda x: train_kernels)
    model.zero_grad(set_to_none=True)
    hidden = model(ids, positions, attend)  # (T, H)
    weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(7))
    (hidden.double() * weights.to(hidden.device, torch.float64)).sum().backward()
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        scored = model(ids, positions, attend)
    return hidden.detach(), grads, scored


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("config", [QWEN3_LIKE, QWEN2_LIKE], ids=["qwen3-like", "qwen2-like"])
def test_fused_training_forward_gives_the_pytorch_hidden_states_and_gradients(
    config, packed, monkeypatch
):
    model = random_model(config, torch.float32)
    if packed:
        model.pack_projections()
    ids, positions, attend = _packed_inputs(config)
    hidden, grads, scored = _forward_and_grads(model, ids, positions, attend, True, monkeypatch)
    want, want_grads, _ = _forward_and_grads(model, ids, positions, attend, False, monkeypatch)
    assert torch.equal(scored, hidden)  # no-grad scoring is bitwise the gradient pass
    torch.testing.assert_close(hidden, want, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name, ref in want_grads.items():
        scale = ref.abs().max().clamp(min=1e-6)
        assert (grads[name] - ref).abs().max() <= 1e-4 * scale, name


def test_the_trainer_takes_the_fused_forward_only_on_cuda(monkeypatch):
    x = torch.zeros(2, device=DEVICE)
    assert transformer.use_train_kernels(x) == ON_GPU
    monkeypatch.setattr(transformer, "FUSED_OPS", False)  # FASTGRPO_FUSED_OPS=0
    assert not transformer.use_train_kernels(x)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", [QWEN3_LIKE, QWEN2_LIKE], ids=["qwen3-like", "qwen2-like"])
def test_bf16_fused_training_forward_is_within_twice_the_pytorch_error(config, monkeypatch):
    config = ModelConfig(**{**config.__dict__, "head_dim": 16})  # flash takes multiples of 8
    lengths, start = (37, 1, 128, 64), (0, 0, 300, 5)
    exact_model = random_model(config, torch.float64)
    ids, positions, attend = _packed_inputs(config, lengths, start)
    exact, exact_grads, _ = _forward_and_grads(
        exact_model, ids, positions, attend, False, monkeypatch
    )
    model = random_model(config, torch.bfloat16)
    model.pack_projections()
    fused, fused_grads, _ = _forward_and_grads(model, ids, positions, attend, True, monkeypatch)
    plain, plain_grads, _ = _forward_and_grads(model, ids, positions, attend, False, monkeypatch)
    assert (fused.double() - exact).norm() <= 2 * (plain.double() - exact).norm()
    for name, ref in exact_grads.items():
        fused_err = (fused_grads[name] - ref).norm()
        assert fused_err <= 2 * (plain_grads[name] - ref).norm() + 1e-3 * ref.norm(), name

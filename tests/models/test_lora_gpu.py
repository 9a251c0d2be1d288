"""LoRA on a GPU (marked `gpu`): the engine's merged weights after the adapters change, and the
CUDA trainer's path (packed GEMMs, fused kernels) with adapters in bf16."""

from __future__ import annotations

import copy

import pytest
import torch

from fastgrpo.models.lora import LoraSettings, add_adapters, merge_adapters
from fastgrpo.models.lora_decode import DecodeAdapters
from fastgrpo.models.lora_merged import MergedWeights
from fastgrpo.rollout.native_generate import engine_for, release_engine
from fastgrpo.rollout.sampling import SamplingParams
from tests.models.test_lora import randomise_adapters
from tests.models.test_transformer import FAMILIES, build_pair, packed_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]


def sample(model, never: int) -> torch.Tensor:
    engine = engine_for(model, stop_ids=[never], pad_id=0)
    out = engine.generate(
        PROMPTS, num_samples=4, max_new_tokens=16, params=SamplingParams(1.0), seed=3
    )
    return out.tokens.cpu()


def adapted_cuda_model(family="llama3-untied-bias", rank=4):
    hf_config = FAMILIES[family]()
    _, model = build_pair(hf_config)
    model = model.cuda().to(torch.bfloat16)
    model.pack_projections()
    add_adapters(model, LoraSettings(rank=rank, alpha=2.0 * rank))
    for m in model.modules():  # adapters stay fp32 beside the bf16 base
        if hasattr(m, "lora_A"):
            m.lora_A.float(), m.lora_B.float()
    randomise_adapters(model)
    return hf_config, model


def test_engine_samples_after_the_adapters_change_are_a_fresh_merged_models():
    """The merged copy's CUDA graphs are captured on the first weights; after new adapter values
    and a refresh in place, its samples are those of a fresh engine on the model merged anew."""
    hf_config, model = adapted_cuda_model()
    never = hf_config.vocab_size - 1
    merged = MergedWeights(model)
    first = sample(merged.current(0), never)
    randomise_adapters(model, seed=11)  # what an optimizer step does, in bigger strides
    after = sample(merged.current(1), never)
    fresh = merge_adapters(copy.deepcopy(model))
    fresh.pack_projections()
    assert torch.equal(after, sample(fresh, never))
    assert not torch.equal(after, first)


def test_engine_samples_with_its_own_adapters_follow_them_through_its_cuda_graphs():
    """lora.merge_for_rollout false: the engine's graphs, captured on the first factors, give
    after new adapter values and a refresh the samples of an engine made afresh; and its log-probs
    of its samples are the trainer's (adapters in bf16 GEMMs) as closely as a merged engine's are
    its trainer's (which computes with the merged weights) on a twin of the model."""
    hf_config, model = adapted_cuda_model()
    _, twin = adapted_cuda_model()  # the same weights: the merged run, as the trainer makes it
    randomise_adapters(twin, seed=11)
    merged = MergedWeights(twin)  # made before any engine of its model
    never = hf_config.vocab_size - 1
    rollout = DecodeAdapters(model)
    first = sample(rollout.current(0), never)
    randomise_adapters(model, seed=11)
    after = sample(rollout.current(1), never)
    release_engine(model)
    assert torch.equal(after, sample(model, never))
    assert not torch.equal(after, first)
    gaps = {}
    for name, trainer_model, engine_model in (
        ("adapters", model, model),
        ("merged", twin, merged.current(1)),
    ):
        engine = engine_for(engine_model, stop_ids=[never], pad_id=0)
        out = engine.generate(
            PROMPTS, num_samples=4, max_new_tokens=16, params=SamplingParams(1.0), seed=3
        )
        gaps[name] = trainer_gap(trainer_model, out)
    print("engine - trainer gaps", gaps)
    assert gaps["adapters"] <= max(gaps["merged"], 0.02), gaps


def trainer_gap(model, out) -> float:
    """Largest |engine - trainer| log-prob over the sampled tokens, the trainer scoring each
    prompt + completion on its CUDA path (`forward_train`, no gradient)."""
    worst = 0.0
    for row in range(out.tokens.shape[0]):
        prompt = PROMPTS[row // 4]
        completion = out.tokens[row, : int(out.lengths[row])].tolist()
        ids = torch.tensor(prompt + completion, device="cuda")
        cu = torch.tensor([0, len(ids)], dtype=torch.int32, device="cuda")
        with torch.no_grad():
            hidden = model(
                ids, torch.arange(len(ids), device="cuda"), model.packed_attention(cu, len(ids))
            )
            logp = model.logits(hidden).float().log_softmax(-1)
        n = len(prompt)
        scored = logp[n - 1 : -1].gather(1, ids[n:, None])[:, 0]
        engine_logp = out.logp[row, : len(completion)].float()
        worst = max(worst, float((scored - engine_logp).abs().max()))
    return worst


def test_the_cuda_training_path_gives_the_adapters_gradients_within_twice_eager_bf16s_error():
    """Against the fp32 gradients (the eager path, which equals peft's: test_lora.py), the CUDA
    trainer's bf16 path (packed GEMMs, fused kernels, the adapters' part added in fp32) errs at
    most twice as much as the eager PyTorch path in bf16 on the CPU."""
    hf_config, model = adapted_cuda_model()
    exact = copy.deepcopy(model).float().cpu()
    eager_bf16 = copy.deepcopy(model).cpu()
    ids, positions, cu = packed_batch(hf_config.vocab_size)
    weights = torch.randn(len(positions), hf_config.vocab_size, generator=torch.Generator())

    def grads(m, device):
        attend = m.packed_attention(cu.to(device), 9)
        hidden = m(torch.cat(ids).to(device), positions.to(device), attend)
        (m.logits(hidden).float() * weights.to(device)).sum().backward()
        return {n: p.grad.float().cpu() for n, p in m.named_parameters() if p.requires_grad}

    got, want, eager = grads(model, "cuda"), grads(exact, "cpu"), grads(eager_bf16, "cpu")
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    assert got.keys() == want.keys() and len(got) == 28
    for name in want:
        error = float((got[name] - want[name]).norm() / want[name].norm())
        baseline = float((eager[name] - want[name]).norm() / want[name].norm())
        assert error <= 2 * baseline + 1e-3, (name, error, baseline)

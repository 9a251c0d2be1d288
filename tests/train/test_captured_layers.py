"""The update's layers as CUDA graphs (`train/captured_layers.py`): the padded layout gives the
unpadded layout's hidden states and gradients (CPU, fp32), and on a GPU (marked `gpu`) the
replayed graphs give the eager layers' values and gradients, follow in-place weight changes, and
record a bucket once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastgrpo.rollout import Rollout
from fastgrpo.train.captured_layers import CapturedLayers, pad_layout, why_eager
from fastgrpo.train.logprobs import kept_hidden, pack_layout


def random_rollout(vocab: int, device="cpu", seed: int = 0, groups=(3, 2, 1)) -> Rollout:
    """Rows of left-padded prompts (each prompt shared by its group's rows) and completions
    whose masks keep a prefix: some all, one a single token, one nothing."""
    g = torch.Generator().manual_seed(seed)
    Tp, Tc = 9, 12
    prompt_ids, prompt_mask, completion_mask = [], [], []
    for size in groups:
        length = int(torch.randint(2, Tp + 1, (1,), generator=g))
        prompt = torch.randint(1, vocab, (Tp,), generator=g)
        mask = (torch.arange(Tp) >= Tp - length).long()
        for _ in range(size):
            prompt_ids.append(prompt * mask)
            prompt_mask.append(mask)
            kept = int(torch.randint(0, Tc + 1, (1,), generator=g))
            completion_mask.append((torch.arange(Tc) < kept).long())
    completion_mask[0] = torch.ones(Tc, dtype=torch.long)
    completion_mask[1] = (torch.arange(Tc) < 1).long()
    completion_mask[-1] = torch.zeros(Tc, dtype=torch.long)
    B = len(prompt_ids)
    return Rollout(
        torch.stack(prompt_ids).to(device),
        torch.stack(prompt_mask).to(device),
        torch.randint(1, vocab, (B, Tc), generator=g).to(device),
        torch.stack(completion_mask).to(device),
        torch.ones(B, dtype=torch.bool, device=device),
    )


@pytest.mark.parametrize("share", [True, False], ids=["shared-prompts", "own-prompts"])
def test_the_padded_layout_gives_the_layouts_hidden_states_and_gradients(tiny_model, share):
    """A filler sequence pads the tokens and the key rows to the bucket: every packed row and
    key row in exactly one sequence, lengths rounded to powers of two; the kept tokens' hidden
    states and every weight's gradient are those of the unpadded layout (fp32)."""
    model, _ = tiny_model
    rollout = random_rollout(model.config.vocab_size)
    args = rollout.prompt_ids, rollout.prompt_mask, rollout.completion_mask, share
    layout = pack_layout(*args)
    padded, bucket = pad_layout(layout, 16, sequence_step=4)
    T_b, Tk_b, sequences, max_q, max_k = bucket
    T, Tk, N = layout.tokens.size, layout.cu_seqlens_k[-1], layout.cu_seqlens.size - 1
    assert T_b % 16 == 0 and T_b - T <= 16 + 4 and Tk_b % 16 == 0 and Tk_b - Tk >= T_b - T
    assert sequences % 4 == 0 and N < sequences <= N + 4
    assert padded.tokens.size == padded.cu_seqlens[-1] == T_b
    assert padded.key_rows.size == padded.cu_seqlens_k[-1] == Tk_b
    assert padded.key_rows.max() < T_b and padded.cu_seqlens.size == sequences + 1
    q_lengths, k_lengths = (np.diff(cu) for cu in (padded.cu_seqlens, padded.cu_seqlens_k))
    assert (q_lengths[N:] >= 1).all() and (k_lengths[N:] >= q_lengths[N:]).all()
    for lengths, longest in ((q_lengths, max_q), (k_lengths, max_k)):
        assert longest & (longest - 1) == 0 and longest >= lengths.max()
    w = torch.randn(int(rollout.completion_mask.sum()), model.config.hidden_size)
    results = []
    for use in (layout, padded):
        packed = use.to_device("cpu")
        ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1).view(-1)
        attend = model.packed_attention(packed.cu_seqlens, use.max_seqlen, packed.keys)
        model.zero_grad()
        hidden = model(ids[packed.tokens], packed.positions, attend, position_bound=64)
        hidden = hidden[packed.scored]
        (hidden * w).sum().backward()
        results.append((hidden.detach(), [p.grad.clone() for p in model.parameters()]))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads):  # fp32, sums in another order
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_the_graphs_serve_only_the_native_model_on_one_gpu_and_the_log_says_why_not(
    tiny_model, monkeypatch
):
    """`why_eager` names what keeps the layers eager, and the run log's line says it (none on
    the CPU). The GPU is stood in for by the model's device."""
    from types import SimpleNamespace

    from fastgrpo.config import Config
    from fastgrpo.models import Transformer
    from fastgrpo.train.trainer import update_layers_note

    model, _ = tiny_model
    assert why_eager(model) == "not on a CUDA GPU"
    trainer = SimpleNamespace(model=model, captured=None, fused=True, world=None)
    assert update_layers_note(Config(), trainer) is None
    assert why_eager(torch.nn.Linear(2, 2)).startswith("a transformers model")
    monkeypatch.setattr(Transformer, "device", property(lambda self: torch.device("cuda")))
    assert why_eager(model) == "a dtype, head size or window the flash kernels do not take"  # fp32
    assert why_eager(model, SimpleNamespace(size=2)) == "several processes"
    monkeypatch.setattr(model, "activation_checkpointing", True)
    assert why_eager(model) == "gradient checkpointing"
    off = Config()
    off.train.cuda_graphs = "off"
    assert (
        update_layers_note(off, trainer) == "update: the layers run eagerly (train.cuda_graphs=off)"
    )
    note = update_layers_note(Config(), trainer)
    assert note == "update: the layers run eagerly (gradient checkpointing)"
    trainer.captured = SimpleNamespace(step=1536)
    assert "replay CUDA graphs" in update_layers_note(Config(), trainer)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda_model(lora: bool):
    from fastgrpo.models.lora import LoraSettings, add_adapters
    from tests.models.test_lora import randomise_adapters
    from tests.models.test_transformer import FAMILIES, build_pair

    _, model = build_pair(FAMILIES["llama3-untied-bias"]())
    model = model.cuda().to(torch.bfloat16)
    model.pack_projections()
    if lora:
        add_adapters(model, LoraSettings(rank=4, alpha=8.0))
        for m in model.modules():  # adapters stay fp32 beside the bf16 base
            if hasattr(m, "lora_A"):
                m.lora_A.float(), m.lora_B.float()
        randomise_adapters(model)
    return model.train()


def _hidden_and_grads(hidden_of, model, rollout, w):
    params = [p for p in model.model.layers.parameters() if p.requires_grad]
    hidden = hidden_of(model, rollout)
    grads = torch.autograd.grad((hidden.float() * w).sum(), params)
    return hidden.detach().float(), [g.float() for g in grads]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_replayed_layers_give_the_eager_layers_values_and_gradients(lora):
    """The graphs against the eager layers (bf16): hidden states and every trainable layer
    weight's gradient, three times, with the weights changed in place between (as an optimizer
    step changes them): the bucket runs eagerly, is recorded, then replayed, and follows the new
    weights."""
    model = _cuda_model(lora)
    assert why_eager(model) is None
    rollout = random_rollout(model.config.vocab_size, device="cuda")
    captured = CapturedLayers(model)
    w = torch.randn(int(rollout.completion_mask.sum()), model.config.hidden_size, device="cuda")
    for _ in range(3):  # the graphs first: their own refill of LoRA's factors is what is tested
        got, got_grads = _hidden_and_grads(captured.kept_hidden, model, rollout, w)
        want, want_grads = _hidden_and_grads(kept_hidden, model, rollout, w)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        for a, b in zip(got_grads, want_grads):
            scale = b.abs().max().clamp(min=1e-6)
            assert (a - b).abs().max() / scale < 3e-2
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * p.abs().mean() * 0.5)
        if lora:
            from fastgrpo.models.lora_train import adapters_stepped

            adapters_stepped()  # what the trainer's optimizer announces after a step
    assert (captured.captures, captured.replays) == (1, 1)


@pytest.mark.gpu
@gpu
def test_replayed_gradients_accumulate_into_the_weights_grads_as_eager_ones_do():
    """Two micro-batches' backward passes through the replayed layers add up in each weight's
    .grad (the first pass's gradient is not overwritten by the second replay): against the
    eager layers' sum."""
    model = _cuda_model(lora=True)
    captured = CapturedLayers(model)
    rollouts = [random_rollout(model.config.vocab_size, "cuda", seed) for seed in (1, 2)]
    params = [p for p in model.model.layers.parameters() if p.requires_grad]
    for _ in range(2):  # eagerly, then recorded: the next round replays
        for rollout in rollouts:
            captured.kept_hidden(model, rollout).float().sum().backward()
    sums = []
    for hidden_of in (kept_hidden, captured.kept_hidden):
        for p in params:
            p.grad = None
        for rollout in rollouts:
            (hidden_of(model, rollout).float() ** 2).mean().backward()
        sums.append([p.grad.float().clone() for p in params])
    assert captured.replays >= 2
    for a, b in zip(sums[1], sums[0]):
        assert (a - b).abs().max() / b.abs().max().clamp(min=1e-6) < 3e-2


def test_the_engines_budget_gets_a_dropped_trainers_idle_graph_memory_back(tiny_model):
    """The pool's idle bytes stay out of the engine's budget (`engine.GRAPH_POOLS_IDLE`) only while
    the CapturedLayers that recorded into it exists (a benchmark builds several trainers)."""
    import gc

    from fastgrpo.rollout.engine import GRAPH_POOLS_IDLE

    before = GRAPH_POOLS_IDLE[0]
    captured = CapturedLayers(tiny_model[0])
    captured._idle[0] += 1000  # as a recording would
    GRAPH_POOLS_IDLE[0] += 1000
    del captured
    gc.collect()
    assert GRAPH_POOLS_IDLE[0] == before


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_an_update_replaying_the_graphs_reads_nothing_back_from_the_gpu(lora):
    """Once every bucket is recorded, the update's forward and backward passes make no host
    read of the device (torch's sync debug mode raises on one): the layouts are computed before
    the passes and the loss indexes its tokens without a boolean mask."""
    import argparse

    from benchmarks.bench_step import synthetic_trainer
    from fastgrpo.train import update as update_module
    from fastgrpo.train.step import grpo_step

    args = argparse.Namespace(
        shape="tiny", prompts=4, samples=4, prompt_len=16, completion_len=24, beta=0.04,
        micro_batch_tokens=128, warmup=3, steps=1,
    )  # fmt: skip
    config, trainer, examples = synthetic_trainer(args, torch.device("cuda"), lora_rank=lora)
    assert trainer.captured is not None
    torch.manual_seed(0)
    for _ in range(args.warmup):  # each bucket: eagerly, then recorded
        grpo_step(config, trainer, examples)
    original = update_module._accumulate_gradients

    def strict(*a, **k):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(*a, **k)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    update_module._accumulate_gradients = strict
    try:
        replays = trainer.captured.replays
        grpo_step(config, trainer, examples)
    finally:
        update_module._accumulate_gradients = original
    assert trainer.captured.replays > replays


def test_a_bucket_that_cannot_be_recorded_leaves_the_layers_eager_with_one_warning(
    tiny_model, monkeypatch, caplog
):
    """A recording that raises (an operation CUDA graphs cannot hold) does not stop the run:
    that bucket and every later one run eagerly, said once. Here on the CPU, with the CUDA
    calls around the recording stood in for."""
    from fastgrpo.train import captured_layers

    model, _ = tiny_model
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)

    def refuse(self, *args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(captured_layers._Recorded, "__init__", refuse)
    captured = CapturedLayers(model)
    x = torch.zeros(3, model.config.hidden_size)
    runs = [captured._graphed((512, 512, 8, 64, 64), (x,)) for _ in range(3)]
    runs.append(captured._graphed((1024, 1024, 8, 64, 64), (x,)))
    runs.append(captured._graphed((1024, 1024, 8, 64, 64), (x,)))
    assert all(isinstance(r, captured_layers._Layers) for r in runs)
    assert captured.failed and captured.captures == captured.replays == 0
    warnings = [r for r in caplog.records if "could not be recorded" in r.getMessage()]
    assert len(warnings) == 1 and "more" not in warnings[0].getMessage()


def test_the_address_check_sees_moved_tensors_and_wrapped_modules_and_the_refill_is_in_place(
    tiny_model,
):
    """What decides that the graphs must be recorded again (`_addresses`): unchanged by in-place
    weight and adapter changes (an optimizer step); changed by a parameter replaced, a module
    wrapped, a projection packed again. `_refill_factors` (each forward graph's head) writes the
    adapters into the same factor tensors, without the cache's refill."""
    from torch import nn

    from fastgrpo.models.lora import LoraSettings, add_adapters
    from fastgrpo.models.lora_train import CACHE

    model, _ = tiny_model
    model.pack_projections()
    add_adapters(model, LoraSettings(rank=4, alpha=8.0))
    captured = CapturedLayers(model)
    assert captured._addresses() is None
    captured._watch()
    first = captured._addresses()
    layer = model.model.layers[0]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert captured._addresses() == first
    q = layer.self_attn.q_proj
    f = q.__dict__[CACHE][1]
    a_before, b_before = f.a_cat.data_ptr(), f.b_bd.data_ptr()
    with torch.no_grad():
        q.lora_A.weight.copy_(torch.randn_like(q.lora_A.weight))
        q.lora_B.weight.copy_(torch.randn_like(q.lora_B.weight))
    captured._refill_factors()
    rank = q.lora_A.weight.shape[0]
    assert (f.a_cat.data_ptr(), f.b_bd.data_ptr()) == (a_before, b_before)
    torch.testing.assert_close(f.a_cat[:rank], q.lora_A.weight, rtol=0, atol=0)
    torch.testing.assert_close(f.b_bd[: q.out_features, :rank], q.lora_B.weight, rtol=0, atol=0)
    assert captured._addresses() == first

    q.enabled = False  # an adapter switched off: its group's product leaves the graphs
    assert captured._addresses() != first
    q.enabled = True
    assert captured._addresses() == first

    norm = model.model.layers[-1].post_attention_layernorm
    norm.weight = nn.Parameter(norm.weight.detach().clone())
    moved = captured._addresses()
    assert moved != first
    layer.mlp.down_proj = nn.Sequential(layer.mlp.down_proj)  # a module wrapped
    wrapped = captured._addresses()
    assert wrapped != moved
    model.pack_projections()  # packed again: new packed weights
    assert captured._addresses() != wrapped


def test_the_token_step_is_an_eighth_of_the_budget_in_multiples_of_128_and_at_least_512():
    from fastgrpo.train.captured_layers import token_step

    assert token_step(12288) == 1536 and token_step(16384) == 2048 and token_step(2048) == 512
    assert token_step(10000) == 1280  # 1250 rounded up to a multiple of 128

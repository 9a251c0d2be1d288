"""The memory prediction of `fastgrpo check` (`train/memory_estimate.py`): its parts are the bytes
the trainer and the engine really allocate, and the longest completion it reports is the edge of
what fits. (The whole peak is checked against GPU measurements by benchmarks/bench_memory.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fastgrpo.config import Config, validate
from fastgrpo.models import Transformer
from fastgrpo.models.lora import LoraSettings, add_adapters
from fastgrpo.models.model_config import ModelConfig
from fastgrpo.train.memory_estimate import estimate_memory, longest_completion
from fastgrpo.train.trainer import build_trainer

SHAPE = ModelConfig(
    vocab_size=211, hidden_size=48, intermediate_size=80, num_layers=3, num_heads=4,
    num_kv_heads=2, head_dim=12, tie_word_embeddings=True,
)  # fmt: skip


def small_config(**changes) -> Config:
    config = Config()
    config.rollout.prompts_per_step, config.rollout.num_generations = 4, 3
    config.rollout.max_new_tokens = 20
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    validate(config)
    return config


def bf16_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(SHAPE).to(torch.bfloat16)


def tensor_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_the_optimizer_part_is_what_the_trainer_allocates_for_masters_and_moments():
    for masters in ("auto", "off"):
        config = small_config(**{"train.master_weights": masters})
        model = bf16_model()
        tokenizer = SimpleNamespace(eos_token_id=1, pad_token_id=0)
        optimizer = build_trainer(config, model, tokenizer, ref_model=None).optimizer
        for param in optimizer.params:  # AdamW makes its moments at the first step
            param.grad = torch.zeros_like(param)
        optimizer.step(max_grad_norm=1.0)
        state = [t for s in optimizer.adamw.state.values() for t in s.values() if t.dim() > 0]
        kept = tensor_bytes(state)
        if optimizer.masters is not None:
            kept += tensor_bytes(optimizer.masters.masters)
        estimate = estimate_memory(config, model, prompt_len=10)
        assert estimate.parts["optimizer"] == kept, masters


def test_a_lora_run_counts_fp32_adapters_merged_copies_and_no_reference():
    config = small_config(**{"algo.beta": 0.04})
    model = bf16_model()
    add_adapters(model, LoraSettings(rank=4, alpha=8))
    estimate = estimate_memory(config, model, prompt_len=10)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert estimate.parts["gradients"] == 4 * adapters  # fp32 gradients of fp32 adapters
    assert estimate.parts["optimizer"] == 8 * adapters  # two fp32 moments, no masters
    linear = sum(m.weight.numel() for m in model.modules() if hasattr(m, "lora_A"))
    assert estimate.parts["merged weights"] == 2 * linear
    assert "reference" not in estimate.parts
    too_small = "\n".join(estimate.lines(device_bytes=estimate.peak - 1))
    assert (
        f"lora.merge_for_rollout=false keeps no merged copies: {2 * linear / 2**30:.1f}"
        in too_small
    )
    assert "merge_for_rollout" not in "\n".join(estimate.lines(device_bytes=estimate.peak))
    config.lora.merge_for_rollout = False  # the engine adds the adapters: neither copy is kept
    unmerged = estimate_memory(config, model, prompt_len=10)
    assert "merged weights" not in unmerged.parts and "reference" not in unmerged.parts
    assert unmerged.peak == estimate.peak - 2 * linear


def test_the_kv_cache_part_is_the_engines_wave_and_splits_into_waves_when_short_of_room():
    config = small_config()
    model = bf16_model()
    whole = estimate_memory(config, model, prompt_len=10)
    per_token = 2 * SHAPE.num_layers * SHAPE.num_kv_heads * SHAPE.head_dim * 2
    # 4 prompts (+ the spare row) at a 64-token bucket, 12 rows of 19 completion slots
    assert whole.parts["kv cache"] == per_token * (5 * 64 + 12 * 19)
    assert whole.waves == 1
    held = sum(whole.parts[k] for k in ("weights", "gradients", "optimizer"))
    # room left for about 4 rows: the engine takes 70% of it and rolls out by wave
    row = per_token * 30 + 16 * SHAPE.vocab_size
    tight = estimate_memory(config, model, prompt_len=10, device_bytes=held + 6 * row)
    assert tight.waves == 4  # 4 rows fit: one prompt's 3 samples per wave
    assert tight.parts["kv cache"] == per_token * (2 * 64 + 3 * 19)


def test_the_longest_completion_is_the_edge_of_what_fits():
    config = small_config(**{"algo.beta": 0.04})
    model = bf16_model()
    room = estimate_memory(config, model, 10, 500).peak
    longest = longest_completion(config, model, 10, room, step=16)
    assert longest >= 496
    assert estimate_memory(config, model, 10, longest, room).peak <= room
    assert estimate_memory(config, model, 10, longest + 16, room).peak > room
    # gradient checkpointing keeps less, so longer completions fit
    config.model.gradient_checkpointing = True
    assert longest_completion(config, model, 10, room, step=16) > longest


def test_a_prediction_near_the_gpus_size_suggests_expandable_segments(monkeypatch):
    estimate = estimate_memory(small_config(), bf16_model(), prompt_len=10)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    near = "\n".join(estimate.lines(device_bytes=int(estimate.peak / 0.9)))
    roomy = "\n".join(estimate.lines(device_bytes=2 * estimate.peak))
    over = "\n".join(estimate.lines(device_bytes=estimate.peak // 2))
    assert "expandable_segments:True" in near and "fits" in near
    assert "expandable_segments" not in roomy and "expandable_segments" not in over
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert "expandable_segments" not in "\n".join(estimate.lines(int(estimate.peak / 0.9)))


def test_the_update_graphs_part_is_the_bucket_padding_and_the_layer_gradients_twice():
    """train.cuda_graphs: the pool holds a micro-batch padded to its bucket (half a step on
    average) and the gradients the graphs write of the trainable layer weights, through the
    optimizer step too; off or under gradient checkpointing there is no such part, and a run
    that does not fit is told what off saves."""
    from fastgrpo.train.captured_layers import SEQUENCE_STEP, token_step

    model = bf16_model()
    on = estimate_memory(small_config(), model, prompt_len=10)
    off = estimate_memory(small_config(**{"train.cuda_graphs": "off"}), model, prompt_len=10)
    grads = sum(p.numel() * 2 for p in model.model.layers.parameters())
    tokens, kept = on.micro_batch_tokens, on.parts["activations"]
    padding = token_step(small_config().train.micro_batch_tokens) // 2 + SEQUENCE_STEP
    assert on.parts["cuda graphs"] == kept * padding // tokens + grads
    assert "cuda graphs" not in off.parts and on.peak > off.peak
    checkpointed = small_config(**{"model.gradient_checkpointing": True})
    assert "cuda graphs" not in estimate_memory(checkpointed, model, prompt_len=10).parts
    saves = f"train.cuda_graphs=off runs the update's layers eagerly: {on.parts['cuda graphs'] / 2**30:.1f}"
    assert saves in "\n".join(on.lines(device_bytes=on.peak - 1))
    assert "cuda_graphs" not in "\n".join(on.lines(device_bytes=on.peak))

"""Why a LoRA run's engine log-probs sit further from the trainer's than in full fine-tuning, on
the CPU: the engine samples from merged bf16 weights, W + s B A rounded once, while the trainer
computes the bf16 base W plus the low-rank product apart. In full fine-tuning both sides use the
same bf16 weights, so only their kernels differ.

A random Llama of the 0.5B shape's widths (896 / 4864, 14 heads, 2 KV heads), 4 layers, vocab
4096, weights N(0, 0.02); adapters r=16, alpha 32 on every linear, B drawn at several scales
(B starts at zero; Adam moves it by about the learning rate a step). For each scale, the kept
tokens' log-probs of a random rollout three ways: the trainer's bf16 path, the merged bf16 copy
(`MergedWeights`, what the engine reads) and fp32 with exact W + s B A. Prints the mean and max
|difference| per pair.

    python -m benchmarks.lab.lora_logp_gap
"""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig

from fastgrpo.models import Transformer
from fastgrpo.models.lora import LoraSettings, MergedWeights, add_adapters
from fastgrpo.models.model_config import ModelConfig
from fastgrpo.train.logprobs import kept_hidden
from tests.train.test_captured_layers import random_rollout

SCALES = (0.0, 5e-4, 2e-3, 1e-2)


def kept_logprobs(model, rollout) -> torch.Tensor:
    """The kept completion tokens' log-probs, the LM head in fp32 (only the layers differ)."""
    with torch.no_grad():
        hidden = kept_hidden(model, rollout).float()
        logp = torch.log_softmax(hidden @ model.lm_head_weight.float().t(), -1)
        ids = rollout.completion_ids[rollout.completion_mask.bool()]
        return logp.gather(1, ids[:, None])[:, 0]


def main():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    base = Transformer(ModelConfig.from_hf(config))
    with torch.no_grad():
        for p in base.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    rollout = random_rollout(config.vocab_size, groups=(4, 4))
    print(
        f"{'B scale':>8} {'trainer-merged':>15} {'(max)':>9} {'trainer-fp32':>13} {'merged-fp32':>12}"
    )
    for scale in SCALES:
        model = copy.deepcopy(base)
        add_adapters(model, LoraSettings(rank=16, alpha=32.0))
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "lora_B") and scale:
                    m.lora_B.weight.normal_(0, scale)
        exact = kept_logprobs(model, rollout)
        model = model.to(torch.bfloat16)
        for m in model.modules():  # the adapters stay fp32 beside the bf16 base, as in training
            if hasattr(m, "lora_A"):
                m.lora_A.float(), m.lora_B.float()
        trainer = kept_logprobs(model, rollout)
        merged = kept_logprobs(MergedWeights(model).current(1), rollout)
        gap = (trainer - merged).abs()
        print(
            f"{scale:>8g} {float(gap.mean()):>15.2e} {float(gap.max()):>9.2e} "
            f"{float((trainer - exact).abs().mean()):>13.2e} "
            f"{float((merged - exact).abs().mean()):>12.2e}"
        )


if __name__ == "__main__":
    main()

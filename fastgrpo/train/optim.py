"""AdamW (fused on CUDA) and the learning-rate schedule."""

from __future__ import annotations

import math

import torch


def build_optimizer(model, *, learning_rate, weight_decay, betas, eps) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # Biases and norm weights (1-D) take no weight decay, as in common practice.
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=eps, fused=fused or None)


def build_scheduler(optimizer, *, kind: str, warmup_steps: int, total_steps: int):
    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

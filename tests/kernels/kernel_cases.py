"""Shared by the kernel tests: where they run, the skip rules for Triton, the loss variants."""

from __future__ import annotations

import pytest
import torch

from fastgrpo.kernels.support import triton

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
OLD_INTERPRETER = triton is not None and tuple(
    int(x) for x in triton.__version__.split(".")[:2]
) < (3, 7)
NEEDS_TRITON = [
    pytest.mark.skipif(triton is None, reason="needs triton"),
    # before 3.7 the interpreter cannot read scalar kernel arguments under numpy >= 2.4
    pytest.mark.skipif(
        not ON_GPU and OLD_INTERPRETER, reason="triton interpreter too old for numpy 2"
    ),
]

# token-level loss settings that cover every surrogate, aggregation, KL estimator and bonus
LOSS_VARIANTS = [
    dict(loss_type="grpo"),
    dict(loss_type="dapo", epsilon_high=0.28),
    dict(loss_type="bnpo", beta=0.05, kl_estimator="k3"),
    dict(loss_type="dr_grpo", beta=0.02, kl_estimator="k1", delta=1.5),
    dict(loss_type="cispo", epsilon_high=5.0, entropy_coef=0.01),
    dict(loss_type="grpo", entropy_coef=0.02, beta=0.1, kl_estimator="k2"),
]


def variant_id(settings):
    return "-".join(f"{k}={v}" for k, v in settings.items())


def random_model(config, dtype, seed: int = 0):
    """A native Transformer of `config` on DEVICE with weights of O(1) logits; norm weights near 1
    but not equal to it, so they are exercised."""
    from fastgrpo.models.transformer import Transformer

    torch.manual_seed(seed)
    model = Transformer(config)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data = 1 + 0.2 * torch.randn_like(p)
        else:
            p.data = 0.1 * torch.randn_like(p)
    return model.to(dtype=dtype, device=DEVICE)


class UncompilableKernel:
    """Stands in for a Gluon kernel that does not compile with the installed triton: launching it
    (`kernel[grid](...)`) raises what a compile failure raises."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise RuntimeError("unsupported layout\nmore detail")

        return launch

"""train.parallel=fsdp on the trainer's CUDA path (`DecoderLayer.forward_train`, registered with
FSDP as a forward method), run on the CPU by Triton's interpreter: two ranks, each with half of
the sequences, take the optimizer steps one process takes on all of them, with and without
activation checkpointing (which recomputes each layer's forward inside the backward, where FSDP
must gather the layer's weights again)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed.test_data_parallel_update import VOCAB, skip_teardown, tiny_models

pytest.importorskip("triton")

LENGTHS = (7, 11, 5, 9)


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    n = ids.numel()
    attend = model.packed_attention(torch.tensor([0, n], dtype=torch.int32), n)
    hidden = model(ids, torch.arange(n), attend)  # (n, H)
    logits = hidden[:-1] @ model.lm_head_weight.t()
    return torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum")


def _train(model, optimizer, sequences) -> list[float]:
    norms = []
    for _ in range(2):
        optimizer.zero_grad()
        for ids in sequences:
            _loss(model, ids).backward()
        norms.append(float(optimizer.step(max_grad_norm=1.0)[0]))
    return norms


def _rank_main(rank: int, size: int, store: str, out: str, checkpointing: bool) -> None:
    import fastgrpo.models.transformer as transformer
    from fastgrpo.distributed import World
    from fastgrpo.distributed.fsdp import FullySharded
    from fastgrpo.train.optim import ModelOptimizer

    transformer.use_train_kernels = lambda x: True  # the CUDA trainer's path, interpreted
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        world = World(rank, size)
        torch.manual_seed(5)
        sequences = [torch.randint(1, VOCAB, (n,)) for n in LENGTHS]
        options = dict(learning_rate=1e-3, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-8)
        policy, alone = tiny_models()[0], tiny_models()[0]
        policy.activation_checkpointing = alone.activation_checkpointing = checkpointing
        sharding = FullySharded(policy, world)
        optimizer = ModelOptimizer(policy, world=world, fully_sharded=sharding, **options)
        norms = _train(policy, optimizer, sequences[rank::size])
        if world.is_main:
            expected = _train(alone, ModelOptimizer(alone, **options), sequences)
            torch.save(
                {
                    "norms": (norms, expected),
                    "params": [
                        (a.detach().clone(), b.detach().clone())
                        for a, b in zip(
                            sharding.rollout_model.parameters(), alone.parameters(), strict=True
                        )
                    ],
                },
                out,
            )
    finally:
        dist.destroy_process_group()
    skip_teardown()


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_fsdp_on_the_fused_training_path_takes_the_one_process_steps(
    tmp_path, monkeypatch, checkpointing
):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "result.pt"
    mp.start_processes(
        _rank_main,
        args=(2, str(tmp_path / "store"), str(out), checkpointing),
        nprocs=2,
        start_method="spawn",
    )
    result = torch.load(out)
    sharded, alone = result["norms"]
    assert sharded == pytest.approx(alone, rel=1e-5)
    assert alone[0] > 1.0  # clipped: the clip's scale is part of what is compared
    before = tiny_models()[0].parameters()
    moved = max(float((b - p).abs().max()) for (_, b), p in zip(result["params"], before))
    assert moved > 1e-4
    for a, b in result["params"]:
        assert float((a - b).norm() / b.norm()) < 1e-6

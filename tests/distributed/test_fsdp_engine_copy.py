"""The FSDP engine copy freed during the update (`train.fsdp_free_engine_copy`): released, it holds
no memory; gathered again, it holds the shards' current weights in packed projections the engine
still takes as intact. Two ranks on the CPU (gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed.test_data_parallel_update import skip_teardown, tiny_models


def _rank_main(rank: int, size: int, store: str, out: str) -> None:
    from fastgrpo.distributed import World
    from fastgrpo.distributed.fsdp import FullySharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        policy = tiny_models()[0]
        policy.pack_projections()
        sharded = FullySharded(policy, World(rank, size))
        engine = sharded.rollout_model
        before = [p.detach().clone() for p in engine.parameters()]
        sharded.release_engine_weights()
        held = sum(storage.nbytes() for storage, _ in sharded._storages)
        with torch.no_grad():  # an optimizer step's change, on each rank's own shard
            for p in sharded.params:
                p.to_local().add_(0.5)
        sharded.restore_engine_weights()
        after = [p.detach().clone() for p in engine.parameters()]
        packed = all(layer.is_packed() for layer in engine.model.layers)
        sharded.restore_engine_weights()  # not released: no gather, nothing changes
        if rank == 0:
            torch.save({"before": before, "after": after, "held": held, "packed": packed}, out)
    finally:
        dist.destroy_process_group()
    skip_teardown()


@pytest.mark.slow
def test_a_released_engine_copy_holds_nothing_and_comes_back_with_the_new_weights(tmp_path):
    out = tmp_path / "result.pt"
    mp.start_processes(
        _rank_main, args=(2, str(tmp_path / "store"), str(out)), nprocs=2, start_method="spawn"
    )
    result = torch.load(out)
    assert result["held"] == 0
    assert result["packed"]  # q/k/v and gate/up still one GEMM each in the engine
    for a, b in zip(result["before"], result["after"], strict=True):
        torch.testing.assert_close(b, a + 0.5)  # every rank's shard moved, all of it gathered

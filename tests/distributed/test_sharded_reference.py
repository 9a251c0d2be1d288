"""The reference kept as shards (`distributed/frozen.py`, a sharded job with beta > 0): between
uses its storages hold nothing; inside `whole()` every parameter holds exactly its bytes again,
packed projections included, on every rank, as often as it is entered."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastgrpo.distributed import World
from fastgrpo.distributed.frozen import ShardedFrozen
from tests.distributed.test_data_parallel_update import tiny_models


def _rank_main(rank: int, size: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        _, reference = tiny_models()
        reference.pack_projections()  # q/k/v and gate/up share storages, as on a GPU
        before = {name: p.detach().clone() for name, p in reference.named_parameters()}
        shards = ShardedFrozen(reference, World(rank, size))
        report = {"empty_between": [], "equal_inside": [], "packed_inside": []}
        for _ in range(2):
            report["empty_between"].append(
                all(p.untyped_storage().nbytes() == 0 for p in reference.parameters())
            )
            with shards.whole():
                report["equal_inside"].append(
                    all(torch.equal(p, before[n]) for n, p in reference.named_parameters())
                )
                layers = reference.model.layers
                report["packed_inside"].append(
                    all(x.self_attn.qkv.intact() and x.mlp.gate_up.intact() for x in layers)
                )
        report["kept_bytes"] = sum(piece.numel() for piece in shards.pieces)
        report["whole_bytes"] = sum(shards.sizes)
        report["storages"] = len(shards.storages)
        torch.save(report, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_sharded_reference_is_whole_only_while_it_scores(tmp_path):
    mp.start_processes(
        _rank_main, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    for rank in range(2):
        report = torch.load(tmp_path / f"rank{rank}.pt")
        assert report["empty_between"] == [True, True]
        assert report["equal_inside"] == [True, True]
        assert report["packed_inside"] == [True, True]
        assert report["kept_bytes"] <= report["whole_bytes"] / 2 + report["storages"]  # padding

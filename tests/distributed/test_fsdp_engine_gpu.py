"""FSDP's weight gather feeding the rollout engine, on GPUs (2 ranks, NCCL).

Each rank's engine samples from `FullySharded.rollout_model`, whose bf16 weights the gather
refreshes in place after every step; the engine captured its CUDA graphs on the old weights. The
samples after a gather must be those of a fresh engine on an unsharded model holding the same
weights (the whole fp32 state dict cast to bf16), for the same seed, token for token."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed.test_data_parallel_update import VOCAB, skip_teardown, tiny_models

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]
GENERATIONS, NEW_TOKENS = 4, 24


def _sample(model, seed: int) -> torch.Tensor:
    from fastgrpo.rollout.native_generate import engine_for
    from fastgrpo.rollout.sampling import SamplingParams

    engine = engine_for(model, stop_ids=[VOCAB - 1], pad_id=0)
    out = engine.generate(
        PROMPTS, num_samples=GENERATIONS, max_new_tokens=NEW_TOKENS, params=SamplingParams(1.0),
        seed=seed,
    )  # fmt: skip
    return out.tokens.cpu()


def _rank_main(rank: int, size: int, store: str, out: str, released: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fastgrpo.distributed.fsdp import FullySharded
    from fastgrpo.distributed.world import World

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        policy, _ = tiny_models()
        fresh = tiny_models()[0].cuda().to(torch.bfloat16).eval()  # the same weights, unsharded
        policy = policy.cuda().to(torch.bfloat16)
        policy.pack_projections()
        sharded = FullySharded(policy, World(rank, size))
        engine_model = sharded.rollout_model
        before = _sample(engine_model, seed=7)  # the engine captures its graphs on these weights
        if released:  # train.fsdp_free_engine_copy: the copy comes back at other addresses
            sharded.release_engine_weights()
        with torch.no_grad():  # a step's worth of change, different on each rank's shard
            g = torch.Generator(device="cuda").manual_seed(100 + rank)
            for p in sharded.params:
                local = p.to_local()
                local.add_(0.05 * torch.randn(local.shape, device="cuda", generator=g))
        sharded.restore_engine_weights() if released else sharded.gather_weights()
        after = _sample(engine_model, seed=7)
        whole = get_model_state_dict(
            policy, options=StateDictOptions(full_state_dict=True, cpu_offload=False)
        )
        with torch.no_grad():
            for name, p in fresh.named_parameters():
                p.copy_(whole[name].to(torch.bfloat16))
        fresh.pack_projections()
        engine_weights = dict(engine_model.named_parameters())
        exact = all(torch.equal(engine_weights[n], p) for n, p in fresh.named_parameters())
        reference = _sample(fresh, seed=7)
        result = {"before": before, "after": after, "reference": reference, "exact": exact}
        gathered = [None] * size
        dist.all_gather_object(gathered, result)
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()
    skip_teardown()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
@pytest.mark.parametrize("released", [False, True], ids=["kept", "released"])
def test_the_engine_samples_after_an_fsdp_weight_gather_what_an_unsharded_engine_samples(released):
    """Also when the copy was released during the update (train.fsdp_free_engine_copy) and
    gathered into new memory: the engine captures its graphs again on the new addresses."""
    folder = tempfile.mkdtemp()
    out = os.path.join(folder, "result.pt")
    mp.start_processes(
        _rank_main,
        args=(2, os.path.join(folder, "store"), out, released),
        nprocs=2,
        start_method="spawn",
    )
    ranks = torch.load(out)
    for result in ranks:
        assert result["exact"]  # the gathered bf16 weights are the whole weights' cast
        assert torch.equal(result["after"], result["reference"])
        assert not torch.equal(result["after"], result["before"])  # the new weights were read
    assert torch.equal(ranks[0]["after"], ranks[1]["after"])

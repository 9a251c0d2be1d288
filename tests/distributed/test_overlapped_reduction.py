"""The gradient reduction overlapped with the last backward pass (`overlap.py`): a sharded job's
reduce-scatter and a replicated job's all-reduce, on the CPU (gloo, 2 processes). The ranks issue
the same collectives in the same order when their micro-batch counts differ or a rank's last
micro-batch has no backward, the update is still the one-process update (bf16 weights with fp32
masters too), and the sends do start during the backward.
"""

from __future__ import annotations

import datetime
import itertools
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastgrpo.distributed import World, replicated, sharded
from fastgrpo.distributed.sharded import read_one_process_state
from fastgrpo.train.optim import ModelOptimizer
from tests.distributed.test_data_parallel_update import (
    GROUP,
    global_batch,
    run_update,
    tiny_models,
)

TIMEOUT_S = 120  # a collective out of order hangs gloo until its timeout: the test then fails


def masked_last_batch():
    """`global_batch()` with the last row of groups 1 and 3 (rank 1's, one per mini-batch) given
    an advantage and no completion tokens: with a budget of 1 token every row is its own
    micro-batch, so rank 1's last micro-batch of each mini-batch runs no backward."""
    rollout, advantages = global_batch()
    for row in (2 * GROUP - 1, 4 * GROUP - 1):
        rollout.completion_mask[row] = 0
        rollout.completion_ids[row] = 0
        rollout.sampling_logp[row] = 0.0
        advantages[row] = 0.5
    return rollout, advantages


CASES = {  # name: (batch, token budget)
    "uneven": (global_batch, 15),  # mini-batch 0: 3 micro-batches on rank 0, 2 on rank 1
    "masked_last": (masked_last_batch, 1),
}


FP32_LAYOUTS = ["sharded", "replicated"]
LAYOUTS = [*FP32_LAYOUTS, "replicated-bf16"]  # bf16: the sums land in the masters' gradients


def _rank_main(rank: int, size: int, store: str, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=TIMEOUT_S // 2),
    )
    sends, steps, in_step = [], [0], [False]
    reduce_scatter, all_reduce = sharded._reduce_scatter, replicated._all_reduce
    step = ModelOptimizer.step

    def counted_reduce_scatter(out, full, *args, async_op=False, **kwargs):
        sends.append((steps[0], in_step[0], async_op, full.numel()))
        return reduce_scatter(out, full, *args, async_op=async_op, **kwargs)

    def counted_all_reduce(piece, *args, async_op=False, **kwargs):
        sends.append((steps[0], in_step[0], async_op, piece.numel()))
        return all_reduce(piece, *args, async_op=async_op, **kwargs)

    def counted_step(self, *args, **kwargs):
        in_step[0] = True
        try:
            return step(self, *args, **kwargs)
        finally:
            in_step[0] = False
            steps[0] += 1

    sharded._reduce_scatter, ModelOptimizer.step = counted_reduce_scatter, counted_step
    replicated._all_reduce = counted_all_reduce
    sharded.BUCKET_ELEMENTS = 1000  # many buckets; some parameters larger than one
    try:
        world = World(rank, size)
        results = {}
        for (name, (batch, budget)), layout in itertools.product(CASES.items(), LAYOUTS):
            sends.clear()
            steps[0] = 0
            results[name, layout] = run_update(
                "grpo", 0.0, world, sharded=layout == "sharded",
                shards=Path(folder) / f"shards-{name}", batch=batch(), token_budget=budget,
                dtype=torch.bfloat16 if layout == "replicated-bf16" else torch.float32,
            )  # fmt: skip
            results[name, layout]["sends"] = list(sends)
        results["sums"] = {mixed: gradient_sums(world, mixed) for mixed in (False, True)}
        torch.save(results, f"{folder}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def rank_gradients(rank: int, params) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(p.shape, generator=g) for p in params]


def gradient_sums(world, mixed: bool) -> dict:
    """A replicated bf16 model's backward under `last_backward()`, each rank's gradients its own
    random numbers: after `finish` and `deliver`, the gradients AdamW steps with (the masters'
    fp32 ones, and the fp32 parameters' own) and the sums they should hold. Not `mixed`: the
    all-reduces write the masters' buffer in place, bucket by bucket; `mixed` (the final norm in
    fp32): a buffer of their own, copied into the masters."""
    policy = tiny_models()[0].to(torch.bfloat16)
    if mixed:
        policy.model.norm.float()
    optimizer = ModelOptimizer(
        policy, learning_rate=1e-3, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8, world=world
    )
    assert (optimizer.replicated.masters is optimizer.masters) != mixed
    mine = rank_gradients(world.rank, optimizer.params)
    with optimizer.last_backward():
        sum((p.float() * c).sum() for p, c in zip(optimizer.params, mine)).backward()
    assert optimizer.reduction.finish()
    optimizer.replicated.deliver()
    masters = iter(optimizer.masters.masters)
    stepped = [next(masters) if p.dtype == torch.bfloat16 else p for p in optimizer.params]
    got = [p.grad.clone() for p in stepped]
    want = [  # each rank's gradient in its parameter's dtype, summed in fp32
        sum(c.to(p.dtype).float() for c in cs)
        for p, *cs in zip(
            optimizer.params, *(rank_gradients(r, optimizer.params) for r in range(world.size))
        )
    ]
    return {"got": got, "want": want, "sent": len(optimizer.reduction.order)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results per case; fails (rather than hangs) when the ranks deadlock."""
    folder = tmp_path_factory.mktemp("overlap")
    context = mp.start_processes(
        _rank_main,
        args=(2, str(folder / "store"), str(folder)),
        nprocs=2,
        start_method="spawn",
        join=False,
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the 2 ranks did not finish in {TIMEOUT_S} s: collectives out of order")
    return [torch.load(folder / f"rank{r}.pt") for r in range(2)]


def _assert_one_process_update(two: dict, name: str, layout: str) -> None:
    batch, budget = CASES[name]
    one = run_update("grpo", 0.0, world=None, batch=batch(), token_budget=budget)
    for a, b in zip(one["params"], two["params"], strict=True):
        assert float((a - b).norm() / a.norm()) < 1e-6
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    params = list(tiny_models()[0].parameters())
    read = two["state"]
    if layout == "sharded":
        read = read_one_process_state(read, params, lambda p: p.dtype != torch.float32)
    for i, state in one["state"]["adamw"]["state"].items():
        theirs = read["adamw"]["state"][i]
        assert float(theirs["step"]) == float(state["step"]) == 4
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = state[key], theirs[key]
            assert float((a - b).norm() / a.norm().clamp(min=1e-30)) < 1e-4, (i, key)


@pytest.mark.parametrize("layout", FP32_LAYOUTS)
def test_ranks_with_different_micro_batch_counts_give_the_one_process_update(ranks, layout):
    counts = [[len(mini) for mini in rank["uneven", layout]["tokens"]] for rank in ranks]
    assert counts[0][0] == 3 and counts[1][0] == 2  # the case this test is about
    _assert_one_process_update(ranks[0]["uneven", layout], "uneven", layout)


@pytest.mark.parametrize("layout", FP32_LAYOUTS)
def test_a_rank_whose_last_micro_batch_has_no_tokens_does_not_hang_the_others(ranks, layout):
    assert all(mini[-1] == 0 for mini in ranks[1]["masked_last", layout]["tokens"])
    assert all(mini[-1] > 0 for mini in ranks[0]["masked_last", layout]["tokens"])
    _assert_one_process_update(ranks[0]["masked_last", layout], "masked_last", layout)
    during_backward = [s for s in ranks[1]["masked_last", layout]["sends"] if not s[1]]
    assert during_backward == []  # rank 1 sent everything at the step


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_sends_the_same_buckets_in_the_same_order(ranks, name, layout):
    """Each step reduces every bucket once, and the sizes in send order are the same on both
    ranks (a rank sending its buckets in completion order would differ where sizes do)."""
    sizes = [[(s[0], s[3]) for s in rank[name, layout]["sends"]] for rank in ranks]
    assert sizes[0] == sizes[1]
    per_step = [sum(1 for s in sizes[0] if s[0] == k) for k in range(4)]
    assert per_step[0] > 10 and per_step == [per_step[0]] * 4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_reductions_start_during_the_last_backward_pass(ranks, layout):
    """Sends made before `step` was entered are asynchronous and are most of the buckets: the
    hooks fire; the step sends the rest synchronously."""
    sends = ranks[0]["uneven", layout]["sends"]
    for k in range(4):
        early = [s for s in sends if s[0] == k and not s[1]]
        late = [s for s in sends if s[0] == k and s[1]]
        assert all(s[2] for s in early) and not any(s[2] for s in late)
        assert len(early) > len(late)


@pytest.mark.parametrize("mixed", [False, True], ids=["bf16", "bf16_and_fp32"])
def test_a_replicated_bf16_job_sums_each_ranks_gradients_into_the_fp32_masters(ranks, mixed):
    sums = ranks[0]["sums"][mixed]
    assert sums["sent"] > 10  # many buckets, each all-reduced in place
    for got, want in zip(sums["got"], sums["want"], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

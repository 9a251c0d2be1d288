"""The sharded gradient reduce-scatter overlapped with the last backward pass (`overlap.py`), on
the CPU (gloo, 2 processes): the ranks issue the same collectives in the same order when their
micro-batch counts differ or a rank's last micro-batch has no backward, the update is still the
one-process update, and the sends do start during the backward.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastgrpo.distributed import World, sharded
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
    reduce_scatter, step = sharded._reduce_scatter, ModelOptimizer.step

    def counted_reduce_scatter(out, full, *args, async_op=False, **kwargs):
        sends.append((steps[0], in_step[0], async_op, full.numel()))
        return reduce_scatter(out, full, *args, async_op=async_op, **kwargs)

    def counted_step(self, *args, **kwargs):
        in_step[0] = True
        try:
            return step(self, *args, **kwargs)
        finally:
            in_step[0] = False
            steps[0] += 1

    sharded._reduce_scatter, ModelOptimizer.step = counted_reduce_scatter, counted_step
    sharded.BUCKET_ELEMENTS = 1000  # many buckets; some parameters larger than one
    try:
        world = World(rank, size)
        results = {}
        for name, (batch, budget) in CASES.items():
            sends.clear()
            steps[0] = 0
            results[name] = run_update(
                "grpo", 0.0, world, sharded=True, shards=Path(folder) / f"shards-{name}",
                batch=batch(), token_budget=budget,
            )  # fmt: skip
            results[name]["sends"] = list(sends)
        torch.save(results, f"{folder}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


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


def _assert_one_process_update(two: dict, name: str) -> None:
    batch, budget = CASES[name]
    one = run_update("grpo", 0.0, world=None, batch=batch(), token_budget=budget)
    for a, b in zip(one["params"], two["params"], strict=True):
        assert float((a - b).norm() / a.norm()) < 1e-6
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    params = list(tiny_models()[0].parameters())
    read = read_one_process_state(two["state"], params, lambda p: p.dtype != torch.float32)
    for i, state in one["state"]["adamw"]["state"].items():
        theirs = read["adamw"]["state"][i]
        assert float(theirs["step"]) == float(state["step"]) == 4
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = state[key], theirs[key]
            assert float((a - b).norm() / a.norm().clamp(min=1e-30)) < 1e-4, (i, key)


def test_ranks_with_different_micro_batch_counts_give_the_one_process_update(ranks):
    counts = [[len(mini) for mini in rank["uneven"]["tokens"]] for rank in ranks]
    assert counts[0][0] == 3 and counts[1][0] == 2  # the case this test is about
    _assert_one_process_update(ranks[0]["uneven"], "uneven")


def test_a_rank_whose_last_micro_batch_has_no_tokens_does_not_hang_the_others(ranks):
    assert all(mini[-1] == 0 for mini in ranks[1]["masked_last"]["tokens"])
    assert all(mini[-1] > 0 for mini in ranks[0]["masked_last"]["tokens"])
    _assert_one_process_update(ranks[0]["masked_last"], "masked_last")
    during_backward = [s for s in ranks[1]["masked_last"]["sends"] if not s[1]]
    assert during_backward == []  # rank 1 sent everything at the step


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_sends_the_same_buckets_in_the_same_order(ranks, name):
    """Each step reduce-scatters every bucket once, and the sizes in send order are the same on
    both ranks (a rank sending its buckets in completion order would differ where sizes do)."""
    sizes = [[(s[0], s[3]) for s in rank[name]["sends"]] for rank in ranks]
    assert sizes[0] == sizes[1]
    per_step = [sum(1 for s in sizes[0] if s[0] == k) for k in range(4)]
    assert per_step[0] > 10 and per_step == [per_step[0]] * 4


def test_the_reduce_scatters_start_during_the_last_backward_pass(ranks):
    """Sends made before `step` was entered are asynchronous and are most of the buckets: the
    hooks fire; the step sends the rest synchronously."""
    sends = ranks[0]["uneven"]["sends"]
    for k in range(4):
        early = [s for s in sends if s[0] == k and not s[1]]
        late = [s for s in sends if s[0] == k and s[1]]
        assert all(s[2] for s in early) and not any(s[2] for s in late)
        assert len(early) > len(late)

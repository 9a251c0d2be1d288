"""The decode step's bookkeeping kernel (`kernels.decode_record`) against its torch reference:
tokens and log-probs at the step's column, pad and 0 for finished rows, lengths, stop tokens ending
rows (several stop ids, none), the next input, and the counters advancing."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, NEEDS_TRITON, ON_GPU

from fastgrpo.kernels.decode import decode_record

pytestmark = NEEDS_TRITON


def _state(B, T, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50, (B, T), generator=gen)
    logp = -torch.rand(B, T, generator=gen)
    lengths = torch.randint(0, T, (B,), generator=gen)
    finished = torch.rand(B, generator=gen) < 0.3
    last = torch.randint(0, 50, (B,), generator=gen)
    token = torch.randint(0, 12, (B,), generator=gen)  # small ids: many hit the stop ids
    token_logp = -torch.rand(B, generator=gen)
    state = [tokens, logp, lengths, finished, last, torch.tensor(2), torch.tensor(5)]
    return [t.to(DEVICE) for t in state], token.to(DEVICE), token_logp.to(DEVICE)


def _record_both(state, token, token_logp, stop_ids, fed):
    """Record into `state` by the reference and into a copy by the kernel (pad id 0); assert the
    two states are equal and return the kernel's."""
    got = [t.clone() for t in state]
    decode_record.record_step_ref(*state, token, token_logp, stop_ids, 0, fed)
    decode_record.record_step_triton(*got, token, token_logp, stop_ids, 0, fed)
    names = ["tokens", "logp", "lengths", "finished", "last", "step", "slot"]
    for name, g, w in zip(names, got, state):
        assert torch.equal(g, w), name
    return got


@pytest.mark.parametrize("B,block", [(37, 16), (5, 1024), (1, 1024)], ids=["3-blocks", "5", "1"])
@pytest.mark.parametrize("stop", [[3, 7], [], [11]], ids=["two-stops", "no-stop", "one-stop"])
@pytest.mark.parametrize("fed", [True, False], ids=["fed", "prefill"])
def test_record_kernel_is_the_torch_ops(B, block, stop, fed, monkeypatch):
    monkeypatch.setattr(decode_record, "BLOCK_ROWS", block)
    stop_ids = torch.tensor(stop, dtype=torch.int64, device=DEVICE)
    want, token, token_logp = _state(B, 6, seed=B + len(stop))
    if stop:  # row 0 is running and samples a stop token
        token[0], want[3][0] = stop[-1], False
    was_finished = want[3].clone()
    got = _record_both(want, token, token_logp, stop_ids, fed)
    step, slot = got[5], got[6]
    assert int(step) == 3 and int(slot) == (6 if fed else 5)
    assert bool(got[3][0]) == bool(stop)  # row 0 ended by its stop token, if there are stops
    assert int(got[0][0, 2]) == int(token[0])  # a running row keeps its sample at column 2
    # rows finished before this step get the pad id and log-prob 0
    assert bool((got[0][was_finished, 2] == 0).all()) and bool((got[1][was_finished, 2] == 0).all())


def test_record_launcher_says_what_it_cannot_take():
    state, token, token_logp = _state(4, 6, seed=0)
    stop_ids = torch.tensor([1], device=DEVICE)
    with pytest.raises(ValueError, match="per-row"):
        decode_record.record_step_triton(*state, token[:3], token_logp, stop_ids, 0, True)
    with pytest.raises(ValueError, match="contiguous"):
        bad = list(state)
        bad[0] = state[0].t().contiguous().t()
        decode_record.record_step_triton(*bad, token, token_logp, stop_ids, 0, True)


@pytest.mark.parametrize("n_stop", [300, 2000], ids=["300-stop-ids", "over-the-kernel's-limit"])
def test_many_stop_ids(n_stop):
    stop_ids = torch.arange(5, 5 + n_stop, dtype=torch.int64, device=DEVICE)  # ids 5 and up
    want, token, token_logp = _state(37, 6, seed=n_stop)
    token[0], want[3][0] = 5 + n_stop - 1, False  # row 0 samples the last stop id
    got = _record_both(want, token, token_logp, stop_ids, True)
    assert bool(got[3][0])


@pytest.mark.parametrize("B, group", [(1, 1), (5, 1), (6, 3), (1500, 1), (3000, 6), (40, 8)])
@pytest.mark.parametrize("pattern", ["all", "one-running", "none", "random"])
def test_live_groups_kernel_counts_the_groups_with_a_row_running(B, group, pattern):
    """The host's finish look: the kernel's count equals the torch reference, written on the
    device or, on a GPU, straight into pinned host memory (1500 groups: two blocks of the loop)."""
    finished = torch.ones(B, dtype=torch.bool)
    if pattern == "one-running":
        finished[B * 2 // 3] = False  # in the second block at 1500 groups
    elif pattern == "none":
        finished[:] = False
    elif pattern == "random":
        finished = torch.rand(B, generator=torch.Generator().manual_seed(B)) < 0.8
    want = {"all": 0, "one-running": 1, "none": B // group}.get(pattern)
    if want is None:
        want = sum(not bool(finished[i : i + group].all()) for i in range(0, B, group))
    finished = finished.to(DEVICE)
    assert int(decode_record.live_groups_ref(finished, group)) == want
    outs = [torch.tensor(-1, dtype=torch.int32, device=DEVICE)]  # a wrong answer first
    if ON_GPU:
        outs.append(torch.tensor(-1, dtype=torch.int32).pin_memory())
    for out in outs:
        decode_record.live_groups_triton(finished, group, out)
        if ON_GPU:
            torch.cuda.synchronize()
        assert int(out) == want


def test_live_groups_launcher_says_what_it_cannot_take():
    finished = torch.ones(4, dtype=torch.bool, device=DEVICE)
    out = torch.tensor(0, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="bool"):
        decode_record.live_groups_triton(finished.int(), 1, out)
    with pytest.raises(ValueError, match="groups of 3"):
        decode_record.live_groups_triton(finished, 3, out)
    with pytest.raises(ValueError, match="out must be"):
        decode_record.live_groups_triton(
            finished, 2, torch.zeros(2, dtype=torch.int32, device=DEVICE)
        )

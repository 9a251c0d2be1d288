"""The decode step's bookkeeping kernel (`kernels.decode_record`) against its torch reference:
tokens and log-probs at the step's column, pad and 0 for finished rows, lengths, stop tokens ending
rows (several stop ids, none), the next input, and the counters advancing."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, NEEDS_TRITON, ON_GPU

from fastgrpo.kernels import decode_record

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


@pytest.mark.parametrize("B", [1, 5, 1500])
@pytest.mark.parametrize("pattern", ["all", "one-running", "none"])
def test_all_finished_kernel_is_torch_all(B, pattern):
    """The host's finish look: the kernel's answer equals finished.all(), written on the device or,
    on a GPU, straight into pinned host memory (1500 rows: two blocks of the kernel's loop)."""
    finished = torch.ones(B, dtype=torch.bool)
    if pattern == "one-running":
        finished[B * 2 // 3] = False  # in the second block at 1500 rows
    elif pattern == "none":
        finished[:] = False
    finished = finished.to(DEVICE)
    outs = [torch.tensor(not bool(finished.all().item()), device=DEVICE)]  # the wrong answer first
    if ON_GPU:
        outs.append(torch.tensor(not bool(finished.all().item())).pin_memory())
    for out in outs:
        decode_record.all_finished_triton(finished, out)
        if ON_GPU:
            torch.cuda.synchronize()
        assert bool(out) == bool(finished.all()) == (pattern == "all")


def test_all_finished_launcher_says_what_it_cannot_take():
    finished = torch.ones(4, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="bool"):
        decode_record.all_finished_triton(finished.int(), torch.tensor(True, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        decode_record.all_finished_triton(finished, torch.zeros(2, dtype=torch.bool, device=DEVICE))

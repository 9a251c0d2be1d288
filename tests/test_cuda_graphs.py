"""Every capture pauses Python's cyclic garbage collector (`fastgrpo/cuda_graphs.py`): on the CPU
with torch's capture context stood in for; on a GPU (marked `gpu`), a capture during which a
collection would destroy another graph held in a reference cycle."""

from __future__ import annotations

import gc
from contextlib import contextmanager

import pytest
import torch

from fastgrpo import cuda_graphs


def test_the_collector_is_paused_inside_a_capture_and_restored_after_even_when_it_raises(
    monkeypatch,
):
    seen = []

    @contextmanager
    def graph(g, **options):
        seen.append((gc.isenabled(), options))
        yield

    monkeypatch.setattr(torch.cuda, "graph", graph)
    assert gc.isenabled()
    with cuda_graphs.capture(object(), pool=7):
        assert not gc.isenabled()
    assert gc.isenabled() and seen == [(False, {"pool": 7})]
    with pytest.raises(RuntimeError, match="captured op failed"):
        with cuda_graphs.capture(object()):
            raise RuntimeError("captured op failed")
    assert gc.isenabled()
    gc.disable()  # a caller that had it off keeps it off
    try:
        with cuda_graphs.capture(object()):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def _graph_in_a_cycle(x: torch.Tensor) -> None:
    """A recorded graph (x += 1), left unreachable inside a reference cycle that no collection
    has seen yet (made with the collector off, so it sits in the youngest generation)."""
    gc.collect()
    gc.disable()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.add_(1)
    holder = [g]
    holder.append(holder)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_capture_survives_a_collection_that_would_destroy_another_graph():
    """Inside the capture the collection threshold drops to 1: any Python allocation there would
    start a collection freeing the cyclic graph (a call CUDA refuses during a capture), were the
    collector not paused."""
    thresholds = gc.get_threshold()
    try:
        _graph_in_a_cycle(torch.zeros(4, device="cuda"))
        y = torch.zeros(4, device="cuda")
        g = torch.cuda.CUDAGraph()
        with cuda_graphs.capture(g):
            gc.set_threshold(1)
            y.add_(2)
            _ = [[] for _ in range(1000)]
        g.replay()
        g.replay()
    finally:
        gc.set_threshold(*thresholds)
        gc.enable()
    gc.collect()  # the cyclic graph goes now, outside any capture
    torch.cuda.synchronize()
    assert y.tolist() == [4.0, 4.0, 4.0, 4.0]

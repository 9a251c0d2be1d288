"""CUDA graph capture as every capture in fastgrpo runs it (the engine's prefill and decode steps,
the update's layers, LoRA's merged refresh).

Python's cyclic garbage collector stays paused while a graph is captured. A collection that
starts inside a capture (any allocation of Python objects can start one) may free another CUDA
graph held in a reference cycle, and destroying a graph is a call CUDA refuses while a stream
captures: the refusal invalidates the capture being made, and the step fails with a cuBLAS or
Triton error far from the cause. Seen on an H100 when a test process had left such cycles behind
(torch logged "operation not permitted when stream is capturing (function reset)").
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

import torch


@contextmanager
def capture(graph: torch.cuda.CUDAGraph, **options):
    """`torch.cuda.graph(graph, **options)` with the cyclic garbage collector paused inside
    (restored as it was, also when the capture raises)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, **options):
            yield
    finally:
        if was_enabled:
            gc.enable()

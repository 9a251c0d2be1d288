"""Where a step's time goes: named phases, per-phase seconds, and torch.profiler traces.

Each phase of a GRPO step (rollout, reward, reference, old_logprobs, update, optimizer) runs inside
`phase(name)`: an NVTX range on a GPU, which Nsight Systems shows over the kernels it launched, and
a torch.profiler label, which a trace shows on the CPU too. `PhaseTimer` turns the same phases into
the step's `time/<name>` metrics. `StepProfiler` records chosen training steps with torch.profiler
(`fastgrpo train --profile N`) and writes a Chrome trace into the run folder; open it in
https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import torch

# NVTX calls raise on builds without CUDA: probe once (a test switches it on with a stand-in).
NVTX = torch.cuda.is_available()


@contextmanager
def phase(name: str):
    """Label a region: an NVTX range where CUDA is available, and a torch.profiler range."""
    if NVTX:
        torch.cuda.nvtx.range_push(name)
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        if NVTX:
            torch.cuda.nvtx.range_pop()


# True: the GPU phase timer also waits for the device at every phase boundary (profiles)
SYNCHRONIZE_PHASES = False


class PhaseTimer:
    """Seconds per phase of one step, as `time/<name>` entries of `times`.

    `with timer("update"):` times a phase and labels it with `phase("grpo/update")`. A phase run
    several times (the optimizer steps of a rollout) adds up, and a phase nested in another is
    left out of the outer one's time: "update" is the forward and backward passes, "optimizer"
    the steps between them.

    On a GPU the phases are CUDA events on the current stream, read when `times` is (one wait, at
    the end of the step), not a synchronisation at every boundary: each phase spans the GPU's
    timeline from its start marker to its end marker, so its kernels count in it and in no other
    phase, and the host can queue the next phase while the GPU finishes this one (a host-only
    phase, such as the reward's text round trip, spans the time the host spent on it). On the
    CPU, wall time. `SYNCHRONIZE_PHASES` (set by benchmarks/lab/profile_step.py, which attributes
    kernels to phases by time) also makes the host wait for the GPU at each boundary.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._cuda = device.type == "cuda"
        self._order: dict[str, None] = {}  # phases in the order they start
        self._cpu_times: dict[str, float] = {}
        self._nested = [0.0]  # CPU: per open phase, seconds spent in the phases nested in it
        # GPU: per phase run, [key, start event, end event, index of the enclosing run or -1]
        self._spans: list[list] = []
        self._open: list[int] = []

    @contextmanager
    def __call__(self, name: str):
        key = f"time/{name}"
        self._order.setdefault(key)
        if self._cuda:
            with self._gpu_span(key), phase(f"grpo/{name}"):
                yield
            return
        self._cpu_times.setdefault(key, 0.0)
        self._nested.append(0.0)
        start = time.perf_counter()
        try:
            with phase(f"grpo/{name}"):
                yield
        finally:
            elapsed = time.perf_counter() - start
            nested = self._nested.pop()
            self._nested[-1] += elapsed
            self._cpu_times[key] += elapsed - nested

    @contextmanager
    def _gpu_span(self, key: str):
        if SYNCHRONIZE_PHASES:
            torch.cuda.synchronize(self.device)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        index = len(self._spans)
        self._spans.append([key, start, None, self._open[-1] if self._open else -1])
        self._open.append(index)
        try:
            yield
        finally:
            if SYNCHRONIZE_PHASES:
                torch.cuda.synchronize(self.device)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans[index][2] = end
            self._open.pop()

    @property
    def times(self) -> dict[str, float]:
        """{"time/<phase>": seconds}; on a GPU this waits for the phases' end markers."""
        if not self._cuda:
            return {key: self._cpu_times[key] for key in self._order}
        if any(span[2] is not None for span in self._spans):
            torch.cuda.synchronize(self.device)  # every marker, whatever its stream
        seconds = [
            span[1].elapsed_time(span[2]) / 1e3 if span[2] is not None else 0.0
            for span in self._spans
        ]
        own = list(seconds)
        for index, span in enumerate(self._spans):
            if span[3] >= 0:
                own[span[3]] -= seconds[index]
        out = dict.fromkeys(self._order, 0.0)
        for span, value in zip(self._spans, own):
            out[span[0]] += value
        return out


def profiled_steps(num_steps: int, start_step: int, total_steps: int) -> tuple[int, int] | None:
    """(first, last) global step numbers to record, or None.

    The first step a process runs pays for warm-up (allocations, Triton compilation, CUDA graph
    capture), so recording starts one step later unless that is the only step left to run.
    """
    remaining = total_steps - start_step
    if num_steps <= 0 or remaining <= 0:
        return None
    first = start_step + (2 if remaining > 1 else 1)
    return first, min(first + num_steps - 1, total_steps)


class StepProfiler:
    """Records training steps `first..last` (1-based, global) with torch.profiler and writes one
    Chrome trace, `<run_dir>/profile/trace_steps_<first>-<last>.json`.

    The profiler runs from the start of step `first` until `finish()`, which the loop calls after
    step `last` (or when it stops early), so whatever the loop does between recorded steps
    (metrics, a checkpoint, an evaluation) is in the trace too. Profiling reads no random numbers
    and changes no tensor: the run's results stay the same.
    """

    def __init__(self, run_dir: Path, steps: tuple[int, int] | None, device: torch.device):
        self.first, self.last = steps or (None, None)
        self.folder = Path(run_dir) / "profile"
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = None
        self._last_done: int | None = None

    @contextmanager
    def step(self, number: int):
        """Wrap the training step numbered `number`; recording starts with step `first`."""
        if number == self.first:
            self._profiler = torch.profiler.profile(activities=self.activities, record_shapes=False)
            self._profiler.start()
        with phase(f"grpo/step {number}"):
            yield
        if self._profiler is not None:
            self._last_done = number

    def finish(self) -> Path | None:
        """Stop recording and write the trace of the steps recorded; its path, or None."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return None
        profiler.stop()
        if self._last_done is None:  # the first recorded step did not complete
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"trace_steps_{self.first}-{self._last_done}.json"
        profiler.export_chrome_trace(str(path))
        return path

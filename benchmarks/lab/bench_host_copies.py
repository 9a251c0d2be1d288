"""Host time of a host-to-device copy while the GPU is busy: blocking, pageable non-blocking, and
pinned non-blocking (`fastgrpo.transfer.to_device`).

Why: the trainer copies small host-built tensors (packed layouts, rewards, prompt ids) to the GPU
in every step while the GPU still has queued work. A blocking `tensor.to("cuda")` waits for that
queue to drain before the host can go on; the two non-blocking forms do not.

How: ~40 ms of matmuls are queued, then each form is timed on the host over many calls (a fresh
host tensor each call, as the trainer makes them), at three sizes. Prints a table and one JSON line.

Run on a CUDA GPU:  python -m benchmarks.lab.bench_host_copies
"""

from __future__ import annotations

import json
import subprocess
import time

import torch

from fastgrpo.transfer import to_device  # noqa: E402

SIZES = (1_000, 30_000, 300_000)  # int64 elements: 8 KB, 240 KB, 2.4 MB


def host_us(copy, elements: int, device, calls: int) -> float:
    """Mean host microseconds per copy, measured with the GPU's queue full of matmuls."""
    busy = torch.randn(8192, 8192, device=device)
    for _ in range(10):
        copy(torch.arange(elements))
    torch.cuda.synchronize(device)
    for _ in range(25):  # ~40 ms of work on an H100
        busy = busy @ busy
        busy /= busy.norm()
    start = time.perf_counter()
    for _ in range(calls):
        copy(torch.arange(elements))
    seconds = time.perf_counter() - start
    torch.cuda.synchronize(device)
    return seconds / calls * 1e6


def main():
    device = torch.device("cuda")
    forms = {
        "blocking .to(device)": (lambda x: x.to(device), 5),
        "pageable, non_blocking": (lambda x: x.to(device, non_blocking=True), 200),
        "pinned, non_blocking (to_device)": (lambda x: to_device(x, device), 200),
    }
    results = []
    print(f"{'form':34s}" + "".join(f"{f'{n * 8 // 1000} KB':>12s}" for n in SIZES))
    for name, (copy, calls) in forms.items():
        row = {"form": name, "host_us": [host_us(copy, n, device, calls) for n in SIZES]}
        results.append(row)
        print(f"{name:34s}" + "".join(f"{us:10.0f} us" for us in row["host_us"]))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        json.dumps(
            {
                "bench": "host_copies",
                "gpu": torch.cuda.get_device_name(device),
                "torch": torch.__version__,
                "commit": commit,
                "bytes": [n * 8 for n in SIZES],
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()

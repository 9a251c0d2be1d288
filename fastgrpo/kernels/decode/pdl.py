"""Programmatic dependent launch (PDL) for the small kernels of a decode step (Hopper and newer).

What: a kernel launched with `**launch_options()` (its `PDL` constexpr and the launch flag) calls
`start(PDL)` first, which lets the next kernel in the stream put its programs on the SMs at once, and
`wait(PDL)` before it reads or writes anything an earlier kernel of the stream touches; that wait
returns when the previous kernel has finished and its writes are visible (and, since every
kernel waits the same way, all earlier ones too). Between the two a kernel may start reading
what no kernel of the step writes: `prefetch_l2` pulls weight rows into L2.

Why: a decode step of the 0.5B model is ~200 kernels of 3-10 us, each paying a fixed ~3.5 us of
launch, ramp-up and tail (benchmarks/HISTORY.md). With PDL the next kernel is resident and its
weights are on their way while the previous one drains.

Reference: with `FASTGRPO_PDL=0`, on other GPUs, under the interpreter, or with a Triton without
the intrinsics, `active()` is False and the same kernels run as plain launches; both must give
bitwise the same results (the waits only order memory, they compute nothing).
"""

from __future__ import annotations

import functools

import torch

from fastgrpo import switches
from fastgrpo.kernels.support import gluon, interpreting, triton

ENABLED = switches.PDL

if triton is not None:
    import triton.language as tl

    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # a Triton without the intrinsics: PDL stays off
        gdc_launch_dependents = gdc_wait = None

    @triton.jit
    def start(PDL: tl.constexpr):
        """Let the next kernel of the stream launch its programs now."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def wait(PDL: tl.constexpr):
        """Block until the previous kernel of the stream has finished and its writes are visible."""
        if PDL:
            gdc_wait()

    @triton.jit
    def prefetch_l2(ptrs, PDL: tl.constexpr):
        """Ask L2 for the 128-byte lines at `ptrs` (any shape), without waiting for them."""
        if PDL:
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
                "=r,l",
                [ptrs],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )


def active() -> bool:
    """Whether kernels here should be compiled and launched with PDL on the current device."""
    return ENABLED and _supported(torch.cuda.current_device() if torch.cuda.is_available() else -1)


@functools.cache
def _supported(device: int) -> bool:
    if device < 0 or triton is None or gdc_wait is None or interpreting():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options() -> dict:
    """Keywords for a launch of a kernel with a `PDL` constexpr: `PDL=True` and `launch_pdl=True`
    where `active()`, else `PDL=False` (a plain launch)."""
    return {"PDL": True, "launch_pdl": True} if active() else {"PDL": False}


gluon_start = gluon_wait = None  # without Gluon: the Gluon kernels are not defined either
if gluon is not None:  # the same waits for the Gluon kernels (their `PDL` constexpr decides)
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def gluon_wait(PDL: gl.constexpr):
        if PDL:  # griddepcontrol.wait: the previous kernel is done and its writes are visible
            gl.inline_asm_elementwise(
                "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
            )

    @gluon.jit
    def gluon_start(PDL: gl.constexpr):
        if PDL:  # the next kernel of the stream may put its programs on the SMs now
            gl.inline_asm_elementwise(
                "griddepcontrol.launch_dependents; // $0",
                "=r",
                [],
                dtype=gl.int32,
                is_pure=False,
                pack=1,
            )

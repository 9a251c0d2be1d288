"""What every kernel file asks of its surroundings, probed once: is Triton (and its Gluon layer)
installed, is it interpreting, how many multiprocessors has the GPU, can TMA read a tensor.

Why one module: Triton is optional (`pip install fastgrpo` on a CPU machine or a Mac has none).
Every kernel file takes `triton` and `gluon` from here, None when absent, defines its kernels only
when they are not, and its public op then runs the `*_ref` beside it; so importing any module of
`fastgrpo.kernels` works without Triton, and Triton's own names are imported only where a kernel
is defined.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs: the references serve
    triton = TensorDescriptor = None

try:  # Gluon, triton >= 3.5's experimental layer; the Gluon kernels here were written against 3.6
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier  # noqa: F401
except ImportError:  # no triton, or a triton without this Gluon API: the Triton kernels serve
    gluon = gl = None

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
if triton is not None:  # the same, for kernels: a global a kernel reads must be a constexpr
    _LOG2E = tl.constexpr(LOG2E)
    _LN2 = tl.constexpr(LN2)


def _interpreting() -> bool:
    """Whether Triton runs its kernels in the (numpy) interpreter, on the CPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def multiprocessors(device: torch.device | int | None = None) -> int:
    """The SM count of a CUDA device (None: the current one), cached: `get_device_properties`
    costs tens of microseconds of host time, and launchers that size their grids by it run
    thousands of times per training step."""
    index = device.index if isinstance(device, torch.device) else device
    return _multiprocessors(torch.cuda.current_device() if index is None else index)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _hopper(device_index: int) -> bool:
    """Whether the CUDA device is a Hopper GPU (sm_90), cached: the capability query reads the
    device properties, tens of microseconds, and the Gluon kernels' `applies` run per launch."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def aligned_empty(rows, cols, **kwargs):
    """An uninitialised (rows, cols) tensor whose rows start on 16 bytes (a view of a wider buffer
    when cols * itemsize is not a multiple of 16), as bulk tensor copies (TMA) need."""
    itemsize = torch.empty((), dtype=kwargs.get("dtype")).element_size()
    align = 16 // itemsize
    return torch.empty(rows, -(-cols // align) * align, **kwargs)[:, :cols]


def tma_readable(x) -> bool:
    """Whether a bulk tensor copy (TMA) can read the 2-D x where it is: row-major, rows and base
    16-byte aligned."""
    return (
        x.stride(1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0
    )


def _tma_ready(x):
    """x itself when `tma_readable`, else a copy into an `aligned_empty` buffer (TMA reads past
    its columns as zeros)."""
    if tma_readable(x):
        return x
    return aligned_empty(*x.shape, dtype=x.dtype, device=x.device).copy_(x)


def _layout(block):
    """The shared-memory layout of a bf16 Gluon tile of shape `block`."""
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def warn_not_compiled(kernel: str, error: Exception, instead: str) -> None:
    """The one warning a Gluon kernel's launcher gives when the kernel does not compile with the
    installed triton (the Gluon API it was written against, 3.6, has moved): which kernel, why,
    and what serves instead. The launcher also sets its module's `_failed`, so it warns once."""
    warnings.warn(
        f"{kernel} did not compile with triton {triton.__version__} ({type(error).__name__}: "
        f"{str(error).splitlines()[0][:200]}); using {instead} instead",
        stacklevel=3,
    )

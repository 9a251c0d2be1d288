"""What every kernel file asks of its surroundings, probed once: is Triton (and its Gluon layer)
installed, is it interpreting, how many multiprocessors and how much shared memory has the GPU,
can TMA read a tensor, does a kernel take this dtype.

Why one module: Triton is optional (`pip install fastgrpo` on a CPU machine or a Mac has none).
Every kernel file takes `triton` and `gluon` from here, None when absent, defines its kernels only
when they are not, and its public op then runs the `*_ref` beside it; so importing any module of
`fastgrpo.kernels` works without Triton, and Triton's own names are imported only where a kernel
is defined.
"""

from __future__ import annotations

import functools
import logging
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

log = logging.getLogger("fastgrpo.kernels")

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
if triton is not None:  # the same, for kernels: a global a kernel reads must be a constexpr
    LOG2E_CONSTEXPR = tl.constexpr(LOG2E)
    LN2_CONSTEXPR = tl.constexpr(LN2)


def interpreting() -> bool:
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


def shared_memory(device: torch.device | int | None = None) -> int:
    """The most shared memory one program (thread block) may take on a CUDA device (None: the
    current one), in bytes: 227 KiB on an H100, 163 on an A100, 99 on consumer GPUs. Cached."""
    index = device.index if isinstance(device, torch.device) else device
    return _shared_memory(torch.cuda.current_device() if index is None else index)


@functools.cache
def _shared_memory(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", 227 * 1024)


@functools.cache
def is_hopper(device_index: int) -> bool:
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


def tma_ready(x):
    """x itself when `tma_readable`, else a copy into an `aligned_empty` buffer (TMA reads past
    its columns as zeros)."""
    if tma_readable(x):
        return x
    return aligned_empty(*x.shape, dtype=x.dtype, device=x.device).copy_(x)


def bf16_shared_layout(block):
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


HALF_DTYPES = (torch.bfloat16, torch.float16)
_SHORT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def kernel_dtype(op: str, dtype: torch.dtype, dtypes: tuple = HALF_DTYPES) -> bool:
    """Whether a kernel tuned for `dtypes` takes `dtype`; if not, `reference_notice` says once
    that `op` runs its PyTorch reference. Dispatches ask it last, once the kernel would otherwise
    serve (CUDA tensors, Triton installed), so CPU runs say nothing."""
    if dtype in dtypes:
        return True
    names = "/".join(_SHORT_NAMES.get(d, str(d)) for d in dtypes)
    dtype_name = str(dtype).removeprefix("torch.")
    reference_notice(op, f"for {dtype_name} (its Triton kernel is tuned for {names})")
    return False


_noticed: set[tuple[str, str]] = set()


def reference_notice(op: str, why: str) -> None:
    """One line, once per process for each (op, why): `op` runs its PyTorch reference, and why."""
    if (op, why) not in _noticed:
        _noticed.add((op, why))
        log.warning("fastgrpo: %s runs its PyTorch reference %s", op, why)

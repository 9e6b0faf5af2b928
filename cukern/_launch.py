"""Kernel launches at the driver's cost: ``cuLaunchKernel`` with a parameter buffer built once.

CuPy's ``RawKernel.__call__`` converts every argument to a Python wrapper object and rebuilds
the parameter list on each call (about 5 us more than the launch itself for a softmax's 11
arguments on an H100). A :class:`RawLaunch` keeps one 8-byte slot per argument and an array of
pointers to the slots; a call writes the slots and hands both to the driver, which copies the
values before it returns. Arguments of a call, in the kernel's order:

- a CuPy array: its device pointer;
- a Python int: the slot's 64 bits as they are (a pointer, or a value from :func:`bits`);
- ``None``: a null pointer;
- a NumPy scalar of at most 8 bytes: its bytes (little-endian, as the kernel reads them);
- :class:`ByValue`: a struct passed by value (its own buffer).

Every launch runs on CuPy's current stream and device; the kernel handle must be the current
device's (the ops key their launches by device and check it).
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

__all__ = ["ByValue", "RawLaunch", "bits"]

_MASK64 = (1 << 64) - 1

try:
    import cupy as _cp
    from cupy_backends.cuda.api.driver import CUDADriverError as _DriverError
    from cupy_backends.cuda.api.driver import launchKernel as _launch_kernel

    _ndarray = _cp.ndarray
    _current_stream = _cp.cuda.get_current_stream
except ImportError:  # pragma: no cover - exercised only where CuPy is missing
    _cp = _launch_kernel = _current_stream = None
    _ndarray = type(None)
    _DriverError = RuntimeError
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT


def bits(value) -> int:
    """A scalar kernel argument as its slot's 64 bits: a NumPy scalar's bytes (little-endian,
    zero-extended past its size), or a Python int as a 64-bit pattern."""
    if type(value) is int:
        return value & _MASK64
    if isinstance(value, np.generic) and value.dtype.itemsize <= 8:
        return int.from_bytes(value.tobytes(), "little")
    raise TypeError(f"kernel argument: a scalar of at most 8 bytes expected, got "
                    f"{type(value).__name__}")


class ByValue:
    """A struct argument passed by value: a structured NumPy scalar or size-1 array's bytes."""

    __slots__ = ("buffer",)

    def __init__(self, value):
        data = np.ascontiguousarray(value).tobytes()
        self.buffer = ctypes.create_string_buffer(data, len(data))


def _slot(a) -> int:
    """One argument's slot value (the slow cases of :meth:`RawLaunch.__call__`)."""
    if a is None:
        return 0
    if isinstance(a, _ndarray):
        return a.data.ptr
    return bits(a)


class RawLaunch:
    """One kernel with its grid, block and dynamic shared memory fixed, and optionally fixed
    trailing arguments (``tail``: slot values, NumPy scalars or :class:`ByValue`); a call
    passes the leading arguments and launches on CuPy's current stream."""

    __slots__ = ("function", "config", "tail", "_keep", "_slots", "_params", "_nargs", "_lock")

    def __init__(self, function: int, grid, block, smem: int = 0, tail: tuple = ()):
        self.function = function  # CUfunction handle (cupy Function.ptr)
        g = tuple(grid) if isinstance(grid, tuple) else (grid,)
        b = tuple(block) if isinstance(block, tuple) else (block,)
        g, b = g + (1,) * (3 - len(g)), b + (1,) * (3 - len(b))
        self.config = (*map(int, g), *map(int, b), int(smem or 0))
        self.tail = tuple(t if isinstance(t, ByValue) else _slot(t) for t in tail)
        self._nargs = -1
        self._lock = threading.Lock()

    def _build(self, nargs: int) -> None:
        """Slots for ``nargs`` leading arguments and the tail, and the pointer array."""
        scalars = [t for t in self.tail if not isinstance(t, ByValue)]
        slots = (ctypes.c_uint64 * max(1, nargs + len(scalars)))()
        base = ctypes.addressof(slots)
        pointers, k = [], nargs
        for i in range(nargs):
            pointers.append(base + 8 * i)
        for t in self.tail:
            if isinstance(t, ByValue):
                pointers.append(ctypes.addressof(t.buffer))
            else:
                slots[k] = t
                pointers.append(base + 8 * k)
                k += 1
        params = (ctypes.c_void_p * max(1, len(pointers)))(*pointers)
        self._keep = params
        self._slots, self._params, self._nargs = slots, ctypes.addressof(params), nargs

    def __call__(self, *args) -> None:
        nd = _ndarray
        values = [a.data.ptr if type(a) is nd else a if type(a) is int else _slot(a)
                  for a in args]
        g0, g1, g2, b0, b1, b2, smem = self.config
        with self._lock:  # the slots are shared: one launch writes and reads them at a time
            if len(values) != self._nargs:
                self._build(len(values))
            self._slots[:self._nargs] = values
            try:
                _launch_kernel(self.function, g0, g1, g2, b0, b1, b2, smem,
                               _current_stream().ptr, self._params, 0)
            except _DriverError as e:
                if e.status != _INVALID_CONTEXT:
                    raise
                # a thread with no runtime call yet (a Dask or user thread whose arrays came
                # from CuPy's pool) has no current context: set it up, as CuPy's launch does
                _cp.cuda.runtime.free(0)
                _launch_kernel(self.function, g0, g1, g2, b0, b1, b2, smem,
                               _current_stream().ptr, self._params, 0)

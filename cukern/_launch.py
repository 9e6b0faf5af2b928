"""Kernel launches at the driver's cost: ``cuLaunchKernel`` with a parameter buffer built once.

CuPy's ``RawKernel.__call__`` converts every argument to a Python wrapper object and rebuilds
the parameter list on each call (about 5 us more than the launch itself for a softmax's 11
arguments on an H100). A :class:`RawLaunch` keeps one 8-byte slot per argument and an array of
pointers to the slots; a call writes the slots and hands both to the driver, which copies the
values before it returns. Arguments of a call, in the kernel's order:

- a CuPy array: its device pointer;
- a :class:`ByPointer` (a PyTorch tensor as the fast paths see it): its ``ptr``;
- a Python int: the slot's 64 bits as they are (a pointer, or a value from :func:`bits`);
- ``None``: a null pointer;
- a NumPy scalar of at most 8 bytes: its bytes (little-endian, as the kernel reads them);
- :class:`ByValue`: a struct passed by value (its own buffer).

Every launch runs on CuPy's current stream and device; the kernel handle must be the current
device's (the ops key their launches by device and check it). A kernel that reads its cluster's
size at run time (sm_90) launches through ``cuLaunchKernelEx`` with the cluster-dimension
attribute (:func:`launch_config`).
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

__all__ = ["ByPointer", "ByValue", "LaunchConfig", "RawLaunch", "bits", "driver_function",
           "launch_config"]

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
_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_uint * 3), ("rest", ctypes.c_char * 52)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def launch_config(grid, block, smem: int = 0, cluster: int = 1) -> LaunchConfig:
    """A ``CUlaunchConfig`` (its stream null) with clusters of ``cluster`` blocks along x where
    ``cluster > 1``; the structure keeps its attribute alive."""
    g = (tuple(grid) if isinstance(grid, tuple) else (grid,)) + (1, 1)
    b = (tuple(block) if isinstance(block, tuple) else (block,)) + (1, 1)
    config = LaunchConfig(*map(int, g[:3]), *map(int, b[:3]), int(smem or 0))
    if cluster > 1:
        attr = _LaunchAttribute(id=_CLUSTER_DIMENSION)
        attr.value[:] = (int(cluster), 1, 1)
        config._attr = attr
        config.attrs, config.numAttrs = ctypes.pointer(attr), 1
    return config


_driver_functions: dict[str, object] = {}


def driver_function(name: str, argtypes):
    """A CUDA driver entry point through ctypes (returning CUresult), or None where the driver
    lacks it."""
    if name not in _driver_functions:
        try:
            fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
            fn.restype, fn.argtypes = ctypes.c_int, argtypes
        except (OSError, AttributeError):
            fn = None
        _driver_functions[name] = fn
    return _driver_functions[name]


def _launch_kernel_ex():
    """The driver's cuLaunchKernelEx; RuntimeError where the driver lacks it."""
    fn = driver_function("cuLaunchKernelEx", [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                             ctypes.c_void_p, ctypes.c_void_p])
    if fn is None:
        raise RuntimeError("cuLaunchKernelEx is missing from the CUDA driver: clusters sized at "
                           "launch need a driver of CUDA 12 or newer")
    return fn


def _launch_ex(fn, config: LaunchConfig, function: int, params: int) -> None:
    config.hStream = _current_stream().ptr or None
    status = fn(ctypes.byref(config), function, params, None)
    if status:
        raise _DriverError(status)


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


class ByPointer:
    """Base of device arrays passed to a launch by their address ``ptr`` (an int): PyTorch
    tensors as the ops' fast paths see them (:class:`cukern._interop.TensorView`)."""

    __slots__ = ()


def _slot(a) -> int:
    """One argument's slot value (the slow cases of :meth:`RawLaunch.__call__`)."""
    if a is None:
        return 0
    if isinstance(a, _ndarray):
        return a.data.ptr
    if isinstance(a, ByPointer):
        return a.ptr
    return bits(a)


class RawLaunch:
    """One kernel with its grid, block and dynamic shared memory fixed, and optionally fixed
    trailing arguments (``tail``: slot values, NumPy scalars or :class:`ByValue`); a call
    passes the leading arguments and launches on CuPy's current stream. ``cluster > 1``: the
    kernel reads its cluster's size at run time, and launches with it as an attribute."""

    __slots__ = ("function", "config", "tail", "_ex", "_ex_fn", "_keep", "_slots", "_params",
                 "_nargs", "_lock")

    def __init__(self, function: int, grid, block, smem: int = 0, tail: tuple = (),
                 cluster: int = 1):
        self.function = function  # CUfunction handle (cupy Function.ptr)
        g = tuple(grid) if isinstance(grid, tuple) else (grid,)
        b = tuple(block) if isinstance(block, tuple) else (block,)
        g, b = g + (1,) * (3 - len(g)), b + (1,) * (3 - len(b))
        self.config = (*map(int, g), *map(int, b), int(smem or 0))
        # built once; its stream is set at each launch, under the lock
        self._ex = launch_config(g, b, smem, cluster) if cluster > 1 else None
        self._ex_fn = None  # cuLaunchKernelEx, looked up at the first launch of clusters
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
        lock = self._lock  # the slots are shared: one launch writes and reads them at a time
        lock.acquire()
        try:
            if len(values) != self._nargs:
                self._build(len(values))
            self._slots[:self._nargs] = values
            if self._ex is not None:
                return self._launch_clusters()
            g0, g1, g2, b0, b1, b2, smem = self.config
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
        finally:
            lock.release()

    def _launch_clusters(self) -> None:
        if self._ex_fn is None:
            self._ex_fn = _launch_kernel_ex()
        try:
            _launch_ex(self._ex_fn, self._ex, self.function, self._params)
        except _DriverError as e:
            if e.status != _INVALID_CONTEXT:
                raise
            _cp.cuda.runtime.free(0)  # as in __call__
            _launch_ex(self._ex_fn, self._ex, self.function, self._params)

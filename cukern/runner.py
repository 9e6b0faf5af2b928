"""The op runner: what every op shares on its way validate -> row view -> plan -> cached launch.

- accepting arrays (CuPy, or any CUDA array with ``__dlpack__``: :mod:`cukern._interop`) and
  checking them;
- describing an array as a (rows, cols) view (:class:`RowView`);
- planning with the driver's occupancy for the compiled candidate kernels;
- :class:`Launch`: a planned, compiled kernel with its fixed arguments, what the ops cache per
  layout (in a :class:`BoundedDict`), launched on the array's device and CuPy's current stream;
- :func:`check_eps`: the norms' eps, checked against the kernels' compute type.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import numbers
from typing import NamedTuple

import numpy as np

try:
    import cupy as cp
except ImportError:  # pragma: no cover - exercised only where CuPy is missing
    cp = None

from . import _compile, _device, _launch
from . import plan as _plan
from ._capture import capture_safe, keep  # noqa: F401  (the ops' capture safety)

# the ops reach these as runner.*
from ._interop import (  # noqa: F401
    Adapted,
    TensorView,
    adapt,
    empty,
    fast_arrays,
    handed_back,
    new_array,
    on_device,
    results,
    tensor_view,
    to_torch,
    torch_view,
    torch_views,
)
from ._launch import RawLaunch, bits

try:
    from ml_dtypes import bfloat16 as _bf16
except ImportError:  # pragma: no cover
    _bf16 = None

DTYPE_NAMES: dict[np.dtype, str] = {
    np.dtype(np.float16): "float16",
    np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64",
}
if _bf16 is not None:
    DTYPE_NAMES[np.dtype(_bf16)] = "bfloat16"

CACHE_SIZE = 4096  # entries of each plan and launch cache (BoundedDict)


class BoundedDict(dict):
    """A dict of at most ``maxsize`` entries, for caches keyed by shapes and strides: an insert
    into a full one first drops its older half (in insertion order; storing a key again makes
    it the newest). Lookups are plain dict lookups, so a cache hit costs what it did in a dict;
    eviction falls on misses, which plan anyway. Only ``d[key] = value`` evicts."""

    __slots__ = ("maxsize",)

    def __init__(self, maxsize: int = CACHE_SIZE):
        super().__init__()
        if maxsize < 1:
            raise ValueError(f"BoundedDict: maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize

    def __setitem__(self, key, value) -> None:
        self.pop(key, None)
        if len(self) >= self.maxsize:
            for old in list(itertools.islice(self, len(self) - self.maxsize // 2)):
                self.pop(old, None)
        dict.__setitem__(self, key, value)


def dtype_name(fn: str, arg: str, a) -> str:
    name = DTYPE_NAMES.get(a.dtype)
    if name is None:
        raise TypeError(
            f"{fn}: {arg} has dtype {a.dtype}; expected float16, bfloat16, float32 or float64")
    return name


# The normal range (smallest, largest) of each compute type: a smaller eps is 0 or subnormal
# there (1e-50 is 0 in float32: NaN on constant rows), a larger one inf.
EPS_RANGE = {name: (float(np.finfo(name).tiny), float(np.finfo(name).max))
              for name in ("float32", "float64")}


def check_eps(fn: str, eps, dtype: str) -> float:
    """``eps`` as a float: a real number, finite, > 0 and normal in the compute type of
    ``dtype`` data (float64 for float64, else float32), where the kernels add it."""
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{fn}: eps must be a real number, got {type(eps).__name__}")
    e = float(eps)
    if not math.isfinite(e) or e <= 0:
        raise ValueError(f"{fn}: eps must be finite and > 0, got {e}")
    compute = "float64" if dtype == "float64" else "float32"
    tiny, top = EPS_RANGE[compute]
    if e < tiny:
        raise ValueError(f"{fn}: eps={e} underflows {compute}, the compute type of {dtype} "
                         f"data (its smallest normal number is {tiny:g})")
    if e > top:
        raise ValueError(f"{fn}: eps={e} overflows {compute}, the compute type of {dtype} "
                         f"data (its largest number is {top:g})")
    return e


def normalize_axis(fn: str, axis, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{fn}: axis must be an int, got {type(axis).__name__}")
    nd = max(ndim, 1)
    if not -nd <= axis < nd:
        raise ValueError(f"{fn}: axis {axis} is out of range for an array of {ndim} dimensions")
    return int(axis) % nd


def check_shape_dtype(fn: str, ref_name: str, ref, arg: str, other) -> None:
    """`other` must match `ref` in shape and dtype (arrays of any kind, Dask's too)."""
    if other.shape != ref.shape:
        raise ValueError(f"{fn}: {arg} has shape {other.shape}, expected {ref.shape} "
                         f"(the shape of {ref_name})")
    if other.dtype != ref.dtype:
        raise TypeError(f"{fn}: {arg} has dtype {other.dtype}, expected {ref.dtype} "
                        f"(the dtype of {ref_name})")


def check_same(fn: str, ref_name: str, ref, arg: str, other) -> None:
    """`other` must match `ref` in shape, dtype and device."""
    check_shape_dtype(fn, ref_name, ref, arg, other)
    if other.data.device_id != ref.data.device_id:
        raise ValueError(f"{fn}: {arg} is on GPU {other.data.device_id} but {ref_name} is on "
                         f"GPU {ref.data.device_id}")


def output(fn: str, like: Adapted, out):
    """The output array: a new C-contiguous array (on the current device: call it with the
    input's device current), or ``out`` after checking it."""
    x = like.array
    if out is None:
        return cp.empty(x.shape, x.dtype)
    if like.kind == "jax":
        raise TypeError(f"{fn}: out= is not supported for JAX arrays (they are immutable)")
    o = adapt(fn, "out", out, out=True).array
    check_same(fn, "the input", x, "out", o)
    if any(s == 0 and n > 1 for s, n in zip(o.strides, o.shape)):
        raise ValueError(f"{fn}: out has overlapping elements (strides {o.strides}); it must "
                         f"be writable element by element")
    return o


def check_aliasing(fn: str, inputs, o) -> None:
    """``out`` may be an input itself (in place) but may not overlap one any other way."""
    for a in inputs:
        if a.data.ptr == o.data.ptr and a.strides == o.strides:
            continue
        if cp.may_share_memory(a, o):
            raise ValueError(f"{fn}: out overlaps an input without being that input; pass a "
                             f"separate array or the input itself")


class RowView(NamedTuple):
    """An array reduced along one axis, as (rows, cols): element (o, c, i) of its
    (outer, cols, inner) shape is at ``o * s_outer + c * s_col + i * s_inner`` elements, and
    rows = outer * inner. Contiguous rows have ``inner == 1`` and ``s_col == 1``; their row
    stride is ``s_outer``."""

    rows: int
    cols: int
    inner: int
    s_outer: int
    s_inner: int
    s_col: int

    @property
    def contiguous_rows(self) -> bool:
        return self.inner == 1 and self.s_col == 1


def layout(a, axis: int) -> RowView | None:
    """``a`` reduced along ``axis`` as a :class:`RowView`, or None when the dimensions before
    or after ``axis`` cannot be merged into one stride each."""
    shape = a.shape if a.ndim else (1,)
    item = a.itemsize
    strides = tuple(s // item for s in a.strides) if a.ndim else (1,)
    cols = shape[axis]
    s_col = strides[axis] if cols > 1 else 1
    before = _merge(shape[:axis], strides[:axis])
    after = _merge(shape[axis + 1:], strides[axis + 1:])
    if before is None or after is None:
        return None
    (outer, s_outer), (inner, s_inner) = before, after
    return RowView(outer * inner, cols, inner, s_outer, s_inner, s_col)


def trailing_layout(a, ndims: int) -> RowView | None:
    """``a`` as a :class:`RowView` whose cols are its last ``ndims`` dimensions (a
    normalisation over trailing dimensions), or None when those are not one contiguous run or
    the leading dimensions cannot be walked with a single stride."""
    lead = len(a.shape) - ndims
    item = a.itemsize
    strides = tuple(s // item for s in a.strides)
    before = _merge(a.shape[:lead], strides[:lead])
    after = _merge(a.shape[lead:], strides[lead:])
    if before is None or after is None:
        return None
    (rows, s_row), (cols, s_col) = before, after
    if cols > 1 and s_col != 1:
        return None
    return RowView(rows, cols, 1, s_row if rows > 1 else cols, 0, 1)


def _merge(shape, strides):
    """(count, stride) of dims that walk memory with a single stride, or None."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if not dims:
        return 1, 0
    count, stride = dims[-1]
    for n, s in reversed(dims[:-1]):
        if s != stride * count:
            return None
        count *= n
    return count, stride


def align_elems(item: int, pointers, strides) -> int:
    """Largest power of two (elements, up to 16) dividing every pointer and row stride."""
    a = 16
    for p in pointers:
        while a > 1 and p % (a * item):
            a //= 2
    for s in strides:
        while a > 1 and s % a:
            a //= 2
    return a


def device_spec(device_id: int) -> _device.DeviceSpec:
    """The device's spec; UnsupportedDeviceError below cukern's minimum GPU (before compiling)."""
    return _device.supported_spec(device_id)


def _context_current() -> None:
    """Makes the current device's primary context current in this thread before a driver API
    call (occupancy, kernel attributes). CuPy's launches do this themselves, but a thread that
    has made no runtime call yet (a Dask or user thread whose output came from CuPy's pool)
    has none, and the driver answers CUDA_ERROR_INVALID_CONTEXT."""
    from cupy_backends.cuda.api import driver

    if driver.ctxGetCurrent() == 0:
        cp.cuda.runtime.free(0)  # cudaFree(0): the runtime's way to set up the context


def driver_occupancy(device_id: int):
    """Occupancy from the CUDA driver for the compiled candidate kernel: blocks per SM, and
    (``occ.max_clusters``) how many clusters of a cluster plan fit on the GPU at once, which
    the GPCs' sizes can make fewer than SMs x blocks per SM / cluster size."""
    from cupy_backends.cuda.api import driver

    def occ(plan: _plan.Plan) -> int:
        with on_device(device_id):  # the kernel as loaded on, and configured for, that GPU
            kern = kernel(plan, device_id)
            if plan.smem_bytes > kern.max_dynamic_shared_size_bytes:
                return 0
            if plan.cluster > PORTABLE_CLUSTER and not _max_active_clusters(kern, plan):
                return 0  # a cluster size this device or driver does not take
            return driver.occupancyMaxActiveBlocksPerMultiprocessor(
                kern.kernel.ptr, plan.threads, plan.smem_bytes)

    def max_clusters(plan: _plan.Plan) -> int | None:
        with on_device(device_id):
            return _max_active_clusters(kernel(plan, device_id), plan)

    occ.max_clusters = max_clusters
    return occ


def _max_active_clusters(kern, plan: _plan.Plan) -> int | None:
    """Clusters of ``plan`` (its size compiled into the kernel, or a launch attribute where
    ``plan.launch_cluster``) resident at once, or None when the driver cannot say
    (cuOccupancyMaxActiveClusters, CUDA 12+)."""
    fn = _launch.driver_function("cuOccupancyMaxActiveClusters", [
        ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(_launch.LaunchConfig)])
    if fn is None or plan.cluster <= 1:
        return None
    config = _launch.launch_config((plan.cluster * 64,), plan.block, plan.smem_bytes,
                                   plan.launch_cluster)
    n = ctypes.c_int(0)
    if fn(ctypes.byref(n), ctypes.c_void_p(kern.kernel.ptr), ctypes.byref(config)) != 0:
        return None
    return n.value if n.value > 0 else None


PORTABLE_CLUSTER = 8  # larger clusters need the kernel's non-portable opt-in
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CUfunction_attribute
_non_portable: set[int] = set()  # kernels (function handles) opted in


def allow_non_portable_clusters(kern) -> None:
    """Opts a compiled kernel (``cupy.RawKernel``, its device current) into clusters past
    ``PORTABLE_CLUSTER`` blocks, once."""
    if kern.kernel.ptr in _non_portable:
        return
    from cupy_backends.cuda.api import driver

    try:
        driver.funcSetAttribute(kern.kernel.ptr, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
    except Exception:  # an older driver: the occupancy check then finds no room for it
        pass
    _non_portable.add(kern.kernel.ptr)


def kernel(plan: _plan.Plan, device_id: int):
    """The compiled kernel of a plan, allowed all the dynamic shared memory the device has
    beside the kernel's static shared memory (set once; plans of different sizes share it),
    and clusters past the portable size where its plan has one. CuPy keeps a kernel per
    device and sets attributes on the current device's: call it with ``device_id`` current."""
    kern = _compile.get_kernel(plan.family, plan.name_expression(), device_id)
    _context_current()
    if plan.cluster > PORTABLE_CLUSTER:
        allow_non_portable_clusters(kern)
    if plan.smem_bytes:
        limit = device_spec(device_id).smem_per_block_optin - kern.shared_size_bytes
        if kern.max_dynamic_shared_size_bytes != limit:
            kern.max_dynamic_shared_size_bytes = limit
    return kern


def _c_scalars(values: tuple) -> tuple:
    """Scalar kernel arguments converted once to their slots' bits (:func:`_launch.bits`), for
    arguments that stay fixed from call to call."""
    return tuple(bits(v) for v in values)


class Launch(RawLaunch):
    """A planned, compiled kernel with its fixed arguments: the cached result of planning.
    Call it with the leading arguments (:class:`cukern._launch.RawLaunch`)."""

    __slots__ = ("plan", "device_id")

    def __init__(self, plan: _plan.Plan, device_id: int, tail: tuple):
        """Compiles and configures the kernel: call it with ``device_id`` current."""
        self.plan = plan
        self.device_id = device_id
        super().__init__(kernel(plan, device_id).kernel.ptr, (plan.grid,), plan.block,
                         plan.smem_bytes, tail, cluster=plan.launch_cluster)


class AuxLaunch(RawLaunch):
    """An auxiliary kernel of a plan (the backward's partial sums and their reduction), as the
    planner shaped it (``cukern.plan.col_sums.AuxLaunch``), with its fixed arguments. Build it
    with ``device_id`` current."""

    __slots__ = ()

    def __init__(self, source: str, name: str, shape, device_id: int, tail: tuple):
        kern = _compile.get_kernel(source, name, device_id)
        super().__init__(kern.kernel.ptr, shape.grid, shape.block, 0, tail)


def plan_for(op: str, dtype: str, device_id: int, rows: int, cols: int, pointers, row_strides,
             *, strided: bool = False, switches: _plan.Switches | None = None,
             row_pointers=None) -> _plan.Plan:
    """The plan of ``op`` for a (rows, cols) view on a live device: its arrays' pointers and
    row strides (elements) set the vector width, and the driver answers occupancy.
    ``row_pointers``: the pointers of the arrays whose rows must start at the same offset for
    shifted packs (Plan.shifted), where not all are (the norms' gamma and beta are shifted to
    each row in the kernel); default ``pointers``."""
    item = _plan.ITEMSIZE[dtype]
    strides = row_strides if rows > 1 else []
    align = align_elems(item, pointers, strides)
    shift_ok = same_offsets(item, pointers if row_pointers is None else row_pointers, strides)
    return _plan.plan_rowwise(op, rows, cols, dtype, device_spec(device_id),
                              driver_occupancy(device_id), align_elems=align, strided=strided,
                              switches=switches, shift_ok=shift_ok)


def same_offsets(item: int, pointers, strides) -> bool:
    """Every row of every array starts at the same offset within its 16-byte word: pointers
    congruent modulo 16 bytes, row strides (elements) modulo 16 bytes."""
    return len({p % 16 for p in pointers}) <= 1 and len({s * item % 16 for s in strides}) <= 1


def pointer_offsets(arrays) -> tuple:
    """Each array's address modulo 16 (None for an absent one): what a launch that may take
    shifted packs was planned for (part of its cache key; an OR cannot tell arrays whose rows
    share an offset from others)."""
    return tuple(None if a is None else a.data.ptr & 15 for a in arrays)


def pointer_bits(arrays) -> int:
    """The low four bits of every array's address OR-ed together: what alignment a cached
    launch was planned for (part of its cache key)."""
    bits = 0
    for a in arrays:
        if a is not None:
            bits |= a.data.ptr
    return bits & 15

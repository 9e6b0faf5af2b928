"""Batch norm's argument checks and working layouts (for :mod:`cukern.ops.batch_norm` and
:mod:`cukern.dask`): the channel axis, flags, momentum, per-channel arrays and their dtypes, the
addend's and out's rules, the kernels' copies of the parameters, and the dense working array
with its (A, C, B) view."""

from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from .. import runner as c
from ..plan import batch_norm as bnplan

__all__ = ["check_statistics"]  # and the private helpers cukern.ops.batch_norm imports


def check_statistics(fn: str, training: bool, running_mean, running_var, shape: tuple,
                     axis: int) -> None:
    """Eval needs both running statistics; training more than one value per channel (PyTorch's
    rule). ``shape``: x's, ``axis``: its channel axis (also for :mod:`cukern.dask`)."""
    if not training and (running_mean is None or running_var is None):
        missing = "running_mean" if running_mean is None else "running_var"
        raise ValueError(f"{fn}: eval (training=False) needs running_mean and running_var; "
                         f"{missing} is None")
    nch = shape[axis]
    n = math.prod(shape) // nch if nch else 0
    if training and nch and n <= 1:
        raise ValueError(f"{fn}: expected more than 1 value per channel when training, got x "
                         f"of shape {shape} (channel axis {axis}: {n} value"
                         f"{'s' if n != 1 else ''} per channel)")


def _stat_dtype(dtype: str):
    return np.float64 if dtype == "float64" else np.float32


@functools.cache
def _param_dtypes(dtype: str) -> tuple:
    """Dtypes a per-channel parameter or statistic may have for data of ``dtype``."""
    data = next(d for d, n in c.DTYPE_NAMES.items() if n == dtype)
    if dtype in ("float16", "bfloat16"):
        return (np.dtype(np.float32), data)
    return (data,)


def _axis(fn: str, axis, xa) -> int:
    if xa.ndim < 2:
        raise ValueError(f"{fn}: x has {xa.ndim} dimension{'s' if xa.ndim != 1 else ''}, "
                         f"expected at least 2 (N, C, ...)")
    return c.normalize_axis(fn, axis, xa.ndim)


def _flag(fn: str, name: str, v) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{fn}: {name} must be True or False, got {v!r}")
    return bool(v)


def _momentum(fn: str, momentum) -> float:
    if isinstance(momentum, (bool, np.bool_)) or not isinstance(momentum, numbers.Real):
        raise TypeError(f"{fn}: momentum must be a real number, got {type(momentum).__name__}")
    m = float(momentum)
    if not 0.0 <= m <= 1.0:
        raise ValueError(f"{fn}: momentum must be in [0, 1], got {m}")
    return m


def _vector(fn: str, name: str, v, xa, nch: int, allowed: tuple):
    """A per-channel array: shape (C,), one of ``allowed`` dtypes, x's device (None passes)."""
    if v is None:
        return None
    a = c.adapt(fn, name, v).array
    if tuple(a.shape) != (nch,):
        raise ValueError(f"{fn}: {name} has shape {tuple(a.shape)}, expected ({nch},) (one "
                         f"value per channel of x, whose shape is {tuple(xa.shape)})")
    if a.dtype not in allowed:
        raise TypeError(f"{fn}: {name} has dtype {a.dtype}, expected "
                        f"{' or '.join(str(d) for d in allowed)} for {xa.dtype} x")
    if a.data.device_id != xa.data.device_id:
        raise ValueError(f"{fn}: {name} is on GPU {a.data.device_id} but x is on GPU "
                         f"{xa.data.device_id}")
    return a


def _compute_copy(a, dtype):
    """(array for the kernels, whether results must be copied back into ``a``): ``a`` itself
    when it is contiguous in the compute dtype, else a converted copy."""
    if a is None:
        return None, False
    if a.dtype == np.dtype(dtype) and a.flags.c_contiguous:
        return a, False
    return c.cp.ascontiguousarray(a.astype(dtype)), True


def _same_strides(a, b) -> bool:
    return tuple(a.shape) == tuple(b.shape) and all(
        s == t for n, s, t in zip(a.shape, a.strides, b.strides) if n > 1)


def _same_layout(fn: str, name: str, z, xa) -> None:
    if tuple(z.shape) != tuple(xa.shape):
        raise ValueError(f"{fn}: {name} has shape {tuple(z.shape)}, expected {tuple(xa.shape)} "
                         f"(x's shape; broadcasting is not supported)")
    if z.dtype != xa.dtype:
        raise TypeError(f"{fn}: {name} has dtype {z.dtype}, expected {xa.dtype} (x's dtype)")
    if z.data.device_id != xa.data.device_id:
        raise ValueError(f"{fn}: {name} is on GPU {z.data.device_id} but x is on GPU "
                         f"{xa.data.device_id}")
    if not _same_strides(z, xa):
        raise ValueError(f"{fn}: {name} has strides {z.strides}, expected x's {xa.strides} "
                         f"(the same memory layout; broadcasting is not supported)")


def _check_out(fn: str, o, xa, others) -> None:
    if any(s == 0 and n > 1 for s, n in zip(o.strides, o.shape)):
        raise ValueError(f"{fn}: out has overlapping elements (strides {o.strides})")
    if not (o.data.ptr == xa.data.ptr and _same_strides(o, xa)) and \
            c.cp.may_share_memory(o, xa):
        raise ValueError(f"{fn}: out overlaps x without being x itself")
    for name, a in others:
        if a is not None and c.cp.may_share_memory(o, a):
            raise ValueError(f"{fn}: out overlaps {name}; pass a separate array")


@functools.lru_cache(maxsize=1024)
def _view_of(shape, strides, itemsize: int, axis: int):
    return bnplan.channel_view(shape, tuple(s // itemsize for s in strides), axis)


def _working(xa, axis: int):
    """(array, (A, C, B) view, copied): x itself when dense, else a C-order copy."""
    view = _view_of(xa.shape, xa.strides, xa.itemsize, axis)
    if view is not None:
        return xa, view, False
    xc = c.cp.ascontiguousarray(xa)
    return xc, _view_of(xc.shape, xc.strides, xc.itemsize, axis), True


def _empty_like(a):
    """An uninitialised array with ``a``'s shape, dtype and (dense) memory layout."""
    if a.flags.c_contiguous:
        return c.cp.empty(a.shape, a.dtype)
    order = sorted(range(a.ndim), key=lambda i: (-abs(a.strides[i]), i))
    base = c.cp.empty(tuple(a.shape[i] for i in order), a.dtype)
    return base.transpose(tuple(int(i) for i in np.argsort(order)))


def _copy_like(src, like):
    dst = _empty_like(like)
    dst[...] = src
    return dst

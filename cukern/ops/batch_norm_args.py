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


def _vector(fn: str, name: str, v, xa, nch: int, allowed: tuple, written: bool = False):
    """A per-channel array: shape (C,), one of ``allowed`` dtypes, x's device (None passes).
    ``written``: updated in place (training's running statistics), so refused where it cannot
    be written (a JAX array, a lazy PyTorch view: ``runner.adapt``'s ``out``)."""
    if v is None:
        return None
    a = c.adapt(fn, name, v, out=written).array
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
    c.check_same(fn, "x", xa, name, z)  # shape (no broadcasting), dtype, device
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
    """An uninitialised array with ``a``'s shape, dtype and (dense) memory layout, of ``a``'s
    kind (a CuPy array, or a PyTorch tensor's :class:`~cukern.runner.TensorView`)."""
    if type(a) is _ndarray and a.flags.c_contiguous:
        return c.new_array(a.shape, a.dtype)
    nd = len(a.shape)
    order = sorted(range(nd), key=lambda i: (-abs(a.strides[i]), i))
    if order == list(range(nd)) or _c_contiguous(a.shape, a.strides, a.dtype.itemsize):
        return c.empty(a, a.shape, a.dtype)
    base = c.empty(a, tuple(a.shape[i] for i in order), a.dtype)
    return base.transpose(tuple(int(i) for i in np.argsort(order)))


def _c_contiguous(shape, strides, item: int) -> bool:
    """CuPy's (and NumPy's) C-contiguity: the strides of the dimensions longer than 1."""
    want = item
    for n, s in zip(reversed(shape), reversed(strides)):
        if n == 0:
            return True
        if n != 1 and s != want:
            return False
        want *= n
    return True


def _copy_like(src, like):
    dst = _empty_like(like)
    dst[...] = src
    return dst


# ---------------------------------------------------------------------------------------------
# The fast paths' keys (cukern.ops.batch_norm).

_ndarray = c.cp.ndarray if c.cp is not None else None
_TensorView = c.TensorView
# eps the fast path takes as it is: what c.check_eps accepts for every dtype (float32's normal
# range); any other goes through the full checks
_EPS_LO, _EPS_HI = c.EPS_RANGE["float32"]


def _param_key(a):
    """An optional per-channel array's part of a key: None for None, False (no key) for an
    array that is neither CuPy nor a tensor's :class:`~cukern.runner.TensorView`."""
    if a is None:
        return None
    if type(a) is not _ndarray and type(a) is not _TensorView:
        return False
    return (a.dtype, a.shape, a.strides, a.data.device_id)


def _fresh_key(x, rm, rv, w, b, z, axis, training, relu, return_stats, momentum, eps):
    """batch_norm's fast-path key of a call (None where its scalars or a non-CuPy array need
    the full checks): what the full path validated and planned for, every array's dtype,
    shape, strides and device, x's and the addend's alignment."""
    if not (type(axis) is int and type(training) is bool and type(relu) is bool
            and type(return_stats) is bool and type(momentum) is float
            and type(eps) is float and 0.0 <= momentum <= 1.0 and _EPS_LO <= eps <= _EPS_HI):
        return None
    zk = None
    if z is not None:
        if type(z) is not _ndarray and type(z) is not _TensorView:
            return None
        zk = (z.dtype, z.shape, z.strides, z.data.ptr & 15, z.data.device_id)
    params = (_param_key(rm), _param_key(rv), _param_key(w), _param_key(b))
    if False in params:
        return None
    return (x.dtype, x.shape, x.strides, x.data.ptr & 15, x.data.device_id, axis, training,
            relu, return_stats, params, zk)


def _backward_key(dy, x, mean, invstd, w, m, axis, addend, training):
    """batch_norm_backward's fast-path key (None where the full checks are needed): every
    array CuPy (or every one a tensor's TensorView), its dtype, shape, strides and device, dy's
    and x's alignment, the switches as given."""
    if not (type(axis) is int and type(addend) is bool and type(training) is bool
            and (type(dy) is _ndarray or type(dy) is _TensorView)):
        return None
    arrays = (_param_key(mean), _param_key(invstd), _param_key(w), _param_key(m))
    if False in arrays or arrays[0] is None or arrays[1] is None:
        return None
    return ("batch_norm_backward", x.dtype, x.shape, x.strides, x.data.ptr & 15,
            x.data.device_id, dy.dtype, dy.shape, dy.strides, dy.data.ptr & 15,
            dy.data.device_id, arrays, axis, addend, training)

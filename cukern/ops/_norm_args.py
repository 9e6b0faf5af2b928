"""The norms' argument checks: normalized_shape, parameters, statistics, ``out=`` overlap, and
the row view the kernels read (:mod:`cukern.ops.layer_norm`)."""

from __future__ import annotations

import numpy as np

from .. import runner as c

__all__ = ["normalized_shape", "param_dtypes", "check_param_dtype", "check_same_params", "param",
           "wide_params", "stat_dtype", "check_stat", "rows_view", "check_out_overlap", "typed",
           "fresh_key", "uncopied"]


def normalized_shape(fn: str, normalized_shape, x) -> tuple[int, ...]:
    ns = normalized_shape
    if isinstance(ns, (bool, np.bool_)):
        raise TypeError(f"{fn}: normalized_shape must be an int or a tuple of ints, got bool")
    if isinstance(ns, (int, np.integer)):
        ns = (int(ns),)
    elif isinstance(ns, (tuple, list)) and all(
            isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_)) for n in ns):
        ns = tuple(int(n) for n in ns)
    else:
        raise TypeError(f"{fn}: normalized_shape must be an int or a tuple of ints, got "
                        f"{normalized_shape!r}")
    if not ns:
        raise ValueError(f"{fn}: normalized_shape is empty; name at least one trailing dimension")
    if len(ns) > x.ndim or tuple(x.shape[x.ndim - len(ns):]) != ns:
        raise ValueError(f"{fn}: normalized_shape {ns} does not match the trailing dimensions of "
                         f"x, whose shape is {tuple(x.shape)}")
    return ns


def param_dtypes(x_dtype) -> tuple:
    """Dtypes weight and bias may have for x of ``x_dtype``: float32 or x's dtype for 16-bit x
    (the mixed-precision setup), x's dtype otherwise (batch norm's rule)."""
    x_dtype = np.dtype(x_dtype)
    if x_dtype.itemsize == 2:
        return (np.dtype(np.float32), x_dtype)
    return (x_dtype,)


def check_param_dtype(fn: str, name: str, dtype, x_dtype) -> None:
    """TypeError unless a weight or bias of ``dtype`` may go with x of ``x_dtype``."""
    allowed = param_dtypes(x_dtype)
    if np.dtype(dtype) not in allowed:
        raise TypeError(f"{fn}: {name} has dtype {dtype}, expected "
                        f"{' or '.join(str(d) for d in allowed)} for {np.dtype(x_dtype)} x")


def check_same_params(fn: str, w, b) -> None:
    """weight and bias, where both are given, share one dtype: the kernels read both as
    float32 or both in x's dtype."""
    if w is not None and b is not None and w.dtype != b.dtype:
        raise TypeError(f"{fn}: weight has dtype {w.dtype} but bias has dtype {b.dtype}; pass "
                        f"both in one dtype")


def param(fn: str, name: str, p, x, ns: tuple[int, ...] | None):
    """A weight or bias: shape ``ns`` (any non-empty shape when ns is None), x's dtype (or
    float32 for 16-bit x: :func:`param_dtypes`) and device; returned contiguous, and 16-byte
    aligned where it is float32 for 16-bit x (the kernels read its packs as float32 vectors)."""
    a = c.adapt(fn, name, p).array
    if ns is not None and tuple(a.shape) != ns:
        raise ValueError(f"{fn}: {name} has shape {tuple(a.shape)}, expected {ns} "
                         f"(normalized_shape)")
    check_param_dtype(fn, name, a.dtype, x.dtype)
    if a.data.device_id != x.data.device_id:
        raise ValueError(f"{fn}: {name} is on GPU {a.data.device_id} but x is on GPU "
                         f"{x.data.device_id}")
    if not a.flags.c_contiguous or (a.dtype != x.dtype and a.data.ptr & 15):
        return _contiguous(a)
    return a


def wide_params(w, x) -> bool:
    """Whether the parameters (``w``: weight, or bias without one) are float32 for 16-bit x:
    ``Switches.float32_params``, the kernels that read them as float32."""
    return w is not None and w.dtype != x.dtype


def _contiguous(a):
    """A C-contiguous copy of ``a`` (fresh: aligned to CuPy's 256 bytes), made on ``a``'s
    GPU."""
    with c.on_device(a.data.device_id):
        return c.cp.array(a, order="C", copy=True)


def stat_dtype(dtype: str):
    return np.float64 if dtype == "float64" else np.float32


def check_stat(fn: str, name: str, s, x, expected: tuple[int, ...], dtype: str):
    if tuple(s.shape) != expected:
        raise ValueError(f"{fn}: {name} has shape {tuple(s.shape)}, expected {expected} (the "
                         f"leading dimensions of x, whose shape is {tuple(x.shape)})")
    want = np.dtype(stat_dtype(dtype))
    if s.dtype != want:
        raise TypeError(f"{fn}: {name} has dtype {s.dtype}, expected {want} (the statistics "
                        f"dtype for {dtype} input)")
    if s.data.device_id != x.data.device_id:
        raise ValueError(f"{fn}: {name} is on GPU {s.data.device_id} but x is on GPU "
                         f"{x.data.device_id}")
    return s if s.flags.c_contiguous else _contiguous(s)


def rows_view(a, k: int):
    """(array, row_stride): ``a`` itself when its trailing k dims are one contiguous run and its
    leading dims one stride, else a contiguous copy."""
    view = c.trailing_layout(a, k)
    if view is None:
        a = c.cp.ascontiguousarray(a)
        view = c.trailing_layout(a, k)
    return a, view.s_outer


def check_out_overlap(op: str, o, x, r, w, b) -> None:
    """``out`` may be ``x`` itself (in place) but may not overlap ``x`` any other way, nor
    ``residual``, ``weight`` or ``bias`` at all."""
    c.check_aliasing(op, [x], o)
    for name, a in (("residual", r), ("weight", w), ("bias", b)):
        if a is not None and c.cp.may_share_memory(a, o):
            raise ValueError(f"{op}: out overlaps {name}; pass a separate array (only x itself "
                             f"may be written in place)")


# ---------------------------------------------------------------------------------------------
# The fast paths' keys.

def typed(v):
    """A value with its type (and its items' types), so that True and 1, or 1 and 1.0, never
    share a fast-path key: the validation they would skip tells them apart."""
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(typed(i) for i in v))
    return (type(v), v)


def fresh_key(op: str, args, extra: tuple):
    """The fast-path key of a call (None when an argument rules the fast path out): ``args``
    are the CuPy arrays (or None) the kernels would read, a PyTorch tensor's
    :class:`~cukern.runner.TensorView` for it. Flat: each array's shape, strides, dtype and
    device, and their pointers' low four bits side by side (the alignment the plan was made
    for, and whether their rows start at the same offset: Plan.shifted); None arguments add
    an empty tuple."""
    nd, tv = c.cp.ndarray, c.TensorView
    key = [op]
    bits = 0
    for a in args:
        if type(a) is nd or type(a) is tv:
            data = a.data
            key += (a.shape, a.strides, a.dtype, data.device_id)
            bits = bits << 4 | (data.ptr & 15)
        elif a is None:
            key.append(())
        else:
            return None
    if extra:
        try:
            hash(extra)  # the arrays' part always hashes
        except TypeError:  # an unhashable argument (an array for eps, say)
            return None
    key.append(bits)
    key += extra
    return tuple(key)


def uncopied(a, given) -> bool:
    """Whether ``a``, the checked array the kernels read, is the caller's ``given`` as it was:
    the same CuPy array (or both None), or the CuPy view of a PyTorch tensor (its memory, no
    contiguous copy): what the fast path, which reads ``given`` (or its view), needs."""
    return a is given or (type(given).__module__ == "torch" and a.data.ptr == given.data_ptr())

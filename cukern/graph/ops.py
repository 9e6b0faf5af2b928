"""The graph's own ops: elementwise ``relu`` and ``bias_add``, norms over any axis, and user
ops registered with their NCHW and NHWC implementations. Each works eagerly on CuPy and NumPy
arrays (the NumPy path in float64, as ``cukern.reference``) and records a node on a traced
array."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .trace import Tracer, TracingError, record

__all__ = ["relu", "bias_add", "layer_norm", "rms_norm", "UserOp", "register", "USER_OPS"]

USER_OPS: dict[Callable, UserOp] = {}  # registered functions -> their op (swapped in by trace)


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy


def relu(x):
    """``max(x, 0)`` elementwise, x's shape and dtype (CuPy or NumPy arrays, or traced)."""
    if type(x) is Tracer:
        return record("relu", x, (), {})
    return _xp(x).maximum(x, 0)


def bias_add(x, bias, axis: int = 1):
    """``x + bias`` with ``bias`` of shape ``(x.shape[axis],)`` broadcast along ``axis``."""
    if type(x) is Tracer:
        nd = x.ndim
        if type(axis) is not int or not -nd <= axis < nd:
            raise TracingError(f"bias_add: axis must be an int in [-{nd}, {nd}), got {axis!r}")
        if tuple(bias.shape) != (x.shape[axis % nd],):
            raise TracingError(f"bias_add: bias has shape {tuple(bias.shape)}, expected "
                               f"({x.shape[axis % nd]},)")
        return record("bias_add", x, (bias,), {"axis": axis % nd})
    shape = [1] * x.ndim
    shape[axis] = -1
    return x + bias.reshape(shape)


def _norm(op: str, x, weight, bias, axis: int, eps: float):
    if type(x) is Tracer:
        nd = x.ndim
        if type(axis) is not int or not -nd <= axis < nd:
            raise TracingError(f"{op}: axis must be an int in [-{nd}, {nd}), got {axis!r}")
        others = (weight, bias) if op == "layer_norm" else (weight,)
        return record(op, x, others, {"axis": axis % x.ndim, "eps": float(eps)})
    from .execute import norm_along

    return norm_along(op, x, weight, bias, axis, eps)


def layer_norm(x, weight=None, bias=None, *, axis: int = 1, eps: float = 1e-5):
    """Layer norm of ``x`` along one axis (default the channels of NCHW):
    ``y = (x - mean) / sqrt(var + eps) * weight + bias``, weight and bias of shape
    ``(x.shape[axis],)``. Along the last axis it is ``cukern.layer_norm``; along another axis it
    runs on a channels-last copy (in a graph optimised for NHWC, a contiguous row)."""
    return _norm("layer_norm", x, weight, bias, axis, eps)


def rms_norm(x, weight=None, *, axis: int = 1, eps: float = 1e-6):
    """RMS norm along one axis: ``y = x / sqrt(mean(x**2) + eps) * weight``; as
    :func:`layer_norm`."""
    return _norm("rms_norm", x, weight, None, axis, eps)


class UserOp:
    """A registered op: ``op(x, *weights)`` with x an activation (NCHW when rank 4), weights
    constants. Eager calls run the NCHW implementation; traced calls record a node that the
    passes may switch to the NHWC implementation (x and the result channels-last, each weight
    converted once by ``weight_layout``)."""

    def __init__(self, fn, name: str, nchw: Callable, nhwc: Callable | None,
                 weight_layout, shape: Callable | None) -> None:
        self.fn, self.name, self.nchw, self.nhwc = fn, name, nchw, nhwc
        self.weight_layout, self.shape = weight_layout, shape

    def __repr__(self) -> str:
        return f"UserOp({self.name}, NHWC={'yes' if self.nhwc else 'no'})"

    def __call__(self, x, *weights):
        if type(x) is Tracer or any(type(w) is Tracer for w in weights):
            if type(x) is not Tracer:
                raise TracingError(f"{self.name}: its first argument must be the traced "
                                   f"activation, got {type(x).__name__}")
            shape = x.shape
            if self.shape is not None:
                shape = tuple(self.shape(x.shape, *(tuple(w.shape) for w in weights)))
            return record("user", x, weights, {"userop": self, "impl": "NCHW"}, shape)
        return self.nchw(x, *weights)

    def weight_fn(self, i: int):
        """What converts weight ``i`` for the NHWC implementation (None: unchanged)."""
        wl = self.weight_layout
        if isinstance(wl, dict):
            wl = wl.get(i)
        if wl is None:
            return None
        if callable(wl):
            return wl
        axes = tuple(wl)
        return lambda w: _xp(w).ascontiguousarray(_xp(w).transpose(w, axes))


def register(fn=None, *, layouts: dict | None = None, weight_layout=None,
             shape: Callable | None = None, name: str | None = None) -> UserOp:
    """Register a user op for tracing; returns the op (call it like ``fn``).

    Parameters
    ----------
    fn : callable, optional
        The function user code calls as ``fn(x, *weights)``. While a function is traced, its
        module's names bound to ``fn`` are swapped for the op, so code calling ``fn`` traces.
        Default implementation for NCHW when ``layouts`` has none.
    layouts : dict, optional
        ``{"NCHW": impl, "NHWC": impl}``: ``impl(x, *weights)`` for x in that layout,
        returning the result in the same layout. Without "NHWC" the op is NCHW-only (the
        passes keep it in NCHW).
    weight_layout : callable, tuple of int or dict, optional
        How each weight changes for the NHWC implementation: a function ``w -> w'`` (NumPy
        or CuPy), axes to permute, or ``{weight_index: either}``; applied once at optimize time
        (and once per new weight array), never per call. Default: weights unchanged.
    shape : callable, optional
        ``shape(x_shape, *weight_shapes) -> result shape`` in NCHW (default: x's shape). At
        optimize time each implementation is run once on a zero batch of one (x's kind: NumPy
        or CuPy) and its result shape checked against it.
    name : str, optional
        Shown in printed graphs (default ``fn.__name__``).
    """
    layouts = dict(layouts or {})
    unknown = set(layouts) - {"NCHW", "NHWC"}
    if unknown:
        raise ValueError(f"register: layouts has keys {sorted(unknown)}; expected 'NCHW' and "
                         f"'NHWC'")
    nchw = layouts.get("NCHW", fn)
    nhwc = layouts.get("NHWC")
    for k, f in (("NCHW", nchw), ("NHWC", nhwc)):
        if f is not None and not callable(f):
            raise TypeError(f"register: the {k} implementation must be callable, got "
                            f"{type(f).__name__}")
    if nchw is None:
        raise ValueError("register: needs fn or layouts['NCHW']")
    if not (weight_layout is None or callable(weight_layout) or isinstance(
            weight_layout, (dict, tuple, list))):
        raise TypeError(f"register: weight_layout must be a callable, axes or a dict, got "
                        f"{type(weight_layout).__name__}")
    if shape is not None and not callable(shape):
        raise TypeError(f"register: shape must be callable, got {type(shape).__name__}")
    op = UserOp(fn, name or getattr(fn or nchw, "__name__", "user_op"), nchw, nhwc,
                weight_layout, shape)
    if fn is not None:
        USER_OPS[fn] = op
    return op

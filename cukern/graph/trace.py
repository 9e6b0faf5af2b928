"""Tracing: call a function on proxy arrays and record the cukern ops it calls as graph nodes.

While :func:`trace` runs, the ``cukern.<op>`` names (and, in the traced function's module,
names bound to cukern ops or to registered user ops) are swapped for dispatchers under a lock:
a call with a :class:`Tracer` argument records a node, a call on NumPy arrays runs the float64
reference (``cukern.reference``), anything else runs the op itself. Nothing executes while
tracing. A traced array refuses what cannot be recorded (reading values into Python, indexing,
NumPy/CuPy functions) with a :class:`TracingError` naming the user's source line.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import os
import sys
import threading

import numpy as np

from .ir import NCHW, NHWC, Graph, Node, flatten, permuted_tag

__all__ = ["Tracer", "TracingError", "trace", "patched", "is_array", "record", "current_line"]

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the cukern package
_LOCK = threading.RLock()


class TracingError(TypeError):
    """Something in a traced function that the graph cannot record."""


def current_line() -> str:
    """``file:line: source`` of the innermost frame outside cukern, NumPy and CuPy."""
    f = sys._getframe(1)
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        lib = fn.startswith(_PKG) or any(s in fn for s in (f"{os.sep}numpy{os.sep}",
                                                           f"{os.sep}cupy{os.sep}", "<frozen"))
        if not lib:
            src = linecache.getline(fn, f.f_lineno).strip()
            return f"{f.f_code.co_filename}:{f.f_lineno}: {src}"
        f = f.f_back
    return "<unknown line>"


def _fail(what: str):
    raise TracingError(f"{what} (at {current_line()})")


def is_array(v) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype") and not isinstance(v, np.generic)


class _Context:
    def __init__(self, name: str) -> None:
        self.nodes: list[Node] = []
        self.name = name

    def add(self, op: str, args: tuple, attrs: dict, shape, dtype, layout) -> Tracer:
        n = Node(len(self.nodes), op, tuple(args), attrs, tuple(int(s) for s in shape),
                 np.dtype(dtype), layout)
        self.nodes.append(n)
        return Tracer(self, n)


class Tracer:
    """A proxy array seen by a traced function: shape, dtype and ndim, ``+`` and ``*`` (with
    another traced array, a constant array or a Python number), and the cukern and
    ``cukern.graph`` ops. Everything else raises :class:`TracingError`."""

    __slots__ = ("_ctx", "_node")
    __array_priority__ = 1000  # NumPy defers its operators to ours

    def __init__(self, ctx: _Context, node: Node) -> None:
        self._ctx, self._node = ctx, node

    shape = property(lambda self: self._node.shape)
    dtype = property(lambda self: self._node.dtype)
    ndim = property(lambda self: len(self._node.shape))
    size = property(lambda self: int(np.prod(self._node.shape, dtype=np.int64)))

    def __repr__(self) -> str:
        return f"Tracer(%{self._node.id} {self._node.op}, shape={self.shape}, {self.dtype})"

    def __len__(self) -> int:
        return self.shape[0]

    # the arithmetic the graph records
    def __add__(self, other):
        return _binary("add", self, other)

    def __mul__(self, other):
        return _binary("mul", self, other)

    __radd__ = __add__
    __rmul__ = __mul__

    # everything that needs values or an unregistered function
    def _refuse(self, what: str):
        _fail(f"{what} on a traced array is not traceable: the graph records cukern ops, "
              f"cukern.graph ops (relu, bias_add, registered ops) and + and *")

    def __bool__(self):
        self._refuse("bool() (a Python branch on array values)")

    def __float__(self):
        self._refuse("float() (reading a value into Python)")

    def __int__(self):
        self._refuse("int() (reading a value into Python)")

    def __index__(self):
        self._refuse("using it as an index")

    def __iter__(self):
        self._refuse("iteration")

    def __getitem__(self, key):
        self._refuse("indexing")

    def __setitem__(self, key, v):
        self._refuse("item assignment")

    def __array__(self, *a, **k):
        self._refuse("conversion to a NumPy array")

    def __array_ufunc__(self, ufunc, method, *a, **k):
        self._refuse(f"numpy.{ufunc.__name__}")

    def __array_function__(self, func, types, a, k):
        self._refuse(f"numpy.{func.__name__}")

    def __cupy_get_ndarray__(self):
        self._refuse("a CuPy function")

    def get(self, *a, **k):
        self._refuse(".get() (copying values to the host)")

    @property
    def __cuda_array_interface__(self):
        self._refuse("a function reading GPU memory (__cuda_array_interface__)")

    @property
    def __array_interface__(self):
        self._refuse("a function reading memory (__array_interface__)")

    def __dlpack__(self, *a, **k):
        self._refuse("an op not recorded by the graph (through __dlpack__; cukern ops bound "
                     "to other names before tracing must be reached as cukern.<op>)")

    def __dlpack_device__(self):
        self._refuse("__dlpack_device__")

    def __getattr__(self, name: str):
        if name.startswith("__"):  # a library probing the object (CuPy's kernel overrides)
            self._refuse(f"a library function (it looked up {name})")
        self._refuse(f".{name}")


def _op_names() -> dict:
    names = {}
    for op in ("__sub__", "__rsub__", "__truediv__", "__rtruediv__", "__neg__", "__pow__",
               "__matmul__", "__rmatmul__", "__floordiv__", "__mod__", "__lt__", "__le__",
               "__gt__", "__ge__", "__abs__", "__iadd__", "__imul__"):
        names[op] = (lambda o: lambda self, *a: self._refuse(f"operator {o}"))(op)
    names["__eq__"] = lambda self, o: self._refuse("operator ==")
    names["__ne__"] = lambda self, o: self._refuse("operator !=")
    names["__hash__"] = object.__hash__
    return names


for _k, _v in _op_names().items():
    setattr(Tracer, _k, _v)


def value_of(ctx: _Context, a, what: str):
    """A node id for an op argument: a traced array, None, or a concrete array captured by the
    function (recorded as a constant)."""
    if a is None:
        return None
    if type(a) is Tracer:
        if a._ctx is not ctx:
            _fail(f"{what} comes from another trace")
        return a._node.id
    if is_array(a):
        return ctx.add("param", (), {"path": None, "value": a}, a.shape, a.dtype, None)._node.id
    _fail(f"{what} must be an array, got {type(a).__name__}")


def context_of(*args) -> _Context:
    for a in args:
        if type(a) is Tracer:
            return a._ctx
    raise AssertionError("no traced argument")


def record(op: str, x: Tracer, others: tuple, attrs: dict, shape=None, dtype=None,
           layout: str | None | bool = True) -> Tracer:
    """Record ``op`` on traced ``x`` with further arguments ``others`` (arrays or None)."""
    ctx = context_of(x, *others)
    if type(x) is not Tracer:
        _fail(f"{op}: x must be a traced array here, got {type(x).__name__}")
    args = (x._node.id,) + tuple(value_of(ctx, a, f"{op} argument {i + 1}")
                                 for i, a in enumerate(others))
    tag = x._node.layout if layout is True else layout
    return ctx.add(op, args, attrs, x.shape if shape is None else shape,
                   x.dtype if dtype is None else dtype, tag)


def _binary(op: str, a: Tracer, b) -> Tracer:
    if isinstance(b, (bool, int, float)) and not isinstance(b, bool):
        return record(op, a, (), {"scalar": float(b)})
    if not (type(b) is Tracer or is_array(b)):
        _fail(f"{'+' if op == 'add' else '*'} with {type(b).__name__} is not traceable")
    try:
        shape = np.broadcast_shapes(a.shape, tuple(b.shape))
    except ValueError:
        _fail(f"{op}: shapes {a.shape} and {tuple(b.shape)} do not broadcast")
    first, second = (a, b) if len(a.shape) >= len(b.shape) else (b, a)
    if type(first) is not Tracer:
        _fail(f"{op}: the larger operand must be a traced array")
    return record(op, first, (second,), {}, shape, np.result_type(a.dtype, b.dtype))


def _axis(fn: str, axis, ndim: int) -> int:
    if type(axis) is not int or not -ndim <= axis < ndim:
        _fail(f"{fn}: axis must be an int in [-{ndim}, {ndim}), got {axis!r}")
    return axis % ndim


def _no(fn: str, **flags) -> None:
    for k, v in flags.items():
        if v is not None and v is not False:
            _fail(f"{fn}: {k}= is not supported in a traced graph")


# ---- recorders of the cukern ops (same signatures as the ops)

def _softmax(op):
    def rec(x, axis=-1, *, out=None):
        _no(op, out=out)
        return record(op, x, (), {"axis": _axis(op, axis, x.ndim)})
    return rec


class _Stat:
    """A statistic returned by a traced norm; the graph does not produce it."""

    def __getattr__(self, name):
        _fail("the statistics of a traced norm are not available (use return_stats=False)")


def _norm(op):
    def rec(x, normalized_shape, weight=None, bias=None, eps=1e-5 if op == "layer_norm"
            else 1e-6, *, residual=None, return_stats=False, out=None):
        if op == "rms_norm" and bias is not None:  # rms_norm(x, ns, weight, eps)
            eps, bias = bias, None
        _no(op, residual=residual, out=out)
        ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(ns) != 1 or ns[0] != x.shape[-1]:
            _fail(f"{op}: a traced norm runs over the last axis only (normalized_shape "
                  f"{ns}, x of shape {x.shape})")
        others = (weight, bias) if op == "layer_norm" else (weight,)
        y = record(op, x, others, {"axis": x.ndim - 1, "eps": float(eps)})
        if not return_stats:
            return y
        return (y, _Stat(), _Stat()) if op == "layer_norm" else (y, _Stat())
    return rec


def _batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False,
                momentum=0.1, eps=1e-5, *, axis=1, addend=None, relu=False, return_stats=False,
                out=None):
    _no("batch_norm", out=out, return_stats=return_stats)
    if addend is not None and tuple(addend.shape) != x.shape:
        _fail(f"batch_norm: addend has shape {tuple(addend.shape)}, expected {x.shape}")
    attrs = {"axis": _axis("batch_norm", axis, x.ndim), "training": bool(training),
             "momentum": float(momentum), "eps": float(eps), "relu": bool(relu)}
    return record("batch_norm", x, (running_mean, running_var, weight, bias, addend), attrs)


def _permute(x, axes=None, *, out=None):
    _no("permute", out=out)
    nd = x.ndim
    axes = tuple(range(nd))[::-1] if axes is None else tuple(axes)
    if sorted(a % nd if type(a) is int and -nd <= a < nd else -1 for a in axes) != list(
            range(nd)):
        _fail(f"permute: axes {axes} is not a permutation of range({nd})")
    axes = tuple(a % nd for a in axes)
    return record("permute", x, (), {"axes": axes}, tuple(x.shape[a] for a in axes),
                  layout=permuted_tag(x._node.layout, axes))


def _layout_change(axes4):
    def rec(x, *, out=None):
        if x.ndim != 4:
            _fail(f"the graph converts layouts of 4-D arrays only, got shape {x.shape}")
        return _permute(x, axes4, out=out)
    return rec


RECORDERS = {"softmax": _softmax("softmax"), "log_softmax": _softmax("log_softmax"),
             "layer_norm": _norm("layer_norm"), "rms_norm": _norm("rms_norm"),
             "batch_norm": _batch_norm, "permute": _permute,
             "to_nhwc": _layout_change(NHWC), "to_nchw": _layout_change(NCHW)}
PATCHED = ("softmax", "log_softmax", "layer_norm", "rms_norm", "batch_norm", "permute",
           "to_nhwc", "to_nchw", "softmax_backward", "log_softmax_backward",
           "layer_norm_backward", "rms_norm_backward", "batch_norm_backward", "batch_stats")


def _reference(name: str):
    from .. import reference

    if name == "to_nhwc":
        return lambda x, *, out=None: reference.permute(x, NHWC)
    if name == "to_nchw":
        return lambda x, *, out=None: reference.permute(x, NCHW)
    return getattr(reference, name, None)


def _dispatcher(name: str, orig):
    rec = RECORDERS.get(name)
    ref = _reference(name)

    @functools.wraps(orig)
    def dispatch(*a, **k):
        if any(type(v) is Tracer for v in a) or any(type(v) is Tracer for v in k.values()):
            if rec is None:
                _fail(f"cukern.{name} is not traceable (backward ops and batch_stats are "
                      f"outside the graph)")
            return rec(*a, **k)
        if a and isinstance(a[0], np.ndarray) and ref is not None:
            return ref(*a, **k)
        return orig(*a, **k)

    dispatch.__cukern_dispatch__ = orig
    return dispatch


@contextlib.contextmanager
def patched(fn=None):
    """Swap the cukern op names (and, in ``fn``'s module, names bound to cukern ops or
    registered user ops) for dispatchers while the block runs; restored afterwards."""
    import cukern

    from .ops import USER_OPS

    with _LOCK:
        saved: list[tuple[dict, str, object]] = []
        originals = {}
        try:
            for name in PATCHED:
                orig = getattr(cukern, name)
                orig = getattr(orig, "__cukern_dispatch__", orig)
                originals[orig] = name
                saved.append((cukern.__dict__, name, cukern.__dict__[name]))
                cukern.__dict__[name] = _dispatcher(name, orig)
            g = getattr(inspect.unwrap(fn), "__globals__", None) if fn is not None else None
            if g is not None and g is not cukern.__dict__:
                for k, v in list(g.items()):
                    try:
                        user = USER_OPS.get(v) if callable(v) else None
                        name = originals.get(v) if callable(v) else None
                    except TypeError:  # unhashable
                        continue
                    if user is not None or name is not None:
                        saved.append((g, k, v))
                        g[k] = user if user is not None else cukern.__dict__[name]
            yield
        finally:
            for d, k, v in reversed(saved):
                d[k] = v


def _rebuild(obj, leaf):
    if isinstance(obj, dict):
        return {k: _rebuild(v, leaf) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_rebuild(v, leaf) for v in obj]
        return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
    return leaf(obj)


def trace(fn, *args, const_argnums=None, name: str | None = None) -> Graph:
    """Record ``fn(*args)`` as a :class:`~cukern.graph.ir.Graph` without running any kernel.

    Parameters
    ----------
    fn : callable
        Code over cukern ops, ``cukern.graph`` ops (relu, bias_add, registered ops) and ``+``
        and ``*``; arrays in NCHW (rank 4) or any rank for layout-free code.
    *args
        Arrays, or nested dicts, lists and tuples of arrays (CuPy or NumPy: the kind the
        graph will be called with); other leaves (numbers, strings, None) are fixed.
    const_argnums : tuple of int, optional
        Arguments holding parameters (weights, per-channel vectors, running statistics):
        the passes may change their layout once at optimize time. Default: the arguments that
        are dicts. Array leaves of the other arguments are the graph's inputs.

    Returns
    -------
    Graph, callable as ``graph(*args)`` (eager, unoptimised) and ``graph.optimize(...)``.

    Raises
    ------
    TracingError
        Something in ``fn`` that cannot be recorded, with its source line.
    """
    from .api import TracedGraph

    if not callable(fn):
        raise TypeError(f"trace: fn must be callable, got {type(fn).__name__}")
    if const_argnums is None:
        const_argnums = tuple(i for i, a in enumerate(args) if isinstance(a, dict))
    const_argnums = tuple(const_argnums)
    for i in const_argnums:
        if type(i) is not int or not 0 <= i < len(args):
            raise ValueError(f"trace: const_argnums has {i!r}; {len(args)} arguments given")
    ctx = _Context(name or getattr(fn, "__name__", "graph"))
    try:
        arg_names = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        arg_names = ()
    paths = [p for p, v in flatten(tuple(args)) if is_array(v)]

    def leaf(v):
        if not is_array(v):
            return v
        p = paths.pop(0)
        if p[0] in const_argnums:
            return ctx.add("param", (), {"path": p, "value": v}, v.shape, v.dtype, None)
        tag = "NCHW" if len(v.shape) == 4 else None
        return ctx.add("input", (), {"path": p, "kind": _kind(v)}, v.shape, v.dtype, tag)

    targs = _rebuild(tuple(args), leaf)
    with patched(fn):
        out = fn(*targs)
    outs = flatten(out)
    ids = []
    for p, v in outs:
        if type(v) is not Tracer:
            raise TracingError(f"trace: {ctx.name} returns {type(v).__name__} at "
                               f"{p or 'its result'}; a traced function returns traced arrays")
        ids.append(v._node.id)
    counter = iter(range(len(ids)))
    tree = _rebuild(out, lambda v: next(counter)) if type(out) is not Tracer else 0
    g = Graph(ctx.nodes, tuple(ids), tree, ctx.name, arg_names)
    g, _ = g.dce()
    return TracedGraph(g, fn, {"const_argnums": const_argnums, "name": name})


def _kind(v) -> str:
    return "numpy" if isinstance(v, np.ndarray) else "gpu"

"""``cukern.prepare``: a call bound to one layout, for loops over many arrays of one shape.

A prepared call checks that its arrays have the layout it was prepared for (shape, strides,
dtype, device: a tuple comparison each) and launches the planned kernel; with ``out=`` it
allocates nothing. It skips what a repeated plain call still does per call: building the
fast path's key, and parsing the op's other arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

__all__ = ["Prepared", "prepare"]

_OPS = ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward", "layer_norm",
        "rms_norm", "permute")


def _extent(shape, strides, itemsize) -> tuple[int, int]:
    """Byte offsets [lo, hi) an array of this layout spans from its data pointer."""
    if 0 in shape:
        return 0, 0
    lo = sum(s * (n - 1) for n, s in zip(shape, strides) if s < 0)
    hi = sum(s * (n - 1) for n, s in zip(shape, strides) if s > 0) + itemsize
    return lo, hi


class _Sig:
    """What a prepared call requires of one array argument."""

    __slots__ = ("name", "shape", "strides", "dtype", "device", "align", "lo", "hi")

    def __init__(self, name: str, a):
        self.name = name
        self.shape, self.strides, self.dtype = a.shape, a.strides, a.dtype
        self.device, self.align = a.data.device_id, a.data.ptr & 15
        self.lo, self.hi = _extent(a.shape, a.strides, a.itemsize)

    def describe(self) -> str:
        return (f"shape {self.shape}, strides {self.strides}, dtype {self.dtype}, "
                f"GPU {self.device}")


class Prepared:
    """A call of one op bound to its arrays' layout and its other arguments (see
    :func:`prepare`). Call it with the op's array arguments (those given to ``prepare``, in
    that order), and optionally ``out=``: a C-contiguous array of the result's shape and dtype
    on the same GPU (the softmax family's may be its first input itself, in place)."""

    __slots__ = ("op", "fast", "_sigs", "_out", "_run", "_full", "_device", "_in_place")

    def __init__(self, op, sigs, out_sig, run, full, device, in_place):
        self.op = op
        self._sigs, self._out, self._run, self._full = sigs, out_sig, run, full
        self._device, self._in_place = device, in_place
        self.fast = run is not None  # False: every call runs the op's full path

    def __repr__(self) -> str:
        args = ", ".join(f"{s.name}: {s.describe()}" for s in self._sigs)
        return f"<cukern.prepare {self.op!r} ({args}){'' if self.fast else ' (full path)'}>"

    def __call__(self, *arrays, out=None):
        sigs = self._sigs
        if len(arrays) != len(sigs):
            raise TypeError(f"prepare({self.op!r}): the prepared call takes "
                            f"{len(sigs)} array argument(s) "
                            f"({', '.join(s.name for s in sigs)}), got {len(arrays)}")
        ok = self.fast and _get_device() == self._device
        for s, a in zip(sigs, arrays):
            if type(a) is not _ndarray:
                raise TypeError(f"prepare({self.op!r}): {s.name} must be a cupy.ndarray "
                                f"(prepared calls take CuPy arrays), got {type(a).__module__}."
                                f"{type(a).__name__}")
            if (a.shape != s.shape or a.strides != s.strides or a.dtype != s.dtype
                    or a.data.device_id != s.device):
                raise ValueError(f"prepare({self.op!r}): {s.name} has shape {a.shape}, strides "
                                 f"{a.strides}, dtype {a.dtype}, GPU {a.data.device_id}; the "
                                 f"call was prepared for {s.describe()}")
            if a.data.ptr & 15 != s.align:  # planned for another alignment: the full path
                ok = False
        if out is not None:
            self._check_out(arrays, out)
            if out.data.ptr & 15:
                ok = False
        if not ok:
            return self._full(*arrays, out=out)
        return self._run(*arrays, out)

    def _check_out(self, arrays, out) -> None:
        o = self._out
        if type(out) is not _ndarray:
            raise TypeError(f"prepare({self.op!r}): out must be a cupy.ndarray, got "
                            f"{type(out).__name__}")
        if out.shape != o.shape or out.strides != o.strides or out.dtype != o.dtype or \
                out.data.device_id != o.device:
            raise ValueError(f"prepare({self.op!r}): out has shape {out.shape}, strides "
                             f"{out.strides}, dtype {out.dtype}, GPU {out.data.device_id}; "
                             f"expected the result's layout: {o.describe()}")
        p = out.data.ptr
        for s, a in zip(self._sigs, arrays):
            q = a.data.ptr
            if p + o.lo < q + s.hi and q + s.lo < p + o.hi:  # the byte ranges meet
                if self._in_place and (a is out or (p == q and a.strides == out.strides)):
                    continue
                raise ValueError(f"prepare({self.op!r}): out overlaps {s.name}; pass a "
                                 f"separate array")


_ndarray = None
_get_device = None


def _resolve(op) -> tuple[str, Callable]:
    import cukern

    name = getattr(op, "__name__", op) if callable(op) else op
    if not isinstance(name, str) or name.replace("-", "_") not in _OPS:
        raise ValueError(f"prepare: op must be one of {', '.join(_OPS)} (a name or the "
                         f"function), got {name!r}")
    name = name.replace("-", "_")
    return name, getattr(cukern, name)


def prepare(op, *args, **kwargs) -> Prepared:
    """Bind ``op`` to the layout of its array arguments, for loops over arrays of one shape.

    ``prepare(op, *args, **kwargs)`` takes the op's arguments as the op does, validates them,
    plans and compiles, and runs the op once on them (its result is discarded). The returned
    callable takes the same array arguments positionally, with every other argument bound::

        p = cukern.prepare("softmax", x, axis=-1)
        y = p(x2)                  # x2: x's shape, strides, dtype and GPU
        p(x3, out=y)               # no allocation

        q = cukern.prepare("layer_norm", x, (d,), w, b, eps=1e-5)
        y = q(x2, w, b)            # the array arguments given to prepare, in their order

    Parameters
    ----------
    op : str or function
        ``softmax``, ``log_softmax``, ``softmax_backward``, ``log_softmax_backward``,
        ``layer_norm``, ``rms_norm`` or ``permute`` (``-`` or ``_``; or the function).
    *args, **kwargs
        The op's arguments. Arrays must be CuPy arrays; ``out=`` is not bound (give it to the
        prepared call). ``layer_norm``/``rms_norm``: no ``residual``; the prepared call
        returns what the op returns with the bound ``return_stats``.

    Returns
    -------
    Prepared
        Calling it with arrays of another shape, strides, dtype or GPU raises ValueError, and a
        non-CuPy array TypeError. An array with other pointer alignment (a view at an odd
        offset), a call on another current GPU, or a layout the op runs through copies goes
        through the op's full path (``Prepared.fast`` is False for the latter).
    """
    global _ndarray, _get_device
    import cupy as cp

    _ndarray, _get_device = cp.ndarray, cp.cuda.runtime.getDevice
    name, fn = _resolve(op)
    if "out" in kwargs:
        raise TypeError(f"prepare({name!r}): out= belongs to the prepared call, not to prepare")
    binder = _BINDERS[name]
    return binder(name, fn, args, kwargs)


def _arrays(name, names, values) -> list:
    for n, a in zip(names, values):
        if type(a) is not _ndarray:
            raise TypeError(f"prepare({name!r}): {n} must be a cupy.ndarray, got "
                            f"{type(a).__module__}.{type(a).__name__}")
    return list(values)


def _bind_softmax(name, fn, args, kwargs):
    from .ops import softmax as sm

    backward = name.endswith("_backward")
    names = ("dy", "y") if backward else ("x",)
    if len(args) < len(names):
        raise TypeError(f"prepare({name!r}): expected the arrays {', '.join(names)}")
    arrays = _arrays(name, names, args[:len(names)])
    rest = args[len(names):]
    axis = rest[0] if rest else kwargs.pop("axis", -1)
    if len(rest) > 1 or kwargs:
        raise TypeError(f"prepare({name!r}): unexpected arguments {rest[1:]} {kwargs}")
    y0 = fn(*arrays, axis)  # validates, plans, compiles
    first = arrays[1] if backward else arrays[0]  # the kernels read (y, dy)
    launch = (sm._fresh.get(sm._key2(name, axis, first, arrays[0])) if backward else
              sm._fresh.get((name, axis, first.shape, first.strides, first.dtype,
                             first.data.ptr & 15, first.data.device_id)))
    run = None
    if launch is not None and type(axis) is int:
        empty, shape, dtype = _ndarray, first.shape, first.dtype

        if backward:
            def run(dy, y, out):
                o = empty(shape, dtype) if out is None else out
                launch(y, dy, o)
                return o
        else:
            def run(x, out):
                o = empty(shape, dtype) if out is None else out
                launch(x, o)
                return o

    sigs = [_Sig(n, a) for n, a in zip(names, arrays)]
    return Prepared(name, sigs, _Sig("out", y0), run,
                    lambda *a, out=None: fn(*a, axis, out=out), first.data.device_id, True)


def _bind_norm(name, fn, args, kwargs):
    from .ops import layer_norm as ln

    layer = name == "layer_norm"
    pnames = ("x", "normalized_shape", "weight", "bias", "eps") if layer else \
        ("x", "normalized_shape", "weight", "eps")
    if len(args) > len(pnames):
        raise TypeError(f"prepare({name!r}): at most {len(pnames)} positional arguments")
    bound = dict(zip(pnames, args))
    for k, v in kwargs.items():
        if k in bound:
            raise TypeError(f"prepare({name!r}): {k} given twice")
        bound[k] = v
    if bound.get("residual") is not None:
        raise ValueError(f"prepare({name!r}): residual= is not supported by prepared calls")
    if "x" not in bound or "normalized_shape" not in bound:
        raise TypeError(f"prepare({name!r}): x and normalized_shape are required")
    names = tuple(n for n in ("x", "weight", "bias") if bound.get(n) is not None)
    arrays = _arrays(name, names, [bound[n] for n in names])
    other = {k: v for k, v in bound.items() if k not in ("x", "weight", "bias")}
    res = fn(**bound)  # validates, plans, compiles
    stats = other.get("return_stats", False)
    y0 = res[0] if type(res) is tuple else res
    eps = other.get("eps", inspect.signature(fn).parameters["eps"].default)
    x, w, b = bound["x"], bound.get("weight"), bound.get("bias")
    key = ln._fresh_key(name, (x, w, b), (ln._typed(other["normalized_shape"]),
                                          ln._typed(eps), ln._typed(stats)))
    hit = ln._fresh.get(key) if key is not None else None

    def full(*a, out=None):
        kw = dict(other, **dict(zip(names, a)))
        return fn(**kw, out=out)

    run = None
    if hit is not None:
        launch, lead, sdt, eps_c = hit
        main, empty, shape, dtype = launch.main, _ndarray, x.shape, x.dtype
        has_w, has_b = w is not None, b is not None

        def run(*a):  # the arrays, then out
            xv, out = a[0], a[-1]
            wv = a[1] if has_w else 0
            bv = a[1 + has_w] if has_b else 0
            y = empty(shape, dtype) if out is None else out
            mean = empty(lead, sdt) if stats and layer else None
            rstd = empty(lead, sdt) if stats else None
            main(xv, 0, wv, bv, y, 0, mean, rstd, eps_c)
            if not stats:
                return y
            return (y, mean, rstd) if layer else (y, rstd)

    sigs = [_Sig(n, a) for n, a in zip(names, arrays)]
    return Prepared(name, sigs, _Sig("out", y0), run, full, x.data.device_id, False)


def _bind_permute(name, fn, args, kwargs):
    from .ops import permute as pm

    if not args:
        raise TypeError(f"prepare({name!r}): expected the array x")
    x = _arrays(name, ("x",), args[:1])[0]
    axes = args[1] if len(args) > 1 else kwargs.pop("axes", None)
    if len(args) > 2 or kwargs:
        raise TypeError(f"prepare({name!r}): unexpected arguments {args[2:]} {kwargs}")
    if type(axes) is list:
        axes = tuple(axes)
    y0 = fn(x, axes)
    hit = pm._fresh.get((x.shape, x.strides, x.dtype, axes, x.data.ptr & 15, x.data.device_id))
    run = None
    if hit is not None and x.size:
        launch, shape, empty, dtype = hit[0], hit[1], _ndarray, x.dtype

        def run(xa, out):
            o = empty(shape, dtype) if out is None else out
            launch(xa, o)
            return o

    return Prepared(name, [_Sig("x", x)], _Sig("out", y0), run,
                    lambda a, out=None: fn(a, axes, out=out), x.data.device_id, False)


_BINDERS = {"softmax": _bind_softmax, "log_softmax": _bind_softmax,
            "softmax_backward": _bind_softmax, "log_softmax_backward": _bind_softmax,
            "layer_norm": _bind_norm, "rms_norm": _bind_norm, "permute": _bind_permute}

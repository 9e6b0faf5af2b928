"""Layer norm and RMS norm, forward and backward, over the trailing dimensions of a CuPy (or
DLPack) array, with optional affine parameters and a fused residual add."""

from __future__ import annotations

import math

import numpy as np

from .. import plan as _plan
from .. import registry
from .. import runner as c
from ._norm_args import check_out_overlap as _check_out_overlap
from ._norm_args import check_same_params as _check_same_params
from ._norm_args import check_stat as _check_stat
from ._norm_args import fresh_key as _fresh_key
from ._norm_args import normalized_shape as _normalized_shape
from ._norm_args import param as _param
from ._norm_args import rows_view as _rows_view
from ._norm_args import stat_dtype as _stat_dtype
from ._norm_args import typed as _typed
from ._norm_args import uncopied as _uncopied
from ._norm_args import wide_params as _wide_params

__all__ = ["layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward"]

_NULL = 0  # a null pointer argument (cukern._launch slot value)
_launches: dict[tuple, _Launches] = c.BoundedDict()
# Fast path: calls with CuPy arrays (or PyTorch tensors on CuPy's current stream, through their
# CuPy views) whose every argument (shapes, strides, dtypes, devices, pointer alignment, eps,
# switches) matches an earlier, validated call that needed no copies skip validation and
# planning. Key -> (launches, lead shape, statistics dtype, eps scalar); a backward's
# (launches, normalized shape).
_fresh: dict[tuple, tuple] = c.BoundedDict()
_last: dict[str, _plan.Plan] = {}  # op -> the plan of its latest call (last_plan)
_get_device = c.cp.cuda.runtime.getDevice if c.cp is not None else None
_fast_arrays, _results, _new = c.fast_arrays, c.results, c.new_array


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5, *,
               residual=None, return_stats: bool = False, out=None):
    """Layer normalisation over the trailing dimensions ``normalized_shape`` of ``x``.

    For each row (the ``n = prod(normalized_shape)`` trailing values at one index of the leading
    dimensions)::

        mean = sum(x) / n
        var  = sum((x - mean)**2) / n          (biased; computed as exact two passes or Welford,
                                                never as E[x^2] - E[x]^2)
        rstd = 1 / sqrt(var + eps)
        y    = (x - mean) * rstd * weight + bias

    Parameters
    ----------
    x : cupy.ndarray or a GPU array with ``__dlpack__`` (PyTorch, JAX)
        float16, bfloat16 (``ml_dtypes.bfloat16``), float32 or float64, any shape and strides.
        Half-precision inputs are computed in float32; float and double in their own type.
    normalized_shape : int or tuple of int
        The trailing dimensions to normalise over (PyTorch's meaning): ``x.shape[-k:]`` must
        equal it.
    weight, bias : array of shape ``normalized_shape``, optional
        gamma and beta, on ``x``'s device, of ``x``'s dtype or, for float16 and bfloat16 ``x``,
        float32 (the mixed-precision setup: read as float32, never rounded to ``x``'s dtype;
        such calls run the uncached kernel, which reads ``x`` twice); both of one dtype.
        Either may be omitted.
    eps : float
        Added to the variance; finite, > 0 and a normal number of the compute type (at least
        1.2e-38 in float32), so that it never rounds to 0.
    residual : array, optional
        Same shape, dtype and device as ``x``. The kernel normalises ``h = x + residual``
        (rounded to ``x``'s dtype, as a separate add would) and also returns ``h``: one read of
        each input and one write of each output, the "add then norm" of a transformer block.
    return_stats : bool
        Whether to return ``mean`` and ``rstd`` too (what :func:`layer_norm_backward` needs);
        default False, as ``torch.nn.functional.layer_norm`` returns ``y`` alone.
    out : array, optional
        Where to write ``y``: same shape, dtype and device as ``x``, any strides (rows of any
        stride are written in place; other layouts through a temporary). It may be ``x``
        itself (in place); any other overlap with ``x``, ``residual``, ``weight`` or ``bias``
        is refused. A PyTorch ``out`` is safe to read on the caller's stream after the call; a
        JAX array cannot be written (TypeError).

    Returns
    -------
    ``y``; ``(y, h)`` with a residual; with ``return_stats=True``, ``(y, mean, rstd)`` and
    ``(y, mean, rstd, h)``. ``y`` (``out`` itself when given) and ``h`` have ``x``'s shape and
    dtype; ``mean`` and ``rstd`` have shape ``x.shape[:-k]`` and dtype float32 (float64 for
    float64 input), the statistics of ``h`` when there is a residual. Results are of the same
    kind as ``x`` (CuPy in, CuPy out; PyTorch and JAX arrays come back as their own kind,
    shared through DLPack without a copy).

    Notes
    -----
    Runs on ``x``'s GPU and CuPy's current stream. The trailing dimensions must form one
    contiguous run in memory for the fast path (rows may have any stride, as in ``x[:, :k]``);
    other layouts are copied first. An empty normalised shape product gives NaN statistics;
    one past ``cukern.plan.MAX_COLS`` (2^31 - 4096) values is refused with a ValueError.
    """
    return _forward("layer_norm", x, normalized_shape, weight, bias, eps, residual, return_stats,
                    out)


def rms_norm(x, normalized_shape, weight=None, eps: float = 1e-6, *, residual=None,
             return_stats: bool = False, out=None):
    """RMS normalisation over the trailing dimensions ``normalized_shape`` of ``x``::

        rstd = 1 / sqrt(sum(x**2) / n + eps)
        y    = x * rstd * weight

    Same arguments (``out=`` included), dtypes, layouts and return kinds as
    :func:`layer_norm`, with no bias and no mean: returns ``y``; ``(y, h)`` with a residual;
    with ``return_stats=True``, ``(y, rstd)`` and ``(y, rstd, h)``.
    """
    return _forward("rms_norm", x, normalized_shape, weight, None, eps, residual, return_stats,
                    out)


def layer_norm_backward(dy, x, mean, rstd, weight=None, bias=None):
    """Gradients of :func:`layer_norm`, given the gradient ``dy`` of its output ``y``.

    With ``xhat = (x - mean) * rstd`` and ``g = dy * weight`` (``dy`` without a weight), per row
    of ``n`` values::

        dx      = rstd * (g - mean(g) - xhat * mean(g * xhat))
        dweight = sum over rows of dy * xhat
        dbias   = sum over rows of dy

    ``dweight`` and ``dbias`` are summed in float32 (float64 for float64 input): float32 partial
    sums per thread block, then one reduction of those; never in half precision.

    Parameters
    ----------
    dy, x : arrays of one shape, dtype and device
        ``x`` is the forward's input (with a residual: the sum ``h`` it returned).
    mean, rstd : arrays of shape ``x.shape[:-k]``
        The statistics :func:`layer_norm` returned, float32 (float64 for float64 ``x``).
    weight : array, optional
        The forward's weight; its shape is ``normalized_shape``, its dtype ``x``'s or, for
        float16 and bfloat16 ``x``, float32 (``g = dy * weight`` then uses the float32 values).
        Without it, ``k`` is ``x.ndim - mean.ndim``.
    bias : array, optional
        The forward's bias (or None): only whether it is given matters, and it is checked like
        ``weight`` (shape ``normalized_shape``, the dtypes ``weight`` may have, the same as
        ``weight``'s where both are given, ``x``'s device).

    Returns
    -------
    ``(dx, dweight, dbias)``: ``dx`` like ``x``; ``dweight`` (None unless ``weight`` is given)
    and ``dbias`` (None unless ``weight`` or ``bias`` is given) of shape ``normalized_shape``
    and the parameters' dtype (``x``'s, or float32 for float32 parameters).
    """
    return _backward("layer_norm_backward", dy, x, mean, rstd, weight, bias)


def rms_norm_backward(dy, x, rstd, weight=None):
    """Gradients of :func:`rms_norm`, given the gradient ``dy`` of its output.

    With ``xhat = x * rstd`` and ``g = dy * weight``::

        dx      = rstd * (g - xhat * mean(g * xhat))
        dweight = sum over rows of dy * xhat

    Arguments as for :func:`layer_norm_backward` without ``mean``. Returns ``(dx, dweight)``;
    ``dweight`` is None when ``weight`` is None, else of ``weight``'s dtype.
    """
    return _backward("rms_norm_backward", dy, x, None, rstd, weight, None)


class _Launches:
    """The cached launches of one (op, layout, switches) key: the planned kernel, and for a
    backward with a weight the auxiliary launches that finish dweight (and dbias), which
    ``reduce`` writes in ``grad_dtype``."""

    __slots__ = ("main", "grad", "partial", "reduce", "grad_dtype")

    def __init__(self, main: c.Launch, grad: _plan.ParamGradPlan | None = None,
                 partial: c.AuxLaunch | None = None, reduce: c.AuxLaunch | None = None,
                 grad_dtype=None):
        self.main = main
        self.grad = grad
        self.partial = partial
        self.reduce = reduce
        self.grad_dtype = grad_dtype


# ---------------------------------------------------------------------------------------------
# Forward.

def _forward(op: str, x, normalized_shape, weight, bias, eps, residual, return_stats, out):
    key = None
    if residual is None and out is None:
        args = _fast_arrays(x, (x, weight, bias))  # CuPy arrays, or same-stream tensors' views
        if args is not None:
            key = _fresh_key(op, args,
                             (_typed(normalized_shape), _typed(eps), _typed(return_stats)))
            hit = _fresh.get(key) if key is not None else None
            xv = args[0]
            if hit is not None and xv.data.device_id == _get_device():
                launch, lead, sdt, eps_c = hit
                new = _new if xv is x else xv.empty  # the caller's kind
                y = new(xv.shape, xv.dtype)
                layer = op == "layer_norm"
                mean = new(lead, sdt) if return_stats and layer else None
                rstd = new(lead, sdt) if return_stats else None
                launch.main(xv, _NULL, _arg(args[1]), _arg(args[2]), y, _NULL, _arg(mean),
                            _arg(rstd), eps_c)
                _last[op] = launch.main.plan
                res = ((y, mean, rstd) if layer else (y, rstd)) if return_stats else y
                return res if xv is x else _results(res)
    return _forward_checked(op, x, normalized_shape, weight, bias, eps, residual, return_stats,
                            out, key)


@c.capture_safe
def _forward_checked(op: str, x, normalized_shape, weight, bias, eps, residual, return_stats,
                     out, fresh_key):
    ax = c.adapt(op, "x", x)
    xa = ax.array
    dtype = c.dtype_name(op, "x", xa)
    ns = _normalized_shape(op, normalized_shape, xa)
    eps = c.check_eps(op, eps, dtype)
    w = None if weight is None else _param(op, "weight", weight, xa, ns)
    b = None if bias is None else _param(op, "bias", bias, xa, ns)
    _check_same_params(op, w, b)
    pf32 = _wide_params(w if w is not None else b, xa)
    r = None
    if residual is not None:
        r = c.adapt(op, "residual", residual).array
        c.check_same(op, "x", xa, "residual", r)
    k = len(ns)
    lead = tuple(xa.shape[:xa.ndim - k])
    rows, cols = math.prod(lead), math.prod(ns)
    if cols > _plan.MAX_COLS:
        raise ValueError(f"{op}: normalized_shape {ns} has {cols} elements; at most "
                         f"{_plan.MAX_COLS} (2^31 - 4096) are supported (the kernels' 32-bit "
                         f"column index)")
    layer = op == "layer_norm"
    sdt = _stat_dtype(dtype)
    dev = xa.data.device_id
    with c.on_device(dev):
        if out is None:
            y = c.cp.empty(xa.shape, xa.dtype)
        else:
            y = c.output(op, ax, out)
            _check_out_overlap(op, y, xa, r, w, b)
        h = c.cp.empty(xa.shape, xa.dtype) if r is not None else None
        mean = c.cp.empty(lead, sdt) if return_stats and layer else None
        rstd = c.cp.empty(lead, sdt) if return_stats else None
        if rows and cols:
            xv, sx = _rows_view(xa, k)
            rv, sr = _rows_view(r, k) if r is not None else (None, 0)
            yv = y
            view = c.trailing_layout(y, k)
            if view is None:  # an out= whose trailing dims are not one run: via a temporary
                yv = c.cp.empty(xa.shape, xa.dtype)
                view = c.trailing_layout(yv, k)
            sy = view.s_outer
            sw = _plan.Switches(w is not None, b is not None, r is not None, pf32)
            arrays = (xv, rv, w, b, yv, h)
            key = (op, dev, dtype, xa.shape, k, sx, sr, sy, sw, c.pointer_offsets(arrays))
            launch = _launches.get(key)
            if launch is None:
                plan = c.plan_for(op, dtype, dev, rows, cols,
                                  [a.data.ptr for a in arrays if a is not None],
                                  [sx, sy] + ([sr] if rv is not None else []), switches=sw,
                                  row_pointers=[a.data.ptr for a in (xv, rv, yv, h)
                                                if a is not None])
                tail = (np.int64(rows), np.int32(cols), np.int64(sx), np.int64(sr),
                        np.int64(sy), np.int64(cols))
                launch = _launches[key] = _Launches(c.Launch(plan, dev, tail))
            launch.main(xv, _arg(rv), _arg(w), _arg(b), yv, _arg(h), _arg(mean), _arg(rstd),
                        sdt(eps))
            if yv is not y:
                y[...] = yv
            _last[op] = launch.main.plan
            if (fresh_key is not None and xv is xa and _uncopied(w, weight)
                    and _uncopied(b, bias)):  # no copies: the fast path reads the arguments
                _fresh[fresh_key] = (launch, lead, sdt, c.bits(sdt(eps)))
        elif rows and return_stats:  # nothing to normalise: the statistics of no values
            rstd.fill(np.nan)
            if mean is not None:
                mean.fill(np.nan)
        yr = ax.wrap(y) if out is None else c.handed_back(out, y)
    wrap = ax.wrap
    if not return_stats:
        return (yr, wrap(h)) if h is not None else yr
    res = (yr, wrap(mean), wrap(rstd)) if layer else (yr, wrap(rstd))
    return res + (wrap(h),) if h is not None else res


def _arg(a):
    return _NULL if a is None else a


# ---------------------------------------------------------------------------------------------
# Backward.

def _backward(op: str, dy, x, mean, rstd, weight, bias):
    key = None
    if bias is None or weight is not None:
        args = _fast_arrays(x, (dy, x, mean, rstd, weight, bias))
        if args is not None:
            key = _fresh_key(op, args, ())
            hit = _fresh.get(key) if key is not None else None
            xv = args[1]
            if hit is not None and xv.data.device_id == _get_device():
                launch, ns = hit[0], hit[1]
                new = _new if xv is x else xv.empty  # the caller's kind
                dx = new(xv.shape, xv.dtype)
                layer = op == "layer_norm_backward"
                dw = db = None
                if weight is not None:
                    dw = new(ns, args[4].dtype)  # the parameters' dtype
                    db = new(ns, args[4].dtype) if layer else None
                _launch_backward(launch, layer, args[0], xv, args[2], args[3], args[4], dx, dw,
                                 db)
                res = (dx, dw, db) if layer else (dx, dw)
                return res if xv is x else _results(res)
    return _backward_checked(op, dy, x, mean, rstd, weight, bias, key)


def _launch_backward(launch, layer, dyv, xv, mean, rstd, w, dx, dw, db) -> None:
    _last["layer_norm_backward" if layer else "rms_norm_backward"] = launch.main.plan
    grad = launch.grad
    partial = None
    p0 = p1 = _NULL  # partial[0], partial[1] as pointers (no views made)
    direct = False
    if grad is not None:
        sdt = _stat_dtype(launch.main.plan.dtype)
        if grad.prows == 1 and dw.dtype == sdt:
            # one partial row in the sums' own dtype is dweight (and dbias): written there,
            # with no reduction launch (small inputs: one block or cluster)
            direct = True
            p0, p1 = dw, _arg(db)
        else:
            partial = _new((grad.nacc, grad.prows, launch.main.plan.cols), sdt)
            c.keep(partial)  # a captured graph writes it on every replay
            p0 = partial.data.ptr
            p1 = p0 + partial.strides[0] if layer else _NULL
    launch.main(dyv, xv, _arg(mean), rstd, _arg(w), dx, p0, p1)
    if launch.partial is not None:  # the main kernel keeps no column sums: from x and dy
        launch.partial(dyv, xv, _arg(mean), rstd, p0, p1)
    if direct:
        return
    if grad is not None and dw.dtype != launch.grad_dtype:  # float sums: backward_param_sums
        dw[...] = partial[0].sum(axis=0)
        if db is not None:
            db[...] = partial[1].sum(axis=0)
    elif grad is not None:
        launch.reduce(partial, dw, _arg(db))


def backward_param_sums(op: str, dy, x, mean, rstd, weight, bias=None):
    """``op``'s backward (``mean`` None for RMS norm) with dweight and dbias left as the
    kernels' float32 column sums (float64 for float64 x), not rounded to x's dtype: for
    :mod:`cukern.dask`, which adds them up across blocks first. Returns what the op does."""
    return _backward_checked(op, dy, x, mean, rstd, weight, bias, None, sums_dtype=True)


@c.capture_safe
def _backward_checked(op: str, dy, x, mean, rstd, weight, bias, fresh_key, sums_dtype=False):
    layer = op == "layer_norm_backward"
    ax = c.adapt(op, "x", x)
    xa = ax.array
    dtype = c.dtype_name(op, "x", xa)
    dya = c.adapt(op, "dy", dy).array
    c.check_same(op, "x", xa, "dy", dya)
    stats = [("mean", mean)] if layer else []
    stats = [(n, c.adapt(op, n, s).array) for n, s in stats + [("rstd", rstd)]]
    w = None
    if weight is not None:
        w = _param(op, "weight", weight, xa, None)
        ns = tuple(w.shape)
        if not ns or len(ns) > xa.ndim or tuple(xa.shape[xa.ndim - len(ns):]) != ns:
            raise ValueError(f"{op}: weight has shape {ns}, which does not match the trailing "
                             f"dimensions of x, whose shape is {tuple(xa.shape)}")
        k = len(ns)
    else:
        first, s0 = stats[0]
        k = xa.ndim - s0.ndim
        if k < 1 or tuple(s0.shape) != tuple(xa.shape[:s0.ndim]):
            raise ValueError(f"{op}: {first} has shape {tuple(s0.shape)}, which is not x's shape "
                             f"{tuple(xa.shape)} without its normalised trailing dimensions")
        ns = tuple(xa.shape[xa.ndim - k:])
    lead = tuple(xa.shape[:xa.ndim - k])
    stats = {n: _check_stat(op, n, s, xa, lead, dtype) for n, s in stats}
    bias_only = bias is not None and w is None
    if bias is not None:
        _check_same_params(op, w, _param(op, "bias", bias, xa, ns))
    rows, cols = math.prod(lead), math.prod(ns)
    if cols > _plan.MAX_COLS:
        raise ValueError(f"{op}: the normalised dimensions {ns} have {cols} elements; at most "
                         f"{_plan.MAX_COLS} (2^31 - 4096) are supported (the kernels' 32-bit "
                         f"column index)")
    dev = xa.data.device_id
    with c.on_device(dev):
        dx = c.cp.empty(xa.shape, xa.dtype)
        dw = db = None
        if bias_only:
            # dbias = dy summed over rows: the weighted kernels with a weight of ones (dy * 1
            # is exact) in bias's dtype give it from their float32 column sums; their dweight
            # is dropped
            w = c.cp.ones(ns, c.adapt(op, "bias", bias).array.dtype)
        pf32 = _wide_params(w, xa)
        if w is not None:
            gdt = _stat_dtype(dtype) if sums_dtype else w.dtype
            dw = c.cp.empty(ns, gdt)
            db = c.cp.empty(ns, gdt) if layer else None
        if rows and cols:
            xv, sx = _rows_view(xa, k)
            dyv, sdy = _rows_view(dya, k)
            sw = _plan.Switches(weight=w is not None, float32_params=pf32)
            arrays = (dyv, xv, w, dx)
            key = (op, dev, dtype, xa.shape, k, sx, sdy, sw, c.pointer_bits(arrays))
            launch = _launches.get(key)
            if launch is None:
                launch = _launches[key] = _plan_backward(
                    op, dtype, dev, rows, cols, [a.data.ptr for a in arrays if a is not None],
                    [sx, sdy], sw, None if w is None else w.dtype)
            _launch_backward(launch, layer, dyv, xv, stats.get("mean"), stats["rstd"], w, dx,
                             dw, db)
            no_copies = dyv is dya and xv is xa and _uncopied(w, weight) and \
                _uncopied(stats["rstd"], rstd) and (not layer or _uncopied(stats["mean"], mean))
            if fresh_key is not None and no_copies:
                _fresh[fresh_key] = (launch, ns)
        elif w is not None:
            dw.fill(0)  # a sum over no rows (or an empty dweight, when cols == 0)
            if db is not None:
                db.fill(0)
    wrap = ax.wrap
    if bias_only:
        dw = None
    if layer:
        return wrap(dx), _wrap_opt(wrap, dw), _wrap_opt(wrap, db)
    return wrap(dx), _wrap_opt(wrap, dw)


def _wrap_opt(wrap, a):
    return None if a is None else wrap(a)


def _plan_backward(op, dtype, dev, rows, cols, ptrs, strides, sw, pdt) -> _Launches:
    """The launches of a backward; ``pdt``: the weight's dtype (None without one), which
    dweight and dbias are returned in."""
    plan = c.plan_for(op, dtype, dev, rows, cols, ptrs, strides, switches=sw)
    sx, sdy = strides
    main = c.Launch(plan, dev, (np.int64(rows), np.int32(cols), np.int64(sdy), np.int64(sx),
                                np.int64(cols)))
    grad = _plan.plan_param_grad(plan, c.device_spec(dev))
    if grad is None:
        return _Launches(main)
    # float32 parameters of 16-bit x: dweight and dbias from float32's reduce kernel (the
    # partial sums are float32 either way)
    gdt = "float32" if sw.float32_params else dtype
    reduce_name = registry.get(op).aux(gdt, 1)[0]
    partial_name = registry.get(op).aux(dtype, grad.partial.pack_size if grad.partial else 1)[1]
    source = plan.family
    reduce = c.AuxLaunch(source, reduce_name, grad.reduce, dev,
                         (np.int64(grad.prows), np.int32(cols), np.int32(grad.reduce.vec)))
    partial = None
    if grad.partial is not None:
        partial = c.AuxLaunch(source, partial_name, grad.partial, dev,
                              (np.int64(rows), np.int32(cols), np.int64(sdy), np.int64(sx)))
    return _Launches(main, grad, partial, reduce, pdt)


def last_plan(op: str):
    """The plan of the latest call of ``op`` (for tests and debugging), or None."""
    return _last.get(op)

"""Batch norm over the channel axis of a CuPy (or DLPack) array: training and eval forward with
a fused add and ReLU (and its 1-bit mask), the backward, and per-channel batch statistics.

The public functions, their fast path and launch cache; the launches are in
:mod:`cukern.ops.batch_norm_launch`, the argument checks and working layouts in
:mod:`cukern.ops.batch_norm_args`."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from .. import registry
from .. import runner as c
from ..plan import batch_norm as bnplan
from .batch_norm_args import (
    _axis,
    _backward_key,
    _check_out,
    _compute_copy,
    _copy_like,
    _empty_like,
    _flag,
    _fresh_key,
    _momentum,
    _param_dtypes,
    _same_layout,
    _same_strides,
    _stat_dtype,
    _vector,
    _working,
    check_statistics,
)
from .batch_norm_launch import (
    _Backward,
    _Forward,
    _Kernel,
    _last,
    _Launches,
    stats_launch,
)

__all__ = ["batch_norm", "batch_norm_backward", "batch_stats", "last_plan"]

_launches: dict[tuple, _Launches] = c.BoundedDict()
# The fast paths: a CuPy call (or one of PyTorch tensors on CuPy's stream, as TensorViews,
# their results allocated by PyTorch) whose arrays' layouts and scalars' types the full path
# validated and planned before -> its launches: batch_norm's key (_fresh_key) -> _Forward;
# batch_norm_backward's (_backward_key) and batch_stats' (("batch_stats", x's layout, axis))
# -> (plan, steps, device).
_fresh: dict[tuple, object] = c.BoundedDict()
_ndarray = c.cp.ndarray if c.cp is not None else None
_get_device = c.cp.cuda.runtime.getDevice if c.cp is not None else None
_tensor_view, _torch_views, _results = c.tensor_view, c.torch_views, c.results
_fast_arrays = c.fast_arrays


def batch_norm(x, running_mean, running_var, weight=None, bias=None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5, *, axis: int = 1, addend=None,
               relu: bool = False, return_stats: bool = False, out=None):
    """Batch normalisation over every axis of ``x`` but the channel axis ``axis``, with a fused
    add and ReLU (PyTorch's ``F.batch_norm`` names and semantics).

    Per channel c, over its ``n`` values (every index of the other axes)::

        training:  mean = sum(x) / n,  var = sum((x - mean)**2) / n     (biased)
                   running_mean <- (1 - momentum) * running_mean + momentum * mean
                   running_var  <- (1 - momentum) * running_var  + momentum * var * n / (n - 1)
        eval:      mean = running_mean,  var = running_var
        invstd = 1 / sqrt(var + eps)   (eval, float16/bfloat16/float32 data: within 2 ulp)
        y = relu?((x - mean) * invstd * weight + bias [+ addend])

    The statistics are per-thread shifted sums turned into Welford states, merged with Chan's
    formula in a fixed order (no atomics): results are bitwise reproducible, and data offset
    far from 0 normalises as well as centred data.

    Parameters
    ----------
    x : cupy.ndarray or a GPU array with ``__dlpack__`` (PyTorch, JAX)
        float16, bfloat16, float32 or float64; rank >= 2. Any dense layout is read as it is
        (NCHW, channels-last NHWC, (N, C), 5-D); other strided views are copied to C order
        first (``cukern.explain`` says so).
    running_mean, running_var : arrays of shape (C,), or None
        float32 (or x's dtype) for 16-bit x, x's dtype otherwise. Training updates them in
        place (the same arrays; JAX arrays, being immutable, are refused there); they may be
        None in training. Eval needs both.
    weight, bias : arrays of shape (C,), optional
        Same dtypes as the running statistics.
    training : bool
        Batch statistics (True) or the running statistics (False).
    momentum : float in [0, 1]
    eps : float, finite, > 0 and a normal number of the compute type (at least 1.2e-38 in
        float32)
    axis : int
        The channel axis (default 1; negative counts from the end).
    addend : array, optional
        Added before the ReLU (a residual): x's shape, dtype and memory layout (strides);
        broadcasting is not supported.
    relu : bool
        Fuse a ReLU: ``y = max(y, 0)``.
    return_stats : bool
        Also return (mean, invstd, mask).
    out : array, optional
        Written with y: x's shape and dtype, any layout; it may be x itself but may not
        overlap any other input.

    Returns
    -------
    y, or ``(y, mean, invstd, mask)`` with ``return_stats``. y: x's shape, dtype and memory
    layout (a channels-last x gives a channels-last y), or ``out``. mean, invstd: (C,),
    float32 (float64 for float64 x); in eval the running mean and 1 / sqrt(running_var + eps).
    mask: None unless ``relu``; else int32 words, ``ceil(x.size / 32)`` of them: bit i of word
    k (``(mask[k] >> i) & 1``) is element ``32 k + i`` of y in y's memory order (C order of
    the (outer, C, inner) view: N, C, H, W order for NCHW, N, H, W, C for channels-last), 1
    where y > 0 (kept by the ReLU); unused bits of the last word are 0. Written by the apply
    kernel with ``__ballot_sync`` (one ballot per element of a 32-lane pack group), only when
    asked for (``relu`` and ``return_stats``). Results are of ``x``'s kind (CuPy in, CuPy out;
    PyTorch and JAX through DLPack).

    Raises
    ------
    ValueError
        Training with one value per channel (n == 1), eval without running statistics, a
        parameter of the wrong length, an addend of another shape or layout, momentum outside
        [0, 1], eps <= 0, not finite or underflowing the compute type, an axis out of range,
        rank < 2, out overlapping an input.
    TypeError
        Host (NumPy) or integer arrays, parameters of another dtype.
    """
    if out is None:
        if type(x) is _ndarray:
            key = _fresh_key(x, running_mean, running_var, weight, bias, addend, axis, training,
                             relu, return_stats, momentum, eps)
            fwd = _fresh.get(key) if key is not None else None
            if fwd is not None and fwd.device == _get_device():
                return fwd.fresh(x, running_mean, running_var, weight, bias, addend, momentum,
                                 eps, return_stats)
        elif type(x).__module__ == "torch":
            y = _fast_torch(x, running_mean, running_var, weight, bias, addend, axis, training,
                            relu, return_stats, momentum, eps)
            if y is not None:
                return y
    return _batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps,
                       axis, addend, relu, return_stats, out)


def _fast_torch(x, rm, rv, w, b, z, axis, training, relu, return_stats, momentum, eps):
    """batch_norm's fast path for PyTorch tensors on CuPy's current stream (every array one):
    their TensorViews through the CuPy fast path's launches (the running statistics updated in
    the tensors' memory), the results new tensors; None where it does not apply."""
    views = _torch_views((x, rm, rv, w, b, z))
    if views is None:
        return None
    xv, rm, rv, w, b, z = views
    key = _fresh_key(xv, rm, rv, w, b, z, axis, training, relu, return_stats, momentum, eps)
    fwd = _fresh.get(key) if key is not None else None
    if fwd is None or fwd.device != _get_device():
        return None
    return _results(fwd.fresh(xv, rm, rv, w, b, z, momentum, eps, return_stats))


@c.capture_safe
def _batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps, axis,
                addend, relu, return_stats, out):
    """batch_norm's full path: validation, planning (once per layout), launches."""
    fn = "batch_norm"
    raw_axis = axis
    ax = c.adapt(fn, "x", x)
    xa = ax.array
    dtype = c.dtype_name(fn, "x", xa)
    axis = _axis(fn, axis, xa)
    training = _flag(fn, "training", training)
    relu = _flag(fn, "relu", relu)
    return_stats = _flag(fn, "return_stats", return_stats)
    momentum = _momentum(fn, momentum)
    eps = c.check_eps(fn, eps, dtype)
    nch = xa.shape[axis]
    allowed = _param_dtypes(dtype)
    rm = _vector(fn, "running_mean", running_mean, xa, nch, allowed, written=training)
    rv = _vector(fn, "running_var", running_var, xa, nch, allowed, written=training)
    w = _vector(fn, "weight", weight, xa, nch, allowed)
    b = _vector(fn, "bias", bias, xa, nch, allowed)
    check_statistics(fn, training, rm, rv, tuple(xa.shape), axis)
    z = None
    if addend is not None:
        z = c.adapt(fn, "addend", addend).array
        _same_layout(fn, "addend", z, xa)
    o = None
    if out is not None:
        if ax.kind == "jax":
            raise TypeError(f"{fn}: out= is not supported for JAX arrays (they are immutable)")
        o = c.adapt(fn, "out", out, out=True).array
        c.check_same(fn, "x", xa, "out", o)
        _check_out(fn, o, xa, [("addend", z), ("running_mean", rm), ("running_var", rv),
                                 ("weight", w), ("bias", b)])
    sdt = _stat_dtype(dtype)
    cdt = sdt
    dev = xa.data.device_id
    with c.on_device(dev):
        xw, view, copied = _working(xa, axis)
        zw = None
        if z is not None:
            zw = z if not copied else c.cp.ascontiguousarray(z)
        y = o if o is not None and _same_strides(o, xw) else _empty_like(xw)
        want_mask = relu and return_stats
        mask = c.cp.empty((-(-xa.size // 32),), np.int32) if want_mask else None
        mean = c.cp.empty((nch,), sdt) if return_stats else None
        invstd = c.cp.empty((nch,), sdt) if return_stats else None
        if xa.size == 0:
            if return_stats and not training and nch:
                mean[...] = rm.astype(sdt)
                invstd[...] = 1.0 / c.cp.sqrt(rv.astype(sdt) + sdt(eps))
            elif return_stats and nch:
                mean.fill(np.nan)
                invstd.fill(np.nan)
        else:
            rm_k, rm_back = _compute_copy(rm, cdt)
            rv_k, rv_back = _compute_copy(rv, cdt)
            w_k, _ = _compute_copy(w, cdt)
            b_k, _ = _compute_copy(b, cdt)
            arrays = [xw, zw, y]
            plan, steps, hit = _get_plan("batch_norm", dtype, dev, view, arrays, copied,
                                         training=training, relu=relu, addend=zw is not None,
                                         mask=want_mask,
                                         return_stats=return_stats and not training)
            if hit.fwd is None:
                hit.fwd = _Forward(plan, steps, dev, relu, want_mask)
            hit.fwd(xw, zw, y, mask, mean, invstd, rm_k, rv_k, w_k, b_k, momentum, eps)
            if o is None and not copied and not (rm_back or rv_back) and w_k is w and b_k is b:
                given = (x, running_mean, running_var, weight, bias, addend)
                # the fast path's key, of the arrays the kernels read (the CuPy arguments, or
                # the views of PyTorch tensors on CuPy's stream): only where every array is one
                if all(a is None or type(a) is _ndarray for a in given) or (
                        ax.same_stream and all(a is None or type(a).__module__ == "torch"
                                               for a in given)):
                    key = _fresh_key(xa, rm, rv, w, b, z, raw_axis, training, relu,
                                     return_stats, momentum, eps)
                    if key is not None:
                        _fresh[key] = hit.fwd
            if training:
                if rm_back:
                    rm[...] = rm_k
                if rv_back:
                    rv[...] = rv_k
            _last["batch_norm"] = plan
        if o is not None:
            if y is not o:
                o[...] = y
            y = c.handed_back(out, o)  # the caller's array, its stream ordered after ours
    wrap = ax.wrap
    y = y if o is not None else wrap(y)
    if not return_stats:
        return y
    return y, wrap(mean), wrap(invstd), (wrap(mask) if mask is not None else None)


def batch_norm_backward(dy, x, mean, invstd, weight=None, *, axis: int = 1, mask=None,
                        addend: bool = False, training: bool = True):
    """Gradients of :func:`batch_norm` given the gradient ``dy`` of its output.

    With ``g = dy`` where ``mask`` kept y (``mask`` given) and 0 elsewhere (``g = dy``
    without a mask), ``xhat = (x - mean) * invstd``, per channel over its n values::

        dbias   = sum(g)
        dweight = sum(g * xhat)
        training:  dx = weight * invstd * (g - dbias / n - xhat * dweight / n)
        eval:      dx = weight * invstd * g          (the statistics were constants)
        daddend = g

    Sums are accumulated in float32 (float64 for float64 data) per thread, then merged per
    channel in a fixed order: bitwise reproducible.

    Parameters
    ----------
    dy, x : arrays of one shape and dtype (float16, bfloat16, float32, float64), rank >= 2
        x is the forward's input. dy in another layout than x is copied to x's.
    mean, invstd : arrays of shape (C,)
        What :func:`batch_norm` returned with ``return_stats``: float32 (float64 for float64).
    weight : array of shape (C,), optional
        The forward's weight (float32 or x's dtype for 16-bit x; x's dtype otherwise).
    axis : int
        The channel axis (default 1).
    mask : int32 array of shape (ceil(x.size / 32),), optional
        The forward's ReLU mask (its format: :func:`batch_norm`), read in x's memory order.
    addend : bool
        Also return ``daddend`` (the gradient of the forward's addend: g).
    training : bool
        Whether the forward used batch statistics (dx through them) or the running ones.

    Returns
    -------
    ``(dx, dweight, dbias)``, or ``(dx, dweight, dbias, daddend)`` with ``addend=True``. dx and
    daddend: x's shape, dtype and memory layout. dweight, dbias: (C,), weight's dtype when
    given, else float32 (float64 for float64 x); returned also without a weight.
    """
    args = _fast_arrays(x, (dy, x, mean, invstd, weight, mask))  # CuPy, or tensors' views
    key = _backward_key(*args, axis, addend, training) if args is not None else None
    bwd = _fresh.get(key) if key is not None else None
    if bwd is not None and bwd.device == _get_device():
        dyv, xv, mu, ist, w, m = args
        dx = _empty_like(xv)
        da = _empty_like(xv) if addend else None
        dwt, dbs = c.empty(xv, (bwd.nch,), bwd.sdt), c.empty(xv, (bwd.nch,), bwd.sdt)
        bwd(dyv, xv, m, mu, ist, w, dx, da, dwt, dbs)
        _last["batch_norm_backward"] = bwd.plan
        res = (dx, dwt, dbs, da) if addend else (dx, dwt, dbs)
        return res if xv is x else _results(res)
    return _batch_norm_backward(dy, x, mean, invstd, weight, axis, mask, addend, training, key)


@c.capture_safe
def _batch_norm_backward(dy, x, mean, invstd, weight, axis, mask, addend, training, fresh_key):
    """batch_norm_backward's full path: validation, planning (once per layout), launches; fills
    the fast path (``fresh_key``: its key of the call, None where it does not apply)."""
    fn = "batch_norm_backward"
    ax = c.adapt(fn, "x", x)
    xa = ax.array
    dtype = c.dtype_name(fn, "x", xa)
    axis = _axis(fn, axis, xa)
    training = _flag(fn, "training", training)
    addend = _flag(fn, "addend", addend)
    dya = c.adapt(fn, "dy", dy).array
    c.check_same(fn, "x", xa, "dy", dya)
    nch = xa.shape[axis]
    sdt = _stat_dtype(dtype)
    mu = _vector(fn, "mean", mean, xa, nch, (np.dtype(sdt),))
    ist = _vector(fn, "invstd", invstd, xa, nch, (np.dtype(sdt),))
    if mu is None or ist is None:
        raise ValueError(f"{fn}: mean and invstd are required (batch_norm(..., "
                         f"return_stats=True) returns them)")
    w = _vector(fn, "weight", weight, xa, nch, _param_dtypes(dtype))
    m = None
    if mask is not None:
        m = c.adapt(fn, "mask", mask).array
        words = -(-xa.size // 32)
        if m.dtype not in (np.dtype(np.int32), np.dtype(np.uint32)):
            raise TypeError(f"{fn}: mask has dtype {m.dtype}, expected int32 (the words "
                            f"batch_norm returns)")
        if tuple(m.shape) != (words,):
            raise ValueError(f"{fn}: mask has shape {tuple(m.shape)}, expected ({words},) "
                             f"(ceil(x.size / 32) words)")
        if m.data.device_id != xa.data.device_id:
            raise ValueError(f"{fn}: mask is on GPU {m.data.device_id} but x is on GPU "
                             f"{xa.data.device_id}")
    wdt = w.dtype if w is not None else np.dtype(sdt)
    dev = xa.data.device_id
    # the fast path reads its arguments as they are: only calls that need no copies fill it
    fresh = fresh_key is not None and mu.flags.c_contiguous and ist.flags.c_contiguous and (
        m is None or m.flags.c_contiguous)
    with c.on_device(dev):  # copies, outputs, plans and launches on x's GPU
        mu, ist = c.cp.ascontiguousarray(mu), c.cp.ascontiguousarray(ist)
        if m is not None and not m.flags.c_contiguous:
            m = c.cp.ascontiguousarray(m)
        xw, view, copied = _working(xa, axis)
        dyw = dya if _same_strides(dya, xw) else _copy_like(dya, xw)
        dx = _empty_like(xw)
        da = _empty_like(xw) if addend else None
        dwt = c.cp.empty((nch,), sdt)
        dbs = c.cp.empty((nch,), sdt)
        if xa.size == 0:
            dwt.fill(0)
            dbs.fill(0)
        else:
            w_k, _ = _compute_copy(w, sdt)
            arrays = [xw, dyw, dx, da]
            plan, steps, hit = _get_plan("batch_norm_backward", dtype, dev, view, arrays,
                                         copied, training=training, addend=addend,
                                         mask=m is not None)
            if hit.bwd is None:
                hit.bwd = _Backward(plan, steps, dev, training)
            hit.bwd(dyw, xw, m, mu, ist, w_k, dx, da, dwt, dbs)
            _last["batch_norm_backward"] = plan
            if fresh and not copied and dyw is dya and w_k is w:
                _fresh[fresh_key] = hit.bwd
        if wdt != dwt.dtype:
            dwt, dbs = dwt.astype(wdt), dbs.astype(wdt)
    wrap = ax.wrap
    res = (wrap(dx), wrap(dwt), wrap(dbs))
    return res + (wrap(da),) if addend else res


def batch_stats(x, *, axis: int = 1):
    """Per-channel batch mean and biased variance of ``x`` over every axis but ``axis``::

        mean = sum(x) / n,  var = sum((x - mean)**2) / n

    (per-thread shifted sums as Welford states, merged with Chan's formula in a fixed order:
    the same statistics as :func:`batch_norm` in training, and a partial result the caller can
    merge across batches with Chan's formula.)

    Parameters
    ----------
    x : array, rank >= 2, float16, bfloat16, float32 or float64, any dense layout
    axis : int
        The channel axis (default 1).

    Returns
    -------
    ``(mean, var)``, each of shape (C,), float32 (float64 for float64 x).
    """
    key = None
    if type(axis) is int:
        xv = x if type(x) is _ndarray else _tensor_view(x)
        if xv is not None:
            key = ("batch_stats", xv.dtype, xv.shape, xv.strides, xv.data.ptr & 15,
                   xv.data.device_id, axis)
            hit = _fresh.get(key)
            if hit is not None and hit[2] == _get_device():
                plan = hit[0]
                sdt = _stat_dtype(plan.dtype)
                mean = c.empty(xv, (plan.view.channels,), sdt)
                var = c.empty(xv, (plan.view.channels,), sdt)
                stats_launch(plan, hit[1], xv, mean, var)
                _last["batch_stats"] = plan
                return (mean, var) if xv is x else (mean.tensor, var.tensor)
    return _batch_stats(x, axis, key)


@c.capture_safe
def _batch_stats(x, axis, fresh_key):
    """batch_stats' full path; fills the fast path (``fresh_key``: its key, or None)."""
    fn = "batch_stats"
    ax = c.adapt(fn, "x", x)
    xa = ax.array
    dtype = c.dtype_name(fn, "x", xa)
    axis = _axis(fn, axis, xa)
    nch = xa.shape[axis]
    n = xa.size // nch if nch else 0
    if nch and n == 0:
        raise ValueError(f"{fn}: x of shape {tuple(xa.shape)} has no values per channel")
    sdt = _stat_dtype(dtype)
    dev = xa.data.device_id
    with c.on_device(dev):
        mean = c.cp.empty((nch,), sdt)
        var = c.cp.empty((nch,), sdt)
        if xa.size:
            xw, view, copied = _working(xa, axis)
            plan, steps, _ = _get_plan("batch_stats", dtype, dev, view, [xw], copied)
            stats_launch(plan, steps, xw, mean, var)
            _last["batch_stats"] = plan
            if fresh_key is not None and not copied and (ax.kind == "cupy" or ax.same_stream):
                _fresh[fresh_key] = (plan, steps, dev)
    return ax.wrap(mean), ax.wrap(var)


@contextlib.contextmanager
def tuned(**changes):
    """Plans every batch-norm call inside the block with these fields of the device's tuning
    changed (``cukern.plan.policy.Tuning``; e.g. ``bn_one_read_max_bytes=0``: the two passes),
    its launch caches emptied on entry and exit (tests and benchmarks; not thread-safe)."""
    real = bnplan.tuning_for
    bnplan.tuning_for = lambda device: dataclasses.replace(real(device), **changes)
    _launches.clear()
    _fresh.clear()
    try:
        yield
    finally:
        bnplan.tuning_for = real
        _launches.clear()
        _fresh.clear()


def last_plan(op: str):
    """The plan of the latest call of ``op`` (for tests and debugging), or None."""
    return _last.get(op)


# ---------------------------------------------------------------------------------------------
# The fast path's key and the launch cache.

def _get_plan(op, dtype, dev, view, arrays, copied, **switches):
    align = c.align_elems(bnplan.ITEMSIZE[dtype],
                          [a.data.ptr for a in arrays if a is not None], [])
    key = (op, dev, dtype, view, align, copied, tuple(sorted(switches.items())))
    hit = _launches.get(key)
    if hit is None:
        spec = registry.get(op)
        plan = bnplan.plan_batch_norm(op, view, dtype, c.device_spec(dev), align_elems=align,
                                      copied=copied, signature=spec.signature, **switches)
        hit = _launches[key] = _Launches(plan, [_Kernel(s, dev) for s in plan.steps])
    return hit.plan, hit.steps, hit

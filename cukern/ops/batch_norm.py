"""Batch norm over the channel axis of a CuPy (or DLPack) array: training and eval forward with
a fused add and ReLU (and its 1-bit mask), the backward, and per-channel batch statistics."""

from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from .. import _compile, registry
from .. import runner as c
from ..plan import batch_norm as bnplan

__all__ = ["batch_norm", "batch_norm_backward", "batch_stats", "last_plan"]

_NULL = np.uint64(0)  # a null pointer argument
_SOURCE = "batch_norm"
_launches: dict[tuple, _Launches] = c.BoundedDict()
# The fast path: a CuPy call whose arrays' layouts and scalars' types the full path validated
# and planned before (_fresh_key) -> its launches.
_fresh: dict[tuple, _Forward] = c.BoundedDict()
# eps the fast path takes as it is: what c.check_eps accepts for every dtype (float32's normal
# range); any other goes through the full checks
_EPS_LO, _EPS_HI = c.EPS_RANGE["float32"]
_ndarray = c.cp.ndarray if c.cp is not None else None
_get_device = c.cp.cuda.runtime.getDevice if c.cp is not None else None
_last: dict[str, bnplan.BatchNormPlan] = {}  # op -> the plan of its latest call



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
        invstd = 1 / sqrt(var + eps)
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
        place (the same arrays); they may be None in training. Eval needs both.
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
    if out is None and type(x) is _ndarray:
        key = _fresh_key(x, running_mean, running_var, weight, bias, addend, axis, training,
                         relu, return_stats, momentum, eps)
        fwd = _fresh.get(key) if key is not None else None
        if fwd is not None and fwd.device == _get_device():
            return fwd.fresh(x, running_mean, running_var, weight, bias, addend, momentum, eps,
                             return_stats)
    return _batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps,
                       axis, addend, relu, return_stats, out)


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
    rm = _vector(fn, "running_mean", running_mean, xa, nch, allowed)
    rv = _vector(fn, "running_var", running_var, xa, nch, allowed)
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
            if (o is None and not copied and not (rm_back or rv_back) and w_k is w
                    and b_k is b and all(a is None or type(a) is _ndarray for a in
                                         (x, running_mean, running_var, weight, bias, addend))):
                key = _fresh_key(x, running_mean, running_var, weight, bias, addend, raw_axis,
                                 training, relu, return_stats, momentum, eps)
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


@c.capture_safe
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
            plan, steps, _ = _get_plan("batch_norm_backward", dtype, dev, view, arrays, copied,
                                    training=training, addend=addend, mask=m is not None)
            a_, ch, inner = view
            part = c.cp.empty((ch, plan.splits, 2), sdt) if plan.splits > 1 else None
            coef = c.cp.empty((nch, 4), sdt)
            finish = (sdt(a_ * inner), np.int32(training), ist, _arg(w_k), dwt, dbs, coef)
            red = steps[0]
            if plan.layout == bnplan.PLANES:
                red(dyw, xw, _arg(m), mu, _arg(part), np.int64(a_), np.int32(ch),
                    *_plane_args(plan), np.int32(plan.splits), *finish)
            else:
                red(dyw, xw, _arg(m), mu, _arg(part), np.int64(a_), np.int32(ch // red.pack),
                    np.int32(plan.splits), *finish)
            if steps[1].kind == "grad_finalize":
                steps[1](part, np.int32(plan.splits), np.int32(ch), mu, *finish)
            steps[-1](dyw, xw if training else _NULL, _arg(m), coef, dx, _arg(da),
                      *_flat_args(plan))
            _last["batch_norm_backward"] = plan
        if wdt != dwt.dtype:
            dwt, dbs = dwt.astype(wdt), dbs.astype(wdt)
    wrap = ax.wrap
    res = (wrap(dx), wrap(dwt), wrap(dbs))
    return res + (wrap(da),) if addend else res


@c.capture_safe
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
            a_, ch, inner = view
            finish = (sdt(a_ * inner), np.int32(1), _NULL, _NULL, _NULL, _NULL, sdt(0), sdt(1),
                      mean, _NULL, var, _NULL)
            part = _stats(steps[0], xw, plan, view, finish)
            if len(steps) > 1:
                steps[1](part, np.int32(plan.splits), np.int32(ch), *finish)
            _last["batch_stats"] = plan
    return ax.wrap(mean), ax.wrap(var)


def last_plan(op: str):
    """The plan of the latest call of ``op`` (for tests and debugging), or None."""
    return _last.get(op)


# ---------------------------------------------------------------------------------------------
# Launches.

class _Kernel:
    """One planned step, compiled, with its grid, block and dynamic shared memory."""

    __slots__ = ("kind", "pack", "kernel", "grid", "block", "smem")

    def __init__(self, step: bnplan.Step, device_id: int):
        self.kind = step.kind
        self.pack = step.targs[1] if len(step.targs) > 1 else 1  # elements a thread's access
        self.kernel = _compile.get_kernel(_SOURCE, step.kernel, device_id)
        self.grid = step.grid
        self.block = step.block
        self.smem = step.smem

    def __call__(self, *args) -> None:
        self.kernel(self.grid, self.block, args, shared_mem=self.smem)


class _Launches:
    __slots__ = ("plan", "steps", "fwd")

    def __init__(self, plan, steps):
        self.plan = plan
        self.steps = steps
        self.fwd: _Forward | None = None  # batch_norm's launches with their fixed arguments


class _Forward:
    """batch_norm's launches for one layout and set of switches, with the arguments that do
    not change from call to call converted once; what both the full path and the fast path
    (a CuPy call of a layout seen before) run."""

    __slots__ = ("plan", "device", "cdt", "nch", "words", "want_mask", "stats", "finalize", "apply",
                 "coef", "part_shape", "count", "training", "stats_tail", "fin_head",
                 "apply_tail")

    def __init__(self, plan, steps, device_id: int, relu: bool, want_mask: bool):
        a_, ch, inner = plan.view
        cdt = _stat_dtype(plan.dtype)
        self.plan, self.device, self.cdt, self.nch = plan, device_id, cdt, ch
        self.words, self.want_mask = -(-(a_ * ch * inner) // 32), want_mask
        self.stats = steps[0] if plan.training else None
        self.finalize = steps[-2] if len(steps) > 1 and steps[-2].kind == "finalize" else None
        self.apply = steps[-1]
        self.coef = len(steps) > 1  # training, or eval with mean and invstd asked for
        self.part_shape = (ch, plan.splits, 3) if plan.splits > 1 else None
        cs = c._c_scalars
        self.count, self.training = cs((cdt(a_ * inner), np.int32(plan.training)))
        if self.stats is None:
            self.stats_tail = ()
        elif plan.layout == bnplan.PLANES:
            self.stats_tail = cs((np.int64(a_), np.int32(ch), *_plane_args(plan),
                                  np.int32(plan.splits)))
        else:
            self.stats_tail = cs((np.int64(a_), np.int32(ch // self.stats.pack),
                                  np.int32(plan.splits)))
        self.fin_head = cs((np.int32(plan.splits), np.int32(ch)))
        self.apply_tail = cs((*_flat_args(plan), np.int32(relu)))

    def __call__(self, x, z, y, mask, mean, invstd, rm, rv, w, b, momentum, eps) -> None:
        cdt = self.cdt
        coef = None
        if self.coef:
            coef = c.cp.empty((self.nch, 4), cdt)
            finish = (self.count, self.training, _arg(rm), _arg(rv), _arg(w), _arg(b),
                      cdt(momentum), cdt(eps), _arg(mean), _arg(invstd), _NULL, coef)
            part = None
            if self.stats is not None:
                if self.part_shape is not None:
                    part = c.cp.empty(self.part_shape, cdt)
                self.stats(x, _arg(part), *self.stats_tail, *finish)
            if self.finalize is not None:
                self.finalize(_arg(part), *self.fin_head, *finish)
            c.keep(coef, part)  # a captured graph writes them on every replay
        self.apply(x, _arg(z), _arg(coef), y, _arg(mask), *self.apply_tail, _arg(rm), _arg(rv),
                   _arg(w), _arg(b), cdt(eps))

    def fresh(self, x, rm, rv, w, b, z, momentum, eps, return_stats: bool):
        """The fast path: new outputs for a validated layout, then the launches."""
        y = _empty_like(x)
        mask = c.cp.empty((self.words,), np.int32) if self.want_mask else None
        mean = invstd = None
        if return_stats:
            mean = c.cp.empty((self.nch,), self.cdt)
            invstd = c.cp.empty((self.nch,), self.cdt)
        self(x, z, y, mask, mean, invstd, rm, rv, w, b, momentum, eps)
        _last["batch_norm"] = self.plan
        return (y, mean, invstd, mask) if return_stats else y


def _param_key(a):
    return None if a is None else (type(a) is _ndarray, a.dtype, a.shape, a.strides,
                                   a.data.device_id)


def _fresh_key(x, rm, rv, w, b, z, axis, training, relu, return_stats, momentum, eps):
    """The fast path's key of a call (None where its scalars need the full checks): what the
    full path validated and planned for, every array's dtype, shape, strides and device, x's
    and the addend's alignment."""
    if not (type(axis) is int and type(training) is bool and type(relu) is bool
            and type(return_stats) is bool and type(momentum) is float
            and type(eps) is float and 0.0 <= momentum <= 1.0 and _EPS_LO <= eps <= _EPS_HI):
        return None
    zk = None
    if z is not None:
        if type(z) is not _ndarray:
            return None
        zk = (z.dtype, z.shape, z.strides, z.data.ptr & 15, z.data.device_id)
    return (x.dtype, x.shape, x.strides, x.data.ptr & 15, x.data.device_id, axis, training,
            relu, return_stats, _param_key(rm), _param_key(rv), _param_key(w), _param_key(b),
            zk)


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


def _stats(step, xw, plan, view, finish):
    """Launches the statistics pass: partial states (returned), or with one split the
    finished channels (``finish``: the bn::Finish arguments; returns None)."""
    a_, ch, inner = view
    part = None
    if plan.splits > 1:
        part = c.cp.empty((ch, plan.splits, 3), _stat_dtype(plan.dtype))
    if plan.layout == bnplan.PLANES:
        step(xw, _arg(part), np.int64(a_), np.int32(ch), *_plane_args(plan),
             np.int32(plan.splits), *finish)
    else:
        step(xw, _arg(part), np.int64(a_), np.int32(ch // step.pack), np.int32(plan.splits),
             *finish)
    return part


def _plane_args(plan):
    """The planes reductions' (B, W, w_m, w_s): elements and packs a plane (bnplan.plane_packs)
    and the fast_div constants of W."""
    inner = plan.view.inner
    w = bnplan.plane_packs(inner, plan.pack)
    mg, sh = bnplan.fast_div(w)
    return np.int32(inner), np.int32(w), np.uint32(mg), np.uint32(sh)


def _flat_args(plan):
    """The elementwise kernels' (total, CBp, d, d_m, d_s, upp) (bnplan.flat_args)."""
    total, cbp, d, mg, sh, upp = bnplan.flat_args(plan)
    return (np.int64(total), np.int32(cbp), np.int32(d), np.uint32(mg), np.uint32(sh),
            np.uint32(upp))


# ---------------------------------------------------------------------------------------------
# Validation and layouts.

def _arg(a):
    return _NULL if a is None else a


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

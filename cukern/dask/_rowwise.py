"""Softmax, log-softmax, layer norm and RMS norm, forward and backward, over Dask arrays: each
block holds whole rows (the reduced axes in one chunk) and runs the single-GPU op; the norms'
dweight and dbias are float32 partial sums per block, added up by a tree reduction."""

from __future__ import annotations

import functools

import dask.array as da
import numpy as np

from .. import reference, runner
from ..ops._norm_args import check_param_dtype, check_same_params
from ..ops.layer_norm import _normalized_shape
from . import _blocks as B

__all__ = ["softmax", "log_softmax", "softmax_backward", "log_softmax_backward", "layer_norm",
           "rms_norm", "layer_norm_backward", "rms_norm_backward"]

SPLIT_EVERY = 16  # blocks added per node of the dweight/dbias reduction tree (one level up
#                   to 16 blocks: every task costs the scheduler ~0.1-0.5 ms of host time)


# ---------------------------------------------------------------------------------------------
# Softmax family.

def softmax(x, axis: int = -1):
    """:func:`cukern.softmax` of a Dask array along ``axis``: ``exp(x - max) / sum(exp(x -
    max))``, block by block.

    ``x``: a Dask array of CuPy blocks (each runs :func:`cukern.softmax` on its GPU) or NumPy
    blocks (each runs the float64 reference, cast back to x's dtype); float16, bfloat16,
    float32 or float64. ``axis`` must lie whole in each block: where it is split, ``x`` is
    rechunked along it only, with a :class:`~cukern.dask.PerformanceWarning`. Returns a lazy
    Dask array of x's shape, dtype and chunks (after that rechunk)."""
    return _rowwise("softmax", (x,), ("x",), axis)


def log_softmax(x, axis: int = -1):
    """:func:`cukern.log_softmax` of a Dask array; as :func:`softmax`."""
    return _rowwise("log_softmax", (x,), ("x",), axis)


def softmax_backward(dy, y, axis: int = -1):
    """:func:`cukern.softmax_backward` over Dask arrays (the gradient ``dy`` first): ``dx =
    (dy - sum(dy * y)) * y``. ``dy`` is rechunked to ``y``'s chunks where they differ (with a
    warning)."""
    return _rowwise("softmax_backward", (y, dy), ("y", "dy"), axis)


def log_softmax_backward(dy, y, axis: int = -1):
    """:func:`cukern.log_softmax_backward` over Dask arrays: ``dx = dy - exp(y) * sum(dy)``;
    as :func:`softmax_backward`."""
    return _rowwise("log_softmax_backward", (y, dy), ("y", "dy"), axis)


def _rowwise(op: str, arrays, names, axis) -> da.Array:
    arrays = [B.as_dask(op, n, a) for n, a in zip(names, arrays)]
    first = arrays[0]
    B.float_dtype(op, names[0], first)
    for n, a in zip(names[1:], arrays[1:]):
        B.check_same(op, names[0], first, n, a)
    if first.ndim == 0:
        raise ValueError(f"{op}: {names[0]} is a 0-d array; the op needs at least one axis")
    ax = runner.normalize_axis(op, axis, first.ndim)
    first = B.whole(op, names[0], first, (ax,))
    rest = []
    for n, a in zip(names[1:], arrays[1:]):  # a loop, not a comprehension: warnings' stacklevel
        rest.append(B.align(op, n, B.whole(op, n, a, (ax,)), first, names[0]))
    ind = tuple(range(first.ndim))
    args = [a for arr in (first, *rest) for a in (arr, ind)]
    return da.blockwise(_rowwise_block, ind, *args, op=op, axis=ax, dtype=first.dtype,
                        meta=first._meta, name=B.fresh_name(op))


def _rowwise_block(*blocks, op: str, axis: int):
    if len(blocks) == 2:  # a backward's (y, dy): y sets the chunks, the ops take dy first
        blocks = blocks[::-1]
    if B.is_cupy(blocks[0]):
        import cukern

        blocks = [B.like(b, blocks[0]) for b in blocks]
        return getattr(cukern, op)(*blocks, axis=axis)
    blocks = [B.like(b, blocks[0]) for b in blocks]
    return getattr(reference, op)(*blocks, axis=axis).astype(blocks[0].dtype)


# ---------------------------------------------------------------------------------------------
# Layer norm and RMS norm, forward.

def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5, *,
               residual=None, return_stats: bool = False):
    """:func:`cukern.layer_norm` of a Dask array, block by block (same arguments, results and
    dtypes): ``y = (x - mean) * rstd * weight + bias`` over the trailing ``normalized_shape``.

    The trailing dimensions must lie whole in each block (rechunked along them only, with a
    :class:`~cukern.dask.PerformanceWarning`, where they are split). ``weight``, ``bias``:
    NumPy, CuPy or one-chunk Dask arrays of x's dtype, or float32 for 16-bit x (both of one
    dtype), moved to each block's kind.
    ``residual``: a Dask array like x. Returns lazy Dask arrays: ``y`` (``(y, h)`` with a
    residual); with ``return_stats=True``, ``(y, mean, rstd)`` (``(y, mean, rstd, h)``),
    ``mean`` and ``rstd`` of shape ``x.shape[:-k]``, float32 (float64 for float64 x). Compute
    them together (``dask.compute(y, mean, rstd)``) so that each block runs once."""
    return _forward("layer_norm", x, normalized_shape, weight, bias, eps, residual,
                    return_stats)


def rms_norm(x, normalized_shape, weight=None, eps: float = 1e-6, *, residual=None,
             return_stats: bool = False):
    """:func:`cukern.rms_norm` of a Dask array: as :func:`layer_norm` without bias and mean;
    returns ``y`` or ``(y, h)``, and ``(y, rstd)`` or ``(y, rstd, h)`` with
    ``return_stats=True``."""
    return _forward("rms_norm", x, normalized_shape, weight, None, eps, residual, return_stats)


def _param(fn: str, name: str, p, x: da.Array, ns: tuple[int, ...]) -> da.Array | None:
    if p is None:
        return None
    if not hasattr(p, "shape") or not hasattr(p, "dtype"):
        raise TypeError(f"{fn}: {name} must be an array, got {type(p).__name__}")
    if tuple(p.shape) != ns:
        raise ValueError(f"{fn}: {name} has shape {tuple(p.shape)}, expected {ns} "
                         f"(normalized_shape)")
    check_param_dtype(fn, name, p.dtype, x.dtype)
    return B.param(fn, name, p, tuple((n,) for n in ns))


def _forward(op, x, normalized_shape, weight, bias, eps, residual, return_stats):
    x = B.as_dask(op, "x", x)
    dtype = B.float_dtype(op, "x", x)
    ns = _normalized_shape(op, normalized_shape, x)
    eps = runner.check_eps(op, eps, dtype)
    if not isinstance(return_stats, (bool, np.bool_)):
        raise TypeError(f"{op}: return_stats must be True or False, got {return_stats!r}")
    k = len(ns)
    nd = x.ndim
    lead = nd - k
    w = _param(op, "weight", weight, x, ns)
    b = _param(op, "bias", bias, x, ns)
    check_same_params(op, w, b)
    x = B.whole(op, "x", x, range(lead, nd))
    r = None
    if residual is not None:
        r = B.as_dask(op, "residual", residual)
        B.check_same(op, "x", x, "residual", r)
        r = B.align(op, "residual", B.whole(op, "residual", r, range(lead, nd)), x, "x")
    ind = tuple(range(nd))
    args = [x, ind] + [a for p in (r,) if p is not None for a in (p, ind)]
    params = B.with_params(args, {"w": w, "b": b}, {"w": ind[lead:], "b": ind[lead:]})
    packed = da.blockwise(_norm_block, ind, *args, op=op, ns=ns, eps=eps,
                          stats=bool(return_stats), dtype=x.dtype, meta=x._meta,
                          name=B.fresh_name(op), **params)
    sdt = B.stat_dtype(x.dtype)
    n_stats = (2 if op == "layer_norm" else 1) if return_stats else 0
    outs = [B.output(packed, 0, x.dtype)]
    for i in range(1, 1 + n_stats):
        outs.append(B.stat_output(packed, i, sdt, lead))
    if r is not None:
        outs.append(B.output(packed, 1 + n_stats, x.dtype))
    return outs[0] if len(outs) == 1 else tuple(outs)


def _norm_block(x, *rest, op: str, ns, eps: float, stats: bool, dask_params, literals):
    rest, p = B.take_params(rest, dask_params, literals, x)
    r = B.like(rest[0], x) if rest else None
    w, b = p.get("w"), p.get("b")
    layer = op == "layer_norm"
    if B.is_cupy(x):
        import cukern

        f = getattr(cukern, op)
        res = f(x, ns, w, b, eps, residual=r, return_stats=stats) if layer else \
            f(x, ns, w, eps, residual=r, return_stats=stats)
        return res if isinstance(res, tuple) else (res,)
    f = getattr(reference, op)
    res = f(x, ns, w, b, eps, residual=r, return_stats=stats) if layer else \
        f(x, ns, w, eps, residual=r, return_stats=stats)
    res = res if isinstance(res, tuple) else (res,)
    sdt = B.stat_dtype(x.dtype)
    n_stats = (2 if layer else 1) if stats else 0
    out = [res[0].astype(x.dtype)] + [s.astype(sdt) for s in res[1:1 + n_stats]]
    return tuple(out + [h.astype(x.dtype) for h in res[1 + n_stats:]])


# ---------------------------------------------------------------------------------------------
# Backward: dx per block; dweight (and dbias) as float32 partial sums per block, added up in a
# tree (float32; float64 for float64 data) and cast to the parameters' dtype at the end.

def layer_norm_backward(dy, x, mean, rstd, weight=None, bias=None):
    """:func:`cukern.layer_norm_backward` over Dask arrays: ``dx`` block by block; ``dweight``
    and ``dbias`` from float32 partial sums of each block (float64 for float64 x), added up
    by a tree reduction (:data:`SPLIT_EVERY` blocks a node) and cast to the parameters' dtype
    (x's, or float32 for float32 parameters of 16-bit x) at the end.

    ``mean``, ``rstd``: what :func:`layer_norm` returned (Dask, NumPy or CuPy arrays of shape
    ``x.shape[:-k]``; rechunked to x's leading chunks). ``bias``: the forward's bias or None,
    checked like ``weight``. Returns lazy ``(dx, dweight, dbias)``; ``dweight`` is None without
    a weight, ``dbias`` None without a weight or a bias."""
    return _backward("layer_norm_backward", dy, x, mean, rstd, weight, bias)


def rms_norm_backward(dy, x, rstd, weight=None):
    """:func:`cukern.rms_norm_backward` over Dask arrays; as :func:`layer_norm_backward`
    without mean and dbias. Returns lazy ``(dx, dweight)``."""
    return _backward("rms_norm_backward", dy, x, None, rstd, weight, None)


def _backward(op, dy, x, mean, rstd, weight, bias):
    layer = op == "layer_norm_backward"
    x = B.as_dask(op, "x", x)
    dtype = B.float_dtype(op, "x", x)
    dy = B.as_dask(op, "dy", dy)
    B.check_same(op, "x", x, "dy", dy)
    sdt = B.stat_dtype(x.dtype)
    stats = ([("mean", mean)] if layer else []) + [("rstd", rstd)]
    for n, s in stats:
        if s is None or not hasattr(s, "shape"):
            raise TypeError(f"{op}: {n} must be an array (what the forward returned), got "
                            f"{type(s).__name__}")
    if weight is not None:
        if not hasattr(weight, "shape"):
            raise TypeError(f"{op}: weight must be an array, got {type(weight).__name__}")
        ns = tuple(weight.shape)
        if not ns or len(ns) > x.ndim or tuple(x.shape[x.ndim - len(ns):]) != ns:
            raise ValueError(f"{op}: weight has shape {ns}, which does not match the trailing "
                             f"dimensions of x, whose shape is {x.shape}")
    else:
        s0 = stats[0][1]
        k = x.ndim - len(s0.shape)
        if k < 1 or tuple(s0.shape) != tuple(x.shape[:len(s0.shape)]):
            raise ValueError(f"{op}: {stats[0][0]} has shape {tuple(s0.shape)}, which is not "
                             f"x's shape {x.shape} without its normalised trailing dimensions")
        ns = tuple(x.shape[x.ndim - k:])
    k = len(ns)
    nd, lead = x.ndim, x.ndim - k
    w = _param(op, "weight", weight, x, ns)
    b = _param(op, "bias", bias, x, ns)
    check_same_params(op, w, b)
    pdt = (w if w is not None else b).dtype if w is not None or b is not None else x.dtype
    for n, s in stats:
        if tuple(s.shape) != tuple(x.shape[:lead]):
            raise ValueError(f"{op}: {n} has shape {tuple(s.shape)}, expected "
                             f"{tuple(x.shape[:lead])} (the leading dimensions of x)")
        if np.dtype(s.dtype) != sdt:
            raise TypeError(f"{op}: {n} has dtype {s.dtype}, expected {sdt} (the statistics "
                            f"dtype for {dtype} input)")
    x = B.whole(op, "x", x, range(lead, nd))
    dy = B.align(op, "dy", B.whole(op, "dy", dy, range(lead, nd)), x, "x")
    ind = tuple(range(nd))
    args = [dy, ind, x, ind]
    params = B.with_params(args, {n: B.param(op, n, s, x.chunks[:lead]) for n, s in stats}
                           | {"w": w, "b": b}, {"mean": ind[:lead], "rstd": ind[:lead],
                                                "w": ind[lead:], "b": ind[lead:]})
    packed = da.blockwise(_norm_backward_block, ind, *args, op=op, k=k, dtype=x.dtype,
                          meta=x._meta, name=B.fresh_name(op), **params)
    dx = B.output(packed, 0, x.dtype)
    if w is None and b is None:
        return (dx, None, None) if layer else (dx, None)
    # dweight and dbias in one tree: each node adds up its blocks' partial sums, both at once;
    # a leaf task a block keeps them (not dx) on the block's worker, so only they travel
    fields = ((1, 2) if w is not None else (2,)) if layer else (1,)
    leaves = [(packed.name, *idx) for idx in np.ndindex(*packed.numblocks)]
    graph, (root,) = B.tree(packed.name, [leaves], _add_partials, (sdt,), SPLIT_EVERY,
                            packed, leaf=functools.partial(_partials, fields=fields))
    grads = []
    for j in range(len(fields)):
        name = f"cukern-grad{j}-{packed.name}"
        dsk = {(name, *(0,) * k): (_cast_pick, root, j, pdt)}
        grads.append(B.from_tasks(name, dsk, (graph, root[0]), tuple((n,) for n in ns),
                                  pdt, x, k))
    if layer and w is None:  # bias alone: dbias
        return dx, None, grads[0]
    return (dx, *grads)


def _partials(block: tuple, fields) -> tuple:
    """A packed block's partial sums (its ``fields``), without dx."""
    return tuple(block[f] for f in fields)


def _add_partials(values: list, level: int, sdt):
    """A tree node: its values' tuples of partial sums added up in order, in ``sdt``."""
    out = []
    for f in range(len(values[0])):
        acc = values[0][f].astype(sdt, copy=True)
        for v in values[1:]:
            acc += v[f]
        out.append(acc)
    return tuple(out)


def _cast_pick(sums: tuple, j: int, dtype):
    return B.cast(sums[j], dtype)


def _norm_backward_block(dy, x, *rest, op: str, k: int, dask_params, literals):
    layer = op == "layer_norm_backward"
    _, p = B.take_params(rest, dask_params, literals, x)
    w, b = p.get("w"), p.get("b")
    has = (w is not None, b is not None)
    params = (w, b) if layer else (w,)
    rest = [p["mean"], p["rstd"]] if layer else [p["rstd"]]
    sdt = B.stat_dtype(x.dtype)
    dy = B.like(dy, x)
    if B.is_cupy(x):
        import cukern

        from ..ops import layer_norm as ln

        if any(has) and x.dtype.itemsize == 2:  # float32 sums, not rounded to x's dtype
            return ln.backward_param_sums(op, dy, x, rest[0] if layer else None, rest[-1],
                                          *params)
        return tuple(getattr(cukern, op)(dy, x, *rest, *params))
    res = getattr(reference, op)(dy, x, *rest, *params)
    return (res[0].astype(x.dtype),) + tuple(
        None if g is None else g.astype(sdt) for g in res[1:])

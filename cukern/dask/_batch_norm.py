"""Synchronised batch norm over Dask arrays: per-block channel statistics merged across blocks
with Chan's formula in a fixed-order tree, then each block normalised with the merged mean and
variance; the backward's channel sums tree-reduced the same way, then dx block by block."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np

from .. import reference, runner
from ..ops.batch_norm_args import _flag, _momentum, _param_dtypes, check_statistics
from . import _blocks as B

__all__ = ["batch_norm", "batch_norm_backward", "batch_stats"]

SPLIT_EVERY = 16  # blocks merged per node of the statistics trees (fewer tasks, less host time)


def _axis(fn: str, x: da.Array, axis) -> int:
    if x.ndim < 2:
        raise ValueError(f"{fn}: x has {x.ndim} dimension{'s' if x.ndim != 1 else ''}, "
                         f"expected at least 2 (N, C, ...)")
    return runner.normalize_axis(fn, axis, x.ndim)


def _start(fn: str, x, axis, training):
    """(x, its dtype name, the channel axis, training), checked as the op checks them."""
    x = B.as_dask(fn, "x", x)
    dtype = B.float_dtype(fn, "x", x)
    return x, dtype, _axis(fn, x, axis), _flag(fn, "training", training)


def _vector(fn: str, name: str, v, x: da.Array, axis: int, allowed):
    """A per-channel argument, checked like the op's, chunked like x's channel axis (see
    :func:`_blocks.param`)."""
    if v is None:
        return None
    if not hasattr(v, "shape") or not hasattr(v, "dtype"):
        raise TypeError(f"{fn}: {name} must be an array, got {type(v).__name__}")
    nch = x.shape[axis]
    if tuple(v.shape) != (nch,):
        raise ValueError(f"{fn}: {name} has shape {tuple(v.shape)}, expected ({nch},) (one "
                         f"value per channel of x, whose shape is {x.shape})")
    if np.dtype(v.dtype) not in allowed:
        raise TypeError(f"{fn}: {name} has dtype {v.dtype}, expected "
                        f"{' or '.join(str(d) for d in allowed)} for {x.dtype} x")
    return B.param(fn, name, v, (x.chunks[axis],))


# ---------------------------------------------------------------------------------------------
# Statistics: (count, mean, M2) per channel and block, merged with Chan's formula.

def _moments(x: da.Array, axis: int) -> da.Array:
    """(C, 3) float64 per channel: count, mean and M2 (sum of squared deviations) of x, from
    each block's statistics merged in a fixed-order tree of :data:`SPLIT_EVERY` blocks a node
    (one tree per chunk of the channel axis; chunks ``(x.chunks[axis], (3,))``)."""
    nd = x.ndim
    ind = tuple(range(nd))
    adjust = {i: 1 for i in ind if i != axis}
    parts = da.blockwise(_moments_block, ind + (nd,), x, ind, axis=axis, new_axes={nd: 3},
                         adjust_chunks=adjust, dtype=np.float64,
                         meta=B.meta(x, np.float64, nd + 1), name=B.fresh_name("moments"))
    return _per_channel(parts, axis, _merge_blocks, "merged")


def _per_channel(parts: da.Array, axis: int, combine, what: str) -> da.Array:
    """Per-block channel states ``parts`` (one block a block of x, a trailing axis of k
    values) reduced by ``combine`` in a tree per chunk of the channel axis: (C, k) float64
    with chunks ``(parts.chunks[axis], (k,))``."""
    nd = parts.ndim - 1
    name = f"cukern-{what}-{parts.name}"
    cs = range(parts.numblocks[axis])
    groups = [[(parts.name, *idx, 0) for idx in np.ndindex(*parts.numblocks[:nd])
               if idx[axis] == c] for c in cs]
    graph, _ = B.tree(parts.name, groups, combine, (), SPLIT_EVERY, parts,
                      roots=[(name, c, 0) for c in cs])
    return da.Array(graph, name, chunks=(parts.chunks[axis], parts.chunks[nd]),
                    dtype=np.float64, meta=B.meta(parts, np.float64, 2))


def _merge_blocks(values: list, level: int):
    """A tree node: the (C_b, 3) merge of its blocks' states (level 0: each of shape
    (1, .., C_b, .., 1, 3); above: (C_b, 3))."""
    xp = B._cupy() if B.is_cupy(values[0]) else np
    if level == 0:
        values = [v.reshape(-1, 3) for v in values]
    return _chan(xp.stack(values), axis=0)


def _moments_block(x, axis: int):
    """One block's (count, mean, M2) per channel, shaped (1, .., C_b, .., 1, 3)."""
    nch = x.shape[axis]
    n = x.size // nch if nch else 0
    shape = [1] * x.ndim
    shape[axis] = nch
    if B.is_cupy(x):
        import cukern

        xp = B._cupy()
        if n:
            mean, var = cukern.batch_stats(x, axis=axis)
            mean, var = mean.astype(np.float64), var.astype(np.float64)
    else:
        xp = np
        if n:
            mean, var = reference.batch_stats(x, axis=axis)
    if not n:  # an empty block adds nothing
        mean = var = xp.zeros(nch, np.float64)
    out = xp.stack([xp.full(nch, float(n)), mean, var * n], axis=-1)
    return out.reshape(shape + [3])


def _chan(a, axis=None, keepdims=False):
    """Chan et al.'s merge of (count, mean, M2) states along ``axis``, all at once:
    ``n = sum n_i``, ``mean = sum n_i mean_i / n``,
    ``M2 = sum M2_i + sum n_i (mean_i - mean)^2`` (the pairwise formula for k parts; no
    E[x^2] - E[x]^2)."""
    xp = B._cupy() if B.is_cupy(a) else np
    n_i, m_i, q_i = a[..., 0], a[..., 1], a[..., 2]
    n = n_i.sum(axis=axis, keepdims=True)
    safe = xp.where(n > 0, n, 1.0)
    mean = (n_i * m_i).sum(axis=axis, keepdims=True) / safe
    m2 = q_i.sum(axis=axis, keepdims=True) + (n_i * (m_i - mean) ** 2).sum(axis=axis,
                                                                         keepdims=True)
    out = xp.stack([n, mean, m2], axis=-1)
    if not keepdims:
        gone = _axes(axis, a.ndim - 1)
        out = out.reshape([s for i, s in enumerate(out.shape[:-1]) if i not in gone] + [3])
    return out


def _axes(axis, nd: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(nd))
    axis = axis if isinstance(axis, tuple) else (axis,)
    return tuple(a % nd for a in axis)


def batch_stats(x, *, axis: int = 1):
    """:func:`cukern.batch_stats` of a Dask array: per-channel mean and biased variance over
    every axis but ``axis``, from each block's statistics (:func:`cukern.batch_stats` on a
    CuPy block, the float64 reference on a NumPy one) merged with Chan's formula in a tree.
    Any chunking works (no rechunk). Returns lazy ``(mean, var)`` of shape (C,), float32
    (float64 for float64 x)."""
    fn = "batch_stats"
    x = B.as_dask(fn, "x", x)
    B.float_dtype(fn, "x", x)
    ax = _axis(fn, x, axis)
    nch = x.shape[ax]
    if nch and x.size // nch == 0:
        raise ValueError(f"{fn}: x of shape {x.shape} has no values per channel")
    return _mean_var(_moments(x, ax), B.stat_dtype(x.dtype))


def _mean_var(moments: da.Array, dtype=np.float64):
    """Lazy (mean, biased variance) of ``dtype`` from the merged moments: one task each per
    chunk of channels."""
    outs = []
    for i in (0, 1):
        name = f"cukern-{'mean' if i == 0 else 'var'}-{moments.name}"
        dsk = {(name, c): (_stat, (moments.name, c, 0), i, dtype)
               for c in range(moments.numblocks[0])}
        outs.append(B.from_tasks(name, dsk, [moments], (moments.chunks[0],), dtype, moments, 1))
    return tuple(outs)


def _stat(m, i: int, dtype):
    """Mean (i = 0) or biased variance (i = 1) from (C, 3) merged moments, as ``dtype``."""
    xp = B._cupy() if B.is_cupy(m) else np
    v = m[:, 1] if i == 0 else m[:, 2] / xp.maximum(m[:, 0], 1.0)
    return v.astype(dtype)


# ---------------------------------------------------------------------------------------------
# Forward.

def batch_norm(x, running_mean, running_var, weight=None, bias=None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5, *, axis: int = 1, addend=None,
               relu: bool = False, return_stats: bool = False):
    """:func:`cukern.batch_norm` over a Dask array (same arguments but ``out``): synchronised
    batch norm, whose result equals the single-GPU op on the whole array.

    Training: each block's per-channel (count, mean, M2) (:func:`cukern.batch_stats` on a CuPy
    block, the reference on a NumPy one) is merged with Chan's formula in a fixed-order tree
    (float64); each block is then normalised by :func:`cukern.batch_norm` in eval mode with
    the merged mean and biased variance as its running statistics (the training
    normalisation, with the addend, ReLU and mask). Eval: each block with the running
    statistics. Any chunking works (no rechunk).

    Running statistics (training): when ``running_mean``/``running_var`` are given, the
    merged statistics are computed when this function is called (one pass over x through the
    scheduler, only (C,) values come back) and the arrays (NumPy or CuPy, on the caller's
    side) are updated in place right then, exactly once, as PyTorch does:
    ``running = (1 - momentum) * running + momentum * batch``, the variance unbiased
    (times n / (n - 1)). ``y`` stays lazy and reuses those statistics, so computing it any
    number of times never touches the running statistics again. Without running statistics
    nothing is computed until asked.

    Returns
    -------
    Lazy ``y`` (x's shape, dtype and chunks) or ``(y, mean, invstd, mask)``: mean and invstd
    of shape (C,), float32 (float64 for float64 x); mask None unless ``relu``, else a 1-D
    int32 Dask array holding, for each block of x in the C order of the blocks, that block's
    ``ceil(block.size / 32)`` mask words (the single-GPU format of the block); its chunks are
    the blocks. It equals the single-GPU mask of the whole array when the blocks split only
    the first axis and each block's size is a multiple of 32.
    """
    fn = "batch_norm"
    x, dtype, ax, training = _start(fn, x, axis, training)
    relu = _flag(fn, "relu", relu)
    return_stats = _flag(fn, "return_stats", return_stats)
    momentum = _momentum(fn, momentum)
    eps = runner.check_eps(fn, eps, dtype)
    allowed = _param_dtypes(dtype)
    for name, v in (("running_mean", running_mean), ("running_var", running_var)):
        _vector(fn, name, v, x, ax, allowed)
    w = _vector(fn, "weight", weight, x, ax, allowed)
    b = _vector(fn, "bias", bias, x, ax, allowed)
    check_statistics(fn, training, running_mean, running_var, tuple(x.shape), ax)
    n = x.size // x.shape[ax] if x.shape[ax] else 0  # values a channel
    z = None
    if addend is not None:
        z = B.as_dask(fn, "addend", addend)
        B.check_same(fn, "x", x, "addend", z)
        z = B.align(fn, "addend", z, x, "x")
    sdt = B.stat_dtype(x.dtype)
    chunks = (x.chunks[ax],)
    if training:
        moments = _moments(x, ax)
        if running_mean is not None or running_var is not None:
            # the statistics pass now (the running statistics change exactly once); the graph
            # is already minimal: Dask's optimisation would cost more than it saves
            (m,) = dask.compute(moments, optimize_graph=False)
            mean_v, var_v = _stat(m, 0, np.float64), _stat(m, 1, np.float64)
            _update(running_mean, mean_v, momentum, 1.0)
            _update(running_var, var_v, momentum, n / (n - 1))
            mean, var = (B.param(fn, name, B.cast(a, sdt), chunks)
                         for name, a in (("mean", mean_v), ("var", var_v)))
        else:
            mean, var = _mean_var(moments, sdt)
    else:
        mean, var = (B.param(fn, n, v, chunks)
                     for n, v in (("running_mean", running_mean), ("running_var", running_var)))
    want_mask = relu and return_stats
    ind = tuple(range(x.ndim))
    args = [x, ind] + ([z, ind] if z is not None else [])
    params = B.with_params(args, {"mean": mean, "var": var, "w": w, "b": b},
                           dict.fromkeys(("mean", "var", "w", "b"), (ax,)))
    packed = da.blockwise(_apply_block, ind, *args, axis=ax, eps=eps, relu=relu,
                          mask=want_mask, dtype=x.dtype, meta=x._meta, name=B.fresh_name(fn),
                          **params)
    y = B.output(packed, 0, x.dtype) if want_mask else packed  # a tuple only with the mask
    if not return_stats:
        return y
    mean, var = (_as_stat(n, v, sdt, chunks, x) for n, v in (("mean", mean), ("var", var)))
    invstd = 1.0 / da.sqrt(var + sdt.type(eps))
    mask = None
    if want_mask:
        words = [-(-int(np.prod(s)) // 32) for s in _block_shapes(x)]
        mask = B.per_block(packed, 1, np.int32, words)
    return y, mean, invstd.astype(sdt), mask


def _as_stat(name: str, v, sdt, chunks, x: da.Array) -> da.Array:
    """A per-channel statistic the blocks used (Dask, NumPy or CuPy) as a Dask array of
    ``sdt``, to return."""
    if not isinstance(v, da.Array):
        return da.from_array(B.to_float(v, sdt), chunks=chunks, asarray=False,
                             name=B.fresh_name(f"batch-{name}"))
    if v.dtype == sdt:
        return v
    return v.map_blocks(B.to_float, sdt, dtype=sdt, meta=B.meta(x, sdt, 1))


def _block_shapes(x: da.Array):
    """The shape of every block of x, in the C order of the blocks."""
    for idx in np.ndindex(*x.numblocks):
        yield tuple(c[i] for c, i in zip(x.chunks, idx))


def _update(running, batch, momentum: float, scale: float) -> None:
    """running <- (1 - momentum) * running + momentum * scale * batch, in place (float64
    arithmetic, stored in running's dtype and kind)."""
    if running is None:
        return
    batch = B.like(batch, running)
    old = B.to_float(running, np.float64)
    running[...] = B.cast((1.0 - momentum) * old + momentum * scale * batch, running.dtype)


def _apply_block(x, *rest, axis: int, eps: float, relu: bool, mask: bool, dask_params,
                 literals):
    rest, p = B.take_params(rest, dask_params, literals, x)
    z = B.like(rest[0], x) if rest else None
    w, b = p.get("w"), p.get("b")
    sdt = B.stat_dtype(x.dtype)
    mean, var = B.to_float(p["mean"], sdt), B.to_float(p["var"], sdt)
    if B.is_cupy(x):
        import cukern

        if z is not None and z.strides != x.strides:  # one block moved between workers
            x, z = B._cupy().ascontiguousarray(x), B._cupy().ascontiguousarray(z)
        res = cukern.batch_norm(x, mean, var, w, b, False, 0.0, eps, axis=axis, addend=z,
                                relu=relu, return_stats=mask)
        return (res[0], res[3]) if mask else res
    res = reference.batch_norm(x, mean, var, w, b, False, 0.0, eps, axis=axis, addend=z,
                               relu=relu, return_stats=mask)
    return (res[0].astype(x.dtype), res[3]) if mask else res.astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Backward.

def batch_norm_backward(dy, x, mean, invstd, weight=None, *, axis: int = 1, mask=None,
                        addend: bool = False, training: bool = True):
    """:func:`cukern.batch_norm_backward` over Dask arrays, for the synchronised forward.

    Each block's per-channel sums of ``g`` (dy, masked by the ReLU's mask) and ``g * xhat``
    (:func:`cukern.batch_norm_backward` on a CuPy block, the reference on a NumPy one) are
    added up in a tree (float64); then each block's ``dx = weight * invstd * (g - dbias / n -
    xhat * dweight / n)`` (eval: ``weight * invstd * g``) from those global sums, computed in
    float32 (float64 for float64 data) with CuPy or NumPy expressions.

    ``mean``, ``invstd``: what :func:`batch_norm` returned (any array kind, shape (C,)).
    ``mask``: the 1-D Dask array :func:`batch_norm` returned for x chunked as now (a plain
    array only when x is one block). Returns lazy ``(dx, dweight, dbias[, daddend])``;
    dweight and dbias of weight's dtype when given, else float32 (float64 for float64 x).
    """
    fn = "batch_norm_backward"
    x, dtype, ax, training = _start(fn, x, axis, training)
    addend = _flag(fn, "addend", addend)
    dy = B.as_dask(fn, "dy", dy)
    B.check_same(fn, "x", x, "dy", dy)
    dy = B.align(fn, "dy", dy, x, "x")
    sdt = B.stat_dtype(x.dtype)
    if mean is None or invstd is None:
        raise ValueError(f"{fn}: mean and invstd are required (batch_norm(..., "
                         f"return_stats=True) returns them)")
    mu = _vector(fn, "mean", mean, x, ax, (sdt,))
    ist = _vector(fn, "invstd", invstd, x, ax, (sdt,))
    w = _vector(fn, "weight", weight, x, ax, _param_dtypes(dtype))
    m = _mask_blocks(fn, mask, x)
    ind = tuple(range(x.ndim))
    nd = x.ndim
    args = [dy, ind, x, ind] + ([m, ind] if m is not None else [])
    stats = B.with_params(args, {"mean": mu, "invstd": ist}, {"mean": (ax,), "invstd": (ax,)})
    parts = da.blockwise(_sums_block, ind + (nd,), *args, axis=ax, new_axes={nd: 2},
                         adjust_chunks={i: 1 for i in ind if i != ax}, dtype=np.float64,
                         meta=B.meta(x, np.float64, nd + 1), name=B.fresh_name("sums"),
                         **stats)
    sums = _per_channel(parts, ax, _add_sums, "sums")
    dbias, dweight = (_column(sums, j, np.float64) for j in (0, 1))
    nch = x.shape[ax]
    n = x.size // nch if nch else 0
    args = [dy, ind, x, ind, dbias, (ax,), dweight, (ax,)]
    args += [m, ind] if m is not None else []
    params = B.with_params(args, {"mean": mu, "invstd": ist, "w": w},
                           dict.fromkeys(("mean", "invstd", "w"), (ax,)))
    packed = da.blockwise(_dx_block, ind, *args, axis=ax, n=n, training=training,
                          addend=addend, dtype=x.dtype, meta=x._meta, name=B.fresh_name(fn),
                          **params)
    gdt = np.dtype(w.dtype) if w is not None else sdt
    res = (B.output(packed, 0, x.dtype) if addend else packed,
           *(_column(sums, j, gdt, sdt) for j in (1, 0)))
    return res + (B.output(packed, 1, x.dtype),) if addend else res


def _add_sums(values: list, level: int):
    """A tree node: the (C_b, 2) float64 sum of its blocks' (1, .., C_b, .., 1, 2) sums."""
    acc = values[0].reshape(-1, 2).astype(np.float64, copy=True)
    for v in values[1:]:
        acc += v.reshape(-1, 2)
    return acc


def _column(sums: da.Array, j: int, dtype, via=None) -> da.Array:
    """Column ``j`` of the (C, 2) channel sums as ``dtype`` (rounded to ``via`` first)."""
    name = f"cukern-col{j}-{np.dtype(dtype).name}-{sums.name}"
    dsk = {(name, c): (_column_block, (sums.name, c, 0), j, dtype, via)
           for c in range(sums.numblocks[0])}
    return B.from_tasks(name, dsk, [sums], (sums.chunks[0],), dtype, sums, 1)


def _column_block(s, j: int, dtype, via):
    v = s[:, j]
    return B.cast(v if via is None else v.astype(via), dtype)


def _mask_blocks(fn: str, mask, x: da.Array) -> da.Array | None:
    """The forward's mask words placed on x's blocks (see :func:`batch_norm`)."""
    if mask is None:
        return None
    words = tuple(-(-int(np.prod(s)) // 32) for s in _block_shapes(x))
    if not isinstance(mask, da.Array):
        if not hasattr(mask, "shape") or x.npartitions != 1:
            raise ValueError(f"{fn}: mask must be the Dask array batch_norm returned (the "
                             f"words of each block of x); got {type(mask).__name__} for x of "
                             f"{x.npartitions} blocks")
        mask = da.from_array(mask, chunks=mask.shape, asarray=False,
                             name=B.fresh_name("mask"))
    if np.dtype(mask.dtype) not in (np.dtype(np.int32), np.dtype(np.uint32)):
        raise TypeError(f"{fn}: mask has dtype {mask.dtype}, expected int32 (the words "
                        f"batch_norm returns)")
    if mask.ndim != 1 or mask.chunks[0] != words:
        raise ValueError(f"{fn}: mask has shape {mask.shape} and chunks {mask.chunks}, expected "
                         f"({sum(words)},) in chunks {words}: the words of each of x's "
                         f"{x.npartitions} blocks, as batch_norm returned them for x chunked "
                         f"as now")
    return B.from_blocks(mask, x)


def _sums_block(dy, x, *rest, axis: int, dask_params, literals):
    """One block's per-channel (sum(g), sum(g * xhat)), shaped (1, .., C_b, .., 1, 2)."""
    rest, p = B.take_params(rest, dask_params, literals, x)
    m = B.like(rest[0], x) if rest else None
    dy, mean, invstd = B.like(dy, x), p["mean"], p["invstd"]
    if B.is_cupy(x):
        import cukern

        xp = B._cupy()
        _, dw, db = cukern.batch_norm_backward(dy, x, mean, invstd, None, axis=axis, mask=m,
                                               training=False)
    else:
        xp = np
        _, dw, db = reference.batch_norm_backward(dy, x, mean, invstd, None, axis=axis,
                                                  mask=m, training=False)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    return xp.stack([db.astype(np.float64), dw.astype(np.float64)], axis=-1).reshape(
        shape + [2])


def _keep(xp, words, like, axis: int):
    """The booleans of mask ``words`` shaped like ``like``, read in its memory order (as the
    op that wrote them: the reference follows the strides; the GPU op reads a layout that no
    (outer, C, inner) view describes as a C-order copy)."""
    order = sorted(range(like.ndim), key=lambda i: (-abs(like.strides[i]), i))
    if xp is not np:
        from ..ops.batch_norm_args import _view_of

        if _view_of(like.shape, like.strides, like.itemsize, axis) is None:
            order = list(range(like.ndim))
    bits = xp.unpackbits(xp.ascontiguousarray(words).view(xp.uint8), bitorder="little")
    keep = bits[:like.size].astype(bool).reshape([like.shape[i] for i in order])
    return keep.transpose(tuple(int(i) for i in np.argsort(order)))


def _dx_block(dy, x, sum_g, sum_gx, *rest, axis: int, n: int, training: bool, addend: bool,
              dask_params, literals):
    rest, p = B.take_params(rest, dask_params, literals, x)
    m = B.like(rest[0], x) if rest else None
    mean, invstd, w = p["mean"], p["invstd"], p.get("w")
    xp = B._cupy() if B.is_cupy(x) else np
    f = B.stat_dtype(x.dtype) if xp is not np else np.dtype(np.float64)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]

    def chan(v):
        return B.to_float(B.like(v, x), f).reshape(shape)

    g = B.to_float(B.like(dy, x), f)
    if m is not None:
        g = xp.where(_keep(xp, m, x, axis), g, f.type(0))
    a = chan(invstd) * (chan(w) if w is not None else f.type(1))
    if training:
        xhat = (B.to_float(x, f) - chan(mean)) * chan(invstd)
        dx = a * (g - chan(sum_g) / f.type(n) - xhat * (chan(sum_gx) / f.type(n)))
    else:
        dx = a * g
    dx = B.cast(dx, x.dtype)
    return (dx, B.cast(g, x.dtype)) if addend else dx  # a tuple only with daddend

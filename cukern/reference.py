"""Float64 NumPy references for every cukern op: what the tests compare against and what the
CLI runs with ``--device cpu``. Inputs of any float dtype (bfloat16 included) are upcast to
float64; results are float64. Permute moves bits: its reference keeps x's dtype."""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["batch_norm", "batch_norm_backward", "batch_stats", "layer_norm", "layer_norm_backward",
           "log_softmax", "log_softmax_backward", "pack_mask", "permute", "rms_norm",
           "rms_norm_backward", "softmax", "softmax_backward", "unpack_mask"]


def _quiet(fn):
    """``fn`` without NumPy's RuntimeWarnings: NaN and inf in the data propagate to the result
    as on the GPU, and the command line's --device cpu path prints no warnings for them."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with np.errstate(invalid="ignore", over="ignore", divide="ignore", under="ignore"):
            return fn(*args, **kwargs)

    return wrapped


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def softmax(x, axis: int = -1) -> np.ndarray:
    """``exp(x - max) / sum(exp(x - max))``; a row of all -inf gives NaN."""
    x = _f64(x)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(x - np.max(x, axis=axis, keepdims=True))
        return e / np.sum(e, axis=axis, keepdims=True)


def log_softmax(x, axis: int = -1) -> np.ndarray:
    """``(x - max) - log(sum(exp(x - max)))``; a row of all -inf gives NaN."""
    x = _f64(x)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        s = x - np.max(x, axis=axis, keepdims=True)
        return s - np.log(np.sum(np.exp(s), axis=axis, keepdims=True))


@_quiet
def softmax_backward(dy, y, axis: int = -1) -> np.ndarray:
    """``dx = (dy - sum(dy * y)) * y`` for y = softmax(x); the gradient ``dy`` first."""
    y, dy = _f64(y), _f64(dy)
    return (dy - np.sum(dy * y, axis=axis, keepdims=True)) * y


@_quiet
def log_softmax_backward(dy, y, axis: int = -1) -> np.ndarray:
    """``dx = dy - exp(y) * sum(dy)`` for y = log_softmax(x); the gradient ``dy`` first."""
    y, dy = _f64(y), _f64(dy)
    return dy - np.exp(y) * np.sum(dy, axis=axis, keepdims=True)


# ---------------------------------------------------------------------------------------------
# Layer norm and RMS norm over trailing dimensions. Same arguments and return tuples as the ops.

def _norm_dims(x, normalized_shape) -> int:
    ns = (normalized_shape,) if np.isscalar(normalized_shape) else tuple(normalized_shape)
    if not ns or tuple(np.shape(x)[np.ndim(x) - len(ns):]) != tuple(int(n) for n in ns):
        raise ValueError(f"normalized_shape {ns} does not match the trailing dimensions of x, "
                         f"shape {np.shape(x)}")
    return len(ns)


def _skip(x, residual):
    """x, or x + residual rounded to x's dtype (what the op computes and returns as h)."""
    x = np.asarray(x)
    if residual is None:
        return _f64(x), None
    h = (x + np.asarray(residual).astype(x.dtype)).astype(x.dtype)
    return _f64(h), _f64(h)


@_quiet
def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5, *,
               residual=None, return_stats: bool = False):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the trailing dimensions, var
    biased, from a two-pass float64 mean and variance. Returns y or (y, h), and with
    ``return_stats=True`` (y, mean, rstd[, h]), like :func:`cukern.layer_norm`; with a
    residual, x is replaced by h = x + residual rounded to x's dtype."""
    k = _norm_dims(x, normalized_shape)
    v, h = _skip(x, residual)
    axes = tuple(range(v.ndim - k, v.ndim))
    mean = v.mean(axis=axes, keepdims=True)
    var = ((v - mean) ** 2).mean(axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    y = (v - mean) * rstd
    if weight is not None:
        y = y * _f64(weight)
    if bias is not None:
        y = y + _f64(bias)
    lead = v.shape[:v.ndim - k]
    if not return_stats:
        return (y, h) if h is not None else y
    out = (y, mean.reshape(lead), rstd.reshape(lead))
    return out + (h,) if h is not None else out


@_quiet
def rms_norm(x, normalized_shape, weight=None, eps: float = 1e-6, *, residual=None,
             return_stats: bool = False):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the trailing dimensions. Returns
    y or (y, h), and (y, rstd[, h]) with ``return_stats=True``, like :func:`cukern.rms_norm`."""
    k = _norm_dims(x, normalized_shape)
    v, h = _skip(x, residual)
    axes = tuple(range(v.ndim - k, v.ndim))
    rstd = 1.0 / np.sqrt((v * v).mean(axis=axes, keepdims=True) + eps)
    y = v * rstd
    if weight is not None:
        y = y * _f64(weight)
    if not return_stats:
        return (y, h) if h is not None else y
    out = (y, rstd.reshape(v.shape[:v.ndim - k]))
    return out + (h,) if h is not None else out


@_quiet
def _norm_backward(dy, x, mean, rstd, weight):
    x, dy, rstd = _f64(x), _f64(dy), _f64(rstd)
    k = np.ndim(weight) if weight is not None else x.ndim - rstd.ndim
    axes = tuple(range(x.ndim - k, x.ndim))
    lead = tuple(range(x.ndim - k))
    expand = (...,) + (None,) * k
    r = rstd[expand]
    xhat = (x - _f64(mean)[expand]) * r if mean is not None else x * r
    g = dy * _f64(weight) if weight is not None else dy
    gx = (g * xhat).mean(axis=axes, keepdims=True)
    if mean is not None:
        dx = r * (g - g.mean(axis=axes, keepdims=True) - xhat * gx)
    else:
        dx = r * (g - xhat * gx)
    if weight is None:
        return dx, None, None
    return dx, (dy * xhat).sum(axis=lead), dy.sum(axis=lead)


def layer_norm_backward(dy, x, mean, rstd, weight=None, bias=None):
    """``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``xhat = (x - mean) * rstd``,
    ``g = dy * weight``; ``dweight = sum_rows(dy * xhat)`` (None without a weight), ``dbias =
    sum_rows(dy)`` (None without a weight or a bias). Returns (dx, dweight, dbias) like
    :func:`cukern.layer_norm_backward`."""
    dx, dw, db = _norm_backward(dy, x, mean, rstd, weight)
    if weight is None and bias is not None:
        db = _f64(dy).sum(axis=tuple(range(np.ndim(x) - np.ndim(bias))))
    return dx, dw, db


def rms_norm_backward(dy, x, rstd, weight=None):
    """``dx = rstd * (g - xhat * mean(g * xhat))`` with ``xhat = x * rstd``, ``g = dy * weight``;
    ``dweight = sum_rows(dy * xhat)`` (None without a weight). Returns (dx, dweight)."""
    dx, dw, _ = _norm_backward(dy, x, None, rstd, weight)
    return dx, dw


# ---------------------------------------------------------------------------------------------
# Batch norm over every axis but the channel axis, with a fused ReLU (and add + ReLU). Same
# arguments and return tuples as the ops. Arrays keep x's memory layout (a channels-last view
# gives channels-last results), and the ReLU mask packs y > 0 in that memory order.

def _channel_axis(x, axis: int, name: str) -> int:
    nd = np.ndim(x)
    if nd < 2:
        raise ValueError(f"{name}: x has {nd} dimension{'s' if nd != 1 else ''}, expected at "
                         f"least 2 (N, C, ...)")
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{name}: axis must be an int, got {type(axis).__name__}")
    if not -nd <= axis < nd:
        raise ValueError(f"{name}: axis {axis} is out of range for x with {nd} dimensions")
    return int(axis) % nd


def _memory_axes(a) -> tuple[int, ...]:
    """The axes of ``a`` from the slowest-varying in memory to the fastest (C order for a
    C-contiguous array; N, H, W, C for a channels-last NCHW view)."""
    strides = np.asarray(a).strides
    return tuple(sorted(range(len(strides)), key=lambda i: (-abs(strides[i]), i)))


def _per_channel(v, c: int, what: str, name: str) -> np.ndarray:
    if v is None:
        return None
    if np.shape(v) != (c,):
        raise ValueError(f"{name}: {what} has shape {np.shape(v)}, expected ({c},) (one value "
                         f"per channel)")
    return _f64(v)


def pack_mask(keep) -> np.ndarray:
    """int32 words of the bits of ``keep`` (a boolean array, flattened in C order: pass it in
    memory order): bit i of word k is ``keep[32 k + i]``; unused tail bits are 0. Returns
    ``ceil(n / 32)`` words."""
    bits = np.asarray(keep, dtype=bool).ravel()
    words = -(-bits.size // 32)
    padded = np.zeros(words * 32, dtype=bool)
    padded[:bits.size] = bits
    return np.packbits(padded, bitorder="little").view("<i4").astype(np.int32)


def unpack_mask(words, n: int) -> np.ndarray:
    """The ``n`` booleans packed by :func:`pack_mask` (in the order they were packed)."""
    w = np.asarray(words)
    if w.dtype != np.int32:
        raise TypeError(f"unpack_mask: mask has dtype {w.dtype}, expected int32")
    if w.shape != (-(-int(n) // 32),):
        raise ValueError(f"unpack_mask: mask has shape {w.shape}, expected "
                         f"({-(-int(n) // 32)},) for {n} elements")
    raw = np.ascontiguousarray(w, dtype="<i4").view(np.uint8)
    return np.unpackbits(raw, bitorder="little")[:int(n)].astype(bool)


def _mask_of(keep, like) -> np.ndarray:
    """pack_mask of ``keep`` (shaped like ``like``) in ``like``'s memory order."""
    return pack_mask(np.transpose(keep, _memory_axes(like)))


def _keep_of(mask, like) -> np.ndarray:
    """The booleans of ``mask`` shaped like ``like``, read in ``like``'s memory order."""
    order = _memory_axes(like)
    shape = np.shape(like)
    keep = unpack_mask(mask, int(np.prod(shape, dtype=np.int64)))
    return np.transpose(keep.reshape([shape[i] for i in order]), np.argsort(order))


@_quiet
def batch_stats(x, *, axis: int = 1):
    """Per-channel ``mean`` and biased ``var = mean((x - mean)^2)`` over every axis of x but
    ``axis``, two-pass in float64. Returns (mean, var), each of shape (C,)."""
    ax = _channel_axis(x, axis, "batch_stats")
    v = _f64(x)
    red = tuple(i for i in range(v.ndim) if i != ax)
    if v.shape[ax] and v.size // v.shape[ax] == 0:
        raise ValueError(f"batch_stats: x of shape {v.shape} has no values per channel")
    mean = v.mean(axis=red, keepdims=True)
    var = ((v - mean) ** 2).mean(axis=red)
    return mean.reshape(-1), var


@_quiet
def batch_norm(x, running_mean, running_var, weight=None, bias=None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5, *, axis: int = 1, addend=None,
               relu: bool = False, return_stats: bool = False, out=None):
    """``y = relu?((x - mean) * invstd * weight + bias [+ addend])`` per channel along ``axis``.

    Training: mean and biased var over every other axis (two-pass float64), invstd =
    1 / sqrt(var + eps), and the running statistics (NumPy arrays, None allowed) updated in
    place: ``running = (1 - momentum) * running + momentum * batch``, the variance unbiased
    (times n / (n - 1)). Eval: mean = running_mean, invstd = 1 / sqrt(running_var + eps).
    Returns y (float64, in x's memory layout; written into ``out`` when given), or with
    ``return_stats`` (y, mean, invstd, mask): mask is :func:`pack_mask` of y > 0 in x's memory
    order with ``relu``, else None."""
    name = "batch_norm"
    ax = _channel_axis(x, axis, name)
    if not 0.0 <= float(momentum) <= 1.0:
        raise ValueError(f"{name}: momentum must be in [0, 1], got {momentum}")
    if not (float(eps) > 0.0 and np.isfinite(eps)):
        raise ValueError(f"{name}: eps must be positive and finite, got {eps}")
    v = _f64(x)  # order "K": x's layout
    c = v.shape[ax]
    n = v.size // c if c else 0
    red = tuple(i for i in range(v.ndim) if i != ax)
    bshape = [1] * v.ndim
    bshape[ax] = c
    rm = _per_channel(running_mean, c, "running_mean", name)
    rv = _per_channel(running_var, c, "running_var", name)
    w = _per_channel(weight, c, "weight", name)
    b = _per_channel(bias, c, "bias", name)
    if training:
        if n <= 1:
            raise ValueError(f"{name}: expected more than 1 value per channel when training, "
                             f"got x of shape {v.shape} (channel axis {ax})")
        mean = v.mean(axis=red, keepdims=True)
        var = ((v - mean) ** 2).mean(axis=red)
        mean = mean.reshape(c)
        invstd = 1.0 / np.sqrt(var + eps)
        if running_mean is not None:
            running_mean[...] = (1.0 - momentum) * rm + momentum * mean
        if running_var is not None:
            running_var[...] = (1.0 - momentum) * rv + momentum * var * (n / (n - 1))
    else:
        if rm is None or rv is None:
            raise ValueError(f"{name}: eval (training=False) needs running_mean and "
                             f"running_var")
        mean, invstd = rm, 1.0 / np.sqrt(rv + eps)
    z = (v - mean.reshape(bshape)) * invstd.reshape(bshape)
    if w is not None:
        z = z * w.reshape(bshape)
    if b is not None:
        z = z + b.reshape(bshape)
    if addend is not None:
        if np.shape(addend) != v.shape:
            raise ValueError(f"{name}: addend has shape {np.shape(addend)}, expected "
                             f"{v.shape} (the shape of x)")
        z = z + _f64(addend)
    y = np.empty_like(v)  # x's layout
    y[...] = z
    if relu:
        np.maximum(y, 0.0, out=y)
    if out is not None:
        out[...] = y
        y = out
    if not return_stats:
        return y
    mask = _mask_of(np.asarray(y) > 0, v) if relu else None
    return y, mean, invstd, mask


@_quiet
def batch_norm_backward(dy, x, mean, invstd, weight=None, *, axis: int = 1, mask=None,
                        addend: bool = False, training: bool = True):
    """The backward of :func:`batch_norm` for its saved mean and invstd.

    ``g = dy`` where the ReLU kept y (``mask``, read in x's memory order; all of dy without
    one), ``xhat = (x - mean) * invstd``; per channel ``dbias = sum(g)``, ``dweight =
    sum(g * xhat)``; training: ``dx = weight * invstd * (g - dbias / n - xhat * dweight / n)``
    (n values per channel), eval: ``dx = weight * invstd * g``. Returns (dx, dweight, dbias),
    and g as daddend with ``addend=True``; dweight and dbias also without a weight."""
    name = "batch_norm_backward"
    ax = _channel_axis(x, axis, name)
    v, d = _f64(x), _f64(dy)
    if d.shape != v.shape:
        raise ValueError(f"{name}: dy has shape {d.shape}, expected {v.shape} (the shape of x)")
    c = v.shape[ax]
    n = v.size // c if c else 0
    red = tuple(i for i in range(v.ndim) if i != ax)
    bshape = [1] * v.ndim
    bshape[ax] = c
    mu = _per_channel(mean, c, "mean", name).reshape(bshape)
    r = _per_channel(invstd, c, "invstd", name).reshape(bshape)
    w = _per_channel(weight, c, "weight", name)
    w = np.ones(bshape) if w is None else w.reshape(bshape)
    g = d if mask is None else np.where(_keep_of(mask, v), d, 0.0)
    xhat = (v - mu) * r
    dbias = g.sum(axis=red)
    dweight = (g * xhat).sum(axis=red)
    dx = np.empty_like(v)  # x's layout
    if training:
        dx[...] = w * r * (g - dbias.reshape(bshape) / n - xhat * dweight.reshape(bshape) / n)
    else:
        dx[...] = w * r * g
    if not addend:
        return dx, dweight, dbias
    da = np.empty_like(v)
    da[...] = g
    return dx, dweight, dbias, da


# ---------------------------------------------------------------------------------------------
# Permute: data movement, exact in every dtype.

def permute(x, axes=None) -> np.ndarray:
    """``numpy.transpose(x, axes)`` materialised as a C-contiguous array of x's dtype (the op
    moves bits: NaN payloads and -0.0 survive)."""
    return np.transpose(np.asarray(x), axes).copy(order="C")

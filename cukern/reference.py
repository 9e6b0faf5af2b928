"""Float64 NumPy references for every cukern op: what the tests compare against and what the
CLI runs with ``--device cpu``. Inputs of any float dtype (bfloat16 included) are upcast to
float64; results are float64."""

from __future__ import annotations

import numpy as np

__all__ = ["layer_norm", "layer_norm_backward", "log_softmax", "log_softmax_backward", "rms_norm",
           "rms_norm_backward", "softmax", "softmax_backward"]


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


def softmax_backward(y, dy, axis: int = -1) -> np.ndarray:
    """``dx = (dy - sum(dy * y)) * y`` for y = softmax(x)."""
    y, dy = _f64(y), _f64(dy)
    return (dy - np.sum(dy * y, axis=axis, keepdims=True)) * y


def log_softmax_backward(y, dy, axis: int = -1) -> np.ndarray:
    """``dx = dy - exp(y) * sum(dy)`` for y = log_softmax(x)."""
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


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5, *,
               residual=None, return_stats: bool = True):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the trailing dimensions, var
    biased, from a two-pass float64 mean and variance. Returns (y, mean, rstd[, h]) or y / (y, h)
    like :func:`cukern.layer_norm`; with a residual, x is replaced by h = x + residual rounded to
    x's dtype."""
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


def rms_norm(x, normalized_shape, weight=None, eps: float = 1e-6, *, residual=None,
             return_stats: bool = True):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the trailing dimensions. Returns
    (y, rstd[, h]) or y / (y, h) like :func:`cukern.rms_norm`."""
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


def layer_norm_backward(dy, x, mean, rstd, weight=None):
    """``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`` with ``xhat = (x - mean) * rstd``,
    ``g = dy * weight``; ``dweight = sum_rows(dy * xhat)``, ``dbias = sum_rows(dy)`` (None, None
    without a weight). Returns (dx, dweight, dbias) like :func:`cukern.layer_norm_backward`."""
    return _norm_backward(dy, x, mean, rstd, weight)


def rms_norm_backward(dy, x, rstd, weight=None):
    """``dx = rstd * (g - xhat * mean(g * xhat))`` with ``xhat = x * rstd``, ``g = dy * weight``;
    ``dweight = sum_rows(dy * xhat)`` (None without a weight). Returns (dx, dweight)."""
    dx, dw, _ = _norm_backward(dy, x, None, rstd, weight)
    return dx, dw

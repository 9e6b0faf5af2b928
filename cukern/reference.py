"""Float64 NumPy references for every cukern op: what the tests compare against and what the
CLI runs with ``--device cpu``. Inputs of any float dtype (bfloat16 included) are upcast to
float64; results are float64."""

from __future__ import annotations

import numpy as np

__all__ = ["softmax", "log_softmax", "softmax_backward", "log_softmax_backward"]


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

"""``cukern.torch``'s softmax, log-softmax, layer norm and RMS norm custom ops, forward and
backward, with their fake implementations and autograd formulas."""

from __future__ import annotations

import torch

import cukern as _ck

from . import _base
from ._base import _check_dim, _d, _register, _stat_dtype

__all__: list[str] = []


# ---------------------------------------------------------------------------------------------
# Softmax and log-softmax: dx from the output y and dy.

def _softmax_family(fwd: str):
    bwd = f"{fwd}_backward"

    def impl(x, dim):
        with _base._cuda(fwd, x):
            return getattr(_ck, fwd)(_d(x), dim)

    def fake(x, dim):
        _check_dim(fwd, dim, x.dim())
        return x.new_empty(x.shape)

    def setup_context(ctx, inputs, output):
        ctx.dim = inputs[1]
        ctx.save_for_backward(output)

    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return getattr(torch.ops.cukern, bwd)(dy, y, ctx.dim), None

    def impl_backward(dy, y, dim):
        with _base._cuda(bwd, y):
            return getattr(_ck, bwd)(_d(dy), _d(y), axis=dim)

    def fake_backward(dy, y, dim):
        _check_dim(bwd, dim, y.dim())
        return y.new_empty(y.shape)

    _register(fwd, "(Tensor x, int dim) -> Tensor", impl, fake, setup_context, backward)
    _register(bwd, "(Tensor dy, Tensor y, int dim) -> Tensor", impl_backward, fake_backward)


_softmax_family("softmax")
_softmax_family("log_softmax")


# ---------------------------------------------------------------------------------------------
# Layer norm and RMS norm: (y, mean, rstd) / (y, rstd); the statistics are not differentiable.

def _ln(x, normalized_shape, weight, bias, eps):
    with _base._cuda("layer_norm", x):
        return _ck.layer_norm(_d(x), normalized_shape=tuple(normalized_shape),
                              weight=_d(weight), bias=_d(bias), eps=eps, return_stats=True)


def _lead(fn: str, x, normalized_shape):
    """x's leading dims (the statistics' shape), after checking ``normalized_shape``."""
    k = len(normalized_shape)
    if not 0 < k <= x.dim() or list(x.shape[x.dim() - k:]) != list(normalized_shape):
        raise ValueError(f"cukern.torch.{fn}: normalized_shape {list(normalized_shape)} does "
                         f"not match the trailing dimensions of x, whose shape is "
                         f"{list(x.shape)}")
    return x.shape[:x.dim() - k]


def _ln_fake(x, normalized_shape, weight, bias, eps):
    lead = _lead("layer_norm", x, normalized_shape)
    sdt = _stat_dtype(x.dtype)
    return x.new_empty(x.shape), x.new_empty(lead, dtype=sdt), x.new_empty(lead, dtype=sdt)


def _ln_setup(ctx, inputs, output):
    x, normalized_shape, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, mean, rstd, weight, bias)


def _ln_backward(ctx, dy, _dmean, _drstd):
    x, mean, rstd, weight, bias = ctx.saved_tensors
    needs = ctx.needs_input_grad
    dx, dw, db = torch.ops.cukern.layer_norm_backward(dy, x, mean, rstd, weight, bias)
    return (dx if needs[0] else None, None, dw if needs[2] and weight is not None else None,
            db if needs[3] and bias is not None else None, None)


def _ln_bwd(dy, x, mean, rstd, weight, bias=None):
    with _base._cuda("layer_norm_backward", x):
        dx, dw, db = _ck.layer_norm_backward(_d(dy), _d(x), _d(mean), _d(rstd),
                                             weight=_d(weight), bias=_d(bias))
    # an absent gradient is an empty tensor (a custom op returns tensors, not None)
    dw = dx.new_empty((0,)) if dw is None else dw.to(weight.dtype)
    db = dx.new_empty((0,)) if db is None else db.to((bias if weight is None else weight).dtype)
    return dx, dw, db


def _ln_bwd_fake(dy, x, mean, rstd, weight, bias=None):
    def grad(p):
        return x.new_empty((0,)) if p is None else p.new_empty(p.shape)

    return x.new_empty(x.shape), grad(weight), grad(weight if weight is not None else bias)


_register("layer_norm", "(Tensor x, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, "
          "float eps) -> (Tensor, Tensor, Tensor)", _ln, _ln_fake, _ln_setup, _ln_backward)
_register("layer_norm_backward", "(Tensor dy, Tensor x, Tensor mean, Tensor rstd, "
          "Tensor? weight, Tensor? bias=None) -> (Tensor, Tensor, Tensor)", _ln_bwd, _ln_bwd_fake)


def _rms(x, normalized_shape, weight, eps):
    with _base._cuda("rms_norm", x):
        return _ck.rms_norm(_d(x), normalized_shape=tuple(normalized_shape), weight=_d(weight),
                            eps=eps, return_stats=True)


def _rms_fake(x, normalized_shape, weight, eps):
    lead = _lead("rms_norm", x, normalized_shape)
    return x.new_empty(x.shape), x.new_empty(lead, dtype=_stat_dtype(x.dtype))


def _rms_setup(ctx, inputs, output):
    x, _, weight, _ = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, output[1], weight)


def _rms_backward(ctx, dy, _drstd):
    x, rstd, weight = ctx.saved_tensors
    needs = ctx.needs_input_grad
    dx, dw = torch.ops.cukern.rms_norm_backward(dy, x, rstd, weight)
    return dx if needs[0] else None, None, dw if needs[2] and weight is not None else None, None


def _rms_bwd(dy, x, rstd, weight):
    with _base._cuda("rms_norm_backward", x):
        dx, dw = _ck.rms_norm_backward(dy=_d(dy), x=_d(x), rstd=_d(rstd), weight=_d(weight))
    return (dx, dx.new_empty((0,))) if weight is None else (dx, dw.to(weight.dtype))


def _rms_bwd_fake(dy, x, rstd, weight):
    dw = x.new_empty((0,)) if weight is None else weight.new_empty(weight.shape)
    return x.new_empty(x.shape), dw


_register("rms_norm", "(Tensor x, SymInt[] normalized_shape, Tensor? weight, float eps) -> "
          "(Tensor, Tensor)", _rms, _rms_fake, _rms_setup, _rms_backward)
_register("rms_norm_backward", "(Tensor dy, Tensor x, Tensor rstd, Tensor? weight) -> "
          "(Tensor, Tensor)", _rms_bwd, _rms_bwd_fake)

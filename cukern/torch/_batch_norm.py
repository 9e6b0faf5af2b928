"""``cukern.torch``'s batch norm, batch statistics and permute custom ops, forward and
backward, with their fake implementations and autograd formulas."""

from __future__ import annotations

import torch

import cukern as _ck

from . import _base
from ._base import _d, _dense, _perm, _register, _same_strides, _stat_dtype

__all__: list[str] = []


# ---------------------------------------------------------------------------------------------
# Batch norm. PyTorch registers autograd formulas only for functional ops, so the op returns
# the updated running statistics as new tensors (copies that cukern's kernels update) and
# batch_norm() copies them into running_mean / running_var. y (and dx, daddend) have x's
# memory layout when x is dense (NCHW, channels-last); other views are made contiguous first.

def _bn(x, running_mean, running_var, weight, bias, addend, training, momentum, eps, relu):
    x = _dense(x)
    if addend is not None and not _same_strides(addend, x):
        addend = torch.empty_like(x).copy_(addend)  # the kernels read it in x's layout
    rm = running_mean.clone() if training and running_mean is not None else None
    rv = running_var.clone() if training and running_var is not None else None
    with _base._cuda("batch_norm", x):
        y, mean, invstd, mask = _ck.batch_norm(
            _d(x), running_mean=_d(rm if training else running_mean),
            running_var=_d(rv if training else running_var), weight=_d(weight), bias=_d(bias),
            training=training, momentum=momentum, eps=eps, addend=_d(addend), relu=relu,
            return_stats=True)
    sdt = _stat_dtype(x.dtype)
    if mask is None:
        mask = x.new_empty((0,), dtype=torch.int32)
    return (y, mean, invstd, mask, x.new_empty((0,), dtype=sdt) if rm is None else rm,
            x.new_empty((0,), dtype=sdt) if rv is None else rv)


def _bn_fake(x, running_mean, running_var, weight, bias, addend, training, momentum, eps, relu):
    if x.dim() < 2:
        raise ValueError(f"cukern.torch.batch_norm: x has {x.dim()} dimensions, expected at "
                         f"least 2 (N, C, ...)")
    x = _dense(x)
    sdt = _stat_dtype(x.dtype)
    stats = [x.new_empty((x.shape[1],), dtype=sdt) for _ in range(2)]
    mask = x.new_empty(((x.numel() + 31) // 32 if relu else 0,), dtype=torch.int32)
    running = [r.new_empty(r.shape) if training and r is not None else
               x.new_empty((0,), dtype=sdt) for r in (running_mean, running_var)]
    return torch.empty_like(x), *stats, mask, *running


def _bn_setup(ctx, inputs, output):
    x, _, _, weight, _, addend, training, _, _, relu = inputs
    _, mean, invstd, mask, rm, rv = output
    ctx.mark_non_differentiable(mean, invstd, mask, rm, rv)
    ctx.training, ctx.addend = training, addend is not None
    ctx.save_for_backward(x, mean, invstd, weight, mask if relu else None)


def _bn_backward(ctx, dy, *_):
    x, mean, invstd, weight, mask = ctx.saved_tensors
    needs = ctx.needs_input_grad
    dx, dw, db, da = torch.ops.cukern.batch_norm_backward(dy, x, mean, invstd, weight, mask,
                                                          ctx.training, ctx.addend)
    return (dx if needs[0] else None, None, None, dw if needs[3] else None,
            db if needs[4] else None, da if needs[5] else None, None, None, None, None)


def _bn_bwd(dy, x, mean, invstd, weight, mask, training, addend):
    x = _dense(x)
    with _base._cuda("batch_norm_backward", x):
        res = _ck.batch_norm_backward(dy=_d(dy), x=_d(x), mean=_d(mean), invstd=_d(invstd),
                                      weight=_d(weight), mask=_d(mask), addend=addend,
                                      training=training)
    dx, dw, db = res[:3]
    return dx, dw, db, res[3] if addend else x.new_empty((0,))


def _bn_bwd_fake(dy, x, mean, invstd, weight, mask, training, addend):
    x = _dense(x)
    nch = x.shape[1]
    if weight is not None:
        dw, db = weight.new_empty((nch,)), weight.new_empty((nch,))
    else:
        dw, db = (x.new_empty((nch,), dtype=_stat_dtype(x.dtype)) for _ in range(2))
    return torch.empty_like(x), dw, db, torch.empty_like(x) if addend else x.new_empty((0,))


_register("batch_norm", "(Tensor x, Tensor? running_mean, Tensor? running_var, Tensor? weight, "
          "Tensor? bias, Tensor? addend, bool training, float momentum, float eps, bool relu) "
          "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _bn, _bn_fake, _bn_setup,
          _bn_backward)
_register("batch_norm_backward", "(Tensor dy, Tensor x, Tensor mean, Tensor invstd, "
          "Tensor? weight, Tensor? mask, bool training, bool addend) -> "
          "(Tensor, Tensor, Tensor, Tensor)", _bn_bwd, _bn_bwd_fake)


def _stats(x):
    with _base._cuda("batch_stats", x):
        return _ck.batch_stats(_d(x))


def _stats_fake(x):
    sdt = _stat_dtype(x.dtype)
    return x.new_empty((x.shape[1],), dtype=sdt), x.new_empty((x.shape[1],), dtype=sdt)


def _stats_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[0])


def _stats_backward(ctx, dmean, dvar):
    """mean = sum(x) / n, var = sum((x - mean)^2) / n per channel: dx = (dmean + 2 dvar
    (x - mean)) / n."""
    x, mean = ctx.saved_tensors
    shape = [1] * x.dim()
    shape[1] = x.shape[1]
    n = x.numel() // x.shape[1]
    dx = (dmean.view(shape) + 2 * dvar.view(shape) * (x.to(mean.dtype) - mean.view(shape))) / n
    return dx.to(x.dtype)


_register("batch_stats", "(Tensor x) -> (Tensor, Tensor)", _stats, _stats_fake, _stats_setup,
          _stats_backward)


# ---------------------------------------------------------------------------------------------
# Permute: the backward is the inverse permutation.

def _permute(x, dims):
    with _base._cuda("permute", x):
        return _ck.permute(_d(x), tuple(dims))


def _permute_fake(x, dims):
    dims = _perm("permute", dims, x.dim())
    return x.new_empty([x.shape[d] for d in dims])


def _permute_setup(ctx, inputs, output):
    x, dims = inputs
    inverse = [0] * x.dim()
    for i, d in enumerate(_perm("permute", dims, x.dim())):
        inverse[d] = i
    ctx.inverse = inverse


def _permute_backward(ctx, dy):
    return torch.ops.cukern.permute(dy, ctx.inverse), None


_register("permute", "(Tensor x, int[] dims) -> Tensor", _permute, _permute_fake,
          _permute_setup, _permute_backward)

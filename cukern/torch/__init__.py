"""PyTorch integration: every cukern op as a ``torch.library`` custom op (namespace ``cukern``)
with a fake (meta) implementation and an autograd formula built on cukern's backward kernels,
so ``loss.backward()`` runs through them and ``torch.compile`` keeps them as opaque ops
without graph breaks.

    >>> import torch, cukern.torch as ct
    >>> x = torch.randn(4096, 1000, device="cuda", requires_grad=True)
    >>> y = ct.softmax(x, dim=-1)           # torch.ops.cukern.softmax
    >>> y.sum().backward()                  # torch.ops.cukern.softmax_backward

The functions here mirror ``torch.nn.functional`` (names, arguments, defaults) and call
``torch.ops.cukern.<op>``. Each op runs the cukern function on the tensors (zero-copy through
DLPack) on the tensor's GPU, with CuPy's current stream set to PyTorch's current stream there,
so kernels are ordered with the surrounding PyTorch work. Gradients are first order (the
backward ops have no autograd formula of their own).
"""

from __future__ import annotations

from collections.abc import Sequence

from . import _batch_norm, _rowwise  # noqa: F401  (registers torch.ops.cukern.<name>)
from ._base import OPS, Tensor, torch

__all__ = ["OPS", "softmax", "log_softmax", "layer_norm", "rms_norm", "batch_norm",
           "batch_stats", "permute", "to_nhwc", "to_nchw"]


# ---------------------------------------------------------------------------------------------
# The public functions: torch.nn.functional's names, arguments and defaults.

def _shape(normalized_shape) -> list:
    if isinstance(normalized_shape, int):
        return [normalized_shape]
    return list(normalized_shape)


def softmax(x: Tensor, dim: int = -1, *, dtype: torch.dtype | None = None) -> Tensor:
    """``F.softmax(x, dim, dtype=dtype)`` on cukern's kernels: ``exp(x - max) / sum(exp(x -
    max))`` along ``dim``. float16, bfloat16, float32, float64 (half types computed in
    float32); any shape and strides; the result is contiguous. Backward:
    ``cukern.softmax_backward``."""
    if dtype is not None:
        x = x.to(dtype)
    return torch.ops.cukern.softmax(x, dim)


def log_softmax(x: Tensor, dim: int = -1, *, dtype: torch.dtype | None = None) -> Tensor:
    """``F.log_softmax(x, dim, dtype=dtype)``: ``(x - max) - log(sum(exp(x - max)))``; as
    :func:`softmax`."""
    if dtype is not None:
        x = x.to(dtype)
    return torch.ops.cukern.log_softmax(x, dim)


def layer_norm(x: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """``F.layer_norm``: ``(x - mean) / sqrt(var + eps) * weight + bias`` over the trailing
    dimensions ``normalized_shape`` (biased variance). x float16, bfloat16, float32 or
    float64; weight and bias of shape ``normalized_shape`` and x's dtype, or float32 for
    16-bit x (mixed precision: both of one dtype). Returns y, contiguous, x's shape and dtype;
    gradients for x, weight and bias (in the parameters' dtype)."""
    return torch.ops.cukern.layer_norm(x, _shape(normalized_shape), weight, bias, eps)[0]


def rms_norm(x: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
             eps: float | None = None) -> Tensor:
    """``F.rms_norm``: ``x / sqrt(mean(x^2) + eps) * weight`` over ``normalized_shape``;
    ``eps=None`` is ``torch.finfo(x.dtype).eps``, as in PyTorch. As :func:`layer_norm`."""
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return torch.ops.cukern.rms_norm(x, _shape(normalized_shape), weight, eps)[0]


def batch_norm(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
               weight: Tensor | None = None, bias: Tensor | None = None,
               training: bool = False, momentum: float = 0.1, eps: float = 1e-5, *,
               addend: Tensor | None = None, relu: bool = False) -> Tensor:
    """``F.batch_norm`` over channel axis 1, with a fused add and ReLU::

        y = relu?((x - mean) / sqrt(var + eps) * weight + bias [+ addend])

    Training normalises with the batch's biased variance and updates ``running_mean`` and
    ``running_var`` in place (``(1 - momentum) * running + momentum * batch``, the variance
    unbiased); eval uses them. x: rank >= 2, float16, bfloat16, float32 or float64; a dense
    layout (NCHW or channels-last) is kept by y and by the gradients, other views are copied.
    Parameters and running statistics: (C,), float32 or x's dtype for 16-bit x, else x's
    dtype. ``addend``: x's shape and dtype. Gradients for x, weight, bias and addend (through
    the ReLU's 1-bit mask)."""
    y, _, _, _, rm, rv = torch.ops.cukern.batch_norm(
        x, running_mean, running_var, weight, bias, addend, training, float(momentum),
        float(eps), relu)
    if training and running_mean is not None:
        running_mean.copy_(rm)
    if training and running_var is not None:
        running_var.copy_(rv)
    return y


def batch_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel (axis 1) mean and biased variance of x: ``(mean, var)``, each (C,), float32
    (float64 for float64 x); differentiable."""
    return torch.ops.cukern.batch_stats(x)


def permute(x: Tensor, dims: Sequence[int]) -> Tensor:
    """``torch.permute(x, dims)``, materialised: a new contiguous tensor (any dtype, rank up to
    8, any strides; bit-exact). The gradient is the inverse permutation."""
    return torch.ops.cukern.permute(x, list(dims))


def to_nhwc(x: Tensor) -> Tensor:
    """(N, C, *spatial) -> (N, *spatial, C) for rank 3 to 5, a new contiguous tensor."""
    _rank_3_to_5("to_nhwc", x)
    return permute(x, (0, *range(2, x.dim()), 1))


def to_nchw(x: Tensor) -> Tensor:
    """(N, *spatial, C) -> (N, C, *spatial) for rank 3 to 5: the inverse of :func:`to_nhwc`."""
    _rank_3_to_5("to_nchw", x)
    return permute(x, (0, x.dim() - 1, *range(1, x.dim() - 1)))


def _rank_3_to_5(fn: str, x: Tensor) -> None:
    if not 3 <= x.dim() <= 5:
        raise ValueError(f"cukern.torch.{fn}: x has shape {tuple(x.shape)}, expected 3 to 5 "
                         f"dimensions")

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

import contextlib
import functools
from collections.abc import Sequence

try:
    import torch
except ImportError as err:  # pragma: no cover - exercised only where PyTorch is missing
    raise ImportError(
        "cukern.torch needs PyTorch 2.4 or later with CUDA: pip install torch "
        "(cukern itself works without it, on CuPy arrays)") from err
if not hasattr(torch.library, "custom_op"):  # pragma: no cover
    raise ImportError(f"cukern.torch needs PyTorch 2.4 or later (torch.library.custom_op); "
                      f"found {torch.__version__}: pip install -U torch")

import cukern as _ck

from .runner import cp as _cp

Tensor = torch.Tensor

__all__ = ["OPS", "softmax", "log_softmax", "layer_norm", "rms_norm", "batch_norm",
           "batch_stats", "permute", "to_nhwc", "to_nchw"]

# cukern op -> its custom op (torch.ops.cukern.<name>); every op of cukern.registry.
OPS: dict[str, object] = {}


# ---------------------------------------------------------------------------------------------
# Running the kernels on PyTorch's device and stream.

_streams: dict[tuple[int, int], object] = {}  # (device, stream pointer) -> a cupy Stream


class _StreamRef:
    """A stream pointer as the CUDA stream protocol's object (``__cuda_stream__``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return 0, self.ptr


@functools.cache
def _borrowed_stream_class():
    """A CuPy Stream that never destroys its handle: PyTorch owns the stream."""

    class Borrowed(_cp.cuda.Stream):
        def __del__(self):
            pass

    return Borrowed


def _cupy_stream(ptr: int, dev: int):
    """A CuPy stream object for PyTorch's stream ``ptr`` on device ``dev`` (current)."""
    if hasattr(_cp.cuda.Stream, "from_external"):  # CuPy 14 (ExternalStream is deprecated)
        return _borrowed_stream_class().from_external(_StreamRef(ptr))
    return _cp.cuda.ExternalStream(ptr, dev)


@contextlib.contextmanager
def _cuda(fn: str, t: Tensor):
    """Makes ``t``'s GPU current and CuPy's current stream PyTorch's current stream on it."""
    if t.device.type != "cuda":
        raise TypeError(f"cukern.torch.{fn}: expected a CUDA tensor, got one on {t.device} "
                        f"(cukern's kernels run on NVIDIA GPUs; move it with .cuda())")
    if _cp is None:
        raise RuntimeError(f"cukern.torch.{fn}: CuPy is not installed; install cukern[cuda12] "
                           f"or cukern[cuda13]")
    dev = t.device.index
    ptr = torch.cuda.current_stream(dev).cuda_stream
    with _cp.cuda.Device(dev):
        stream = _streams.get((dev, ptr))
        if stream is None:
            if len(_streams) > 64:  # streams come and go: keep the table small
                _streams.clear()
            stream = _streams[dev, ptr] = _cupy_stream(ptr, dev)
        with stream:
            yield


def _d(t: Tensor | None) -> Tensor | None:
    """``t`` without autograd history: PyTorch refuses to export a tensor that requires grad
    through DLPack (the custom op's forward sees the caller's tensors)."""
    return None if t is None else t.detach()


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The statistics dtype of data of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dense(t: Tensor) -> Tensor:
    """``t`` when its elements fill memory without gaps or overlaps (any order of dims: NCHW,
    channels-last), else a contiguous copy. Batch norm keeps a dense input's layout (its
    outputs have x's strides); anything else cukern would copy to C order itself."""
    if t.is_contiguous():
        return t
    dims = sorted((t.stride(i), t.size(i)) for i in range(t.dim()) if t.size(i) != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return t.contiguous()
        expected *= size
    return t


def _same_strides(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and all(
        s == t for n, s, t in zip(a.shape, a.stride(), b.stride()) if n > 1)


def _check_dim(fn: str, dim: int, ndim: int) -> int:
    nd = max(ndim, 1)
    if not -nd <= dim < nd:
        raise IndexError(f"cukern.torch.{fn}: dim {dim} is out of range for a tensor of {ndim} "
                         f"dimensions")
    return dim % nd


def _perm(fn: str, dims, ndim: int) -> list[int]:
    """``dims`` with negative entries counted from the end; ValueError unless a permutation."""
    out = [d + ndim if d < 0 else d for d in dims]
    if sorted(out) != list(range(ndim)):
        raise ValueError(f"cukern.torch.{fn}: dims {list(dims)} is not a permutation of the "
                         f"{ndim} dimensions of x")
    return out


def _register(name: str, schema: str, impl, fake, setup_context=None, backward=None):
    """``cukern::<name>``: a functional custom op (no argument is mutated) with its fake
    implementation and, for a forward op, its autograd formula."""
    op = torch.library.custom_op(f"cukern::{name}", impl, mutates_args=(), schema=schema)
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
    OPS[name] = op
    return op


# ---------------------------------------------------------------------------------------------
# Softmax and log-softmax: dx from the output y and dy.

def _softmax_family(fwd: str):
    bwd = f"{fwd}_backward"

    def impl(x, dim):
        with _cuda(fwd, x):
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
        with _cuda(bwd, y):
            return getattr(_ck, bwd)(y=_d(y), dy=_d(dy), axis=dim)

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
    with _cuda("layer_norm", x):
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
    ctx.lead = x.dim() - len(normalized_shape)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(x, mean, rstd, weight)


def _ln_backward(ctx, dy, _dmean, _drstd):
    x, mean, rstd, weight = ctx.saved_tensors
    needs = ctx.needs_input_grad
    dx, dw, db = torch.ops.cukern.layer_norm_backward(dy, x, mean, rstd, weight)
    if weight is None:  # the kernels sum no column gradients without a weight
        dw = db = None
        if needs[3]:  # bias alone: dy summed over the leading dims (sum(()) would sum all)
            db = (dy.sum(tuple(range(ctx.lead))) if ctx.lead else dy).to(ctx.bias_dtype)
    return (dx if needs[0] else None, None, dw if needs[2] else None,
            db if needs[3] else None, None)


def _ln_bwd(dy, x, mean, rstd, weight):
    with _cuda("layer_norm_backward", x):
        dx, dw, db = _ck.layer_norm_backward(dy=_d(dy), x=_d(x), mean=_d(mean), rstd=_d(rstd),
                                             weight=_d(weight))
    if weight is None:
        return dx, dx.new_empty((0,)), dx.new_empty((0,))
    return dx, dw.to(weight.dtype), db.to(weight.dtype)


def _ln_bwd_fake(dy, x, mean, rstd, weight):
    if weight is None:
        return x.new_empty(x.shape), x.new_empty((0,)), x.new_empty((0,))
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


_register("layer_norm", "(Tensor x, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, "
          "float eps) -> (Tensor, Tensor, Tensor)", _ln, _ln_fake, _ln_setup, _ln_backward)
_register("layer_norm_backward", "(Tensor dy, Tensor x, Tensor mean, Tensor rstd, "
          "Tensor? weight) -> (Tensor, Tensor, Tensor)", _ln_bwd, _ln_bwd_fake)


def _rms(x, normalized_shape, weight, eps):
    with _cuda("rms_norm", x):
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
    with _cuda("rms_norm_backward", x):
        dx, dw = _ck.rms_norm_backward(dy=_d(dy), x=_d(x), rstd=_d(rstd), weight=_d(weight))
    return (dx, dx.new_empty((0,))) if weight is None else (dx, dw.to(weight.dtype))


def _rms_bwd_fake(dy, x, rstd, weight):
    dw = x.new_empty((0,)) if weight is None else weight.new_empty(weight.shape)
    return x.new_empty(x.shape), dw


_register("rms_norm", "(Tensor x, SymInt[] normalized_shape, Tensor? weight, float eps) -> "
          "(Tensor, Tensor)", _rms, _rms_fake, _rms_setup, _rms_backward)
_register("rms_norm_backward", "(Tensor dy, Tensor x, Tensor rstd, Tensor? weight) -> "
          "(Tensor, Tensor)", _rms_bwd, _rms_bwd_fake)


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
    with _cuda("batch_norm", x):
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
    with _cuda("batch_norm_backward", x):
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
    with _cuda("batch_stats", x):
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
    with _cuda("permute", x):
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
    float64; weight and bias of shape ``normalized_shape`` and x's dtype. Returns y,
    contiguous, x's shape and dtype; gradients for x, weight and bias."""
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


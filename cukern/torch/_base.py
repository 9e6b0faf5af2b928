"""What every ``cukern.torch`` op shares: the PyTorch import check, running cukern on a
tensor's GPU and PyTorch's current stream there, small tensor helpers, and registering a
``torch.library`` custom op (:data:`OPS`)."""

from __future__ import annotations

import contextlib
import functools

try:
    import torch
except ImportError as err:  # pragma: no cover - exercised only where PyTorch is missing
    raise ImportError(
        "cukern.torch needs PyTorch 2.4 or later with CUDA: pip install torch "
        "(cukern itself works without it, on CuPy arrays)") from err
if not hasattr(torch.library, "custom_op"):  # pragma: no cover
    raise ImportError(f"cukern.torch needs PyTorch 2.4 or later (torch.library.custom_op); "
                      f"found {torch.__version__}: pip install -U torch")

from ..runner import cp as _cp

Tensor = torch.Tensor

__all__ = ["OPS", "Tensor"]

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

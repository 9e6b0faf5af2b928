"""Arrays in and out: CuPy arrays as they are, PyTorch tensors and JAX arrays (any CUDA array
with ``__dlpack__``) through DLPack without a copy, results back as the caller's kind, and the
device and stream rules of the exchange (the runner re-exports these for the ops)."""

from __future__ import annotations

import contextlib

import numpy as np

from ._launch import ByPointer

try:
    import cupy as cp
except ImportError:  # pragma: no cover - exercised only where CuPy is missing
    cp = None

__all__ = ["Adapted", "TensorView", "adapt", "empty", "fast_arrays", "handed_back", "new_array",
           "on_device", "results", "tensor_view", "to_torch", "torch_view", "torch_views"]

_KDL_CUDA, _KDL_CUDA_MANAGED, _KDL_ROCM = 2, 13, 10
_ndarray = cp.ndarray if cp is not None else None
_alloc = cp.cuda.alloc if cp is not None else None


class Adapted:
    """A CuPy view of a user's array and the means to return results as the user's kind.
    ``same_stream``: a PyTorch tensor whose GPU's current PyTorch stream is CuPy's, exchanged
    without the protocol's stream handshake (see :func:`torch_view`)."""

    __slots__ = ("array", "kind", "same_stream")

    def __init__(self, array, kind: str, same_stream: bool = False):
        self.array = array
        self.kind = kind
        self.same_stream = same_stream

    def wrap(self, result):
        if self.kind == "cupy":
            return result
        if self.same_stream:
            return to_torch(result)
        # the exchange orders the result's GPU's streams: make that GPU current for it
        if self.kind == "torch":
            import torch

            with on_device(result.data.device_id):
                return torch.from_dlpack(result)
        if self.kind == "jax":
            import jax.numpy as jnp

            with on_device(result.data.device_id):
                return jnp.from_dlpack(result)
        return result


# PyTorch's current raw stream of a GPU (a private accessor where present: the public
# torch.cuda.current_stream costs several microseconds a call)
_torch_stream = None


def _torch_current_stream(device_id: int) -> int:
    global _torch_stream
    if _torch_stream is None:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _torch_stream = raw if raw is not None else (
            lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _torch_stream(device_id)


def torch_view(x):
    """A CuPy view of the CUDA PyTorch tensor ``x`` when PyTorch's current stream on its GPU
    is CuPy's current stream there (the common case: both on the legacy default stream), else
    None. The exchange then needs none of DLPack's stream handshake (an event recorded on one
    stream and waited on by the other: tens of microseconds of host time a call), so it uses
    the unversioned capsule, which carries none. Tensors that require grad give None (the
    caller's checks refuse them), and so does a missing CuPy (the caller's checks say so)."""
    if cp is None or not x.is_cuda or x.requires_grad:
        return None
    dev = x.get_device()
    if _torch_current_stream(dev) != cp.cuda.get_current_stream(dev).ptr:
        return None
    return cp.from_dlpack(_torch_dlpack().to_dlpack(x))


_np_of_torch: dict = {}  # torch dtype -> NumPy dtype (CuPy's), filled on first use
_torch_of_np: dict = {}  # NumPy dtype or scalar type -> torch dtype
_torch_complex: frozenset = frozenset()  # the complex torch dtypes (the conjugate bit's)
_strided = _contiguous_format = _empty_like = None  # torch.strided, ..., torch.empty_like


def _dtype_tables() -> None:
    global _torch_complex, _strided, _contiguous_format, _empty_like
    import torch

    pairs = [(torch.bool, np.bool_), (torch.int8, np.int8), (torch.uint8, np.uint8),
             (torch.int16, np.int16), (torch.int32, np.int32), (torch.int64, np.int64),
             (torch.float16, np.float16), (torch.float32, np.float32),
             (torch.float64, np.float64), (torch.complex64, np.complex64),
             (torch.complex128, np.complex128)]
    try:
        from ml_dtypes import bfloat16

        pairs.append((torch.bfloat16, bfloat16))
    except ImportError:  # pragma: no cover - ml_dtypes comes with cukern's dependencies
        pass
    _torch_complex = frozenset((torch.complex64, torch.complex128))
    _strided, _contiguous_format = torch.strided, torch.contiguous_format
    _empty_like = torch.empty_like
    for t, n in pairs:  # last: a filled table is what tensor_view tests
        _np_of_torch[t] = np.dtype(n)
        _torch_of_np[np.dtype(n)] = _torch_of_np[n] = t


class TensorView(ByPointer):
    """A CUDA PyTorch tensor as the ops' fast paths read a CuPy array (``shape``, ``strides``
    in bytes, NumPy ``dtype``, ``data.ptr``, ``data.device_id``), built without a DLPack
    exchange: launches take its address (:class:`cukern._launch.ByPointer`) and results are
    allocated by PyTorch (:meth:`empty`), so neither side wraps the other's memory. Only for
    tensors on CuPy's current stream (:func:`tensor_views`)."""

    __slots__ = ("tensor", "shape", "_strides", "dtype", "ptr", "device_id")

    def __init__(self, t, dtype, device_id: int, shape=None):
        """``shape``: the tensor's, where the caller has it as a tuple (its strides are then
        worked out when first read: a new result's are not, launches take its address)."""
        self.tensor = t
        self.dtype = dtype
        self.ptr = t.data_ptr()
        self.device_id = device_id
        if shape is None:
            self.shape = tuple(t.shape)
            item = dtype.itemsize
            self._strides = tuple([s * item for s in t.stride()])
        else:
            self.shape = shape
            self._strides = None

    @property
    def strides(self) -> tuple:  # in bytes, as CuPy's
        if self._strides is None:
            item = self.dtype.itemsize
            self._strides = tuple([s * item for s in self.tensor.stride()])
        return self._strides

    @property
    def data(self):  # CuPy's ``a.data.ptr`` and ``a.data.device_id``
        return self

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def empty(self, shape, dtype) -> TensorView:
        """A new C-contiguous tensor of ``shape`` (a tuple of ints) on this tensor's GPU,
        allocated by PyTorch on its current stream (CuPy's: the stream the kernels run on);
        ``dtype`` a NumPy dtype or scalar type. Host cost a call (H200 host, interleaved):
        ``torch.empty_like`` 2.1 us, ``Tensor.new_empty`` 2.9, ``torch.empty`` 3.7."""
        t = self.tensor
        tdt = _torch_of_np[dtype]
        if tdt is t.dtype and (shape is self.shape or shape == self.shape):
            new = _empty_like(t) if t.is_contiguous() else _empty_like(
                t, memory_format=_contiguous_format)
        else:
            new = t.new_empty(shape, dtype=tdt)
        return TensorView(new, _np_of_torch[tdt], self.device_id, shape)

    def transpose(self, axes) -> TensorView:
        return TensorView(self.tensor.permute(axes), self.dtype, self.device_id)


_itemsizes: dict = {}  # dtype (np.dtype or scalar type) -> its itemsize


def new_array(shape: tuple, dtype):
    """``cupy.empty(shape, dtype)`` for a tuple of ints and a NumPy dtype or scalar type, on
    the current device through CuPy's current allocator: the memory, then the array on it,
    without ``cupy.empty``'s argument handling (about 1 us less a call on an H100 host)."""
    size = _itemsizes.get(dtype)
    if size is None:
        size = _itemsizes[dtype] = np.dtype(dtype).itemsize
    for n in shape:
        size *= n
    return _ndarray(shape, dtype, _alloc(size))


def empty(like, shape, dtype):
    """A new C-contiguous array of ``like``'s kind (a CuPy array, or a :class:`TensorView`'s
    tensor) on the current device (the ops call it with ``like``'s GPU current)."""
    if type(like) is _ndarray:
        return new_array(shape, dtype)
    return like.empty(shape, dtype)


def results(res):
    """A fast path's results (an array, or a tuple of arrays and Nones) as the caller's kind:
    CuPy arrays as they are, :class:`TensorView` results as their tensors."""
    if type(res) is TensorView:
        return res.tensor
    if type(res) is tuple:
        return tuple([r.tensor if type(r) is TensorView else r for r in res])
    return res


def tensor_view(x, checked: int = -1) -> TensorView | None:
    """:class:`TensorView` of ``x`` when it is a CUDA PyTorch tensor, not requiring grad, of a
    dtype CuPy has, and PyTorch's current stream on its GPU is CuPy's current stream there
    (compared unless that GPU is ``checked``); else None (the full path then adapts, checks
    and refuses). A tensor whose conjugate or negative bit is set (``x.conj()``,
    ``x.conj().imag``: lazy views whose memory holds the values before the operation) is
    left to the full path, which reads it through a resolved copy (:func:`adapt`); a sparse
    one too, which the full path refuses."""
    if type(x).__module__ != "torch" or x.requires_grad:
        return None
    dev = x.get_device()  # -1 for a CPU tensor
    if dev < 0:
        return None
    if not _np_of_torch:
        _dtype_tables()
    tdt = x.dtype
    dtype = _np_of_torch.get(tdt)
    if dtype is None or x.layout is not _strided:  # sparse: the full path refuses it
        return None
    if x.is_neg() or (tdt in _torch_complex and x.is_conj()):  # only complex ones conjugate
        return None
    if dev != checked and _torch_current_stream(dev) != cp.cuda.get_current_stream(dev).ptr:
        return None
    return TensorView(x, dtype, dev)


def torch_views(arrays) -> list | None:
    """The ops' PyTorch fast paths: :func:`tensor_view` of each of ``arrays`` (None stays
    None), or None unless every other one is a CUDA tensor not requiring grad on CuPy's current
    stream of its GPU. The streams are compared once a GPU."""
    if cp is None:
        return None
    views = []
    checked = -1  # the GPU whose streams were compared
    for a in arrays:
        if a is None:
            views.append(None)
            continue
        v = tensor_view(a, checked)
        if v is None:
            return None
        checked = v.device_id
        views.append(v)
    return views


def fast_arrays(x, arrays):
    """What an op's fast path reads of its array arguments (``x`` one of them): ``arrays`` as
    they are when ``x`` is a CuPy array, their :class:`TensorView` (:func:`torch_views`) when
    it is a PyTorch tensor, else None. (The key then tells whether the others are CuPy
    arrays.)"""
    if type(x) is _ndarray:
        return arrays
    if type(x).__module__ == "torch":
        return torch_views(arrays)
    return None


_dlpack_module = None


def _torch_dlpack():
    """``torch.utils.dlpack``, imported on first use (PyTorch is optional)."""
    global _dlpack_module
    if _dlpack_module is None:
        from torch.utils import dlpack

        _dlpack_module = dlpack
    return _dlpack_module


_no_sync_capsule = True  # CuPy's __dlpack__ takes stream=-1 (no synchronisation)


def to_torch(result):
    """``result`` (CuPy) as a PyTorch tensor sharing its memory, without a stream handshake:
    only for results of an input taken by :func:`torch_view` (same stream on both sides).
    The capsule comes from ``__dlpack__(stream=-1)`` (the DLPack protocol's "no
    synchronisation"), not from CuPy's deprecated ``toDlpack``, whose warning would point here."""
    global _no_sync_capsule
    if _no_sync_capsule:
        try:
            capsule = result.__dlpack__(stream=-1)
        except (TypeError, ValueError, BufferError):  # a CuPy without it: the old method
            _no_sync_capsule = False
        else:
            return _torch_dlpack().from_dlpack(capsule)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its VisibleDeprecationWarning (a UserWarning)
        capsule = result.toDlpack()
    return _torch_dlpack().from_dlpack(capsule)


def _require_cupy(fn: str) -> None:
    if cp is None:
        raise RuntimeError(
            f"{fn}: CuPy is not installed; install cukern[cuda12] or cukern[cuda13]")


def adapt(fn: str, arg: str, x, *, out: bool = False) -> Adapted:
    """Accept a CuPy array, or a GPU array exposing ``__dlpack__`` (zero-copy, stream-safe).
    ``out``: the array is to be written (a JAX array is refused: JAX arrays are immutable). A
    PyTorch tensor that requires grad is refused with a TypeError naming ``arg``; one with its
    conjugate or negative bit set is read through a resolved copy, and refused where written."""
    _require_cupy(fn)
    if isinstance(x, cp.ndarray):
        return Adapted(x, "cupy")
    if isinstance(x, np.ndarray) or np.isscalar(x) or isinstance(x, (list, tuple)):
        raise TypeError(
            f"{fn}: {arg} must be a CuPy array or a GPU array with __dlpack__, got "
            f"{type(x).__module__}.{type(x).__qualname__} (host data: move it to the GPU "
            f"with cupy.asarray first)")
    if not hasattr(x, "__dlpack__") or not hasattr(x, "__dlpack_device__"):
        raise TypeError(
            f"{fn}: {arg} must be a CuPy array or a GPU array with __dlpack__, got "
            f"{type(x).__module__}.{type(x).__qualname__}")
    module = type(x).__module__.split(".")[0]
    kind = {"torch": "torch", "jax": "jax", "jaxlib": "jax"}.get(module, "cupy")
    if kind == "jax" and out:
        hint = ("leave out= unset and use the returned array" if arg == "out" else
                f"pass {arg} as a CuPy array or a PyTorch tensor, or None")
        raise TypeError(f"{fn}: {arg} is a JAX array; JAX arrays are immutable, so cukern "
                        f"cannot write into one: {hint}")
    if kind == "torch" and getattr(x, "requires_grad", False):
        raise TypeError(
            f"{fn}: {arg} is a PyTorch tensor that requires grad; cukern.{fn} records no "
            f"autograd history: use cukern.torch (autograd through cukern's backward kernels) "
            f"or pass {arg}.detach()")
    layout = str(getattr(x, "layout", "torch.strided")) if kind == "torch" else ""
    if layout and layout != "torch.strided":
        raise TypeError(f"{fn}: {arg} is a PyTorch tensor of layout {layout}; cukern takes "
                        f"strided (dense) tensors: pass {arg}.to_dense()")
    if kind == "torch" and (x.is_conj() or x.is_neg()):
        # a lazy conjugate or negation (x.conj(), x.conj().imag): its memory holds the values
        # before it, and DLPack hands over that memory as it is
        if out:
            raise TypeError(
                f"{fn}: {arg} is a PyTorch tensor with its conjugate or negative bit set (a "
                f"lazy view of another tensor's memory); cukern would write the memory as "
                f"stored: pass a tensor without it")
        x = x.resolve_conj().resolve_neg()  # a copy with the values it stands for
    if kind == "torch":
        _check_torch_dtype(fn, arg, x)
    elif kind == "jax":
        _check_jax_dtype(fn, arg, x)
    if kind == "torch" and x.is_cuda:
        view = torch_view(x)
        if view is not None:
            return Adapted(view, kind, True)
    dev_type, dev_id = x.__dlpack_device__()
    if int(dev_type) not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        raise TypeError(
            f"{fn}: {arg} lives on DLPack device type {int(dev_type)}, not a CUDA GPU; move it "
            f"to the GPU first")
    with on_device(int(dev_id)):  # the exchange orders the array's GPU's current streams
        return Adapted(cp.from_dlpack(x), kind)


def _check_torch_dtype(fn: str, arg: str, x) -> None:
    """TypeError naming ``arg`` for a PyTorch tensor that CuPy cannot hold: a quantized tensor,
    or a dtype with no NumPy counterpart (complex32, the float8 types, bit and sub-byte
    types); unsigned 16- to 64-bit tensors are left to the exchange."""
    if x.is_quantized:
        raise TypeError(f"{fn}: {arg} is a quantized PyTorch tensor ({x.dtype}); cukern takes "
                        f"plain tensors: pass {arg}.dequantize()")
    if not _np_of_torch:
        _dtype_tables()
    if x.dtype not in _np_of_torch and str(x.dtype) not in _TORCH_UNSIGNED:
        raise TypeError(
            f"{fn}: {arg} is a PyTorch tensor of dtype {x.dtype}, which CuPy has no dtype for; "
            f"convert it first ({arg}.float(), say), or for permute view its bytes as an "
            f"integer type of the same size ({arg}.view(torch.uint8) for one-byte types)")


_TORCH_UNSIGNED = ("torch.uint16", "torch.uint32", "torch.uint64")


def _check_jax_dtype(fn: str, arg: str, x) -> None:
    """TypeError naming ``arg`` for a JAX array of an ml_dtypes type other than bfloat16 (the
    float8 and 4-bit types), which CuPy cannot import."""
    dt = np.dtype(x.dtype)
    if dt.type.__module__.split(".")[0] == "ml_dtypes" and dt.name != "bfloat16":
        raise TypeError(
            f"{fn}: {arg} is a JAX array of dtype {dt.name}, which CuPy has no dtype for; "
            f"convert it first ({arg}.astype(jnp.float32), say), or for permute view its bytes "
            f"as an integer type of the same size (jax.lax.bitcast_convert_type)")


def handed_back(out, o):
    """``out`` (the caller's out= array, ``o`` its CuPy view) once written: a PyTorch tensor's
    current stream on its GPU is made to wait for the kernels CuPy's current stream ran, as
    ``torch.from_dlpack`` does for fresh results, so that reading ``out`` on the caller's
    stream right after the call is safe. Call it with ``o``'s device current."""
    if type(out) is not cp.ndarray and type(out).__module__.split(".")[0] == "torch":
        import torch

        dev = o.data.device_id
        if _torch_current_stream(dev) != cp.cuda.get_current_stream(dev).ptr:
            torch.from_dlpack(o)  # the exchange records the event and the wait
    return out


_SAME_DEVICE = contextlib.nullcontext()  # reusable: it holds no state


def on_device(device_id: int):
    """A context that makes ``device_id`` current (a no-op when it already is)."""
    if device_id == cp.cuda.runtime.getDevice():
        return _SAME_DEVICE
    return cp.cuda.Device(device_id)

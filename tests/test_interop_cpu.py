"""Without a GPU: the out= rule for JAX arrays as the runner applies it (before any DLPack
exchange), and the capture-safety helpers where CUDA is unusable. The real checks with JAX,
PyTorch and CUDA graphs are tests/test_interop_gpu.py and tests/test_capture_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

import cukern
from cukern import _capture, runner

pytest.importorskip("cupy")


def _jax_like():
    """An object that claims to be a JAX array on CUDA GPU 0 and fails if it is exchanged."""

    class ArrayImpl:
        def __dlpack__(self, **kwargs):
            raise AssertionError("exchanged through DLPack before out= was checked")

        def __dlpack_device__(self):
            return 2, 0

    ArrayImpl.__module__ = "jaxlib.xla_extension"
    return ArrayImpl()


def test_a_jax_out_is_refused_before_any_exchange():
    with pytest.raises(TypeError, match=r"softmax: out is a JAX array; JAX arrays are "
                                        r"immutable"):
        runner.adapt("softmax", "out", _jax_like(), out=True)


def test_capture_helpers_without_a_gpu():
    if runner.cp is not None:
        try:
            runner.cp.cuda.runtime.getDeviceCount()
            pytest.skip("a GPU is visible: tests/test_capture_gpu.py covers it")
        except runner.cp.cuda.runtime.CUDARuntimeError:
            pass
    assert _capture.capturing() == 0
    assert cukern.capture_memory_bytes() == 0
    assert cukern.release_capture_memory() == 0

    @_capture.capture_safe
    def f(a, *, b=2):
        """doc"""
        return a + b

    assert f(1, b=3) == 4 and f.__name__ == "f" and f.__doc__ == "doc"


class _FakeMem:
    """What an allocator returns, as far as cukern._capture looks at it."""

    class _Block:
        def __init__(self, size):
            self.size = size

    def __init__(self, size):
        self.mem = self._Block(size)


def test_capture_bookkeeping_with_a_stubbed_capturing_stream(monkeypatch):
    """The Python side of capture safety with CUDA stubbed out: while "capturing", every
    allocation a capture_safe function makes through the current allocator, and what keep()
    is given, is held under the stream's pointer until released; outside, nothing is."""
    cp = runner.cp

    class Stream:
        ptr = 7

    state = {"capturing": False}
    monkeypatch.setattr(_capture, "_get_stream", lambda: Stream)
    monkeypatch.setattr(_capture, "_is_capturing", lambda ptr: state["capturing"])
    made = []

    def base(size):
        made.append(size)
        return _FakeMem(size)

    monkeypatch.setattr(cp.cuda, "get_allocator", lambda: base)
    cukern.release_capture_memory()

    @_capture.capture_safe
    def op(n):
        # CuPy's own lookup of the allocator in force (capturing: the one capture_safe set;
        # outside, base stands for the pool, which needs a GPU)
        alloc = cp.cuda.memory.get_allocator() if state["capturing"] else base
        return [alloc(s) for s in (512, 1024)][:n]

    op(1)
    _capture.keep(_FakeMem(99))
    assert cukern.capture_memory_bytes() == 0  # not capturing: nothing kept

    state["capturing"] = True
    assert _capture.capturing() == 7
    res = op(1)
    _capture.keep(None, _FakeMem(256))
    assert len(res) == 1
    assert cukern.capture_memory_bytes() == 512 + 1024 + 256
    assert cukern.release_capture_memory(8) == 0  # another stream
    assert cukern.release_capture_memory(Stream) == 512 + 1024 + 256
    assert cukern.capture_memory_bytes() == 0


def _fake_tensor(**attrs):
    """An object that passes for a PyTorch tensor as far as the type's module goes."""

    class Tensor:
        pass

    Tensor.__module__ = "torch"
    t = Tensor()
    t.__dict__.update(attrs)
    return t


def test_tensors_that_cannot_take_a_fast_path_are_refused_before_any_exchange():
    """A CPU tensor, a tensor that requires grad, or an argument of another kind among an
    op's arrays: no views (the full path then adapts and refuses), decided before any CUDA
    call or DLPack exchange (the fake tensors have neither)."""
    from cukern import _interop

    cpu = _fake_tensor(is_cuda=False, requires_grad=False, get_device=lambda: -1)
    grad = _fake_tensor(is_cuda=True, requires_grad=True, get_device=lambda: 0)
    for bad in (cpu, grad, [1.0], object()):
        assert _interop.torch_views((None, bad, grad)) is None
        assert _interop.fast_arrays(cpu, (cpu, bad)) is None
        assert _interop.fast_arrays(bad, (bad,)) is None
    assert _interop.torch_view(cpu) is None and _interop.torch_view(grad) is None


def test_lazy_conjugate_and_negative_views_are_left_to_the_full_path(monkeypatch):
    """A CUDA tensor whose conjugate (complex dtypes) or negative bit is set gets no
    TensorView (its memory holds the values before the lazy operation), decided before its
    stream is read (the fake tensors have none)."""
    from cukern import _interop

    c64, f32, strided = object(), object(), object()
    monkeypatch.setattr(_interop, "_np_of_torch", {c64: np.dtype(np.complex64),
                                                   f32: np.dtype(np.float32)})
    monkeypatch.setattr(_interop, "_torch_complex", frozenset((c64,)))
    monkeypatch.setattr(_interop, "_strided", strided)
    for dtype, conj, neg in ((c64, True, False), (c64, False, True), (f32, False, True)):
        t = _fake_tensor(is_cuda=True, requires_grad=False, get_device=lambda: 0, dtype=dtype,
                         layout=strided, is_conj=lambda c=conj: c, is_neg=lambda n=neg: n)
        assert _interop.tensor_view(t) is None
        assert _interop.torch_views((t,)) is None
        assert _interop.fast_arrays(t, (t,)) is None


def test_lazy_views_are_refused_where_written():
    """A PyTorch tensor with its conjugate or negative bit set, given where cukern writes
    (out=, training's running statistics), is refused with a TypeError naming the argument,
    before any exchange (the fake tensors have none)."""
    from cukern import _interop

    for conj, neg in ((True, False), (False, True)):
        t = _fake_tensor(is_cuda=True, requires_grad=False, is_conj=lambda c=conj: c,
                         is_neg=lambda n=neg: n, __dlpack__=None, __dlpack_device__=None)
        with pytest.raises(TypeError, match=r"softmax: out is a PyTorch tensor with its "
                                            r"conjugate or negative bit set"):
            _interop.adapt("softmax", "out", t, out=True)


def test_tensors_that_are_not_strided_are_refused():
    """A sparse (or any non-strided) PyTorch tensor gets a TypeError naming the argument and
    its layout, before any exchange (the fake tensor has none)."""
    from cukern import _interop

    t = _fake_tensor(is_cuda=True, requires_grad=False, layout="torch.sparse_coo",
                     __dlpack__=None, __dlpack_device__=None)
    with pytest.raises(TypeError, match=r"layer_norm: weight is a PyTorch tensor of layout "
                                        r"torch.sparse_coo; cukern takes strided"):
        _interop.adapt("layer_norm", "weight", t)


def test_tensors_of_dtypes_cupy_lacks_are_refused(monkeypatch):
    """A quantized PyTorch tensor, or one whose dtype has no NumPy counterpart (complex32, the
    float8 types), gets a TypeError naming the argument and its dtype, before any exchange
    (the fake tensors have none); a dtype CuPy has passes the check."""
    from cukern import _interop

    float32 = object()
    monkeypatch.setattr(_interop, "_np_of_torch", {float32: np.dtype(np.float32)})

    def tensor(dtype, quantized=False):
        return _fake_tensor(is_cuda=True, requires_grad=False, is_conj=lambda: False,
                            is_neg=lambda: False, is_quantized=quantized, dtype=dtype,
                            __dlpack__=None, __dlpack_device__=None)

    with pytest.raises(TypeError, match=r"permute: x is a quantized PyTorch tensor \(torch.qint8"
                                        r"\); cukern takes plain tensors: pass x.dequantize"):
        _interop.adapt("permute", "x", tensor("torch.qint8", quantized=True))
    for name in ("torch.complex32", "torch.float8_e4m3fn"):
        with pytest.raises(TypeError, match=rf"softmax: y is a PyTorch tensor of dtype {name}, "
                                            r"which CuPy has no dtype for"):
            _interop.adapt("softmax", "y", tensor(name))
    _interop._check_torch_dtype("softmax", "x", tensor(float32))  # no error
    _interop._check_torch_dtype("permute", "x", tensor("torch.uint16"))  # left to DLPack


def test_jax_arrays_of_dtypes_cupy_lacks_are_refused():
    """A JAX array of an ml_dtypes type other than bfloat16 (float8, int4) gets a TypeError
    naming the argument and its dtype, before any exchange (the fakes have none); bfloat16 and
    NumPy's own types pass."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from cukern import _interop

    def array(dtype):
        class ArrayImpl:
            pass

        ArrayImpl.__module__ = "jaxlib.xla_extension"
        a = ArrayImpl()
        a.dtype, a.__dlpack__, a.__dlpack_device__ = np.dtype(dtype), None, None
        return a

    for name in ("float8_e4m3fn", "float8_e5m2", "int4"):
        if not hasattr(ml_dtypes, name):
            continue
        with pytest.raises(TypeError, match=rf"softmax: x is a JAX array of dtype {name}, "
                                            r"which CuPy has no dtype for"):
            _interop.adapt("softmax", "x", array(getattr(ml_dtypes, name)))
    for ok in (ml_dtypes.bfloat16, np.float32, np.int8):
        _interop._check_jax_dtype("permute", "x", array(ok))

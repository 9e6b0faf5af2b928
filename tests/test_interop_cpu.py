"""Without a GPU: the out= rule for JAX arrays as the runner applies it (before any DLPack
exchange), and the capture-safety helpers where CUDA is unusable. The real checks with JAX,
PyTorch and CUDA graphs are tests/test_interop_gpu.py and tests/test_capture_gpu.py."""

from __future__ import annotations

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

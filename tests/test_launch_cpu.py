"""The driver-level launcher's argument slots (cukern._launch) and cukern.prepare's checks that
need no GPU. (Launches and prepared calls on the GPU: tests/test_prepare_gpu.py.)"""

from __future__ import annotations

import numpy as np
import pytest

import cukern
from cukern import _launch


@pytest.mark.parametrize("value, expected", [
    (np.float32(1.0), 0x3F800000),
    (np.float64(-2.0), 0xC000000000000000),
    (np.int32(-1), 0xFFFFFFFF),            # 4 bytes: the kernel reads the low half
    (np.int64(-1), 0xFFFFFFFFFFFFFFFF),
    (np.uint32(3000000000), 3000000000),
    (np.uint64(0), 0),
    (np.float16(1.0), 0x3C00),
    (-3, 0xFFFFFFFFFFFFFFFD),              # a Python int: its 64-bit pattern
    (2**63 + 5, 2**63 + 5),
])
def test_scalar_slots_hold_the_bytes_the_kernel_reads(value, expected):
    got = _launch.bits(value)
    assert got == expected
    nbytes = value.dtype.itemsize if isinstance(value, np.generic) else 8
    if isinstance(value, np.generic):  # the slot's first bytes are the scalar's own
        assert got.to_bytes(8, "little")[:nbytes] == value.tobytes()


@pytest.mark.parametrize("bad", [np.complex128(1j), np.longdouble(1.0), 1.5, "1", b"\0"])
def test_slots_refuse_what_they_cannot_hold(bad):
    if isinstance(bad, np.generic) and bad.dtype.itemsize <= 8:
        pytest.skip("a long double of 8 bytes on this platform")
    with pytest.raises(TypeError, match="at most 8 bytes"):
        _launch.bits(bad)


def test_a_struct_passed_by_value_keeps_its_bytes():
    dt = np.dtype([("a", np.int32), ("b", np.int64)], align=True)
    v = np.zeros(1, dt)
    v["a"], v["b"] = 7, -2
    buf = _launch.ByValue(v).buffer
    assert bytes(buf) == v.tobytes() and len(bytes(buf)) == dt.itemsize == 16


def test_prepare_refuses_unknown_ops_and_host_arrays():
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="prepare: op must be one of .*got 'softmaxx'"):
        cukern.prepare("softmaxx", x)
    with pytest.raises(ValueError, match="got 'batch_norm'"):
        cukern.prepare(cukern.batch_norm, x)
    with pytest.raises(TypeError, match=r"prepare\('softmax'\): x must be a cupy.ndarray, got "
                                        r"numpy.ndarray"):
        cukern.prepare("softmax", x)
    with pytest.raises(TypeError, match=r"prepare\('layer_norm'\): x must be a cupy.ndarray"):
        cukern.prepare("layer-norm", x, (8,))
    with pytest.raises(TypeError, match="out= belongs to the prepared call"):
        cukern.prepare("permute", x, (1, 0), out=x)

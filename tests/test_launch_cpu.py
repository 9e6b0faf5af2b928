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


def test_cluster_launch_config_matches_the_drivers_layout():
    """CUlaunchConfig and CUlaunchAttribute as cuda.h lays them out on 64-bit hosts: the config
    56 bytes (hStream at 32, attrs at 40, numAttrs at 48), an attribute 72 (its id, 4 bytes of
    padding, then a 64-byte union whose clusterDim is 3 unsigned ints)."""
    import ctypes

    assert ctypes.sizeof(_launch.LaunchConfig) == 56
    assert _launch.LaunchConfig.hStream.offset == 32
    assert _launch.LaunchConfig.attrs.offset == 40
    assert _launch.LaunchConfig.numAttrs.offset == 48
    assert ctypes.sizeof(_launch._LaunchAttribute) == 72
    assert _launch._LaunchAttribute.value.offset == 8
    config = _launch.launch_config((96,), (256, 2), 4096, cluster=8)
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (96, 1, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (256, 2, 1)
    assert config.sharedMemBytes == 4096 and not config.hStream
    assert config.numAttrs == 1
    attr = config.attrs[0]
    assert attr.id == 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert list(attr.value) == [8, 1, 1]
    assert _launch.launch_config(96, 256).numAttrs == 0  # no clusters: no attribute
    # a launch of clusters sized at launch keeps its configuration; others use cuLaunchKernel
    assert _launch.RawLaunch(0, 96, 256, cluster=8)._ex.attrs[0].value[0] == 8
    assert _launch.RawLaunch(0, 96, 256)._ex is None


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

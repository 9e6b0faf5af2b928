"""Planning of the norms' forward over rows off the 16-byte grid (Plan.shifted), no GPU: which
rows take 16-byte shifted packs, in which kernels, and which keep narrow ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cukern import runner
from cukern._device import DeviceSpec
from cukern.plan import Switches, Variant, plan_rowwise
from cukern.plan.rowwise import shifted_cols
from cukern.registry import policy

FWD = ("layer_norm", "rms_norm")
BWD = ("layer_norm_backward", "rms_norm_backward")
ITEM = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
DEVICES = (DeviceSpec.h100(), DeviceSpec.h200())

# (cols, dtype, variant, pack): the warp kernel's rows of 32 values a lane, blocks, clusters
SHIFTED = [
    (769, "float32", Variant.WARP, 4),
    (1001, "float16", Variant.WARP, 8),
    (1017, "float64", Variant.WARP, 2),
    (4095, "float16", Variant.BLOCK_SMEM, 8),
    (10001, "float64", Variant.BLOCK_SMEM, 2),
    (50257, "bfloat16", Variant.BLOCK_SMEM, 8),
    (131071, "bfloat16", Variant.CLUSTER, 8),
    (262143, "float32", Variant.CLUSTER, 4),
]


def switch_sets(op):
    return policy(op).switch_sets


@pytest.mark.parametrize("device", DEVICES, ids=lambda d: d.name)
@pytest.mark.parametrize("op", FWD)
@pytest.mark.parametrize("cols,dtype,variant,pack", SHIFTED)
def test_rows_off_the_grid_take_shifted_packs(op, cols, dtype, variant, pack, device):
    for sw in switch_sets(op):
        p = plan_rowwise(op, 4096, cols, dtype, device, switches=sw)
        where = (sw, p)
        assert (p.variant, p.pack_size, p.shifted, p.cols) == (variant, pack, True, cols), where
        assert p.rows_per_pass == 1, where  # one row a pass: each row its own window
        assert p.name_expression().endswith(", true>"), where
        assert "shifted" in str(p)
        if variant is Variant.WARP:  # 32 values a lane, one row a group
            assert (p.cols_per_thread, p.thread_group_width, p.rows_per_access) == \
                (32, 32, 1), where
        elif variant is Variant.BLOCK_SMEM:  # the packs the row may span, cached
            assert p.smem_bytes >= shifted_cols(cols, pack) * ITEM[dtype], where
        # arrays whose rows start at other offsets: narrow packs, no SHIFT argument
        narrow = plan_rowwise(op, 4096, cols, dtype, device, switches=sw, shift_ok=False)
        assert not narrow.shifted and narrow.pack_size < pack, (sw, narrow)


@pytest.mark.parametrize("op", FWD)
def test_what_keeps_narrow_packs(op):
    dev = DeviceSpec.h100()
    # rows on the grid, short rows, warp rows that shifted packs would hold in fewer than 32
    # values a lane
    for cols in (1024, 4096, 31, 33, 127, 255):
        assert not plan_rowwise(op, 4096, cols, "float16", dev).shifted, cols
    # shifted warp rows of 32 values a lane, half of them empty (RMS norm); past the warp, a
    # block
    p = plan_rowwise(op, 4096, 511, "float16", dev)
    assert p.variant is Variant.WARP and p.shifted is (op == "rms_norm"), p
    if p.shifted:
        assert (p.cols_per_thread, p.thread_group_width) == (32, 32), p
    p = plan_rowwise(op, 4096, 1023, "float16", dev)
    assert (p.variant, p.shifted, p.pack_size) == (Variant.BLOCK_SMEM, True, 8), p
    # past what a cluster caches: the uncached kernel, in the narrow packs it has
    p = plan_rowwise(op, 4, 2**21 + 1, "float16", dev)
    assert p.variant is Variant.BLOCK_UNCACHED and not p.shifted and p.pack_size == 1, p
    assert p == plan_rowwise(op, 4, 2**21 + 1, "float16", dev, shift_ok=False)
    # float32 weight and bias with 16-bit data: the uncached kernel of P = float
    sw = Switches(weight=True, float32_params=True)
    p = plan_rowwise(op, 4096, 4095, "float16", dev, switches=sw)
    assert p.variant is Variant.BLOCK_UNCACHED and not p.shifted, p


@pytest.mark.parametrize("op", BWD)
def test_backward_keeps_narrow_packs(op):
    p = plan_rowwise(op, 4096, 4095, "float16", DeviceSpec.h100())
    assert not p.shifted and p.pack_size == 1, p


def test_two_rows_a_pass_only_on_the_grid():
    """16-bit layer norm with weight and bias caches two rows a pass in clusters where rows
    are on the grid; off it each row has its own window and gamma's shift: one a pass."""
    dev = DeviceSpec.h100()
    sw = Switches(weight=True, bias=True)
    assert plan_rowwise("layer_norm", 1024, 131072, "float16", dev, switches=sw).rows_per_pass == 2
    p = plan_rowwise("layer_norm", 1024, 131071, "float16", dev, switches=sw)
    assert p.shifted and p.rows_per_pass == 1, p


def test_pointer_offsets_tell_arrays_apart():
    """The launch caches' key: each array's offset in its 16-byte word, where the OR of them
    gives x at 0 with a weight at 2 and x at 2 with a weight at 0 the same key."""
    def at(ptr):
        return SimpleNamespace(data=SimpleNamespace(ptr=ptr))

    assert runner.pointer_offsets([at(256), None, at(258)]) == (0, None, 2)
    assert runner.pointer_offsets([at(258), None, at(256)]) == (2, None, 0)
    assert runner.pointer_bits([at(256), at(258)]) == runner.pointer_bits([at(258), at(256)])

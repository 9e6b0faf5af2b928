"""The tile kernel's two phase 2 variants on the GPU, bit for bit against numpy.transpose:
every 1-byte dtype (int8, uint8, bool) and float16 over the shape classes of the permute sweep
(NCHW <-> NHWC with C = 3, 7x7 and 14x14 planes, batched and plain 2-D transposes on and off
the tiles, tiny and odd dims, 5-D), strided views whose tiles end off multiples of 4 and 16
(tests/test_permute_regs_cpu.py: REGS_CASES), misaligned pointers and 64-bit indices, each
with the register transpose on (perm_byte_regs = (1, 2)) and off (the gather). Outputs are
poisoned as in tests/test_permute_gpu.py (a fresh output over 0xFF pool memory, out= holding
the complement of the expected bytes)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cukern
from cukern.ops import permute as ops
from cukern.plan import permute as pp

from .test_permute_gpu import (  # noqa: F401  (warm_permute: the family compiled first)
    assert_bits,
    check,
    check_64_bit,
    check_misaligned,
    clear_launches,
    device_from_raw,
    expected,
    host,
    plan_with,
    poison,
    put,
    put_misaligned,
    raw,
    warm_permute,
)
from .test_permute_regs_cpu import REGS_CASES, case_plan

cp = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu]

NHWC, NCHW = (0, 2, 3, 1), (0, 3, 1, 2)
ONE_BYTE = ["int8", "uint8", "bool"]


def device_tuning():
    """The planner's table for the current GPU (the one the op plans with)."""
    from cukern import runner

    return pp.tuning_for(runner.device_spec(cp.cuda.Device().id))


@pytest.fixture(params=["regs", "gather"])
def switch(request, monkeypatch):
    """The planner with perm_byte_regs on (both sizes) or off, for every plan made in the
    test (perm_skew_regs off: 14x14 and 28x28 planes to NCHW as row tiles, this path's)."""
    sizes = pp.REGS_SIZES if request.param == "regs" else ()
    plan_with(monkeypatch, perm_byte_regs=sizes, perm_skew_regs=())
    yield request.param == "regs"
    clear_launches()


SHAPES = [
    # NCHW <-> NHWC: C = 3 and 7x7 planes (flat runs: the gather), 14x14 (a flat input run
    # of 196 and output rows of 196: the register path), 28x28, odd sizes, 5-D
    ((2, 3, 224, 224), NHWC), ((2, 224, 224, 3), NCHW),
    ((2, 2048, 7, 7), NHWC), ((2, 7, 7, 2048), NCHW),
    ((2, 1024, 14, 14), NHWC), ((2, 14, 14, 1024), NCHW),
    ((3, 64, 28, 28), NHWC), ((3, 28, 28, 64), NCHW), ((2, 512, 28, 28), NHWC),
    ((4, 33, 17, 31), NHWC), ((4, 17, 31, 33), NCHW), ((1, 5, 9, 11), NHWC),
    ((2, 16, 4, 14, 14), (0, 2, 3, 4, 1)), ((2, 4, 14, 14, 16), (0, 4, 1, 2, 3)),
    # batched 2-D transposes, on and off the tiles
    ((5, 37, 41), (0, 2, 1)), ((3, 64, 64), (0, 2, 1)), ((2, 65, 129), (0, 2, 1)),
    ((3, 200, 136), (0, 2, 1)), ((3, 136, 200), (0, 2, 1)), ((2, 300, 132), (0, 2, 1)),
    ((3, 144, 4100), (0, 2, 1)), ((2, 3, 4, 5, 6), (3, 4, 0, 1, 2)),
    # tiny dims
    ((7, 1, 40), (0, 2, 1)), ((6, 2, 300), (0, 2, 1)), ((6, 300, 2), (0, 2, 1)),
    ((2, 3), (1, 0)), ((4097, 2), (1, 0)), ((2, 4097), (1, 0)), ((8192, 3), (1, 0)),
    ((3, 8192), (1, 0)), ((4, 8192), (1, 0)), ((8192, 4), (1, 0)),
    # 2-D around and past the tiles
    ((31, 33), (1, 0)), ((32, 32), (1, 0)), ((64, 64), (1, 0)), ((1000, 1000), (1, 0)),
    ((1024, 1024), (1, 0)), ((1024, 48), (1, 0)), ((48, 1024), (1, 0)),
    ((4100, 36), (1, 0)), ((36, 4100), (1, 0)), ((4097, 33), (1, 0)),
    # a general order
    ((3, 5, 7, 9), (3, 1, 0, 2)),
]
# of SHAPES, those whose 1-byte plan takes the register path when it is on (rows, or a flat
# input run of 4 (mod 8) bytes: 196, 4; words of 4 bytes or more both ways)
REGS_1B = [((2, 1024, 14, 14), NHWC), ((2, 14, 14, 1024), NCHW), ((3, 64, 28, 28), NHWC),
           ((3, 28, 28, 64), NCHW), ((2, 512, 28, 28), NHWC), ((3, 64, 64), (0, 2, 1)),
           ((2, 300, 132), (0, 2, 1)), ((3, 144, 4100), (0, 2, 1)), ((8192, 4), (1, 0)),
           ((32, 32), (1, 0)), ((64, 64), (1, 0)), ((1024, 1024), (1, 0)),
           ((1024, 48), (1, 0)), ((48, 1024), (1, 0)), ((4100, 36), (1, 0))]


def _id(case) -> str:
    shape, axes = case
    return f"{'x'.join(map(str, shape))}-{''.join(map(str, axes))}"


def _plan_agrees(xd, axes, on: bool):
    """The plan the op runs for xd: the gather whenever the switch is off."""
    p = ops.plan_for(xd, axes)
    if not on:
        assert not p.regs, str(p)
    return p


@pytest.mark.parametrize("dtype", ONE_BYTE + ["float16"])
@pytest.mark.parametrize("case", SHAPES, ids=[_id(c) for c in SHAPES])
def test_shapes_both_ways(case, dtype, switch, rng):
    shape, axes = case
    xh, xd = put(rng, shape, dtype)
    p = _plan_agrees(xd, axes, switch)
    if switch and dtype != "float16":
        assert p.regs == (case in REGS_1B), str(p)
    check(xd, xh, axes)


def test_switch_reaches_the_register_path(switch, rng):
    for shape, axes in REGS_1B:
        _, xd = put(rng, shape, "int8")
        assert ops.plan_for(xd, axes).regs == switch, (shape, axes)
    _, xd = put(rng, (4, 64, 28, 28), "float16")
    assert ops.plan_for(xd, NHWC).regs == switch


@pytest.mark.parametrize("dtype", ONE_BYTE + ["float16", "bfloat16"])
@pytest.mark.parametrize("case", [c for c in REGS_CASES], ids=[
    "{}B-b{}-i{}-o{}-in{}-out{}".format(*c) for c in REGS_CASES])
def test_strided_tiles_off_the_words(case, dtype, switch, rng):
    """x a slice of wider rows, out= a slice of wider rows (the model's cases): tiles that end
    off multiples of 4 along i and of the store word along o; the bytes beside out= stay."""
    item, b, si, so, o_in, i_out = case
    if np.dtype("float16" if dtype == "bfloat16" else dtype).itemsize != item:
        pytest.skip(f"a case of {item}-byte elements")
    base_h, base_d = put(rng, (b, so, o_in), dtype)
    xh, xd = base_h[:, :, :si], base_d[:, :, :si]
    want = expected(xh, (0, 2, 1))
    big = np.full((b, si, i_out, item), 0xA5, np.uint8)
    big[:, :, :so] = ~raw(want)
    buf = device_from_raw(big, want.dtype, (b, si, i_out))
    o = buf[:, :, :so]
    p = ops.plan_for(xd, (0, 2, 1), out=o)
    ref = case_plan(case, dataclasses.replace(
        device_tuning(), perm_byte_regs=pp.REGS_SIZES if switch else ()))
    assert (p.targs[:8], p.tile, p.regs) == (ref.targs[:8], ref.tile, switch), str(p)
    r = cukern.permute(xd, (0, 2, 1), out=o)
    assert r.data.ptr == o.data.ptr
    got = raw(host(buf))
    assert (got[:, :, :so] == raw(want)).all(), "out= holds the wrong bytes"
    assert (got[:, :, so:] == 0xA5).all(), "bytes beside out= were written"
    check(xd, xh, (0, 2, 1), out=False)  # and into a fresh contiguous output
    assert_bits(base_d, base_h, "the input after the calls")


@pytest.mark.parametrize("dtype", ["int8", "float16"])
@pytest.mark.parametrize("offset", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("case", [((4, 64, 32), (0, 2, 1)), ((2, 40, 40, 64), NCHW),
                                  ((2, 64, 40, 40), NHWC), ((256, 96), (1, 0))], ids=_id)
def test_misaligned_pointers(case, offset, dtype, switch, rng):
    """Input and output ``offset`` elements into their buffers: narrower words both ways."""
    shape, axes = case
    xh, xd, want, o, obuf = put_misaligned(rng, shape, axes, dtype, offset, offset)
    p = ops.plan_for(xd, axes, out=o)
    if not switch:
        assert not p.regs
    check_misaligned(xd, axes, want, o, obuf, offset, p.kernel)


@pytest.mark.parametrize("dtype", ["int8", "bool", "float16"])
@pytest.mark.parametrize("case", [((3, 28, 28, 64), NCHW), ((2, 14, 14, 1024), NCHW),
                                  ((2, 1024, 14, 14), NHWC), ((2, 65, 129), (0, 2, 1)),
                                  ((1000, 1000), (1, 0)), ((2, 7, 7, 2048), NCHW)], ids=_id)
def test_64_bit_indices(case, dtype, switch, rng):
    """The plan the op makes, launched with 64-bit indices (the instantiations arrays past 2^31
    elements run), into poisoned memory."""
    shape, axes = case
    xh, xd = put(rng, shape, dtype)
    p = _plan_agrees(xd, axes, switch)
    p64 = check_64_bit(p, xd, xh, axes)
    assert p64.targs[5] == p.regs and p64.targs[8] == p.async_copy

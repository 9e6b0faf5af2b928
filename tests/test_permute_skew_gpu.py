"""The tile kernel's skewed-column phase 2 (``permute_tile<..., SK>``) and the plans it
replaces (the gather of 7x7 runs, row tiles of 14x14 and int8 28x28 planes), on the GPU, bit
for bit against numpy.transpose: every 1- and 2-byte dtype class (and 4-byte, which keeps the
old plans) over NHWC -> NCHW of 7x7, 14x14, 28x28, 9x9, 5x5 and 3x3 planes, strided inputs and
out= with partial tiles and columns and runs off the store word (tests/test_permute_skew_cpu.py:
SKEW_CASES), misaligned pointers and 64-bit indices, each with perm_skew_regs on (1, 2) and off.
Outputs are poisoned as in tests/test_permute_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest

import cukern
from cukern.ops import permute as ops
from cukern.plan import permute as pp

from .test_permute_flat_gpu import _id
from .test_permute_gpu import (  # noqa: F401  (warm_permute: the family compiled first)
    assert_bits,
    check,
    check_64_bit,
    check_misaligned,
    check_strided_into_buffer,
    clear_launches,
    device_from_raw,
    expected,
    host,
    item_size,
    plan_with,
    poison,
    put,
    put_misaligned,
    raw,
    warm_permute,
)
from .test_permute_skew_cpu import SKEW_CASES, skew_case_plan

cp = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu]

NCHW = (0, 3, 1, 2)
# a dtype of each class: 1-byte (int8, uint8, bool), 2-byte (float16, bfloat16, int16),
# 4-byte (float32: the old plans either way)
DTYPES = ["int8", "uint8", "bool", "float16", "bfloat16", "int16", "float32"]


def device_tuning():
    """The planner's table for the current GPU (the one the op plans with)."""
    from cukern import runner

    return pp.tuning_for(runner.device_spec(cp.cuda.Device().id))


@pytest.fixture(params=["skew", "old"])
def switch(request, monkeypatch):
    """The planner with perm_skew_regs on (1, 2) or off, for every plan made in the test."""
    on = request.param == "skew"
    plan_with(monkeypatch, perm_skew_regs=pp.SKEW_SIZES if on else ())
    yield on
    clear_launches()


# (shape, axes, whether the path runs for 1- and 2-byte elements with the switch on)
SHAPES = [
    ((2, 7, 7, 2048), NCHW, (True, True)),      # D = 1: tiles of 128 (int8), 64 (16-bit)
    ((3, 14, 14, 1024), NCHW, (True, True)),    # D = 4
    ((2, 28, 28, 512), NCHW, (True, False)),    # int8 D = 0; 16-bit rows are whole sectors
    ((2, 9, 9, 96), NCHW, (True, True)),        # 81 = 1 (mod 16, mod 8); a partial tile of 32
    ((3, 5, 5, 64), NCHW, (False, True)),       # 25: 9 (mod 16), 1 (mod 8)
    ((2, 3, 3, 64), NCHW, (False, True)),       # 9: under the int8 word, 1 (mod 8)
    ((1, 7, 7, 48), NCHW, (True, True)),        # one partial tile of 48
    ((2, 14, 14, 80), NCHW, (True, True)),      # a partial tile of 16 (int8: 80 = 64 + 16)
    ((4, 7, 7, 40), NCHW, (False, True)),       # int8 batch stride 1960: stores under 16 B
    ((2, 7, 7, 36), NCHW, (False, False)),      # 16-bit: channel rows of 72 bytes, 8-byte loads
    ((2, 4, 7, 7, 64), (0, 4, 1, 2, 3), (True, True)),    # 5-D: runs of 196
    ((2, 2, 7, 7, 64), (0, 4, 1, 2, 3), (False, False)),  # runs of 98 = 2 (mod 16, mod 8)
    ((2, 2048, 7, 7), (0, 2, 3, 1), (False, False)),    # the other direction: a flat input
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SHAPES, ids=[_id(c[:2]) for c in SHAPES])
def test_shapes_both_ways(case, dtype, switch, rng):
    shape, axes, takes = case
    xh, xd = put(rng, shape, dtype)
    p = ops.plan_for(xd, axes)
    item = xh.dtype.itemsize
    assert p.skew_regs == (switch and item <= 2 and takes[item - 1]), str(p)
    if not switch:
        assert p.targs[7] == -1
    check(xd, xh, axes)


@pytest.mark.parametrize("words", [1, 4, 16])
@pytest.mark.parametrize("shape,dtype", [
    ((2, 7, 7, 2048), "int8"), ((3, 14, 14, 1024), "int8"), ((2, 28, 28, 512), "int8"),
    ((1, 7, 7, 48), "int8"), ((2, 7, 7, 2048), "bfloat16"), ((3, 14, 14, 1024), "bfloat16"),
    ((1, 7, 7, 48), "bfloat16"), ((2, 3, 3, 64), "bfloat16")], ids=str)
def test_lane_runs(shape, dtype, words, monkeypatch, rng):
    """perm_skew_words other than the default (lanes storing 1, 4, 16 words of a channel)."""
    plan_with(monkeypatch, perm_skew_regs=pp.SKEW_SIZES, perm_skew_words=(words, words))
    xh, xd = put(rng, shape, dtype)
    p = ops.plan_for(xd, NCHW)
    assert p.skew_regs and p.group == words.bit_length() - 1, str(p)
    check(xd, xh, NCHW)
    clear_launches()


@pytest.mark.parametrize("dtype", ["int8", "float16", "float32"])
def test_to_nchw_of_planes(dtype, switch, rng):
    for shape in ((4, 7, 7, 256), (2, 14, 14, 128)):
        xh, xd = put(rng, shape, dtype)
        want = expected(xh, NCHW)
        poison(want.nbytes)
        y = cukern.to_nchw(xd)
        assert_bits(y, want, "to_nchw")
        assert_bits(cukern.to_nhwc(y), xh, "to_nhwc(to_nchw(x))")


@pytest.mark.parametrize("dtype", ["int8", "bool", "float16", "bfloat16"])
@pytest.mark.parametrize("case", SKEW_CASES, ids=[
    "{}B-b{}-c{}-in{}-L{}-at{}".format(*c) for c in SKEW_CASES])
def test_strided_runs_off_the_words(case, dtype, switch, rng):
    """x a slice of wider channel rows (b, L, c of c_in), out= a batch of (c, L) runs out_base
    elements into a buffer (the model's cases): partial tiles and columns, runs that end off
    the store word, L just over the word; the bytes around out= stay."""
    item, b, c, c_in, L, out_base = case
    if item_size(dtype) != item:
        pytest.skip(f"a case of {item}-byte elements")
    base_h, base_d = put(rng, (b, L, c_in), dtype)
    ref = skew_case_plan(case, dataclasses.replace(
        device_tuning(), perm_skew_regs=pp.SKEW_SIZES if switch else ()))

    def plan_check(p):  # the path of the reference's table (phase 1 may take cp.async here)
        assert (p.targs[:8], p.tile, p.pitch, p.skew_regs) == \
            (ref.targs[:8], ref.tile, ref.pitch, switch), str(p)

    check_strided_into_buffer(base_d, base_h, base_d[:, :, :c], base_h[:, :, :c], (0, 2, 1),
                              out_base, plan_check)
    clear_launches()


@pytest.mark.parametrize("dtype", ["int8", "float16"])
@pytest.mark.parametrize("side", ["in", "out"])
@pytest.mark.parametrize("offset", [1, 2, 4, 8, 16])
def test_misaligned_pointers(offset, side, dtype, switch, rng):
    """(2, 7, 7, 64) planes with the input or the output ``offset`` elements into its buffer:
    the path where loads and stores stay 16 bytes, the old plans elsewhere."""
    pad_in = offset if side == "in" else 0
    pad_out = offset if side == "out" else 0
    _, xd, want, o, obuf = put_misaligned(rng, (2, 7, 7, 64), NCHW, dtype, pad_in, pad_out)
    item = want.dtype.itemsize
    p = ops.plan_for(xd, NCHW, out=o)
    path = switch and (pad_out * item) % 16 == 0 and (pad_in * item) % 16 == 0
    assert p.skew_regs == path, str(p)
    check_misaligned(xd, NCHW, want, o, obuf, pad_out, p.kernel)


@pytest.mark.parametrize("dtype", ["int8", "bool", "float16", "bfloat16"])
@pytest.mark.parametrize("case", [((2, 7, 7, 2048), NCHW), ((3, 14, 14, 1024), NCHW),
                                  ((2, 28, 28, 512), NCHW), ((2, 3, 3, 64), NCHW),
                                  ((1, 7, 7, 48), NCHW)], ids=_id)
def test_64_bit_indices(case, dtype, switch, rng):
    """The plan the op makes, launched with 64-bit indices (the instantiations arrays past 2^31
    elements run), into poisoned memory."""
    shape, axes = case
    xh, xd = put(rng, shape, dtype)
    p = ops.plan_for(xd, axes)
    takes = {(2, 28, 28, 512): (True, False), (2, 3, 3, 64): (False, True)}.get(shape,
                                                                                (True, True))
    assert p.skew_regs == (switch and takes[item_size(dtype) - 1]), str(p)
    check_64_bit(p, xd, xh, axes)

"""The tile kernel's flat-run interleave (``permute_tile<..., FO = 3>``) and the gather it
replaces, on the GPU, bit for bit against numpy.transpose: every 1-, 2- and 4-byte dtype class
over C = 3 images (NCHW -> NHWC, the path) and their inverse, 7x7, 14x14 and odd planes (5x5,
9x9, 1x1: flat output runs the gather keeps), batched 2-D and 5-D shapes, strided inputs and
out= with runs off the store word and partial tiles (tests/test_permute_flat_cpu.py:
FLAT_CASES), misaligned pointers and 64-bit indices, each with perm_flat_regs on (1, 2, 4) and
off (the gather). Outputs are poisoned as in tests/test_permute_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest

import cukern
from cukern.ops import permute as ops
from cukern.plan import permute as pp

from .test_permute_flat_cpu import FLAT_CASES, flat_case_plan
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

cp = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu]

NHWC, NCHW = (0, 2, 3, 1), (0, 3, 1, 2)
# a dtype of each class: 1-byte (int8, uint8, bool), 2-byte (float16, bfloat16, int16),
# 4-byte (float32, int32)
DTYPES = ["int8", "uint8", "bool", "float16", "bfloat16", "int16", "float32", "int32"]


def device_tuning():
    """The planner's table for the current GPU (the one the op plans with)."""
    from cukern import runner

    return pp.tuning_for(runner.device_spec(cp.cuda.Device().id))


def _flat_sizes(on: bool) -> tuple[int, ...]:
    return pp.FLAT_SIZES if on else ()


@pytest.fixture(params=["flat", "gather"])
def switch(request, monkeypatch):
    """The planner with perm_flat_regs on (1, 2, 4) or off, for every plan made in the test;
    the op's launch caches emptied around it (they key on layouts, not tunings)."""
    on = request.param == "flat"
    plan_with(monkeypatch, perm_flat_regs=_flat_sizes(on))
    yield on
    clear_launches()


def _id(case) -> str:
    shape, axes = case
    return f"{'x'.join(map(str, shape))}-{''.join(map(str, axes))}"


# (shape, axes, whether the path runs for 1-, 2-, 4-byte elements with the switch on)
SHAPES = [
    # C = 3 to the end: a flat output run of 3-element blocks
    ((2, 3, 224, 224), NHWC, (True, True, True)),
    ((3, 3, 32, 32), NHWC, (True, True, True)),
    ((4, 3, 16, 16), NHWC, (True, True, True)),
    ((1, 3, 15, 16), NHWC, (True, True, True)),       # one image: a partial tile of 240
    ((1, 3, 9, 16), NHWC, (True, True, True)),        # a partial tile of 144
    ((1, 3, 15, 15), NHWC, (False, False, False)),    # channel rows 225 apart: narrow loads
    ((1, 3, 9, 9), NHWC, (False, False, False)),      # the general kernel or narrow loads
    ((2, 3, 15, 15), NHWC, (False, False, False)),    # batch stride 675: narrow stores
    ((5, 3, 1000), (0, 2, 1), (False, True, True)),   # batch stride 3000: int8 under 16 B
    ((1, 3, 5, 5), NHWC, (False, False, False)),      # the general kernel
    ((2, 3, 4, 16, 16), (0, 2, 3, 4, 1), (True, True, True)),  # 5-D
    ((3, 4096), (1, 0), (True, True, True)),
    ((3, 1000), (1, 0), (False, True, True)),  # int8: a flat input run of 1000, not 16k
    # the other direction and flat output runs of other lengths: the gather either way
    ((2, 224, 224, 3), NCHW, (False,) * 3), ((2, 4, 16, 16, 3), (0, 4, 1, 2, 3), (False,) * 3),
    ((4096, 3), (1, 0), (False,) * 3),
    ((2, 2048, 7, 7), NHWC, (False,) * 3), ((2, 7, 7, 2048), NCHW, (False,) * 3),
    ((2, 1024, 14, 14), NHWC, (False,) * 3), ((2, 14, 14, 1024), NCHW, (False,) * 3),
    ((3, 64, 5, 5), NHWC, (False,) * 3), ((3, 5, 5, 64), NCHW, (False,) * 3),
    ((2, 96, 9, 9), NHWC, (False,) * 3), ((2, 9, 9, 96), NCHW, (False,) * 3),
    ((4, 64, 1, 1), NHWC, (False,) * 3), ((2, 5, 7, 7, 40), (0, 4, 1, 2, 3), (False,) * 3),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SHAPES, ids=[_id(c[:2]) for c in SHAPES])
def test_shapes_both_ways(case, dtype, switch, rng):
    shape, axes, takes = case
    xh, xd = put(rng, shape, dtype)
    p = ops.plan_for(xd, axes)
    want_flat = switch and takes[{1: 0, 2: 1, 4: 2}[xh.dtype.itemsize]]
    assert (p is not None and p.flat_regs == 3) == want_flat, str(p)
    if not switch and p is not None:
        assert p.flat_regs == 0
    check(xd, xh, axes)


@pytest.mark.parametrize("dtype", ["int8", "float16", "float32"])
def test_to_nhwc_of_images(dtype, switch, rng):
    xh, xd = put(rng, (4, 3, 40, 48), dtype)
    want = expected(xh, NHWC)
    poison(want.nbytes)
    y = cukern.to_nhwc(xd)
    assert_bits(y, want, "to_nhwc")
    assert_bits(cukern.to_nchw(y), xh, "to_nchw(to_nhwc(x))")


@pytest.mark.parametrize("dtype", ["int8", "bool", "float16", "bfloat16", "float32"])
@pytest.mark.parametrize("case", FLAT_CASES, ids=[
    "{}B-b{}-i{}-in{}-at{}".format(*c) for c in FLAT_CASES])
def test_strided_runs_off_the_words(case, dtype, switch, monkeypatch, rng):
    """x a slice of wider channel rows, out= a batch of (si, 3) runs out_base elements into a
    buffer (the model's cases, tiles down to 16 bytes): partial tiles, runs that end off the
    store word, flat input runs; the bytes around out= stay."""
    item, b, si, o_in, out_base = case
    if item_size(dtype) != item:
        pytest.skip(f"a case of {item}-byte elements")
    plan_with(monkeypatch, perm_flat_regs=_flat_sizes(switch), perm_tile_min_bytes=16)
    base_h, base_d = put(rng, (b, 3, o_in), dtype)
    ref = flat_case_plan(case, dataclasses.replace(
        device_tuning(), perm_flat_regs=_flat_sizes(switch)))

    def plan_check(p):
        # the path of the reference's table (phase 1 may take cp.async here)
        assert (p.targs[:8], p.tile, p.pitch, p.flat_regs) == \
            (ref.targs[:8], ref.tile, ref.pitch, 3 if switch else 0), str(p)

    check_strided_into_buffer(base_d, base_h, base_d[:, :, :si], base_h[:, :, :si], (0, 2, 1),
                              out_base, plan_check)
    clear_launches()


@pytest.mark.parametrize("dtype", ["int8", "float16", "float32"])
@pytest.mark.parametrize("side", ["in", "out"])
@pytest.mark.parametrize("offset", [1, 2, 4, 8, 16])
def test_misaligned_pointers(offset, side, dtype, switch, rng):
    """C = 3 images with the input or the output ``offset`` elements into its buffer: the path
    where the stores stay 16 bytes and the loads 4 or more, the gather elsewhere."""
    axes = NHWC
    pad_in = offset if side == "in" else 0
    pad_out = offset if side == "out" else 0
    _, xd, want, o, obuf = put_misaligned(rng, (2, 3, 32, 32), axes, dtype, pad_in, pad_out)
    item = want.dtype.itemsize
    p = ops.plan_for(xd, axes, out=o)
    path = switch and (pad_out * item) % 16 == 0 and (pad_in * item) % 4 == 0
    assert (p.flat_regs == 3) == path, str(p)
    check_misaligned(xd, axes, want, o, obuf, pad_out, p.kernel)


@pytest.mark.parametrize("dtype", ["int8", "bool", "float16", "float32"])
@pytest.mark.parametrize("case", [((2, 3, 224, 224), NHWC), ((1, 3, 15, 16), NHWC),
                                  ((3, 1000), (1, 0)), ((2, 3, 4, 16, 16), (0, 2, 3, 4, 1)),
                                  ((2, 7, 7, 2048), NCHW)], ids=_id)
def test_64_bit_indices(case, dtype, switch, rng):
    """The plan the op makes, launched with 64-bit indices (the instantiations arrays past 2^31
    elements run), into poisoned memory."""
    shape, axes = case
    xh, xd = put(rng, shape, dtype)
    p = ops.plan_for(xd, axes)
    p64 = check_64_bit(p, xd, xh, axes)
    assert p64.targs[6] == (3 if p.flat_regs else 0) and p64.targs[8] == p.async_copy

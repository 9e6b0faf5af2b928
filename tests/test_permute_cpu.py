"""Permute tests that need no GPU: the simplification on a table of permutations and as a
property (the same pairs of input and output elements), the planner's choices at its regime
edges (copy, tile, flat runs, general; vector widths by alignment; 32- and 64-bit indices),
the kernel argument structs, shared-memory banks of the default tiles, NVRTC compilation of
every reachable instantiation for sm_75, sm_80 and sm_90, ``explain``, the registry entry, the
reference and the argument checks that run before any GPU work."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import re

import numpy as np
import pytest

import cukern
from cukern import _compile, reference, registry
from cukern._device import DeviceSpec
from cukern.families import permute as fam
from cukern.ops import permute as ops
from cukern.plan import HOPPER
from cukern.plan import permute as pp
from cukern.plan.permute import Dim

from .conftest import NVRTC_ARCHS, nvrtc_results

H100 = DeviceSpec.h100()
A100 = DeviceSpec.a100()


def elem_strides(a: np.ndarray) -> tuple[int, ...]:
    return tuple(s // a.itemsize for s in a.strides)


def simple_of(x: np.ndarray, axes, out: np.ndarray | None = None) -> pp.Simplified:
    """simplify() of transpose(x, axes) written into ``out`` (default C order)."""
    axes = pp.normalize_axes(axes, x.ndim)
    outs = None if out is None else elem_strides(out)
    _, dims = pp.output_dims(x.shape, elem_strides(x), axes, outs)
    return pp.simplify([d.size for d in dims], [d.in_stride for d in dims],
                       [d.out_stride for d in dims])


def plan(shape, axes, itemsize=2, device=H100, **kw):
    """The plan of transpose(x, axes) for a C-contiguous x of ``shape``."""
    x = np.lib.stride_tricks.as_strided(np.empty(1, f"V{itemsize}"), shape,
                                        [s * itemsize for s in pp.c_strides(shape)])
    return pp.plan_permute(simple_of(x, axes), itemsize, device,
                           signature=fam.name_expression, **kw)


# ---------------------------------------------------------------------------------------------
# Simplification.

N, C, H, W = 2, 5, 6, 7


@pytest.mark.parametrize("shape,axes,expected", [
    # identity: one dim, a copy
    ((N, C, H, W), (0, 1, 2, 3), [(N * C * H * W, 1, 1)]),
    # NCHW -> NHWC: (N, HW, C), input strides (C*HW, 1, HW)
    ((N, C, H, W), (0, 2, 3, 1), [(N, C * H * W, H * W * C), (H * W, 1, C), (C, H * W, 1)]),
    # NHWC -> NCHW: (N, C, HW)
    ((N, H, W, C), (0, 3, 1, 2), [(N, H * W * C, C * H * W), (C, 1, H * W), (H * W, C, 1)]),
    # 5-D NCDHW -> NDHWC
    ((N, C, 3, H, W), (0, 2, 3, 4, 1), [(N, C * 3 * H * W, 3 * H * W * C),
                                        (3 * H * W, 1, C), (C, 3 * H * W, 1)]),
    # 2-D transpose
    ((H, W), (1, 0), [(W, 1, H), (H, W, 1)]),
    # axes None: reversed
    ((N, C, H), None, [(H, 1, C * N), (C, H, N), (N, C * H, 1)]),
    # size-1 axes dropped: (1, C, 1, W) -> (W, C) is a 2-D transpose
    ((1, C, 1, W), (3, 2, 1, 0), [(W, 1, C), (C, W, 1)]),
    ((N, 1, C), (1, 0, 2), [(N * C, 1, 1)]),
    # swapping the two middle axes keeps the inner run: a batched copy of rows of W
    ((N, C, H, W), (0, 2, 1, 3), [(N, C * H * W, H * C * W), (H, W, C * W), (C, H * W, W),
                                  (W, 1, 1)]),
    # rank 8, no merges: reversed axes of size 2
    ((2,) * 8, tuple(range(7, -1, -1)), [(2, 1 << k, 1 << (7 - k)) for k in range(8)]),
    # rank 8 with merges: the last four axes keep their order
    ((2, 3, 2, 3, 2, 3, 2, 3), (1, 0, 2, 3, 4, 5, 6, 7),
     [(3, 216, 432), (2, 648, 216), (216, 1, 1)]),
    # a single element; rank 0
    ((1, 1, 1), (2, 0, 1), [(1, 1, 1)]),
    ((), (), [(1, 1, 1)]),
    # empty
    ((N, 0, W), (2, 1, 0), [(0, 1, 1)]),
])
def test_simplify_table(shape, axes, expected):
    s = simple_of(np.empty(shape, np.float32), axes)
    assert [tuple(d) for d in s.dims] == expected
    assert (s.in_offset, s.out_offset) == (0, 0)


def test_simplify_views_and_negative_strides():
    a = np.empty((6, 8, 10), np.float16)
    # a reversed axis: its input stride is negative; the copy has no unit stride to merge with
    s = simple_of(a[:, ::-1], (0, 1, 2))
    assert s.dims == (Dim(6, 80, 80), Dim(8, -10, 10), Dim(10, 1, 1))
    # the fully reversed array read as it lies: a copy walking the input backwards
    s = simple_of(a[::-1, ::-1, ::-1], (0, 1, 2))
    assert s.dims == (Dim(480, -1, 1),)
    # a strided view: no input stride of 1
    s = simple_of(a[:, :, ::2], (0, 2, 1))
    assert s.dims == (Dim(6, 80, 40), Dim(5, 2, 8), Dim(8, 10, 1))
    # a slice of rows: the inner run stays, rows of 4 in strides 10 / 4
    s = simple_of(a[:, :, :4], (1, 0, 2))
    assert s.dims == (Dim(8, 10, 24), Dim(6, 80, 4), Dim(4, 1, 1))
    # a transposed (Fortran-order) input copied to C order: a 2-D transpose
    f = np.empty((9, 7), np.float32, order="F")
    assert simple_of(f, (0, 1)).dims == (Dim(9, 1, 7), Dim(7, 9, 1))
    # a broadcast input (stride 0)
    b = np.broadcast_to(np.empty((1, 10), np.float32), (6, 10))
    assert simple_of(b, (1, 0)).dims == (Dim(10, 1, 6), Dim(6, 0, 1))


def test_simplify_flips_negative_output_strides():
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    o = np.empty((4, 6), np.float32)[::-1]
    s = simple_of(x, (0, 1), out=o)
    # the output's rows walked forwards: the input's from its last row, both merge to a copy
    # of rows read backwards
    assert s.out_offset == 3 * (-6) and s.in_offset == 3 * 6
    assert s.dims == (Dim(4, -6, 6), Dim(6, 1, 1))
    with pytest.raises(ValueError, match="stride 0"):
        pp.simplify((3, 4), (4, 1), (0, 1))


def _pairs(shape, in_strides, out_strides, in_off=0, out_off=0) -> set:
    """Every (input offset, output offset) pair a permutation moves."""
    pairs = set()
    for idx in itertools.product(*(range(n) for n in shape)):
        pairs.add((in_off + sum(i * s for i, s in zip(idx, in_strides)),
                   out_off + sum(i * s for i, s in zip(idx, out_strides))))
    return pairs


def test_simplify_moves_the_same_elements():
    rnd = random.Random(3)
    for _ in range(300):
        nd = rnd.randint(0, 5)
        shape = tuple(rnd.choice((1, 2, 3, 4)) for _ in range(nd))
        steps = tuple(rnd.choice((1, 1, 2, -1)) for _ in range(nd))
        base = np.empty(tuple(n * abs(s) + 1 for n, s in zip(shape, steps)), np.float32)
        x = base[tuple(slice(None, n * s, s) if s > 0 else slice(None, None, s)
                       for n, s in zip(shape, steps))][tuple(slice(0, n) for n in shape)]
        axes = list(range(nd))
        rnd.shuffle(axes)
        out = np.empty(tuple(shape[a] for a in axes), np.float32)
        if nd and rnd.random() < 0.3:  # an output walked backwards along one axis
            k = rnd.randrange(nd)
            out = out[tuple(slice(None, None, -1) if i == k else slice(None)
                            for i in range(nd))]
        _, dims = pp.output_dims(x.shape, elem_strides(x), axes, elem_strides(out))
        s = simple_of(x, axes, out)
        want = _pairs([d.size for d in dims], [d.in_stride for d in dims],
                      [d.out_stride for d in dims])
        got = _pairs([d.size for d in s.dims], [d.in_stride for d in s.dims],
                     [d.out_stride for d in s.dims], s.in_offset, s.out_offset)
        assert got == want, (shape, steps, axes)
        assert len(s.dims) <= max(1, sum(n > 1 for n in shape))


def test_normalize_axes():
    assert pp.normalize_axes(None, 3) == (2, 1, 0)
    assert pp.normalize_axes([0, -1, 1], 3) == (0, 2, 1)
    assert pp.normalize_axes((np.int64(1), 0), 2) == (1, 0)
    assert pp.normalize_axes((), 0) == ()


@pytest.mark.parametrize("axes,exc,match", [
    ((0, 1), ValueError, "has 2 entries, expected 3"),
    ((0, 1, 3), ValueError, "axis 3 in axes .* out of range"),
    ((0, 1, -4), ValueError, "out of range"),
    ((0, 1, 1), ValueError, "repeats axis 1"),
    ((0, 2, -1), ValueError, "repeats axis 2"),
    ((0, 1.0, 2), TypeError, "axes must be ints, got float"),
    ((0, True, 2), TypeError, "axes must be ints, got bool"),
    ("012", TypeError, "sequence of ints"),
    (1, TypeError, "sequence of ints"),
])
def test_normalize_axes_errors(axes, exc, match):
    with pytest.raises(exc, match=match):
        pp.normalize_axes(axes, 3)


# ---------------------------------------------------------------------------------------------
# Planner: kinds, tiles and vectors at their edges.

RESNET = [(n, c, h, h) for n in (64, 256) for c, h in
          ((64, 112), (64, 56), (256, 56), (128, 28), (512, 28), (256, 14), (1024, 14),
           (512, 7), (2048, 7))]
NHWC = (0, 2, 3, 1)
NCHW = (0, 3, 1, 2)


def test_copy_plans():
    p = plan((64, 1000), (0, 1), 2)  # identity: one 16-byte-word row
    assert p.kind == "copy" and p.dims == (Dim(64000, 1, 1),)
    assert p.word == 16 and p.vec_in == p.vec_out == 8 and p.tail == 0
    assert p.walk == Dim(8000, 1, 1) and p.kernel == "cukern::permute_rows<uint4, int>"
    p = plan((37,), (0,), 1)  # an odd length: 16-byte words and a byte tail
    assert (p.word, p.walk.size, p.tail) == (16, 2, 5)
    # alignment: a 2-byte-aligned pointer moves 2-byte words; 8 and 4 allow 8 and 4 bytes
    for align, word in ((2, 2), (4, 4), (8, 8), (16, 16), (32, 16), (1024 + 8, 8)):
        p = plan((64, 1000), (0, 1), 2, in_align=align)
        assert p.kind == "copy" and p.word == word, align
        p = plan((64, 1000), (0, 1), 2, out_align=align)
        assert p.word == word, align
    # rows: (N, C, H, W) -> (N, H, C, W) keeps the rows of W; words divide W
    p = plan((8, 16, 12, 40), (0, 2, 1, 3), 2)
    assert p.kind == "copy" and p.word == 16 and p.walk == Dim(5, 1, 1)
    assert [d.size for d in p.batch] == [8, 12, 16] and p.tail == 0
    p = plan((8, 16, 12, 41), (0, 2, 1, 3), 2)  # odd rows: one element a word, no tail
    assert p.kind == "copy" and p.word == 2 and p.walk == Dim(41, 1, 1) and p.tail == 0


def test_fold_inner_into_wider_elements():
    # (N, C, HW, 2) float16 pairs -> (N, HW, C, 2): 4-byte elements, a tiled transpose
    p = plan((4, 64, 196, 2), (0, 2, 1, 3), 2)
    assert p.elem == 4 and p.kind == "tile" and p.itemsize == 2
    assert p.dims == (Dim(4, 64 * 196, 64 * 196), Dim(196, 1, 64), Dim(64, 196, 1))
    # rows of 3 floats do not fold (12 bytes): a copy of short rows
    p = plan((4, 64, 196, 3), (0, 2, 1, 3), 4)
    assert p.elem == 4 and p.kind == "copy"
    # alignment forbids it: 2-byte-aligned pointers keep 2-byte elements
    p = plan((4, 64, 196, 2), (0, 2, 1, 3), 2, in_align=2)
    assert p.elem == 2 and p.kind == "copy"


@pytest.mark.parametrize("itemsize,tile", [(e, (ti, to)) for e, ti, to in HOPPER.perm_tiles])
def test_default_tiles_by_element_size(itemsize, tile):
    p = plan((64, 256, 56, 56), NHWC, itemsize)
    assert p.kind == "tile" and p.tile == tile and not (p.flat_in or p.flat_out)
    assert p.vec_in * itemsize == 16 and p.vec_out * itemsize == 16
    assert 8192 <= tile[0] * tile[1] * itemsize <= 16384
    # threads: enough for every 16-byte word of a phase in TILE_UNROLL steps, at most 256
    words = tile[0] * tile[1] * itemsize // 16
    assert p.block == (min(HOPPER.perm_threads, words // pp.TILE_UNROLL), 1) and p.index == 32
    # the inverse runs the same tile
    q = plan((64, 56, 56, 256), NCHW, itemsize)
    assert q.kind == "tile" and q.tile == tile


@pytest.mark.parametrize("shape", RESNET + [(64, 3, 224, 224), (8, 64, 16, 56, 56)])
@pytest.mark.parametrize("itemsize", [1, 2, 4])
def test_benchmark_shapes_run_wide_tiles(shape, itemsize):
    axes = cukern.ops.permute.nhwc_axes(len(shape))
    for axes_, sh in ((axes, shape), (ops.nchw_axes(len(shape)),
                                      tuple(shape[a] for a in axes))):
        p = plan(sh, axes_, itemsize)
        assert p.kind == "tile" and p.index == 32, (sh, p)
        ti, to = p.tile
        # 16-byte loads and stores wherever a flat run or aligned rows allow them; output rows
        # of 196 or 49 elements (14x14, 7x7 planes past perm_flat_out_max_bytes) store the
        # widest word their length allows
        assert p.vec_in * itemsize == 16, (sh, p)
        row_bytes = p.o_dim.size * itemsize
        assert p.vec_out * itemsize == (16 if p.flat_out else math.gcd(16, row_bytes)), (sh, p)
        assert p.smem <= HOPPER.perm_tile_max_bytes and p.block[0] <= 256
        # skinny dims are held whole as flat runs: no tile is mostly empty
        busy = min(p.i_dim.size, ti) * min(p.o_dim.size, to) / (ti * to)
        assert busy >= 0.75, (sh, p.tile, busy)


def test_skinny_plans():
    # C = 3 images: (N, 3, HW) -> (N, HW, 3): the output tile is one flat run
    p = plan((64, 3, 224, 224), NHWC, 1)
    assert p.flat_out and not p.flat_in and p.tile[1] == 3 and p.vec_out == 16
    q = plan((64, 224, 224, 3), NCHW, 1)
    assert q.flat_in and not q.flat_out and q.tile[0] == 3 and q.vec_in == 16
    # 7x7: (N, 2048, 49) -> (N, 49, 2048): a flat input run of whole 7x7 planes
    p = plan((64, 2048, 7, 7), NHWC, 2)
    assert p.flat_in and p.tile[0] == 49 and p.vec_in == 8 and p.vec_out == 8
    q = plan((64, 7, 7, 2048), NCHW, 2)
    assert q.flat_out and q.tile[1] == 49
    # 14x14 (196 = 4 * 49: rows allow 8-byte vectors only, the flat run 16)
    p = plan((64, 1024, 14, 14), NHWC, 2)
    assert p.flat_in and p.vec_in == 8
    # skinny matrices
    p = plan((8192, 3), (1, 0), 4)
    assert p.flat_in and p.tile[0] == 3 and p.vec_in == 4 and p.vec_out == 4
    p = plan((3, 8192 * 1024), (1, 0), 4)
    assert p.flat_out and p.tile[1] == 3 and p.vec_in == 4 and p.vec_out == 4
    # a square: rows both sides
    p = plan((4096, 4096), (1, 0), 2)
    assert not (p.flat_in or p.flat_out) and p.tile == (64, 64)
    # 64 channels (128 bytes) are rows, not a flat run (fewer bank conflicts)
    p = plan((8, 64, 16, 56, 56), ops.nhwc_axes(5), 4)
    assert not p.flat_out and p.tile == (64, 64)


def test_general_plans():
    # nothing has input stride 1: strided reads
    x = np.empty((6, 8, 20), np.float32)[:, :, ::2]
    p = pp.plan_permute(simple_of(x, (0, 2, 1)), 4, H100, signature=fam.name_expression)
    assert p.kind == "general" and p.word == 4 and p.walk == Dim(8, 20, 1)
    assert p.kernel == "cukern::permute_rows<unsigned int, int>"
    # a transpose of 2 x 2 blocks: under perm_tile_min_bytes
    p = plan((64, 2, 2), (0, 2, 1), 4)
    assert p.kind == "general" and any("perm_tile_min_bytes" in n for n in p.notes)
    # an output with no unit stride
    o = np.empty((8, 12), np.float32)[:, ::2]
    x = np.empty((6, 8), np.float32)
    p = pp.plan_permute(simple_of(x, (1, 0), o), 4, H100)
    assert p.kind == "general" and any("strided stores" in n for n in p.notes)


def test_index_width():
    assert plan((64, 256, 56, 56), NHWC, 2).index == 32
    # past 2^31 elements: 64-bit (planned, never allocated)
    assert plan((2, 2**31), (1, 0), 1).index == 64
    assert plan((2**31 + 8,), (0,), 1).index == 32  # 16-byte words: 2^27 of them
    assert plan((2**32,), (0,), 1).index == 32
    assert plan((2**35 + 2,), (0,), 2).index == 64  # a 1-row copy past 2^31 words
    # offsets past 2^31 through strides (a view of a large array)
    s = pp.simplify((4, 8), (2**30 + 1, 1), (8, 1))
    assert pp.plan_permute(s, 1).index == 64
    s = pp.simplify((4, 8), (2**30, 1), (8, 1))  # 8-byte words: 2^27 a row
    assert pp.plan_permute(s, 1).index == 32
    s = pp.simplify((2, 8), (2**20, 1), (8, 1))
    assert pp.plan_permute(s, 1).index == 32


def test_plan_errors():
    with pytest.raises(ValueError, match="empty"):
        plan((4, 0, 3), (2, 1, 0), 4)
    s = pp.simplify((2,) * 9, [1 << k for k in range(9)], [1 << (8 - k) for k in range(9)])
    with pytest.raises(ValueError, match="at most 8"):
        pp.plan_permute(s, 4)
    with pytest.raises(ValueError, match="3-byte"):
        pp.plan_permute(pp.simplify((4,), (1,), (1,)), 3)


def test_grid_and_blocks_fit_the_device():
    for shape, axes, item in [((64, 256, 56, 56), NHWC, 2), ((4096, 4096), (1, 0), 1),
                              ((2**26,), (0,), 4), ((7, 9, 11), (2, 0, 1), 8)]:
        for device in (H100, A100):
            p = plan(shape, axes, item, device)
            t = cukern.plan.tuning_for(device)
            threads = p.block[0] * p.block[1]
            assert threads <= 256 and threads % 32 == 0
            resident = device.sms * device.model_occupancy(threads, p.smem)
            assert 1 <= p.grid <= min(p.tiles, resident * t.perm_waves)


def test_reachable_covers_planner_output():
    reach = set(pp.reachable_steps())
    # rows; tiles of 1, 2, 4, 8, 16 bytes; the register phase 2 of 1- and 2-byte elements
    # (words of 4, 8, 16 bytes both ways); the flat-run interleave of 1-, 2- and 4-byte
    # elements (loads of 4, 8, 16 bytes, 16-byte stores); the skewed columns of 1- and 2-byte
    # elements (16-byte words, D = 0, 1, 4); every tile kernel again with phase 1 by
    # cp.async; 32- and 64-bit
    # rows kernels again with the small arrays' unroll (SMALL_UNROLLS)
    assert len(reach) == 2 * (5 * (1 + len(pp.SMALL_UNROLLS)) +
                              2 * (25 + 16 + 9 + 4 + 1 + 9 + 9 + 9 + 6))
    names = fam.kernel_names("permute")("float16")
    assert names == {fam._name(t) for t in reach}
    rnd = random.Random(7)
    seen = set()
    off = dataclasses.replace(HOPPER, perm_byte_regs=(), perm_flat_regs=(), perm_skew_regs=())
    asy = dataclasses.replace(HOPPER, perm_async_copy=pp.ASYNC_SIZES)
    for k in range(600):
        nd = rnd.randint(1, 5)
        shape = tuple(rnd.choice((1, 2, 3, 7, 8, 16, 49, 64, 200)) for _ in range(nd))
        if math.prod(shape) == 0:
            continue
        axes = list(range(nd))
        rnd.shuffle(axes)
        item = rnd.choice(pp.WORDS)
        p = plan(shape, axes, item, in_align=rnd.choice((1, 2, 4, 8, 16)),
                 out_align=rnd.choice((1, 2, 4, 8, 16)),
                 tuning=(None, off, asy)[k % 3])
        assert p.targs in reach and p.kernel == fam._name(p.targs)
        seen.add((p.kind, p.regs, p.flat_regs, p.async_copy))
        assert not (k % 3 == 1 and (p.regs or p.flat_regs or p.skew_regs))
        assert p.async_copy == (k % 3 == 2 and (p.flat_in or p.flat_out)
                                and p.smem <= asy.perm_async_max_bytes * (1 + (p.grid < p.tiles)))
    assert {k for k, _, _, _ in seen} == set(pp.KINDS) and ("tile", True, 0, False) in seen
    assert any(k == "tile" and a for k, _, _, a in seen)


# ---------------------------------------------------------------------------------------------
# The kernels' arguments and index arithmetic.

def test_fast_div_is_exact():
    rnd = random.Random(5)
    divisors = list(range(1, 300)) + [2**k + o for k in range(1, 31) for o in (-1, 0, 1)]
    divisors += [rnd.randrange(1, 2**31) for _ in range(300)] + [2**31, 2**40 + 3]
    for d in divisors:
        m, s = pp.fast_div(d)
        assert 0 <= m < 2**32 and 0 <= s <= 31
        for n in [0, 1, d - 1, d, d + 1, 2**31 - 1] + [rnd.randrange(2**31) for _ in range(10)]:
            if 0 <= n < 2**31:
                assert (((n * m) >> 32) + n) >> s == n // d, (d, n)


def test_argument_structs_match_the_header():
    # sizes and offsets as the C structs (natural alignment): perm::Batch 264 bytes,
    # PermuteRowsArgs 344, PermuteTileArgs 416
    assert fam.BATCH.itemsize == 264
    assert fam.ROWS_ARGS.itemsize == 344 and fam.ROWS_ARGS.fields["tail"][1] == 336
    assert fam.TILE_ARGS.itemsize == 416
    assert fam.TILE_ARGS.fields["ti"][1] == 320 and fam.TILE_ARGS.fields["so_s"][1] == 396
    assert fam.TILE_ARGS.fields["npi_s"][1] == 408
    src = _compile.source("permute")
    for name in list(fam.ROWS_ARGS.names) + list(fam.TILE_ARGS.names) + list(fam.BATCH.names):
        assert name in src, name


def tile_order(a) -> list[tuple[int, int, int]]:
    """(batch, i tile, o tile) of every tile index, in order, as permute_tile decomposes it
    from the argument struct ``a`` (one row of kernel_args)."""
    nti, nto, npi = int(a["nti"]), int(a["nto"]), int(a["npi"])
    order = []
    for t in range(int(a["tiles"])):
        r1 = fdiv(t, a["nti_m"], a["nti_s"])
        r2 = fdiv(r1, a["nto_m"], a["nto_s"])
        tb = fdiv(r2, a["npi_m"], a["npi_s"])
        order.append((tb, (r2 - tb * npi) * nti + t - r1 * nti, r1 - r2 * nto))
    return order


def fdiv(n: int, m, s) -> int:
    """perm::fdiv: (umulhi(n, m) + n) >> s."""
    return ((n * int(m)) >> 32) + n >> int(s)


@pytest.mark.parametrize("panel", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("shape,axes,itemsize", [
    ((520, 1030), (1, 0), 2),         # 17 tiles along i (odd: panels of 1), 9 along o
    ((3, 300, 1024), (0, 2, 1), 4),   # 16 along i, 5 along o, a batch of 3
    ((2, 200, 14, 14), (0, 2, 3, 1), 4),
    ((700, 2048), (1, 0), 1),         # 16 along i (128-wide int8 tiles), 11 along o
])
def test_panel_order_visits_every_tile_once(shape, axes, itemsize, panel):
    # perm_panel_tiles: tiles run a panel of up to that many tiles along i (a power of two
    # dividing their count), then o, then the next panel; every tile exactly once
    p = plan(shape, axes, itemsize, tuning=dataclasses.replace(HOPPER, perm_panel_tiles=panel))
    assert p.kind == "tile"
    a = fam.kernel_args(p)[0]
    ti, to = p.tile
    nti, nto = -(-p.i_dim.size // ti), -(-p.o_dim.size // to)
    batch = p.tiles // (nti * nto)
    order = tile_order(a)
    assert sorted(order) == [(b, i, o) for b in range(batch) for i in range(nti)
                             for o in range(nto)]
    h = p.panel or nti
    assert int(a["nti"]) == h and int(a["npi"]) * h == nti
    if panel == 0 or nti <= panel:  # one panel: i first, as without panels
        assert p.panel == 0
    else:
        assert 1 <= p.panel <= panel and nti % p.panel == 0
        assert p.panel == max(d for d in (1, 2, 4, 8) if d <= panel and nti % d == 0)
    # the order: a panel's tiles along i, then along o, then the next panel
    assert order[:h] == [(0, i, 0) for i in range(h)]
    assert order[h] == (0, 0, 1) if nto > 1 else (0, h, 0)


def test_h200_plans_tiles_along_o_first():
    # the H200's table runs tiles along o first (perm_panel_tiles 1); the H100 keeps i first
    h200 = DeviceSpec.h200()
    assert pp.tuning_for(h200).perm_panel_tiles == 1 and HOPPER.perm_panel_tiles == 0
    p200, p100 = plan((16384, 16384), (1, 0), 2, h200), plan((16384, 16384), (1, 0), 2)
    assert p200.panel == 1 and p100.panel == 0
    assert dataclasses.replace(p200, panel=0, device="", notes=()) == \
        dataclasses.replace(p100, device="", notes=())
    assert "tiles along o first" in str(p200) and "order" not in str(p100)
    p4 = plan((16384, 16384), (1, 0), 2, tuning=dataclasses.replace(HOPPER, perm_panel_tiles=4))
    assert p4.panel == 4 and "panels of 4 tiles along i" in str(p4)


def test_kernel_args_of_a_tile_plan():
    p = plan((64, 2048, 7, 7), NHWC, 2)
    a = fam.kernel_args(p)
    assert a.shape == (1,) and a.dtype == fam.TILE_ARGS
    r = a[0]
    assert (r["si"], r["so"], r["o_in"], r["i_out"]) == (49, 2048, 49, 2048)
    assert (r["ti"], r["to"], r["flat_in"], r["flat_out"]) == (49, p.tile[1], 1, 0)
    assert r["nti"] == 1 and r["nto"] == 2048 // p.tile[1] and r["tiles"] == 64 * r["nto"]
    assert r["batch"]["n"] == 1 and r["batch"]["size"][0] == 64
    assert r["batch"]["in"][0] == 2048 * 49 and r["batch"]["out"][0] == 2048 * 49
    assert r["out_words"] == p.tile[1] // 8 and r["pitch"] == 49
    q = plan((64, 1000), (0, 1), 4)
    r = fam.kernel_args(q)[0]
    assert q.kind == "copy" and (r["len"], r["in_step"], r["out_step"]) == (16000, 1, 1)
    assert r["rows"] == 1 and r["batch"]["n"] == 0 and r["tiles"] == q.tiles


def _wavefronts(addrs: list[int], size: int) -> int:
    """Shared-memory wavefronts of one warp access of ``size`` bytes a lane: lanes in groups
    of 128 / size (size >= 8), each group as many wavefronts as the most distinct 4-byte words
    one of its banks is asked for."""
    group = 32 if size <= 4 else 128 // size
    total = 0
    for g in range(0, len(addrs), group):
        banks: dict[int, set] = {}
        for a in addrs[g:g + group]:
            for w in range(a // 4, (a + max(size, 4) - 1) // 4 + 1):
                banks.setdefault(w % 32, set()).add(w)
        total += max(len(v) for v in banks.values())
    return total


def _gather_addresses(p: pp.PermutePlan, j: int) -> list[int]:
    """Byte addresses the first warp of phase 2 (row output) reads for element j of its words:
    the mapping of kernels/permute.cuh (lanes take 2^group adjacent o-words of a row)."""
    ti, _ = p.tile
    out = []
    for w in range(32):
        r = w >> p.group
        og, il = divmod(r, ti)
        ol = ((og << p.group) | (w & ((1 << p.group) - 1))) * p.vec_out
        out.append(((ol + j) * p.pitch + il) * p.elem)
    return out


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8, 16])
def test_default_tiles_gather_without_bank_conflicts(itemsize):
    p = plan((64, 256, 56, 56), NHWC, itemsize)
    ideal = max(1, 32 * itemsize // 128)
    for j in range(p.vec_out):
        assert _wavefronts(_gather_addresses(p, j), itemsize) == ideal, j
    # without the padding every gather of 16-byte words would take 2-4
    unpadded = dataclasses.replace(p, pitch=p.tile[0])
    if itemsize <= 4:
        assert _wavefronts(_gather_addresses(unpadded, 0), itemsize) > ideal


# ---------------------------------------------------------------------------------------------
# NVRTC: every reachable instantiation compiles for sm_75, sm_80 and sm_90.

@pytest.mark.nvrtc("permute")
@pytest.mark.parametrize("arch", list(NVRTC_ARCHS))
def test_every_reachable_instantiation_compiles(arch):
    # compiled in the background since collection ended (conftest.nvrtc_results): the
    # family's names are the same for every dtype, so they come in the first dtype's programs
    device = getattr(DeviceSpec, NVRTC_ARCHS[arch])()  # the device model the check plans for
    lowered = {}
    for source, _, names, result in nvrtc_results("permute", arch):
        assert source == "permute" and set(result) == set(names)
        lowered.update(result)
    names = registry.kernel_names(["permute"], ["int8"], device)["permute"]
    missing = [n for n in names if not lowered.get(n)]
    assert not missing, missing[:3]
    assert len(names) == 372 and sum(n.endswith(", true>") for n in names) == 36 + 176
    # the rows kernel of small arrays (SMALL_UNROLLS): every word size, 32- and 64-bit
    assert sum(bool(re.search(r"permute_rows<[^,]+, (int|long long), 4>$", n))
               for n in names) == 10
    assert sum(bool(re.search(r", (int|long long), true>$", n)) for n in names) == 36
    assert sum(bool(re.search(r", (true|false), \d, -?\d, true>$", n)) for n in names) == 176
    assert sum(n.endswith(", false, 3>") for n in names) == 18


def test_source_is_self_contained_and_matches_the_planner():
    src = _compile.source("permute")
    assert '#include "' not in src
    for kernel in ("permute_rows", "permute_tile", "PermuteRowsArgs", "PermuteTileArgs"):
        assert kernel in src
    # the constants the planner mirrors
    assert f"kMaxDims = {pp.MAX_DIMS};" in src and f"kThreads = {pp.MAX_THREADS};" in src
    assert f"kTileUnroll = {pp.TILE_UNROLL};" in src
    assert f"bytes >= 16 ? {pp.rows_unroll(16)} : {pp.rows_unroll(8)}" in src
    assert all(pp.rows_unroll(w) == pp.rows_unroll(8) for w in (1, 2, 4))


# ---------------------------------------------------------------------------------------------
# explain, the registry, the reference, argument checks.

def test_explain_permute():
    p = cukern.explain("permute", (64, 256, 56, 56), "float16", axes=NHWC)
    text = str(p)
    assert isinstance(p, pp.PermutePlan) and p.kind == "tile"
    assert "sizes (64, 3136, 256)" in text and "in strides (802816, 1, 3136)" in text
    assert "tile               64 x 64" in text and \
        "permute_tile<unsigned short, 8, 8, int, true>" in text and "32-bit" in text and \
        "grid / block" in text and "2 x 8 blocks transposed in registers" in text
    # the gather where the tuning turns the register transpose off
    off = dataclasses.replace(HOPPER, perm_byte_regs=())
    q = plan((64, 256, 56, 56), NHWC, 2, tuning=off)
    assert "permute_tile<unsigned short, 8, 8, int>" in str(q) and \
        "gathers one 2-byte element a shared-memory load" in str(q)
    e = cukern.explain("permute", (8192, 3), "float32", axes=(1, 0), device=A100)
    assert e.flat_in and "flat input run" in str(e) and "A100" in str(e)
    for dtype in ("bool", "int8", "uint16", "bfloat16", np.float64, "complex128"):
        assert cukern.explain("permute", (40, 50, 60), dtype).kind == "tile"
    c = cukern.explain("permute", (5, 7), "float32", axes=(0, 1))
    assert c.kind == "copy" and "copy" in str(c)
    assert cukern.explain("permute", (3, 4), "int32").dims == (Dim(4, 1, 3), Dim(3, 4, 1))


@pytest.mark.parametrize("kw,exc,match", [
    (dict(axes=(0, 1)), ValueError, "has 2 entries, expected 3"),
    (dict(axes=(0, 0, 1)), ValueError, "repeats axis 0"),
    (dict(axes=(0, 1, 2.0)), TypeError, "ints"),
    (dict(dtype="S4"), TypeError, "expected a dtype of 1, 2, 4, 8 or 16 bytes"),
    (dict(dtype="V3"), TypeError, "3-byte"),
    (dict(dtype="nodtype"), TypeError, "not a dtype"),
    (dict(shape=(4, 0, 3)), ValueError, "empty"),
    (dict(shape=(2,) * 9, axes=None), ValueError, "at most 8"),
    (dict(shape=(4, -1, 3)), ValueError, "non-negative"),
    (dict(axis=1), ValueError, "permute takes axes, not axis"),
    (dict(relu=True), ValueError, "not relu"),
])
def test_explain_permute_errors(kw, exc, match):
    args = dict(shape=(4, 5, 6), dtype="float32", axes=(2, 0, 1))
    args.update(kw)
    with pytest.raises(exc, match=match):
        cukern.explain("permute", args.pop("shape"), args.pop("dtype"), **args)
    with pytest.raises(ValueError, match="axes is permute's"):
        cukern.explain("softmax", (4, 5), "float32", axes=(1, 0))


def test_registry_entry():
    spec = registry.get("permute")
    assert spec.family == "permute" and not spec.rowwise and spec.source == "permute"
    assert spec.inputs == ("x",) and spec.traffic == (1, 1) and spec.forward is None
    assert spec.reference is reference.permute and spec.fn is cukern.permute
    assert spec.signature is fam.name_expression
    names = registry.kernel_names(["permute"], ["float32", "int8"], H100)
    assert set(names) == {"permute"} and len(names["permute"]) == 372
    assert registry.get("permute").cli_name == "permute"


def test_reference_is_numpy_transpose():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 5)).astype(np.float16)
    for axes in itertools.permutations(range(3)):
        y = reference.permute(x, axes)
        assert y.flags.c_contiguous and y.dtype == x.dtype
        assert np.array_equal(y, np.transpose(x, axes))
    assert np.array_equal(reference.permute(x), x.T)
    # bits survive: NaN payloads and -0.0
    bits = np.array([0x7E01, 0x8000, 0xFC03, 0x3C00], np.uint16).view(np.float16).reshape(2, 2)
    assert np.array_equal(reference.permute(bits, (1, 0)).view(np.uint16),
                          bits.view(np.uint16).T)
    assert reference.permute(np.float32(3)).shape == ()


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint8", "int16", "float16", "int32",
                                   "float32", "uint64", "float64", "complex64", "complex128",
                                   "datetime64[s]"])
def test_check_dtype_accepts_plain_dtypes(dtype):
    assert ops.check_dtype("permute", "x", dtype) == np.dtype(dtype)
    import ml_dtypes

    assert ops.check_dtype("permute", "x", ml_dtypes.bfloat16).itemsize == 2


@pytest.mark.parametrize("dtype,match", [("S4", "S4"), ("U2", "<U2"), (object, "object"),
                                         ([("a", "i4")], "a"), ("V3", "3-byte"),
                                         ("(2,)f4", "<f4")])
def test_check_dtype_refuses(dtype, match):
    with pytest.raises(TypeError, match=f"permute: x has dtype .*{match}"):
        ops.check_dtype("permute", "x", dtype)


def test_axes_helpers():
    assert ops.nhwc_axes(4) == (0, 2, 3, 1) and ops.nchw_axes(4) == (0, 3, 1, 2)
    assert ops.nhwc_axes(5) == (0, 2, 3, 4, 1) and ops.nchw_axes(5) == (0, 4, 1, 2, 3)
    assert ops.nhwc_axes(3) == (0, 2, 1) and ops.nchw_axes(3) == (0, 2, 1)
    for nd in (3, 4, 5):
        inv = np.argsort(ops.nhwc_axes(nd))
        assert tuple(inv) == ops.nchw_axes(nd)


def test_host_arrays_are_refused():
    x = np.zeros((2, 3, 4), np.float32)
    for call in (lambda: cukern.permute(x, (2, 1, 0)), lambda: cukern.to_nhwc(x),
                 lambda: cukern.to_nchw(x), lambda: cukern.permute([1, 2], (0,))):
        with pytest.raises(TypeError, match="x must be a CuPy array"):
            call()


@pytest.mark.parametrize("shape,item,flat", [
    ((64, 7, 7, 2048), 8, True), ((2, 5, 5, 40), 8, True),      # 392 / 200 bytes: split sectors
    ((64, 14, 14, 1024), 8, False),                              # 1568 bytes: whole sectors
    ((64, 14, 14, 1024), 4, False), ((64, 7, 7, 2048), 4, True),  # float32: 7x7 flat as before
])
def test_flat_runs_that_split_sectors(shape, item, flat):
    """perm_flat_split: 8-byte output runs of channels whose rows are not whole 32-byte sectors
    are held whole (row tiles would split those sectors between blocks); without it, rows."""
    p = plan(shape, NCHW, item)
    assert p.kind == "tile" and p.flat_out is flat, str(p)
    if item == 8:
        q = plan(shape, NCHW, item, tuning=dataclasses.replace(HOPPER, perm_flat_split=()))
        assert not q.flat_out, str(q)
        if flat:  # the same kernel as the row tiles': no new instantiation
            assert p.targs in set(pp.reachable_steps()), p.targs
    with pytest.raises(ValueError, match="perm_flat_split"):
        plan(shape, NCHW, item, tuning=dataclasses.replace(HOPPER, perm_flat_split=(3,)))


def test_h200_copies_flat_tiles_by_cp_async():
    # the H200's table: tiles with a flat side of at most perm_async_max_bytes copy phase 1 by
    # cp.async; row tiles and the H100 keep the loads through registers
    h200 = DeviceSpec.h200()
    t = pp.tuning_for(h200)
    assert t.perm_async_copy == pp.ASYNC_SIZES and HOPPER.perm_async_copy == ()
    for shape, axes, item, want in [((64, 7, 7, 2048), NCHW, 2, True),     # skewed columns
                                    ((64, 2048, 7, 7), NHWC, 2, True),     # a flat input run
                                    ((64, 3, 224, 224), NHWC, 2, True),    # C = 3
                                    ((64, 256, 56, 56), NHWC, 2, False),   # row tiles
                                    ((64, 28, 28, 512), NCHW, 1, False)]:  # a 28 KB tile
        p, q = plan(shape, axes, item, h200), plan(shape, axes, item)
        assert p.async_copy == want and not q.async_copy, (shape, str(p))
        assert p.async_copy == ((p.flat_in or p.flat_out) and p.smem <= t.perm_async_max_bytes)
        assert p.targs == q.targs[:8] + (want,) and p.kernel == fam._name(p.targs)
        assert ("cp.async" in str(p)) == want


@pytest.mark.parametrize("shape,itemsize,flat200", [
    ((256, 1024, 14, 14), 4, True),   # rows of 196 = 4 (mod 8) float32: held whole
    ((64, 64, 10, 10), 4, True),      # 100 (1.6 MB: past perm_small_flat_max_bytes)
    ((64, 512, 28, 28), 4, False),    # 784 float32: 3136 bytes, past perm_flat_max_bytes
    ((64, 256, 16, 16), 4, False),    # 256 = 0 (mod 8): whole row tiles
    ((64, 512, 28, 28), 2, False),    # 16-bit rows of 784: row tiles (pitch 0 mod 8 held whole)
    ((64, 1024, 14, 14), 8, False),   # float64: not in the H200's perm_flat_rows4
])
def test_h200_holds_float32_rows_of_4_mod_8_whole(shape, itemsize, flat200):
    h200 = DeviceSpec.h200()
    assert pp.tuning_for(h200).perm_flat_rows4 == (4,) and HOPPER.perm_flat_rows4 == ()
    p, q = plan(shape, NHWC, itemsize, h200), plan(shape, NHWC, itemsize)
    assert not q.flat_in and p.flat_in == flat200, str(p)
    if flat200:
        hw = shape[2] * shape[3]
        assert p.tile[0] == p.pitch == hw and p.async_copy and p.vec_in == 4



def test_h200_small_arrays_take_the_general_kernel_in_narrow_blocks():
    """The H200's table (perm_small_max_bytes 128 KB, perm_small_flat_max_bytes 1 MB): arrays
    up to 128 KB, and up to 1 MB where the tile would have a flat side or none fits, run the
    general kernel, perm_small_unroll (4) elements a thread in blocks of 32-256 threads sized
    so every SM gets one; the H100 keeps its tiles; copies stay copies; row tiles past 128 KB
    stay tiles."""
    h200 = DeviceSpec.h200()
    t = pp.tuning_for(h200)
    assert (t.perm_small_max_bytes, t.perm_small_flat_max_bytes, t.perm_small_unroll) == \
        (131072, 1048576, 4)
    assert (HOPPER.perm_small_max_bytes, HOPPER.perm_small_flat_max_bytes) == (0, 0)
    reach = set(pp.reachable_steps())
    for shape, axes, item, small in (
            ((8192, 3), (1, 0), 2, True), ((3, 8192), (1, 0), 4, True),
            ((2, 64, 7, 7), NHWC, 1, True), ((256, 256), (1, 0), 2, True),
            ((65536, 3), (1, 0), 2, True),          # 384 KB, C = 3: a flat side
            ((8, 14, 14, 64), (0, 3, 1, 2), 2, True),  # 196 KB, a flat output run of 196
            ((8, 14, 14, 64), (0, 3, 1, 2), 4, False),  # 392 KB of float32 row tiles
            ((512, 512), (1, 0), 1, False),         # 256 KB of row tiles
            ((256, 256), (1, 0), 4, False),         # 256 KB of row tiles
            ((64, 64, 10, 10), NHWC, 4, False),     # 1.6 MB
            ((3, 5, 7), (0, 1, 2), 2, False)):      # a copy
        p, q = plan(shape, axes, item, h200), plan(shape, axes, item)
        assert q.kind != "general" or math.prod(shape) * item < 512, str(q)
        if not small:
            assert p.kind == q.kind and "small array" not in str(p), str(p)
            continue
        assert p.kind == "general" and p.targs[3] == 4 and p.targs in reach, str(p)
        threads = p.block[0] * p.block[1]
        assert threads in (32, 64, 128, 256) and p.grid == p.tiles, str(p)
        words = math.prod(shape) * item // p.elem
        assert p.tiles >= h200.sms or threads == 32, str(p)  # every SM a block where it can
        assert threads == 32 or -(-words // 4) // threads >= h200.sms, str(p)
        assert "small array" in str(p) and "blocks of" in str(p)
        limit = "perm_small_max_bytes" if math.prod(shape) * item <= 131072 else \
            "perm_small_flat_max_bytes"
        assert f"({limit})" in str(p), str(p)
    # random small arrays: the kernels the planner makes are reachable
    rnd = random.Random(11)
    for _ in range(300):
        nd = rnd.randint(1, 5)
        shape = tuple(rnd.choice((1, 2, 3, 7, 16, 49, 64)) for _ in range(nd))
        axes = list(range(nd))
        rnd.shuffle(axes)
        p = plan(shape, axes, rnd.choice(pp.WORDS), h200, in_align=rnd.choice((1, 4, 16)))
        assert p.targs in reach and p.kernel == fam._name(p.targs)
    with pytest.raises(ValueError, match="perm_small_unroll 3"):
        plan((64, 3), (1, 0), 2, tuning=dataclasses.replace(t, perm_small_unroll=3))

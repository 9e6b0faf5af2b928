"""Batch-norm tests that need no GPU: layouts from strides, the planner's choices at their
edges, the kernels' index arithmetic (fast division, the elementwise passes' channel tracking,
the mask's bit layout), NVRTC compilation of every reachable instantiation for sm_75, sm_80
and sm_90, ``explain``, the registry entries and the argument checks that run before any GPU
work."""

from __future__ import annotations

import dataclasses
import math
import random
from unittest import mock

import numpy as np
import pytest

import cukern
from cukern import _compile, reference, registry
from cukern._device import DeviceSpec
from cukern.families import batch_norm as fam
from cukern.plan import HOPPER, ITEMSIZE
from cukern.plan import batch_norm as bp

from .conftest import NVRTC_ARCHS, nvrtc_results

H100 = DeviceSpec.h100()
A100 = DeviceSpec.a100()
TWO_PASS = dataclasses.replace(HOPPER, bn_one_read_max_bytes=0)  # no one-read training step
OPS = ("batch_norm", "batch_norm_backward", "batch_stats")
DTYPES = ("float16", "bfloat16", "float32", "float64")
# Every batch-norm shape of the benchmark (ResNet-50 at batch 64 and 256, BatchNorm1d,
# 5-D video)
RESNET = [(n, c, h, h) for n in (64, 256)
          for c, h in ((64, 112), (64, 56), (256, 56), (128, 28), (512, 28), (256, 14),
                       (1024, 14), (512, 7), (2048, 7))]
BN1D = [(r, c) for r in (4096, 65536) for c in (256, 1024, 4096)]
SHAPES = RESNET + BN1D + [(8, 64, 16, 56, 56)]


def elem_strides(a: np.ndarray) -> tuple[int, ...]:
    return tuple(s // a.itemsize for s in a.strides)


def channels_last(shape, dtype=np.float32) -> np.ndarray:
    """A channels-last view of logical ``shape`` (memory N, spatial..., C), as PyTorch's."""
    order = (0, *range(2, len(shape)), 1)
    return np.empty([shape[i] for i in order], dtype).transpose(np.argsort(order))


def plan(op, shape, dtype="float16", layout="NCHW", axis=1, device=H100, **kw):
    strides = bp.layout_strides(shape, axis, layout)
    view = bp.channel_view(shape, strides, axis % len(shape))
    return bp.plan_batch_norm(op, view, dtype, device, signature=fam.name_expression, **kw)


# ---------------------------------------------------------------------------------------------
# Layouts from strides.

@pytest.mark.parametrize("shape,make,axis,expected", [
    ((8, 3, 5, 7), np.empty, 1, (8, 3, 35)),                    # NCHW
    ((8, 3, 5, 7), channels_last, 1, (280, 3, 1)),              # channels_last
    ((8, 3, 4, 5, 6), channels_last, 1, (960, 3, 1)),           # 5-D channels_last
    ((64, 256), np.empty, 1, (64, 256, 1)),                     # (N, C): columns
    ((64, 256), np.empty, -1, (64, 256, 1)),
    ((64, 256), np.empty, 0, (1, 64, 256)),                     # channels first: one plane each
    ((8, 1, 5, 7), np.empty, 1, (280, 1, 1)),                   # a single channel
    ((1, 3, 1, 7), np.empty, 1, (1, 3, 7)),                     # size-1 axes do not count
    ((8, 3, 5, 7), lambda s: np.empty((8, 5, 3, 7)).transpose(0, 2, 1, 3), 1, (40, 3, 7)),
    ((8, 3, 5, 7), lambda s: np.empty((3, 8, 5, 7)).transpose(1, 0, 2, 3), 1, (1, 3, 280)),
])
def test_channel_view_of_dense_layouts(shape, make, axis, expected):
    a = make(shape)
    assert a.shape == shape
    view = bp.channel_view(a.shape, elem_strides(a), axis % a.ndim)
    assert tuple(view) == expected
    assert view.numel == a.size
    # the element at flat memory index e is in channel (e // B) % C
    chan = np.broadcast_to(np.arange(shape[axis]).reshape(
        [-1 if i == axis % a.ndim else 1 for i in range(a.ndim)]), shape)
    flat = np.empty(a.size, np.int64)
    offs = sum(np.indices(shape)[i] * elem_strides(a)[i] for i in range(a.ndim))
    flat[offs.ravel()] = chan.ravel()
    assert (flat == (np.arange(a.size) // view.inner) % view.channels).all()


@pytest.mark.parametrize("make", [
    lambda: np.empty((8, 6, 5, 7))[:, :3],          # a channel slice: gaps
    lambda: np.empty((8, 3, 5, 14))[..., ::2],      # strided spatial axis
    lambda: np.empty((8, 3, 5, 7))[::-1],           # negative stride
    lambda: np.broadcast_to(np.empty((1, 3, 5, 7)), (8, 3, 5, 7)),  # overlapping
])
def test_channel_view_refuses_other_views(make):
    a = make()
    assert bp.channel_view(a.shape, elem_strides(a), 1) is None


def test_layout_strides_match_numpy():
    for shape in [(8, 3, 5, 7), (2, 4, 3, 5, 6), (16, 9)]:
        assert bp.layout_strides(shape, 1, "NCHW") == elem_strides(np.empty(shape))
        assert bp.layout_strides(shape, 1, "NHWC") == elem_strides(channels_last(shape))
    with pytest.raises(ValueError, match="layout"):
        bp.layout_strides((2, 3), 1, "NWHC")


# ---------------------------------------------------------------------------------------------
# The kernels' index arithmetic.

def test_fast_div_is_exact():
    rnd = random.Random(5)
    divisors = list(range(1, 600)) + [2**k + o for k in range(1, 31) for o in (-1, 0, 1)
                                      if 2**k + o < 2**31] + [49, 196, 784, 3136, 12544, 802816]
    divisors += [rnd.randrange(1, 2**31 - 1) for _ in range(500)]
    for d in divisors:
        m, s = bp.fast_div(d)
        assert 0 < m < 2**32 and 0 <= s <= 31
        ns = [0, 1, d - 1, d, d + 1, 2**31 - 1, 2**31 - 2] + [rnd.randrange(2**31)
                                                                for _ in range(20)]
        for n in ns:
            if 0 <= n < 2**31:
                assert (((n * m) >> 32) + n) >> s == n // d, (d, n)
    with pytest.raises(ValueError):
        bp.fast_div(0)


def _elementwise_visits(plan_, view):
    """Emulates batch_norm_apply's loop (each thread U packs G apart, j tracked by adding
    G % CBp, bn::plane_span): (pack index, channel of each of its elements) for every visit."""
    step = plan_.step("apply") or plan_.step("dx")
    pack = plan_.pack
    assert step.targs[1] == pack
    cols = view.layout == bp.COLUMNS
    total, cbp, d, m, s, upp = bp.flat_args(plan_)
    assert total == view.numel // pack
    threads = step.block[0]
    G = step.grid[0] * threads
    u_n = bp.elementwise_unroll(step.kind, plan_.dtype, pack, cols, plan_.addend)
    rG = G % cbp
    visits = []
    for tid in range(G):
        j = tid % cbp
        j_first = j
        wb = tid
        while wb - tid % 32 < total:
            for u in range(u_n):
                t = wb + u * G
                if t < total:
                    if cols:
                        assert j == j_first  # the coefficients a thread keeps stay right
                        chans = [j * pack + k for k in range(pack)]
                    else:  # bn::plane_span
                        e = j * upp
                        assert e < 2**31
                        c0 = (((e * m) >> 32) + e) >> s
                        left = d - (e - c0 * d)
                        n0 = pack if upp == 1 else min(left, pack)
                        chans = [c0 if k < n0 else c0 + 1 for k in range(pack)]
                    visits.append((t, chans))
                j += rG
                if j >= cbp:
                    j -= cbp
            wb += G * u_n
    return visits


@pytest.mark.parametrize("shape,layout,dtype", [
    ((3, 5, 7, 1), "NCHW", "float32"), ((4, 6, 8, 2), "NCHW", "float16"),
    ((9, 24, 2, 2), "NHWC", "float16"), ((7, 20, 3), "NHWC", "float32"),
    ((5, 3), "NCHW", "float64"), ((3, 100), "NCHW", "float32"),
    # B not a multiple of the 16-byte pack: packs spanning two planes
    ((3, 16, 7, 7), "NCHW", "float16"), ((5, 8, 14, 14), "NCHW", "float16"),
    ((2, 12, 3, 3), "NCHW", "float32"), ((4, 6, 5, 5), "NCHW", "bfloat16"),
    ((4, 16, 5, 5), "NCHW", "bfloat16"), ((3, 8, 7, 7), "NCHW", "float16"),
])
def test_elementwise_passes_visit_each_pack_once_with_its_channel(shape, layout, dtype):
    for op in ("batch_norm", "batch_norm_backward"):
        p = plan(op, shape, dtype, layout, tuning=TWO_PASS)
        view = p.view
        pack = p.pack
        visits = _elementwise_visits(p, view)
        packs = [t for t, _ in visits]
        assert sorted(packs) == list(range(view.numel // pack))
        for t, chans in visits:
            assert chans == [((t * pack + k) // view.inner) % view.channels
                             for k in range(pack)]


def test_flat_pack_for_small_planes():
    view = bp.ChannelView(64, 2048, 49)
    assert bp.pack_for("float16", view) == 1
    assert bp.flat_pack_for("float16", view) == 8  # 2048 * 49 % 8 == 0, 49 >= 8
    assert bp.flat_pack_for("float16", view, align_elems=4) == 4
    assert bp.flat_pack_for("float16", view, align_elems=2) == 1  # a 4-byte span: too narrow
    # a dividing pack of 8 bytes or more is kept (B = 196: fp16 4, fp32 4)
    assert bp.flat_pack_for("float16", bp.ChannelView(64, 1024, 196)) == 4
    assert bp.flat_pack_for("float32", bp.ChannelView(64, 1024, 196)) == 4
    assert bp.flat_pack_for("float16", bp.ChannelView(64, 1024, 196), min_bytes=16) == 8
    assert bp.flat_pack_for("float32", bp.ChannelView(64, 1024, 49)) == 4
    assert bp.flat_pack_for("float64", bp.ChannelView(64, 1024, 49)) == 1  # 8 bytes divide
    assert bp.flat_pack_for("float32", bp.ChannelView(64, 3, 49)) == 1  # 147 is odd
    assert bp.flat_pack_for("float16", bp.ChannelView(64, 8, 4)) == 4  # B < 8
    assert bp.flat_pack_for("float16", bp.ChannelView(64, 8, 1)) == 8  # columns: pack_for
    assert bp.flat_pack_for("float16", bp.ChannelView(2, 2**26, 49)) == 1  # C * B >= 2^31
    assert not bp.spans(bp.ChannelView(64, 1024, 196), 4)
    assert bp.spans(bp.ChannelView(64, 1024, 49), 8)
    assert not bp.spans(bp.ChannelView(64, 1024, 1), 8)
    p = plan("batch_norm", (64, 2048, 7, 7), "float16", tuning=TWO_PASS)
    assert p.pack == 8
    assert p.steps[0].targs == ("float16", 8, True)
    assert p.steps[-1].targs == ("float16", 8, False, False, True)
    assert bp.flat_args(p) == (64 * 2048 * 49 // 8, 2048 * 49 // 8, 49,
                               *bp.fast_div(49), 8)
    p = plan("batch_norm", (64, 1024, 14, 14), "float16", tuning=TWO_PASS)
    assert p.pack == 4 and p.steps[0].targs == ("float16", 4, False)
    assert p.steps[-1].targs == ("float16", 4, False, False, False)
    assert bp.flat_args(p) == (64 * 1024 * 196 // 4, 1024 * 49, 49, *bp.fast_div(49), 1)
    p = plan("batch_norm_backward", (64, 64, 112, 112), "float16")
    assert p.steps[0].targs == ("float16", 8, False)
    assert p.steps[-1].targs == ("float16", 8, False, False)
    assert bp.plane_packs(49, 8) == 7 and bp.plane_packs(196, 8) == 26
    assert bp.plane_packs(784, 8) == 98 and bp.plane_packs(49, 1) == 49


def _plane_bits(off, b, pack):
    lo, hi = max(0, -off), min(pack, b - off)
    return 0 if hi <= lo else ((1 << hi) - 1) & ~((1 << lo) - 1)


@pytest.mark.parametrize("view,dtype", [
    (bp.ChannelView(5, 16, 49), "float16"), (bp.ChannelView(3, 8, 196), "float16"),
    (bp.ChannelView(4, 12, 9), "float32"), (bp.ChannelView(6, 6, 25), "bfloat16"),
    (bp.ChannelView(3, 4, 64), "float16"), (bp.ChannelView(7, 3, 5), "float32"),
    (bp.ChannelView(300, 16, 49), "float16"),
])
def test_planes_reductions_read_each_channel_element_once(view, dtype):
    """Emulates batch_norm_{stats,grad}_planes' loop over a split's W packs a plane
    (bn::plane_bits): every element of channel c is counted exactly once, no other's."""
    for op in ("batch_stats", "batch_norm_backward"):
        p = bp.plan_batch_norm(op, view, dtype, H100)
        a_n, c_n, b = view
        pack, s_n = p.pack, p.splits
        w_n = bp.plane_packs(b, pack)
        m, sh = bp.fast_div(w_n)
        numel = view.numel
        assert numel % pack == 0
        for c in range(c_n):
            seen = []
            for s in range(s_n):
                a0, a1 = a_n * s // s_n, a_n * (s + 1) // s_n
                first = (a0 * c_n + c) * b
                for j in range((a1 - a0) * w_n):
                    a = (((j * m) >> 32) + j) >> sh
                    w = j - a * w_n
                    start = first + a * c_n * b
                    bits = _plane_bits(w * pack - start % pack, b, pack)
                    if bits:
                        i = start // pack + w
                        assert 0 <= i < numel // pack
                        seen += [i * pack + k for k in range(pack) if (bits >> k) & 1]
            want = [(a * c_n + c) * b + e for a in range(a_n) for e in range(b)]
            assert sorted(seen) == want


@pytest.mark.parametrize("pack", [1, 2, 4, 8])
def test_mask_words_follow_the_reference_format(pack):
    """write_mask: lane L's element k goes to bit (L % G) * PACK + k of word L // G, G = 32 /
    PACK (as the kernel assembles it from one ballot per k); reference.pack_mask packs the
    same booleans."""
    rng = np.random.default_rng(pack)
    keep = rng.random(32 * pack) > 0.5  # one warp's 32 packs, in memory order
    ballots = [sum(int(keep[lane * pack + k]) << lane for lane in range(32))
               for k in range(pack)]
    g = 32 // pack
    words = []
    for w in range(pack):
        word = 0
        for k in range(pack):
            bits = (ballots[k] >> (w * g)) & ((1 << g) - 1)
            for j in range(g):
                word |= ((bits >> j) & 1) << (j * pack + k)
        words.append(word)
    want = reference.pack_mask(keep).view(np.uint32)
    assert [int(v) for v in want] == words


# ---------------------------------------------------------------------------------------------
# Planner.

@pytest.mark.parametrize("dtype,run,align,expected", [
    ("float16", 49, 16, 1), ("float16", 196, 16, 4), ("float16", 784, 16, 8),
    ("float16", 12544, 16, 8), ("bfloat16", 3136, 16, 8), ("float32", 49, 16, 1),
    ("float32", 196, 16, 4), ("float32", 98, 16, 2), ("float64", 3136, 16, 2),
    ("float16", 784, 2, 2), ("float16", 784, 1, 1), ("float32", 784, 4, 4),
])
def test_pack_for_planes(dtype, run, align, expected):
    assert bp.pack_for(dtype, bp.ChannelView(8, 3, run), align) == expected


@pytest.mark.parametrize("dtype,c,expected", [
    ("float16", 64, 8), ("float16", 100, 4), ("float16", 3, 1), ("float32", 2048, 4),
    ("float32", 6, 2), ("float64", 7, 1), ("bfloat16", 4096, 8),
])
def test_pack_for_columns(dtype, c, expected):
    assert bp.pack_for(dtype, bp.ChannelView(1000, c, 1)) == expected


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_plans_of_the_benchmark_shapes(shape, layout, dtype):
    t = TWO_PASS  # the two passes (the one-read step: test_one_read_training_step)
    for op in OPS:
        p = plan(op, shape, dtype, layout, tuning=t)
        a, c, b = p.view
        assert a * c * b == math.prod(shape)
        assert p.layout == (bp.PLANES if b > 1 else bp.COLUMNS)
        assert p.layout == (bp.COLUMNS if layout == "NHWC" or len(shape) == 2 else bp.PLANES)
        red = p.steps[0]
        assert red.kind.endswith("cols" if p.layout == bp.COLUMNS else "planes")
        # columns split rows; planes split a channel's packs (inside a plane too)
        units = a if p.layout == bp.COLUMNS else a * bp.plane_packs(b, p.pack)
        assert 1 <= p.splits <= min(t.bn_max_splits, units)
        assert red.grid[1] == p.splits
        blocks = red.grid[0] * red.grid[1]
        resident = H100.sms * H100.model_occupancy(math.prod(red.block), red.smem)
        # enough blocks for the GPU unless the splits are capped by work or by the merge
        per_split = (a * bp.plane_packs(b, p.pack)) // (t.bn_reduce_threads * bp.unroll_reduce(
            p.pack * ITEMSIZE[dtype]) * t.bn_min_packs_per_thread)
        values = 2 if op == "batch_norm_backward" else 3
        cap = bp.partial_cap(p.view, dtype, values, t)
        if p.layout == bp.PLANES and p.splits < min(t.bn_max_splits, max(1, per_split), cap):
            assert blocks >= resident * t.bn_reduce_waves
        # partial states: at most 1/bn_partial_fraction of the bytes read (or one split)
        state = values * ITEMSIZE["float32"]
        if p.splits > 1:
            assert c * p.splits * state * t.bn_partial_fraction <= (
                p.view.numel * ITEMSIZE[dtype] * (2 if values == 2 else 1))
        assert red.smem <= 48 * 1024  # no opt-in needed
        if op != "batch_stats":
            ew = p.steps[-1]
            assert ew.kind in ("apply", "dx")
            assert ew.grid[0] <= 2**31 - 1
            if p.layout == bp.COLUMNS:
                assert ew.grid[0] * ew.block[0] % (c // p.pack) == 0
                # each thread ~128 bytes in flight (bn::unroll_cols); up to bn_apply_waves
                # waves, or about one resident wave (bn_apply_blocks_per_sm_cols an SM) where
                # the waves would leave a thread fewer than PACK / bn_apply_cols_coefs_per_pack
                # packs; rounded to whole samples
                packs = p.view.numel // p.pack
                u = bp.elementwise_unroll(ew.kind, dtype, p.pack, True, p.addend)
                step_bytes = p.pack * ITEMSIZE[dtype] * (2 if ew.kind == "dx" or p.addend
                                                         else 1)
                assert u == bp.unroll_cols(step_bytes) == min(8, 128 // step_bytes)
                need = -(-packs // (ew.block[0] * u))
                waves = H100.sms * 8 * t.bn_apply_waves  # 8 blocks of 256 threads an SM
                few = packs * t.bn_apply_cols_coefs_per_pack < waves * ew.block[0] * p.pack
                if ITEMSIZE[dtype] == 2:
                    few = few or packs < waves * ew.block[0] * t.bn_apply_cols_few_packs_16bit
                cap = min(need, H100.sms * t.bn_apply_blocks_per_sm_cols if few else waves)
                assert cap - c // p.pack < ew.grid[0] < cap + c // p.pack
        for s in p.steps:
            assert s.kernel in fam.kernel_names(op)(dtype)


def test_pack_is_widest_for_16_byte_runs():
    assert plan("batch_norm", (64, 64, 112, 112), "float16").pack == 8
    assert plan("batch_norm", (64, 64, 112, 112), "float32").pack == 4
    # B = 49, 196: 16-byte packs spanning two planes (C * B % 8 == 0)
    assert plan("batch_norm", (64, 2048, 7, 7), "float16").pack == 8
    # B = 196: 8-byte packs that divide it (bn_min_pack_bytes), not 16-byte spanning ones
    assert plan("batch_norm", (64, 1024, 14, 14), "float16").pack == 4
    assert plan("batch_norm", (64, 1024, 14, 14), "float16", align_elems=2).pack == 2
    assert plan("batch_norm", (64, 3, 7, 7), "float16").pack == 1  # C * B odd
    assert plan("batch_norm", (64, 2048, 7, 7), "float16", "NHWC").pack == 8
    assert plan("batch_norm", (64, 64, 112, 112), "float16", align_elems=2).pack == 2


def test_splits_fill_the_gpu_and_respect_their_caps():
    t = HOPPER
    # many planes per channel, few channels: splits = ceil(target / C)
    p = plan("batch_norm", (256, 64, 112, 112), "float16")
    target = H100.sms * H100.model_occupancy(t.bn_reduce_threads, 0) * t.bn_reduce_waves
    assert p.splits == -(-target // 64)
    # ... unless a split's threads would get fewer than bn_min_packs_per_thread unrolled packs
    p = plan("batch_norm", (256, 64, 56, 56), "float16")
    per_thread = bp.unroll_reduce(16) * t.bn_min_packs_per_thread
    assert p.splits == 256 * 56 * 56 // 8 // t.bn_reduce_threads // per_thread < -(-target // 64)
    # many channels: one split a channel
    assert plan("batch_norm", (64, 2048, 7, 7), "float16").splits == 1
    # planes splits are ranges of a channel's packs, not whole planes: two large planes a
    # channel still fill the GPU
    few = plan("batch_norm", (2, 4, 1000, 1000), "float32")
    assert few.splits > 2 and few.steps[0].grid[0] * few.splits >= H100.sms
    # tiny tensors: a split keeps work for its threads
    assert plan("batch_norm", (4, 8, 4, 4), "float32").splits == 1
    # columns: at most bn_max_splits, in whole waves of resident blocks
    p = plan("batch_norm", (8, 64, 16, 56, 56), "float16", "NHWC")
    resident = H100.sms * t.bn_cols_stats_blocks_per_sm
    assert p.splits == (min(t.bn_max_splits, resident * t.bn_cols_stats_waves) // resident
                        * resident)
    p = plan("batch_norm_backward", (8, 64, 16, 56, 56), "float16", "NHWC")
    resident_grad = H100.sms * t.bn_cols_reduce_blocks_per_sm
    assert p.splits == min(t.bn_max_splits, resident_grad * t.bn_reduce_waves)
    # 32-pack tiles capped by traffic (2 x 261 blocks): kept (bn_cols_min_tile_packs)
    p = plan("batch_norm", (64, 512, 28, 28), "float16", "NHWC")
    assert p.steps[0].block == (32, 8)
    assert p.steps[0].grid[0] * p.splits <= resident
    assert p.splits == min(bp.partial_cap(p.view, "float16", 3, t), resident // p.steps[0].grid[0])
    assert plan("batch_norm", (10**6, 8), "float32").splits <= t.bn_max_splits


def test_columns_tiles_narrow_only_to_the_tuning_minimum():
    t = HOPPER
    # many channels over few rows: 32-pack tiles at the H100's bn_cols_min_tile_packs (the
    # 8-pack ones' more blocks were slower), 8-pack ones where the minimum allows
    p = plan("batch_norm", (64, 2048, 7, 7), "float16", "NHWC", tuning=TWO_PASS)
    assert t.bn_cols_min_tile_packs == 32
    assert p.steps[0].block == (32, 8) and p.steps[0].grid == (16, 16)  # 4-channel packs
    narrow = dataclasses.replace(TWO_PASS, bn_cols_min_tile_packs=8)
    with mock.patch.object(bp, "tuning_for", lambda device: narrow):
        q = bp.plan_batch_norm("batch_norm", p.view, "float16", H100)
    tx = q.steps[0].block[0]
    assert tx < 32 and q.steps[0].grid[0] == 2048 // t.bn_cols_reduce_max_pack // tx
    assert q.steps[0].grid[0] * q.splits <= H100.sms * t.bn_cols_stats_blocks_per_sm
    assert q.steps[0].grid[0] * q.splits > 16 * 16  # the 32-pack tiles' 256 blocks
    # enough rows: the widest tiles
    p = plan("batch_norm", (256, 256, 56, 56), "float16", "NHWC")
    assert p.steps[0].block == (32, 8)
    # few channels: one tile of all of them (64 channels in packs of 4)
    assert plan("batch_norm", (64, 64, 112, 112), "float16", "NHWC").steps[0].block == (16, 16)


def test_merge_is_a_block_a_channel_for_few_channels_and_many_splits():
    fin = HOPPER.bn_finalize_channels
    p = plan("batch_norm", (64, 64, 112, 112), "float16", "NHWC")
    assert p.splits > 32 and p.steps[1].kind == "finalize"
    assert p.steps[1].grid == (64,) and p.steps[1].block == (32, fin)  # bn::Merger: block
    p = plan("batch_norm_backward", (64, 2048, 7, 7), "float16", "NHWC")
    assert p.steps[1].grid == (2048 // fin,)  # many channels: a warp each
    p = plan("batch_norm", (16, 4096, 8), "float32", tuning=TWO_PASS)
    if p.splits <= 32 and p.steps[1].kind == "finalize":
        assert p.steps[1].grid == (4096 // fin,)
    # many splits, but enough channels for 1 / bn_block_merge_sm_fraction of the SMs in warp
    # blocks: a warp a channel
    p = plan("batch_norm", (64, 1024, 14, 14), "float16", "NHWC", tuning=TWO_PASS)
    assert p.splits > 32
    assert 1024 // fin * HOPPER.bn_block_merge_sm_fraction >= H100.sms
    assert p.steps[1].grid == (1024 // fin,)
    p = plan("batch_norm", (64, 256, 56, 56), "float16", "NHWC")
    assert p.splits > 32 and p.steps[1].grid == (256,)
    # eval with statistics: nothing to merge, a warp a channel
    p = plan("batch_norm", (8, 64, 4, 4), "float32", training=False, return_stats=True)
    assert p.steps[0].grid == (64 // fin,)


def test_planes_splits_keep_32_bit_counts():
    # one channel's run per split must stay below 2^31 packs
    view = bp.ChannelView(2**12, 2, 2**22)
    p = bp.plan_batch_norm("batch_stats", view, "float32", H100)
    per = -(-view.outer // p.splits) * bp.plane_packs(view.inner, p.pack)
    assert per < 2**31


def test_plan_rejects_samples_past_32_bits():
    with pytest.raises(ValueError, match="32-bit"):
        bp.plan_batch_norm("batch_norm", bp.ChannelView(2, 2**17, 2**15), "float16", H100,
                           align_elems=1)


def test_steps_per_op_and_mode():
    kinds = lambda p: [s.kind for s in p.steps]  # noqa: E731
    # one split a channel: the statistics kernel finishes the channels itself
    assert kinds(plan("batch_norm", (8, 16, 4, 4), "float32", tuning=TWO_PASS)) == [
        "stats_planes", "apply"]
    assert kinds(plan("batch_norm", (8, 16, 4, 4), "float32")) == ["train_planes"]
    # 4-byte packs (C * B odd: no spanning pack either): the two passes
    assert kinds(plan("batch_norm", (8, 3, 3, 3), "float32")) == ["stats_planes", "apply"]
    assert kinds(plan("batch_norm", (256, 64, 56, 56), "float32")) == [
        "stats_planes", "finalize", "apply"]
    assert kinds(plan("batch_norm", (65536, 256), "float16")) == [
        "stats_cols", "finalize", "apply"]
    assert kinds(plan("batch_norm", (64, 2048, 7, 7), "float16", tuning=TWO_PASS)) == [
        "stats_planes", "apply"]
    assert kinds(plan("batch_norm", (64, 2048, 8, 8), "float16")) == ["train_planes"]
    assert kinds(plan("batch_norm", (8, 16, 4, 4), "float32", training=False)) == ["apply"]
    assert kinds(plan("batch_norm", (8, 16, 4, 4), "float32", training=False,
                      return_stats=True)) == ["finalize", "apply"]
    assert kinds(plan("batch_norm", (8, 16, 4, 4), "float32", "NHWC", tuning=TWO_PASS)) == [
        "stats_cols", "apply"]
    assert kinds(plan("batch_norm", (8, 16, 4, 4), "float32", "NHWC")) == ["train_cols"]
    assert kinds(plan("batch_norm_backward", (8, 16), "float32")) == ["grad_cols", "dx"]
    assert kinds(plan("batch_norm_backward", (65536, 256), "float32")) == [
        "grad_cols", "grad_finalize", "dx"]
    assert kinds(plan("batch_norm_backward", (256, 64, 56, 56), "float32")) == [
        "grad_planes", "grad_finalize", "dx"]
    assert kinds(plan("batch_stats", (8, 16, 4), "float64")) == ["stats_planes"]
    assert kinds(plan("batch_stats", (4096, 16), "float64")) == ["stats_cols", "finalize"]
    p = plan("batch_norm", (8, 16, 4, 4), "float16", addend=True, relu=True, mask=True,
             tuning=TWO_PASS)
    assert p.steps[-1].kernel == "cukern::batch_norm_apply<cukern::f16, 8, false, true, false>"
    p = plan("batch_norm", (8, 16, 4, 4), "float16", addend=True, relu=True, mask=True)
    assert p.kernel_names() == ("cukern::batch_norm_train_planes<cukern::f16, 8, true>",)
    p = plan("batch_norm_backward", (256, 16, 64, 64), "bfloat16", "NHWC")
    # columns reductions keep bn_cols_reduce_max_pack channels a thread; dx the data's pack
    assert p.pack == 8 and p.steps[0].kernel == "cukern::batch_norm_grad_cols<cukern::bf16, 4>"
    assert p.steps[1].kernel == "cukern::batch_norm_grad_finalize<float>"
    assert p.steps[2].kernel == "cukern::batch_norm_dx<cukern::bf16, 8, true, false>"
    with pytest.raises(ValueError, match="unknown"):
        bp.plan_batch_norm("batch_normal", bp.ChannelView(2, 2, 2), "float32")
    with pytest.raises(ValueError, match="empty"):
        bp.plan_batch_norm("batch_norm", bp.ChannelView(0, 2, 2), "float32")


# ---------------------------------------------------------------------------------------------
# Registry, reachable instantiations and their compilation.

def test_registry_entries():
    for op in OPS:
        spec = registry.get(op)
        assert spec.family == "batch_norm" and not spec.rowwise
        assert spec.source == "batch_norm"
        with pytest.raises(ValueError, match="not a row-wise"):
            registry.policy(op)
    assert registry.get("batch-norm-backward").forward == "batch_norm"
    # the row-wise ops are as they were
    assert registry.get("layer_norm").rowwise and registry.get("softmax").source == "softmax"


def test_reachable_sets_and_counts():
    for device in (H100, A100):
        by = registry.kernel_names(list(OPS), list(DTYPES), device)
        assert set(by) == {"batch_norm"}
        names = by["batch_norm"]
        assert len(names) == 184
        assert len(names) <= 200  # the compile check's budget for the family
    per_dtype = {dt: len(registry.kernel_names(list(OPS), [dt], H100)["batch_norm"])
                 for dt in DTYPES}
    # (stats x2, grad x2) per pack + apply x4 + dx x2 per pack + finalize x2, and the planes
    # kernels (stats, grad, apply x2, dx) again with SPAN for the packs of 8 bytes or more
    # where a narrower pack is under 8 bytes (fp16/bf16: 4, 8; fp32: 2, 4; fp64: none); the
    # one-read training kernels for the dividing packs of 8 bytes or more (planes: with an
    # addend for those of 16; columns: without, as the tuning has it)
    assert per_dtype == {"float16": 4 * 10 + 2 + 2 * 5 + 5, "bfloat16": 4 * 10 + 2 + 2 * 5 + 5,
                         "float32": 3 * 10 + 2 + 2 * 5 + 5, "float64": 2 * 10 + 2 + 5}


def test_reachable_covers_planner_output():
    rnd = random.Random(11)
    for _ in range(300):
        nd = rnd.choice((2, 3, 4, 5))
        shape = tuple(rnd.choice((1, 2, 3, 7, 8, 16, 49, 64, 100)) for _ in range(nd))
        if math.prod(shape) < 2:
            continue
        dtype = rnd.choice(DTYPES)
        op = rnd.choice(OPS)
        layout = rnd.choice(("NCHW", "NHWC"))
        kw = dict(training=rnd.random() < 0.7, relu=rnd.random() < 0.5,
                  addend=rnd.random() < 0.5, mask=rnd.random() < 0.5,
                  return_stats=rnd.random() < 0.5,
                  align_elems=rnd.choice((1, 2, 4, 8, 16)))
        p = plan(op, shape, dtype, layout, **kw)
        reach = fam.kernel_names(op)(dtype)
        assert set(p.kernel_names()) <= reach, (op, shape, dtype, layout, kw)


@pytest.mark.nvrtc("batch_norm")
@pytest.mark.parametrize("arch", list(NVRTC_ARCHS))
def test_every_reachable_instantiation_compiles(arch):
    # every kernel the family's ops can launch, compiled in the background since collection
    # ended (conftest.nvrtc_results)
    device = getattr(DeviceSpec, NVRTC_ARCHS[arch])()  # the device model the check plans for
    lowered = {}
    for source, _, names, result in nvrtc_results("batch_norm", arch):
        assert source == "batch_norm" and set(result) == set(names)
        lowered.update(result)
    for dtype in DTYPES:
        names = registry.kernel_names(list(OPS), [dtype], device)["batch_norm"]
        missing = [n for n in names if not lowered.get(n)]
        assert not missing, (dtype, missing[:3])
        assert len(names) >= 20, dtype


def test_source_inlines_includes_once():
    src = _compile.source("batch_norm")
    assert '#include "' not in src
    assert src.count("struct Welford") == 1
    for kernel in ("batch_norm_stats_planes", "batch_norm_apply", "batch_norm_dx",
                   "__ballot_sync"):
        assert kernel in src


# ---------------------------------------------------------------------------------------------
# explain and argument checks.

def test_explain_batch_norm():
    p = cukern.explain("batch_norm", (64, 256, 56, 56), "float16", layout="NHWC", relu=True,
                       addend=True)
    text = str(p)
    assert "columns" in text and "two-pass" in text and "stats_cols" in text
    assert "addend, relu, mask" in text and "grid" in text and "on chip" in text
    assert p.view == (64 * 56 * 56, 256, 1)
    e = cukern.explain("batch_norm", (64, 256, 56, 56), "float32", training=False)
    assert "one read" in str(e) and [s.kind for s in e.steps] == ["apply"]
    assert "from the running stats" in str(e)
    e = cukern.explain("batch_norm", (64, 256, 56, 56), "float32", training=False, relu=True)
    assert "mask" not in str(e) and "ReLU" in str(e)
    b = cukern.explain("batch_norm_backward", (64, 256), "bfloat16", relu=True, addend=True)
    assert "dy masked" in str(b) and "daddend" in str(b)
    s = cukern.explain("batch_stats", (8, 3, 4, 4), "float64", axis=-3)
    assert s.view == (8, 3, 16)
    # the row-wise ops keep their default axis
    assert cukern.explain("softmax", (4, 8), "float32").cols == 8


@pytest.mark.parametrize("kw,exc,match", [
    (dict(shape=(8,)), ValueError, "at least 2"),
    (dict(axis=4), ValueError, "out of range"),
    (dict(layout="NWHC"), ValueError, "layout"),
    (dict(relu=1), TypeError, "relu"),
    (dict(shape=(0, 3, 4)), ValueError, "empty"),
    (dict(residual=True), ValueError, "addend"),
    (dict(dtype="int32"), TypeError, "not supported"),
])
def test_explain_batch_norm_errors(kw, exc, match):
    args = dict(shape=(8, 3, 4, 4), dtype="float32")
    args.update(kw)
    with pytest.raises(exc, match=match):
        cukern.explain("batch_norm", args.pop("shape"), args.pop("dtype"), **args)


def test_host_arrays_are_refused():
    x = np.zeros((4, 3, 2, 2), np.float32)
    with pytest.raises(TypeError, match="x must be a CuPy array"):
        cukern.batch_norm(x, None, None, training=True)
    with pytest.raises(TypeError, match="x must be a CuPy array"):
        cukern.batch_stats(x)
    with pytest.raises(TypeError, match="x must be a CuPy array"):
        cukern.batch_norm_backward(x, x, None, None)


def test_counts_past_32_bits_are_refused():
    """C * B is checked in packs, and C and B in elements: both are 32-bit kernel arguments."""
    for shape, what in (((2, 2**31 + 8), "C = 2147483656 channels"),
                        ((2, 2, 2**31 + 8), "C = 2 channels of planes of B = 2147483656 elements")):
        with pytest.raises(ValueError, match=f"plan: batch_norm: {what}"):
            cukern.explain("batch_norm", shape, "float16", device=H100)
    assert cukern.explain("batch_norm", (2, 2**31 - 1), "float16", device=H100).view.channels \
        == 2**31 - 1


def test_eps_the_fast_path_takes():
    """The fast path skips the checks only for eps that runner.check_eps accepts for every
    dtype; 1e-50 (0 in float32) or 0 always meets the full checks."""
    from cukern.ops import batch_norm as bn

    def key(eps):
        return bn._fresh_key(None, None, None, None, None, None, 1, True, False, False, 0.1, eps)

    for eps in (1e-50, 1e-40, 0.0, -1e-5, float("nan"), float("inf"), 1e39):
        assert key(eps) is None, eps


def test_arrays_that_are_not_cupy_take_no_fast_path_key():
    """A parameter or dy that is not a CuPy array (a PyTorch tensor beside a CuPy x, say) gives
    no key, before any of its attributes is read: the full path adapts it."""
    from cukern.ops import batch_norm as bn

    class Foreign:  # no dtype, shape, strides or data to read
        pass

    other = Foreign()
    for i in range(4):
        params = [None] * 4
        params[i] = other
        assert bn._fresh_key(None, *params, None, 1, True, False, False, 0.1, 1e-5) is None
    assert bn._backward_key(other, None, None, None, None, None, 1, False, True) is None


def test_view_cache_is_bounded():
    from cukern.ops import batch_norm_args as bn

    for n in range(1, 100_001):  # 100,000 distinct batch sizes
        assert bn._view_of((n, 8, 7, 7), (784, 98, 14, 2), 2, 1) == (n, 8, 49)
    info = bn._view_of.cache_info()
    assert info.maxsize is not None and info.currsize <= info.maxsize


@pytest.mark.gpu
def test_gpu_eps_underflowing_float32_is_refused():
    import cupy as cp

    x = cp.ones((4, 3, 2, 2), cp.float16)
    rm, rv = cp.zeros(3, cp.float32), cp.ones(3, cp.float32)
    cukern.batch_norm(x, rm, rv, eps=1e-5)  # the fast path's entry for this layout
    for _ in range(2):
        with pytest.raises(ValueError, match="batch_norm: eps=1e-50 underflows float32"):
            cukern.batch_norm(x, rm, rv, eps=1e-50)
    x64 = cp.ones((4, 3), cp.float64)
    y = cukern.batch_norm(x64, cp.zeros(3), cp.ones(3), eps=1e-50)  # a normal float64
    assert bool(cp.isfinite(y).all())


# ---------------------------------------------------------------------------------------------
# A GPU smoke check of the kernels' edges (skips without a GPU; the full GPU suite is
# tests/test_batch_norm_gpu.py): pack widths 1..8, planes and columns, mask tails, in-place
# running statistics, the backward through the mask, bitwise determinism.

SMOKE_TOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 2e-5, "float64": 1e-11}


def _order(a: np.ndarray, layout: str) -> tuple[int, ...]:
    """The axes of ``a`` from slowest to fastest in memory for ``layout``."""
    if layout == "NHWC" and a.ndim > 2:
        return (0, *range(2, a.ndim), 1)
    return tuple(range(a.ndim))


def _host(a: np.ndarray, layout: str) -> np.ndarray:
    order = _order(a, layout)
    return np.ascontiguousarray(a.transpose(order)).transpose(
        tuple(int(i) for i in np.argsort(order)))


def _on_gpu(a: np.ndarray, layout: str):
    import cupy as cp

    order = _order(a, layout)
    return cp.asarray(np.ascontiguousarray(a.transpose(order))).transpose(
        tuple(int(i) for i in np.argsort(order)))


def _to_host(a) -> np.ndarray:
    """A CuPy array's values in its logical shape (whatever its layout)."""
    import cupy as cp

    return cp.asnumpy(cp.ascontiguousarray(a))


def _close(got, want, dtype, what):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    err = float(np.max(np.abs(got - want))) / scale if want.size else 0.0
    assert err <= SMOKE_TOL[dtype], (what, err)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,layout", [
    ((4, 3, 5, 7), "NCHW"), ((4, 3, 5, 7), "NHWC"), ((33, 17), "NCHW"), ((64, 24), "NCHW"),
    ((2, 8, 3, 4, 4), "NHWC"), ((3, 16, 7, 7), "NCHW"), ((5, 24, 14, 14), "NCHW"),
    ((2, 40, 28, 28), "NHWC"), ((3, 1, 9, 9), "NCHW"),
    ((16, 8, 32, 32), "NCHW"), ((4096, 40), "NCHW"), ((64, 8, 8, 8), "NHWC")])  # finalize
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_smoke_against_reference(shape, layout, dtype):
    import cupy as cp

    from cukern._io import np_dtype

    rng = np.random.default_rng(sum(shape))
    dt = np_dtype(dtype)
    pdt = np.float64 if dtype == "float64" else np.float32
    nch = shape[1]
    xh = _host((rng.standard_normal(shape) * 2 + 1e2).astype(dt), layout)
    zh = _host(rng.standard_normal(shape).astype(dt), layout)
    dyh = _host(rng.standard_normal(shape).astype(dt), layout)
    wh = (1 + 0.1 * rng.standard_normal(nch)).astype(pdt)
    bh = (0.1 * rng.standard_normal(nch)).astype(pdt)
    rmh, rvh = rng.standard_normal(nch).astype(pdt), (1 + rng.random(nch)).astype(pdt)
    x, z, dy = _on_gpu(xh, layout), _on_gpu(zh, layout), _on_gpu(dyh, layout)
    w, b, rm, rv = (cp.asarray(a) for a in (wh, bh, rmh, rvh))
    rm_ref, rv_ref = rmh.astype(np.float64), rvh.astype(np.float64)
    y, mean, invstd, mask = cukern.batch_norm(x, rm, rv, w, b, training=True, addend=z,
                                              relu=True, return_stats=True)
    yr, meanr, invr, _ = reference.batch_norm(xh, rm_ref, rv_ref, wh, bh, True, addend=zh,
                                              relu=True, return_stats=True)
    assert y.strides == x.strides and y.dtype == x.dtype
    _close(_to_host(y), yr, dtype, "y")
    _close(cp.asnumpy(mean), meanr, "float64" if dtype == "float64" else "float32", "mean")
    _close(cp.asnumpy(invstd), invr, dtype, "invstd")
    _close(cp.asnumpy(rm), rm_ref, dtype, "running_mean")
    _close(cp.asnumpy(rv), rv_ref, dtype, "running_var")
    # the mask is y > 0 of the kernel's own y, in memory order
    assert mask.dtype == np.int32 and mask.shape == (-(-x.size // 32),)
    keep = _to_host(y).astype(np.float64) > 0
    want = reference.pack_mask(np.transpose(keep, _order(xh, layout)))
    assert (cp.asnumpy(mask) == want).all()
    # eval, fused coefficients and with the finalize launch
    ye = cukern.batch_norm(x, rm, rv, w, b, relu=True)
    ye2, me, ie, _ = cukern.batch_norm(x, rm, rv, w, b, relu=True, return_stats=True)
    yer = reference.batch_norm(xh, cp.asnumpy(rm), cp.asnumpy(rv), wh, bh, False, relu=True)
    _close(_to_host(ye), yer, dtype, "y eval")
    assert (_to_host(ye) == _to_host(ye2)).all()
    # backward through the mask
    dx, dw, db, da = cukern.batch_norm_backward(dy, x, mean, invstd, w, mask=mask, addend=True)
    dxr, dwr, dbr, dar = reference.batch_norm_backward(dyh, xh, cp.asnumpy(mean),
                                                       cp.asnumpy(invstd), wh,
                                                       mask=cp.asnumpy(mask), addend=True)
    assert dx.strides == x.strides and da.strides == x.strides
    _close(_to_host(dx), dxr, dtype, "dx")
    _close(cp.asnumpy(dw), dwr, dtype, "dweight")
    _close(cp.asnumpy(db), dbr, dtype, "dbias")
    assert (_to_host(da).astype(np.float64) == dar).all()
    # batch_stats, and bitwise determinism
    m1, v1 = cukern.batch_stats(x)
    m2, v2 = cukern.batch_stats(x)
    assert (cp.asnumpy(m1) == cp.asnumpy(m2)).all() and (cp.asnumpy(v1) == cp.asnumpy(v2)).all()
    ms, vs = reference.batch_stats(xh)
    _close(cp.asnumpy(m1), ms, "float64" if dtype == "float64" else "float32", "batch mean")
    _close(cp.asnumpy(v1), vs, dtype, "batch var")
    dx2 = cukern.batch_norm_backward(dy, x, mean, invstd, w, mask=mask)[0]
    assert (_to_host(dx2) == _to_host(dx)).all()


@pytest.mark.parametrize("shape,dtype,waves", [
    ((64, 64, 112, 112), "float16", True),    # 6.4 M packs: ~6 a thread over 4 waves
    ((16384, 1024), "float32", True),         # 4.2 M packs of 4: ~4 a thread
    ((64, 512, 28, 28), "float16", False),    # 3.2 M packs of 8: ~3 a thread
    ((64, 2048, 7, 7), "float16", False),
    ((64, 2048, 7, 7), "float32", False),
])
def test_columns_elementwise_grid_by_packs_a_thread(shape, dtype, waves):
    # the columns apply pass runs the waves grid where it gives each thread at least PACK /
    # bn_apply_cols_coefs_per_pack packs, else one resident wave of bn_apply_blocks_per_sm_cols
    p = plan("batch_norm", shape, dtype, layout="NHWC", training=False)
    t = HOPPER
    grid = p.steps[-1].grid[0]
    if waves:
        assert grid > H100.sms * 8
    else:
        assert grid <= H100.sms * t.bn_apply_blocks_per_sm_cols


@pytest.mark.parametrize("shape,dtype,one_wave_h200", [
    ((64, 64, 112, 112), "float16", True),    # 6.4 M packs of 8: ~6 a thread over 4 waves
    ((256, 1024, 14, 14), "bfloat16", True),  # ~6
    ((256, 512, 28, 28), "float16", True),    # ~12
    ((256, 64, 112, 112), "float16", False),  # ~24
    ((64, 64, 112, 112), "float32", False),   # 12.8 M packs of 4: ~12 a thread
    ((64, 2048, 7, 7), "float32", True),      # ~1.5: the general rule
])
def test_h200_columns_grid_takes_one_wave_up_to_16_packs_a_thread(shape, dtype, one_wave_h200):
    # the H200's table: 16-bit columns passes take one resident wave where the waves grid
    # gives a thread fewer than bn_apply_cols_few_packs_16bit packs; the H100 keeps its rule
    h200 = DeviceSpec.h200()
    t = bp.tuning_for(h200)
    assert t.bn_apply_cols_few_packs_16bit == 16
    assert bp.tuning_for(H100).bn_apply_cols_few_packs_16bit == 0
    h100 = bp.tuning_for(H100)
    assert dataclasses.replace(t, bn_apply_cols_few_packs_16bit=0, bn_cols_stats_blocks_per_sm=4,
                               bn_cols_grad_waves=2, perm_panel_tiles=0,
                               perm_async_copy=(), perm_flat_rows4=(),
                               norm_bwd_narrow=h100.norm_bwd_narrow,
                               norm_bwd_regs_min_cols_32bit=0,
                               norm_bwd_min_packs_32bit=1, two_packs_max_packs=8,
                               warp_four_packs=(),
                               perm_small_max_bytes=0, perm_small_flat_max_bytes=0) == h100
    for op, kw in (("batch_norm", {"training": False}), ("batch_norm_backward", {})):
        one_wave = h200.sms * t.bn_apply_blocks_per_sm_cols
        g200 = plan(op, shape, dtype, layout="NHWC", device=h200, **kw).steps[-1].grid[0]
        g100 = plan(op, shape, dtype, layout="NHWC", **kw).steps[-1].grid[0]
        if one_wave_h200:
            assert g200 <= one_wave
        else:
            assert g200 > one_wave
        if ITEMSIZE[dtype] == 4 or not one_wave_h200 or shape == (64, 2048, 7, 7):
            assert g200 == g100
        else:
            assert g100 > one_wave  # the H100's waves grid


def test_h200_columns_reductions_take_fewer_blocks():
    # the H200's table: columns statistics grids of one wave of 2 blocks an SM (the H100: 4),
    # so twice the rows a thread and half the partial states
    h200 = DeviceSpec.h200()
    assert bp.tuning_for(h200).bn_cols_stats_blocks_per_sm == 2
    assert bp.tuning_for(H100).bn_cols_stats_blocks_per_sm == 4
    for shape in ((64, 1024, 14, 14), (8, 64, 16, 56, 56)):
        p200 = plan("batch_norm", shape, "float16", "NHWC", device=h200)
        p100 = plan("batch_norm", shape, "float16", "NHWC")
        assert p200.steps[0].kind == p100.steps[0].kind == "stats_cols"
        blocks200 = p200.steps[0].grid[0] * p200.splits
        assert blocks200 <= h200.sms * 2
        assert p200.splits == h200.sms * 2 // p200.steps[0].grid[0]  # whole waves
        assert p200.splits < p100.splits
    # columns gradient sums: one wave of resident blocks there, two on the H100; planes
    # reductions keep bn_reduce_waves
    t200 = bp.tuning_for(h200)
    assert t200.bn_cols_grad_waves == 1 and bp.tuning_for(H100).bn_cols_grad_waves == 2
    for shape in ((4096, 4096), (8, 64, 16, 56, 56)):
        q200 = plan("batch_norm_backward", shape, "float16", "NHWC", device=h200)
        q100 = plan("batch_norm_backward", shape, "float16", "NHWC")
        assert q200.steps[0].kind == q100.steps[0].kind == "grad_cols"
        resident = h200.sms * t200.bn_cols_reduce_blocks_per_sm
        assert q200.steps[0].grid[0] * q200.splits <= resident < q100.steps[0].grid[0] * q100.splits
    planes = plan("batch_norm_backward", (64, 64, 112, 112), "float16", device=h200)
    assert planes.splits == plan("batch_norm_backward", (64, 64, 112, 112), "float16").splits


def test_few_large_planes_split_inside_planes():
    # (2, 8, 2^27 + 3): two planes a channel; splits are ranges of a channel's packs, so the
    # statistics still fill the GPU (and each thread sums far fewer values)
    p = plan("batch_norm", (2, 8, 2**27 + 3), "float16")
    assert p.layout == bp.PLANES and p.splits > 2
    assert p.steps[0].grid[0] * p.splits >= H100.sms
    q = plan("batch_norm_backward", (1, 64, 1024, 1024), "float32")
    assert q.splits > 1


def test_one_read_training_step():
    """Training forward over planes takes the one-read kernel (a block a channel, grid C) where
    the channel's packs (and the addend's) fit bn_one_read_max_bytes and the device's shared
    memory and packs are at least bn_min_pack_bytes and divide B; else, and in every other op
    or layout, the two passes."""
    t = HOPPER
    for shape, dtype, addend, one in [
            ((64, 2048, 7, 7), "float16", False, False),    # packs spanning two planes
            ((64, 2048, 8, 8), "float16", False, True),
            ((64, 1024, 14, 14), "bfloat16", False, True),   # 8-byte packs
            ((64, 1024, 14, 14), "bfloat16", True, False),   # ... with an addend: two passes
            ((64, 256, 14, 14), "float32", True, True),      # 16-byte packs, x and addend
            ((64, 512, 28, 28), "float16", False, True),     # 100352 bytes: the limit
            ((64, 512, 28, 28), "float16", True, False),     # twice that with the addend
            ((64, 256, 56, 56), "float16", False, False),    # 401 KB a channel
            ((64, 2048, 7, 7), "float32", True, False),
            ((64, 2048, 6, 6), "float32", True, True),
            ((8, 3, 3, 3), "float32", False, False)]:        # 4-byte packs
        p = plan("batch_norm", shape, dtype, addend=addend, relu=True, mask=True)
        assert p.one_read == one, (shape, dtype, addend)
        if not one:
            assert [s.kind for s in p.steps][-1] == "apply"
            continue
        (step,) = p.steps
        a, c, b = p.view
        packs = a * bp.plane_packs(b, p.pack)
        assert step.smem == packs * p.pack * ITEMSIZE[dtype] * (2 if addend else 1)
        assert step.smem <= t.bn_one_read_max_bytes and p.pack * ITEMSIZE[dtype] >= (
            t.bn_one_read_min_pack_bytes_addend if addend else t.bn_min_pack_bytes)
        assert step.grid == (c,) and step.block[0] % 32 == 0
        assert 64 <= step.block[0] <= t.bn_one_read_max_threads
        assert step.targs == (dtype, p.pack, addend) and b % p.pack == 0
        assert step.kernel == fam.name_expression(step)
        text = str(p)
        assert "one read" in text and f"{step.smem} bytes" in text and "two-pass" not in text
    # 512 threads where shared memory leaves two blocks an SM or fewer (100 KB channels)
    assert plan("batch_norm", (64, 512, 28, 28), "float16").steps[0].block == (512,)
    assert plan("batch_norm", (64, 1024, 14, 14), "float16").steps[0].block == (256,)
    assert plan("batch_norm", (64, 1024, 14, 14), "float32").steps[0].block == (256,)
    assert plan("batch_norm", (64, 1024, 14, 14), "float32", addend=True).steps[0].block == (512,)
    # eval, the backward, batch_stats: never (columns: test_batch_norm_cols_cpu.py)
    assert not plan("batch_norm", (64, 2048, 8, 8), "float16", training=False).one_read
    for op in ("batch_norm_backward", "batch_stats"):
        assert not plan(op, (64, 2048, 8, 8), "float16").one_read
    # the tuning's limit, and a device whose opt-in shared memory is smaller than the channel
    assert not plan("batch_norm", (64, 2048, 8, 8), "float16", tuning=TWO_PASS).one_read
    big = dataclasses.replace(HOPPER, bn_one_read_max_bytes=1 << 20)
    assert plan("batch_norm", (128, 64, 28, 28), "float16", tuning=big).one_read  # 196 KiB
    t4 = DeviceSpec.t4()
    assert not plan("batch_norm", (128, 64, 28, 28), "float16", device=t4, tuning=big).one_read
    assert not plan("batch_norm", (64, 256, 56, 56), "float16", tuning=big).one_read  # 392 KiB


def _one_read_mask_model(view, pack, threads, kept):
    """Emulates batch_norm_train_planes' mask writes (bn::PlaneWalk, bn::or_mask_bits): block c
    walks its channel's packs j = j0 + thread; each warp ORs its lanes' bits word by word (a
    segmented OR over shuffles up, word indices compared in 32 bits) and each segment's last
    lane ORs the word into memory. ``kept[e]``: element e's bit. Returns (the mask words, the
    atomics each word took)."""
    a, c, b = view
    w = b // pack
    words = np.zeros(-(-a * c * b // 32), np.uint32)
    hits = np.zeros_like(words, dtype=np.int64)
    length = a * w
    for ch in range(c):
        for j0 in range(0, length, threads):
            for warp0 in range(j0, j0 + threads, 32):
                lanes = []
                for j in range(warp0, warp0 + 32):
                    if j < length:
                        plane, k = divmod(j, w)
                        e = ((plane * c + ch) * w + k) * pack
                        bits = sum(int(kept[e + i]) << i for i in range(pack))
                        word = (bits << (e & 31)) & 0xFFFFFFFF
                        lanes.append((True, e, word, (e >> 5) & 0xFFFFFFFF))
                    else:
                        lanes.append((False, 0, 0, 0xFFFFFFFF - (j - warp0)))
                acc = [v for _, _, v, _ in lanes]
                off = 1
                while off < 32 // pack:  # Hillis-Steele steps, all lanes reading the old values
                    acc = [acc[i] | (acc[i - off] if i >= off and lanes[i - off][3] == lanes[i][3]
                                     else 0) for i in range(32)]
                    off *= 2
                for i, (active, e, _, wi) in enumerate(lanes):
                    last = i == 31 or lanes[i + 1][3] != wi
                    if active and last and acc[i]:
                        words[e >> 5] |= acc[i]
                        hits[e >> 5] += 1
    return words, hits


@pytest.mark.parametrize("shape,pack,threads", [
    ((3, 5, 36), 4, 64), ((2, 3, 40), 8, 64), ((4, 7, 12), 4, 64), ((3, 2, 64), 2, 64),
    ((5, 3, 100), 4, 128), ((2, 9, 8), 8, 64), ((6, 4, 2), 2, 64), ((2, 1, 200), 8, 64),
])
def test_one_read_mask_words_model(shape, pack, threads):
    """Every element's bit lands in its word (bit i of word k = element 32 k + i) whatever
    the planes' offsets within words, bits past the end stay 0, and a word takes at most one
    atomic for each warp holding part of it (one where a single warp holds it)."""
    rng = np.random.default_rng(7)
    a, c, b = shape
    n = a * c * b
    kept = rng.random(n) < 0.5
    words, hits = _one_read_mask_model(bp.ChannelView(a, c, b), pack, threads, kept)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    np.testing.assert_array_equal(bits[:n].astype(bool), kept)
    assert not bits[n:].any()
    # one atomic for each (channel, warp) holding part of a word: one for a word a warp holds
    w = b // pack
    for k in np.flatnonzero(words):
        holders = set()
        for e in range(32 * k, min(32 * k + 32, n)):
            a_idx, ch = divmod(e // b, c)
            holders.add((ch, (a_idx * w + (e % b) // pack) // 32))
        assert hits[k] <= len(holders), (k, hits[k], holders)
        assert len(holders) > 1 or hits[k] == 1


def test_one_read_tuning_is_checked_and_tuned_restores():
    """A block size past the kernel's launch bound is refused, naming the field; ``tuned``
    plans with changed fields inside its block only."""
    from cukern.ops import batch_norm as obn

    bad = dataclasses.replace(HOPPER, bn_one_read_max_threads=1024)
    with pytest.raises(ValueError, match="bn_one_read_max_threads 1024.*at most 512"):
        plan("batch_norm", (64, 512, 28, 28), "float16", tuning=bad)
    shape = (64, 512, 28, 28)
    assert cukern.explain("batch_norm", shape, "float16", training=True, device="h100").one_read
    with obn.tuned(bn_one_read_max_bytes=0):
        assert not cukern.explain("batch_norm", shape, "float16", training=True,
                                  device="h100").one_read
    assert cukern.explain("batch_norm", shape, "float16", training=True, device="h100").one_read

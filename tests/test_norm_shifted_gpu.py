"""Layer norm and RMS norm forward over rows off the 16-byte grid (Plan.shifted): rows whose
length or start is not a multiple of 16 bytes read and write 16-byte packs of memory, each
row's end packs masked, and gamma and beta shifted to each row in registers. Every variant
they reach, every switch, views at every offset of a 16-byte word with the elements around
them left alone, parameters at odd offsets, and the launch caches told apart by each array's
offset."""

from __future__ import annotations

import numpy as np
import pytest

import cukern
from cukern import reference
from cukern.ops import layer_norm as ln_mod
from cukern.plan import CLUSTER_SIZES, Variant, max_dynamic_smem
from cukern.registry import policy

from . import test_layer_norm_gpu as lng
from .conftest import DTYPES, TOL, cluster_tail

cp = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("warm_layer_norm")]


def off_grid_shapes(op, dtype):
    """(shape, expected variant) of rows off the grid: warp rows of 32 values a lane, blocks,
    clusters, and past what a cluster caches (the uncached kernel, in narrow packs)."""
    dev, per_col = lng.spec(), lng.smem_per_col(op, dtype, False)
    edge = (max_dynamic_smem(dev) - policy(op).smem_align) // per_col
    wide = 16 // lng.ITEM[dtype]
    shapes = [((5, 769), Variant.WARP), ((7, 1001), Variant.WARP), ((3, 1017), Variant.WARP),
              # warp rows whose packs would span more than the warp holds: a block
              ((6, 1023), Variant.BLOCK_SMEM if wide > 2 else Variant.WARP),
              ((3, 1031), Variant.BLOCK_SMEM), ((4, 4099), Variant.BLOCK_SMEM),
              ((3, edge // 2 + 1), Variant.BLOCK_SMEM)]
    if wide > 2 and policy(op).shifted_half_warps:  # 32 values a lane, half of them empty
        shapes.append(((9, 511), Variant.WARP))
    if dev.has_clusters:
        tail = cluster_tail(op, dtype, 1024)
        slice_edge = (max_dynamic_smem(dev) - policy(op).smem_align - tail) // per_col
        shapes += [((2, edge + 3), Variant.CLUSTER),
                   ((3, 5 * edge // 2 // wide * wide + 1), Variant.CLUSTER),
                   ((2, CLUSTER_SIZES[-1] * (slice_edge // wide) * wide - wide - 1),
                    Variant.CLUSTER),
                   ((2, CLUSTER_SIZES[-1] * edge + 64 * wide + 3), Variant.BLOCK_UNCACHED)]
    return shapes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", lng.FWD)
def test_rows_off_the_grid_every_variant_and_switch(op, dtype, rng):
    """Poisoned fresh outputs against float64, statistics and h included: the planned variant
    takes 16-byte shifted packs (one row a pass; the uncached kernel narrow packs)."""
    seen = set()
    for shape, variant in off_grid_shapes(op, dtype):
        cols = shape[-1]
        for weight, bias, residual in lng.combos(op):
            x = lng.make(shape, dtype, rng)
            w = lng.make(cols, dtype, rng, 1.0, 1.0) if weight else None
            b = lng.make(cols, dtype, rng, 1.0, 0.0) if bias else None
            r = lng.make(shape, dtype, rng) if residual else None
            lng.check_forward(op, x, cols, w, b, r, dtype)
            plan = ln_mod.last_plan(op)
            where = (shape, weight, bias, residual, plan)
            # a residual lets a block kernel overlap its rows and a lone block stay a block
            want = (variant, Variant.CLUSTER) if variant is Variant.BLOCK_SMEM else (variant,)
            assert plan.variant in want, where
            uncached = plan.variant is Variant.BLOCK_UNCACHED
            assert plan.shifted is not uncached, where
            if plan.shifted:
                assert plan.pack_size * lng.ITEM[dtype] == 16 and plan.rows_per_pass == 1, where
                seen.add((plan.variant, plan.overlap))
    want = {(Variant.WARP, False), (Variant.BLOCK_SMEM, False)}
    if lng.spec().has_clusters:
        want |= {(Variant.CLUSTER, False), (Variant.CLUSTER, True)}
    assert want <= seen, seen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", lng.FWD)
def test_rows_off_the_grid_leave_their_neighbours(op, dtype, rng):
    """Views whose rows start at every offset of a 16-byte word (row stride cols + 5, first
    column 3), weight and bias at their own odd offsets: out= at the rows' offsets takes the
    shifted packs and the elements around its rows keep their sentinel; out= one element
    further on cannot, and is right too. The statistics of the first call are the second's."""
    dt = lng.np_dtype(dtype)
    layer = op == "layer_norm"
    for cols in (777, 1001, 6007, 70001):
        width = cols + 5
        base = lng.make((9, width), dtype, rng)
        x = cp.asarray(base)[:, 3:3 + cols]
        hx = base[:, 3:3 + cols]
        wbase, bbase = lng.make(cols + 8, dtype, rng, 1.0, 1.0), lng.make(cols + 8, dtype, rng)
        w, hw = cp.asarray(wbase)[1:1 + cols], wbase[1:1 + cols]
        b, hb = cp.asarray(bbase)[3:3 + cols], bbase[3:3 + cols]
        if layer:
            ref = reference.layer_norm(hx, cols, hw, hb, 1e-5)
            args = (x, cols, w, b, 1e-5)
        else:
            ref = reference.rms_norm(hx, cols, hw, 1e-6)
            args = (x, cols, w, 1e-6)
        sentinel = np.asarray(7.5, dt)
        for start, shifted in ((3, True), (4, False)):
            big = cp.full((9, width), sentinel, dtype=dt)
            out = big[:, start:start + cols]
            getattr(cukern, op)(*args, out=out)
            assert ln_mod.last_plan(op).shifted is shifted, (cols, start)
            err = lng.rel_err(out, ref)
            assert err <= TOL[dtype], f"{op} {dtype} cols={cols} start={start}: {err:.3g}"
            around = cp.asnumpy(big).astype(np.float64)
            around[:, start:start + cols] = float(sentinel)
            assert (around == float(sentinel)).all(), (cols, start)


@pytest.mark.parametrize("op", lng.FWD)
def test_launch_caches_tell_offsets_apart(op, rng):
    """x at offset 0 with a weight at offset 2 bytes, then x at offset 2 with a weight at 0:
    the same shapes, strides and OR of the offsets. The first plan (x and y at one offset:
    shifted packs, gamma shifted in the kernel) must not serve the second (x and y apart:
    narrow packs), neither through the fast path nor the full path's launch cache."""
    rows, cols = 6, 1001
    flat = cp.asarray(lng.make(rows * cols + 8, "float16", rng))
    wflat = cp.asarray(lng.make(cols + 8, "float16", rng, 1.0, 1.0))
    cases = [(flat[:rows * cols], wflat[1:1 + cols], True),
             (flat[1:1 + rows * cols], wflat[:cols], False)]
    for out_given in (False, True):
        ln_mod._fresh.clear()
        ln_mod._launches.clear()
        for xf, w, shifted in cases:
            x = xf.reshape(rows, cols)
            assert x.strides == (2 * cols, 2) and w.strides == (2,)
            hx, hw = cp.asnumpy(x), cp.asnumpy(w)
            ref = reference.layer_norm(hx, cols, hw) if op == "layer_norm" else \
                reference.rms_norm(hx, cols, hw)
            if out_given:
                y = cp.full((rows, cols), np.nan, dtype=np.float16)
                getattr(cukern, op)(x, cols, w, out=y)
            else:
                y = getattr(cukern, op)(x, cols, w)
            assert ln_mod.last_plan(op).shifted is shifted, (out_given, shifted)
            assert lng.rel_err(y, ref) <= TOL["float16"], (out_given, shifted)

"""Layer norm and RMS norm on the GPU against float64 NumPy: every variant x dtype x op x
(affine, residual) at its edge shapes, forward and backward; dweight/dbias over many rows;
constant rows; large offsets; views; empty arrays; DLPack hand-offs; bad input."""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest

import cukern
from cukern import reference, runner
from cukern.families import norm
from cukern.ops import layer_norm as ln_mod
from cukern.plan import CLUSTER_SIZES, MAX_COLS, Switches, Variant, max_dynamic_smem
from cukern.plan.rowwise import shifted_cols
from cukern.registry import policy

from .conftest import DTYPES, TOL, cluster_tail, col_sums_expected

cp = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("warm_layer_norm")]

FWD = ("layer_norm", "rms_norm")
BWD = ("layer_norm_backward", "rms_norm_backward")
ITEM = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
# Statistics are float32 (float64 for float64 input) whatever the input: their own tolerance.
STAT_TOL = {"float16": 1e-5, "bfloat16": 1e-5, "float32": 1e-5, "float64": 1e-12}


def np_dtype(name):
    if name == "bfloat16":
        from ml_dtypes import bfloat16

        return np.dtype(bfloat16)
    return np.dtype(name)


def stat_dtype(name):
    return np.float64 if name == "float64" else np.float32


def host(a) -> np.ndarray:
    return cp.asnumpy(a).astype(np.float64) if isinstance(a, cp.ndarray) else np.asarray(a)


def rel_err(out, ref, scale=None) -> float:
    """||out - ref|| / ||ref|| (or / scale), with NaN patterns required to match."""
    got = host(out)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.array_equal(np.isnan(got), np.isnan(ref)), "NaN pattern differs (unwritten output?)"
    num = np.linalg.norm((got - ref).ravel())
    den = np.linalg.norm(ref.ravel()) if scale is None else scale
    return float(num / den) if den else float(num)


def poison(*arrays_like) -> None:
    """Return NaN-filled memory to CuPy's pool, sized like the outputs about to be allocated
    (and one large block the pool splits for anything else), so that an output element a kernel
    fails to write shows up as NaN. 0xFF bytes are NaN in every float format."""
    blocks = [cp.full(int(np.prod(shape)) * item + 1, 255, cp.uint8)
              for shape, item in arrays_like]
    blocks.append(cp.full(64 << 20, 255, cp.uint8))
    del blocks


def spec():
    return cukern.DeviceSpec.from_device()


def smem_per_col(op, dtype, weight):
    sums = policy(op).col_sums if weight else 0
    return ITEM[dtype] * policy(op).inputs + sums * (8 if dtype == "float64" else 4)


def col_sums_shapes(op, dtype):
    """(shape, expected variant) for a backward with a weight on this device: every way its
    column sums are planned (registers or shared memory, one or two buffers, block or cluster,
    packs of one element, or of 8 bytes in 16-bit types: 6500 and 14500 columns), by
    conftest.col_sums_expected."""
    shapes = [((1, 1), Variant.WARP), ((7, 33), Variant.WARP), ((5, 512), Variant.WARP),
              ((5, 513), Variant.BLOCK_SMEM), ((5, 1024), Variant.BLOCK_SMEM)]

    occ = runner.driver_occupancy(0)
    for cols in (1025, 2048, 5001, 6500, 12288, 14500, 16384, 18000, 20001, 32768, 36000, 65536,
                 70000, 10**5 + 3, 160000, 300000):
        way = col_sums_expected(op, dtype, cols, spec(), occ)
        variant = Variant.BLOCK_UNCACHED
        if way is not None:
            variant = Variant.BLOCK_SMEM if way[0] == 1 else Variant.CLUSTER
        shapes.append(((3, cols), variant))
    return shapes


# The expected variant of a row that one block's shared memory holds alone on its SM, for an op
# that then prefers a cluster whose blocks share SMs (OpPolicy.split_lone_blocks): check_lone.
LONE = "lone block"


def check_lone(plan, residual):
    """A row at the shared-memory edge: a block alone on its SM. With a residual (which lets
    the block overlap its rows) or without clusters it stays; else it goes to a cluster whose
    blocks share SMs where one launches, and says why."""
    wanted = (Variant.BLOCK_SMEM,) if residual or not spec().has_clusters else \
        (Variant.BLOCK_SMEM, Variant.CLUSTER)
    assert plan.variant in wanted, plan
    assert (plan.variant is Variant.CLUSTER) == any("alone on its SM" in n for n in plan.notes)


def variant_shapes(op, dtype, weight=False):
    """(shape, expected variant or None) on this device: every regime, its edges, and the
    issue's edge columns 1, 2, 31, 33, 1023, 1024, 1025 and 10**5 + 3."""
    edge = (max_dynamic_smem(spec()) - policy(op).smem_align) // smem_per_col(op, dtype, weight)
    # a forward cluster block's slice beside its reduction buffers (the widest block's)
    tail = cluster_tail(op, dtype, 1024) if op in FWD else 0
    slice_edge = (max_dynamic_smem(spec()) - policy(op).smem_align - tail) // \
        smem_per_col(op, dtype, weight)
    wide = 16 // ITEM[dtype]
    at_edge = LONE if policy(op).split_lone_blocks else Variant.BLOCK_SMEM
    shapes = [((1, 1), Variant.WARP), ((2, 1), Variant.WARP), ((7, 2), Variant.WARP),
              ((8, 31), Variant.WARP), ((9, 32), Variant.WARP), ((10, 33), Variant.WARP),
              ((5, 64), Variant.WARP), ((6, 24), Variant.WARP), ((7, 40), Variant.WARP),
              ((300, 100), Variant.WARP), ((3, 768), Variant.WARP),
              # 16-byte packs: 9, 17 and 32 a row (the H200's two packs a lane, padded or not)
              ((5, 9 * wide), Variant.WARP), ((4, 17 * wide), Variant.WARP),
              ((3, 32 * wide), Variant.WARP),
              # a forward row of 1023 in 16-byte shifted packs spans more than the warp kernel
              # holds (OpPolicy.shifted_past_warp): the block kernel
              ((3, 1023), Variant.BLOCK_SMEM if policy(op).shifted_past_warp and wide > 2
               else Variant.WARP), ((4, 1024), Variant.WARP),
              ((3, 1025), Variant.BLOCK_SMEM), ((6, 4096), Variant.BLOCK_SMEM),
              ((3, edge // wide * wide), at_edge)]
    # a forward row of edge - 1 off the 16-byte grid is sized for the packs it may span
    # (Plan.shifted): past the edge, a cluster where there are clusters
    span = shifted_cols(edge - 1, wide) if policy(op).shifted_rows and (edge - 1) % wide \
        else edge - 1
    shapes.append(((2, edge - 1), at_edge if span <= edge or not spec().has_clusters
                   else Variant.CLUSTER))
    if spec().has_clusters:
        shapes += [((2, (edge // wide + 1) * wide), Variant.CLUSTER),
                   ((3, 3 * edge // wide * wide), Variant.CLUSTER),
                   ((2, 8 * (edge // wide) * wide), Variant.CLUSTER),
                   ((2, CLUSTER_SIZES[-1] * (slice_edge // wide) * wide), Variant.CLUSTER),
                   ((2, CLUSTER_SIZES[-1] * edge + 64 * wide), Variant.BLOCK_UNCACHED)]
    else:
        shapes += [((2, edge + 64 * wide), Variant.BLOCK_UNCACHED)]
    shapes += [((2, 10**5 + 3), None)]
    return shapes


def combos(op):
    """(weight, bias, residual) switch combinations of a forward op."""
    return [(s.weight, s.bias, s.residual) for s in policy(op).switch_sets]


def make(shape, dtype, rng, scale=2.0, shift=0.5):
    dt = np_dtype(dtype)
    return (rng.standard_normal(shape) * scale + shift).astype(dt)


# ---------------------------------------------------------------------------------------------
# Forward.

def check_forward(op, x, ns, w, b, r, dtype, eps=None):
    """Run op on x (a host array of dtype) with NaN-poisoned fresh outputs; compare y, the
    statistics and h with the float64 reference."""
    layer = op == "layer_norm"
    eps = eps if eps is not None else (1e-5 if layer else 1e-6)
    kw = {"residual": r, "return_stats": True}
    if layer:
        ref = reference.layer_norm(x, ns, w, b, eps, **kw)
        args = (cp.asarray(x), ns, None if w is None else cp.asarray(w),
                None if b is None else cp.asarray(b), eps)
    else:
        ref = reference.rms_norm(x, ns, w, eps, **kw)
        args = (cp.asarray(x), ns, None if w is None else cp.asarray(w), eps)
    k = 1 if np.isscalar(ns) else len(ns)
    lead = x.shape[:x.ndim - k]
    item = ITEM[dtype]
    poison((x.shape, item), (x.shape, item), (lead, 8), (lead, 8))
    got = getattr(cukern, op)(*args, residual=None if r is None else cp.asarray(r),
                              return_stats=True)
    assert len(got) == len(ref)
    y, y_ref = got[0], ref[0]
    assert y.dtype == np_dtype(dtype) and y.shape == x.shape
    where = f"{op} {dtype} {x.shape} w={w is not None} b={b is not None} r={r is not None}"
    # The statistics of a row of n values carry rounding that grows like sqrt(n): TOL holds
    # for rows up to 2^18 values, and grows with that beyond. (The uncached kernel's float32
    # Welford means over 921344 columns: y's rel err 1.1e-6 on average, 2.3e-6 at worst over
    # 12 seeds, on the H100; 2e-6 failed one seed in the suite.)
    tol = TOL[dtype] * max(1.0, (math.prod(x.shape[x.ndim - k:]) / 2**18) ** 0.5)
    assert rel_err(y, y_ref) <= tol, f"{where}: y rel err {rel_err(y, y_ref):.3g} > {tol:.3g}"
    rstd, rstd_ref = got[2 if layer else 1], ref[2 if layer else 1]
    assert rstd.dtype == stat_dtype(dtype) and rstd.shape == lead
    assert rel_err(rstd, rstd_ref) <= STAT_TOL[dtype], f"{where}: rstd"
    if layer:
        mean = got[1]
        assert mean.dtype == stat_dtype(dtype) and mean.shape == lead
        # the mean's error against its own size or the row's standard deviation, whichever is
        # larger: far from zero a float32 mean is only as exact as float32 (x = 1e4 + noise)
        size = np.abs(ref[1]) + 1 / np.minimum(rstd_ref, 1e6)
        dev = np.abs(host(mean) - ref[1]) / size
        assert np.all(dev <= STAT_TOL[dtype]), f"{where}: mean off by {dev.max():.3g}"
    if r is not None:
        h = got[-1]
        assert h.dtype == np_dtype(dtype) and h.shape == x.shape
        np.testing.assert_array_equal(host(h), ref[-1], err_msg=f"{where}: h")
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", FWD)
def test_forward_every_variant_and_switch(op, dtype, rng):
    for shape, variant in variant_shapes(op, dtype):
        cols = shape[-1]
        for weight, bias, residual in combos(op):
            x = make(shape, dtype, rng)
            w = make(cols, dtype, rng, 1.0, 1.0) if weight else None
            b = make(cols, dtype, rng, 1.0, 0.0) if bias else None
            r = make(shape, dtype, rng) if residual else None
            check_forward(op, x, cols, w, b, r, dtype)
            plan = ln_mod.last_plan(op)
            assert plan.switches == Switches(weight, bias, residual)
            if variant is LONE:
                check_lone(plan, residual)
            elif variant is not None:
                assert plan.variant is variant, (shape, plan)


def test_repeated_calls_take_the_fast_path(rng, monkeypatch):
    """A call matching an earlier validated one skips validation and planning: same results,
    fresh outputs; anything that differs (dtypes, eps's type, layouts) is checked again."""
    monkeypatch.setattr(ln_mod, "_fresh", {})
    x = cp.asarray(make((64, 3000), "float16", rng))
    w = cp.asarray(make(3000, "float16", rng, 1.0, 1.0))
    b = cp.asarray(make(3000, "float16", rng))
    first = cukern.layer_norm(x, 3000, w, b, return_stats=True)
    assert len(ln_mod._fresh) == 1
    again = cukern.layer_norm(x, 3000, w, b, return_stats=True)
    assert len(ln_mod._fresh) == 1
    for a, c in zip(first, again):
        assert a.data.ptr != c.data.ptr
        np.testing.assert_array_equal(host(a), host(c))
    y, rstd = cukern.rms_norm(x, (3000,), w, return_stats=True)
    y2 = cukern.rms_norm(x, (3000,), w)  # y alone by default
    assert isinstance(y2, cp.ndarray)
    np.testing.assert_array_equal(host(y), host(y2))
    with pytest.raises(TypeError, match="eps"):
        cukern.layer_norm(x, 3000, w, b, eps=True)
    with pytest.raises(TypeError, match="normalized_shape"):
        cukern.layer_norm(x, True, w, b)
    with pytest.raises(TypeError, match="weight"):
        cukern.layer_norm(x, 3000, w.astype(cp.float32), b)
    # a weight that needs a contiguous copy is never cached, and still right
    wide = cp.asarray(make(6000, "float16", rng, 1.0, 1.0))
    before = len(ln_mod._fresh)
    check = cukern.layer_norm(x, 3000, wide[::2], b)
    assert len(ln_mod._fresh) == before
    ref = cukern.layer_norm(x, 3000, cp.ascontiguousarray(wide[::2]), b, return_stats=True)
    np.testing.assert_array_equal(host(check), host(ref[0]))
    assert len(ln_mod._fresh) == before  # first's key: the strided weight added no entry
    # backward: the same gradients twice
    dy = cp.asarray(make((64, 3000), "float16", rng))
    _, mean, rstd = first
    g1 = cukern.layer_norm_backward(dy, x, mean, rstd, w)
    g2 = cukern.layer_norm_backward(dy, x, mean, rstd, w)
    for a, c in zip(g1, g2):
        np.testing.assert_array_equal(host(a), host(c))
    ref = reference.layer_norm_backward(host(dy), host(x), host(mean), host(rstd), host(w))
    for got, r in zip(g2, ref):
        assert rel_err(got, r) <= TOL["float16"]
    with pytest.raises(TypeError, match="rstd"):
        cukern.layer_norm_backward(dy, x, mean, rstd.astype(cp.float64), w)


def test_forward_return_forms(rng):
    x = cp.asarray(make((6, 40), "float32", rng))
    r = cp.asarray(make((6, 40), "float32", rng))
    y = cukern.layer_norm(x, 40, return_stats=False)
    assert isinstance(y, cp.ndarray) and y.shape == (6, 40)
    y2, h = cukern.layer_norm(x, 40, residual=r, return_stats=False)
    np.testing.assert_allclose(host(y2), host(cukern.layer_norm(x + r, 40)), rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_array_equal(host(h), host(x + r))
    y3, rstd3, h3 = cukern.rms_norm(x, (40,), residual=r, return_stats=True)
    assert rstd3.shape == (6,) and y3.shape == h3.shape == (6, 40)
    y4 = cukern.rms_norm(x, 40, return_stats=False)
    assert isinstance(y4, cp.ndarray)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", FWD)
def test_forward_uncached_at_short_rows(op, dtype, rng, monkeypatch):
    """The uncached kernel on ordinary rows, by making the block kernels unlaunchable."""
    monkeypatch.setattr(runner, "driver_occupancy", lambda dev: (lambda plan: 0))
    monkeypatch.setattr(ln_mod, "_launches", {})
    monkeypatch.setattr(ln_mod, "_fresh", {})
    for shape in [(3, 1025), (5, 4097), (2, 20000)]:
        for weight, bias, residual in combos(op):
            x = make(shape, dtype, rng)
            cols = shape[-1]
            w = make(cols, dtype, rng, 1.0, 1.0) if weight else None
            b = make(cols, dtype, rng) if bias else None
            r = make(shape, dtype, rng) if residual else None
            check_forward(op, x, cols, w, b, r, dtype)
            assert ln_mod.last_plan(op).variant is Variant.BLOCK_UNCACHED


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", FWD)
def test_forward_blocks_loop_over_rows(op, dtype, rng, monkeypatch):
    """Grids of two blocks (or two clusters) over 9 rows, so that each loops over rows: the
    cached kernels' row loops, both ways with a residual (blocks that take turns, and blocks
    that load their next row while they write this one: Plan.overlap). Odd columns take
    shifted 16-byte packs, and packs of one element where the arrays' rows would start at
    other offsets (forced); the rest end in partial strides of the block."""
    from dataclasses import replace

    planned = runner.plan_for
    overlap = [False]
    narrow = [False]
    same_offsets = runner.same_offsets
    monkeypatch.setattr(runner, "same_offsets", lambda *a: not narrow[0] and same_offsets(*a))

    def two_groups(*args, **kwargs):
        plan = planned(*args, **kwargs)
        if plan.variant is Variant.BLOCK_SMEM and plan.switches.residual:
            plan = replace(plan, overlap=overlap[0])
        if plan.variant in (Variant.BLOCK_SMEM, Variant.CLUSTER):
            plan = replace(plan, grid=2 * plan.cluster)
        return plan

    monkeypatch.setattr(runner, "plan_for", two_groups)
    monkeypatch.setattr(ln_mod, "_launches", {})
    monkeypatch.setattr(ln_mod, "_fresh", {})
    edge = (max_dynamic_smem(spec()) - policy(op).smem_align) // smem_per_col(op, dtype, False)
    wide = 16 // ITEM[dtype]
    cases = [(1025, Variant.BLOCK_SMEM), (4104, Variant.BLOCK_SMEM), (edge // wide * wide, LONE)]
    if spec().has_clusters:
        cases += [((edge // wide + 1) * wide, Variant.CLUSTER),
                  (3 * (edge // wide) * wide + 1, Variant.CLUSTER)]
    for (cols, variant), weight, bias, residual, narrow[0] in (
            (case, *switches, n) for case in cases for switches in combos(op)
            for n in ((False, True) if case[0] % 2 else (False,))):
        for overlap[0] in ((False, True) if residual else (False,)):
            ln_mod._launches.clear()  # plan afresh: the launch cache knows nothing of overlap
            ln_mod._fresh.clear()
            x = make((9, cols), dtype, rng)
            w = make(cols, dtype, rng, 1.0, 1.0) if weight else None
            b = make(cols, dtype, rng, 1.0, 0.0) if bias else None
            r = make((9, cols), dtype, rng) if residual else None
            check_forward(op, x, cols, w, b, r, dtype)
            plan = ln_mod.last_plan(op)
            if variant is LONE:
                check_lone(plan, residual)
            else:
                assert plan.variant is variant, plan
            assert plan.shifted is (cols % 2 == 1 and not narrow[0]), plan
            assert plan.grid == 2 * plan.cluster, plan
            # clusters overlap their rows exactly when there is a residual
            want = overlap[0] if plan.variant is Variant.BLOCK_SMEM else residual
            assert plan.overlap is want, plan


@pytest.mark.parametrize("dtype", ("float16", "bfloat16", "float32"))
@pytest.mark.parametrize("op", FWD)
def test_residual_clusters_prefetch_rows_of_their_own_strides(op, dtype, rng):
    """The planned clusters with a residual at 262144 columns (rows overlapped, 16-byte packs:
    each block prefetches a quarter of its slice of the next row into L2 while the cluster
    merges, norm_rows' PREFETCH; float32 also loads its first gamma and beta then) over more
    rows than clusters, so that every cluster loops, on x and a residual that are views with
    row strides of their own: y, the statistics and h against float64 NumPy."""
    if not spec().has_clusters:
        pytest.skip("needs thread-block clusters (sm_90)")
    rows, cols = 47, 262144
    layer = op == "layer_norm"
    hx = make((rows, cols + 64), dtype, rng)
    hr = make((rows, cols + 128), dtype, rng)
    w = make(cols, dtype, rng, 1.0, 1.0)
    b = make(cols, dtype, rng) if layer else None
    xs, rs = hx[:, 8:8 + cols], hr[:, 16:16 + cols]
    dx, dr = cp.asarray(hx)[:, 8:8 + cols], cp.asarray(hr)[:, 16:16 + cols]
    poison(((rows, cols), ITEM[dtype]), ((rows, cols), ITEM[dtype]), ((rows,), 8), ((rows,), 8))
    if layer:
        ref = reference.layer_norm(xs, cols, w, b, 1e-5, residual=rs, return_stats=True)
        got = cukern.layer_norm(dx, cols, cp.asarray(w), cp.asarray(b), 1e-5, residual=dr,
                                return_stats=True)
    else:
        ref = reference.rms_norm(xs, cols, w, 1e-6, residual=rs, return_stats=True)
        got = cukern.rms_norm(dx, cols, cp.asarray(w), 1e-6, residual=dr, return_stats=True)
    plan = ln_mod.last_plan(op)
    assert plan.variant is Variant.CLUSTER and plan.overlap, plan
    assert plan.pack_size * ITEM[dtype] == 16, plan
    assert rows > plan.grid // plan.cluster, plan  # every cluster takes two rows or more
    assert rel_err(got[0], ref[0]) <= TOL[dtype]
    assert rel_err(got[-2], ref[-2]) <= STAT_TOL[dtype]  # rstd
    if layer:
        assert rel_err(got[1], ref[1], scale=np.linalg.norm(1 / ref[2])) <= STAT_TOL[dtype]
    np.testing.assert_array_equal(host(got[-1]), ref[-1])  # h = x + residual


def _force_cluster_plans(monkeypatch, change):
    """Route the forward's plans through change(plan), each a cluster's (skips without
    clusters)."""
    if not spec().has_clusters:
        pytest.skip("needs thread-block clusters (sm_90 or newer)")
    planned = runner.plan_for

    def forced(*args, **kwargs):
        plan = planned(*args, **kwargs)
        assert plan.variant is Variant.CLUSTER, plan
        return change(plan)

    monkeypatch.setattr(runner, "plan_for", forced)


def _check_forced(op, dtype, rng, monkeypatch, rows, cols, weight, bias):
    """check_forward on fresh random data, planned afresh; the plan that ran."""
    monkeypatch.setattr(ln_mod, "_launches", {})
    monkeypatch.setattr(ln_mod, "_fresh", {})
    x = make((rows, cols), dtype, rng)
    w = make(cols, dtype, rng, 1.0, 1.0) if weight else None
    b = make(cols, dtype, rng, 1.0, 0.0) if bias else None
    check_forward(op, x, cols, w, b, None, dtype)
    return ln_mod.last_plan(op)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", FWD)
def test_forward_cluster_launch_bounds(op, dtype, rng, monkeypatch):
    """The forward cluster kernel both ways (families.norm.min_blocks): blocks of at most 512
    threads that load two packs' gamma and beta ahead of their stores (MIN_BLOCKS 3), and
    1024-thread blocks that do not (1). Block widths that leave threads with odd and even
    numbers of packs, and slices that end part-way through a stride, on two clusters looping
    over 9 rows."""
    from dataclasses import replace

    threads = [0]

    def widths(plan):  # the reduction buffers at the end of the shared memory are per warp
        smem = plan.smem_bytes - cluster_tail(op, dtype, plan.threads, plan.rows_per_pass) + \
            cluster_tail(op, dtype, threads[0], plan.rows_per_pass)
        return replace(plan, block=(threads[0], 1), grid=2 * plan.cluster, smem_bytes=smem)

    _force_cluster_plans(monkeypatch, widths)
    edge = (max_dynamic_smem(spec()) - policy(op).smem_align) // smem_per_col(op, dtype, False)
    wide = 16 // ITEM[dtype]
    for cols in ((edge // wide + 1) * wide, 5 * (edge // wide) * wide + 3 * wide,
                 3 * (edge // wide) * wide + 1):
        for threads[0], want in ((256, 3), (512, 3), (1024, 1)):
            plan = _check_forced(op, dtype, rng, monkeypatch, 9, cols, True,
                                 op == "layer_norm")
            assert plan.threads == threads[0] and not plan.overlap, plan
            assert norm.min_blocks(plan) == want
            shift = ", true" if plan.shifted else ""  # odd columns: shifted packs (SHIFT)
            assert plan.name_expression().endswith(f", {want}, {plan.rows_per_pass}{shift}>")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", FWD)
def test_forward_paired_rows(op, dtype, rng, monkeypatch):
    """Clusters that cache two rows a pass (Plan.rows_per_pass; the planner's choice for 16-bit
    layer norm with a weight or bias from PAIRED_MIN_COLS columns over at most
    PAIRED_MAX_CLUSTER blocks, forced here on a cluster of
    twice the planned size, or of 16 blocks with twice the slice, for every dtype, both ops and
    every parameter switch). Rows 1, 3 and 9, so that a pass may lack its second row, on one
    cluster looping over the passes, on two, and on one cluster a pass; slices that end
    part-way through a stride, and packs of one element."""
    from dataclasses import replace

    clusters = [0]

    def paired(plan):
        assert not plan.overlap, plan
        if plan.rows_per_pass == 1:  # twice the blocks, or else twice the slice
            size = min(2 * plan.cluster, max(CLUSTER_SIZES))
            slice_packs = -(-(plan.cols // plan.pack_size) // size)
            smem = -(-2 * slice_packs * plan.pack_size * ITEM[dtype] // 16) * 16 + \
                cluster_tail(op, dtype, plan.threads, rows_per_pass=2)
            assert smem <= max_dynamic_smem(spec()), plan
            plan = replace(plan, cluster=size, rows_per_pass=2, smem_bytes=smem)
        passes = -(-plan.rows // 2)
        return replace(plan, grid=(clusters[0] or passes) * plan.cluster)

    _force_cluster_plans(monkeypatch, paired)
    # rows off the 16-byte grid in packs of one element: two rows a pass have one window each
    # time, so shifted packs never pair (Plan.shifted)
    monkeypatch.setattr(runner, "same_offsets", lambda *a: False)
    edge = (max_dynamic_smem(spec()) - policy(op).smem_align) // smem_per_col(op, dtype, False)
    wide = 16 // ITEM[dtype]
    switches = ((True, True), (True, False), (False, True), (False, False)) \
        if op == "layer_norm" else ((True, False), (False, False))
    for cols, every in (((edge // wide + 1) * wide, False),
                        (3 * (edge // wide) * wide + 1, False),
                        (5 * (edge // wide) * wide + 3 * wide, True)):
        for (weight, bias) in (switches if every else switches[:1]):
            for rows, clusters[0] in ((9, 2), (3, 1), (1, 0), (9, 0)):
                plan = _check_forced(op, dtype, rng, monkeypatch, rows, cols, weight, bias)
                assert plan.rows_per_pass == 2 and plan.name_expression().endswith(", 2>"), plan


def _variant_cases(op, dtype):
    """Columns that reach the warp, block, cluster (Hopper) and uncached kernels, on the
    16-byte grid and off it (shifted packs)."""
    edge = (max_dynamic_smem(spec()) - policy(op).smem_align) // smem_per_col(op, dtype, True)
    wide = 16 // ITEM[dtype]
    cases = [1000, 1001, 5000, 5001, min(edge // wide * wide, 20000)]
    if spec().has_clusters:
        cases += [(edge // wide + 1) * wide, (edge // wide + 1) * wide + 1]
    return cases


@pytest.mark.parametrize("op", FWD)
@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_rows(op, dtype, rng, monkeypatch):
    """var = 0: y is exactly beta (layer norm), rstd = 1 / sqrt(eps)."""
    for uncached in (False, True):
        if uncached:
            monkeypatch.setattr(runner, "driver_occupancy", lambda dev: (lambda plan: 0))
            monkeypatch.setattr(ln_mod, "_launches", {})
            monkeypatch.setattr(ln_mod, "_fresh", {})
        for cols in (_variant_cases(op, dtype) if not uncached else [3000]):
            c = rng.standard_normal((5, 1)) * 10
            x = np.broadcast_to(c, (5, cols)).astype(np_dtype(dtype))
            b = make(cols, dtype, rng)
            if op == "layer_norm":
                y, mean, rstd = cukern.layer_norm(cp.asarray(x), cols, None, cp.asarray(b),
                                                  return_stats=True)
                np.testing.assert_array_equal(host(y), np.broadcast_to(b.astype(np.float64),
                                                                       (5, cols)))
                np.testing.assert_allclose(host(mean), x[:, 0].astype(np.float64),
                                           rtol=STAT_TOL[dtype])
                np.testing.assert_allclose(host(rstd), 1 / np.sqrt(1e-5), rtol=STAT_TOL[dtype])
            else:
                check_forward(op, x, cols, None, None, None, dtype)


@pytest.mark.parametrize("op", FWD)
def test_large_offsets(op, rng, monkeypatch):
    """x = 1e4 + small noise in float32, where E[x^2] - E[x]^2 loses every digit: y and the
    statistics still match float64 to float32 precision, in every variant."""
    for uncached in (False, True):
        if uncached:
            monkeypatch.setattr(runner, "driver_occupancy", lambda dev: (lambda plan: 0))
            monkeypatch.setattr(ln_mod, "_launches", {})
            monkeypatch.setattr(ln_mod, "_fresh", {})
        for cols in (_variant_cases(op, "float32") if not uncached else [3000, 70000]):
            x = (1e4 + rng.standard_normal((6, cols)) * 0.5).astype(np.float32)
            w = make(cols, "float32", rng, 1.0, 1.0)
            b = make(cols, "float32", rng) if op == "layer_norm" else None
            check_forward(op, x, cols, w, b, None, "float32")


# ---------------------------------------------------------------------------------------------
# One outlier among small values (issue 26): the layer norm kernels shift each row by K, a value
# of the row (norm.cuh). K was the row's first value: an outlier there (1e4 among values of
# 1e-3) rounded the rest of the row to the outlier's spacing, 1e-3 in float32, and put y 1.45e-3
# off at 1.2M columns. K is now the median of the row's first three values.

OUTLIER = 1e4


def _outlier_columns(dtype):
    """(cols, expected variant or None) reaching every layer norm forward kernel on this GPU:
    the warp kernel with one register slot a lane, two a lane (24: two packs a lane; 256), 4-16
    slots (1024) and 32 packs of one element (999: the three values in three lanes); the
    block kernel; a cluster (sm_90); the uncached kernel past what 16 blocks' shared memory
    holds (one block's without clusters); the issue's 1.2M columns."""
    edge = (max_dynamic_smem(spec()) - policy("layer_norm").smem_align) // \
        smem_per_col("layer_norm", dtype, False)
    wide = 16 // ITEM[dtype]
    cases = [(7, Variant.WARP), (24, Variant.WARP), (256, Variant.WARP), (999, Variant.WARP),
             (1024, Variant.WARP), (5000, Variant.BLOCK_SMEM)]
    if spec().has_clusters:
        cases += [((edge // wide + 1) * wide, Variant.CLUSTER),
                  (CLUSTER_SIZES[-1] * edge + 64 * wide, Variant.BLOCK_UNCACHED)]
    else:
        cases += [(edge + 64 * wide, Variant.BLOCK_UNCACHED)]
    return cases + [(1_200_000, None)]


def _outlier_rows(rows, cols, dtype, rng):
    """Rows of noise of 1e-3 with one value of 1e4: first, second, in the middle, last, at a
    random column, in turn. Returns x and each row's outlier column."""
    where = np.array([(0, 1, cols // 2, cols - 1, int(rng.integers(cols)))[i % 5]
                      for i in range(rows)])
    x = rng.standard_normal((rows, cols)) * 1e-3
    x[np.arange(rows), where] = OUTLIER
    return x.astype(np_dtype(dtype)), where


def check_outlier_rows(x, where, dtype, w=None, r=None):
    """layer_norm of rows with one outlier each (at ``where``) against float64 NumPy, row by
    row. y: relative L2 error (||y - ref|| / ||ref||, as rel_err) over the whole row, and over
    the row without its outlier: the bulk, whose y (~1e-3 after normalising) the whole row's
    measure hides under the outlier's (~1e3), and which a shift by the outlier ruins. Within
    1e-5 in float32, TOL in the other types (grown with the row as check_forward's). mean and
    rstd: |got - ref| / |ref| within STAT_TOL (1e-5 in float32), the mean against itself (here
    far smaller than the row's deviation, which check_forward's measure would add)."""
    rows, cols = x.shape
    ref = reference.layer_norm(x, cols, w, None, 1e-5, residual=r, return_stats=True)
    poison((x.shape, ITEM[dtype]), (x.shape, ITEM[dtype]), ((rows,), 8), ((rows,), 8))
    got = cukern.layer_norm(cp.asarray(x), cols, None if w is None else cp.asarray(w), None,
                            1e-5, residual=None if r is None else cp.asarray(r),
                            return_stats=True)
    y, y_ref = host(got[0]), ref[0]
    assert not np.isnan(y).any(), "unwritten or NaN output"
    err = y - y_ref
    bulk = np.ones(x.shape, bool)
    bulk[np.arange(rows), where] = False
    whole = np.linalg.norm(err, axis=1) / np.linalg.norm(y_ref, axis=1)
    part = np.linalg.norm(np.where(bulk, err, 0), axis=1) / \
        np.linalg.norm(np.where(bulk, y_ref, 0), axis=1)
    tol = 1e-5 if dtype == "float32" else TOL[dtype] * max(1.0, (cols / 2**18) ** 0.5)
    at = f"{dtype} {x.shape} w={w is not None} r={r is not None}"
    assert whole.max() <= tol, f"{at}: y rel err {whole.max():.3g} (row {whole.argmax()})"
    assert part.max() <= tol, f"{at}: y rel err without the outlier {part.max():.3g} " \
                              f"(row {part.argmax()}, outlier at {where[part.argmax()]})"
    for name, g, want in (("mean", got[1], ref[1]), ("rstd", got[2], ref[2])):
        dev = np.abs(host(g) - want) / np.abs(want)
        assert dev.max() <= STAT_TOL[dtype], f"{at}: {name} off by {dev.max():.3g}"
    if r is not None:
        np.testing.assert_array_equal(host(got[3]), ref[3], err_msg=f"{at}: h")
    return ln_mod.last_plan("layer_norm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_outlier_rows(dtype, rng):
    """A row whose first (middle, last, some) value is 1e4 among values of 1e-3, in every
    forward kernel, without and with a residual and a weight: y, mean and rstd to 1e-5 in
    float32, TOL (y) and STAT_TOL in the other types. Fails with the first value as the shift
    wherever the row is long (float32 from about 1000 columns: the bulk's error grows like
    the row's length times float32's epsilon); short rows check the kernels' choice of the
    three values' lanes and registers."""
    reached = set()
    for cols, variant in _outlier_columns(dtype):
        x, where = _outlier_rows(5, cols, dtype, rng)
        plan = check_outlier_rows(x, where, dtype)
        if variant is not None:
            assert plan.variant is variant, (cols, plan)
        reached.add(plan.variant)
        # the shift of x + residual, the kernels with a residual (overlapped rows) and a weight
        r = (rng.standard_normal(x.shape) * 1e-3).astype(np_dtype(dtype))
        w = make(cols, dtype, rng, 0.5, 1.0)
        check_outlier_rows(x, where, dtype, w, r)
    wanted = {Variant.WARP, Variant.BLOCK_SMEM, Variant.BLOCK_UNCACHED}
    assert reached >= wanted | ({Variant.CLUSTER} if spec().has_clusters else set()), reached


def test_outlier_rows_two_rows_a_group(rng):
    """The warp kernel with two rows a group of lanes (rows_per_access 2: many short rows; 62
    columns: packs of 2, which no table takes two a lane)."""
    x, where = _outlier_rows(100000, 62, "float32", rng)
    plan = check_outlier_rows(x, where, "float32")
    assert plan.variant is Variant.WARP and plan.rows_per_access == 2, plan


@pytest.mark.parametrize("dtype", DTYPES)
def test_outlier_shift_keeps_offsets_and_constant_rows(dtype, rng):
    """What the shift is for, at the outlier tests' columns: a row of 1e4 + noise (16-bit:
    1e3) keeps its small differences (y and the statistics as check_forward wants), a constant
    row gives var = 0 exactly: y = beta, mean = the value, rstd = 1 / sqrt(eps)."""
    for cols, _ in _outlier_columns(dtype):
        b = make(cols, dtype, rng)
        if dtype != "float64":
            # 16-bit: 1e3 + noise of a few spacings (1e4 + 0.5 would round to a constant row;
            # their kernels take K once a pack of 8 values, add_pack)
            offset, noise = (1e4, 0.5) if dtype == "float32" else (1e3, 8.0)
            x = (offset + rng.standard_normal((2, cols)) * noise).astype(np_dtype(dtype))
            check_forward("layer_norm", x, cols, None, b, None, dtype)
        elif dtype == "float64":
            # NumPy's own float64 y is off by ~eps * 1e4 / 0.5 = 2e-12 here (x - mean rounds
            # at 1e4's spacing): the reference is taken of x less its first column (y and
            # rstd do not change with a shift; the mean moves by it)
            x = 1e4 + rng.standard_normal((2, cols)) * 0.5
            got = cukern.layer_norm(cp.asarray(x), cols, None, cp.asarray(b), return_stats=True)
            ref = reference.layer_norm(x - x[:, :1], cols, None, b, return_stats=True)
            assert rel_err(got[0], ref[0]) <= TOL[dtype], (cols, rel_err(got[0], ref[0]))
            np.testing.assert_allclose(host(got[1]) - x[:, 0], ref[1], rtol=0,
                                       atol=1e-11)
            np.testing.assert_allclose(host(got[2]), ref[2], rtol=STAT_TOL[dtype])
        c = np.broadcast_to(rng.standard_normal((2, 1)) * 10, (2, cols)).astype(np_dtype(dtype))
        y, mean, rstd = cukern.layer_norm(cp.asarray(c), cols, None, cp.asarray(b),
                                          return_stats=True)
        np.testing.assert_array_equal(host(y), np.broadcast_to(b.astype(np.float64), (2, cols)))
        np.testing.assert_array_equal(host(mean), c[:, 0].astype(np.float64))
        np.testing.assert_allclose(host(rstd), 1 / np.sqrt(1e-5), rtol=STAT_TOL[dtype])


def test_views_and_layouts(rng):
    base = make((6, 1100), "float32", rng)
    db = cp.asarray(base)
    w = make(1000, "float32", rng)
    cases = [
        (base[:, :1000], db[:, :1000]),  # row stride > cols
        (base[:, 1:1001], db[:, 1:1001]),  # misaligned: single-element accesses
        (base[:, ::2][:, :500], db[:, ::2][:, :500]),  # columns not contiguous: copied
        (base[::-1, :1000], db[::-1, :1000]),  # negative row stride
    ]
    for hx, dx in cases:
        cols = hx.shape[-1]
        ref = reference.layer_norm(hx, cols, w[:cols])
        got = cukern.layer_norm(dx, cols, cp.asarray(w[:cols]))
        assert rel_err(got, ref) <= TOL["float32"]
    # several normalised dimensions, leading dimensions that do not merge (copied)
    cube = make((4, 3, 10, 16), "float32", rng)
    dcube = cp.asarray(cube)
    w2 = make((10, 16), "float32", rng)
    for hv, dv in [(cube, dcube), (cube.transpose(1, 0, 2, 3), dcube.transpose(1, 0, 2, 3))]:
        ref = reference.layer_norm(hv, (10, 16), w2, return_stats=True)
        got = cukern.layer_norm(dv, (10, 16), cp.asarray(w2), return_stats=True)
        assert got[1].shape == hv.shape[:2]
        assert rel_err(got[0], ref[0]) <= TOL["float32"]
        dy = make(hv.shape, "float32", rng)
        ref_b = reference.layer_norm_backward(dy, hv, ref[1], ref[2], w2)
        got_b = cukern.layer_norm_backward(cp.asarray(dy), dv, got[1], got[2], cp.asarray(w2))
        for g, r_ in zip(got_b, ref_b):
            assert rel_err(g, r_) <= 1e-5
    # a non-contiguous weight and a residual with its own layout
    wbig = make(2000, "float32", rng)
    r = make((6, 2000), "float32", rng)
    ref = reference.layer_norm(base[:, :1000], 1000, wbig[::2], residual=r[:, 500:1500])
    got = cukern.layer_norm(db[:, :1000], 1000, cp.asarray(wbig)[::2],
                            residual=cp.asarray(r)[:, 500:1500])
    assert rel_err(got[0], ref[0]) <= TOL["float32"]
    np.testing.assert_array_equal(host(got[1]), ref[1])  # (y, h) without the statistics


def test_empty_arrays():
    for shape, ns in [((0, 5), 5), ((2, 0, 3), 3), ((0,), 0)]:
        x = cp.empty(shape, cp.float32)
        y, mean, rstd = cukern.layer_norm(x, ns, return_stats=True)
        assert y.shape == shape and mean.shape == shape[:-1]
        dx, dw, db = cukern.layer_norm_backward(x, x, mean, rstd, cp.ones(ns, cp.float32))
        assert dx.shape == shape and dw.shape == (ns,)
        assert bool((dw == 0).all()) and bool((db == 0).all())
    # rows but no columns: the statistics of no values are NaN, as in NumPy
    x = cp.empty((3, 0), cp.float32)
    y, mean, rstd = cukern.layer_norm(x, 0, return_stats=True)
    assert y.shape == (3, 0) and bool(cp.isnan(mean).all()) and bool(cp.isnan(rstd).all())
    y, rstd = cukern.rms_norm(x, 0, return_stats=True)
    assert bool(cp.isnan(rstd).all())
    # one row of one dimension: statistics are 0-d
    y, mean, rstd = cukern.layer_norm(cp.arange(4, dtype=cp.float32), 4, return_stats=True)
    assert mean.shape == () and float(mean) == 1.5


# ---------------------------------------------------------------------------------------------
# Backward.

def backward_stats(op, x64, dtype) -> tuple:
    """A backward's statistics from the float64 forward over the last axis of ``x64``, rounded
    to the statistics dtype: (mean, rstd) for layer norm, (rstd,) for RMS norm."""
    sdt = stat_dtype(dtype)
    if op == "layer_norm_backward":
        _, mean, rstd = reference.layer_norm(x64, x64.shape[-1], return_stats=True)
        return mean.astype(sdt), rstd.astype(sdt)
    _, rstd = reference.rms_norm(x64, x64.shape[-1], return_stats=True)
    return (rstd.astype(sdt),)


def check_backward(op, x, dy, w, dtype, b=None):
    """Statistics from the float64 forward, rounded to the statistics dtype, go to both the
    kernel and the reference; dx, dweight, dbias from NaN-poisoned fresh outputs. ``b``: the
    layer norm's bias (dbias is expected with a weight or a bias)."""
    cols = x.shape[-1]
    x64 = x.astype(np.float64)
    stats = backward_stats(op, x64, dtype)
    bias = () if b is None else (b,)
    ref = getattr(reference, op)(dy.astype(np.float64), x64,
                                 *[s.astype(np.float64) for s in stats],
                                 None if w is None else w.astype(np.float64),
                                 *[p.astype(np.float64) for p in bias])
    item = ITEM[dtype]
    poison((x.shape, item), ((cols,), item), ((cols,), item))
    got = getattr(cukern, op)(cp.asarray(dy), cp.asarray(x), *[cp.asarray(s) for s in stats],
                              None if w is None else cp.asarray(w),
                              *[cp.asarray(p) for p in bias])
    assert len(got) == len(ref)
    where = f"{op} {dtype} {x.shape} weight={w is not None} bias={b is not None}"
    # dx's natural scale is rstd * |dy * w|: with 1 or 2 columns dx itself is ~0 by cancellation
    g = dy.astype(np.float64) * (1 if w is None else w.astype(np.float64))
    scale = max(np.linalg.norm(ref[0]), np.linalg.norm(stats[-1].astype(np.float64)[:, None] * g))
    assert got[0].dtype == np_dtype(dtype) and got[0].shape == x.shape
    err = rel_err(got[0], ref[0], scale)
    assert err <= TOL[dtype], f"{where}: dx rel err {err:.3g}"
    for name, gv, rv in zip(("dweight", "dbias"), got[1:], ref[1:]):
        if w is None and (name == "dweight" or b is None):
            assert gv is None and rv is None, name
            continue
        assert gv.dtype == np_dtype(dtype) and gv.shape == (cols,)
        err = rel_err(gv, rv)
        assert err <= TOL[dtype], f"{where}: {name} rel err {err:.3g}"
    return got


@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", BWD)
def test_backward_every_variant(op, dtype, weight, rng):
    occ = runner.driver_occupancy(0)
    shapes = col_sums_shapes(op, dtype) if weight else variant_shapes(op, dtype)
    for shape, variant in shapes:
        x = make(shape, dtype, rng)
        dy = make(shape, dtype, rng, 1.0, 0.1)
        w = make(shape[-1], dtype, rng, 1.0, 1.0) if weight else None
        check_backward(op, x, dy, w, dtype)
        plan = ln_mod.last_plan(op)
        assert plan.switches == Switches(weight=weight)
        if variant is not None:
            assert plan.variant is variant, (shape, plan)
        if weight and variant in (Variant.BLOCK_SMEM, Variant.CLUSTER):
            # the way itself, by the rule's mirror with the driver's occupancy
            way = (plan.cluster, plan.threads, plan.smem_bytes, plan.sums_in_registers,
                   plan.gamma_in_smem)
            assert way == col_sums_expected(op, dtype, shape[-1], spec(), occ), (shape, plan)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", BWD)
def test_param_grad_reduce_shapes(op, dtype, rng):
    """dweight (and dbias) from the partial rows by norm_param_grad_reduce in each of its
    shapes (plan.param_reduce_shape): 16-byte column lanes or single columns, one to 32
    row lanes, columns that the lanes do or do not divide."""
    from cukern.plan import param_reduce_shape

    seen = set()
    for rows, cols in ((300, 36000), (300, 36001), (40, 36000), (2, 65536), (5000, 1024),
                       (700, 4100)):
        x = make((rows, cols), dtype, rng)
        dy = make((rows, cols), dtype, rng, 1.0, 0.1)
        w = make(cols, dtype, rng, 1.0, 1.0)
        check_backward(op, x, dy, w, dtype)
        plan = ln_mod.last_plan(op)
        if plan.variant in (Variant.BLOCK_SMEM, Variant.CLUSTER):
            prows = plan.grid // plan.cluster
            vec, block, _ = param_reduce_shape(cols, prows, policy(op).col_sums, dtype,
                                               runner.device_spec(0))
            seen.add((vec, block[1] > 1 and block[1] < 32))
    assert {(True, True), (False, False)} <= seen, seen


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("op", BWD)
def test_backward_gamma_in_shared_memory_both_ways(op, dtype, rng, monkeypatch):
    """The cached backward with a weight reads gamma from a float copy in shared memory where
    the planner finds room for it (Plan.gamma_in_smem), else from memory: every block and
    cluster shape here both ways (a cluster with no room for the copy doubled until it has
    some), one or two buffers, packs of one element (odd columns) or more, in grids of two
    blocks (or clusters) that loop over rows."""
    from dataclasses import replace

    planned = runner.plan_for
    gamma, fits = [False], [False]

    def forced(*args, **kwargs):
        plan = planned(*args, **kwargs)
        if plan.variant not in (Variant.BLOCK_SMEM, Variant.CLUSTER):
            return plan
        packs, align = plan.cols // plan.pack_size, policy(plan.op).smem_align

        def values(size):
            return -(-packs // size) * plan.pack_size

        # x and dy (and shared-memory sums) take the same bytes per value in any slice
        rest = plan.smem_bytes - align - (4 * values(plan.cluster) if plan.gamma_in_smem else 0)
        per_value = rest // values(plan.cluster)
        size = plan.cluster  # a cluster with no room for gamma: more, smaller slices
        while True:
            smem = align + per_value * values(size) + (4 * values(size) if gamma[0] else 0)
            fits[0] = smem <= max_dynamic_smem(spec())
            if fits[0] or plan.variant is Variant.BLOCK_SMEM or size == CLUSTER_SIZES[-1]:
                break
            size *= 2
        if fits[0]:
            plan = replace(plan, gamma_in_smem=gamma[0], smem_bytes=smem, cluster=size)
        return replace(plan, grid=2 * plan.cluster)

    monkeypatch.setattr(runner, "plan_for", forced)
    cases = [1001, 1024, 4096, 8192, 16384]
    if spec().has_clusters:  # just past one block (room left in each slice), and fuller
        cases += [20001, 24000, 36000, 70001]
    cached = []
    for cols in cases:
        for gamma[0] in (False, True):
            ln_mod._launches.clear()  # plan afresh
            ln_mod._fresh.clear()
            x = make((9, cols), dtype, rng)
            dy = make((9, cols), dtype, rng, 1.0, 0.1)
            w = make(cols, dtype, rng, 1.0, 1.0)
            check_backward(op, x, dy, w, dtype)
            plan = ln_mod.last_plan(op)
            assert plan.variant in (Variant.BLOCK_SMEM, Variant.CLUSTER), plan
            assert plan.grid == 2 * plan.cluster, plan
            assert plan.gamma_in_smem is (gamma[0] and fits[0]), plan
            if plan.gamma_in_smem:
                cached.append((cols, plan.variant, plan.pack_size))
    # both kernels, and packs of one element, took gamma from shared memory
    assert {v for _, v, _ in cached} == ({Variant.BLOCK_SMEM, Variant.CLUSTER}
                                         if spec().has_clusters else {Variant.BLOCK_SMEM})
    assert any(pack == 1 for _, _, pack in cached), cached


def test_max_active_clusters():
    """The driver's count of co-resident clusters sizes the backward's one-wave cluster grid."""
    if not spec().has_clusters:
        pytest.skip("needs thread-block clusters (sm_90)")
    from cukern.plan import plan_rowwise

    occ = runner.driver_occupancy(0)
    plan = plan_rowwise("layer_norm_backward", 1000, 65536, "float16", spec(), occ,
                        switches=Switches(weight=True))
    assert plan.variant is Variant.CLUSTER
    n = occ.max_clusters(plan)
    assert n is not None and 0 < n <= spec().sms * occ(plan) // plan.cluster
    assert plan.grid == n * plan.cluster
    # a forward cluster of 16-byte packs (its size compiled in: on the grid or shifted) and of
    # one-element packs (arrays at other offsets: its size a launch attribute): the driver
    # answers all three
    for cols, shift_ok, at_launch in ((262144, True, False), (262143, True, False),
                                      (262143, False, True)):
        plan = plan_rowwise("layer_norm", 512, cols, "float32", spec(), occ, shift_ok=shift_ok)
        assert plan.shifted is (cols % 2 == 1 and shift_ok), plan
        assert plan.variant is Variant.CLUSTER
        assert (plan.launch_cluster > 1) is at_launch, plan
        n = occ.max_clusters(plan)
        assert n is not None and 0 < n <= spec().sms * occ(plan) // plan.cluster


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", BWD)
def test_backward_uncached_at_short_rows(op, dtype, rng, monkeypatch):
    monkeypatch.setattr(runner, "driver_occupancy", lambda dev: (lambda plan: 0))
    monkeypatch.setattr(ln_mod, "_launches", {})
    monkeypatch.setattr(ln_mod, "_fresh", {})
    for shape in [(3, 1025), (5, 4097), (40, 20000)]:
        for weight in (False, True):
            x = make(shape, dtype, rng)
            dy = make(shape, dtype, rng, 1.0, 0.1)
            w = make(shape[-1], dtype, rng, 1.0, 1.0) if weight else None
            check_backward(op, x, dy, w, dtype)
            assert ln_mod.last_plan(op).variant is Variant.BLOCK_UNCACHED


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", BWD)
def test_param_grads_over_many_rows(op, dtype, rng):
    """dweight/dbias summed over 10**5 rows: float32 partial sums hold where a half-precision
    running sum visibly fails."""
    x = make((10**5, 64), dtype, rng)
    dy = make((10**5, 64), dtype, rng, 1.0, 0.1)
    w = make(64, dtype, rng, 1.0, 1.0)
    got = check_backward(op, x, dy, w, dtype)
    if dtype == "float16":
        ref_db = dy.astype(np.float64).sum(0)
        half = np.cumsum(dy, axis=0, dtype=np.float16)[-1].astype(np.float64)
        assert np.linalg.norm(half - ref_db) / np.linalg.norm(ref_db) > 10 * TOL[dtype]
        if op == "layer_norm_backward":
            assert rel_err(got[2], ref_db) <= TOL[dtype]
    # the same rows through the block and cluster kernels (fewer rows, longer)
    for cols in _variant_cases(op, dtype)[1:]:
        rows = max(64, 2**21 // cols)
        check_backward(op, make((rows, cols), dtype, rng), make((rows, cols), dtype, rng, 1, .1),
                       make(cols, dtype, rng, 1.0, 1.0), dtype)


@pytest.mark.parametrize("op", BWD)
def test_backward_large_offsets_and_constant_rows(op, rng):
    for cols in _variant_cases(op, "float32"):
        x = (1e4 + rng.standard_normal((6, cols)) * 0.5).astype(np.float32)
        dy = make((6, cols), "float32", rng, 1.0, 0.1)
        check_backward(op, x, dy, make(cols, "float32", rng, 1.0, 1.0), "float32")
        c = np.broadcast_to(rng.standard_normal((6, 1)) * 10, (6, cols)).astype(np.float32)
        check_backward(op, c, dy, make(cols, "float32", rng, 1.0, 1.0), "float32")


def test_forward_backward_round_trip(rng):
    """The backward of the forward's own outputs (h as x, the returned statistics)."""
    x = cp.asarray(make((64, 3000), "bfloat16", rng))
    r = cp.asarray(make((64, 3000), "bfloat16", rng))
    w = cp.asarray(make(3000, "bfloat16", rng, 1.0, 1.0))
    b = cp.asarray(make(3000, "bfloat16", rng))
    y, mean, rstd, h = cukern.layer_norm(x, 3000, w, b, residual=r, return_stats=True)
    dy = cp.asarray(make((64, 3000), "bfloat16", rng))
    dx, dw, db = cukern.layer_norm_backward(dy, h, mean, rstd, w)
    ref = reference.layer_norm_backward(host(dy), host(h), host(mean), host(rstd), host(w))
    for g, r_ in zip((dx, dw, db), ref):
        assert rel_err(g, r_) <= TOL["bfloat16"]
    _, rstd, h = cukern.rms_norm(x, 3000, w, residual=r, return_stats=True)
    dx, dw = cukern.rms_norm_backward(dy, h, rstd, w)
    ref = reference.rms_norm_backward(host(dy), host(h), host(rstd), host(w))
    for g, r_ in zip((dx, dw), ref):
        assert rel_err(g, r_) <= TOL["bfloat16"]


# ---------------------------------------------------------------------------------------------
# DLPack hand-offs.

@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_round_trip(dtype):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    tdt = getattr(torch, dtype)
    x = torch.randn(257, 1000, device="cuda", dtype=tdt) * 2 + 0.5
    r = torch.randn_like(x)
    w = torch.randn(1000, device="cuda", dtype=tdt) + 1
    b = torch.randn(1000, device="cuda", dtype=tdt)
    y, mean, rstd, h = cukern.layer_norm(x, 1000, w, b, residual=r, return_stats=True)
    for t in (y, mean, rstd, h):
        assert isinstance(t, torch.Tensor) and t.device == x.device
    assert y.dtype == tdt and h.dtype == tdt and mean.dtype == torch.float32
    assert torch.equal(h, x + r)
    hd = h.double().requires_grad_()
    wd, bd = w.double().requires_grad_(), b.double().requires_grad_()
    ref = F.layer_norm(hd, (1000,), wd, bd, 1e-5)
    assert float((y.double() - ref.detach()).norm() / ref.detach().norm()) < TOL[dtype]
    dy = torch.randn_like(x)
    dx, dw, db = cukern.layer_norm_backward(dy, h, mean, rstd, w)
    ref.backward(dy.double())
    for got, want in ((dx, hd.grad), (dw, wd.grad), (db, bd.grad)):
        assert isinstance(got, torch.Tensor) and got.dtype == tdt
        assert float((got.double() - want).norm() / want.norm()) < 2 * TOL[dtype]
    y2, rstd2 = cukern.rms_norm(x, 1000, w, return_stats=True)
    assert rstd2.dtype == torch.float32 and rstd2.shape == (257,)
    ms = x.double().pow(2).mean(-1, keepdim=True)
    ref2 = x.double() * torch.rsqrt(ms + 1e-6) * w.double()
    assert float((y2.double() - ref2).norm() / ref2.norm()) < TOL[dtype]
    assert cp.from_dlpack(y).data.ptr == y.data_ptr()  # zero-copy


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_jax_round_trip(dtype, rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x64 = rng.standard_normal((129, 2048))
    x = jnp.asarray(x64, dtype=getattr(jnp, dtype))
    w = jnp.asarray(rng.standard_normal(2048) + 1, dtype=getattr(jnp, dtype))
    y, rstd = cukern.rms_norm(x, 2048, w, return_stats=True)
    assert isinstance(y, jax.Array) and y.dtype == x.dtype and rstd.dtype == jnp.float32
    xh = np.asarray(x.astype(jnp.float32)).astype(np.float64)
    wh = np.asarray(w.astype(jnp.float32)).astype(np.float64)
    ref = reference.rms_norm(xh, 2048, wh)
    assert rel_err(np.asarray(y.astype(jnp.float32)).astype(np.float64), ref) < TOL[dtype]
    dy = jnp.asarray(rng.standard_normal((129, 2048)), dtype=x.dtype)
    dx, dw = cukern.rms_norm_backward(dy, x, rstd, w)
    assert isinstance(dx, jax.Array) and isinstance(dw, jax.Array)
    ref_b = reference.rms_norm_backward(np.asarray(dy.astype(jnp.float32)).astype(np.float64),
                                        xh, np.asarray(rstd).astype(np.float64), wh)
    assert rel_err(np.asarray(dw.astype(jnp.float32)).astype(np.float64), ref_b[1]) < TOL[dtype]


# ---------------------------------------------------------------------------------------------
# Bad input.

def test_bad_input_is_named():
    x = cp.ones((4, 8), cp.float32)
    w8 = cp.ones(8, cp.float32)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        cukern.layer_norm(np.ones((4, 8), np.float32), 8)
    with pytest.raises(TypeError, match="int32"):
        cukern.layer_norm(cp.ones((4, 8), cp.int32), 8)
    with pytest.raises(ValueError, match=r"normalized_shape \(7,\) does not match"):
        cukern.layer_norm(x, 7)
    with pytest.raises(ValueError, match="normalized_shape"):
        cukern.rms_norm(x, (2, 4, 8))
    with pytest.raises(TypeError, match="normalized_shape"):
        cukern.layer_norm(x, 8.0)
    with pytest.raises(ValueError, match=r"weight has shape \(7,\), expected \(8,\)"):
        cukern.layer_norm(x, 8, cp.ones(7, cp.float32))
    with pytest.raises(ValueError, match="bias has shape"):
        cukern.layer_norm(x, 8, w8, cp.ones((1, 8), cp.float32))
    with pytest.raises(TypeError, match="weight has dtype float16"):
        cukern.rms_norm(x, 8, cp.ones(8, cp.float16))
    with pytest.raises(TypeError, match="bias has dtype float64"):
        cukern.layer_norm(x, 8, None, cp.ones(8, cp.float64))
    with pytest.raises(TypeError, match="weight must be a CuPy array"):
        cukern.layer_norm(x, 8, np.ones(8, np.float32))
    for eps in (0, -1e-5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps"):
            cukern.layer_norm(x, 8, eps=eps)
    with pytest.raises(TypeError, match="eps"):
        cukern.rms_norm(x, 8, eps="1e-6")
    for op in (cukern.layer_norm, cukern.rms_norm):  # 1e-50 is 0 in float32: var + eps = var
        op(x, 8, eps=1e-5)
        with pytest.raises(ValueError, match="eps=1e-50 underflows float32, the compute type "
                                             "of float32 data"):
            op(x, 8, eps=1e-50)
        with pytest.raises(ValueError, match="eps=1e-40 underflows float32, the compute type "
                                             "of float16 data"):
            op(x.astype(cp.float16), 8, eps=1e-40)
    assert bool(cp.isfinite(cukern.rms_norm(x.astype(cp.float64), 8, eps=1e-50)).all())
    with pytest.raises(ValueError, match="residual has shape"):
        cukern.layer_norm(x, 8, residual=cp.ones((4, 9), cp.float32))
    with pytest.raises(TypeError, match="residual has dtype"):
        cukern.rms_norm(x, 8, residual=cp.ones((4, 8), cp.float16))
    # backward: statistics of the wrong shape or dtype, mismatched dy
    mean, rstd = cp.zeros(4, cp.float32), cp.ones(4, cp.float32)
    with pytest.raises(ValueError, match=r"rstd has shape \(5,\), expected \(4,\)"):
        cukern.layer_norm_backward(x, x, mean, cp.ones(5, cp.float32))
    with pytest.raises(ValueError, match="mean has shape"):
        cukern.layer_norm_backward(x, x, cp.zeros((4, 8), cp.float32), rstd)
    with pytest.raises(ValueError, match="rstd has shape"):
        cukern.rms_norm_backward(x, x, cp.ones((2, 2), cp.float32))
    with pytest.raises(ValueError, match="mean has shape"):
        cukern.layer_norm_backward(x, x, cp.zeros(4, cp.float32), rstd, cp.ones((4, 8),
                                                                                 cp.float32))
    with pytest.raises(TypeError, match="rstd has dtype float16"):
        cukern.rms_norm_backward(x, x, cp.ones(4, cp.float16))
    with pytest.raises(TypeError, match="mean has dtype float64"):
        cukern.layer_norm_backward(x, x, cp.zeros(4, cp.float64), rstd)
    with pytest.raises(ValueError, match="dy has shape"):
        cukern.layer_norm_backward(cp.ones((4, 9), cp.float32), x, mean, rstd)
    with pytest.raises(TypeError, match="dy has dtype"):
        cukern.rms_norm_backward(cp.ones((4, 8), cp.float16), x, rstd)
    with pytest.raises(ValueError, match="weight has shape"):
        cukern.rms_norm_backward(x, x, rstd, cp.ones(7, cp.float32))
    with pytest.raises(TypeError, match="weight has dtype"):
        cukern.layer_norm_backward(x, x, mean, rstd, cp.ones(8, cp.float64))
    # float64 input takes float64 statistics
    x64 = cp.ones((4, 8), cp.float64)
    with pytest.raises(TypeError, match="expected float64"):
        cukern.rms_norm_backward(x64, x64, rstd)


@pytest.mark.parametrize("op", FWD + BWD)
def test_rows_past_the_longest_are_refused(op):
    """Normalised shapes of more than MAX_COLS = 2^31 - 4096 values are refused before
    anything is allocated (zero-stride views: no memory)."""
    pool = cp.get_default_memory_pool()
    one = cp.zeros((1, 1), cp.float16)
    stat = cp.ones(2, cp.float32)
    for ns in ((MAX_COLS + 1,), (2**31 - 1,), (2**31,), (2**16, 2**15)):
        x = cp.broadcast_to(one.reshape((1,) * (len(ns) + 1)), (2, *ns))
        gc.collect()  # earlier tests' garbage freed now, not during the call
        used = pool.used_bytes()
        cols = math.prod(ns)
        with pytest.raises(ValueError, match=rf"{op}: .*{cols} elements; at most 2147479552"):
            if op == "layer_norm_backward":
                cukern.layer_norm_backward(x, x, stat, stat)
            elif op == "rms_norm_backward":
                cukern.rms_norm_backward(x, x, stat)
            else:
                getattr(cukern, op)(x, ns)
        assert pool.used_bytes() == used


def test_longest_row():
    """One row of MAX_COLS = 2^31 - 4096 float16 values, the longest the kernels take, read in
    single-element packs (a view one element off alignment), so that the kernels' 32-bit pack
    indices go furthest: -1 and 1 in turn, so mean 0, variance 1 and y = x in float16.
    About 11 GB of GPU memory; leave it out with -k "not longest_row"."""
    free, _ = cp.cuda.runtime.memGetInfo()
    if free < (16 << 30):
        pytest.skip(f"needs about 16 GB of free GPU memory, {free >> 30} GB free")
    n = MAX_COLS
    x = cp.empty((1, n + 1), cp.float16)[:, 1:]
    x[0, 0::2] = -1
    x[0, 1::2] = 1
    y, mean, rstd = cukern.layer_norm(x, n, return_stats=True)
    plan = ln_mod.last_plan("layer_norm")
    assert (plan.variant, plan.pack_size, plan.cols) == (Variant.BLOCK_UNCACHED, 1, n)
    assert int(cp.count_nonzero(y != x)) == 0
    assert abs(float(mean[0])) <= 1e-5  # float32 merges of 1024 threads' statistics
    assert float(rstd[0]) == pytest.approx(1 / math.sqrt(1 + 1e-5), rel=1e-5)
    del y
    y, rstd = cukern.rms_norm(x, n, return_stats=True)
    assert ln_mod.last_plan("rms_norm").pack_size == 1
    assert int(cp.count_nonzero(y != x)) == 0
    assert float(rstd[0]) == pytest.approx(1 / math.sqrt(1 + 1e-6), rel=1e-6)


def test_arrays_on_different_devices():
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    x = cp.ones((4, 8), cp.float32)
    with cp.cuda.Device(1):
        w = cp.ones(8, cp.float32)
        r = cp.ones((4, 8), cp.float32)
    with pytest.raises(ValueError, match="GPU"):
        cukern.layer_norm(x, 8, w)
    with pytest.raises(ValueError, match="GPU"):
        cukern.rms_norm(x, 8, residual=r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7, 1), (4096, 1), (3, 5, 1)])
@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("eps", [1e-5, 1e-12])
def test_backward_over_one_element_is_exactly_zero(dtype, shape, weight, eps, rng):
    """Layer norm over one element gives y = bias whatever x, so dx (and dweight) are exactly 0
    (PyTorch's OpInfo sample (1,)). rstd = 1 / sqrt(eps) used to scale a rounding residue of
    rstd * g up to 1e-4."""
    x = cp.asarray(make(shape, dtype, rng, 5.0, 3.0))
    dy = cp.asarray(make(shape, dtype, rng, 5.0, 1.0))
    w = cp.asarray(make(1, dtype, rng, 1.0, 1.0)) if weight else None
    _, mean, rstd = cukern.layer_norm(x, (1,), w, None, eps, return_stats=True)
    assert np.array_equal(host(mean), host(x).reshape(shape[:-1]))  # the exact mean
    poison((shape, ITEM[dtype]))
    dx, dw, db = cukern.layer_norm_backward(dy, x, mean, rstd, w)
    got = host(dx)
    assert got.shape == shape and np.all(got == 0), got[got != 0][:8]
    if weight:
        assert np.all(host(dw) == 0)

"""Softmax family on the GPU against float64 NumPy: every variant x dtype x op at its edge
shapes, properties, strided views, DLPack hand-offs, streams and graphs, and bad input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import cukern
from cukern import reference
from cukern.ops import softmax as softmax_mod
from cukern.plan import CLUSTER_SIZES, MAX_COLS, Variant, max_dynamic_smem
from cukern.plan.rowwise import shifted_cols
from cukern.registry import policy

from .conftest import DTYPES, TOL, block_tail, cluster_tail

cp = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("warm_softmax")]

FWD = ("softmax", "log_softmax")
BWD = ("softmax_backward", "log_softmax_backward")
ITEM = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def np_dtype(name):
    if name == "bfloat16":
        from ml_dtypes import bfloat16

        return np.dtype(bfloat16)
    return np.dtype(name)


def rel_err(out, ref) -> float:
    got = cp.asnumpy(out).astype(np.float64) if isinstance(out, cp.ndarray) else out
    assert got.shape == ref.shape
    assert np.array_equal(np.isnan(got), np.isnan(ref)), "NaN pattern differs"
    fin = np.isfinite(ref)
    assert np.array_equal(got[~fin], ref[~fin]), "infinities differ"
    num = np.linalg.norm(got[fin] - ref[fin])
    den = np.linalg.norm(ref[fin])
    return float(num / den) if den else float(num)


def inputs(op, shape, dtype, rng, axis=-1, scale=3.0):
    """Host float64 copies (exactly representable in dtype) and device arrays of dtype, in the
    op's order (a backward's dy, then y)."""
    dt = np_dtype(dtype)
    x = (rng.standard_normal(shape) * scale).astype(dt)
    if op in BWD:
        fwd = reference.softmax if op == "softmax_backward" else reference.log_softmax
        x = fwd(x.astype(np.float64), axis=axis).astype(dt)
        dy = rng.standard_normal(shape).astype(dt)
        return (dy.astype(np.float64), x.astype(np.float64)), (cp.asarray(dy), cp.asarray(x))
    return (x.astype(np.float64),), (cp.asarray(x),)


def check(op, host, dev, dtype, axis=-1, out=None):
    """Run op with a NaN-poisoned ``out`` and without ``out``; both must match the reference."""
    ref = getattr(reference, op)(*host, axis=axis)
    fn = getattr(cukern, op)
    poisoned = cp.full(dev[0].shape, np.nan, dtype=dev[0].dtype) if out is None else out
    if out is not None:
        out[...] = np.nan
    got = fn(*dev, axis=axis, out=poisoned)
    assert got is poisoned
    err = rel_err(got, ref)
    # a row's sums round like sqrt(n): TOL holds up to 2^18 values a row and grows beyond, as in
    # the norms' check_forward (float32 over 921600 columns: 2.4e-6 in one seed of the H200's)
    tol = TOL[dtype] * max(1.0, (dev[0].shape[axis] / 2**18) ** 0.5)
    assert err <= tol, f"{op} {dtype} {dev[0].shape} axis={axis}: rel err {err:.3g}"
    fresh = fn(*dev, axis=axis)
    assert fresh.dtype == dev[0].dtype and fresh.shape == dev[0].shape
    assert rel_err(fresh, ref) <= tol
    again = fn(*dev, axis=axis)  # the cached fast path
    assert again.data.ptr != fresh.data.ptr
    assert bool(cp.array_equal(again, fresh, equal_nan=True))
    return got


def spec():
    return cukern.DeviceSpec.from_device()


def smem_edge(op, dtype):
    """Columns a block of 128 threads holds beside its all-reduce's two buffers."""
    room = max_dynamic_smem(spec()) - block_tail(op, dtype, 128)
    return room // (ITEM[dtype] * policy(op).inputs)


def variant_shapes(op, dtype):
    """(shape, expected variant) on this device: every regime and its edges. A cluster's widest
    blocks (1024 threads) keep their all-reduce's two buffers of a state a warp (max and sum
    forward, a sum backward) beside their slice."""
    edge = smem_edge(op, dtype)
    wide = 16 // ITEM[dtype]
    scratch = cluster_tail(op, dtype, 1024)
    slice_edge = (max_dynamic_smem(spec()) - scratch) // (ITEM[dtype] * policy(op).inputs)
    cluster_cap = CLUSTER_SIZES[-1] * edge  # past it no slice fits, with or without buffers
    shapes = [((1, 1), Variant.WARP), ((2, 1), Variant.WARP), ((7, 2), Variant.WARP),
              ((8, 31), Variant.WARP), ((9, 32), Variant.WARP), ((10, 33), Variant.WARP),
              ((5, 64), Variant.WARP), ((3, 1023), Variant.WARP), ((4, 1024), Variant.WARP),
              ((300, 100), Variant.WARP),
              ((3, 1025), Variant.BLOCK_SMEM), ((6, 4096), Variant.BLOCK_SMEM),
              ((3, edge // wide * wide), Variant.BLOCK_SMEM)]
    # a row of edge - 1 off the 16-byte grid is sized for the packs it may span (Plan.shifted)
    span = shifted_cols(edge - 1, wide) if (edge - 1) % wide else edge - 1
    past = Variant.CLUSTER if spec().has_clusters else Variant.BLOCK_UNCACHED
    shapes.append(((2, edge - 1), Variant.BLOCK_SMEM if span <= edge else past))
    if spec().has_clusters:
        shapes += [((2, (edge // wide + 1) * wide), Variant.CLUSTER),
                   ((3, (3 * edge) // wide * wide), Variant.CLUSTER),
                   ((2, 8 * (edge // wide) * wide), Variant.CLUSTER),
                   ((2, CLUSTER_SIZES[-1] * (slice_edge // wide) * wide), Variant.CLUSTER)]
    shapes += [((2, cluster_cap + wide * 64), Variant.BLOCK_UNCACHED)]
    return shapes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", FWD + BWD)
def test_every_variant_at_its_edges(op, dtype, rng):
    for shape, variant in variant_shapes(op, dtype):
        plan = cukern.explain(op, shape, dtype)
        assert plan.variant is variant, (shape, plan)
        host, dev = inputs(op, shape, dtype, rng)
        check(op, host, dev, dtype)


def off_grid_shapes(op, dtype):
    """Rows off the 16-byte grid for every variant the shifted packs reach on this device."""
    edge = smem_edge(op, dtype)
    wide = 16 // ITEM[dtype]
    shapes = [(5, 769), (7, 1001), (300, 999), (3, 1017), (3, 1031), (4, 4099),
              (3, edge - wide - 1)]
    if spec().has_clusters:
        shapes += [(2, edge + 3), (3, 5 * edge // 2 // wide * wide + 1)]
    return shapes + [(2, CLUSTER_SIZES[-1] * edge + wide * 64 + 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", FWD + BWD)
def test_rows_off_the_grid_every_variant(op, dtype, rng):
    """Rows whose length is not a multiple of 16 bytes take 16-byte packs of memory, each row's
    end packs masked: every variant, poisoned out=, fresh results and the cached fast path."""
    seen = set()
    for shape in off_grid_shapes(op, dtype):
        plan = cukern.explain(op, shape, dtype)
        assert plan.shifted and plan.pack_size * ITEM[dtype] == 16, (shape, plan)
        seen.add(plan.variant)
        host, dev = inputs(op, shape, dtype, rng)
        check(op, host, dev, dtype)
        assert softmax_mod.last_plan(op).shifted
    want = {Variant.WARP, Variant.BLOCK_SMEM, Variant.BLOCK_UNCACHED}
    assert want | ({Variant.CLUSTER} if spec().has_clusters else set()) == seen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", FWD + BWD)
def test_rows_off_the_grid_leave_their_neighbours(op, dtype, rng):
    """Views whose rows start at every offset of a 16-byte word (row stride cols + 5, first
    column 3): out= at the same offsets takes the shifted packs, and the elements around its
    rows keep their sentinel; out= one element further on cannot, and is right too."""
    dt = np_dtype(dtype)
    for cols in (777, 1001, 6007, 70001):
        width = cols + 5
        sentinel = np.asarray(7.5, dt)
        arrays, host = [], []
        for _ in range(2 if op in BWD else 1):
            base = rng.standard_normal((9, width)).astype(dt)
            arrays.append(cp.asarray(base)[:, 3:3 + cols])
            host.append(base[:, 3:3 + cols].astype(np.float64))
        if op in BWD:  # dy, then y: a softmax output
            fwd = reference.softmax if op == "softmax_backward" else reference.log_softmax
            y = fwd(host[1]).astype(dt)
            arrays[1][...] = cp.asarray(y)
            host[1] = y.astype(np.float64)
        ref = getattr(reference, op)(*host)
        for start, shifted in ((3, True), (4, False)):
            big = cp.full((9, width), sentinel, dtype=dt)
            out = big[:, start:start + cols]
            getattr(cukern, op)(*arrays, out=out)
            assert softmax_mod.last_plan(op).shifted is shifted, (cols, start)
            err = rel_err(out, ref)
            assert err <= TOL[dtype], f"{op} {dtype} cols={cols} start={start}: {err:.3g}"
            around = cp.asnumpy(big).astype(np.float64)
            around[:, start:start + cols] = float(sentinel)
            assert (around == float(sentinel)).all(), (cols, start)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", FWD + BWD)
def test_uncached_at_short_rows(op, dtype, rng, monkeypatch):
    """The uncached kernel on ordinary rows, by making the block kernels unlaunchable."""
    from cukern import runner
    from cukern.ops import softmax as mod

    monkeypatch.setattr(runner, "driver_occupancy", lambda dev: (lambda plan: 0))
    monkeypatch.setattr(mod, "_launches", {})
    for shape in [(3, 1025), (5, 4097), (2, 20000)]:
        host, dev = inputs(op, shape, dtype, rng)
        check(op, host, dev, dtype)
        assert mod.last_plan(op).variant is Variant.BLOCK_UNCACHED


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_sum_to_one(dtype, rng):
    for cols in (7, 1000, 5000, 3 * smem_edge("softmax", dtype)):
        x = cp.asarray((rng.standard_normal((4, cols)) * 4).astype(np_dtype(dtype)))
        s = cukern.softmax(x).astype(cp.float64).sum(-1)
        assert float(cp.abs(s - 1).max()) < 20 * TOL[dtype] + 1e-12


@pytest.mark.parametrize("op", FWD)
def test_shift_invariance_and_huge_inputs(op, rng):
    x = rng.standard_normal((64, 777)).astype(np.float32)
    a = getattr(cukern, op)(cp.asarray(x))
    b = getattr(cukern, op)(cp.asarray(x + np.float32(1000.0)))
    ref = getattr(reference, op)(x.astype(np.float64))
    assert rel_err(a, ref) < TOL["float32"] and rel_err(b, ref) < 1e-4
    # float16 near its largest value: computed in float, nothing overflows
    h = (65000 + rng.uniform(-400, 400, (16, 3000))).astype(np.float16)
    y = getattr(cukern, op)(cp.asarray(h))
    assert bool(cp.isfinite(y).all())
    assert rel_err(y, getattr(reference, op)(h.astype(np.float64))) < TOL["float16"]


@pytest.mark.parametrize("cols", [5, 40, 3000, 70000])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_infinities_and_nan(cols, dtype, rng):
    x = rng.standard_normal((4, cols)).astype(np.float64)
    x[0, ::2] = -np.inf  # partly -inf: zeros there
    x[1, :] = -np.inf  # all -inf: NaN, as NumPy and PyTorch
    x[2, cols // 2] = np.nan  # NaN poisons its row
    x[3, : min(16, cols - 1)] = -np.inf  # leading packs of nothing but -inf
    d = cp.asarray(x.astype(np_dtype(dtype)))
    for op in FWD:
        got = cp.asnumpy(getattr(cukern, op)(d)).astype(np.float64)
        ref = getattr(reference, op)(x)
        assert np.isnan(got[1]).all() and np.isnan(got[2]).all()
        assert np.array_equal(np.isinf(got[0]), np.isinf(ref[0]))
        if op == "softmax":
            assert (got[0, ::2] == 0).all()
        assert rel_err(got[[0, 3]], ref[[0, 3]]) < TOL[dtype]
        if op == "softmax":
            assert (got[3, : min(16, cols - 1)] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", FWD + BWD)
def test_views_and_axes(op, dtype, rng):
    dt = np_dtype(dtype)
    cases = []
    for cols in (33, 1000, 4096, 70000):
        base = rng.standard_normal((6, cols + 24)).astype(dt)
        cases.append((base, lambda a, c=cols: a[:, :c], -1))  # row stride > cols
        cases.append((base, lambda a, c=cols: a[:, c // 3: c], -1))  # misaligned start
        cases.append((base, lambda a: a[:, ::2], -1))  # column stride 2
        cases.append((base, lambda a: a[:, ::-1], -1))  # negative stride
        cases.append((base, lambda a: a, 0))  # reduce over rows
    cube = rng.standard_normal((3, 50, 7)).astype(dt)
    cases += [(cube, lambda a: a, 0), (cube, lambda a: a, 1), (cube, lambda a: a, 2),
              (cube, lambda a: a.transpose(2, 0, 1), 1),
              (cube, lambda a: a.transpose(1, 0, 2)[:, :, ::2], 0)]  # not mergeable: copied
    for base, view, axis in cases:
        host_x = view(base).astype(np.float64)
        dev_x = view(cp.asarray(base))
        if op in BWD:
            fwd = reference.softmax if op == "softmax_backward" else reference.log_softmax
            y_base = fwd(base.astype(np.float64), axis=-1).astype(dt)
            dy_base = rng.standard_normal(base.shape).astype(dt)
            host = (view(dy_base).astype(np.float64), view(y_base).astype(np.float64))
            dev = (view(cp.asarray(dy_base)), view(cp.asarray(y_base)))
        else:
            host, dev = (host_x,), (dev_x,)
        check(op, host, dev, dtype, axis=axis)


def test_out_may_be_a_view(rng):
    x = rng.standard_normal((40, 300)).astype(np.float32)
    big = cp.full((40, 512), 7.0, cp.float32)
    out = big[:, 100:400]
    cukern.softmax(cp.asarray(x), out=out)
    assert rel_err(out, reference.softmax(x.astype(np.float64))) < TOL["float32"]
    assert bool((big[:, :100] == 7).all()) and bool((big[:, 400:] == 7).all())
    out_t = cp.empty((300, 40), cp.float32).T
    cukern.log_softmax(cp.asarray(x), out=out_t)
    assert rel_err(out_t, reference.log_softmax(x.astype(np.float64))) < TOL["float32"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("log", [False, True])
def test_backwards_take_dy_first(dtype, log, rng):
    """softmax_backward(dy, y) and log_softmax_backward(dy, y): the gradient first, as every
    cukern backward and PyTorch's _softmax_backward_data. The formulas are written out here
    (the reference's order changed with the ops'); swapped arguments give other numbers."""
    dt = np_dtype(dtype)
    fn = cukern.log_softmax_backward if log else cukern.softmax_backward
    for shape in [(9, 33), (5, 3000), (3, 20000)]:
        y = (reference.log_softmax if log else reference.softmax)(
            rng.standard_normal(shape) * 2).astype(dt)
        dy = rng.standard_normal(shape).astype(dt)
        y64, dy64 = y.astype(np.float64), dy.astype(np.float64)
        if log:
            want = dy64 - np.exp(y64) * dy64.sum(-1, keepdims=True)
        else:
            want = (dy64 - (dy64 * y64).sum(-1, keepdims=True)) * y64
        dy_d, y_d = cp.asarray(dy), cp.asarray(y)
        out = cp.full(shape, np.nan, dt)
        assert fn(dy_d, y_d, -1, out=out) is out
        assert rel_err(out, want) <= TOL[dtype], f"{dtype} {shape}"
        fresh = fn(dy_d, y_d)
        assert rel_err(fresh, want) <= TOL[dtype]
        assert bool(cp.array_equal(fn(dy=dy_d, y=y_d), fresh, equal_nan=True))
        swapped = cp.asnumpy(fn(y_d, dy_d)).astype(np.float64)  # may overflow: no rel_err
        assert not np.allclose(swapped, want, rtol=0.1, atol=0.1 * np.abs(want).max())


def test_empty_and_scalar():
    for shape in [(0, 5), (5, 0), (0,), (2, 0, 3)]:
        x = cp.empty(shape, cp.float32)
        assert cukern.softmax(x).shape == shape
        assert cukern.softmax_backward(x, x).shape == shape
    y = cukern.softmax(cp.asarray(np.float32(3.0)))
    assert y.shape == () and float(y) == 1.0
    assert float(cukern.log_softmax(cp.asarray(np.float64(3.0)))) == 0.0


# ---------------------------------------------------------------------------------------------
# DLPack hand-offs.

@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_round_trip(dtype, rng):
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype)
    t = torch.randn(257, 1000, device="cuda", dtype=tdt) * 3
    y = cukern.softmax(t)
    assert isinstance(y, torch.Tensor) and y.dtype == tdt and y.device == t.device
    ref = torch.softmax(t.double(), -1)
    assert float((y.double() - ref).norm() / ref.norm()) < TOL[dtype]
    dy = torch.randn_like(t)
    dx = cukern.softmax_backward(dy, y)
    yd = y.double()
    ref_dx = (dy.double() - (dy.double() * yd).sum(-1, keepdim=True)) * yd
    assert float((dx.double() - ref_dx).norm() / ref_dx.norm()) < TOL[dtype]
    out = torch.empty_like(t)
    assert cukern.log_softmax(t, out=out) is out
    ref = torch.log_softmax(t.double(), -1)
    assert float((out.double() - ref).norm() / ref.norm()) < TOL[dtype]
    # zero-copy: the result's memory is shared with a CuPy view
    assert cp.from_dlpack(y).data.ptr == y.data_ptr()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_jax_round_trip(dtype, rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x = jnp.asarray(rng.standard_normal((129, 2048)), dtype=getattr(jnp, dtype))
    y = cukern.log_softmax(x)
    assert isinstance(y, jax.Array) and y.dtype == x.dtype
    ref = reference.log_softmax(np.asarray(x.astype(jnp.float32)))
    assert rel_err(np.asarray(y.astype(jnp.float32)).astype(np.float64), ref) < TOL[dtype]
    with pytest.raises(TypeError, match="immutable"):
        cukern.softmax(x, out=x)


# ---------------------------------------------------------------------------------------------
# Streams and graphs.

def test_user_stream_and_graph_capture(rng):
    x = cp.asarray(rng.standard_normal((1000, 3000)).astype(np.float32))
    y = cp.empty_like(x)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cukern.softmax(x, out=y)  # plan and compile outside the capture
        stream.synchronize()
        assert rel_err(y, reference.softmax(cp.asnumpy(x).astype(np.float64))) < 1e-5
        stream.begin_capture()
        cukern.softmax(x, out=y)
        graph = stream.end_capture()
    new = rng.standard_normal((1000, 3000)).astype(np.float32)
    x.set(new)
    y.fill(np.nan)
    # the fill ran on the legacy default stream, which a non-blocking stream does not wait for
    cp.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    assert rel_err(y, reference.softmax(new.astype(np.float64))) < 1e-5


# ---------------------------------------------------------------------------------------------
# Bad input.

def test_bad_input_is_named():
    x = cp.ones((4, 8), cp.float32)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        cukern.softmax(np.ones((4, 8), np.float32))
    with pytest.raises(TypeError, match="int32"):
        cukern.softmax(cp.ones((4, 8), cp.int32))
    with pytest.raises(TypeError, match="complex64"):
        cukern.log_softmax(cp.ones((4, 8), cp.complex64))
    with pytest.raises(ValueError, match="axis 2"):
        cukern.softmax(x, axis=2)
    with pytest.raises(TypeError, match="axis must be an int"):
        cukern.softmax(x, axis=1.0)
    with pytest.raises(ValueError, match=r"out has shape \(4, 7\)"):
        cukern.softmax(x, out=cp.empty((4, 7), cp.float32))
    with pytest.raises(TypeError, match="out has dtype float16"):
        cukern.softmax(x, out=cp.empty((4, 8), cp.float16))
    with pytest.raises(ValueError, match="dy has shape"):
        cukern.softmax_backward(cp.ones((4, 9), cp.float32), x)
    with pytest.raises(TypeError, match="dy has dtype"):
        cukern.log_softmax_backward(cp.ones((4, 8), cp.float64), x)
    with pytest.raises(ValueError, match="overlap"):
        cukern.softmax(x, out=cp.broadcast_to(cp.empty((1, 8), cp.float32), (4, 8)))


@pytest.mark.parametrize("op", FWD + BWD)
def test_rows_past_the_longest_are_refused(op):
    """Rows of more than MAX_COLS = 2^31 - 4096 values are refused, along any axis, before
    anything is allocated (zero-stride views: no memory)."""
    pool = cp.get_default_memory_pool()
    first = "y" if op in BWD else "x"
    one = cp.zeros((1, 1), cp.float16)
    for cols in (MAX_COLS + 1, 2**31 - 1, 2**31):
        for shape, axis in (((1, cols), -1), ((cols, 2), 0)):
            x = cp.broadcast_to(one, shape)
            used = pool.used_bytes()
            with pytest.raises(ValueError, match=rf"{op}: {first} has shape \({shape[0]}, "
                                                 rf"{shape[1]}\): rows of {cols} along axis "
                                                 rf"{axis % 2}; at most 2147479552"):
                getattr(cukern, op)(*((x, x) if op in BWD else (x,)), axis=axis)
            assert pool.used_bytes() == used


def test_longest_row():
    """One row of MAX_COLS = 2^31 - 4096 float16 values, the longest the kernels take, read in
    single-element packs (a view one element off alignment), so that the kernels' 32-bit pack
    indices go furthest: 30 at both ends and the middle, zeros elsewhere; outputs poisoned.
    About 11 GB of GPU memory; leave it out with -k "not longest_row"."""
    free, _ = cp.cuda.runtime.memGetInfo()
    if free < (16 << 30):
        pytest.skip(f"needs about 16 GB of free GPU memory, {free >> 30} GB free")
    n = MAX_COLS
    x = cp.zeros((1, n + 1), cp.float16)[:, 1:]
    hot = (0, n // 2, n - 1)
    for i in hot:
        x[0, i] = 30
    y = cp.full((1, n), cp.nan, cp.float16)
    cukern.softmax(x, out=y)
    plan = softmax_mod.last_plan("softmax")
    assert (plan.variant, plan.pack_size, plan.cols) == (Variant.BLOCK_UNCACHED, 1, n)
    assert int(cp.count_nonzero(y)) == 3  # exp(-30) / 3 is 0 in float16; no NaN left
    np.testing.assert_allclose(cp.asnumpy(y[0, list(hot)]).astype(np.float64), 1 / 3,
                               rtol=1e-3)
    y.fill(cp.nan)
    cukern.log_softmax(x, out=y)
    assert softmax_mod.last_plan("log_softmax").pack_size == 1
    lse = 30 + np.log(3 + (n - 3) * np.exp(-30.0))
    np.testing.assert_allclose(cp.asnumpy(y[0, list(hot)]).astype(np.float64), 30 - lse,
                               atol=2e-3)
    cold = float(y[0, 1])
    assert abs(cold + lse) <= 0.02
    assert int(cp.count_nonzero(y == cp.float16(cold))) == n - 3


def test_arrays_on_different_devices():
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    x = cp.ones((4, 8), cp.float32)
    with cp.cuda.Device(1):
        y = cp.ones((4, 8), cp.float32)
    with pytest.raises(ValueError, match="GPU"):
        cukern.softmax_backward(x, y)


# ---------------------------------------------------------------------------------------------
# Every variant pinned on shapes the planner would give to another, with small grids so the
# grid-stride loops turn over, and clusters whose slices are partly empty.

def pinned_plans(op, dtype, rows, cols):
    from dataclasses import replace

    from cukern import plan as planner

    dev = spec()
    pack = planner.pack_size(dtype, cols, 16, False)
    warp = planner.plan_rowwise(op, rows, min(cols, 1024), dtype, dev)
    common = dict(rows=rows, cols=cols, pack_size=pack, cols_per_thread=0,
                  thread_group_width=0, rows_per_access=0, padding=False)
    plans = []
    if cols <= 1024:
        plans.append(replace(planner.plan_rowwise(op, rows, cols, dtype, dev), grid=1))
    inputs = policy(op).inputs
    template = replace(warp, variant=Variant.BLOCK_SMEM, block=(128, 1), grid=2,
                       smem_bytes=cols * ITEM[dtype] * inputs, **common)
    for t in (128, 256, 512, 1024):  # the row, then the all-reduce's buffers from 16 bytes on
        smem = -(-template.smem_bytes // 16) * 16 + block_tail(op, dtype, t)
        if smem <= max_dynamic_smem(dev):
            plans.append(replace(template, block=(t, 1), smem_bytes=smem))
    plans.append(replace(template, variant=Variant.BLOCK_UNCACHED, block=(1024, 1),
                         smem_bytes=0))
    if dev.has_clusters:
        for size, threads in itertools.product(CLUSTER_SIZES, (128, 1024)):
            per = -(-(cols // pack) // size)
            cache = -(-per * pack * ITEM[dtype] * inputs // 16) * 16
            plans.append(replace(template, variant=Variant.CLUSTER, cluster=size, grid=2 * size,
                                 block=(threads, 1),
                                 smem_bytes=cache + cluster_tail(op, dtype, threads)))
    if pack * ITEM[dtype] < 16 and cols > 1:  # the same in shifted 16-byte packs
        wide = 16 // ITEM[dtype]
        span = shifted_cols(cols, wide)
        for p in list(plans):
            if p.variant is Variant.WARP:
                shifted = planner.plan_rowwise(op, rows, cols, dtype, dev)
                if shifted.shifted:
                    plans.append(replace(shifted, grid=1))
                continue
            smem = p.smem_bytes
            if p.variant is Variant.BLOCK_SMEM:
                smem = -(-span * ITEM[dtype] * inputs // 16) * 16 + block_tail(op, dtype,
                                                                               p.threads)
            elif p.variant is Variant.CLUSTER:
                per = -(-(span // wide) // p.cluster) * wide
                smem = -(-per * ITEM[dtype] * inputs // 16) * 16 + cluster_tail(op, dtype,
                                                                                p.threads)
            if smem <= max_dynamic_smem(dev):
                plans.append(replace(p, pack_size=wide, shifted=True, smem_bytes=smem))
    return plans


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", FWD + BWD)
def test_pinned_variants(op, dtype, rng):
    from cukern.ops.softmax import run_plan

    for rows, cols in [(5, 1), (3, 7), (4, 64), (3, 1000), (5, 1025), (3, 4099), (2, 20000)]:
        host, dev = inputs(op, (rows, cols), dtype, rng)
        ref = getattr(reference, op)(*host)
        for plan in pinned_plans(op, dtype, rows, cols):
            out = cp.full((rows, cols), np.nan, dtype=dev[0].dtype)
            run_plan(plan, *dev, out=out)
            err = rel_err(out, ref)
            assert err <= TOL[dtype], f"{plan.name_expression()} {rows}x{cols}: {err:.3g}"

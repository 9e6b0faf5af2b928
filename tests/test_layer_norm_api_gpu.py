"""The norms' API on the GPU against float64 NumPy: y alone unless return_stats=True, dbias
for a bias-only layer norm (in every way the backward sums its columns), and ``out=``
(contiguous, strided rows, other layouts through a temporary, in place, the refusals)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import cukern
from cukern import reference, runner
from cukern.ops import layer_norm as ln_mod

from .conftest import DTYPES, TOL
from .test_layer_norm_gpu import (
    STAT_TOL,
    backward_stats,
    check_backward,
    col_sums_shapes,
    host,
    make,
    np_dtype,
    poison,
    rel_err,
)

cp = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("warm_layer_norm")]

FWD = ("layer_norm", "rms_norm")
# rows held in registers, cached in shared memory, past shared memory (cluster on sm_90)
SHAPES = [(7, 64), (5, 3000), (3, 70000), (2, 262144)]


def _args(op, x, dtype, rng, params=True):
    """(host arguments, device arguments) after x: weight (and bias) and eps."""
    cols = x.shape[-1]
    w = make(cols, dtype, rng, 1.0, 1.0) if params else None
    hb = (make(cols, dtype, rng, 1.0, 0.0) if params else None,) if op == "layer_norm" else ()
    host_args = (w, *hb, 1e-5 if op == "layer_norm" else 1e-6)
    dev_args = tuple(cp.asarray(a) if isinstance(a, np.ndarray) else a for a in host_args)
    return host_args, dev_args


def _tol(dtype, cols):
    """check_forward's bound: TOL, growing like sqrt(n) past 2^18 values a row."""
    return TOL[dtype] * max(1.0, (cols / 2**18) ** 0.5)


# ---------------------------------------------------------------------------------------------
# A backward whose main kernel writes one partial row of column sums.

@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("op", ["layer_norm_backward", "rms_norm_backward"])
@pytest.mark.parametrize("dtype,wdtype", [("float32", "float32"), ("float64", "float64"),
                                          ("float16", "float32"), ("bfloat16", "bfloat16")])
def test_one_partial_row_is_dweight_itself(op, dtype, wdtype, rows, rng, monkeypatch):
    """Where the column sums come to one partial row (one row, or one block of the warp
    kernel), dweight (and dbias) in the sums' dtype (float32, float64 for float64 x) are that
    row, written by the main kernel (or the separate column-sum kernel) with no reduction
    launch; 16-bit parameters, and several partial rows, still go through the reduction. Full
    path and fast path, fresh data and NaN-poisoned outputs each call, against float64 NumPy."""
    reduces = []
    real = runner.AuxLaunch.__call__
    monkeypatch.setattr(runner.AuxLaunch, "__call__",
                        lambda self, *a: reduces.append(self) or real(self, *a))
    monkeypatch.setattr(ln_mod, "_fresh", runner.BoundedDict())
    full = []
    checked = ln_mod._backward_checked
    monkeypatch.setattr(ln_mod, "_backward_checked",
                        lambda *a, **k: full.append(1) or checked(*a, **k))
    sums_dtype = np_dtype(wdtype) == np.dtype(np.float64 if dtype == "float64" else np.float32)
    cols = 40
    for call in ("full", "fast"):
        x, dy = make((rows, cols), dtype, rng), make((rows, cols), dtype, rng, 1.0, 0.1)
        w = make(cols, wdtype, rng, 1.0, 1.0)
        x64, dy64, w64 = (a.astype(np.float64) for a in (x, dy, w))
        stats = backward_stats(op, x64, dtype)
        ref = getattr(reference, op)(dy64, x64, *[s.astype(np.float64) for s in stats], w64)
        poison(((rows, cols), 8), ((cols,), 8), ((cols,), 8))
        del reduces[:]
        got = getattr(cukern, op)(cp.asarray(dy), cp.asarray(x), *map(cp.asarray, stats),
                                  cp.asarray(w))
        launch = next(v for v in ln_mod._launches.values()
                      if v.main.plan is ln_mod.last_plan(op))
        assert launch.grad is not None and (rows > 1 or launch.grad.prows == 1), launch.grad
        direct = sums_dtype and launch.grad.prows == 1
        reduced = [r for r in reduces if r is launch.reduce]
        assert bool(reduced) != direct, f"{call}: {len(reduced)} reduction launches"
        assert len(full) == 1, f"{call}: the full path ran {len(full)} times"
        assert len(got) == len(ref)
        for name, g, r in zip(("dx", "dweight", "dbias"), got, ref):
            assert g.dtype == (np_dtype(dtype) if name == "dx" else np_dtype(wdtype)), name
            err = rel_err(g, r)
            assert err <= TOL[dtype], f"{call} {name}: rel err {err:.3g}"


# ---------------------------------------------------------------------------------------------
# y alone by default (as torch.nn.functional.layer_norm); the statistics on request.

@pytest.mark.parametrize("op", FWD)
def test_y_alone_unless_return_stats(op, rng):
    x = make((6, 40), "float32", rng)
    r = make((6, 40), "float32", rng)
    hargs, dargs = _args(op, x, "float32", rng)
    xd, rd = cp.asarray(x), cp.asarray(r)
    n_stats = 2 if op == "layer_norm" else 1
    y = getattr(cukern, op)(xd, 40, *dargs)
    assert isinstance(y, cp.ndarray) and y.shape == (6, 40)
    ref = getattr(reference, op)(x, 40, *hargs, return_stats=True)
    assert rel_err(y, ref[0]) <= TOL["float32"]
    full = getattr(cukern, op)(xd, 40, *dargs, return_stats=True)
    assert len(full) == 1 + n_stats and bool(cp.array_equal(full[0], y))
    for got, want in zip(full[1:], ref[1:]):
        assert got.shape == (6,) and rel_err(got, want) <= STAT_TOL["float32"]
    y2, h = getattr(cukern, op)(xd, 40, *dargs, residual=rd)  # (y, h) with a residual
    np.testing.assert_array_equal(host(h), host(xd + rd))
    assert len(getattr(cukern, op)(xd, 40, *dargs, residual=rd, return_stats=True)) == 2 + n_stats
    np.testing.assert_allclose(host(y2), host(getattr(cukern, op)(h, 40, *dargs)), rtol=1e-6,
                               atol=1e-6)


# ---------------------------------------------------------------------------------------------
# A bias-only layer norm gets dbias.

@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_only_backward_gives_dbias(dtype, rng):
    """dbias = dy summed over rows in float32 (float64 for float64), in bias's dtype, in every
    way the weighted backward sums its columns; dweight is None; dx as without parameters."""
    op = "layer_norm_backward"
    for shape, _ in col_sums_shapes(op, dtype):
        x = make(shape, dtype, rng)
        dy = make(shape, dtype, rng, 1.0, 0.1)
        b = make(shape[-1], dtype, rng, 1.0, 0.0)
        dx, dw, db = check_backward(op, x, dy, None, dtype, b=b)
        assert dw is None and db.dtype == np_dtype(dtype)
        assert rel_err(db, dy.astype(np.float64).sum(0)) <= TOL[dtype]


def test_bias_only_matches_the_other_forms(rng):
    """Several normalised dimensions; dbias equals what a weight of ones gives, dx what the
    backward without parameters gives; rows of none give zeros."""
    x = cp.asarray(make((4, 3, 10, 16), "float32", rng))
    dy = cp.asarray(make((4, 3, 10, 16), "float32", rng, 1.0, 0.1))
    b = cp.asarray(make((10, 16), "float32", rng))
    _, mean, rstd = cukern.layer_norm(x, (10, 16), None, b, return_stats=True)
    dx, dw, db = cukern.layer_norm_backward(dy, x, mean, rstd, None, b)
    assert dw is None and db.shape == (10, 16)
    np.testing.assert_allclose(host(db), host(dy).sum((0, 1)), rtol=1e-5, atol=1e-5)
    dx0, dw0, db0 = cukern.layer_norm_backward(dy, x, mean, rstd)
    assert dw0 is None and db0 is None
    np.testing.assert_allclose(host(dx), host(dx0), rtol=1e-5, atol=1e-6)
    _, _, db1 = cukern.layer_norm_backward(dy, x, mean, rstd, cp.ones((10, 16), cp.float32), b)
    np.testing.assert_array_equal(host(db), host(db1))
    empty = cp.empty((0, 10, 16), cp.float32)
    stats = cp.empty(0, cp.float32)
    _, dw, db = cukern.layer_norm_backward(empty, empty, stats, stats, None, b)
    assert dw is None and db.shape == (10, 16) and not bool(db.any())


def test_bias_is_checked_like_weight():
    x = cp.ones((4, 8), cp.float32)
    mean, rstd = cp.zeros(4, cp.float32), cp.ones(4, cp.float32)
    bwd = cukern.layer_norm_backward
    with pytest.raises(ValueError, match=r"layer_norm_backward: bias has shape \(7,\), "
                                         r"expected \(8,\)"):
        bwd(x, x, mean, rstd, None, cp.ones(7, cp.float32))
    with pytest.raises(ValueError, match=r"bias has shape \(4,\), expected \(8,\)"):
        bwd(x, x, mean, rstd, cp.ones(8, cp.float32), cp.ones(4, cp.float32))
    with pytest.raises(TypeError, match="bias has dtype float16, expected float32"):
        bwd(x, x, mean, rstd, None, cp.ones(8, cp.float16))
    with pytest.raises(TypeError, match="bias must be a CuPy array"):
        bwd(x, x, mean, rstd, None, np.ones(8, np.float32))


# ---------------------------------------------------------------------------------------------
# out=.

def _check_out(op, x, dtype, rng, make_out, **kw):
    """Run op into ``make_out(shape, dtype)`` (NaN-poisoned) and check y; returns the result."""
    hargs, dargs = _args(op, x, dtype, rng)
    cols = x.shape[-1]
    ref = getattr(reference, op)(x, cols, *hargs)
    out = make_out(x.shape, np_dtype(dtype))
    got = getattr(cukern, op)(cp.asarray(x), cols, *dargs, out=out, **kw)
    y = got[0] if isinstance(got, tuple) else got
    assert y is out
    err = rel_err(out, ref)
    assert err <= _tol(dtype, cols), f"{op} {dtype} {x.shape}: y rel err {err:.3g}"
    return got


def _fresh(shape, dt):
    return cp.full(shape, np.nan, dt)


def _rows_in(pad):
    """out= as rows of a wider NaN array starting ``pad`` columns in (the rest checked)."""
    def make_out(shape, dt):
        big = cp.full((shape[0], shape[1] + 2 * pad + 16), np.nan, dt)
        return big[:, pad:pad + shape[1]]  # out.base is big
    return make_out


def _transposed(shape, dt):
    """out= whose rows are not contiguous (written through a temporary)."""
    return cp.full(shape[::-1], np.nan, dt).T


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", FWD)
def test_out(op, dtype, rng):
    for shape in SHAPES:
        x = make(shape, dtype, rng)
        _check_out(op, x, dtype, rng, _fresh)
        for pad in (32, 1):  # aligned rows, and rows one element off
            out = _check_out(op, x, dtype, rng, _rows_in(pad))
            y = out[0] if isinstance(out, tuple) else out
            around = cp.concatenate([y.base[:, :pad].ravel(), y.base[:, pad + shape[1]:].ravel()])
            assert bool(cp.isnan(around).all()), "out= wrote outside its elements"
        _check_out(op, x, dtype, rng, _transposed)


@pytest.mark.parametrize("op", FWD)
def test_out_in_place_and_with_the_other_results(op, rng, monkeypatch):
    """out=x (in place) in every variant, the uncached one included; the statistics and h
    beside an out=."""
    for uncached in (False, True):
        if uncached:
            monkeypatch.setattr(runner, "driver_occupancy", lambda dev: (lambda plan: 0))
            monkeypatch.setattr(ln_mod, "_launches", {})
            monkeypatch.setattr(ln_mod, "_fresh", {})
        for shape in (SHAPES if not uncached else [(5, 3000)]):
            x = make(shape, "float16", rng)
            hargs, dargs = _args(op, x, "float16", rng)
            ref = getattr(reference, op)(x, shape[-1], *hargs, return_stats=True)
            xd = cp.asarray(x)
            got = getattr(cukern, op)(xd, shape[-1], *dargs, out=xd, return_stats=True)
            assert got[0] is xd
            assert rel_err(xd, ref[0]) <= _tol("float16", shape[-1]), (shape, uncached)
            assert rel_err(got[-1], ref[-1]) <= STAT_TOL["float16"]  # rstd
            if op == "layer_norm":  # the mean against its size or the row's deviation
                size = np.abs(ref[1]) + 1 / ref[2]
                assert np.all(np.abs(host(got[1]) - ref[1]) <= STAT_TOL["float16"] * size)
    x = make((6, 500), "float32", rng)
    r = make((6, 500), "float32", rng)
    hargs, dargs = _args(op, x, "float32", rng)
    out = _fresh(x.shape, np.float32)
    y, h = getattr(cukern, op)(cp.asarray(x), 500, *dargs, residual=cp.asarray(r), out=out)
    assert y is out
    assert rel_err(out, getattr(reference, op)(x, 500, *hargs, residual=r)[0]) <= TOL["float32"]
    np.testing.assert_array_equal(host(h), (x + r).astype(np.float64))


def test_out_refusals(rng):
    x = cp.asarray(make((4, 8), "float32", rng))
    w = cp.ones(8, cp.float32)
    for op in FWD:
        f = getattr(cukern, op)
        with pytest.raises(ValueError, match=rf"{op}: out has shape \(4, 9\), expected \(4, 8\)"):
            f(x, 8, out=cp.empty((4, 9), cp.float32))
        with pytest.raises(TypeError, match=rf"{op}: out has dtype float16, expected float32"):
            f(x, 8, out=cp.empty((4, 8), cp.float16))
        with pytest.raises(ValueError, match="out has overlapping elements"):
            f(x, 8, out=cp.broadcast_to(cp.empty((1, 8), cp.float32), (4, 8)))
        with pytest.raises(TypeError, match="out must be a CuPy array"):
            f(x, 8, out=np.empty((4, 8), np.float32))
        base = cp.zeros((4, 9), cp.float32)
        with pytest.raises(ValueError, match=rf"{op}: out overlaps an input"):
            f(base[:, :8], 8, out=base[:, 1:])
        r = cp.ones((4, 8), cp.float32)
        with pytest.raises(ValueError, match=rf"{op}: out overlaps residual"):
            f(x, 8, residual=r, out=r)
        buf = cp.zeros((5, 8), cp.float32)
        with pytest.raises(ValueError, match=rf"{op}: out overlaps weight"):
            f(x, 8, buf[0], out=buf[:4])
        assert not bool(buf.any())  # nothing written before the refusal
    buf = cp.zeros((5, 8), cp.float32)
    with pytest.raises(ValueError, match="layer_norm: out overlaps bias"):
        cukern.layer_norm(x, 8, w, buf[4], out=buf[1:])


def test_out_torch_and_jax(rng):
    torch = pytest.importorskip("torch")
    x = torch.randn(33, 700, device="cuda") * 2 + 1
    w = torch.randn(700, device="cuda") + 1
    out = torch.full_like(x, math.nan)
    assert cukern.rms_norm(x, 700, w, out=out) is out
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert float((out.double() - ref).norm() / ref.norm()) < TOL["float32"]
    y, mean, rstd = cukern.layer_norm(x, 700, w, out=out, return_stats=True)
    assert y is out and isinstance(mean, torch.Tensor) and mean.shape == (33,)
    jax = pytest.importorskip("jax")
    jx = jax.numpy.asarray(np.ones((4, 8), np.float32))
    with pytest.raises(TypeError, match="out= is not supported for JAX arrays"):
        cukern.layer_norm(jx, 8, out=jax.numpy.zeros((4, 8), np.float32))
    with pytest.raises(TypeError, match="JAX arrays are immutable"):
        cukern.rms_norm(cp.ones((4, 8), cp.float32), 8, out=jx)


def test_out_leaves_the_fast_path_alone(rng):
    """A call with out= neither uses nor fills the fast path's cache; the next call without
    out= still returns a fresh array."""
    x = cp.asarray(make((16, 256), "float32", rng))
    y0 = cukern.layer_norm(x, 256)
    entries = len(ln_mod._fresh)
    out = cp.full((16, 256), np.nan, cp.float32)
    cukern.layer_norm(x, 256, out=out)
    assert len(ln_mod._fresh) == entries
    np.testing.assert_array_equal(host(out), host(y0))
    y1 = cukern.layer_norm(x, 256)
    assert y1.data.ptr != out.data.ptr and bool(cp.array_equal(y1, y0))

"""One API convention, PyTorch's where it has one, without a GPU: every backward takes dy
first; the norms return y alone unless return_stats=True; a bias-only layer norm gets dbias;
the norms' out= and bias checks (on NumPy arrays posing as device arrays); float32 parameters
with 16-bit data."""

from __future__ import annotations

import inspect
import types

import numpy as np
import pytest

import cukern
from cukern import reference, registry, runner
from cukern.ops import _norm_args

from .test_layer_norm_cpu import _fd

BACKWARDS = [name for name, op in registry.OPS.items() if op.is_backward]


# ---------------------------------------------------------------------------------------------
# dy first.

@pytest.mark.parametrize("op", BACKWARDS)
def test_every_backward_takes_dy_first(op):
    spec = registry.get(op)
    assert spec.inputs[0] == "dy", spec.inputs
    for fn in (spec.fn, spec.reference):
        assert next(iter(inspect.signature(fn).parameters)) == "dy", (op, fn)


@pytest.mark.parametrize("op", ["softmax_backward", "log_softmax_backward"])
def test_dask_softmax_backwards_take_dy_first(op):
    cd = pytest.importorskip("cukern.dask")
    assert list(inspect.signature(getattr(cd, op)).parameters)[:2] == ["dy", "y"]


@pytest.mark.parametrize("log", [False, True])
def test_reference_softmax_backwards_take_dy_first(rng, log):
    """Against the formulas written out: swapped (y, dy) give other numbers."""
    y = (reference.log_softmax if log else reference.softmax)(rng.standard_normal((5, 9)))
    dy = rng.standard_normal((5, 9))
    if log:
        want = dy - np.exp(y) * dy.sum(-1, keepdims=True)
        got = reference.log_softmax_backward(dy, y)
    else:
        want = (dy - (dy * y).sum(-1, keepdims=True)) * y
        got = reference.softmax_backward(dy, y)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    fn = reference.log_softmax_backward if log else reference.softmax_backward
    assert not np.allclose(fn(y, dy), want)


# ---------------------------------------------------------------------------------------------
# y alone by default.

def _defaults():
    fns = [cukern.layer_norm, cukern.rms_norm, reference.layer_norm, reference.rms_norm]
    try:
        import cukern.dask as cd
    except ImportError:  # pragma: no cover - Dask is optional
        return fns
    return fns + [cd.layer_norm, cd.rms_norm]


@pytest.mark.parametrize("fn", _defaults(), ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_norms_return_y_alone_by_default(fn):
    assert inspect.signature(fn).parameters["return_stats"].default is False


def test_reference_norm_return_forms(rng):
    x, r = rng.standard_normal((4, 8)), rng.standard_normal((4, 8))
    assert isinstance(reference.layer_norm(x, 8), np.ndarray)
    assert isinstance(reference.rms_norm(x, 8), np.ndarray)
    assert len(reference.layer_norm(x, 8, residual=r)) == 2
    assert len(reference.layer_norm(x, 8, return_stats=True)) == 3
    assert len(reference.rms_norm(x, 8, residual=r, return_stats=True)) == 3
    np.testing.assert_array_equal(reference.layer_norm(x, 8),
                                  reference.layer_norm(x, 8, return_stats=True)[0])


def test_public_signatures():
    params = list(inspect.signature(cukern.layer_norm_backward).parameters)
    assert params == ["dy", "x", "mean", "rstd", "weight", "bias"]
    for fn in (cukern.layer_norm, cukern.rms_norm):
        p = inspect.signature(fn).parameters["out"]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is None


# ---------------------------------------------------------------------------------------------
# A bias-only layer norm gets dbias.

def test_reference_bias_only_dbias(rng):
    """dbias is dy summed over the leading dimensions (finite differences of the forward in
    the bias); dweight None; dx as without parameters."""
    x = rng.standard_normal((3, 4, 2, 5)) * 2 + 1
    dy = rng.standard_normal(x.shape)
    b = rng.standard_normal((2, 5))
    _, mean, rstd = reference.layer_norm(x, (2, 5), None, b, 1e-2, return_stats=True)
    dx, dw, db = reference.layer_norm_backward(dy, x, mean, rstd, None, b)
    assert dw is None and db.shape == (2, 5)
    np.testing.assert_allclose(db, dy.sum((0, 1)), rtol=1e-12)
    fd = _fd(lambda bb: np.sum(dy * reference.layer_norm(x, (2, 5), None, bb, 1e-2)), b)
    np.testing.assert_allclose(db, fd, rtol=1e-6, atol=1e-8)
    dx0, dw0, db0 = reference.layer_norm_backward(dy, x, mean, rstd)
    assert dw0 is None and db0 is None
    np.testing.assert_array_equal(dx, dx0)
    # with a weight the bias changes nothing
    w = rng.standard_normal((2, 5))
    with_w = reference.layer_norm_backward(dy, x, mean, rstd, w)
    for a, c in zip(reference.layer_norm_backward(dy, x, mean, rstd, w, b), with_w):
        np.testing.assert_array_equal(a, c)


def test_dask_bias_only_dbias(rng):
    pytest.importorskip("dask")
    import dask
    import dask.array as da

    import cukern.dask as cd

    x = rng.standard_normal((40, 3, 6)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    b = rng.standard_normal((3, 6)).astype(np.float32)
    xa, dya = (da.from_array(a, chunks=(7, -1, -1)) for a in (x, dy))
    _, mean, rstd = cd.layer_norm(xa, (3, 6), None, b, return_stats=True)
    dx, dw, db = cd.layer_norm_backward(dya, xa, mean, rstd, None, b)
    assert dw is None
    dx, db, mean, rstd = dask.compute(dx, db, mean, rstd)
    ref = reference.layer_norm_backward(dy, x, mean, rstd, None, b)
    assert db.dtype == np.float32 and db.shape == (3, 6)
    np.testing.assert_allclose(db, ref[2], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, ref[0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"layer_norm_backward: bias has shape \(6,\), "
                                         r"expected \(3, 6\)"):
        cd.layer_norm_backward(dya, xa, mean, rstd, None, np.ones(6, np.float32))
    with pytest.raises(TypeError, match="bias has dtype float64, expected float32"):
        cd.layer_norm_backward(dya, xa, mean, rstd, None, np.ones((3, 6)))
    with pytest.raises(TypeError, match="bias must be an array, got list"):
        cd.layer_norm_backward(dya, xa, mean, rstd, None, [1.0] * 6)


# ---------------------------------------------------------------------------------------------
# The norms' argument checks, on NumPy arrays posing as device arrays.

class _Dev(np.ndarray):
    """A NumPy array with CuPy's ``.data.ptr`` and ``.data.device_id``."""

    device_id = 0

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0],
                                     device_id=self.device_id)


def _dev(a, device_id=0):
    d = np.asarray(a).view(_Dev)
    d.device_id = device_id
    return d


@pytest.fixture
def posing(monkeypatch):
    """runner.adapt takes _Dev arrays as CuPy ones; overlap is NumPy's may_share_memory."""
    def adapt(fn, arg, x, *, out=False):
        if not isinstance(x, _Dev):
            raise TypeError(f"{fn}: {arg} must be a CuPy array, got {type(x).__name__}")
        return runner.Adapted(x, "cupy")

    monkeypatch.setattr(runner, "adapt", adapt)
    monkeypatch.setattr(runner, "cp", types.SimpleNamespace(may_share_memory=np.may_share_memory))


def test_bias_checked_like_weight(posing):
    x = _dev(np.zeros((4, 8), np.float32))
    op = "layer_norm_backward"
    assert _norm_args.param(op, "bias", _dev(np.ones(8, np.float32)), x, (8,)).shape == (8,)
    with pytest.raises(ValueError, match=r"layer_norm_backward: bias has shape \(7,\), "
                                         r"expected \(8,\) \(normalized_shape\)"):
        _norm_args.param(op, "bias", _dev(np.ones(7, np.float32)), x, (8,))
    with pytest.raises(TypeError, match=r"layer_norm_backward: bias has dtype float16, "
                                        r"expected float32 for float32 x"):
        _norm_args.param(op, "bias", _dev(np.ones(8, np.float16)), x, (8,))
    with pytest.raises(ValueError, match="layer_norm_backward: bias is on GPU 1 but x is on "
                                         "GPU 0"):
        _norm_args.param(op, "bias", _dev(np.ones(8, np.float32), 1), x, (8,))


def test_out_overlap_checks(posing):
    base = np.zeros((6, 9), np.float32)
    x = _dev(base[:4, :8])
    r, w, b = _dev(base[4:5, :8].reshape(8)), _dev(np.ones(8, np.float32)), None
    check = _norm_args.check_out_overlap
    check("layer_norm", x, x, None, w, b)  # x itself: in place
    check("layer_norm", _dev(np.zeros((4, 8), np.float32)), x, None, w, b)
    with pytest.raises(ValueError, match="layer_norm: out overlaps an input without being that "
                                         "input"):
        check("layer_norm", _dev(base[:4, 1:]), x, None, w, b)
    res = _dev(np.ones((4, 8), np.float32))
    with pytest.raises(ValueError, match="rms_norm: out overlaps residual"):
        check("rms_norm", res, x, res, None, None)
    with pytest.raises(ValueError, match="layer_norm: out overlaps weight"):
        check("layer_norm", _dev(base[1:5, :8]), x[:1], None, r, None)
    with pytest.raises(ValueError, match="layer_norm: out overlaps bias"):
        check("layer_norm", _dev(base[1:5, :8]), x[:1], None, None, r)


def test_out_shape_dtype_and_kind(posing):
    x = runner.Adapted(_dev(np.zeros((4, 8), np.float32)), "cupy")
    with pytest.raises(ValueError, match=r"layer_norm: out has shape \(4, 9\), expected "
                                         r"\(4, 8\)"):
        runner.output("layer_norm", x, _dev(np.zeros((4, 9), np.float32)))
    with pytest.raises(TypeError, match="rms_norm: out has dtype float16, expected float32"):
        runner.output("rms_norm", x, _dev(np.zeros((4, 8), np.float16)))
    with pytest.raises(ValueError, match="out has overlapping elements"):
        runner.output("layer_norm", x, _dev(np.broadcast_to(np.zeros((1, 8), np.float32),
                                                            (4, 8))))
    jx = runner.Adapted(x.array, "jax")
    with pytest.raises(TypeError, match="out= is not supported for JAX arrays"):
        runner.output("layer_norm", jx, _dev(np.zeros((4, 8), np.float32)))


def test_explain_plans_a_bias_only_backward_as_weighted():
    """The bias-only backward runs the weighted kernels (a weight of ones): explain says so;
    rms_norm_backward still takes no bias."""
    h100 = cukern.DeviceSpec.h100()
    with_bias = cukern.explain("layer_norm_backward", (64, 8192), "float32", device=h100,
                               bias=True)
    weighted = cukern.explain("layer_norm_backward", (64, 8192), "float32", device=h100,
                              weight=True)
    assert with_bias == weighted and with_bias.switches.weight
    with pytest.raises(ValueError, match="rms_norm_backward takes no bias"):
        cukern.explain("rms_norm_backward", (4, 64), "float32", device=h100, bias=True)


# ---------------------------------------------------------------------------------------------
# Float32 parameters with float16 and bfloat16 data (the mixed-precision setup).

def _np_dtype(name):
    if name == "bfloat16":
        from ml_dtypes import bfloat16

        return np.dtype(bfloat16)
    return np.dtype(name)


@pytest.mark.parametrize("xdt", ["float16", "bfloat16", "float32", "float64"])
def test_norm_param_dtypes(posing, xdt):
    """weight and bias: x's dtype, or float32 for 16-bit x (batch norm's rule); anything else
    a TypeError naming the argument, its dtype and what x's dtype accepts."""
    x = _dev(np.zeros((4, 8), _np_dtype(xdt)))
    half = xdt in ("float16", "bfloat16")
    allowed = ["float32", xdt] if half else [xdt]
    assert [str(d) for d in _norm_args.param_dtypes(x.dtype)] == allowed
    for pdt in ("float16", "bfloat16", "float32", "float64"):
        p = _dev(np.ones(8, _np_dtype(pdt)))
        for op, name in (("layer_norm", "weight"), ("layer_norm_backward", "bias"),
                         ("rms_norm", "weight")):
            if pdt in allowed:
                assert _norm_args.param(op, name, p, x, (8,)) is p
                assert _norm_args.wide_params(p, x) == (pdt != xdt)
            else:
                with pytest.raises(TypeError, match=rf"{op}: {name} has dtype {pdt}, expected "
                                                    rf"{' or '.join(allowed)} for {xdt} x"):
                    _norm_args.param(op, name, p, x, (8,))


def test_norm_params_of_one_dtype():
    w32, b32, b16 = (np.ones(8, d) for d in (np.float32, np.float32, np.float16))
    _norm_args.check_same_params("layer_norm", w32, b32)
    _norm_args.check_same_params("layer_norm", None, b16)
    _norm_args.check_same_params("layer_norm", w32, None)
    with pytest.raises(TypeError, match="layer_norm: weight has dtype float32 but bias has "
                                        "dtype float16; pass both in one dtype"):
        _norm_args.check_same_params("layer_norm", w32, b16)
    assert not _norm_args.wide_params(None, np.ones(2, np.float16))


def test_dask_float32_params_of_float16_x(rng):
    """cukern.dask (NumPy blocks through the float64 reference) takes float32 parameters of
    float16 x: y in float16 with the float32 values (not rounded to float16), dweight and dbias
    back in float32; mixed or float64-x float32 parameters refused."""
    pytest.importorskip("dask")
    import dask
    import dask.array as da

    import cukern.dask as cd

    x = (rng.standard_normal((40, 64)) * 2 + 0.5).astype(np.float16)
    dy = rng.standard_normal(x.shape).astype(np.float16)
    w = (1 + rng.uniform(-0.5, 0.5, 64)).astype(np.float32)
    b = rng.uniform(-0.5, 0.5, 64).astype(np.float32)
    xa, dya = (da.from_array(a, chunks=(7, -1)) for a in (x, dy))
    y, mean, rstd = dask.compute(*cd.layer_norm(xa, 64, w, b, return_stats=True))
    assert y.dtype == np.float16
    ref = reference.layer_norm(x, 64, w, b)
    np.testing.assert_array_equal(y, ref.astype(np.float16))
    dx, dw, db = dask.compute(*cd.layer_norm_backward(dya, xa, mean, rstd, w, b))
    rdx, rdw, rdb = reference.layer_norm_backward(dy, x, mean, rstd, w, b)
    assert dx.dtype == np.float16 and dw.dtype == db.dtype == np.float32
    np.testing.assert_allclose(dw, rdw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, rdb, rtol=1e-5, atol=1e-5)
    dx, db = dask.compute(*cd.layer_norm_backward(dya, xa, mean, rstd, None, b)[::2])
    assert db.dtype == np.float32
    np.testing.assert_allclose(db, rdb, rtol=1e-5, atol=1e-5)
    (dw,) = dask.compute(cd.rms_norm_backward(dya, xa, rstd, w)[1])
    assert dw.dtype == np.float32
    with pytest.raises(TypeError, match="layer_norm: weight has dtype float32 but bias has "
                                        "dtype float16"):
        cd.layer_norm(xa, 64, w, b.astype(np.float16))
    with pytest.raises(TypeError, match="rms_norm: weight has dtype float32, expected float64 "
                                        "for float64 x"):
        cd.rms_norm(xa.astype(np.float64), 64, w)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "layer_norm_backward",
                                "rms_norm_backward"])
def test_float32_params_plan_the_uncached_kernel(op):
    """Float32 parameters of 16-bit data plan the uncached kernel with P = float (the one
    instantiated for them), as wide a block as the row's packs need; the same switches without
    them plan as before; float32 parameters of other data, or with no parameter, are refused."""
    from dataclasses import replace

    from cukern.plan import Switches, Variant, plan_rowwise

    h100 = cukern.DeviceSpec.h100()
    sw = Switches(weight=True, float32_params=True)
    for dtype in ("float16", "bfloat16"):
        for cols, threads in ((64, 128), (6000, 256), (4100, 512), (70000, 1024)):
            plan = plan_rowwise(op, 8, cols, dtype, h100, switches=sw)
            assert plan.variant is Variant.BLOCK_UNCACHED and plan.threads == threads, plan
            assert plan.name_expression().endswith(", float>"), plan.name_expression()
            same = replace(sw, float32_params=False)
            assert plan.name_expression()[:-len(", float>")] + ">" == replace(
                plan, switches=same).name_expression()
            usual = plan_rowwise(op, 8, cols, dtype, h100, switches=same)
            assert not usual.name_expression().endswith(", float>")
    with pytest.raises(ValueError, match="float32 parameters go with float16 or bfloat16 data, "
                                         "not float32"):
        plan_rowwise(op, 8, 64, "float32", h100, switches=sw)
    with pytest.raises(ValueError, match="need a weight or a bias"):
        plan_rowwise(op, 8, 64, "float16", h100, switches=Switches(float32_params=True))


def test_explain_float32_params():
    h100 = cukern.DeviceSpec.h100()
    plan = cukern.explain("layer-norm", (64, 4096), "bfloat16", device=h100, weight=True,
                          bias=True, param_dtype="float32")
    assert plan.switches.float32_params and plan.name_expression().endswith(", float>")
    same = cukern.explain("rms_norm", (64, 4096), "float32", device=h100, weight=True,
                          param_dtype="float32")
    assert not same.switches.float32_params
    with pytest.raises(ValueError, match="param_dtype float64 with float16 data; expected "
                                         "float16, or float32 for float16 and bfloat16"):
        cukern.explain("rms_norm", (4, 64), "float16", device=h100, weight=True,
                       param_dtype="float64")
    with pytest.raises(ValueError, match="param_dtype needs weight=True or bias=True"):
        cukern.explain("layer_norm", (4, 64), "float16", device=h100, param_dtype="float32")
    with pytest.raises(ValueError, match="param_dtype is the norms'; softmax takes none"):
        cukern.explain("softmax", (4, 64), "float16", device=h100, param_dtype="float32")

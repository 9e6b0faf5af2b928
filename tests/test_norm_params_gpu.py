"""Float32 weight and bias with float16 and bfloat16 data (the mixed-precision setup) on the
GPU, which run the uncached kernels instantiated for them (P = float): rows of every length
class and pack size, each switch set, forward and backward, against float64 NumPy with the
float32 parameters; the kernels must not round them to 16 bits (y and dx closer to the
reference than a 16-bit rounding of the parameters allows; dweight and dbias in float32 to
float32's precision); the cached launches and the fast path keep float32 and 16-bit parameters
apart; misaligned parameters; PyTorch with float32 parameters and bfloat16 activations."""

from __future__ import annotations

import numpy as np
import pytest

import cukern
from cukern import reference
from cukern.ops import layer_norm as ln_mod
from cukern.plan import Switches, Variant
from cukern.registry import policy

from .conftest import TOL
from .test_layer_norm_gpu import (
    BWD,
    FWD,
    ITEM,
    STAT_TOL,
    col_sums_shapes,
    host,
    make,
    np_dtype,
    poison,
    rel_err,
    variant_shapes,
)

cp = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("warm_layer_norm")]

HALF = ["float16", "bfloat16"]
# dweight and dbias come back in float32: summed in float32 from exact products of 16-bit
# values, far below a 16-bit rounding of the result (2.8e-4 relative for float16)
PARAM_TOL = 1e-5
# A kernel that read 16-bit copies of the parameters adds their rounding to y's (or dx's) own:
# about sqrt(2) times the error of one rounding. The kernels' error must stay below this
# fraction of that (expected: 1/sqrt(2) = 0.71 or less), checked on >= 8192 values in rows of
# >= 64 (shorter rows' dx is mostly cancellation, and a layer norm of one column is beta).
ROUNDED = 0.85
MIN_VALUES = 8192
MIN_COLS = 64


def telling(x) -> bool:
    """Whether x is large enough for the ROUNDED check."""
    return x.size >= MIN_VALUES and x.shape[-1] >= MIN_COLS


def params32(n, rng, shift=1.0):
    """float32 parameters with full 24-bit mantissas (uniform in shift +- 0.5): each changes
    when rounded to 16 bits."""
    return (shift + rng.uniform(-0.5, 0.5, n)).astype(np.float32)


def as16(p, dtype):
    return None if p is None else p.astype(np_dtype(dtype))


def dev(p):
    return None if p is None else cp.asarray(p)


def check_forward32(op, x, w, b, dtype):
    """op on 16-bit x with float32 w and b (either None) against the float64 reference with
    the float32 values; with a weight and enough values, also closer to it than the same op
    with the parameters rounded to x's dtype can be. Returns the plan."""
    layer = op == "layer_norm"
    cols, rows = x.shape[-1], x.shape[0]
    eps = 1e-5 if layer else 1e-6
    params = (w, b) if layer else (w,)
    ref = getattr(reference, op)(x, cols, *params, eps, return_stats=True)
    poison((x.shape, ITEM[dtype]), ((rows,), 8), ((rows,), 8))
    got = getattr(cukern, op)(cp.asarray(x), cols, *[dev(p) for p in params], eps,
                              return_stats=True)
    where = f"{op} {dtype} {x.shape} w={w is not None} b={b is not None}"
    y = got[0]
    assert y.dtype == np_dtype(dtype) and y.shape == x.shape, where
    err = rel_err(y, ref[0])
    assert err <= TOL[dtype], f"{where}: y rel err {err:.3g}"
    k = 2 if layer else 1
    assert rel_err(got[k], ref[k]) <= STAT_TOL[dtype], f"{where}: rstd"
    if w is not None and telling(x):
        rounded = getattr(reference, op)(x, cols, *[as16(p, dtype) for p in params], eps)
        err16 = rel_err(rounded.astype(np_dtype(dtype)).astype(np.float64), ref[0])
        assert err <= ROUNDED * err16, \
            f"{where}: y rel err {err:.3g} vs {err16:.3g} with 16-bit parameters"
    return ln_mod.last_plan(op)


def check_plan(op, switches):
    """The latest plan of ``op``: the uncached kernel with float32 parameters (P = float)."""
    plan = ln_mod.last_plan(op)
    assert plan.variant is Variant.BLOCK_UNCACHED, plan
    assert plan.switches == switches, (plan.switches, switches)
    assert plan.name_expression().endswith(", float>"), plan.name_expression()
    return plan


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("op", FWD)
def test_forward_float32_params_every_shape_and_switch(op, dtype, rng):
    """The shapes that reach every variant with 16-bit parameters (lnt.variant_shapes: 1 to
    10**5 + 3 columns, every pack size), with each switch set that has a weight or a bias."""
    for shape, _ in variant_shapes(op, dtype):
        cols = shape[-1]
        for s in policy(op).switch_sets:
            if not (s.weight or s.bias):
                continue
            x = make(shape, dtype, rng)
            w = params32(cols, rng) if s.weight else None
            b = params32(cols, rng, 0.0) if s.bias else None
            if s.residual:
                r = make(shape, dtype, rng)
                h = (x + r).astype(np_dtype(dtype))  # what the kernel normalises
                params = (w, b) if op == "layer_norm" else (w,)
                ref = getattr(reference, op)(h, cols, *params)
                poison((shape, ITEM[dtype]), (shape, ITEM[dtype]))
                y, hh = getattr(cukern, op)(cp.asarray(x), cols, *[dev(p) for p in params],
                                            residual=cp.asarray(r))
                np.testing.assert_array_equal(host(hh), h.astype(np.float64))
                assert rel_err(y, ref) <= TOL[dtype], (op, dtype, shape, s)
            else:
                check_forward32(op, x, w, b, dtype)
            check_plan(op, Switches(s.weight, s.bias, s.residual, True))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("op", FWD)
def test_forward_reads_float32_params(op, dtype, rng):
    """Enough rows at each block size (128 to 1024 threads) and pack size (1, 2, 4, 8: odd,
    twice odd, four times odd columns, and multiples of 8) that y shows whether the parameters
    were rounded; the weight alone too (the kernel's run-time presence of beta)."""
    seen = set()
    for cols in (8, 99, 250, 1028, 2048, 6000, 4100, 20000, 70000):
        rows = max(2, -(-MIN_VALUES // cols))
        x = make((rows, cols), dtype, rng)
        b = params32(cols, rng, 0.0) if op == "layer_norm" else None
        check_forward32(op, x, params32(cols, rng), b, dtype)
        plan = check_plan(op, Switches(True, b is not None, False, True))
        seen.add((plan.threads, plan.pack_size))
        check_forward32(op, make((rows, cols), dtype, rng), params32(cols, rng), None, dtype)
    assert {t for t, _ in seen} == {128, 256, 512, 1024}, seen
    assert {p for _, p in seen} == {1, 2, 4, 8}, seen


def check_backward32(op, x, dy, w, dtype, b=None):
    """The backward with float32 w (and b, layer norm) against the float64 reference: dx in
    x's dtype (with enough values: closer than 16-bit parameters allow), dweight and dbias in
    float32 to PARAM_TOL."""
    layer = op == "layer_norm_backward"
    cols = x.shape[-1]
    x64 = x.astype(np.float64)
    if layer:
        _, mean, rstd = reference.layer_norm(x64, cols, return_stats=True)
        stats = (mean.astype(np.float32), rstd.astype(np.float32))
    else:
        _, rstd = reference.rms_norm(x64, cols, return_stats=True)
        stats = (rstd.astype(np.float32),)
    bias = (b,) if layer else ()
    ref = getattr(reference, op)(dy, x, *stats, w, *bias)
    poison((x.shape, ITEM[dtype]), ((cols,), 4), ((cols,), 4))
    got = getattr(cukern, op)(cp.asarray(dy), cp.asarray(x), *[cp.asarray(s) for s in stats],
                              dev(w), *[dev(p) for p in bias])
    where = f"{op} {dtype} {x.shape} w={w is not None} b={b is not None}"
    assert got[0].dtype == np_dtype(dtype) and got[0].shape == x.shape, where
    g = dy.astype(np.float64) * (1 if w is None else w.astype(np.float64))
    scale = max(np.linalg.norm(ref[0]), np.linalg.norm(stats[-1].astype(np.float64)[:, None] * g))
    err = rel_err(got[0], ref[0], scale)
    assert err <= TOL[dtype], f"{where}: dx rel err {err:.3g}"
    if w is not None and telling(x):
        rounded = getattr(reference, op)(dy, x, *stats, as16(w, dtype), *bias)[0]
        err16 = rel_err(rounded.astype(np_dtype(dtype)).astype(np.float64), ref[0], scale)
        assert err <= ROUNDED * err16, \
            f"{where}: dx rel err {err:.3g} vs {err16:.3g} with a 16-bit weight"
    # the column sums' terms, for a scale that a sum cancelling to near 0 does not shrink
    d64 = dy.astype(np.float64)
    r64 = stats[-1].astype(np.float64)[:, None]
    xhat = (x64 - stats[0].astype(np.float64)[:, None]) * r64 if layer else x64 * r64
    for name, gv, rv, terms in zip(("dweight", "dbias"), got[1:], ref[1:], (d64 * xhat, d64)):
        if rv is None:
            assert gv is None, (where, name)
            continue
        assert gv.dtype == np.float32 and gv.shape == (cols,), (where, name, gv.dtype)
        floor = 1e-2 * np.linalg.norm(np.abs(terms).sum(axis=0))
        e = rel_err(gv, rv, max(np.linalg.norm(rv), floor))
        assert e <= PARAM_TOL, f"{where}: {name} rel err {e:.3g}"
    return got


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("op", BWD)
def test_backward_float32_params_every_shape(op, dtype, rng):
    """The shapes of every way 16-bit parameters' column sums are planned (lnt.col_sums_shapes),
    each as given and with enough rows to show whether gamma was rounded: the uncached kernel
    with P = float, dweight (and dbias) from norm_param_grad_partial and float32's reduce."""
    for shape, _ in col_sums_shapes(op, dtype):
        cols = shape[-1]
        for rows in dict.fromkeys((shape[0], max(shape[0], -(-MIN_VALUES // cols)))):
            x = make((rows, cols), dtype, rng)
            dy = make((rows, cols), dtype, rng, 1.0, 0.1)
            check_backward32(op, x, dy, params32(cols, rng), dtype)
            check_plan(op, Switches(weight=True, float32_params=True))


@pytest.mark.parametrize("dtype", HALF)
def test_backward_bias_float32(dtype, rng):
    """Layer norm's backward with float32 weight and bias, and with a float32 bias alone
    (dbias float32, from the kernels with a float32 weight of ones)."""
    for shape in ((64, 768), (5, 5000), (300, 36000)):
        x = make(shape, dtype, rng)
        dy = make(shape, dtype, rng, 1.0, 0.1)
        cols = shape[-1]
        op = "layer_norm_backward"
        check_backward32(op, x, dy, params32(cols, rng), dtype, params32(cols, rng, 0.0))
        got = check_backward32(op, x, dy, None, dtype, params32(cols, rng, 0.0))
        assert got[1] is None and got[2].dtype == np.float32


@pytest.mark.parametrize("dtype", HALF)
def test_launch_caches_keep_param_dtypes_apart(dtype, rng, monkeypatch):
    """The same layout with float32 and with 16-bit parameters, in turn, through the full path
    and the fast path: each call runs its own kernels (the uncached one with P = float, or the
    usual cached one) and reads its own parameters' dtype."""
    monkeypatch.setattr(ln_mod, "_fresh", {})
    cols = 3000
    x = make((64, cols), dtype, rng)
    dy = make((64, cols), dtype, rng, 1.0, 0.1)
    w32, b32 = params32(cols, rng), params32(cols, rng, 0.0)
    for _ in range(2):  # the second round from the fast path
        for w, b in ((w32, b32), (as16(w32, dtype), as16(b32, dtype))):
            ref = reference.layer_norm(x, cols, w, b)
            y = cukern.layer_norm(cp.asarray(x), cols, dev(w), dev(b))
            assert rel_err(y, ref) <= TOL[dtype], w.dtype
            plan = ln_mod.last_plan("layer_norm")
            assert plan.switches.float32_params is (w.dtype == np.float32), plan
            assert (plan.variant is Variant.BLOCK_UNCACHED) is (w.dtype == np.float32), plan
            _, mean, rstd = reference.layer_norm(x.astype(np.float64), cols, return_stats=True)
            stats = [cp.asarray(s.astype(np.float32)) for s in (mean, rstd)]
            dx, dw, db = cukern.layer_norm_backward(cp.asarray(dy), cp.asarray(x), *stats,
                                                    dev(w), dev(b))
            rdx, rdw, rdb = reference.layer_norm_backward(dy, x, mean.astype(np.float32),
                                                          rstd.astype(np.float32), w, b)
            assert dw.dtype == db.dtype == w.dtype
            assert rel_err(dw, rdw.astype(w.dtype).astype(np.float64)) <= TOL[dtype]
            assert rel_err(db, rdb.astype(w.dtype).astype(np.float64)) <= TOL[dtype]
            assert rel_err(dx, rdx) <= 2 * TOL[dtype]
    assert len(ln_mod._fresh) == 4  # forward and backward, per parameter dtype


@pytest.mark.parametrize("dtype", HALF)
def test_misaligned_float32_params(dtype, rng):
    """A float32 weight 4 bytes off a 16-byte boundary (a view): read correctly (the op copies
    it to an aligned array first)."""
    cols = 4096
    x = make((4, cols), dtype, rng)
    base = cp.asarray(params32(cols + 1, rng))
    w = base[1:]
    assert w.data.ptr % 16 == 4
    check = reference.rms_norm(x, cols, cp.asnumpy(w), 1e-6)
    assert rel_err(cukern.rms_norm(cp.asarray(x), cols, w), check) <= TOL[dtype]
    dy = make((4, cols), dtype, rng, 1.0, 0.1)
    _, rstd = cukern.rms_norm(cp.asarray(x), cols, w, return_stats=True)
    dx, dw = cukern.rms_norm_backward(cp.asarray(dy), cp.asarray(x), rstd, w)
    rdx, rdw = reference.rms_norm_backward(dy, x, cp.asnumpy(rstd), cp.asnumpy(w))
    assert dw.dtype == np.float32 and rel_err(dw, rdw) <= PARAM_TOL
    assert rel_err(dx, rdx) <= 2 * TOL[dtype]


def test_refused_param_dtypes():
    x16 = cp.ones((4, 8), cp.float16)
    w32, b16 = cp.ones(8, cp.float32), cp.ones(8, cp.float16)
    with pytest.raises(TypeError, match="layer_norm: weight has dtype float32 but bias has "
                                        "dtype float16"):
        cukern.layer_norm(x16, 8, w32, b16)
    with pytest.raises(TypeError, match="weight has dtype float32 but bias has dtype float16"):
        cukern.layer_norm_backward(x16, x16, cp.zeros(4, cp.float32), cp.ones(4, cp.float32),
                                   w32, b16)
    x64 = cp.ones((4, 8), cp.float64)
    with pytest.raises(TypeError, match="rms_norm: weight has dtype float32, expected float64 "
                                        "for float64 x"):
        cukern.rms_norm(x64, 8, w32)
    with pytest.raises(TypeError, match="weight has dtype float64, expected float32 or float16 "
                                        "for float16 x"):
        cukern.rms_norm(x16, 8, cp.ones(8, cp.float64))


def test_torch_float32_params_bfloat16_activations():
    """cukern.torch with float32 weight and bias and bfloat16 x: y in bfloat16, weight.grad and
    bias.grad in float32, all against the float64 reference."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    import cukern.torch as ct

    gen = torch.Generator(device="cuda").manual_seed(int(np.random.SeedSequence().entropy % 2**31))

    def randn(*shape, dtype, scale=1.0, shift=0.0):
        t = torch.randn(*shape, device="cuda", dtype=torch.float64, generator=gen)
        return (t * scale + shift).to(dtype)

    rows, cols = 64, 1024
    for norm in ("layer_norm", "rms_norm"):
        layer = norm == "layer_norm"
        x = randn(rows, cols, dtype=torch.bfloat16, scale=2, shift=0.5).requires_grad_()
        dy = randn(rows, cols, dtype=torch.bfloat16)
        w = (1 + 0.5 * randn(cols, dtype=torch.float32)).requires_grad_()
        b = randn(cols, dtype=torch.float32).requires_grad_() if layer else None
        y = ct.layer_norm(x, cols, w, b) if layer else ct.rms_norm(x, cols, w, 1e-5)
        assert y.dtype == torch.bfloat16
        y.backward(dy)
        assert w.grad.dtype == torch.float32 and (not layer or b.grad.dtype == torch.float32)

        def np64(t):
            return t.detach().double().cpu().numpy()

        xs, dys, ws = np64(x), np64(dy), np64(w)
        if layer:
            ry, mean, rstd = reference.layer_norm(xs, cols, ws, np64(b), 1e-5, return_stats=True)
            rdx, rdw, rdb = reference.layer_norm_backward(dys, xs, mean, rstd, ws, np64(b))
        else:
            ry, rstd = reference.rms_norm(xs, cols, ws, 1e-5, return_stats=True)
            rdx, rdw = reference.rms_norm_backward(dys, xs, rstd, ws)
        assert rel_err(np64(y), ry) <= TOL["bfloat16"], norm
        assert rel_err(np64(x.grad), rdx) <= 2 * TOL["bfloat16"], norm
        # float32 sums of bfloat16 products, against the float64 sums of the same values
        # (the statistics differ by float32 rounding only)
        assert rel_err(np64(w.grad), rdw) <= 1e-4, norm
        if layer:
            assert rel_err(np64(b.grad), rdb) <= 1e-4, norm

"""cukern.prepare on the GPU: prepared calls give the op's bits on fresh arrays of the prepared
layout, write out= (poisoned first) in place of allocating, refuse other layouts and overlapping
outputs, and route odd alignment through the op's full path; and the driver-level launches
(cukern._launch) stay correct when threads launch one cached kernel at once."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import cukern
from cukern import reference

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def _bits(a, b) -> None:
    for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,),
                    strict=True):
        u, v = cp.asnumpy(u), cp.asnumpy(v)
        assert u.dtype == v.dtype and u.shape == v.shape and u.tobytes() == v.tobytes()


def _normal(rng, shape, dtype=np.float32):
    return cp.asarray(rng.standard_normal(shape).astype(dtype))


CASES = {  # op -> (prepare's arguments after the arrays, array shapes, reference)
    "softmax": ((-1,), [(6, 300)], lambda a: reference.softmax(*a)),
    "log_softmax": ((0,), [(70, 9)], lambda a: reference.log_softmax(*a, axis=0)),
    "permute": (((1, 0, 2),), [(5, 33, 7)], lambda a: np.transpose(a[0], (1, 0, 2))),
}


@pytest.mark.parametrize("op", sorted(CASES))
def test_prepared_forward_matches_the_op_and_reference(op, rng):
    extra, shapes, ref = CASES[op]
    x0 = _normal(rng, shapes[0])
    p = cukern.prepare(op, x0, *extra)
    assert p.fast, repr(p)
    fn = getattr(cukern, op)
    for _ in range(3):  # fresh data each call
        x = _normal(rng, shapes[0])
        y = p(x)
        _bits(y, fn(x, *extra))
        np.testing.assert_allclose(cp.asnumpy(y), ref([cp.asnumpy(x).astype(np.float64)]),
                                   rtol=1e-5, atol=1e-6)
        out = cp.full(y.shape, cp.nan, y.dtype)
        assert p(x, out=out) is out
        _bits(out, y)


@pytest.mark.parametrize("op", ["softmax_backward", "log_softmax_backward"])
def test_prepared_softmax_backward(op, rng):
    fwd = cukern.softmax if op == "softmax_backward" else cukern.log_softmax
    x, dy = _normal(rng, (8, 1000)), _normal(rng, (8, 1000))
    y = fwd(x)
    p = cukern.prepare(op, dy, y)
    x2, dy2 = _normal(rng, (8, 1000)), _normal(rng, (8, 1000))
    y2 = fwd(x2)
    dx = p(dy2, y2)
    _bits(dx, getattr(cukern, op)(dy2, y2))
    ref = getattr(reference, op)(cp.asnumpy(dy2).astype(np.float64), cp.asnumpy(y2))
    np.testing.assert_allclose(cp.asnumpy(dx), ref, rtol=1e-5, atol=1e-6)
    dy3 = dy2.copy()
    assert p(dy3, y2, out=dy3) is dy3  # in place over dy, as the op allows
    _bits(dy3, dx)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("op, stats", [("layer_norm", False), ("layer_norm", True),
                                       ("rms_norm", True)])
def test_prepared_norms(op, stats, dtype, rng):
    from ml_dtypes import bfloat16

    dt = bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    shape, d = (33, 700), 700
    w, b = _normal(rng, d, dt), _normal(rng, d, dt)
    params = (w, b) if op == "layer_norm" else (w,)
    p = cukern.prepare(op, _normal(rng, shape, dt), (d,), *params, eps=1e-3,
                       return_stats=stats)
    assert p.fast
    fn = getattr(cukern, op)
    x = _normal(rng, shape, dt)
    res = p(x, *params)
    _bits(res, fn(x, (d,), *params, eps=1e-3, return_stats=stats))
    y = res[0] if stats else res
    ref = getattr(reference, op)(cp.asnumpy(x), (d,), *[cp.asnumpy(a) for a in params], 1e-3)
    ref_y = ref[0] if isinstance(ref, tuple) else ref
    np.testing.assert_allclose(cp.asnumpy(y).astype(np.float64), ref_y,
                               rtol=2e-2 if dtype != "float32" else 1e-5,
                               atol=2e-2 if dtype != "float32" else 1e-5)
    out = cp.empty(shape, dt)
    out.view(cp.uint8).fill(0xFF)  # poison: NaN in every float type
    res2 = p(x, *params, out=out)
    assert (res2[0] if stats else res2) is out
    _bits(out, y)


def test_prepared_calls_refuse_other_layouts_and_overlaps(rng):
    x = _normal(rng, (4, 64))
    p = cukern.prepare("softmax", x)
    with pytest.raises(ValueError, match=r"x has shape \(4, 65\).*prepared for shape \(4, 64\)"):
        p(_normal(rng, (4, 65)))
    with pytest.raises(ValueError, match="dtype float64"):
        p(x.astype(cp.float64))
    with pytest.raises(ValueError, match=r"strides \(4, 16\)"):
        p(_normal(rng, (64, 4)).T)
    with pytest.raises(TypeError, match="x must be a cupy.ndarray .*numpy.ndarray"):
        p(cp.asnumpy(x))
    with pytest.raises(TypeError, match="takes 1 array argument"):
        p(x, x)
    with pytest.raises(ValueError, match="out has shape"):
        p(x, out=cp.empty((4, 63), cp.float32))
    buf = cp.empty(4 * 64 + 64, cp.float32)
    a, o = buf[:256].reshape(4, 64), buf[64:320].reshape(4, 64)
    a[...] = x
    with pytest.raises(ValueError, match="out overlaps x"):
        p(a, out=o)
    q = cukern.prepare("layer_norm", x, (64,))
    with pytest.raises(ValueError, match="out overlaps x"):
        q(x, out=x)  # layer norm's prepared call writes no input in place


def test_odd_alignment_takes_the_full_path(rng):
    x = _normal(rng, (4, 64))
    p = cukern.prepare("softmax", x)
    buf = cp.empty(4 * 64 + 1, cp.float32)
    xo = buf[1:].reshape(4, 64)  # 4-byte aligned: the prepared plan's 16-byte loads cannot
    xo[...] = _normal(rng, (4, 64))
    _bits(p(xo), cukern.softmax(xo))
    np.testing.assert_allclose(cp.asnumpy(p(xo)), reference.softmax(cp.asnumpy(xo)), rtol=1e-5,
                               atol=1e-7)


def test_threads_launching_one_cached_kernel(rng):
    xs = [_normal(rng, (16, 512)) for _ in range(8)]
    want = [cp.asnumpy(cukern.softmax(x)) for x in xs]
    errors = []

    def work(i):
        try:
            with cp.cuda.Stream(non_blocking=True) as s:
                ys = [cukern.softmax(xs[i]) for _ in range(200)]
                s.synchronize()
                errors.extend(i for y in ys if cp.asnumpy(y).tobytes() != want[i].tobytes())
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []

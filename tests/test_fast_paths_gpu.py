"""The CuPy fast paths of the ops that validated every call before (softmax_backward,
log_softmax_backward, batch_norm_backward, batch_stats): a repeated call of a validated layout
skips the full path and gives its bits; calls whose arguments the kernels cannot read as they
are (copies) take the full path every time and add no entry; bad input after the fast path is
ready still meets the full checks. (PyTorch tensors through these paths:
tests/test_interop_gpu.py.)"""

from __future__ import annotations

import numpy as np
import pytest

import cukern
from cukern import reference, runner
from cukern.ops import batch_norm as bn
from cukern.ops import softmax as sm

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def _counted(monkeypatch, mod, full: str) -> list:
    """Records each call of ``mod.full`` (the op's validating path), with an empty fast-path
    cache."""
    calls = []
    orig = getattr(mod, full)
    monkeypatch.setattr(mod, full, lambda *a, **k: calls.append(1) or orig(*a, **k))
    monkeypatch.setattr(mod, "_fresh", runner.BoundedDict())
    return calls


def _host(res) -> list:
    return [None if r is None else cp.asnumpy(r) for r in (res if isinstance(res, tuple)
                                                         else (res,))]


def _same_bits(a, b) -> None:
    for u, v in zip(_host(a), _host(b), strict=True):
        assert (u is None) == (v is None)
        if u is not None:
            assert (u.dtype, u.shape) == (v.dtype, v.shape) and u.tobytes() == v.tobytes()


def _close(a, b, rtol=1e-6) -> None:
    for u, v in zip(_host(a), _host(b), strict=True):
        if u is not None:
            np.testing.assert_allclose(u, v, rtol=rtol, atol=rtol)


def _rel_err(got, ref) -> float:
    g, r = cp.asnumpy(got).astype(np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm((g - r).ravel()) / max(np.linalg.norm(r.ravel()), 1e-30))


@pytest.mark.parametrize("op", ["softmax_backward", "log_softmax_backward"])
def test_softmax_backward(op, rng, monkeypatch):
    x = cp.asarray(rng.standard_normal((6, 300)), cp.float32)
    y = cukern.softmax(x) if op == "softmax_backward" else cukern.log_softmax(x)
    dy = cp.asarray(rng.standard_normal((6, 300)), cp.float32)
    wide = cp.asarray(rng.standard_normal((6, 400)), cp.float32)
    dy_rows = wide[:, :300]  # rows of another stride: another layout, no copy
    dy_rows[...] = dy
    fn = getattr(cukern, op)
    calls = _counted(monkeypatch, sm, "_run")
    first = fn(dy, y)
    assert len(calls) == 1 and len(sm._fresh) == 1
    again = fn(dy, y)
    assert len(calls) == 1
    assert again.data.ptr != first.data.ptr
    _same_bits(first, again)
    ref = getattr(reference, op)(cp.asnumpy(dy), cp.asnumpy(y))
    assert _rel_err(again, ref) <= 1e-5
    assert fn(dy, y, axis=-1, out=cp.empty_like(y)) is not None and len(calls) == 2  # out=
    other = fn(dy_rows, y)  # a key of its own: the full path once, then the fast path
    fn(dy_rows, y)
    assert len(calls) == 3 and len(sm._fresh) == 2
    _close(other, first)
    with pytest.raises(ValueError, match="dy has shape"):
        fn(cp.ones((6, 301), cp.float32), y)
    with pytest.raises(TypeError, match="dy has dtype"):
        fn(dy.astype(cp.float64), y)


@pytest.mark.parametrize("training,addend,masked", [(True, False, False), (False, True, True),
                                                    (True, True, True)])
def test_batch_norm_backward(training, addend, masked, rng, monkeypatch):
    shape = (4, 8, 5, 6)
    x = cp.asarray(rng.standard_normal(shape), cp.float32)
    dy = cp.asarray(rng.standard_normal(shape), cp.float32)
    w = cp.asarray(rng.uniform(0.5, 1.5, 8), cp.float32)
    _, mean, invstd, mask = cukern.batch_norm(x, None, None, w, None, True, relu=True,
                                              return_stats=True)
    kw = {"mask": mask if masked else None, "addend": addend, "training": training}
    calls = _counted(monkeypatch, bn, "_batch_norm_backward")
    first = cukern.batch_norm_backward(dy, x, mean, invstd, w, **kw)
    assert len(calls) == 1 and len(bn._fresh) == 1
    again = cukern.batch_norm_backward(dy, x, mean, invstd, w, **kw)
    assert len(calls) == 1
    assert len(again) == (4 if addend else 3)
    _same_bits(first, again)
    ref = reference.batch_norm_backward(
        cp.asnumpy(dy), cp.asnumpy(x), cp.asnumpy(mean), cp.asnumpy(invstd), cp.asnumpy(w),
        mask=cp.asnumpy(mask) if masked else None, addend=addend, training=training)
    for got, want in zip(again, ref, strict=True):
        assert _rel_err(got, want) <= 1e-5

    def strided(a):  # a's values in a view with a gap between elements
        v = cp.empty(2 * a.size, a.dtype)[::2]
        v[...] = a
        return v

    dy_cl = cp.ascontiguousarray(dy.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    copies = [{"mean": strided(mean)}, {"invstd": strided(invstd)}, {"weight": strided(w)},
              {"dy": dy_cl}]
    if masked:
        copies.append({"mask": strided(mask)})
    for change in copies:  # arguments the kernels read through copies: no entry
        a = {"dy": dy, "mean": mean, "invstd": invstd, "weight": w, "mask": kw["mask"],
             **change}
        n = len(calls)
        for _ in range(2):
            res = cukern.batch_norm_backward(a["dy"], x, a["mean"], a["invstd"], a["weight"],
                                             mask=a["mask"], addend=addend, training=training)
        assert len(calls) == n + 2, change
        assert len(bn._fresh) == 1, change
        _close(res, first)
    with pytest.raises(TypeError, match="mean has dtype"):
        cukern.batch_norm_backward(dy, x, mean.astype(cp.float64), invstd, w, **kw)
    with pytest.raises(ValueError, match="weight has shape"):
        cukern.batch_norm_backward(dy, x, mean, invstd, cp.ones(7, cp.float32), **kw)


def test_batch_stats(rng, monkeypatch):
    x = cp.asarray(rng.standard_normal((4, 8, 5, 6)), cp.float32)
    gappy = cp.empty((4, 8, 5, 12), cp.float32)[..., ::2]  # not dense: copied first
    gappy[...] = x
    calls = _counted(monkeypatch, bn, "_batch_stats")
    first = cukern.batch_stats(x)
    assert len(calls) == 1 and len(bn._fresh) == 1
    again = cukern.batch_stats(x)
    assert len(calls) == 1
    _same_bits(first, again)
    for got, want in zip(again, reference.batch_stats(cp.asnumpy(x)), strict=True):
        assert _rel_err(got, want) <= 1e-5
    for _ in range(2):
        res = cukern.batch_stats(gappy)
    assert len(calls) == 3 and len(bn._fresh) == 1
    _close(res, first)
    last = cukern.batch_stats(x, axis=-1)  # another axis: another key
    assert len(calls) == 4 and len(bn._fresh) == 2
    for got, want in zip(last, reference.batch_stats(cp.asnumpy(x), axis=-1), strict=True):
        assert _rel_err(got, want) <= 1e-5
    with pytest.raises(ValueError, match="axis 4"):
        cukern.batch_stats(x, axis=4)

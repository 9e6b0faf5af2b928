"""The float64 batch-norm references on the CPU: statistics and running statistics against
their closed forms, the backward against finite differences, the ReLU mask's packing (bit order,
tail bits, memory order of channels-last views), large offsets, and bad input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cukern import reference

# Memory orders of the layouts the ops take: the logical shape's axes from the slowest to the
# fastest in memory (None: C order).
CHANNELS_LAST = {4: (0, 2, 3, 1), 5: (0, 2, 3, 4, 1)}


def in_layout(a: np.ndarray, order) -> np.ndarray:
    """``a`` (logical shape) as a view whose memory runs in ``order``."""
    if order is None:
        return np.ascontiguousarray(a)
    return np.ascontiguousarray(np.transpose(a, order)).transpose(np.argsort(order))


def per_channel(a: np.ndarray, axis: int) -> np.ndarray:
    """(C, values per channel)."""
    return np.moveaxis(a, axis, 0).reshape(a.shape[axis], -1)


def bshape(ndim: int, axis: int, c: int) -> list[int]:
    s = [1] * ndim
    s[axis % ndim] = c
    return s


# ---------------------------------------------------------------------------------------------
# Mask packing


def test_pack_mask_bit_order():
    """Bit i of word k is element 32 k + i; bit 31 makes the int32 word negative; the tail of
    the last word is zero."""
    keep = np.zeros(65, bool)
    keep[[0, 31, 33, 64]] = True
    words = reference.pack_mask(keep)
    assert words.dtype == np.int32 and words.shape == (3,)
    assert words.tolist() == [1 - 2**31, 2, 1]
    assert reference.pack_mask(np.ones(32, bool)).tolist() == [-1]
    assert reference.pack_mask(np.ones(33, bool)).tolist() == [-1, 1]
    assert reference.pack_mask(np.zeros(0, bool)).shape == (0,)


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 63, 64, 1000, 4097])
def test_pack_unpack_round_trip(n, rng):
    keep = rng.random(n) < 0.5
    words = reference.pack_mask(keep)
    assert words.shape == (-(-n // 32),)
    np.testing.assert_array_equal(reference.unpack_mask(words, n), keep)
    # the unused tail bits are zero
    every = reference.unpack_mask(words, 32 * words.size)
    assert not every[n:].any()
    # against a plain loop over the bits
    for k, w in enumerate(words.astype(np.int64) & 0xFFFFFFFF):
        for i in range(32):
            assert bool((int(w) >> i) & 1) == (32 * k + i < n and keep[32 * k + i])


def test_unpack_mask_checks_its_words():
    words = reference.pack_mask(np.ones(40, bool))
    with pytest.raises(ValueError, match=r"mask has shape \(2,\), expected \(3,\)"):
        reference.unpack_mask(words, 65)
    with pytest.raises(ValueError, match="mask has shape"):
        reference.unpack_mask(words, 32)
    with pytest.raises(TypeError, match="int32"):
        reference.unpack_mask(words.astype(np.int64), 40)


# ---------------------------------------------------------------------------------------------
# Statistics and the forward


@pytest.mark.parametrize("shape,axis", [((7, 3), 1), ((7, 3), 0), ((4, 5, 6), 1), ((4, 5, 6), -1),
                                        ((2, 3, 4, 5), 1), ((2, 3, 4, 5), 3),
                                        ((2, 3, 2, 3, 4), 1)])
def test_batch_stats_closed_form(shape, axis, rng):
    x = rng.standard_normal(shape) * 3 + rng.standard_normal(shape[axis]).reshape(
        bshape(len(shape), axis, shape[axis]))
    mean, var = reference.batch_stats(x, axis=axis)
    rows = per_channel(x, axis)
    assert mean.shape == var.shape == (shape[axis],)
    np.testing.assert_allclose(mean, rows.mean(1), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(var, rows.var(1), rtol=1e-12)
    for c in range(shape[axis]):  # one channel by hand
        vals = [float(v) for v in rows[c]]
        m = sum(vals) / len(vals)
        assert mean[c] == pytest.approx(m, rel=1e-12, abs=1e-12)
        assert var[c] == pytest.approx(sum((v - m) ** 2 for v in vals) / len(vals), rel=1e-12)


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("shape,axis", [((9, 4), 1), ((3, 4, 5, 6), 1), ((3, 5, 6, 4), -1)])
def test_training_forward_normalises(shape, axis, affine, rng):
    c = shape[axis]
    x = rng.standard_normal(shape) * 2 + 5
    w = rng.standard_normal(c) + 1 if affine else None
    b = rng.standard_normal(c) if affine else None
    eps = 1e-3
    y, mean, invstd, mask = reference.batch_norm(x, None, None, w, b, True, eps=eps, axis=axis,
                                                 return_stats=True)
    assert mask is None and y.shape == x.shape and y.dtype == np.float64
    var = per_channel(x, axis).var(1)
    np.testing.assert_allclose(invstd, 1 / np.sqrt(var + eps), rtol=1e-13)
    np.testing.assert_allclose(mean, per_channel(x, axis).mean(1), rtol=1e-13)
    ys = per_channel(y, axis)
    w1 = np.ones(c) if w is None else w
    b1 = np.zeros(c) if b is None else b
    np.testing.assert_allclose(ys.mean(1), b1, atol=1e-12)
    np.testing.assert_allclose(ys.var(1), w1**2 * var / (var + eps), rtol=1e-11)


@pytest.mark.parametrize("momentum", [0.1, 0.0, 1.0, 0.37])
def test_running_stats_update_in_place(momentum, rng):
    x = rng.standard_normal((6, 3, 4, 5)) * 2 + 1
    rm0 = rng.standard_normal(3).astype(np.float32)
    rv0 = rng.uniform(0.5, 2, 3).astype(np.float32)
    rm, rv = rm0.copy(), rv0.copy()
    out = reference.batch_norm(x, rm, rv, training=True, momentum=momentum)
    assert out.shape == x.shape and rm.dtype == rv.dtype == np.float32
    rows = per_channel(x, 1)
    want_m = (1 - momentum) * rm0.astype(np.float64) + momentum * rows.mean(1)
    want_v = (1 - momentum) * rv0.astype(np.float64) + momentum * rows.var(1, ddof=1)  # unbiased
    np.testing.assert_array_equal(rm, want_m.astype(np.float32))
    np.testing.assert_array_equal(rv, want_v.astype(np.float32))
    if momentum == 0.0:
        np.testing.assert_array_equal(rm, rm0)
    # without running statistics training still works, and eval leaves them alone
    y2 = reference.batch_norm(x, None, None, training=True, momentum=momentum)
    np.testing.assert_array_equal(y2, out)
    before = (rm.copy(), rv.copy())
    reference.batch_norm(x, rm, rv, training=False, momentum=momentum)
    np.testing.assert_array_equal(rm, before[0])
    np.testing.assert_array_equal(rv, before[1])


def test_eval_uses_running_stats(rng):
    x = rng.standard_normal((5, 4, 3)) + 2
    rm, rv = rng.standard_normal(4), rng.uniform(0.5, 2, 4)
    w, b = rng.standard_normal(4), rng.standard_normal(4)
    y, mean, invstd, mask = reference.batch_norm(x, rm, rv, w, b, eps=1e-2, return_stats=True)
    assert mask is None
    np.testing.assert_array_equal(mean, rm)
    np.testing.assert_allclose(invstd, 1 / np.sqrt(rv + 1e-2), rtol=1e-15)
    bs = (1, 4, 1)
    want = (x - rm.reshape(bs)) / np.sqrt(rv.reshape(bs) + 1e-2) * w.reshape(bs) + b.reshape(bs)
    np.testing.assert_allclose(y, want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("training", [True, False])
def test_relu_addend_and_mask(training, rng):
    x = rng.standard_normal((3, 5, 7))
    a = rng.standard_normal(x.shape)
    rm, rv = rng.standard_normal(5), rng.uniform(0.5, 2, 5)
    w, b = rng.standard_normal(5), rng.standard_normal(5)
    plain = reference.batch_norm(x, rm.copy(), rv.copy(), w, b, training)
    y, _, _, mask = reference.batch_norm(x, rm.copy(), rv.copy(), w, b, training, addend=a,
                                         relu=True, return_stats=True)
    np.testing.assert_allclose(y, np.maximum(plain + a, 0), rtol=1e-14, atol=1e-14)
    assert (y > 0).any() and (y == 0).any()
    np.testing.assert_array_equal(mask, reference.pack_mask(y > 0))  # C order: x is contiguous
    assert mask.shape == (-(-x.size // 32),)  # 105 elements: 4 words, 23 tail bits unused
    np.testing.assert_array_equal(reference.unpack_mask(mask, x.size), (y > 0).ravel())


def test_out_is_written(rng):
    x = rng.standard_normal((4, 3, 5)).astype(np.float32)
    out = np.full(x.shape, np.nan, np.float32)
    got = reference.batch_norm(x, None, None, training=True, out=out)
    assert got is out and not np.isnan(out).any()
    np.testing.assert_array_equal(out, reference.batch_norm(x, None, None, training=True)
                                  .astype(np.float32))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_low_precision_inputs_are_upcast(dtype, rng):
    dt = np.dtype(dtype) if dtype != "bfloat16" else np.dtype(__import__("ml_dtypes").bfloat16)
    x = (rng.standard_normal((8, 3, 5)) * 2).astype(dt)
    w = rng.standard_normal(3).astype(np.float32)
    y, mean, invstd, _ = reference.batch_norm(x, None, None, w, None, True, return_stats=True)
    y64 = reference.batch_norm(x.astype(np.float64), None, None, w.astype(np.float64), None,
                               True)
    assert y.dtype == mean.dtype == invstd.dtype == np.float64
    np.testing.assert_array_equal(y, y64)


# ---------------------------------------------------------------------------------------------
# Layouts: channels-last views keep their layout; the mask follows memory order


@pytest.mark.parametrize("ndim", [4, 5])
def test_channels_last_layout_and_mask_order(ndim, rng):
    shape = (3, 5, 4, 7) if ndim == 4 else (2, 3, 3, 4, 5)
    order = CHANNELS_LAST[ndim]
    logical = rng.standard_normal(shape)
    a = rng.standard_normal(shape)
    x = in_layout(logical, order)
    assert not x.flags.c_contiguous
    add = in_layout(a, order)
    y, mean, invstd, mask = reference.batch_norm(x, None, None, None, None, True, addend=add,
                                                 relu=True, return_stats=True)
    yc, mc, ic, mask_c = reference.batch_norm(np.ascontiguousarray(x), None, None, None, None,
                                              True, addend=a, relu=True, return_stats=True)
    np.testing.assert_allclose(y, yc, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(mean, mc, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(invstd, ic, rtol=1e-13)
    # y in x's layout: its memory runs N, (D,) H, W, C
    assert np.transpose(y, order).flags.c_contiguous
    # the mask packs y > 0 in memory order, not in the logical C order
    np.testing.assert_array_equal(mask, reference.pack_mask(np.transpose(yc, order) > 0))
    np.testing.assert_array_equal(mask_c, reference.pack_mask(yc > 0))
    assert not np.array_equal(mask, mask_c)
    # the backward reads the mask in x's memory order too
    dy = rng.standard_normal(shape)
    got = reference.batch_norm_backward(in_layout(dy, order), x, mean, invstd, mask=mask,
                                        addend=True)
    want = reference.batch_norm_backward(dy, np.ascontiguousarray(x), mean, invstd, mask=mask_c,
                                         addend=True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    assert np.transpose(got[0], order).flags.c_contiguous
    np.testing.assert_array_equal(got[3], np.where(yc > 0, dy, 0.0))


# ---------------------------------------------------------------------------------------------
# The backward


def _loss(x, w, b, a, dy, training, rm, rv, relu, axis, eps):
    y = reference.batch_norm(x, None if rm is None else rm.copy(),
                             None if rv is None else rv.copy(), w, b, training, eps=eps,
                             axis=axis, addend=a, relu=relu)
    return float(np.sum(y * dy))


def _numeric_grad(f, v, h=1e-6):
    g = np.zeros_like(v)
    for idx in np.ndindex(*v.shape):
        keep = v[idx]
        v[idx] = keep + h
        up = f()
        v[idx] = keep - h
        down = f()
        v[idx] = keep
        g[idx] = (up - down) / (2 * h)
    return g


@pytest.mark.parametrize("mode", ["plain", "relu", "add_relu"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape,axis", [((3, 2, 2, 2), 1), ((5, 3), 1), ((2, 3, 4), -1),
                                        ((4, 3), 0)])
def test_backward_against_finite_differences(shape, axis, training, mode, rng):
    """dx, dweight, dbias (and daddend) against central differences of sum(dy * y) through the
    forward, batch statistics included in training; data kept away from the ReLU's kink."""
    c = shape[axis]
    relu, add = mode != "plain", mode == "add_relu"
    eps = 1e-3
    for _ in range(100):
        x = rng.standard_normal(shape) * 1.5 + 0.3
        w = rng.standard_normal(c) + 1
        b = rng.standard_normal(c) * 0.5
        a = rng.standard_normal(shape) if add else None
        rm, rv = rng.standard_normal(c) * 0.2, rng.uniform(0.5, 2, c)
        z = reference.batch_norm(x, rm.copy(), rv.copy(), w, b, training, eps=eps, axis=axis,
                                 addend=a)
        if np.abs(z).min() > 0.05:
            break
    dy = rng.standard_normal(shape)
    y, mean, invstd, mask = reference.batch_norm(x, rm.copy(), rv.copy(), w, b, training,
                                                 eps=eps, axis=axis, addend=a, relu=relu,
                                                 return_stats=True)
    got = reference.batch_norm_backward(dy, x, mean, invstd, w, axis=axis, mask=mask,
                                        addend=add, training=training)
    assert len(got) == (4 if add else 3)

    def f():
        return _loss(x, w, b, a, dy, training, rm, rv, relu, axis, eps)

    for analytic, var in zip(got, (x, w, b, a)):
        numeric = _numeric_grad(f, var)
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape,axis", [((7, 4, 3, 5), 1), ((40, 6), 1), ((3, 4, 9), -1)])
def test_training_dx_closed_forms(shape, axis, rng):
    """Without a mask, sum(dx) is 0 per channel (y does not change when x is shifted per
    channel) and sum(dx * xhat) = weight * invstd * dweight * eps / (var + eps) (zero but for
    eps: y changes with a scaling of x only through eps)."""
    c = shape[axis]
    x = rng.standard_normal(shape) * 3 + 7
    w = rng.standard_normal(c) + 1
    _, mean, invstd, _ = reference.batch_norm(x, None, None, w, None, True, axis=axis,
                                              return_stats=True)
    dy = rng.standard_normal(shape)
    dx, dw, db = reference.batch_norm_backward(dy, x, mean, invstd, w, axis=axis)
    bs = bshape(x.ndim, axis, c)
    xhat = (x - mean.reshape(bs)) * invstd.reshape(bs)
    scale = np.abs(per_channel(dx, axis)).sum(1)
    assert np.all(np.abs(per_channel(dx, axis).sum(1)) <= 1e-12 * scale)
    var = 1 / invstd**2 - 1e-5
    np.testing.assert_allclose(per_channel(dx * xhat, axis).sum(1),
                               w * invstd * dw * 1e-5 / (var + 1e-5), rtol=1e-6, atol=1e-13)
    # db is a sum near 0: summed in another order, it differs by its rounding (atol)
    np.testing.assert_allclose(db, per_channel(dy, axis).sum(1), rtol=1e-13, atol=1e-12)
    np.testing.assert_allclose(dw, per_channel(dy * xhat, axis).sum(1), rtol=1e-12, atol=1e-12)


def test_eval_backward_closed_form_and_defaults(rng):
    x = rng.standard_normal((6, 3, 4))
    dy = rng.standard_normal(x.shape)
    mean, invstd = rng.standard_normal(3), rng.uniform(0.5, 2, 3)
    w = rng.standard_normal(3)
    dx, dw, db = reference.batch_norm_backward(dy, x, mean, invstd, w, training=False)
    bs = (1, 3, 1)
    np.testing.assert_allclose(dx, dy * w.reshape(bs) * invstd.reshape(bs), rtol=1e-14)
    # no weight: dweight and dbias are still returned, dx uses weight 1
    dx1, dw1, db1 = reference.batch_norm_backward(dy, x, mean, invstd, training=False)
    np.testing.assert_allclose(dx1, dy * invstd.reshape(bs), rtol=1e-14)
    np.testing.assert_array_equal(dw1, dw)
    np.testing.assert_array_equal(db1, db)
    # a mask of all zeros stops every gradient
    zeros = reference.pack_mask(np.zeros(x.size, bool))
    got = reference.batch_norm_backward(dy, x, mean, invstd, w, mask=zeros, addend=True)
    for g in got:
        assert not g.any()


# ---------------------------------------------------------------------------------------------
# Large offsets


@pytest.mark.parametrize("training", [True, False])
def test_large_offsets_are_stable(training, rng):
    """x + 1e4: the two-pass float64 statistics lose nothing to the offset."""
    x = rng.standard_normal((16, 4, 6, 6))
    off = 1e4
    w, b = rng.standard_normal(4) + 1, rng.standard_normal(4)
    rm, rv = rng.standard_normal(4) * 0.1, rng.uniform(0.5, 2, 4)
    y, mean, invstd, _ = reference.batch_norm(x, rm.copy(), rv.copy(), w, b, training,
                                              return_stats=True)
    rm_o, rv_o = rm + off, rv.copy()
    y_o, mean_o, invstd_o, _ = reference.batch_norm(x + off, rm_o, rv_o, w, b, training,
                                                    return_stats=True)
    np.testing.assert_allclose(y_o, y, rtol=0, atol=1e-9)
    np.testing.assert_allclose(mean_o - off, mean, rtol=0, atol=1e-9)
    np.testing.assert_allclose(invstd_o, invstd, rtol=1e-10)
    m, v = reference.batch_stats(x + off)
    m0, v0 = reference.batch_stats(x)
    np.testing.assert_allclose(v, v0, rtol=1e-10)
    # float32 input far from zero: still the exact statistics of the float32 values
    x32 = (x + off).astype(np.float32)
    m32, v32 = reference.batch_stats(x32)
    rows = per_channel(x32.astype(np.float64) - off, 1)
    np.testing.assert_allclose(m32 - off, rows.mean(1), atol=1e-9)
    np.testing.assert_allclose(v32, rows.var(1), rtol=1e-9)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_is_named(rng):
    x = rng.standard_normal((4, 3, 5))
    rm, rv = np.zeros(3), np.ones(3)
    cases = [
        (lambda: reference.batch_norm(np.ones(5), None, None, training=True), ValueError,
         "x has 1 dimension"),
        (lambda: reference.batch_norm(x, rm, rv, axis=3), ValueError, "axis 3 is out of range"),
        (lambda: reference.batch_norm(x, rm, rv, axis=-4), ValueError, "axis -4"),
        (lambda: reference.batch_norm(x, rm, rv, axis=1.0), TypeError, "axis"),
        (lambda: reference.batch_norm(np.ones((1, 3, 1, 1)), None, None, training=True),
         ValueError, "more than 1 value per channel"),
        (lambda: reference.batch_norm(np.ones((1, 3)), None, None, training=True), ValueError,
         "more than 1 value per channel"),
        (lambda: reference.batch_norm(x, None, None), ValueError, "running_mean and running_var"),
        (lambda: reference.batch_norm(x, rm, None), ValueError, "running_var"),
        (lambda: reference.batch_norm(x, np.zeros(4), rv), ValueError, "running_mean has shape"),
        (lambda: reference.batch_norm(x, rm, rv, np.ones(2)), ValueError, "weight has shape"),
        (lambda: reference.batch_norm(x, rm, rv, None, np.ones((1, 3))), ValueError,
         "bias has shape"),
        (lambda: reference.batch_norm(x, rm, rv, addend=np.ones((4, 3, 1))), ValueError,
         "addend has shape"),
        (lambda: reference.batch_stats(np.ones(3)), ValueError, "x has 1 dimension"),
        (lambda: reference.batch_stats(x, axis=5), ValueError, "axis 5"),
        (lambda: reference.batch_norm_backward(x[:2], x, rm, rv), ValueError, "dy has shape"),
        (lambda: reference.batch_norm_backward(x, x, rm, np.ones(2)), ValueError,
         "invstd has shape"),
        (lambda: reference.batch_norm_backward(x, x, rm, rv, mask=np.zeros(1, np.int32)),
         ValueError, "mask has shape"),
        (lambda: reference.batch_norm_backward(x, x, rm, rv, mask=np.zeros(2, np.uint8)),
         TypeError, "int32"),
    ]
    for m in (-0.1, 1.5, float("nan")):
        cases.append((lambda m=m: reference.batch_norm(x, rm, rv, True, momentum=m),
                      ValueError, "momentum"))
    for e in (0.0, -1e-5, float("nan"), float("inf")):
        cases.append((lambda e=e: reference.batch_norm(x, rm, rv, eps=e), ValueError, "eps"))
    for call, kind, says in cases:
        with pytest.raises(kind, match=says):
            call()


def test_one_value_per_channel_is_fine_in_eval(rng):
    x = rng.standard_normal((1, 3, 1, 1))
    rm, rv = rng.standard_normal(3), rng.uniform(0.5, 2, 3)
    y = reference.batch_norm(x, rm, rv)
    np.testing.assert_allclose(y.reshape(3), (x.reshape(3) - rm) / np.sqrt(rv + 1e-5))


def test_every_axis_of_every_rank(rng):
    """The channel axis anywhere: the same as moving it to position 1."""
    for ndim in (2, 3, 4, 5):
        shape = tuple(rng.integers(2, 5, ndim))
        for axis in itertools.chain(range(ndim), [-1]):
            x = rng.standard_normal(shape)
            y = reference.batch_norm(x, None, None, training=True, axis=axis)
            moved = np.moveaxis(x, axis, 1) if ndim > 1 else x
            y1 = reference.batch_norm(np.ascontiguousarray(moved), None, None, training=True)
            np.testing.assert_allclose(np.moveaxis(y, axis, 1), y1, rtol=1e-12, atol=1e-12)

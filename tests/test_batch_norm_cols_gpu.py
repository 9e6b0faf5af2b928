"""The one-read training kernel over columns (batch_norm_train_cols) on the GPU: every dtype x
{plain, relu, add + relu} against float64 NumPy (y, statistics, mask, running statistics, and
the backward after it), clusters of 1..16 blocks, agreement with the two passes, bitwise
repeatability, and channel counts whose rows share mask words. Cluster sizes and the addend
beyond what the tuning plans are forced through it (``cukern.ops.batch_norm.tuned``)."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest

import cukern

from .conftest import DTYPES, TOL, warm_family
from .test_batch_norm_cols_cpu import expected_tile, step_pack
from .test_batch_norm_gpu import (
    HAS_BN,
    MODES,
    Case,
    check_backward,
    check_forward,
    growth,
    np_dtype,
)

cp = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAS_BN, reason="cukern has no batch_norm yet")]


@pytest.fixture(scope="module", autouse=True)
def warm_batch_norm():
    warm_family("batch_norm")


def tuned(**changes):
    from cukern.ops import batch_norm as obn

    return obn.tuned(**changes) if changes else contextlib.nullcontext()


def last_plan():
    from cukern.ops import batch_norm as obn

    return obn.last_plan("batch_norm")


def channels_last(ndim: int):
    return (0, *range(2, ndim), 1) if ndim > 2 else None


# (logical shape, the cluster of blocks a tile's rows are split over: 1 with the default
# tuning, more where bn_one_read_max_bytes is set to hold ceil(rows / cluster) of them). The
# data's packs are 16 bytes (the kernel's: 8 for 16-bit data, step_pack).
SHAPES = [
    ((4, 32, 5, 7), 1),
    ((37, 64), 1),                  # (N, C)
    ((2, 48, 3, 5, 7), 1),          # 5-D channels last
    ((6, 64, 9, 11), 2),
    ((5, 96, 7, 9), 3),             # rows not a multiple of 3
    ((8, 32, 13, 13), 5),
    ((3, 64, 17, 19), 8),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,cluster", SHAPES, ids=[str(s) for s, _ in SHAPES])
def test_columns_one_read(shape, cluster, dtype, mode, rng):
    """y, mean, invstd, the mask and the running statistics against float64 NumPy through
    the columns kernel (its plan checked), then the backward from its outputs."""
    case = Case(shape, channels_last(len(shape)), dtype, mode, True, rng)
    a = math.prod(shape) // shape[1]
    item = np_dtype(dtype).itemsize
    # the addend (off in the tuning) with 16-byte packs (bn_one_read_min_pack_bytes_addend)
    pack = 16 // item if case.add else step_pack(dtype, 16 // item)
    tx = expected_tile(shape[1], pack, dtype)
    row = tx * pack * item * (2 if case.add else 1)
    changes = {"bn_one_read_cols_addend": 1,
               "bn_one_read_cols_max_pack_16bit": 8} if case.add else {}
    if cluster > 1:
        changes.update(bn_one_read_max_bytes=-(-a // cluster) * row,
                       bn_one_read_cols_max_cluster=8, bn_one_read_cols_max_cluster_16bit=8)
    with tuned(**changes):
        fwd = check_forward(case, rng)
        plan = last_plan()
    assert plan.one_read and plan.steps[0].kind == "train_cols", plan
    assert plan.steps[0].targs[1] == pack and plan.steps[0].block[0] == tx, plan
    assert plan.steps[0].cluster == cluster, plan
    check_backward(case, fwd)


@pytest.mark.parametrize("cluster", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_columns_one_read_agrees_with_two_passes(cluster, dtype, rng):
    """The same training calls through the columns kernel (clusters of 1 to 16 blocks: 16
    with the non-portable opt-in) and through the two passes: statistics and running
    statistics to rounding, y to its tolerance, the mask bits wherever y is clear of 0."""
    shape = (16, 64, 14, 14)
    a = 16 * 14 * 14
    item = np_dtype(dtype).itemsize
    pack = step_pack(dtype, 16 // item)
    row = expected_tile(64, pack, dtype) * pack * item
    limit = -(-a // cluster) * row  # exactly `cluster` blocks a tile
    case = Case(shape, (0, 2, 3, 1), dtype, "relu", True, rng)
    runs = []
    for changes in ({"bn_one_read_max_bytes": limit, "bn_one_read_cols_max_cluster": 16,
                     "bn_one_read_cols_max_cluster_16bit": 16},
                    {"bn_one_read_max_bytes": 0}):
        with tuned(**changes):
            rm, rv = cp.asarray(case.rm), cp.asarray(case.rv)
            got = cukern.batch_norm(case.xd, rm, rv, cp.asarray(case.w), cp.asarray(case.b),
                                    True, relu=True, return_stats=True)
            plan = last_plan()
            if changes["bn_one_read_max_bytes"]:
                assert plan.steps[0].kind == "train_cols" and plan.steps[0].cluster == cluster
            else:
                assert not plan.one_read
            runs.append([cp.asnumpy(v) for v in (*got, rm, rv)])
    (y1, m1, i1, k1, rm1, rv1), (y2, m2, i2, k2, rm2, rv2) = runs
    for name, u, v in (("mean", m1, m2), ("invstd", i1, i2), ("running_mean", rm1, rm2),
                       ("running_var", rv1, rv2)):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6, err_msg=name)
    tol = TOL[dtype] * growth(a)
    y1 = np.asarray(y1, np.float64)
    y2 = np.asarray(y2, np.float64)
    assert np.max(np.abs(y1 - y2)) <= tol * max(1.0, np.max(np.abs(y2)))
    bits = lambda k: np.unpackbits(k.view(np.uint8), bitorder="little")  # noqa: E731
    n = y2.size
    # y's memory order is channels last: compare in it
    clear = (np.abs(np.transpose(y2, (0, 2, 3, 1))) > 4 * tol).ravel()
    assert np.array_equal(bits(k1)[:n][clear], bits(k2)[:n][clear])
    assert not bits(k1)[n:].any()


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_columns_one_read_is_repeatable(dtype, rng):
    """Two runs over a cluster of 4 give the same bits: y, mean, invstd, mask, and the running
    statistics updated from the same start."""
    shape = (12, 64, 10, 10)
    case = Case(shape, (0, 2, 3, 1), dtype, "add_relu", True, rng)
    outs = []
    item = np_dtype(dtype).itemsize
    row = 2 * 16 * expected_tile(64, 16 // item, dtype)  # x and the addend, 16-byte packs
    with tuned(bn_one_read_max_bytes=12 * 100 * row // 4 + 64, bn_one_read_cols_max_cluster=8,
               bn_one_read_cols_max_cluster_16bit=8, bn_one_read_cols_addend=1,
               bn_one_read_cols_max_pack_16bit=8):
        for _ in range(2):
            rm, rv = cp.asarray(case.rm), cp.asarray(case.rv)
            got = cukern.batch_norm(case.xd, rm, rv, cp.asarray(case.w), cp.asarray(case.b),
                                    True, addend=case.ad, relu=True, return_stats=True)
            plan = last_plan()
            assert plan.steps[0].kind == "train_cols" and plan.steps[0].cluster > 1, plan
            outs.append([cp.asnumpy(v).tobytes() for v in (*got, rm, rv)])
    assert outs[0] == outs[1]


def test_columns_one_read_with_few_rows_and_no_outputs(rng):
    """Blocks with more threads than rows (one row), and y alone without running statistics,
    weight or bias: the same y as the full call's."""
    for shape in [(1, 64, 1, 2), (2, 32)]:
        case = Case(shape, channels_last(len(shape)), "float32", "relu", True, rng)
        full = cukern.batch_norm(case.xd, cp.asarray(case.rm), cp.asarray(case.rv),
                                 cp.asarray(case.w), cp.asarray(case.b), True, relu=True,
                                 return_stats=True)
        assert last_plan().steps[0].kind == "train_cols"
        y = cukern.batch_norm(case.xd, None, None, cp.asarray(case.w), cp.asarray(case.b),
                              True, relu=True)
        assert cp.asnumpy(y).tobytes() == cp.asnumpy(full[0]).tobytes()
        n = math.prod(shape)
        assert full[0].shape == shape and np.isfinite(cp.asnumpy(full[0])).all() and n

"""cukern.dask without a GPU: graphs of NumPy blocks (each runs the float64 reference) against
the reference on the whole array; the rechunk rule and its warning; the cross-block merges
(Chan's formula on uneven chunks and offset data, the partial-sum trees); permute's block
reordering; synchronised batch norm and its running statistics; errors; and the command
line's ``--workers N --device cpu`` against the in-process run."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
import dask  # noqa: E402

import cukern.dask as cd  # noqa: E402
from cukern import _io, reference  # noqa: E402
from cukern.dask import _batch_norm as dbn  # noqa: E402

from .conftest import TOL  # noqa: E402
from .test_cli import leftovers, run, save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def np_dtype(name):
    if name == "bfloat16":
        from ml_dtypes import bfloat16

        return np.dtype(bfloat16)
    return np.dtype(name)


def close(out, ref, dtype: str, scale: float = 1.0) -> None:
    out = np.asarray(out).astype(np.float64)
    ref = np.asarray(ref).astype(np.float64)
    assert out.shape == ref.shape
    err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300)
    assert err <= TOL[dtype] * scale, (err, TOL[dtype] * scale)


@contextlib.contextmanager
def quiet():
    """A context in which any warning (a rechunk's PerformanceWarning) fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# ---------------------------------------------------------------------------------------------
# Import rules.

def test_import_cukern_does_not_import_dask():
    code = "import sys, cukern; assert 'dask' not in sys.modules, 'dask imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_without_dask_says_what_to_install():
    code = ("import sys; sys.modules['dask'] = None\n"
            "try:\n    import cukern.dask\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                         capture_output=True, text=True).stdout
    assert 'pip install "cukern[dask]"' in out


# ---------------------------------------------------------------------------------------------
# Row-wise ops: chunks, rechunks and values.

@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_softmax_family_matches_reference(rng, op, dtype):
    x = rng.standard_normal((23, 5, 17)).astype(np_dtype(dtype))
    for axis in (-1, 0, 1):
        chunks = [(7, 9, 7), (2, 3), (10, 7)]
        chunks[axis % 3] = -1
        with quiet():
            y = getattr(cd, op)(da.from_array(x, chunks=tuple(chunks)), axis=axis)
        out = y.compute()
        assert out.dtype == x.dtype and y.chunks[axis % 3] == (x.shape[axis],)
        close(out, getattr(reference, op)(x, axis=axis), dtype)


@pytest.mark.parametrize("op", ["softmax_backward", "log_softmax_backward"])
def test_softmax_backward_matches_reference(rng, op):
    y = rng.standard_normal((31, 40)).astype(np.float32)
    dy = rng.standard_normal((31, 40)).astype(np.float32)
    with pytest.warns(cd.PerformanceWarning, match="chunked unlike y"):
        dx = getattr(cd, op)(da.from_array(dy, chunks=(5, -1)), da.from_array(y, chunks=(8, -1)))
    assert dx.chunks == ((8, 8, 8, 7), (40,))
    close(dx.compute(), getattr(reference, op)(dy, y), "float32")


def test_rechunk_only_along_the_reduced_axis_with_its_cost(rng):
    x = da.from_array(rng.standard_normal((64, 48)), chunks=(16, 12))
    with pytest.warns(cd.PerformanceWarning) as rec:
        y = cd.softmax(x, axis=-1)
    assert y.chunks == ((16,) * 4, (48,))  # rows untouched, the axis whole
    msg = str(rec[0].message)
    assert "axis 1 (4 chunks)" in msg and "16 -> 4 chunks" in msg
    assert "1.5 KiB -> 6.0 KiB" in msg and "{1: -1}" in msg
    with pytest.warns(cd.PerformanceWarning, match="axis 0"):
        assert cd.softmax(x, axis=0).chunks == ((64,), (12,) * 4)
    with quiet():  # already whole: no rechunk, no warning, the same chunks
        assert cd.softmax(x.rechunk((16, -1))).chunks == ((16,) * 4, (48,))


def test_norms_need_every_normalised_axis_whole(rng):
    x = da.from_array(rng.standard_normal((6, 8, 10)), chunks=(2, 4, 5))
    with pytest.warns(cd.PerformanceWarning, match="axis 1 .* axis 2"):
        y = cd.layer_norm(x, (8, 10), return_stats=False)
    assert y.chunks == ((2, 2, 2), (8,), (10,))
    with quiet():
        assert cd.rms_norm(x.rechunk((2, -1, -1)), 10, return_stats=False).chunks[0] == (2,) * 3


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norm_forward_matches_reference(rng, dtype, op):
    dt = np_dtype(dtype)
    x = (rng.standard_normal((37, 3, 16)) * 2 + 5).astype(dt)
    r = rng.standard_normal(x.shape).astype(dt)
    w = rng.standard_normal((3, 16)).astype(dt)
    b = rng.standard_normal((3, 16)).astype(dt)
    dx = da.from_array(x, chunks=(10, -1, -1))
    kw = dict(residual=da.from_array(r, chunks=(10, -1, -1)), return_stats=True)
    args = (w, b) if op == "layer_norm" else (w,)
    with quiet():
        outs = dask.compute(*getattr(cd, op)(dx, (3, 16), *args, **kw))
    refs = getattr(reference, op)(x, (3, 16), *args, residual=r, return_stats=True)
    sdt = np.float64 if dtype == "float64" else np.float32
    assert len(outs) == len(refs) == (4 if op == "layer_norm" else 3)
    assert outs[0].dtype == dt and outs[-1].dtype == dt
    assert all(s.dtype == sdt and s.shape == (37,) for s in outs[1:-1])
    for o, ref in zip(outs, refs):
        close(o, ref, dtype)
    y = getattr(cd, op)(dx, (3, 16), *args)  # y alone by default
    close(y.compute(), getattr(reference, op)(x, (3, 16), *args), dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norm_backward_partial_sum_tree(rng, dtype, op):
    """dweight and dbias over 40 blocks (a two-level tree of 8) equal the reference's sums of
    the whole array; dx block by block."""
    dt = np_dtype(dtype)
    x = rng.standard_normal((200, 24)).astype(dt)
    dy = rng.standard_normal((200, 24)).astype(dt)
    w = rng.standard_normal(24).astype(dt)
    layer = op == "layer_norm"
    stats = getattr(reference, op)(x, 24, return_stats=True)[1:]
    sdt = np.float64 if dtype == "float64" else np.float32
    stats = [s.astype(sdt) for s in stats]
    dxa = da.from_array(x, chunks=(5, -1))
    dya = da.from_array(dy, chunks=(5, -1))
    with quiet():
        res = getattr(cd, op + "_backward")(dya, dxa, *stats, w)
    assert len(res) == (3 if layer else 2)
    layers = res[1].__dask_graph__().layers
    assert sum(1 for name in layers if "sum" in name) >= 2  # chunk sums and a tree of them
    outs = dask.compute(*res)
    refs = getattr(reference, op + "_backward")(dy, x, *stats, w)
    for o, ref in zip(outs, refs):
        assert o.dtype == dt
        close(o, ref, dtype)
    nw = getattr(cd, op + "_backward")(dya, dxa, *[da.from_array(s, chunks=5) for s in stats])
    assert nw[1] is None
    close(nw[0].compute(), getattr(reference, op + "_backward")(dy, x, *stats)[0], dtype)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norm_backward_tree_moves_partial_sums_not_dx(rng, op):
    """On two workers the dweight/dbias tree's nodes pull only the blocks' partial sums: its
    nodes once read whole packed blocks, dx included, and every node's worker pulled its peers'
    dx (layer norm forward + backward ran 25x slower on 2 GPUs than on 1)."""
    distributed = pytest.importorskip("distributed")
    x = rng.standard_normal((4096, 256)).astype(np.float32)
    dy = rng.standard_normal((4096, 256)).astype(np.float32)
    w = rng.standard_normal(256).astype(np.float32)
    stats = [s.astype(np.float32) for s in getattr(reference, op)(x, 256, return_stats=True)[1:]]
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        xa, dya = client.persist([da.from_array(a, chunks=(512, -1)) for a in (x, dy)])
        sa = client.persist([da.from_array(s, chunks=512) for s in stats])
        distributed.wait([xa, dya, *sa])
        with quiet():
            res = getattr(cd, op + "_backward")(dya, xa, *sa, w)
        grads = client.compute(list(res[1:]), sync=True)

        def pulled(dask_worker):  # (layer, bytes) of every key a worker fetched
            log = getattr(dask_worker, "transfer_incoming_log", None)
            if log is None:
                log = dask_worker.state.transfer_incoming_log
            return [(k[0] if isinstance(k, tuple) else k, n) for e in log
                    for k, n in e.get("keys", {}).items()]

        fetched = [f for got in client.run(pulled).values() for f in got]
    packed = re.compile(rf"^cukern-{op}_backward-[0-9a-f]{{32}}$")  # the op's (dx, sums) blocks
    moved = [(layer, n) for layer, n in fetched if packed.match(str(layer))]
    assert not moved, f"packed blocks (dx and sums) fetched by another worker: {moved[:3]}"
    assert any(str(layer).endswith("-leaf") for layer, _ in fetched), fetched  # sums did travel
    refs = getattr(reference, op + "_backward")(dy, x, *stats, w)[1:]
    for g, ref in zip(grads, refs):
        close(g, ref, "float32")


def _block_deps(arr) -> dict:
    """Each block task of ``arr``'s top layer -> the keys it depends on."""
    graph = dict(arr.__dask_graph__())
    return {k: set(dask.core.get_dependencies(graph, k)) for k in graph
            if isinstance(k, tuple) and k[0] == arr.name}


def _one_block_lineage(arr) -> None:
    """Every block task of ``arr`` reads only blocks at its own index: no task that every
    block shares, which would make its worker a candidate for every block and let the
    scheduler move whole blocks there."""
    for key, deps in _block_deps(arr).items():
        assert deps, key
        for d in deps:
            # the same block index (a per-row statistic: the index of its leading axes)
            assert isinstance(d, tuple) and d[1:] == key[1:len(d)], (key, d)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_parameters_ride_inside_the_block_tasks(rng, dtype):
    """Weight, bias, the batch's statistics and running statistics are NumPy/CuPy values in
    each block's task, not shared tasks (on 2 GPUs the scheduler moved 15-45 GB a call to the
    worker holding such a task)."""
    dt = np_dtype(dtype)
    x = da.from_array(rng.standard_normal((64, 32)).astype(dt), chunks=(8, -1))
    dy = da.from_array(rng.standard_normal((64, 32)).astype(dt), chunks=(8, -1))
    w, b = (rng.standard_normal(32).astype(dt) for _ in range(2))
    y, mean, rstd = cd.layer_norm(x, 32, w, b, return_stats=True)
    _one_block_lineage(_packed(y))
    dx = cd.layer_norm_backward(dy, x, mean, rstd, w)[0]
    _one_block_lineage(_packed(dx))
    xb = da.from_array(rng.standard_normal((16, 4, 3, 3)).astype(dt), chunks=(2, -1, -1, -1))
    rm, rv = np.zeros(4, np.float32), np.ones(4, np.float32)
    wc, bc = np.ones(4, np.float32), np.zeros(4, np.float32)
    for training in (True, False):
        yb = cd.batch_norm(xb, rm.copy(), rv.copy(), wc, bc, training=training)
        _one_block_lineage(yb)
    yb, mu, ist, _ = cd.batch_norm(xb, rm, rv, wc, bc, training=True, return_stats=True)
    dyb = da.from_array(rng.standard_normal((16, 4, 3, 3)).astype(dt), chunks=(2, -1, -1, -1))
    res = cd.batch_norm_backward(dyb, xb, mu.compute(), ist.compute(), wc)
    graph = dict(res[0].__dask_graph__())
    sums = [k for k in graph if isinstance(k, tuple) and str(k[0]).startswith("cukern-sums-")
            and len(k) == 6]
    assert sums
    for k in sums:  # the backward's per-block sums read their own blocks only
        for d in dask.core.get_dependencies(graph, k):
            assert d[1:5] == k[1:5], (k, d)


def _packed(arr):
    """The tuple-valued layer under an op's output (``cukern-out0-<packed>``)."""
    graph = arr.__dask_graph__()
    name = arr.name.split("cukern-out0-", 1)[1] if arr.name.startswith("cukern-out0-") \
        else arr.name
    return type(arr)(graph, name, chunks=arr.chunks, dtype=arr.dtype, meta=arr._meta)


# ---------------------------------------------------------------------------------------------
# Batch norm: Chan's merge, synchronised statistics, running statistics, the backward.

def test_chan_merge_on_uneven_chunks_of_offset_data(rng):
    x = rng.standard_normal((13, 5, 7, 3)) + 1e4
    x[:, 2] += rng.standard_normal() * 1e3  # channels of different offsets
    xa = da.from_array(x, chunks=((1, 5, 7), (2, 3), (3, 3, 1), (2, 1)))
    mean, var = dask.compute(*cd.batch_stats(xa, axis=1))
    red = (0, 2, 3)
    np.testing.assert_allclose(mean, x.mean(axis=red), rtol=1e-14)
    np.testing.assert_allclose(var, x.var(axis=red), rtol=1e-10)
    # the k-way merge itself, against NumPy on the concatenated parts
    parts = [rng.standard_normal(n) * 3 + 1e4 for n in (1, 2, 17, 4)]
    states = np.array([[p.size, p.mean(), ((p - p.mean()) ** 2).sum()] for p in parts])
    n, m, m2 = dbn._chan(states, axis=0)
    allx = np.concatenate(parts)
    assert n == allx.size and abs(m - allx.mean()) < 1e-11
    assert abs(m2 / n - allx.var()) < 1e-9 * allx.var()


def layouts_of(shape, chunks):
    return da.from_array(np.zeros(shape), chunks=chunks)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("mode", ["plain", "relu", "add_relu"])
def test_synchronised_batch_norm_equals_whole_batch(rng, dtype, mode):
    dt = np_dtype(dtype)
    pdt = np.float64 if dtype == "float64" else np.float32
    x = (rng.standard_normal((9, 4, 5, 6)) * 2 + 3).astype(dt)
    z = rng.standard_normal(x.shape).astype(dt) if mode == "add_relu" else None
    w, b = rng.standard_normal(4).astype(pdt), rng.standard_normal(4).astype(pdt)
    rm, rv = rng.standard_normal(4).astype(pdt), rng.random(4).astype(pdt) + 0.5
    rm_ref, rv_ref = rm.copy(), rv.copy()
    chunks = ((2, 4, 3), (3, 1), (5,), (4, 2))
    xa = da.from_array(x, chunks=chunks)
    za = None if z is None else da.from_array(z, chunks=chunks)
    relu = mode != "plain"
    with quiet():
        y, mean, invstd, mask = cd.batch_norm(xa, rm, rv, w, b, True, 0.3, 1e-5, addend=za,
                                              relu=relu, return_stats=True)
    ref = reference.batch_norm(x, rm_ref, rv_ref, w, b, True, 0.3, 1e-5, addend=z, relu=relu,
                               return_stats=True)
    # the running statistics were updated at the call, once
    np.testing.assert_allclose(rm, rm_ref, rtol=1e-6)
    np.testing.assert_allclose(rv, rv_ref, rtol=1e-6)
    outs = dask.compute(y, mean, invstd)
    dask.compute(y, mean)  # computing again leaves them alone
    np.testing.assert_allclose(rm, rm_ref, rtol=1e-6)
    assert outs[0].dtype == dt and outs[1].dtype == pdt and outs[2].dtype == pdt
    close(outs[0], ref[0], dtype, scale=2)
    np.testing.assert_allclose(outs[1], ref[1], rtol=1e-6 if pdt == np.float32 else 1e-12)
    np.testing.assert_allclose(outs[2], ref[2], rtol=1e-6 if pdt == np.float32 else 1e-12)
    if not relu:
        assert mask is None
        return
    words = mask.compute()
    assert mask.chunks[0] == tuple(-(-int(np.prod(s)) // 32) for s in dbn._block_shapes(xa))
    keep = reference._keep_of(ref[3], x)
    for j, idx in enumerate(np.ndindex(*xa.numblocks)):  # each block's words: its own y > 0
        sl = tuple(slice(sum(c[:i]), sum(c[:i + 1])) for c, i in zip(chunks, idx))
        start = sum(mask.chunks[0][:j])
        got = reference.unpack_mask(words[start:start + mask.chunks[0][j]], keep[sl].size)
        agree = got == keep[sl].ravel()
        assert agree.mean() > 0.999


def test_batch_norm_mask_is_the_whole_mask_for_row_blocks(rng):
    x = rng.standard_normal((8, 4, 8))  # blocks of 2 x 4 x 8 = 64 values: whole words
    xa = da.from_array(x, chunks=(2, -1, -1))
    _, _, _, mask = cd.batch_norm(xa, None, None, training=True, relu=True, return_stats=True)
    ref = reference.batch_norm(x, None, None, training=True, relu=True, return_stats=True)
    np.testing.assert_array_equal(mask.compute(), ref[3])


def test_running_statistics_compute_at_the_call_only(rng):
    calls = []

    def counting(dsk, keys, **kw):
        calls.append(1)
        return dask.get(dsk, keys, **kw)

    x = da.from_array(rng.standard_normal((6, 3, 4)), chunks=(2, 3, 4))
    with dask.config.set(scheduler=counting):
        y = cd.batch_norm(x, None, None, training=True)  # nothing to update: lazy
        assert calls == []
        rm, rv = np.zeros(3), np.ones(3)
        y = cd.batch_norm(x, rm, rv, training=True, momentum=1.0)
        assert len(calls) == 1
        y.compute()
        y.compute()
    xn = x.compute()
    np.testing.assert_allclose(rm, xn.mean(axis=(0, 2)), rtol=1e-12)
    np.testing.assert_allclose(rv, xn.var(axis=(0, 2), ddof=1), rtol=1e-12)


class Unhashable(np.ndarray):
    """A parameter that Dask's tokenize must not touch (it pickles a CuPy array to hash it:
    a copy to the host and a device synchronisation on every call)."""


@dask.base.normalize_token.register(Unhashable)
def _no_hashing(a):
    raise RuntimeError("a cukern.dask parameter was hashed")


def test_parameters_are_not_hashed_and_trees_are_flat(rng):
    x = rng.standard_normal((40, 3, 4)).astype(np.float32)
    xa = da.from_array(x, chunks=(2, 3, 4))  # 20 blocks: a tree of two levels
    w, b, rm, rv = (rng.standard_normal(3).astype(np.float32).view(Unhashable)
                    for _ in range(4))
    rv = np.abs(rv).view(Unhashable)
    ns = (3, 4)
    w2 = rng.standard_normal(ns).astype(np.float32).view(Unhashable)
    y, mean, rstd = cd.layer_norm(xa, ns, w2, w2, return_stats=True)
    dx, dw, db = cd.layer_norm_backward(xa, xa, mean, rstd, w2)
    yb = cd.batch_norm(xa, rm, rv, w, b, training=True)
    names = list(dw.__dask_graph__().layers)
    assert sum(1 for n in names if "-sum-" in n) == 2  # 20 blocks -> 2 nodes -> 1
    assert not any(n.startswith("cukern-out") for n in yb.__dask_graph__().layers)
    stats = reference.layer_norm(x, ns, w2, w2, return_stats=True)[1:]
    ref = reference.layer_norm_backward(x, x, *stats, w2)
    for o, r in zip(dask.compute(dx, dw, db), ref):
        close(o, r, "float32", scale=10)
    close(yb.compute(), reference.batch_norm(x, np.zeros(3), np.ones(3), w, b, True),
          "float32", scale=10)


def test_batch_norm_eval_and_channels_last(rng):
    x = rng.standard_normal((5, 7, 6, 3)).astype(np.float32)  # NHWC: channel axis -1
    rm, rv = rng.standard_normal(3).astype(np.float32), rng.random(3).astype(np.float32) + 0.1
    xa = da.from_array(x, chunks=(2, 3, 6, 3))
    y, mean, invstd, _ = cd.batch_norm(xa, rm, rv, axis=-1, return_stats=True)
    ref = reference.batch_norm(x, rm, rv, axis=-1, return_stats=True)
    close(y.compute(), ref[0], "float32")
    np.testing.assert_allclose(invstd.compute(), ref[2], rtol=1e-6)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("mode", ["plain", "relu", "add_relu"])
def test_batch_norm_backward_matches_whole_batch(rng, training, mode):
    x = rng.standard_normal((10, 3, 4, 5)) * 2 + 1
    dy = rng.standard_normal(x.shape)
    w = rng.standard_normal(3)
    chunks = ((3, 3, 4), (2, 1), (4,), (2, 3))
    xa, dya = da.from_array(x, chunks=chunks), da.from_array(dy, chunks=chunks)
    relu = mode != "plain"
    _, mean, invstd, mask = cd.batch_norm(xa, None, None, w, None, True, relu=relu,
                                          return_stats=True)
    ref_y = reference.batch_norm(x, None, None, w, None, True, relu=relu, return_stats=True)
    add = mode == "add_relu"
    got = dask.compute(*cd.batch_norm_backward(dya, xa, mean, invstd, w, mask=mask,
                                               addend=add, training=training))
    ref = reference.batch_norm_backward(dy, x, ref_y[1], ref_y[2], w, mask=ref_y[3],
                                        addend=add, training=training)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        close(g, r, "float64", scale=1e3)


def test_batch_norm_backward_dtypes(rng):
    x = rng.standard_normal((8, 2, 6)).astype(np.float16)
    dy = rng.standard_normal(x.shape).astype(np.float16)
    w = rng.standard_normal(2).astype(np.float32)
    xa, dya = da.from_array(x, chunks=(3, 1, 6)), da.from_array(dy, chunks=(3, 1, 6))
    _, mean, invstd, _ = cd.batch_norm(xa, None, None, training=True, return_stats=True)
    dx, dw, db = cd.batch_norm_backward(dya, xa, mean, invstd, w)
    assert (dx.dtype, dw.dtype, db.dtype) == (np.float16, np.float32, np.float32)
    dx2, dw2, _ = cd.batch_norm_backward(dya, xa, mean, invstd)
    assert dw2.dtype == np.float32
    ref = reference.batch_norm_backward(dy, x, mean.compute(), invstd.compute(), w)
    close(dx.compute(), ref[0], "float16")
    close(dw.compute(), ref[1], "float32", scale=100)


# ---------------------------------------------------------------------------------------------
# Permute.

def test_permute_reorders_blocks(rng):
    x = rng.standard_normal((6, 5, 4, 3)).astype(np.float32)
    xa = da.from_array(x, chunks=(4, 2, 3, 3))
    y = cd.permute(xa, (2, 0, 3, 1))
    assert y.chunks == (xa.chunks[2], xa.chunks[0], xa.chunks[3], xa.chunks[1])
    assert y.npartitions == xa.npartitions
    np.testing.assert_array_equal(y.compute(), np.transpose(x, (2, 0, 3, 1)))
    np.testing.assert_array_equal(cd.permute(xa).compute(), x.T)
    nhwc = cd.to_nhwc(xa)
    np.testing.assert_array_equal(nhwc.compute(), np.transpose(x, (0, 2, 3, 1)))
    np.testing.assert_array_equal(cd.to_nchw(nhwc).compute(), x)
    ints = da.from_array(np.arange(24, dtype=np.int16).reshape(2, 3, 4), chunks=(1, 2, 3))
    np.testing.assert_array_equal(cd.permute(ints, (1, 2, 0)).compute(),
                                  np.arange(24, dtype=np.int16).reshape(2, 3, 4).transpose(1, 2, 0))


# ---------------------------------------------------------------------------------------------
# Errors, at graph construction.

def test_errors(rng):
    x = da.from_array(rng.standard_normal((4, 6)), chunks=(2, 6))
    with pytest.raises(TypeError, match="softmax: x must be a dask.array.Array"):
        cd.softmax(np.zeros((2, 2)))
    with pytest.raises(TypeError, match="dtype int64"):
        cd.softmax(da.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        cd.log_softmax(x, axis=2)
    with pytest.raises(ValueError, match="dy has shape"):
        cd.softmax_backward(x[:2], x)
    with pytest.raises(ValueError, match="normalized_shape"):
        cd.layer_norm(x, 5)
    with pytest.raises(ValueError, match="weight has shape"):
        cd.layer_norm(x, 6, np.ones(5))
    with pytest.raises(TypeError, match="weight has dtype float32"):
        cd.rms_norm(x, 6, np.ones(6, np.float32))
    with pytest.raises(ValueError, match="eps"):
        cd.layer_norm(x, 6, eps=0.0)
    with pytest.raises(TypeError, match="rstd has dtype"):
        cd.rms_norm_backward(x, x, np.ones(4, np.float32))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        cd.batch_norm(da.zeros((1, 3)), None, None, training=True)
    with pytest.raises(ValueError, match="needs running_mean"):
        cd.batch_norm(x, None, None)
    with pytest.raises(ValueError, match="momentum"):
        cd.batch_norm(x, None, None, training=True, momentum=2)
    with pytest.raises(ValueError, match="at least 2"):
        cd.batch_stats(da.zeros(5))
    _, m, s, mask = cd.batch_norm(x, None, None, training=True, relu=True, return_stats=True)
    with pytest.raises(ValueError, match="chunks"):
        cd.batch_norm_backward(x.rechunk((1, 6)), x.rechunk((1, 6)), m, s, mask=mask)
    with pytest.raises(ValueError, match="axes"):
        cd.permute(x, (0, 0))
    with pytest.raises(ValueError, match="3 to 5"):
        cd.to_nhwc(x)


# ---------------------------------------------------------------------------------------------
# Any scheduler: the graphs pickle and run on distributed worker processes.

def test_on_a_distributed_cluster(rng):
    distributed = pytest.importorskip("distributed")
    x = rng.standard_normal((40, 3, 8))
    xa = da.from_array(x, chunks=(7, 3, 8))
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster):
        y, mean, rstd = dask.compute(*cd.layer_norm(xa, 8, np.ones(8), np.zeros(8),
                                                    return_stats=True))
        rm, rv = np.zeros(3), np.ones(3)
        yb = cd.batch_norm(xa, rm, rv, training=True).compute()
        p = cd.permute(xa, (1, 2, 0)).compute()
    close(y, reference.layer_norm(x, 8, np.ones(8), np.zeros(8)), "float64")
    close(yb, reference.batch_norm(x, np.zeros(3), np.ones(3), training=True), "float64")
    assert np.array_equal(p, x.transpose(1, 2, 0))
    np.testing.assert_allclose(rm, 0.1 * x.mean(axis=(0, 2)), rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# The command line with --workers.

def test_cli_workers_write_the_same_files(tmp_path, rng):
    pytest.importorskip("distributed")
    x = save(tmp_path / "x.npy", rng.standard_normal((300, 33)).astype(np.float32))
    dy = save(tmp_path / "dy.npy", rng.standard_normal((300, 33)).astype(np.float32))
    w = save(tmp_path / "w.npy", rng.standard_normal(33).astype(np.float32))
    common = ["--device", "cpu", "--chunk-rows", "40", "-q"]
    for workers in ([], ["--workers", "2"]):
        tag = "n" if workers else "1"
        run("softmax", x, "-o", tmp_path / f"s{tag}.npy", *common, *workers)
        run("layer-norm", x, "-o", tmp_path / f"l{tag}.npy", "--weight", w, "--grad", dy,
            "--param-grads", tmp_path / f"g{tag}.npz", *common, *workers)
    for a in ("s", "l"):
        assert (tmp_path / f"{a}1.npy").read_bytes() == (tmp_path / f"{a}n.npy").read_bytes()
    g1, gn = np.load(tmp_path / "g1.npz"), np.load(tmp_path / "gn.npz")
    for k in ("dweight", "dbias"):
        np.testing.assert_array_equal(g1[k], gn[k])
    assert leftovers(tmp_path) == []


def test_cli_workers_errors_leave_nothing(tmp_path, rng):
    pytest.importorskip("distributed")
    from cukern._chunked import Result, as_rows
    from cukern.cli import _workers

    x = save(tmp_path / "x.npy", rng.standard_normal((50, 9)).astype(np.float32))
    res = run("softmax", x, "-o", tmp_path / "y.npy", "--workers", "2", "--scheduler",
              "tcp://127.0.0.1:9", "--device", "cpu", code=2)
    assert "not both" in res.stderr
    res = run("softmax", x, "-o", tmp_path / "y.npy", "--scheduler", "foo://nowhere:1",
              "--device", "cpu", code=2)
    assert "unknown address scheme" in res.stderr
    xm = np.load(x, mmap_mode="r")

    def boom(t):  # fails in a worker process
        raise ValueError("boom in a worker")

    with pytest.raises(ValueError, match="boom in a worker"):
        with _io.Outputs() as outs:
            y = outs.npy(tmp_path / "z.npy", xm.shape, np.float32)
            _workers.run(boom, [as_rows(xm, 50, 9, 1)], [Result("y", 9, np.float32)],
                         [as_rows(y, 50, 9, 1)], device="cpu", chunk_rows=10, workers=2)
    assert leftovers(tmp_path) == [] and not (tmp_path / "z.npy").exists()
    assert not (tmp_path / "y.npy").exists()


def test_cli_workers_keep_quiet_beside_another_cluster(tmp_path, rng):
    """With the dashboard's usual port 8787 taken (a notebook's cluster), --workers warns of
    nothing: its scheduler's HTTP server takes a free port."""
    import socket

    pytest.importorskip("distributed")
    x = save(tmp_path / "x.npy", rng.standard_normal((20, 9)).astype(np.float32))
    with contextlib.ExitStack() as stack:
        holder = stack.enter_context(socket.socket())
        with contextlib.suppress(OSError):  # already taken: the same test
            holder.bind(("", 8787))
            holder.listen()
        caught = stack.enter_context(warnings.catch_warnings(record=True))
        warnings.simplefilter("always")
        run("softmax", x, "-o", tmp_path / "y.npy", "--workers", "2", "--device", "cpu", "-q")
    said = [str(w.message) for w in caught if "in use" in str(w.message)]
    assert said == []
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"),
                               reference.softmax(np.load(x).astype(np.float64)), rtol=1e-6)

"""cukern.dask on CuPy blocks, on the threaded scheduler and on a dask-cuda LocalCUDACluster of
one worker: every op against the single-GPU call on the same data, bitwise where each block
runs the same call as a single-GPU call on its rows (row-wise ops, permute), within tolerance
for merged statistics and reduced parameter gradients; and, with two or more GPUs, a
LocalCUDACluster over all of them against one GPU."""

from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
da = pytest.importorskip("dask.array")
import dask  # noqa: E402

import cukern  # noqa: E402
import cukern.dask as cd  # noqa: E402
from cukern import reference  # noqa: E402

from .conftest import TOL  # noqa: E402
from .test_cli import leftovers, run, save  # noqa: E402

pytestmark = pytest.mark.gpu
STAT_RTOL = {"float16": 1e-5, "bfloat16": 1e-5, "float32": 1e-5, "float64": 1e-12}


def np_dtype(name):
    if name == "bfloat16":
        from ml_dtypes import bfloat16

        return np.dtype(bfloat16)
    return np.dtype(name)


def gpus() -> int:
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # no driver: the gpu marker skips these tests anyway
        return 0


def host(a) -> np.ndarray:
    return cp.asnumpy(a) if isinstance(a, cp.ndarray) else np.asarray(a)


def same_bits(a, b) -> None:
    a, b = host(a), host(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def close(out, ref, dtype: str, scale: float = 1.0) -> None:
    out, ref = host(out).astype(np.float64), host(ref).astype(np.float64)
    assert out.shape == ref.shape
    assert not np.isnan(out).any()
    err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300)
    assert err <= TOL[dtype] * scale, (err, TOL[dtype] * scale)


def on_gpu(a, chunks):
    return da.from_array(cp.asarray(a), chunks=chunks, asarray=False)


def by_rows(fn, arrays, rows: int):
    """The single-GPU op on each block of ``rows`` rows, concatenated (per output)."""
    n = arrays[0].shape[0]
    parts = [fn(*(a[i:i + rows] for a in arrays)) for i in range(0, n, rows)]
    if isinstance(parts[0], tuple):
        return tuple(cp.concatenate([p[j] for p in parts]) for j in range(len(parts[0])))
    return cp.concatenate(parts)


@pytest.fixture(scope="module", params=["threads", "cuda_cluster"])
def scheduler(request):
    """The threaded scheduler on this GPU, then a LocalCUDACluster of one worker."""
    if request.param == "threads":
        with dask.config.set(scheduler="threads"):
            yield "threads"
        return
    dask_cuda = pytest.importorskip("dask_cuda", reason="dask-cuda is not installed "
                                    "(pip install 'cukern[dask]')")
    distributed = pytest.importorskip("distributed")
    with dask_cuda.LocalCUDACluster(n_workers=1, dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        yield client


# ---------------------------------------------------------------------------------------------
# Row-wise ops: each block is a single-GPU call on its rows.

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_family(scheduler, rng, op, dtype):
    x = cp.asarray(rng.standard_normal((1000, 700)).astype(np_dtype(dtype)))
    dy = cp.asarray(rng.standard_normal((1000, 700)).astype(np_dtype(dtype)))
    f = getattr(cukern, op)
    y = getattr(cd, op)(on_gpu(x, (256, -1))).compute()
    assert isinstance(y, cp.ndarray)
    same_bits(y, by_rows(f, [x], 256))
    close(y, f(x), dtype)
    ys = f(x)
    back = getattr(cd, op + "_backward")(on_gpu(dy, (300, -1)), on_gpu(ys, (300, -1)))
    same_bits(back.compute(), by_rows(getattr(cukern, op + "_backward"), [dy, ys], 300))


def test_softmax_rechunks_the_axis(scheduler, rng):
    x = cp.asarray(rng.standard_normal((300, 512)).astype(np.float32))
    with pytest.warns(cd.PerformanceWarning):
        y = cd.softmax(on_gpu(x, (100, 128)))
    same_bits(y.compute(), by_rows(cukern.softmax, [x], 100))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norms(scheduler, rng, op, dtype):
    dt = np_dtype(dtype)
    x = cp.asarray((rng.standard_normal((2000, 1024)) * 2 + 1).astype(dt))
    r = cp.asarray(rng.standard_normal((2000, 1024)).astype(dt))
    dy = cp.asarray(rng.standard_normal((2000, 1024)).astype(dt))
    w = cp.asarray(rng.standard_normal(1024).astype(dt))
    b = cp.asarray(rng.standard_normal(1024).astype(dt))
    layer = op == "layer_norm"
    params = (w, b) if layer else (w,)
    f = getattr(cukern, op)

    def single(xs, rs):
        return f(xs, 1024, *params, residual=rs, return_stats=True)

    got = dask.compute(*getattr(cd, op)(on_gpu(x, (512, -1)), 1024, *params,
                                        residual=on_gpu(r, (512, -1)), return_stats=True))
    want = by_rows(single, [x, r], 512)
    assert len(got) == len(want) == (4 if layer else 3)
    for g, e in zip(got, want):
        same_bits(g, e)
    h, stats = want[-1], want[1:-1]
    bwd = getattr(cukern, op + "_backward")
    res = dask.compute(*getattr(cd, op + "_backward")(
        on_gpu(dy, (512, -1)), on_gpu(h, (512, -1)), *(on_gpu(s, 512) for s in stats), w))
    whole = bwd(dy, h, *stats, w)
    same_bits(res[0], by_rows(lambda d, hh, *s: bwd(d, hh, *s, w)[0], [dy, h, *stats], 512))
    ref = getattr(reference, op + "_backward")(host(dy), host(h), *(host(s) for s in stats),
                                                host(w))
    for g, e, rf in zip(res[1:], whole[1:], ref[1:]):
        assert g.dtype == dt
        close(g, rf, dtype, scale=2)  # reduced across blocks: as good as the single call
        close(e, rf, dtype, scale=2)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_bias_only_layer_norm_backward(scheduler, rng, dtype):
    """A bias alone: dbias from the blocks' float32 partial sums, tree-reduced, as the
    single-GPU call's; dweight None; dx block by block as the single call on its rows."""
    dt = np_dtype(dtype)
    x = cp.asarray((rng.standard_normal((2000, 1024)) * 2 + 1).astype(dt))
    dy = cp.asarray(rng.standard_normal((2000, 1024)).astype(dt))
    b = cp.asarray(rng.standard_normal(1024).astype(dt))
    _, mean, rstd = cukern.layer_norm(x, 1024, None, b, return_stats=True)
    dx, dw, db = cd.layer_norm_backward(on_gpu(dy, (512, -1)), on_gpu(x, (512, -1)),
                                        on_gpu(mean, 512), on_gpu(rstd, 512), None, b)
    assert dw is None
    dx, db = dask.compute(dx, db)
    whole = cukern.layer_norm_backward(dy, x, mean, rstd, None, b)
    same_bits(dx, by_rows(lambda d, t, m, r: cukern.layer_norm_backward(d, t, m, r, None, b)[0],
                          [dy, x, mean, rstd], 512))
    assert db.dtype == dt
    close(db, host(dy).astype(np.float64).sum(0), dtype, scale=2)
    close(whole[2], host(dy).astype(np.float64).sum(0), dtype, scale=2)


# ---------------------------------------------------------------------------------------------
# Batch norm: merged statistics equal the single-GPU call on the whole batch.

@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_synchronised_batch_norm(scheduler, rng, dtype):
    dt = np_dtype(dtype)
    x = cp.asarray((rng.standard_normal((64, 8, 9, 10)) * 3 + 2).astype(dt))
    z = cp.asarray(rng.standard_normal(x.shape).astype(dt))
    w = cp.asarray(rng.standard_normal(8).astype(np.float32))
    b = cp.asarray(rng.standard_normal(8).astype(np.float32))
    rm, rv = cp.zeros(8, cp.float32), cp.ones(8, cp.float32)
    rm1, rv1 = rm.copy(), rv.copy()
    chunks = (16, -1, -1, -1)  # blocks of 16 * 720 values: whole mask words
    y, mean, invstd, mask = cd.batch_norm(on_gpu(x, chunks), rm, rv, w, b, True, 0.1, 1e-5,
                                          addend=on_gpu(z, chunks), relu=True,
                                          return_stats=True)
    ys, ms, ists, masks = cukern.batch_norm(x, rm1, rv1, w, b, True, 0.1, 1e-5, addend=z,
                                            relu=True, return_stats=True)
    cp.testing.assert_allclose(rm, rm1, rtol=1e-5, atol=1e-6)
    cp.testing.assert_allclose(rv, rv1, rtol=1e-5)
    y, mean, invstd, mask = dask.compute(y, mean, invstd, mask)
    close(y, ys, dtype, scale=10)
    cp.testing.assert_allclose(mean, ms, rtol=STAT_RTOL[dtype], atol=1e-6)
    cp.testing.assert_allclose(invstd, ists, rtol=STAT_RTOL[dtype])
    agree = reference.unpack_mask(host(mask), x.size) == reference.unpack_mask(host(masks),
                                                                               x.size)
    assert agree.mean() > 0.999  # a bit may flip where y is about 0
    # uneven blocks, channels split too
    y2 = cd.batch_norm(on_gpu(x, ((20, 24, 20), (3, 5), 9, (4, 6))), None, None, w, b, True)
    close(y2.compute(), cukern.batch_norm(x, None, None, w, b, True), dtype, scale=10)


def test_batch_stats_of_offset_data(scheduler, rng):
    x = cp.asarray((rng.standard_normal((50, 6, 33)) + 1e4).astype(np.float32))
    mean, var = dask.compute(*cd.batch_stats(on_gpu(x, ((7, 13, 30), (4, 2), (16, 17)))))
    ms, vs = cukern.batch_stats(x)
    ref = reference.batch_stats(host(x))
    cp.testing.assert_allclose(mean, ms, rtol=1e-6)
    np.testing.assert_allclose(host(var), ref[1], rtol=1e-3)
    np.testing.assert_allclose(host(vs), ref[1], rtol=1e-3)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_batch_norm_backward(scheduler, rng, dtype):
    dt = np_dtype(dtype)
    x = cp.asarray((rng.standard_normal((64, 8, 9, 10)) + 0.5).astype(dt))
    dy = cp.asarray(rng.standard_normal(x.shape).astype(dt))
    w = cp.asarray(rng.standard_normal(8).astype(np.float32))
    _, mean, invstd, mask = cukern.batch_norm(x, None, None, w, None, True, relu=True,
                                              return_stats=True)
    words = 16 * 720 // 32  # the single-GPU mask split at the blocks' words
    for training in (True, False):
        got = dask.compute(*cd.batch_norm_backward(
            on_gpu(dy, (16, -1, -1, -1)), on_gpu(x, (16, -1, -1, -1)), mean, invstd, w,
            mask=on_gpu(mask, words), addend=True, training=training))
        want = cukern.batch_norm_backward(dy, x, mean, invstd, w, mask=mask, addend=True,
                                          training=training)
        assert [g.dtype for g in got] == [e.dtype for e in want]
        for g, e in zip(got, want):
            close(g, e, dtype, scale=10)


# ---------------------------------------------------------------------------------------------
# Permute: data movement, bit for bit.

def test_permute(scheduler, rng):
    x = cp.asarray(rng.standard_normal((8, 16, 12, 10)).astype(np.float16))
    xa = on_gpu(x, (3, 16, 5, 10))
    same_bits(cd.permute(xa, (0, 2, 3, 1)).compute(), cukern.permute(x, (0, 2, 3, 1)))
    same_bits(cd.to_nhwc(xa).compute(), cukern.to_nhwc(x))
    same_bits(cd.to_nchw(cd.to_nhwc(xa)).compute(), x)


# ---------------------------------------------------------------------------------------------
# The command line on Dask workers: the same files as in-process.

def cli_same_files(tmp_path, rng, *extra):
    """softmax and layer-norm --grad --param-grads in-process and with ``extra`` (worker
    options), on the same tiles: the same bytes."""
    x = save(tmp_path / "x.npy", rng.standard_normal((6000, 1000)).astype(np.float16))
    dy = save(tmp_path / "dy.npy", rng.standard_normal((6000, 1000)).astype(np.float16))
    w = save(tmp_path / "w.npy", rng.standard_normal(1000).astype(np.float16))
    for tag, opts in (("1", []), ("n", list(extra))):
        run("softmax", x, "-o", tmp_path / f"s{tag}.npy", "--chunk-rows", 1000, "-q", *opts)
        run("layer-norm", x, "-o", tmp_path / f"l{tag}.npy", "--weight", w, "--grad", dy,
            "--param-grads", tmp_path / f"g{tag}.npz", "--chunk-rows", 1000, "-q", *opts)
    for name in ("s1.npy", "l1.npy", "g1.npz"):
        other = name.replace("1", "n")
        assert (tmp_path / name).read_bytes() == (tmp_path / other).read_bytes(), name
    assert leftovers(tmp_path) == []


def test_cli_scheduler(scheduler, rng, tmp_path):
    if scheduler == "threads":
        pytest.skip("--scheduler needs the LocalCUDACluster (the next parameter)")
    cli_same_files(tmp_path, rng, "--scheduler", scheduler.scheduler.address)


# ---------------------------------------------------------------------------------------------
# Several GPUs: a LocalCUDACluster over all of them gives the single-GPU results.

@pytest.mark.skipif(gpus() < 2, reason="needs 2 or more GPUs (LocalCUDACluster over all of "
                                       "them); this machine has fewer")
class TestSeveralGPUs:
    @pytest.fixture(scope="class")
    def cluster(self):
        dask_cuda = pytest.importorskip("dask_cuda", reason="dask-cuda is not installed")
        distributed = pytest.importorskip("distributed")
        with dask_cuda.LocalCUDACluster(dashboard_address=None) as cluster, \
                distributed.Client(cluster) as client:
            client.wait_for_workers(gpus())
            yield client

    def test_rowwise_ops(self, cluster, rng):
        x = cp.asarray(rng.standard_normal((4096, 1024)).astype(np.float16))
        dy = cp.asarray(rng.standard_normal((4096, 1024)).astype(np.float16))
        w = cp.asarray(rng.standard_normal(1024).astype(np.float16))
        xa, dya = on_gpu(x, (256, -1)), on_gpu(dy, (256, -1))
        same_bits(cd.softmax(xa).compute(), by_rows(cukern.softmax, [x], 256))
        y, mean, rstd = dask.compute(*cd.layer_norm(xa, 1024, w, return_stats=True))
        want = by_rows(lambda t: cukern.layer_norm(t, 1024, w, return_stats=True), [x], 256)
        for g, e in zip((y, mean, rstd), want):
            same_bits(g, e)
        dx, dw, db = dask.compute(*cd.layer_norm_backward(dya, xa, mean, rstd, w))
        ref = cukern.layer_norm_backward(dy, x, want[1], want[2], w)
        same_bits(dx, by_rows(lambda d, t, m, r: cukern.layer_norm_backward(d, t, m, r, w)[0],
                              [dy, x, want[1], want[2]], 256))
        close(dw, ref[1], "float16", scale=2)
        close(db, ref[2], "float16", scale=2)

    def test_cli_workers(self, rng, tmp_path):
        cli_same_files(tmp_path, rng, "--workers", gpus())

    def test_batch_norm(self, cluster, rng):
        x = cp.asarray((rng.standard_normal((128, 16, 8, 8)) + 3).astype(np.float32))
        rm, rv = cp.zeros(16, cp.float32), cp.ones(16, cp.float32)
        rm1, rv1 = rm.copy(), rv.copy()
        y, mean, invstd, _ = cd.batch_norm(on_gpu(x, (16, -1, -1, -1)), rm, rv, None, None,
                                           True, return_stats=True)
        ys, ms, ists, _ = cukern.batch_norm(x, rm1, rv1, None, None, True, return_stats=True)
        close(y.compute(), ys, "float32", scale=10)
        cp.testing.assert_allclose(mean.compute(), ms, rtol=1e-5)
        cp.testing.assert_allclose(rv, rv1, rtol=1e-5)
        same_bits(cd.permute(on_gpu(x, (32, 4, 8, 8)), (0, 2, 3, 1)).compute(),
                  cukern.permute(x, (0, 2, 3, 1)))

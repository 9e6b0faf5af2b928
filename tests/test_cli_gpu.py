"""The command line on a GPU: the chunked pipeline (pinned buffers, two streams) gives the same
file, bit for bit, as a single-shot run and as calling the op directly, for every dtype and
kernel variant; plus selftest, precompile, bench, info and explain on the device."""

from __future__ import annotations

import json

import numpy as np
import pytest

import cukern
from cukern import reference

from .conftest import DTYPES, TOL
from .test_cli import bf16, bits, fails, leftovers, run, save

pytestmark = pytest.mark.gpu

HAS_NORMS = all(hasattr(cukern, n) for n in ("layer_norm", "layer_norm_backward", "rms_norm",
                                             "rms_norm_backward"))
needs_norms = pytest.mark.skipif(not HAS_NORMS, reason="cukern has no layer/RMS norm yet")


def np_dtype(name: str) -> np.dtype:
    return bf16() if name == "bfloat16" else np.dtype(name)


def load(path, dtype) -> np.ndarray:
    a = np.load(path)
    return a.view(dtype) if a.dtype != dtype else a  # bfloat16 is stored as raw V2 records


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300))


# Shapes per variant: warp, block_smem, cluster/uncached (long rows), a middle and a first axis
# (strided kernels, and tiles of columns for axis 0).
SHAPES = [((1000, 1000), -1), ((333, 33), -1), ((64, 5000), -1), ((3, 300_000), -1),
          ((40, 7, 300), 1), ((300, 40), 0)]


@pytest.mark.parametrize("shape,axis", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_chunked_equals_single_shot(tmp_path, rng, shape, axis, dtype):
    import cupy as cp

    dt = np_dtype(dtype)
    xs = (rng.standard_normal(shape) * 3).astype(dt)
    x = save(tmp_path / "x.npy", xs)
    one, many = tmp_path / "one.npy", tmp_path / "many.npy"
    run("softmax", x, "-o", one, "--axis", axis)
    run("softmax", x, "-o", many, "--axis", axis, "--chunk-rows", 7)
    direct = cp.asnumpy(cukern.softmax(cp.asarray(xs), axis=axis))
    assert bits(load(one, dt)) == bits(load(many, dt)) == bits(direct)
    assert rel_err(load(one, dt), reference.softmax(xs, axis=axis)) <= TOL[dtype]


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_softmax_backward_chunked(tmp_path, rng, log, dtype):
    import cupy as cp

    dt = np.dtype(dtype)
    fwd = reference.log_softmax if log else reference.softmax
    ys = fwd(rng.standard_normal((517, 3000))).astype(dt)
    dys = rng.standard_normal(ys.shape).astype(dt)
    y, dy = save(tmp_path / "y.npy", ys), save(tmp_path / "dy.npy", dys)
    flag = ["--log"] if log else []
    one, many = tmp_path / "one.npy", tmp_path / "many.npy"
    run("softmax", y, "--grad", dy, "-o", one, *flag)
    run("softmax", y, "--grad", dy, "-o", many, "--chunk-rows", 100, *flag)
    op = cukern.log_softmax_backward if log else cukern.softmax_backward
    direct = cp.asnumpy(op(cp.asarray(dys), cp.asarray(ys)))
    assert bits(np.load(one)) == bits(np.load(many)) == bits(direct)


def test_dtype_cast_on_the_gpu(tmp_path, rng):
    import cupy as cp

    xs = rng.standard_normal((100, 700)).astype(np.float32)
    x = save(tmp_path / "x.npy", xs)
    out = tmp_path / "y.npy"
    run("softmax", x, "-o", out, "--dtype", "bfloat16", "--chunk-rows", 33)
    direct = cp.asnumpy(cukern.softmax(cp.asarray(xs).astype(bf16())))
    assert bits(load(out, bf16())) == bits(direct)


def test_file_of_many_automatic_chunks(tmp_path, rng):
    """600 MB in float32: more than one automatic chunk (256 MiB of pinned memory a slot)."""
    import cupy as cp

    xs = rng.standard_normal((150_000, 1000), dtype=np.float32)
    x = save(tmp_path / "x.npy", xs)
    out = tmp_path / "y.npy"
    run("softmax", x, "-o", out)
    assert bits(np.load(out)) == bits(cp.asnumpy(cukern.softmax(cp.asarray(xs))))


def test_gpu_failure_leaves_nothing(tmp_path, rng, monkeypatch):
    xs = rng.standard_normal((300, 100)).astype(np.float32)
    x = save(tmp_path / "x.npy", xs)
    real = cukern.softmax
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected on the GPU")
        return real(*args, **kwargs)

    monkeypatch.setattr(cukern, "softmax", flaky)
    fails("softmax", x, "-o", tmp_path / "y.npy", "--chunk-rows", 50, code=1,
          says="injected on the GPU")
    assert not (tmp_path / "y.npy").exists() and leftovers(tmp_path) == []


def test_missing_gpu_id(tmp_path, rng):
    x = save(tmp_path / "x.npy", np.ones((2, 3), np.float32))
    fails("softmax", x, "-o", tmp_path / "y.npy", "--device", "gpu:99", code=1,
          says="GPU 99 does not exist")


@needs_norms
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_chunked(tmp_path, rng, dtype):
    dt = np_dtype(dtype)
    f = {k: save(tmp_path / f"{k}.npy", a.astype(dt)) for k, a in (
        ("x", rng.standard_normal((97, 5, 768))), ("dy", rng.standard_normal((97, 5, 768))),
        ("w", 1 + 0.1 * rng.standard_normal(768)), ("b", 0.1 * rng.standard_normal(768)))}
    common = ["--weight", f["w"], "--bias", f["b"]]
    run("layer-norm", f["x"], "-o", tmp_path / "y1.npy", "--stats", tmp_path / "s1.npz", *common)
    run("layer-norm", f["x"], "-o", tmp_path / "y2.npy", "--stats", tmp_path / "s2.npz",
        "--chunk-rows", 13, *common)
    assert bits(np.load(tmp_path / "y1.npy")) == bits(np.load(tmp_path / "y2.npy"))
    s1, s2 = np.load(tmp_path / "s1.npz"), np.load(tmp_path / "s2.npz")
    assert bits(s1["mean"]) == bits(s2["mean"]) and bits(s1["rstd"]) == bits(s2["rstd"])
    xs, w, b = (np.load(f[k]).view(dt) for k in ("x", "w", "b"))
    y = reference.layer_norm(xs, (768,), w, b, 1e-5)
    assert rel_err(load(tmp_path / "y1.npy", dt), y) <= TOL[dtype]
    back = ["--grad", f["dy"], "--weight", f["w"], "--stats", tmp_path / "s1.npz"]
    run("layer-norm", f["x"], "-o", tmp_path / "dx1.npy", "--param-grads", tmp_path / "g1.npz",
        *back)
    run("layer-norm", f["x"], "-o", tmp_path / "dx2.npy", "--param-grads", tmp_path / "g2.npz",
        "--chunk-rows", 13, *back)
    assert bits(np.load(tmp_path / "dx1.npy")) == bits(np.load(tmp_path / "dx2.npy"))
    g1, g2 = np.load(tmp_path / "g1.npz"), np.load(tmp_path / "g2.npz")
    dys = np.load(f["dy"]).view(dt)
    _, dw, db = reference.layer_norm_backward(dys, xs, s1["mean"], s1["rstd"], w)
    for k, ref in (("dweight", dw), ("dbias", db)):
        assert rel_err(g1[k].view(dt), ref) <= TOL[dtype]
        assert rel_err(g2[k].view(dt), ref) <= TOL[dtype]  # summed over chunks in float64


@needs_norms
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_rms_norm_chunked(tmp_path, rng, dtype):
    dt = np.dtype(dtype)
    f = {k: save(tmp_path / f"{k}.npy", a.astype(dt)) for k, a in (
        ("x", rng.standard_normal((211, 4096))), ("dy", rng.standard_normal((211, 4096))),
        ("w", 1 + 0.1 * rng.standard_normal(4096)))}
    for extra, tag in (([], "1"), (["--chunk-rows", 17], "2")):
        run("rms-norm", f["x"], "-o", tmp_path / f"y{tag}.npy", "--weight", f["w"],
            "--stats", tmp_path / f"s{tag}.npz", *extra)
        run("rms-norm", f["x"], "--grad", f["dy"], "--weight", f["w"], "-o",
            tmp_path / f"dx{tag}.npy", "--param-grads", tmp_path / f"g{tag}.npz", *extra)
    for name in ("y", "dx"):
        assert bits(np.load(tmp_path / f"{name}1.npy")) == bits(np.load(tmp_path / f"{name}2.npy"))
    xs, w = np.load(f["x"]), np.load(f["w"])
    y = reference.rms_norm(xs, (4096,), w, 1e-6)
    assert rel_err(np.load(tmp_path / "y1.npy"), y) <= TOL[dtype]


def test_selftest_on_the_gpu(warm_kernels):
    out = run("selftest").stdout
    assert "FAIL" not in out and out.strip().endswith("0 failed")
    for variant in ("warp", "block_smem", "block_uncached", "strided", "cli chunked"):
        assert variant in out


def test_precompile_on_the_gpu(warm_kernels):
    # Everything is in CuPy's cache already (warm_kernels): this checks the command's path.
    err = run("precompile", "--dtype", "float32", "--op", "softmax", "--jobs", "4").stderr
    assert "compiled" in err


def test_info_and_explain_on_the_gpu():
    import cupy as cp

    name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    out = run("info").stdout
    assert "GPU 0" in out and name in out and "GiB free" in out
    plan = run("explain", "softmax", "--shape", "49152x1000", "--dtype", "float16",
               "--device", "gpu:0").stdout
    assert name in plan and "(preset)" not in plan


def test_bench_on_the_gpu(tmp_path):
    out = run("bench", "softmax", "--cols", "1024", "--dtype", "float16", "--rows", "8192",
              "--vs", "none", "--json").stdout
    results = json.loads(out)
    peers = {r["peer"] for r in results}
    assert {"cukern", "copy"} <= peers
    assert all(r["gbps"] > 0 for r in results)
    table = run("bench", "softmax", "--cols", "512,2048", "--dtype", "float32", "--rows", "4096",
                "--vs", "cupyx").stdout
    assert "cukern GB/s" in table and len(table.strip().splitlines()) == 3

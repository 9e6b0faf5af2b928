"""``cukern batch-norm`` end to end: on the CPU (``--device cpu``, the float64 references) its
help, eval and --train (exact statistics over the whole file, merged over chunks with Chan's
formula) against the references, every channel axis, relu and addend, the statistics file,
atomic outputs and every error with its exit status and one-line message; the GPU pipeline's
bookkeeping on the NumPy stand-in for CuPy; and, on a GPU, the real thing against the
references."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cukern
from cukern import reference
from cukern.cli import common as cli

from .conftest import DTYPES, TOL
from .test_cli import _fake_gpu, bf16, bits, digest, fail_on_call, fails, leftovers, run, save

HAS_BN_REF = all(hasattr(reference, n) for n in ("batch_norm", "batch_stats"))
HAS_BN = all(hasattr(cukern, n) for n in ("batch_norm", "batch_stats"))
needs_gpu_bn = pytest.mark.skipif(not HAS_BN, reason="cukern has no batch_norm yet")


def np_dtype(name: str) -> np.dtype:
    return bf16() if name == "bfloat16" else np.dtype(name)


def load(path, dtype=None) -> np.ndarray:
    a = np.load(path)
    if dtype is not None and a.dtype != dtype:
        a = a.view(dtype)  # bfloat16 is stored as raw V2 records
    return a


def channel_data(shape, axis, rng, spread=1.0):
    """Random data with its own mean and spread per channel."""
    c = shape[axis]
    bs = [1] * len(shape)
    bs[axis] = c
    mu = rng.standard_normal(c).reshape(bs) * 0.5
    sig = rng.uniform(0.5, 1.5, c).reshape(bs) * spread
    return rng.standard_normal(shape) * sig + mu


def params(rng, c, dtype=np.float32, keys=("running_mean", "running_var", "weight", "bias")):
    values = {"running_mean": rng.standard_normal(c) * 0.3,
              "running_var": rng.uniform(0.5, 1.5, c),
              "weight": rng.standard_normal(c) * 0.3 + 1,
              "bias": rng.standard_normal(c) * 0.3}
    return {k: values[k].astype(dtype) for k in keys}


@pytest.fixture
def bn(tmp_path, rng):
    """x (6, 4, 5, 7) float32, an addend, and P.npz with all four per-channel arrays."""
    f = {"x_arr": channel_data((6, 4, 5, 7), 1, rng).astype(np.float32),
         "a_arr": rng.standard_normal((6, 4, 5, 7)).astype(np.float32),
         "p_arr": params(rng, 4)}
    f["x"] = save(tmp_path / "x.npy", f["x_arr"])
    f["a"] = save(tmp_path / "a.npy", f["a_arr"])
    np.savez(tmp_path / "p.npz", **f["p_arr"])
    f["p"] = str(tmp_path / "p.npz")
    return f


def ref_eval(x, p, work, axis=1, eps=1e-5, addend=None, relu=False) -> np.ndarray:
    """What the CPU path writes in eval: the reference on x cast to the working dtype."""
    y = reference.batch_norm(np.asarray(x).astype(work), p["running_mean"], p["running_var"],
                             p.get("weight"), p.get("bias"), False, eps=eps, axis=axis,
                             addend=None if addend is None else addend.astype(work), relu=relu)
    return y.astype(work)


def running_after(p, x, axis, momentum=0.1):
    """The running statistics after one training step on the whole of x (unbiased variance)."""
    rows = np.moveaxis(np.asarray(x, np.float64), axis, 0).reshape(x.shape[axis], -1)
    m = (1 - momentum) * p["running_mean"].astype(np.float64) + momentum * rows.mean(1)
    v = (1 - momentum) * p["running_var"].astype(np.float64) + momentum * rows.var(1, ddof=1)
    return m, v


# ------------------------------------------------------------------------------------------
# help


def test_help_names_every_option():
    assert "  batch-norm " in run("--help").stdout
    out = run("batch-norm", "--help").stdout
    assert out.startswith("Usage: cukern batch-norm ")
    for opt in ("--params", "--train", "--relu", "--addend", "--axis", "--eps", "--momentum",
                "--stats", "--chunk-rows", "--device", "--dtype", "--overwrite", "--debug"):
        assert opt in out, opt
    for words in ("running_mean", "running_var", "Chan's", "OUT.stats.npz", "n / (n - 1)",
                  "--axis -1 for a channels-last file"):
        assert words in out, words


# ------------------------------------------------------------------------------------------
# eval


@pytest.mark.parametrize("rows", [None, "1", "5", "1000"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_eval_matches_reference(tmp_path, rng, dtype, rows):
    dt = np_dtype(dtype)
    xs = channel_data((5, 3, 4, 6), 1, rng).astype(dt)
    x = save(tmp_path / "x.npy", xs)
    p = params(rng, 3)
    np.savez(tmp_path / "p.npz", **p)
    out = tmp_path / "y.npy"
    extra = [] if rows is None else ["--chunk-rows", rows]
    run("batch-norm", x, "-o", out, "--params", tmp_path / "p.npz", "--device", "cpu", *extra)
    got = load(out, dt)
    assert got.dtype == dt and got.shape == xs.shape
    assert bits(got) == bits(ref_eval(xs, p, dt))
    assert not (tmp_path / "y.stats.npz").exists()  # eval writes no statistics


def test_eval_relu_addend_eps_and_dtype(tmp_path, bn):
    out = tmp_path / "y.npy"
    run("batch-norm", bn["x"], "-o", out, "--params", bn["p"], "--addend", bn["a"], "--relu",
        "--eps", "0.01", "--device", "cpu", "--chunk-rows", "9")
    want = ref_eval(bn["x_arr"], bn["p_arr"], np.float32, eps=0.01, addend=bn["a_arr"],
                    relu=True)
    got = np.load(out)
    assert bits(got) == bits(want) and (got == 0).any() and (got > 0).any()
    out16 = tmp_path / "y16.npy"
    run("batch-norm", bn["x"], "-o", out16, "--params", bn["p"], "--dtype", "float16",
        "--device", "cpu")
    assert np.load(out16).dtype == np.float16
    assert bits(np.load(out16)) == bits(ref_eval(bn["x_arr"], bn["p_arr"], np.float16))


def test_eval_without_weight_and_bias(tmp_path, rng, bn):
    p = params(rng, 4, keys=("running_mean", "running_var"))
    np.savez(tmp_path / "rs.npz", **p)
    out = tmp_path / "y.npy"
    run("batch-norm", bn["x"], "-o", out, "--params", tmp_path / "rs.npz", "--device", "cpu")
    assert bits(np.load(out)) == bits(ref_eval(bn["x_arr"], p, np.float32))


@pytest.mark.parametrize("shape,axis", [((6, 5, 4, 3), -1), ((5, 6, 7), 0), ((3, 4, 6, 5), 2),
                                        ((40, 3), 1), ((4, 3, 2, 5, 6), 1)])
def test_eval_any_channel_axis(tmp_path, rng, shape, axis):
    xs = channel_data(shape, axis, rng).astype(np.float32)
    x = save(tmp_path / "x.npy", xs)
    p = params(rng, shape[axis])
    np.savez(tmp_path / "p.npz", **p)
    for rows in ("1", "7", "100000"):
        out = tmp_path / f"y{rows}.npy"
        run("batch-norm", x, "-o", out, "--params", tmp_path / "p.npz", "--axis", axis,
            "--device", "cpu", "--chunk-rows", rows)
        assert bits(np.load(out)) == bits(ref_eval(xs, p, np.float32, axis=axis)), rows


def test_fortran_order_input(tmp_path, rng):
    xs = channel_data((7, 3, 5, 4), 1, rng)
    x = save(tmp_path / "f.npy", np.asfortranarray(xs))
    p = params(rng, 3, np.float64)
    np.savez(tmp_path / "p.npz", **p)
    out = tmp_path / "y.npy"
    run("batch-norm", x, "-o", out, "--params", tmp_path / "p.npz", "--device", "cpu",
        "--chunk-rows", "6")
    assert bits(np.load(out)) == bits(ref_eval(xs, p, np.float64))


def test_empty_input_in_eval(tmp_path, rng):
    x = save(tmp_path / "x.npy", np.zeros((0, 3, 4), np.float32))
    np.savez(tmp_path / "p.npz", **params(rng, 3))
    out = tmp_path / "y.npy"
    run("batch-norm", x, "-o", out, "--params", tmp_path / "p.npz", "--device", "cpu")
    assert np.load(out).shape == (0, 3, 4)


# ------------------------------------------------------------------------------------------
# --train


def check_train(tmp_path, xs, axis, p, *, rows=None, momentum=None, addend=None, relu=False,
                dtype=None, stats=None, rtol=1e-12):
    """Run --train on the CPU and check y, the statistics and the running statistics against
    the references on the whole array."""
    x = save(tmp_path / "x.npy", xs)
    out = tmp_path / "y.npy"
    args = ["batch-norm", x, "-o", out, "--train", "--axis", axis, "--device", "cpu",
            "--overwrite"]
    if p is not None:
        np.savez(tmp_path / "p.npz", **p)
        args += ["--params", tmp_path / "p.npz"]
    if rows is not None:
        args += ["--chunk-rows", rows]
    if momentum is not None:
        args += ["--momentum", momentum]
    if addend is not None:
        args += ["--addend", save(tmp_path / "a.npy", addend)]
    if relu:
        args.append("--relu")
    if dtype is not None:
        args += ["--dtype", dtype]
    if stats is not None:
        args += ["--stats", stats]
    run(*args)
    work = np_dtype(dtype) if dtype else xs.dtype
    p = p or {}
    y, mean, invstd, _ = reference.batch_norm(xs.astype(work), None, None, p.get("weight"),
                                              p.get("bias"), True, axis=axis,
                                              addend=None if addend is None else
                                              addend.astype(work), relu=relu, return_stats=True)
    got = load(out, work)
    assert got.dtype == work and got.shape == xs.shape
    if work == np.float64:
        np.testing.assert_allclose(got, y, rtol=rtol, atol=rtol)
    else:  # within one rounding to the file's dtype: a relative ulp, the subnormal step below
        fi = ml_dtypes.finfo(work)
        spacing = np.maximum(np.abs(y) * float(fi.eps), float(fi.smallest_subnormal))
        assert np.all(np.abs(got.astype(np.float64) - y) <= spacing + rtol)
    s = np.load(stats if stats is not None else tmp_path / "y.stats.npz")
    _, var = reference.batch_stats(xs.astype(work), axis=axis)
    sdt = np.float64 if work == np.float64 else np.float32
    want = {"mean": mean, "var": var, "invstd": invstd}
    running = "running_mean" in p
    assert sorted(s) == sorted(list(want) + (["running_mean", "running_var"] if running else []))
    for k, v in want.items():
        assert s[k].dtype == sdt and s[k].shape == (xs.shape[axis],)
        np.testing.assert_allclose(s[k], v, rtol=1e-12 if sdt == np.float64 else 1e-6,
                                   atol=1e-12 if sdt == np.float64 else 1e-7, err_msg=k)
    if running:
        m, v = running_after(p, xs.astype(work), axis, 0.1 if momentum is None else momentum)
        for k, ref in (("running_mean", m), ("running_var", v)):
            assert s[k].dtype == p[k].dtype
            np.testing.assert_allclose(s[k].astype(np.float64), ref,
                                       rtol=float(np.finfo(p[k].dtype).eps) * 2, atol=1e-12,
                                       err_msg=k)
    return got, s


@pytest.mark.parametrize("rows", [None, "1", "3", "7", "1000"])
def test_train_matches_reference(tmp_path, rng, rows):
    """Any chunking gives the exact statistics of the whole file (Chan's merge)."""
    xs = channel_data((6, 4, 5, 7), 1, rng, spread=3.0) + 20.0
    check_train(tmp_path, xs, 1, params(rng, 4, np.float64), rows=rows)


@pytest.mark.parametrize("shape,axis,rows", [
    ((2, 3, 50), 1, "7"),            # tiles of columns within one sample
    ((6, 5, 4, 3), -1, "5"),         # a channels-last file
    ((5, 6, 7), 0, "4"),             # the channel axis first: column tiles of one slice
    ((3, 4, 6, 5), 2, "11"),
    ((40, 3), 1, "6"),
    ((4, 3, 2, 5, 6), 1, "13")])
def test_train_any_channel_axis(tmp_path, rng, shape, axis, rows):
    xs = channel_data(shape, axis, rng)
    check_train(tmp_path, xs, axis % len(shape), params(rng, shape[axis], np.float64),
                rows=rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_train_dtypes_relu_addend(tmp_path, rng, dtype):
    dt = np_dtype(dtype)
    xs = channel_data((6, 3, 4, 5), 1, rng).astype(dt)
    a = rng.standard_normal(xs.shape).astype(dt)
    got, _ = check_train(tmp_path, xs, 1, params(rng, 3), rows="4", addend=a, relu=True,
                         rtol=0 if dtype != "float64" else 1e-12)
    assert (got.astype(np.float64) == 0).any()


@pytest.mark.parametrize("momentum", ["0", "1", "0.25"])
def test_train_momentum_and_running_dtype(tmp_path, rng, momentum):
    """Running statistics keep their dtype (float16 here); momentum 0 leaves them alone, 1
    replaces them with the batch's (the variance unbiased)."""
    xs = channel_data((8, 3, 5), 1, rng)
    p = params(rng, 3, np.float16)
    _, s = check_train(tmp_path, xs, 1, p, rows="3", momentum=float(momentum))
    if momentum == "0":
        assert bits(s["running_mean"]) == bits(p["running_mean"])
        assert bits(s["running_var"]) == bits(p["running_var"])
    if momentum == "1":
        rows = xs.transpose(1, 0, 2).reshape(3, -1)
        np.testing.assert_allclose(s["running_var"], rows.var(1, ddof=1), rtol=1e-3)


def test_train_without_params_and_stats_path(tmp_path, rng):
    xs = channel_data((5, 4, 6), 1, rng)
    _, s = check_train(tmp_path, xs, 1, None, rows="2", stats=tmp_path / "bn_stats.npz")
    assert sorted(s) == ["invstd", "mean", "var"]
    assert not (tmp_path / "y.stats.npz").exists()
    # weight and bias alone: no running statistics to update
    xs2 = channel_data((5, 4, 6), 1, rng)
    _, s2 = check_train(tmp_path, xs2, 1, params(rng, 4, np.float64, keys=("weight", "bias")))
    assert sorted(s2) == ["invstd", "mean", "var"]


def test_train_large_offset_is_exact(tmp_path, rng):
    """x = 1e4 + noise: the float64 per-chunk statistics merged in float64 lose nothing."""
    xs = 1e4 + channel_data((9, 3, 8), 1, rng)
    got, s = check_train(tmp_path, xs, 1, params(rng, 3, np.float64), rows="5", rtol=1e-9)
    rows = xs.transpose(1, 0, 2).reshape(3, -1)
    np.testing.assert_allclose(s["var"], rows.var(1), rtol=1e-9)


def test_chan_merge_is_exact():
    from cukern.cli.batch_norm import _chan_merge

    rng = np.random.default_rng(0)
    data = rng.standard_normal((3, 101)) * 2 + 5
    parts = []
    for lo, hi in ((0, 1), (1, 8), (8, 50), (50, 101)):
        chunk = data[:, lo:hi]
        parts.append((hi - lo, chunk.mean(1), chunk.var(1)))
    mean, var, count = _chan_merge(parts)
    assert count == 101
    np.testing.assert_allclose(mean, data.mean(1), rtol=1e-14)
    np.testing.assert_allclose(var, data.var(1), rtol=1e-13)


# ------------------------------------------------------------------------------------------
# Atomic outputs, refusals, errors


@pytest.mark.parametrize("where", ["batch_stats", "batch_norm"])
def test_failure_mid_run_leaves_nothing(tmp_path, bn, monkeypatch, where):
    before = [digest(bn[k]) for k in ("x", "p")]
    calls = fail_on_call(monkeypatch, 2, RuntimeError(f"injected in {where}"), reference,
                         where)
    out = tmp_path / "y.npy"
    fails("batch-norm", bn["x"], "-o", out, "--params", bn["p"], "--train", "--device", "cpu",
          "--chunk-rows", "5", code=1, says=f"injected in {where}")
    assert len(calls) == 2
    assert not out.exists() and not (tmp_path / "y.stats.npz").exists()
    assert leftovers(tmp_path) == []
    assert [digest(bn[k]) for k in ("x", "p")] == before


def test_existing_outputs_and_inputs_are_refused(tmp_path, bn):
    out = tmp_path / "y.npy"
    common = ["--params", bn["p"], "--device", "cpu"]
    run("batch-norm", bn["x"], "-o", out, "--train", *common)
    old = digest(tmp_path / "y.stats.npz")
    (tmp_path / "y.npy").unlink()
    fails("batch-norm", bn["x"], "-o", out, "--train", *common, code=2,
          says=f"--stats {tmp_path / 'y.stats.npz'} exists; pass --overwrite")
    assert not out.exists() and digest(tmp_path / "y.stats.npz") == old
    run("batch-norm", bn["x"], "-o", out, "--train", "--overwrite", *common)
    before = digest(bn["p"])
    fails("batch-norm", bn["x"], "-o", tmp_path / "z.npy", "--train", "--stats", bn["p"],
          "--overwrite", *common, code=2, says="is an input file")
    fails("batch-norm", bn["x"], "-o", bn["a"], "--addend", bn["a"], "--overwrite", *common,
          code=2, says="is an input file")
    assert digest(bn["p"]) == before and leftovers(tmp_path) == []


def test_argument_errors(tmp_path, rng, bn):
    d = tmp_path
    o = ["-o", d / "out.npy", "--device", "cpu"]
    x, p = bn["x"], bn["p"]
    np.savez(d / "weights.npz", **params(rng, 4, keys=("weight", "bias")))
    np.savez(d / "mean_only.npz", **params(rng, 4, keys=("running_mean",)))
    np.savez(d / "short.npz", **params(rng, 3))
    np.savez(d / "typo.npz", runing_mean=np.zeros(4), **params(rng, 4, keys=("running_var",)))
    np.savez(d / "ints.npz", running_mean=np.zeros(4, np.int64), running_var=np.ones(4))
    np.savez(d / "matrix.npz", running_mean=np.zeros((4, 1)), running_var=np.ones(4))
    np.save(d / "p.npy", np.zeros(4))
    (d / "notes.txt").write_text("hello\n")
    save(d / "one.npy", np.ones((1, 4, 1, 1), np.float32))
    save(d / "vec.npy", np.ones(8, np.float32))
    save(d / "a_bad.npy", np.ones((6, 4, 5, 6), np.float32))
    cases = [
        ([x], "batch-norm needs --params P.npz with running_mean and running_var, or --train"),
        ([x, "--params", d / "weights.npz"],
         f"--params {d / 'weights.npz'} has no running_mean and running_var (it holds: "
         f"weight, bias)"),
        ([x, "--params", d / "mean_only.npz"], "has no running_var"),
        ([x, "--params", d / "mean_only.npz", "--train"],
         "has running_mean but not running_var; --train updates both or neither"),
        ([x, "--params", d / "short.npz"],
         f"--params {d / 'short.npz'}:running_mean has shape 3, expected 4 (one value per "
         f"channel: axis 1 of {x})"),
        ([x, "--params", d / "short.npz", "--axis", "2"], "has shape 3, expected 5"),
        ([x, "--params", d / "matrix.npz"], "running_mean has shape 4x1, expected 4"),
        ([x, "--params", d / "typo.npz"], "unknown array 'runing_mean' (expected running_mean"),
        ([x, "--params", d / "ints.npz"], "has dtype int64; expected float16"),
        ([x, "--params", d / "p.npy"], "expected an .npz file"),
        ([x, "--params", d / "notes.txt"], "expected an .npz file"),
        ([x, "--params", d / "missing.npz"], "missing.npz: no such file"),
        ([x, "--params", p, "--addend", d / "a_bad.npy"],
         f"--addend {d / 'a_bad.npy'} has shape 6x4x5x6, expected 6x4x5x7 (the shape of IN)"),
        ([x, "--params", p, "--addend", d / "missing.npy"], "missing.npy: no such file"),
        ([x, "--params", p, "--axis", "4"], f"--axis 4 is out of range for {x}"),
        ([x, "--params", p, "--axis", "-5"], "--axis -5 is out of range"),
        ([d / "vec.npy", "--train"], "has 1 dimension; batch-norm needs at least 2"),
        ([d / "one.npy", "--train"],
         f"--train needs more than one value per channel; {d / 'one.npy'} has shape 1x4x1x1: "
         f"1 per channel"),
        ([x, "--params", p, "--eps", "0"], "batch_norm: eps must be finite and > 0, got 0.0"),
        ([x, "--params", p, "--eps", "-1e-5"], "batch_norm: eps must be finite and > 0"),
        ([x, "--params", p, "--eps", "nan"], "batch_norm: eps must be finite and > 0"),
        ([x, "--params", p, "--eps", "inf"], "batch_norm: eps must be finite and > 0"),
        ([x, "--params", p, "--eps", "1e-50"], "batch_norm: eps=1e-50 underflows float32"),
        ([x, "--train", "--momentum", "1.5"], "--momentum 1.5: expected a number in [0, 1]"),
        ([x, "--train", "--momentum", "-0.1"], "--momentum"),
        ([x, "--train", "--momentum", "nan"], "--momentum"),
        ([x, "--params", p, "--momentum", "0.2"], "--momentum updates running statistics"),
        ([x, "--params", p, "--stats", d / "s.npz"], "--stats is where --train writes"),
        ([x, "--train", "--stats", d / "s.npy"], "must be a .npz file"),
    ]
    for args, says in cases:
        fails("batch-norm", *args, *o, code=2, says=says)
    # the one-value case is fine in eval
    np.savez(d / "p4.npz", **params(rng, 4))
    run("batch-norm", d / "one.npy", "-o", d / "one_y.npy", "--params", d / "p4.npz",
        "--device", "cpu")
    assert leftovers(d) == [] and not (d / "out.npy").exists()


def test_no_gpu(tmp_path, bn, monkeypatch):
    monkeypatch.setattr(cli, "_gpu_problem", lambda dev=0: "no CUDA GPU visible (test)")
    fails("batch-norm", bn["x"], "-o", tmp_path / "y.npy", "--params", bn["p"], code=1,
          says="no CUDA GPU visible (test); --device cpu runs the NumPy reference instead")
    assert not (tmp_path / "y.npy").exists()


def test_says_when_the_op_is_missing(tmp_path, bn, monkeypatch):
    monkeypatch.delattr(reference, "batch_stats", raising=False)
    fails("batch-norm", bn["x"], "-o", tmp_path / "y.npy", "--train", "--device", "cpu",
          code=1, says="batch-norm --train is not available: this cukern has no "
                       "cukern.reference.batch_stats")
    monkeypatch.delattr(reference, "batch_norm", raising=False)
    fails("batch-norm", bn["x"], "-o", tmp_path / "y.npy", "--params", bn["p"], "--device",
          "cpu", code=1, says="batch-norm is not available")
    assert leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------------
# The GPU code path on the NumPy stand-in for CuPy (test_cli's): pinned buffers, slots, the
# statistics kept per tile and merged after the pass


@pytest.mark.parametrize("rows", [None, "1", "4", "7"])
def test_gpu_pipeline_bookkeeping(tmp_path, rng, monkeypatch, rows):
    xs = channel_data((6, 3, 4, 5), 1, rng).astype(np.float32)
    a = rng.standard_normal(xs.shape).astype(np.float32)
    x, af = save(tmp_path / "x.npy", xs), save(tmp_path / "a.npy", a)
    p = params(rng, 3)
    np.savez(tmp_path / "p.npz", **p)
    extra = [] if rows is None else ["--chunk-rows", rows]
    common = ["--params", tmp_path / "p.npz", "--addend", af, "--relu", *extra]
    run("batch-norm", x, "-o", tmp_path / "cpu.npy", "--device", "cpu", *common)
    run("batch-norm", x, "-o", tmp_path / "cpu_t.npy", "--device", "cpu", "--train", *common)
    _fake_gpu(monkeypatch)
    run("batch-norm", x, "-o", tmp_path / "gpu.npy", *common)
    run("batch-norm", x, "-o", tmp_path / "gpu_t.npy", "--train", *common)
    # eval: float32 parameters either way, the same bits; train: the merged statistics go to
    # the op in float32 on the GPU path, in float64 on the CPU
    assert bits(np.load(tmp_path / "gpu.npy")) == bits(np.load(tmp_path / "cpu.npy"))
    np.testing.assert_allclose(np.load(tmp_path / "gpu_t.npy"), np.load(tmp_path / "cpu_t.npy"),
                               rtol=1e-5, atol=1e-5)
    s_gpu, s_cpu = np.load(tmp_path / "gpu_t.stats.npz"), np.load(tmp_path / "cpu_t.stats.npz")
    for k in ("mean", "var", "invstd", "running_mean", "running_var"):
        np.testing.assert_array_equal(s_gpu[k], s_cpu[k], err_msg=k)


# ------------------------------------------------------------------------------------------
# On a GPU


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300))


@pytest.mark.gpu
@needs_gpu_bn
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,axis", [((16, 8, 14, 14), 1), ((16, 14, 14, 8), -1),
                                        ((3, 5, 40000), 1), ((2000, 24), 1),
                                        ((4, 3, 6, 10, 12), 1)])
def test_gpu_eval_and_train(tmp_path, rng, dtype, shape, axis):
    """Eval: chunked equals single-shot bit for bit, both within TOL of the reference. Train:
    chunked (tiles of samples, or of columns for long samples) and single-shot within TOL of
    the reference training forward; statistics and running statistics to float32 precision."""
    import cupy as cp

    dt = np_dtype(dtype)
    ax = axis % len(shape)
    c = shape[ax]
    xs = channel_data(shape, ax, rng).astype(dt)
    a = rng.standard_normal(shape).astype(dt)
    x, af = save(tmp_path / "x.npy", xs), save(tmp_path / "a.npy", a)
    p = params(rng, c)
    np.savez(tmp_path / "p.npz", **p)
    rows = str(max(1, xs.size // c // 7))  # about seven chunks
    common = ["--params", tmp_path / "p.npz", "--addend", af, "--relu", "--axis", axis]
    run("batch-norm", x, "-o", tmp_path / "one.npy", *common)
    run("batch-norm", x, "-o", tmp_path / "many.npy", "--chunk-rows", rows, *common)
    one, many = load(tmp_path / "one.npy", dt), load(tmp_path / "many.npy", dt)
    assert bits(one) == bits(many)
    want = reference.batch_norm(xs, p["running_mean"], p["running_var"], p["weight"], p["bias"],
                                False, axis=ax, addend=a, relu=True)
    assert rel_err(one, want) <= TOL[dtype]
    pdt = np.float64 if dtype == "float64" else np.float32
    rm, rv, w, b = (cp.asarray(p[k].astype(pdt))
                    for k in ("running_mean", "running_var", "weight", "bias"))
    direct = cp.asnumpy(cukern.batch_norm(cp.asarray(xs), rm, rv, w, b, False, axis=ax,
                                          addend=cp.asarray(a), relu=True))
    assert rel_err(direct, want) <= TOL[dtype]
    # --train
    y, mean, invstd, _ = reference.batch_norm(xs, None, None, p["weight"], p["bias"], True,
                                              axis=ax, addend=a, relu=True, return_stats=True)
    m_run, v_run = running_after(p, xs, ax)
    for tag, extra in (("t1", []), ("t2", ["--chunk-rows", rows])):
        out = tmp_path / f"{tag}.npy"
        run("batch-norm", x, "-o", out, "--train", *extra, *common)
        assert rel_err(load(out, dt), y) <= TOL[dtype], tag
        s = np.load(tmp_path / f"{tag}.stats.npz")
        tol = 1e-12 if dtype == "float64" else 1e-5
        assert np.all(np.abs(s["mean"] - mean) <= tol * (np.abs(mean) + 1 / invstd)), tag
        assert rel_err(s["invstd"], invstd) <= tol, tag
        assert rel_err(s["running_mean"], m_run) <= 1e-5, tag
        assert rel_err(s["running_var"], v_run) <= 1e-5, tag



def test_explain_batch_norm_options():
    # the channel axis defaults to 1 for batch norm; --layout, --eval, --relu reach the planner
    out = _run_explain("explain", "batch-norm", "--shape", "64x256x56x56", "--dtype", "float16",
                       "--device", "h100", "--layout", "NHWC", "--relu").stdout
    assert "C=256 B=1" in out and "columns" in out and "(training)" in out
    nchw = _run_explain("explain", "batch-norm", "--shape", "64x256x56x56", "--device", "h100",
                        "--eval").stdout
    assert "C=256 B=3136" in nchw and "(eval)" in nchw
    bad = _run_explain("explain", "softmax", "--shape", "10x10", "--device", "h100", "--relu",
                       code=2)
    assert "batch norm's" in bad.stderr


def _run_explain(*args, code=0):
    from click.testing import CliRunner

    from cukern.cli import app

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == code, (result.exit_code, result.output)
    return result

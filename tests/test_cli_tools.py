"""The tool commands and the environment on the CPU: explain's devices and --json, info/doctor,
selftest --json, the kernel-cache fallback when $HOME cannot be written, the no-GPU messages,
NaN input on the --device cpu path printing no NumPy warnings, and bench's planning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import cukern
from cukern import _device, _env, reference
from cukern.cli import app

ROOT = Path(__file__).resolve().parents[1]


def run(*args, code: int = 0):
    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        runner = CliRunner()
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr,
                                      result.exception)
    return result


def cukern_proc(*args, env: dict, **kw) -> subprocess.CompletedProcess:
    """``python -m cukern ARGS`` in a fresh process with ``env`` over this one's (None
    values removed from it)."""
    full = dict(os.environ, PYTHONPATH=str(ROOT))
    full.update(env)
    full = {k: v for k, v in full.items() if v is not None}
    return subprocess.run([sys.executable, "-W", "default", "-m", "cukern", *map(str, args)],
                          env=full, capture_output=True, text=True, timeout=120, **kw)


# ------------------------------------------------------------------------------------------
# explain: devices from one table, --json


def test_explain_device_presets():
    for name in _device.PRESETS:
        out = run("explain", "softmax", "--shape", "8x1000", "--device", name.upper()).stdout
        assert f"on {_device.PRESETS[name]().name}" in out.splitlines()[0]
    assert "H200" in run("explain", "softmax", "--shape", "8x1000", "--device", "h200").stdout
    for bad in ("h300", "cpu", "gpu:x"):
        err = run("explain", "softmax", "--shape", "8x1000", "--device", bad, code=2).stderr
        assert f"--device {bad}: expected auto, {', '.join(_device.PRESETS)}, gpu or gpu:N" \
            in err
    # the Python API takes the same names
    assert cukern.explain("softmax", (8, 1000), "float16", device="h200").device == \
        _device.DeviceSpec.h200().name
    with pytest.raises(ValueError, match="unknown device preset 'p100'; expected one of "
                                         "h100, h200, a100, t4, v100"):
        cukern.explain("softmax", (8, 1000), "float16", device="p100")


@pytest.mark.parametrize("args, kernel", [
    (("softmax", "--shape", "4096x1000", "--dtype", "float16"), "softmax_warp"),
    (("layer-norm-backward", "--shape", "64x8192", "--weight"), "layer_norm_grad"),
    (("batch-norm", "--shape", "8x16x4x4", "--relu"), "batch_norm_train_planes"),
    (("permute", "--shape", "8x16x4x4", "--axes", "0,2,3,1"), "permute_"),
])
def test_explain_json(args, kernel):
    text = run("explain", *args, "--device", "h100").stdout
    d = json.loads(run("explain", *args, "--device", "h100", "--json").stdout)
    assert set(d) == {"op", "shape", "dtype", "device", "kernels", "plan", "text"}
    assert d["op"] == args[0].replace("-", "_") and d["text"].strip() == text.strip()
    assert d["shape"] == [int(n) for n in args[2].split("x")]
    assert d["device"].startswith("NVIDIA H100") and any(kernel in k for k in d["kernels"])
    assert all(k in d["text"] for k in d["kernels"])
    assert isinstance(d["plan"], dict) and "policy" not in d["plan"]


# ------------------------------------------------------------------------------------------
# info / doctor, selftest --json


INFO_KEYS = {"cukern", "numpy", "cupy", "nvidia_driver", "cuda_runtime", "cuda_driver", "nvrtc",
             "nvrtc_error", "gpus", "gpu_problem", "cache", "compile"}


def test_info_json_and_doctor():
    d = json.loads(run("info", "--json").stdout)
    assert set(d) == INFO_KEYS and d["cukern"] == cukern.__version__
    assert set(d["cache"]) == {"dir", "files", "bytes", "fallback_from"}
    assert (d["gpu_problem"] is None) == bool(d["gpus"])
    for g in d["gpus"]:
        assert set(g) >= {"id", "name", "compute_capability", "arch", "sms", "memory_bytes"}
    # one compile check per kernel family, for each GPU's architecture (sm_90 without one)
    families = {op.source for op in cukern.registry.OPS.values()}
    archs = {g["arch"] for g in d["gpus"]} or {"sm_90"}
    assert {(c["family"], c["arch"]) for c in d["compile"]} == \
        {(f, a) for f in families for a in archs}
    for c in d["compile"]:
        assert set(c) == {"family", "arch", "ops", "ok", "kernel", "seconds", "error"}
        assert c["ok"] and c["error"] is None and c["kernel"].startswith("cukern::"), c
    text = run("doctor", "--no-compile").stdout
    assert "CUDA driver" in text and "NVRTC" in text and "compiles" not in text
    assert json.loads(run("doctor", "--json", "--no-compile").stdout)["compile"] == []


def test_info_reports_a_family_that_does_not_compile(monkeypatch):
    from cukern import _compile

    def broken(family, names, arch):
        if family == "permute":
            raise RuntimeError("NVRTC failed for permute on sm_90: test")
        return {}

    monkeypatch.setattr(_compile, "compile_check", broken)
    result = run("info", code=1)
    assert "permute          FAILED: NVRTC failed" in result.stdout
    assert "1 kernel family failed to compile: permute" in result.stderr


def test_selftest_json():
    d = json.loads(run("selftest", "--device", "cpu", "--dtype", "float32", "--json").stdout)
    assert set(d) == {"device", "dtypes", "seed", "passed", "failed", "checks"}
    assert d["device"] == "cpu" and d["dtypes"] == ["float32"] and d["failed"] == 0
    assert d["passed"] == len(d["checks"]) > 10
    for c in d["checks"]:
        assert set(c) == {"op", "variant", "dtype", "shape", "error", "tol", "ok", "note"}
        assert c["ok"] is True


# ------------------------------------------------------------------------------------------
# The environment: a HOME that cannot be written, no driver


def _home_under_a_file(tmp_path: Path) -> Path:
    """A HOME no one can create, root included: its parent is a regular file."""
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "home"


def test_version_with_an_unusable_home(tmp_path):
    env = {"HOME": str(_home_under_a_file(tmp_path)), "CUPY_CACHE_DIR": None,
           "XDG_CACHE_HOME": None, "TMPDIR": str(tmp_path)}
    p = cukern_proc("--version", env=env)
    assert p.returncode == 0 and p.stdout.strip() == f"cukern {cukern.__version__}", p.stderr
    fallback = tmp_path / f"cupy-kernel-cache-{os.getuid()}"
    assert p.stderr.strip().splitlines() == [
        f"cukern: the kernel cache {env['HOME']}/.cupy/kernel_cache cannot be used (Not a "
        f"directory); using {fallback} (set CUPY_CACHE_DIR to choose)"]
    assert fallback.is_dir() and (fallback.stat().st_mode & 0o777) == 0o700
    # $XDG_CACHE_HOME first; info shows the folder in use
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    p = cukern_proc("info", "--json", "--no-compile", env=env)
    assert p.returncode == 0, p.stderr
    cache = json.loads(p.stdout)["cache"]
    assert cache["dir"] == str(tmp_path / "xdg" / "cupy" / "kernel_cache")
    assert cache["fallback_from"] == f"{env['HOME']}/.cupy/kernel_cache"
    assert p.stderr.count("cukern: the kernel cache") == 1
    # an unusable CUPY_CACHE_DIR falls back too
    p = cukern_proc("--version", env=dict(env, CUPY_CACHE_DIR=str(tmp_path / "file" / "c")))
    assert p.returncode == 0 and f"using {tmp_path / 'xdg'}" in p.stderr


def test_a_usable_home_says_nothing(tmp_path):
    p = cukern_proc("--version", env={"HOME": str(tmp_path), "CUPY_CACHE_DIR": None})
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert (tmp_path / ".cupy" / "kernel_cache").is_dir()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="root writes through chmod 500 (the test above covers root)")
def test_version_with_a_read_only_home(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o500)
    try:
        p = cukern_proc("--version", env={"HOME": str(home), "CUPY_CACHE_DIR": None,
                                          "XDG_CACHE_HOME": None, "TMPDIR": str(tmp_path)})
    finally:
        home.chmod(0o700)
    assert p.returncode == 0 and "cannot be used (Permission denied)" in p.stderr


def test_no_gpu_messages():
    none = _env.no_gpu_reason(35, 0, 13020, "CUDA driver version is insufficient")
    assert none.startswith("no NVIDIA driver found") and "insufficient" not in none
    old = _env.no_gpu_reason(35, 12040, 13020)
    assert old.startswith("the NVIDIA driver is too old: it supports CUDA up to 12.4, this "
                          "CuPy needs CUDA 13.2")
    assert _env.no_gpu_reason(100, 13000, 13020).startswith(
        "no CUDA GPU visible: the driver (CUDA 13.0) sees none")
    assert _env.no_gpu_reason(None, 13000, 13020).startswith("no CUDA GPU visible")
    assert _env.no_gpu_reason(999, 13000, 13020, "unknown error") == \
        "no CUDA GPU usable (unknown error)"


def test_no_driver_here_is_said_so():
    import cupy

    if cupy.cuda.runtime.driverGetVersion() != 0:
        pytest.skip("this machine has an NVIDIA driver")
    problem = _env.gpu_problem()
    assert problem.startswith("no NVIDIA driver found") and "insufficient" not in problem
    err = run("softmax", "x.npy", "-o", "y.npy", code=2).stderr  # file errors come first
    assert "insufficient" not in err
    err = run("explain", "softmax", "--shape", "8x8", "--device", "gpu", code=1).stderr
    assert "no NVIDIA driver found" in err and "insufficient" not in err


# ------------------------------------------------------------------------------------------
# NaN input on the --device cpu path: no NumPy warnings


def test_references_are_quiet_on_nan_and_inf():
    x = np.array([[1.0, np.nan, 3.0], [np.inf, -np.inf, 1.0], [1e300, -1e300, 0.0]])
    dy = np.ones_like(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, mean, rstd = reference.layer_norm(x, (3,), return_stats=True)
        reference.layer_norm_backward(dy, x, mean, rstd)
        _, r = reference.rms_norm(x, (3,), return_stats=True)
        reference.rms_norm_backward(dy, x, r)
        reference.batch_norm(x, np.zeros(3), np.ones(3), training=True)
        reference.batch_stats(x)
        reference.softmax_backward(dy, x)
    assert np.isnan(y[0]).all()  # NaN propagates over its row, as on the GPU


def test_cli_cpu_path_prints_no_warnings(tmp_path):
    x = np.array([[1, np.nan, 3, 4], [np.inf, -np.inf, 1, 2], [1e30, 3e38, -3e38, 0],
                  [0, 0, 0, 0]], np.float32)
    np.save(tmp_path / "x.npy", x)
    runs = [("softmax",), ("softmax", "--log"), ("softmax", "--grad", "x.npy"),
            ("layer-norm",), ("layer-norm", "--grad", "x.npy"), ("rms-norm",),
            ("rms-norm", "--grad", "x.npy"), ("batch-norm", "--train"),
            ("layer-norm", "--dtype", "float16")]
    for i, args in enumerate(runs):
        p = cukern_proc(args[0], "x.npy", "-o", f"y{i}.npy", "--device", "cpu", *args[1:],
                        env={}, cwd=tmp_path)
        assert p.returncode == 0, (args, p.stderr)
        assert "Warning" not in p.stderr and ".py:" not in p.stderr, (args, p.stderr)
        assert np.isnan(np.load(tmp_path / f"y{i}.npy")).any(), args


# ------------------------------------------------------------------------------------------
# bench: every op of the registry, planned without a GPU (the timing itself runs on a GPU)


def test_bench_plans_every_op():
    from cukern import _bench_ops, registry

    for name, spec in registry.OPS.items():
        cases = _bench_ops.plan(name, ["float16", "float32"])
        assert cases and {c.dtype for c in cases} == {"float16", "float32"}
        reads, writes = spec.traffic
        for c in cases:
            assert c.op == name
            assert c.moved_bytes == (reads + writes) * np.prod(c.shape) * c.itemsize
            if spec.family == "batch_norm":
                assert len(c.shape) >= 2 and c.rows_cols[0] == c.shape[1]
            else:
                assert len(c.shape) == 2 and c.rows_cols == c.shape
                assert c.array_bytes >= 2**27 * c.itemsize // 2  # past the L2 cache
        # a dtype's shapes together, in the default order
        assert [c.dtype for c in cases] == sorted((c.dtype for c in cases),
                                                  key=["float16", "float32"].index)
    assert [c.shape for c in _bench_ops.plan("softmax", ["bfloat16"], cols=[1000, 4096],
                                             rows=64)] == [(64, 1000), (64, 4096)]
    assert _bench_ops.plan("batch_stats", ["float32"], shapes=[(8, 3, 5)])[0].moved_bytes == \
        8 * 3 * 5 * 4  # read once, nothing full-size written
    with pytest.raises(ValueError, match="takes shapes"):
        _bench_ops.plan("batch_norm", ["float32"], cols=[64])
    with pytest.raises(ValueError, match="2-D shapes"):
        _bench_ops.plan("layer_norm", ["float32"], shapes=[(4, 5, 6)])


def test_bench_dry_run_needs_no_gpu(monkeypatch):
    from cukern.cli import common

    monkeypatch.setattr(common, "_gpu_problem", lambda dev=0: "no CUDA GPU visible (test)")
    for spec in cukern.registry.OPS.values():
        out = run("bench", spec.cli_name, "--dtype", "float16", "--dry-run").stdout
        head, *lines = out.strip().splitlines()
        assert head.split() == ["op", "dtype", "shape", "bytes", "moved"] and lines
        assert all(line.split()[:2] == [spec.name, "float16"] for line in lines)
    out = run("bench", "batch-norm", "--shape", "64x256x56x56,16384x1024", "--dtype",
              "bfloat16", "--dry-run").stdout
    assert "64x256x56x56" in out and "16384x1024" in out and "308.3 MB" in out  # 3 x 102.8 MB
    out = run("bench", "layer-norm-backward", "--cols", "256..1024", "--rows", "8",
              "--dry-run", "--dtype", "float32").stdout
    assert [ln.split()[2] for ln in out.splitlines()[1:]] == ["8x256", "8x512", "8x1024"]
    err = run("bench", "softmax", "--dtype", "float16", code=1).stderr
    assert "no CUDA GPU visible (test); bench times GPU kernels" in err


def test_bench_errors():
    def fails(*args, says):
        err = run("bench", *args, code=2).stderr
        assert err.startswith("Error: ") and says in err, err

    fails("--cols", "9..3", "--dry-run", says="--cols 9..3")
    fails("--dtype", "int8", says="--dtype: unknown int8")
    fails("nope", says="unknown op 'nope'; bench knows softmax, log-softmax")
    fails("batch-norm", "--cols", "64", says="batch-norm takes shapes (N, C, ...)")
    fails("softmax", "--shape", "4x5x6", says="softmax is timed on 2-D shapes")
    fails("softmax", "--shape", "4x5", "--cols", "8", says="leave out --cols and --rows")
    fails("softmax", "--shape", "4xq", says="--shape 4xq")


def _fake_bench(calls):
    def sweep(op, dtypes, cols_list=None, rows_fn=None, vs=("torch",), progress=None,
              reps=30, shapes=None):
        calls.append(dict(op=op, dtypes=dtypes, shapes=shapes, vs=vs))
        out = []
        for dt in dtypes:
            for shape in shapes:
                row = dict(op=op, dtype=dt, shape=list(shape), rows=shape[0], cols=shape[-1])
                out.append(dict(row, peer="copy", ms=0.1, gbps=3300.0, pct_copy=100.0))
                for peer, g in (("cukern", 3000.0), *((p, 1500.0) for p in vs)):
                    out.append(dict(row, peer=peer, ms=0.1, gbps=g, pct_copy=g / 33.0))
                    if progress:
                        progress(out[-1])
                if "jax" in vs:  # a peer that cannot run a shape is reported, not fatal
                    out[-1].update(gbps=float("nan"), pct_copy=float("nan"), error="no")
        return out

    def plot(results, path):
        calls.append(dict(plot=str(path), n=len(results)))
        Path(path).write_bytes(b"png")

    return types.SimpleNamespace(sweep=sweep, plot=plot)


def test_bench_table_json_plot(tmp_path, monkeypatch):
    from cukern.cli import common

    calls = []
    monkeypatch.setitem(sys.modules, "cukern._bench", _fake_bench(calls))
    monkeypatch.setattr(common, "_gpu_problem", lambda dev=0: None)
    out = run("bench", "--cols", "256..2048", "--dtype", "float16", "--vs", "torch").stdout
    assert calls[-1]["shapes"] == [(2**27 // c, c) for c in (256, 512, 1024, 2048)]
    assert calls[-1]["vs"] == ("torch",)
    head, *lines = out.strip().splitlines()
    assert head.index("cukern GB/s  %copy") < head.index("copy GB/s  %copy") < \
        head.index("torch GB/s  %copy")
    assert len(lines) == 4 and "3000.0   90.9%" in lines[0] and "1500.0" in lines[0]
    assert lines[0].split()[:3] == ["softmax", "float16", "524288x256"]
    out = run("bench", "--cols", "64", "--vs", "torch,jax").stdout
    assert out.strip().splitlines()[1].endswith("failed")
    js = run("bench", "batch-norm", "--shape", "8x16x4x4", "--vs", "none", "--json",
             "--plot", tmp_path / "p.png").stdout
    res = json.loads(js)
    assert {tuple(r["shape"]) for r in res} == {(8, 16, 4, 4)} and len(res) == 6  # 3 dtypes
    assert {r["peer"] for r in res} == {"copy", "cukern"} and calls[-2]["op"] == "batch_norm"
    assert calls[-1]["plot"] == str(tmp_path / "p.png") and (tmp_path / "p.png").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(cukern.registry.OPS))
def test_bench_times_every_op_on_gpu(op):
    """Each op's inputs and call in _bench_ops work: a small sweep gives a finite bandwidth
    for cukern and the copy, with no error."""
    from cukern import _bench

    bn = cukern.registry.get(op).family == "batch_norm"
    shape = (8, 16, 12, 12) if bn else (512, 1000)
    res = _bench.sweep(op, ["float16", "float32"], shapes=[shape], vs=(), reps=3)
    assert {(r["peer"], r["dtype"]) for r in res} == \
        {(p, d) for p in ("copy", "cukern") for d in ("float16", "float32")}
    for r in res:
        assert "error" not in r and np.isfinite(r["gbps"]) and r["gbps"] > 0, r
        assert r["shape"] == list(shape) and r["op"] == op


@pytest.mark.gpu
def test_bench_command_on_gpu():
    d = json.loads(run("bench", "layer-norm-backward", "--shape", "256x4096", "--dtype",
                       "bfloat16", "--vs", "none", "--json", "-q").stdout)
    assert {r["peer"] for r in d} == {"copy", "cukern"}
    assert all(r["bytes"] == 3 * 256 * 4096 * 2 for r in d)

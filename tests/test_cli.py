"""The command line end to end on the CPU (``--device cpu``, the float64 NumPy reference path):
every command's help, the ops on .npy and .npz inputs, chunked against single-shot, atomic
outputs, refusals, and every error with its exit status and one-line message.

The GPU pipeline's bookkeeping (tiles, double-buffered slots, pinned buffers, summed outputs)
also runs here against a stand-in for CuPy built on NumPy; tests/test_cli_gpu.py runs it on a
real GPU.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import cukern
from cukern import _io, reference
from cukern.cli import app, tools
from cukern.cli import common as cli  # the helpers the tests replace: _gpu_problem, _require

ROOT = Path(__file__).resolve().parents[1]
NORMS = all(hasattr(reference, n) for n in ("layer_norm", "layer_norm_backward", "rms_norm",
                                            "rms_norm_backward"))
needs_norms = pytest.mark.skipif(not NORMS, reason="cukern.reference has no layer/RMS norm yet")


def _runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        return CliRunner()


def run(*args, code: int = 0):
    """Invoke the CLI in-process; check the exit status; return the result."""
    result = _runner().invoke(app, [str(a) for a in args])
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr,
                                      result.exception)
    return result


def fails(*args, code: int, says: str):
    """The command fails with ``code`` and one line on stderr that contains ``says``."""
    result = run(*args, code=code)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ") and says in lines[0], lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    return lines[0]


def save(path: Path, a) -> str:
    np.save(path, a)
    return str(path)


def digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".part"))


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def ref_rows(fn, a, axis=-1, *more):
    """A softmax reference along ``axis`` computed on contiguous rows, as the CPU path does
    (NumPy's summation order, hence the last bit, depends on the memory layout)."""
    rows = [np.ascontiguousarray(np.moveaxis(np.asarray(v), axis, -1)) for v in (a, *more)]
    return np.moveaxis(fn(*rows, axis=-1), -1, axis)


def bf16():
    from ml_dtypes import bfloat16

    return np.dtype(bfloat16)


@pytest.fixture
def x(tmp_path, rng):
    return save(tmp_path / "x.npy", rng.standard_normal((37, 50)).astype(np.float32))


# ------------------------------------------------------------------------------------------
# help


COMMANDS = list(app.commands)


def test_group_help_lists_every_command():
    out = run("--help").stdout
    for name in COMMANDS:
        assert f"  {name} " in out
    assert {"softmax", "layer-norm", "rms-norm", "explain", "info", "bench", "selftest",
            "precompile"} <= set(COMMANDS)


def test_version():
    assert run("--version").stdout.strip() == f"cukern {cukern.__version__}"


@pytest.mark.parametrize("name", COMMANDS)
def test_command_help(name):
    out = run(name, "--help").stdout
    assert out.startswith(f"Usage: cukern {name} ")
    assert "--debug" in out and "-h, --help" in out


def test_console_script_and_forwarder_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    top = subprocess.run([sys.executable, str(ROOT / "cli.py"), "--help"], capture_output=True,
                         text=True, env=env, cwd=tmp_path)
    assert top.returncode == 0 and "Usage: cukern" in top.stdout
    # A real process: the error is one line on stderr, exit status 2, no traceback.
    bad = subprocess.run([sys.executable, "-m", "cukern", "softmax", "missing.npy", "-o",
                          "out.npy", "--device", "cpu"], capture_output=True, text=True, env=env,
                         cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "Error: missing.npy: no such file"
    debug = subprocess.run([sys.executable, "-m", "cukern", "--debug", "softmax", "missing.npy",
                            "-o", "out.npy", "--device", "cpu"], capture_output=True, text=True,
                           env=env, cwd=tmp_path)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


# ------------------------------------------------------------------------------------------
# softmax end to end


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_softmax_forward_matches_reference(tmp_path, rng, log, dtype):
    dt = bf16() if dtype == "bfloat16" else np.dtype(dtype)
    xs = rng.standard_normal((23, 40)).astype(dt)
    x = save(tmp_path / "x.npy", xs)
    out = tmp_path / "y.npy"
    run("softmax", x, "-o", out, "--device", "cpu", *(["--log"] if log else []))
    ref = (reference.log_softmax if log else reference.softmax)(xs).astype(dt)
    got = np.load(out)
    if dtype == "bfloat16":  # NumPy stores bfloat16 as raw 2-byte records
        assert got.dtype == np.dtype("V2")
        got = got.view(dt)
    assert got.dtype == dt and bits(got) == bits(ref)


@pytest.mark.parametrize("log", [False, True])
def test_softmax_backward(tmp_path, rng, log):
    xs = rng.standard_normal((19, 33))
    ys = (reference.log_softmax if log else reference.softmax)(xs)
    dys = rng.standard_normal(xs.shape)
    y, dy = save(tmp_path / "y.npy", ys), save(tmp_path / "dy.npy", dys)
    out = tmp_path / "dx.npy"
    run("softmax", y, "--grad", dy, "-o", out, "--device", "cpu", *(["--log"] if log else []))
    ref = (reference.log_softmax_backward if log else reference.softmax_backward)(dys, ys)
    assert bits(np.load(out)) == bits(ref)


def test_dtype_option_casts(tmp_path, x):
    out = tmp_path / "y.npy"
    run("softmax", x, "-o", out, "--device", "cpu", "--dtype", "float16")
    xs = np.load(x)
    assert np.load(out).dtype == np.float16
    assert bits(np.load(out)) == bits(reference.softmax(xs.astype(np.float16)).astype(np.float16))


def test_npz_inputs(tmp_path, rng):
    a = rng.standard_normal((9, 12)).astype(np.float32)
    np.savez(tmp_path / "s.npz", logits=a, other=np.ones(3))
    np.savez_compressed(tmp_path / "c.npz", a)
    np.savez(tmp_path / "one.npz", only=a)
    ref = bits(reference.softmax(a).astype(np.float32))
    for spec in (f"{tmp_path}/s.npz:logits", f"{tmp_path}/c.npz:arr_0", f"{tmp_path}/one.npz"):
        out = tmp_path / "y.npy"
        run("softmax", spec, "-o", out, "--device", "cpu", "--overwrite")
        assert bits(np.load(out)) == ref, spec


def test_stored_npz_member_is_memory_mapped(tmp_path, rng):
    a = rng.standard_normal((5, 6))
    np.savez(tmp_path / "s.npz", a=a, b=a + 1)
    got = _io.open_array(f"{tmp_path}/s.npz:b")
    assert isinstance(got, np.memmap) and np.array_equal(got, a + 1)


def test_fortran_order_input(tmp_path, rng):
    a = rng.standard_normal((11, 13, 7))
    xf = save(tmp_path / "f.npy", np.asfortranarray(a))
    out = tmp_path / "y.npy"
    run("softmax", xf, "-o", out, "--device", "cpu", "--axis", "1", "--chunk-rows", "3")
    assert bits(np.load(out)) == bits(ref_rows(reference.softmax, a, 1))


def test_big_endian_input(tmp_path, rng, monkeypatch):
    a = rng.standard_normal((13, 21))
    x = save(tmp_path / "x.npy", a.astype(">f4"))
    out = tmp_path / "y.npy"
    run("softmax", x, "-o", out, "--device", "cpu", "--chunk-rows", "4")
    want = bits(reference.softmax(a.astype(np.float32)).astype(np.float32))
    assert np.load(out).dtype == np.dtype("<f4") and bits(np.load(out)) == want
    _fake_gpu(monkeypatch)
    run("softmax", x, "-o", out, "--chunk-rows", "4", "--overwrite")
    assert bits(np.load(out)) == want


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (3, 0, 4)])
def test_empty_arrays(tmp_path, shape):
    x = save(tmp_path / "x.npy", np.zeros(shape, np.float32))
    out = tmp_path / "y.npy"
    run("softmax", x, "-o", out, "--device", "cpu")
    got = np.load(out)
    assert got.shape == shape and got.dtype == np.float32


# ------------------------------------------------------------------------------------------
# chunked == single-shot


@pytest.mark.parametrize("shape,axis", [((37, 50), -1), ((6, 7, 24), -1), ((6, 7, 24), 1),
                                        ((6, 7, 24), 0), ((101,), 0), ((1, 40), -1)])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 1000])
def test_chunked_equals_single_shot(tmp_path, rng, shape, axis, rows):
    xs = rng.standard_normal(shape).astype(np.float32)
    x = save(tmp_path / "x.npy", xs)
    one, many = tmp_path / "one.npy", tmp_path / "many.npy"
    run("softmax", x, "-o", one, "--device", "cpu", "--axis", axis)
    run("softmax", x, "-o", many, "--device", "cpu", "--axis", axis, "--chunk-rows", rows)
    assert bits(np.load(one)) == bits(np.load(many))
    assert bits(np.load(one)) == bits(ref_rows(reference.softmax, xs, axis).astype(np.float32))


def test_chunked_backward(tmp_path, rng):
    ys = reference.softmax(rng.standard_normal((29, 17))).astype(np.float32)
    y = save(tmp_path / "y.npy", ys)
    dy = save(tmp_path / "dy.npy", rng.standard_normal(ys.shape).astype(np.float32))
    one, many = tmp_path / "one.npy", tmp_path / "many.npy"
    run("softmax", y, "--grad", dy, "-o", one, "--device", "cpu")
    run("softmax", y, "--grad", dy, "-o", many, "--device", "cpu", "--chunk-rows", "4")
    assert bits(np.load(one)) == bits(np.load(many))


def test_tiles_cover_every_row_once():
    from cukern._chunked import tiles

    for p, q, rows in [(7, 1, 3), (1, 30, 4), (4, 6, 3), (4, 6, 13), (5, 5, 100)]:
        seen = np.zeros((p, q), int)
        for p0, p1, q0, q1 in tiles(p, q, rows):
            assert (p1 - p0) * (q1 - q0) <= rows
            seen[p0:p1, q0:q1] += 1
        assert (seen == 1).all()


def test_gpu_tiles_start_where_the_row_offsets_repeat():
    from cukern._chunked import phase_rows

    for m in (1, 2, 3, 700, 1500, 3000, 4096, 50257):
        period = 16 // np.gcd(m, 16)
        for rows in (1, 3, 7, 16, 33, 100, 1000):
            got = phase_rows(rows, m)
            if rows >= period:  # every tile's first row at a multiple of 16 bytes of any element
                assert 0 < got <= rows and got % period == 0 and (got * m) % 16 == 0, (m, rows)
                assert rows - got < period
            else:  # not even one period fits: the rows as asked
                assert got == rows


# ------------------------------------------------------------------------------------------
# Atomic outputs, refusals


def fail_on_call(monkeypatch, n: int, exc: BaseException, module=reference,
                 name: str = "softmax"):
    """Make ``module.name`` (the CPU path's reference.softmax by default) raise ``exc`` on its
    n-th call (the n-th chunk); returns the list its calls are counted in."""
    real = getattr(module, name)
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, flaky)
    return calls


def test_failure_mid_run_leaves_nothing(tmp_path, x, monkeypatch):
    before = digest(x)
    calls = fail_on_call(monkeypatch, 2, RuntimeError("injected failure"))
    out = tmp_path / "y.npy"
    fails("softmax", x, "-o", out, "--device", "cpu", "--chunk-rows", "5", code=1,
          says="RuntimeError: injected failure")
    assert len(calls) == 2  # it failed after the first chunk was written
    assert not out.exists() and leftovers(tmp_path) == []
    assert digest(x) == before


def test_interrupt_leaves_nothing(tmp_path, x, monkeypatch):
    fail_on_call(monkeypatch, 3, KeyboardInterrupt())
    out = tmp_path / "y.npy"
    result = run("softmax", x, "-o", out, "--device", "cpu", "--chunk-rows", "5", code=130)
    assert "Aborted" in result.stderr
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_sigterm_leaves_nothing(tmp_path, rng, signame):
    """A real process stopped by SIGTERM, SIGHUP or SIGINT mid-run cleans up its temporary
    output and exits 128 + the signal number (130 for Ctrl-C)."""
    import signal
    import time

    signum = getattr(signal, signame)

    x = save(tmp_path / "x.npy", rng.standard_normal((40_000, 1000)).astype(np.float16))
    out = tmp_path / "y.npy"
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def default_signal():  # as a shell's foreground job gets it: a test run in the background
        signal.signal(signum, signal.SIG_DFL)  # (nohup, cmd &) inherits SIGHUP/SIGINT ignored

    proc = subprocess.Popen([sys.executable, "-m", "cukern", "softmax", x, "-o", str(out),
                             "--device", "cpu", "--chunk-rows", "10"], env=env,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_signal)
    deadline = time.monotonic() + 60
    while not leftovers(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert leftovers(tmp_path), "the run finished before it could be interrupted"
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("make", ["npy", "scratch", "npz"])
def test_a_signal_just_after_a_temporary_appears_leaves_nothing(tmp_path, monkeypatch, make):
    """A signal's handler raises at the first bytecode after the temporary file is created
    (what a loaded machine made of test_sigterm_leaves_nothing once): the file is removed."""
    real_open = os.open

    def open_then_interrupt(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        if flags & os.O_CREAT and str(path).endswith(".part"):
            os.close(fd)
            raise KeyboardInterrupt  # as the CLI's signal handlers do
        return fd

    monkeypatch.setattr(_io.os, "open", open_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        with _io.Outputs() as outs:
            if make == "npz":
                outs.npz(tmp_path / "s.npz", {"a": np.zeros(3)})
            else:
                getattr(outs, make)(tmp_path / "y.npy", (4, 4), np.float32)
    monkeypatch.undo()
    assert leftovers(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_stale_part_files_are_mentioned(tmp_path, x):
    stale = tmp_path / ".y.npy.abc123.part"  # what a killed run leaves
    stale.write_bytes(b"\0" * 10)
    result = run("softmax", x, "-o", tmp_path / "y.npy", "--device", "cpu")
    assert f"Note: {stale} is left from an earlier run" in result.stderr
    assert stale.exists()  # it may belong to a run still going: mentioned, not removed
    assert "Note:" not in run("softmax", x, "-o", tmp_path / "z.npy", "--device", "cpu").stderr


def test_failed_overwrite_keeps_the_old_output(tmp_path, x, monkeypatch):
    out = tmp_path / "y.npy"
    run("softmax", x, "-o", out, "--device", "cpu")
    old = digest(out)
    fail_on_call(monkeypatch, 2, RuntimeError("boom"))
    run("softmax", x, "-o", out, "--device", "cpu", "--chunk-rows", "5", "--overwrite", code=1)
    assert digest(out) == old and leftovers(tmp_path) == []


def test_overwrite(tmp_path, x):
    out = tmp_path / "y.npy"
    run("softmax", x, "-o", out, "--device", "cpu")
    fails("softmax", x, "-o", out, "--device", "cpu", code=2,
          says=f"-o {out} exists; pass --overwrite")
    run("softmax", x, "-o", out, "--device", "cpu", "--log", "--overwrite")
    assert bits(np.load(out)) == bits(reference.log_softmax(np.load(x)).astype(np.float32))
    assert (out.stat().st_mode & 0o777) == 0o666 & ~_umask()
    out.chmod(0o600)  # --overwrite keeps the replaced file's permissions
    run("softmax", x, "-o", out, "--device", "cpu", "--overwrite")
    assert (out.stat().st_mode & 0o777) == 0o600


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_output_equal_to_an_input_is_refused(tmp_path, x, rng):
    before = digest(x)
    link = tmp_path / "link.npy"
    link.symlink_to(x)
    hard = tmp_path / "hard.npy"
    os.link(x, hard)
    for out in (x, f"{tmp_path}/./x.npy", link, hard):
        for flags in ([], ["--overwrite"]):
            fails("softmax", x, "-o", out, "--device", "cpu", *flags, code=2,
                  says="is an input file")
    dy = save(tmp_path / "dy.npy", rng.standard_normal((37, 50)).astype(np.float32))
    fails("softmax", x, "--grad", dy, "-o", dy, "--device", "cpu", "--overwrite", code=2,
          says="is an input file")
    assert digest(x) == before


# ------------------------------------------------------------------------------------------
# Errors: one line, the right exit status, no traceback


def test_input_errors(tmp_path, rng, x):
    d = tmp_path
    (d / "notes.txt").write_text("hello\n")
    (d / "junk.npy").write_bytes(b"\x93NUMPY\x01\x00garbage")
    np.save(d / "ints.npy", np.arange(12).reshape(3, 4))
    np.save(d / "cplx.npy", np.ones((3, 4), np.complex64))
    np.save(d / "obj.npy", np.array([[1, "a"]], dtype=object), allow_pickle=True)
    np.save(d / "scalar.npy", np.float32(3))
    np.save(d / "small.npy", np.ones((3, 5), np.float32))
    np.save(d / "trunc.npy", np.ones((30, 50), np.float32))
    with open(d / "trunc.npy", "r+b") as f:
        f.truncate(500)
    np.savez(d / "two.npz", a=np.ones(3), b=np.ones(3))
    os.mkdir(d / "folder.npy")
    o = ["-o", d / "out.npy", "--device", "cpu"]
    cases = [
        (["softmax", d / "missing.npy"], "missing.npy: no such file"),
        (["softmax", d / "folder.npy"], "is a directory"),
        (["softmax", d / "notes.txt"], "notes.txt is not an .npy or .npz file"),
        (["softmax", d / "junk.npy"], "junk.npy is not a readable .npy array"),
        (["softmax", d / "trunc.npy"], "trunc.npy is truncated"),
        (["softmax", f"{d}/two.npz:c"], "two.npz has no array 'c' (it holds: a, b)"),
        (["softmax", d / "two.npz"], "holds 2 arrays (a, b); name one"),
        (["softmax", f"{d}/missing.npz:a"], "missing.npz: no such file"),
        (["softmax", d / "ints.npy"], "ints.npy has dtype int64; expected float16, bfloat16"),
        (["softmax", d / "cplx.npy"], "has dtype complex64"),
        (["softmax", d / "obj.npy"], "holds Python objects"),
        (["softmax", d / "scalar.npy"], "is a 0-d array"),
        (["softmax", x, "--axis", "2"], "--axis 2 is out of range for"),
        (["softmax", x, "--grad", d / "small.npy"], "--grad"),
        (["softmax", x, "--grad", d / "ints.npy"], "--grad"),
    ]
    for args, says in cases:
        fails(*args, *o, code=2, says=says)
    fails("softmax", x, "-o", d / "out.npy", "--device", "tpu", code=2,
          says="--device tpu: expected gpu, gpu:N or cpu")
    fails("softmax", x, "-o", d / "out.txt", "--device", "cpu", code=2,
          says="must be a .npy file")
    fails("softmax", x, "-o", d / "nowhere" / "out.npy", "--device", "cpu", code=2,
          says="does not exist")
    fails("softmax", x, "-o", d / "folder.npy", "--device", "cpu", "--overwrite", code=2,
          says="is a directory")
    assert leftovers(d) == [] and not (d / "out.npy").exists()


def _npy_bytes(shape, data: bytes, descr: str = "<f4") -> bytes:
    """An .npy image whose header gives ``shape``, followed by ``data`` whatever its size."""
    import io

    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": descr, "fortran_order": False,
                                             "shape": shape})
    return f.getvalue() + data


@pytest.mark.parametrize("shape, says", [((-1, 4), "negative shape (-1, 4)"),
                                         ((2**40, 2**40), "more data than any file can hold")])
def test_malformed_npy_shapes(tmp_path, shape, says):
    (tmp_path / "bad.npy").write_bytes(_npy_bytes(shape, b"\0" * 64))
    import zipfile

    with zipfile.ZipFile(tmp_path / "bad.npz", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("a.npy", _npy_bytes(shape, b"\0" * 64))
    for spec in (tmp_path / "bad.npy", f"{tmp_path}/bad.npz:a"):
        fails("softmax", spec, "-o", tmp_path / "y.npy", "--device", "cpu", code=2, says=says)
    assert leftovers(tmp_path) == []


def test_compressed_member_is_checked_before_it_is_read(tmp_path, monkeypatch):
    """A compressed member's header is checked against the member's size before decompressing,
    and the data is read in bounded pieces, never whole."""
    import zipfile

    big = tmp_path / "big.npz"  # a 4x4 array followed by 64 MB of zeros (a 64 KB archive)
    with zipfile.ZipFile(big, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("a.npy", _npy_bytes((4, 4), np.ones(16, "<f4").tobytes() + bytes(1 << 26)))
    short = tmp_path / "short.npz"  # a header promising 4 MB, 64 bytes of data
    with zipfile.ZipFile(short, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("a.npy", _npy_bytes((1000, 1000), bytes(64)))
    reads = []
    real_read = zipfile.ZipExtFile.read

    def read(self, n=-1):
        reads.append(n)
        return real_read(self, n)

    monkeypatch.setattr(zipfile.ZipExtFile, "read", read)
    a = _io.open_array(f"{big}:a")
    assert a.shape == (4, 4) and (a == 1).all()
    assert reads and all(n is not None and 0 <= n <= _io._CHUNK for n in reads), reads
    reads.clear()
    fails("softmax", f"{short}:a", "-o", tmp_path / "y.npy", "--device", "cpu", code=2,
          says="short.npz:a is truncated: its header promises 4000000 bytes of data, the "
               "member holds 64")
    assert sum(max(n, 0) for n in reads) < 1000  # refused after reading the header only


def test_stored_member_is_bounded_and_checked(tmp_path, rng):
    """A stored member is never read past its own end, and its CRC-32 is checked."""
    import zipfile

    over = tmp_path / "over.npz"  # a promises 4x4 but holds 2 values; b follows it
    with zipfile.ZipFile(over, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("a.npy", _npy_bytes((4, 4), np.ones(2, "<f4").tobytes()))
        zf.writestr("b.npy", _npy_bytes((4, 4), np.ones(16, "<f4").tobytes()))
    fails("softmax", f"{over}:a", "-o", tmp_path / "y.npy", "--device", "cpu", code=2,
          says="over.npz:a is truncated: its header promises 64 bytes of data")
    bad = tmp_path / "bad.npz"
    np.savez(bad, a=rng.standard_normal((8, 8)).astype(np.float32))
    raw = bytearray(bad.read_bytes())
    raw[raw.index(b"\n", raw.index(b"}")) + 10] ^= 0xFF  # one byte of the data
    bad.write_bytes(bytes(raw))
    fails("softmax", f"{bad}:a", "-o", tmp_path / "y.npy", "--device", "cpu", code=2,
          says="bad.npz:a is damaged: its CRC-32 does not match")
    assert not (tmp_path / "y.npy").exists() and leftovers(tmp_path) == []


def test_no_gpu(tmp_path, x, monkeypatch):
    monkeypatch.setattr(cli, "_gpu_problem", lambda dev=0: "no CUDA GPU visible (test)")
    fails("softmax", x, "-o", tmp_path / "y.npy", code=1,
          says="no CUDA GPU visible (test); --device cpu runs the NumPy reference instead")
    fails("selftest", code=1, says="no CUDA GPU visible")
    fails("bench", "--vs", "none", code=1, says="no CUDA GPU visible")
    fails("precompile", code=1, says="no CUDA GPU visible")
    assert not (tmp_path / "y.npy").exists()


def test_not_enough_disk(tmp_path, x, monkeypatch):
    usage = types.SimpleNamespace(total=10**9, used=10**9 - 100, free=100)
    monkeypatch.setattr(_io.shutil, "disk_usage", lambda path: usage)
    fails("softmax", x, "-o", tmp_path / "y.npy", "--device", "cpu", code=1,
          says="not enough disk space for")
    assert leftovers(tmp_path) == [] and not (tmp_path / "y.npy").exists()


def test_disk_fills_while_reserving(tmp_path, x, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_io.os, "posix_fallocate", full)
    fails("softmax", x, "-o", tmp_path / "y.npy", "--device", "cpu", code=1,
          says="not enough disk space for")
    assert leftovers(tmp_path) == [] and not (tmp_path / "y.npy").exists()


def test_debug_shows_the_exception(tmp_path, x, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("deep failure")

    monkeypatch.setattr(reference, "softmax", broken)
    quiet = run("softmax", x, "-o", tmp_path / "a.npy", "--device", "cpu", code=1)
    assert "Traceback" not in quiet.stderr and "--debug" in quiet.stderr
    for args in (["--debug", "softmax", x], ["softmax", x, "--debug"]):
        result = run(*args, "-o", tmp_path / "b.npy", "--device", "cpu", code=1)
        assert "Traceback" in result.stderr and "RuntimeError: deep failure" in result.stderr
    assert leftovers(tmp_path) == []


def test_debug_keeps_the_exit_status(tmp_path, x):
    """--debug adds the traceback; an input error still exits 2."""
    for args in (["--debug", "softmax"], ["softmax", "--debug"]):
        result = run(*args, tmp_path / "missing.npy", "-o", tmp_path / "b.npy", "--device", "cpu",
                     code=2)
        assert "Traceback" in result.stderr and "missing.npy: no such file" in result.stderr


# ------------------------------------------------------------------------------------------
# The GPU pipeline's bookkeeping, on a stand-in for CuPy


class _HostArray(np.ndarray):
    """A NumPy array posing as a CuPy one: ``.data`` copies to and from host pointers."""

    @property
    def data(self):
        arr = self

        class Ptr:
            def copy_from_host_async(self, mem, size, stream=None):
                ctypes.memmove(arr.ctypes.data, getattr(mem, "value", mem), size)

            def copy_to_host_async(self, mem, size, stream=None):
                ctypes.memmove(getattr(mem, "value", mem), arr.ctypes.data, size)

        return Ptr()


def _fake_cupy(free=1 << 30):
    class Ctx:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def synchronize(self):
            pass

        def record(self, stream=None):
            pass

    def dev(a):
        return np.asarray(a).view(_HostArray)

    cuda = types.SimpleNamespace(
        Device=Ctx, Stream=Ctx, Event=Ctx,
        alloc_pinned_memory=lambda n: bytearray(n),
        runtime=types.SimpleNamespace(memGetInfo=lambda: (free, 2 * free),
                                      getDeviceCount=lambda: 1))
    return types.SimpleNamespace(
        cuda=cuda, empty=lambda n, dtype: dev(np.empty(n, dtype)), asarray=dev,
        ascontiguousarray=lambda a: dev(np.ascontiguousarray(a)),
        asnumpy=lambda a, stream=None: np.asarray(a),
        get_default_memory_pool=lambda: types.SimpleNamespace(free_bytes=lambda: 0))


@pytest.fixture
def fake_gpu(monkeypatch):
    """Run the GPU code path with NumPy: the reference ops on a stand-in CuPy."""
    _fake_gpu(monkeypatch)


def _fake_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(cli, "_gpu_problem", lambda dev=0: None)
    monkeypatch.setattr(cli, "_require",
                        lambda device, name, command: getattr(reference, name))


@pytest.mark.parametrize("rows", [None, 1, 4, 7])
@pytest.mark.parametrize("axis", [-1, 0])
def test_gpu_pipeline_bookkeeping(tmp_path, rng, fake_gpu, rows, axis):
    xs = rng.standard_normal((33, 9, 20)).astype(np.float32)
    x = save(tmp_path / "x.npy", xs)
    out = tmp_path / "y.npy"
    extra = [] if rows is None else ["--chunk-rows", rows]
    run("softmax", x, "-o", out, "--axis", axis, *extra)
    # NumPy on strided tiles stands in for the kernels: right to the last bit only up to
    # NumPy's layout-dependent summation order.
    np.testing.assert_allclose(np.load(out), reference.softmax(xs, axis=axis), rtol=1e-6,
                               atol=1e-9)


def test_gpu_auto_chunk_rows_from_free_memory(monkeypatch):
    from cukern._chunked import Result, auto_chunk_rows

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(free=1 << 20))
    x = np.zeros((1000, 256, 1), np.float32)
    rows = auto_chunk_rows([x], [Result("y", 256, np.float32)], 0, np.float32)
    # Two slots, each holding the tile, its cast, the output and its cast (+25%), in half of
    # the free megabyte.
    assert rows == (1 << 19) // (2 * (int(256 * 16 * 1.25) + 64))
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(free=1 << 10))
    with pytest.raises(_io.RunError, match="too long to process on this GPU"):
        auto_chunk_rows([x], [Result("y", 256, np.float32)], 0, np.float32)


# ------------------------------------------------------------------------------------------
# layer-norm and rms-norm


@pytest.fixture
def norm_files(tmp_path, rng):
    f = {}
    for name, a in (("x", rng.standard_normal((6, 7, 24))),
                    ("dy", rng.standard_normal((6, 7, 24))),
                    ("w", 1 + 0.1 * rng.standard_normal(24)),
                    ("b", 0.1 * rng.standard_normal(24)),
                    ("w2", 1 + 0.1 * rng.standard_normal((7, 24)))):
        f[name] = save(tmp_path / f"{name}.npy", a.astype(np.float32))
    return f


def test_norm_argument_errors(tmp_path, norm_files):
    f = norm_files
    o = ["-o", tmp_path / "y.npy", "--device", "cpu"]
    fails("layer-norm", f["x"], "--weight", f["w2"], "--normalized-ndim", "1", *o, code=2,
          says="--weight " + f["w2"] + " has shape 7x24, expected 24, the normalized shape")
    fails("rms-norm", f["x"], "--weight", f["w"], "--normalized-ndim", "2", *o, code=2,
          says="has shape 24, expected 7x24")
    fails("layer-norm", f["x"], "--bias", f["w2"], *o, code=2, says="--bias")
    fails("layer-norm", f["x"], "--normalized-ndim", "4", *o, code=2,
          says="has 3 dimensions; normalizing over the last 4 needs at least 4")
    fails("layer-norm", f["x"], "--normalized-shape", "5x24", *o, code=2,
          says="--normalized-shape 5x24 does not match")
    fails("layer-norm", f["x"], "--normalized-shape", "ax", *o, code=2,
          says="expected sizes like 768 or 12x64")
    fails("layer-norm", f["x"], "--param-grads", tmp_path / "g.npz", *o, code=2,
          says="--param-grads needs --grad")
    fails("rms-norm", f["x"], "--grad", f["dy"], "--param-grads", tmp_path / "g.npz", *o,
          code=2, says="--param-grads needs --weight")
    fails("layer-norm", f["x"], "--grad", f["w"], *o, code=2, says="--grad")
    fails("layer-norm", f["x"], "--stats", tmp_path / "s.npy", *o, code=2,
          says="must be a .npz file")
    fails("layer-norm", f["x"], "--grad", f["dy"], "--stats", f["w"], *o, code=2,
          says="expected the .npz file the forward pass wrote")
    np.savez(tmp_path / "bad.npz", mean=np.zeros(6, np.float32), rstd=np.ones(6, np.float32))
    fails("layer-norm", f["x"], "--grad", f["dy"], "--stats", tmp_path / "bad.npz", *o, code=2,
          says="bad.npz:mean has shape 6, expected 6x7 (one value per row of IN)")
    np.savez(tmp_path / "rms.npz", rstd=np.ones((6, 7), np.float32))
    fails("layer-norm", f["x"], "--grad", f["dy"], "--stats", tmp_path / "rms.npz", *o, code=2,
          says="rms.npz has no array 'mean' (it holds: rstd)")


@needs_norms
@pytest.mark.parametrize("rows", ["1", "5", "100"])
def test_layer_norm_forward(tmp_path, norm_files, rows):
    f = norm_files
    one, many = tmp_path / "one.npy", tmp_path / "many.npy"
    common = ["--weight", f["w"], "--bias", f["b"], "--eps", "1e-5", "--device", "cpu"]
    run("layer-norm", f["x"], "-o", one, "--stats", tmp_path / "s1.npz", *common)
    run("layer-norm", f["x"], "-o", many, "--stats", tmp_path / "s2.npz", "--chunk-rows", rows,
        *common)
    xs, w, b = (np.load(f[k]) for k in ("x", "w", "b"))
    y, mean, rstd = reference.layer_norm(xs, (24,), w, b, 1e-5, return_stats=True)
    assert bits(np.load(one)) == bits(np.load(many)) == bits(y.astype(np.float32))
    s1, s2 = np.load(tmp_path / "s1.npz"), np.load(tmp_path / "s2.npz")
    assert sorted(s1) == ["mean", "rstd"]
    for k, ref in (("mean", mean), ("rstd", rstd)):
        assert s1[k].shape == (6, 7) and s1[k].dtype == np.float32
        assert bits(s1[k]) == bits(s2[k]) == bits(np.asarray(ref).astype(np.float32))


@needs_norms
def test_layer_norm_two_axes(tmp_path, norm_files):
    f = norm_files
    out = tmp_path / "y.npy"
    run("layer-norm", f["x"], "-o", out, "--weight", f["w2"], "--device", "cpu",
        "--chunk-rows", "4")
    xs, w2 = np.load(f["x"]), np.load(f["w2"])
    y = reference.layer_norm(xs, (7, 24), w2, None, 1e-5)
    assert bits(np.load(out)) == bits(y.astype(np.float32))


@needs_norms
@pytest.mark.parametrize("saved", [True, False])
def test_layer_norm_backward(tmp_path, norm_files, saved):
    f = norm_files
    stats = tmp_path / "s.npz"
    run("layer-norm", f["x"], "-o", tmp_path / "y.npy", "--stats", stats, "--weight", f["w"],
        "--device", "cpu")
    common = ["--grad", f["dy"], "--weight", f["w"], "--device", "cpu",
              *(["--stats", stats] if saved else [])]
    run("layer-norm", f["x"], "-o", tmp_path / "dx1.npy", "--param-grads", tmp_path / "g1.npz",
        *common)
    run("layer-norm", f["x"], "-o", tmp_path / "dx2.npy", "--param-grads", tmp_path / "g2.npz",
        "--chunk-rows", "4", *common)
    xs, dys, w = (np.load(f[k]) for k in ("x", "dy", "w"))
    s = np.load(stats)
    dx, dw, db = reference.layer_norm_backward(dys, xs, s["mean"], s["rstd"], w)
    assert bits(np.load(tmp_path / "dx1.npy")) == bits(np.load(tmp_path / "dx2.npy"))
    assert bits(np.load(tmp_path / "dx1.npy")) == bits(dx.astype(np.float32))
    g1, g2 = np.load(tmp_path / "g1.npz"), np.load(tmp_path / "g2.npz")
    assert sorted(g1) == ["dbias", "dweight"]
    for k, ref in (("dweight", dw), ("dbias", db)):
        # Sums over rows: chunked adds per-chunk sums (in float64), so only close.
        assert g1[k].shape == (24,) and g1[k].dtype == np.float32
        np.testing.assert_allclose(g1[k], ref, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(g2[k], ref, rtol=1e-6, atol=1e-6)


@needs_norms
def test_layer_norm_backward_bias_alone(tmp_path, norm_files):
    """--bias without --weight: --param-grads holds dbias alone, dy summed over all rows."""
    f = norm_files
    run("layer-norm", f["x"], "--grad", f["dy"], "--bias", f["b"], "-o", tmp_path / "dx.npy",
        "--param-grads", tmp_path / "g.npz", "--device", "cpu", "--chunk-rows", "4")
    xs, dys, b = (np.load(f[k]) for k in ("x", "dy", "b"))
    _, mean, rstd = reference.layer_norm(xs, (24,), None, b, 1e-5, return_stats=True)
    dx, dw, db = reference.layer_norm_backward(dys, xs, mean.astype(np.float32),
                                               rstd.astype(np.float32), None, b)
    assert dw is None
    assert bits(np.load(tmp_path / "dx.npy")) == bits(dx.astype(np.float32))
    g = np.load(tmp_path / "g.npz")
    assert sorted(g) == ["dbias"] and g["dbias"].dtype == np.float32
    np.testing.assert_allclose(g["dbias"], dys.astype(np.float64).sum((0, 1)), rtol=1e-6,
                               atol=1e-6)
    fails("layer-norm", f["x"], "--grad", f["dy"], "-o", tmp_path / "dx2.npy", "--param-grads",
          tmp_path / "g2.npz", "--device", "cpu", code=2,
          says="--param-grads needs --weight or --bias")


@needs_norms
def test_rms_norm_forward_and_backward(tmp_path, norm_files):
    f = norm_files
    stats = tmp_path / "s.npz"
    run("rms-norm", f["x"], "-o", tmp_path / "y1.npy", "--stats", stats, "--weight", f["w"],
        "--device", "cpu")
    run("rms-norm", f["x"], "-o", tmp_path / "y2.npy", "--weight", f["w"], "--device", "cpu",
        "--chunk-rows", "3")
    xs, dys, w = (np.load(f[k]) for k in ("x", "dy", "w"))
    y, rstd = reference.rms_norm(xs, (24,), w, 1e-6, return_stats=True)
    assert bits(np.load(tmp_path / "y1.npy")) == bits(np.load(tmp_path / "y2.npy")) == \
        bits(y.astype(np.float32))
    assert sorted(np.load(stats)) == ["rstd"]
    run("rms-norm", f["x"], "--grad", f["dy"], "--stats", stats, "--weight", f["w"],
        "-o", tmp_path / "dx.npy", "--param-grads", tmp_path / "g.npz", "--device", "cpu",
        "--chunk-rows", "5")
    dx, dw = reference.rms_norm_backward(dys, xs, np.load(stats)["rstd"], w)
    assert bits(np.load(tmp_path / "dx.npy")) == bits(dx.astype(np.float32))
    np.testing.assert_allclose(np.load(tmp_path / "g.npz")["dweight"], dw, rtol=1e-6)


@needs_norms
def test_norm_failure_leaves_nothing(tmp_path, norm_files, monkeypatch):
    f = norm_files
    real = reference.layer_norm_backward
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "layer_norm_backward", flaky)
    fails("layer-norm", f["x"], "--grad", f["dy"], "--weight", f["w"], "-o", tmp_path / "dx.npy",
          "--param-grads", tmp_path / "g.npz", "--device", "cpu", "--chunk-rows", "4", code=1,
          says="injected")
    assert not (tmp_path / "dx.npy").exists() and not (tmp_path / "g.npz").exists()
    assert leftovers(tmp_path) == []


@needs_norms
@pytest.mark.parametrize("param", ["w", "b"])
def test_norm_gpu_pipeline_sums_param_grads(tmp_path, norm_files, fake_gpu, param):
    f = norm_files
    flag = "--weight" if param == "w" else "--bias"
    run("layer-norm", f["x"], "--grad", f["dy"], flag, f[param], "-o", tmp_path / "dx.npy",
        "--param-grads", tmp_path / "g.npz", "--chunk-rows", "5")
    xs, dys, p = (np.load(f[k]) for k in ("x", "dy", param))
    _, mean, rstd = reference.layer_norm(xs, (24,), None, None, 1e-5, return_stats=True)
    w, b = (p, None) if param == "w" else (None, p)
    dx, dw, db = reference.layer_norm_backward(dys, xs, mean.astype(np.float32),
                                               rstd.astype(np.float32), w, b)
    assert bits(np.load(tmp_path / "dx.npy")) == bits(dx.astype(np.float32))
    g = np.load(tmp_path / "g.npz")
    assert sorted(g) == (["dbias", "dweight"] if param == "w" else ["dbias"])
    if param == "w":
        np.testing.assert_allclose(g["dweight"], dw, rtol=1e-6)
    np.testing.assert_allclose(g["dbias"], db, rtol=1e-6)


@needs_norms
@pytest.mark.parametrize("command", ["layer-norm", "rms-norm", "batch-norm"])
def test_eps_is_checked_as_the_op_checks_it(tmp_path, norm_files, command):
    """--eps meets the op's own check, with its message and exit 2, on the CPU path as on the
    GPU's: 0, negative, NaN, infinite, and values that float32 (the compute type of float16
    and float32 data) rounds to 0 or a subnormal number, or overflows."""
    from cukern import runner

    op = command.replace("-", "_")
    extra = ["--train"] if command == "batch-norm" else []
    out = tmp_path / "y.npy"
    for eps in ("0", "-1", "nan", "inf", "1e-50", "1e-40", "1e39"):
        with pytest.raises(ValueError) as err:
            runner.check_eps(op, float(eps), "float32")
        for device in ("cpu", "gpu"):
            line = fails(command, norm_files["x"], "-o", out, "--eps", eps, "--device", device,
                         *extra, code=2, says=str(err.value))
            assert line == f"Error: {err.value}"
    assert leftovers(tmp_path) == [] and not out.exists()
    # float64 data: computed in float64, where 1e-300 is a normal number
    run(command, norm_files["x"], "-o", out, "--eps", "1e-300", "--dtype", "float64",
        "--device", "cpu", *extra)


def test_rows_past_the_kernels_limit(tmp_path, fake_gpu, monkeypatch):
    """A row longer than the GPU kernels take (MAX_COLS = 2^31 - 4096 values) is refused up
    front with exit 2 on the GPU path; the NumPy reference on the CPU takes any length."""
    from cukern.plan import MAX_COLS

    path = tmp_path / "long.npy"
    np.lib.format.open_memmap(path, "w+", np.float16, (1, MAX_COLS + 1))  # sparse: no data
    monkeypatch.setattr(_io, "check_outputs", lambda *a, **k: None)  # no 4 GB of disk needed
    out = tmp_path / "y.npy"
    fails("softmax", path, "-o", out, code=2,
          says=f"{path} along axis 1 has rows of {MAX_COLS + 1} values; the GPU kernels take "
               f"at most {MAX_COLS} (2^31 - 4096); --device cpu runs the NumPy reference")
    fails("rms-norm", path, "-o", out, code=2,
          says=f"{path} over the normalized shape {MAX_COLS + 1} has rows of {MAX_COLS + 1} "
               f"values")
    assert not out.exists()
    cli._check_row(0, MAX_COLS, "x.npy")
    cli._check_row("cpu", 2**40, "x.npy")


def test_norm_commands_say_when_the_op_is_missing(tmp_path, norm_files, monkeypatch):
    monkeypatch.delattr(reference, "layer_norm", raising=False)
    fails("layer-norm", norm_files["x"], "-o", tmp_path / "y.npy", "--device", "cpu", code=1,
          says="layer-norm is not available: this cukern has no cukern.reference.layer_norm")


# ------------------------------------------------------------------------------------------
# explain, info, bench, selftest, precompile


def test_explain_without_gpu():
    out = run("explain", "softmax", "--shape", "49152x1000", "--dtype", "float16").stdout
    if cli._gpu_problem() is not None:
        assert "(preset)" in out
    assert out.startswith("softmax float16 rows=49152 cols=1000")
    assert "variant            warp" in out
    a100 = run("explain", "log-softmax", "--shape", "8x200000", "--device", "a100").stdout
    assert "A100" in a100 and "block_uncached" in a100
    strided = run("explain", "softmax", "--shape", "1000,64", "--axis", "0",
                  "--device", "h100").stdout
    assert "strided            True" in strided


def test_explain_errors():
    fails("explain", "softmx", "--shape", "4x4", code=2, says="unknown op 'softmx'")
    fails("explain", "softmax", "--shape", "1x2147483648", code=2,
          says="plan: softmax over rows of 2147483648 columns; at most 2147479552")
    fails("explain", "layer-norm-backward", "--shape", "2x2147479553", "--weight", code=2,
          says="plan: layer_norm_backward over rows of 2147479553 columns; at most 2147479552")
    fails("explain", "softmax", "--shape", "4xq", code=2, says="--shape 4xq")
    fails("explain", "softmax", "--shape", "0x4", code=2, says="is empty")
    fails("explain", "softmax", "--shape", "4x4", "--axis", "2", code=2, says="out of range")
    fails("explain", "softmax", "--shape", "4x4", "--device", "cpu", code=2,
          says="--device cpu")
    fails("explain", "rms-norm", "--shape", "4x4", "--bias", code=2, says="takes no bias")
    fails("explain", "softmax", "--shape", "4x4", "--residual", code=2,
          says="takes no residual")


def test_explain_norm_switches():
    """--weight, --bias, --residual choose the norm's kernel, as the call's arguments do."""
    args = ("explain", "layer-norm", "--shape", "2048x65536", "--dtype", "float16",
            "--device", "h100", "--weight", "--bias")
    plain = run(*args).stdout
    # a lone block of 1024 threads: a cluster of two whose blocks share SMs
    assert "layer_norm_cluster<cukern::f16, 0, 8, 2, true, true, false, false, 3, 1>" in plain
    wide = run("explain", "layer-norm", "--shape", "1024x131072", "--dtype", "float16",
               "--device", "h100", "--weight", "--bias").stdout
    # two rows a pass over a cluster of 8 (Tuning.paired_min_cols in cukern/plan/policy.py)
    assert "layer_norm_cluster<cukern::f16, 0, 8, 8, true, true, false, false, 3, 2>" in wide
    assert "rows_per_pass      2" in wide and "rows_per_pass" not in plain
    # without weight and bias (template switches of the clusters), one row a pass over half
    # the cluster
    bare = run("explain", "layer-norm", "--shape", "1024x131072", "--dtype", "float16",
               "--device", "h100").stdout
    assert "layer_norm_cluster<cukern::f16, 0, 8, 4, false, false, false, false, 3, 1>" in bare
    fused = run(*args, "--residual").stdout
    assert "layer_norm_block_smem<cukern::f16, 0, 8, true, true, true>" in fused
    assert "overlap            each block" in fused and "overlap" not in plain


def test_info_runs_anywhere():
    out = run("info").stdout
    for key in ("cukern", "CuPy", "CUDA runtime", "NVRTC", "kernel cache", "GPU"):
        assert key in out
    assert cukern.__version__ in out


def test_selftest_cpu():
    out = run("selftest", "--device", "cpu").stdout
    assert "FAIL" not in out
    assert "softmax_backward" in out and "reference vs finite diff" in out
    assert "cli chunked" in out and out.strip().endswith("0 failed")


def test_precompile_arch_without_gpu(monkeypatch):
    seen = []

    def check(family, names, arch):
        seen.append((family, list(names), arch))
        return {n: n for n in names}

    from cukern import _compile, _device, registry

    monkeypatch.setattr(_compile, "compile_check", check)
    err = run("precompile", "--arch", "sm_90", "--dtype", "float16", "--op", "softmax,log-softmax",
              "--jobs", "1").stderr
    names = {n for _, ns, _ in seen for n in ns}
    spec = _device.DeviceSpec.h100()
    want = registry.kernel_names(["softmax"], ["float16"], spec)["softmax"] | \
        registry.kernel_names(["log_softmax"], ["float16"], spec)["softmax"]
    assert names == want and {a for _, _, a in seen} == {"sm_90"}
    assert any("cluster" in n for n in names)
    assert f"checked {len(want)} of {len(want)}" in err
    seen.clear()
    run("precompile", "--arch", "sm_80", "--dtype", "float32", "--op", "softmax", "--jobs", "1")
    assert not any("cluster" in n for _, ns, _ in seen for n in ns)  # no clusters before sm_90
    fails("precompile", "--arch", "90", code=2, says="--arch 90: expected a target like sm_80")
    fails("precompile", "--arch", "sm_90", "--op", "conv", code=2, says="--op: unknown conv")


def test_precompile_resources(monkeypatch, tmp_path):
    """--resources prints ptxas's report per instantiation as JSON; --against lists those that
    differ from an earlier report, with the values before and after."""
    import json

    from cukern import _compile

    regs = {}

    def report(family, names, arch):
        return {n: dict(registers=regs.get(n, 40), stack=0, spill_stores=0, spill_loads=0,
                        smem=256) for n in names}

    monkeypatch.setattr(_compile, "kernel_resources", report)
    args = ("precompile", "--arch", "sm_90", "--dtype", "float32", "--op", "softmax", "--jobs",
            "1", "-q", "--resources")
    first = json.loads(run(*args).stdout)
    names = sorted(first["kernels"])
    assert first["arch"] == "sm_90" and len(names) > 2
    assert all(k["registers"] == 40 and k["smem"] == 256 for k in first["kernels"].values())
    before = tmp_path / "before.json"
    before.write_text(json.dumps(first))
    same = run(*args, "--against", str(before))
    assert same.stdout == "" and f"0 of {len(names)} instantiations in both differ" in same.stderr
    regs[names[1]] = 43
    changed = run(*args, "--against", str(before))
    assert changed.stdout.strip() == f"{names[1]}: registers 40 -> 43"
    assert f"1 of {len(names)} instantiations in both differ" in changed.stderr
    fails("precompile", "--resources", code=2, says="--resources: needs --arch sm_XY")
    fails(*args[:-1], "--against", str(before), code=2, says="give --resources too")
    for bad in ("{}", "[1]", '{"kernels": {"k": 1}}', "not json"):
        (tmp_path / "bad.json").write_text(bad)
        fails(*args, "--against", str(tmp_path / "bad.json"), code=2,
              says="not a report of precompile --resources")


@pytest.mark.nvrtc
def test_kernel_resources_reads_ptxas():
    """kernel_resources: ptxas's registers and shared memory at full optimisation, no GPU."""
    from cukern import _compile, registry

    names = sorted(registry.kernel_names(["softmax"], ["float32"],
                                         cukern.DeviceSpec.h100())["softmax"])
    block = [n for n in names if "_block_uncached<" in n][:1]
    res = _compile.kernel_resources("softmax", block, "sm_90")
    assert set(res) == set(block)
    (r,) = res.values()
    assert set(r) == set(_compile.RESOURCES)
    # the block all-reduce's static buffers: two of 32 warps' (max, sum) states of 8 bytes
    assert 16 <= r["registers"] <= 255 and r["smem"] == 2 * 32 * 8


def test_precompile_compiles_for_real():
    """NVRTC without a GPU, in two worker processes: a real compile of one small batch."""
    from cukern import registry

    names = sorted(registry.kernel_names(["softmax"], ["float32"],
                                         cukern.DeviceSpec.h100())["softmax"])
    assert tools._compile_all([("softmax", names[:2]), ("softmax", names[-2:])], "sm_90", None, 2,
                            "test", False) == 4

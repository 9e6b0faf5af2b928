"""``cukern permute`` end to end: on the CPU (``--device cpu``, NumPy's transpose) its help,
``--axes`` parsing and every argument error, every dtype a file holds (bit for bit), both paths
(streamed over the first axis when it stays first, else in one piece) against
``numpy.transpose``, Fortran-order, big-endian, ``.npz`` and empty inputs, atomic outputs and
refusals; both paths' GPU bookkeeping on the NumPy stand-in for CuPy (test_cli's), the refusal
of a whole-array permutation that does not fit on the GPU; and, on a GPU, the real thing."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import cukern
from cukern import registry
from cukern.cli import common as cli
from cukern.cli import permute as permute_mod

from .test_cli import _fake_cupy, _fake_gpu, bf16, digest, fail_on_call, fails, leftovers, run, save

HAS_PERMUTE = hasattr(cukern, "permute")
needs_gpu_permute = pytest.mark.skipif(not HAS_PERMUTE, reason="cukern has no permute yet")

# one dtype a line; every element size (1, 2, 4, 8, 16 bytes), signed, unsigned, bfloat16,
# complex and a big-endian file among them
DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "float16", "bfloat16", "int32", "uint32",
          "float32", "int64", "uint64", "float64", "complex64", "complex128", ">i4", ">f8"]


def dtype_of(name: str) -> np.dtype:
    return bf16() if name == "bfloat16" else np.dtype(name)


def random_array(rng, shape, dtype) -> np.ndarray:
    """Random bytes as ``dtype`` (NaN payloads, -0.0, infinities and subnormals among the
    floats); bool as 0 and 1."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dt == np.bool_:
        return (rng.integers(0, 2, n, dtype=np.uint8) == 1).reshape(shape)
    raw = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def raw(path) -> bytes:
    """An output file's data bytes (bfloat16 comes back as raw V2 records)."""
    return np.ascontiguousarray(np.load(path)).tobytes()


def want(a: np.ndarray, axes=None) -> bytes:
    """numpy.transpose in C order, in native byte order (what the command writes)."""
    t = np.transpose(a, axes)
    return np.ascontiguousarray(t, dtype=t.dtype.newbyteorder("=")).tobytes()


def check(path, a: np.ndarray, axes=None) -> None:
    got = np.load(path)
    t = np.transpose(a, axes)
    assert got.shape == t.shape
    stored = "V2" if a.dtype == bf16() else a.dtype.newbyteorder("=")
    assert got.dtype == np.dtype(stored) and got.flags.c_contiguous
    assert raw(path) == want(a, axes)


# ------------------------------------------------------------------------------------------
# help


def test_help():
    assert "  permute " in run("--help").stdout
    out = run("permute", "--help").stdout
    assert out.startswith("Usage: cukern permute [OPTIONS] IN")
    for opt in ("-o, --output", "--axes", "--device", "--chunk-rows", "--overwrite", "--quiet",
                "--debug", "-h, --help"):
        assert opt in out, opt
    for words in ("numpy.transpose", "0,2,3,1", "NCHW -> NHWC", "0,3,1,2", "bfloat16",
                  "complex128", "chunks of first-axis slices", "refused"):
        assert words in " ".join(out.split()), words


# ------------------------------------------------------------------------------------------
# --axes


@pytest.mark.parametrize("text,shape,axes", [
    ("0,2,3,1", (2, 3, 4, 5), (0, 2, 3, 1)),
    ("0, 2, 3, 1", (2, 3, 4, 5), (0, 2, 3, 1)),
    ("0 3 1 2", (2, 3, 4, 5), (0, 3, 1, 2)),
    ("-1,0", (2, 3), (1, 0)),
    ("0,-1,-3,-2", (2, 3, 4, 5), (0, 3, 1, 2)),
    ("0", (7,), (0,)),
    ("", (), ()),
    (None, (2, 3, 4), (2, 1, 0)),
    (None, (), ()),
    ("7,6,5,4,3,2,1,0", (1,) * 8, tuple(range(7, -1, -1))),
])
def test_parse_axes(text, shape, axes):
    assert permute_mod.parse_axes(text, shape, "x.npy") == axes


@pytest.mark.parametrize("text,says", [
    ("0,2,3", "--axes 0,2,3 names 3 axes; x.npy has 4 dimensions (shape 2x3x4x5), so it needs 4"),
    ("0,1,2,3,4", "--axes 0,1,2,3,4 names 5 axes"),
    ("0,2,3,3", "--axes 0,2,3,3 repeats axis 3; expected each of 0..3 once"),
    ("0,-1,3,1", "--axes 0,-1,3,1 repeats axis 3"),
    ("0,2,4,1", "--axes 0,2,4,1: axis 4 is out of range for x.npy, which has 4 dimensions"),
    ("0,2,-5,1", "axis -5 is out of range"),
    ("0,2,x,1", "--axes 0,2,x,1: expected IN's axes in their new order, comma-separated, like "
                "0,2,3,1"),
    ("0.5,1,2,3", "--axes 0.5,1,2,3: expected"),
    ("", "--axes  names 0 axes; x.npy has 4 dimensions"),
])
def test_parse_axes_errors(text, says):
    from cukern._io import InputError

    with pytest.raises(InputError) as err:
        permute_mod.parse_axes(text, (2, 3, 4, 5), "x.npy")
    assert says in str(err.value)


def test_axes_errors_from_the_command(tmp_path, rng):
    x = save(tmp_path / "x.npy", random_array(rng, (2, 3, 4, 5), np.float32))
    one = save(tmp_path / "one.npy", random_array(rng, (6,), np.int8))
    out = tmp_path / "y.npy"
    for args, says in (
        ([x, "--axes", "0,2,3"], "--axes 0,2,3 names 3 axes; "),
        ([x, "--axes", "0,2,3,3"], "--axes 0,2,3,3 repeats axis 3"),
        ([x, "--axes", "0,2,9,1"], "--axes 0,2,9,1: axis 9 is out of range for"),
        ([x, "--axes", "a,b,c,d"], "--axes a,b,c,d: expected IN's axes"),
        ([one, "--axes", "1,0"], "--axes 1,0 names 2 axes; "),
        ([one, "--axes", "1"], "--axes 1: axis 1 is out of range"),
    ):
        fails("permute", *args, "-o", out, "--device", "cpu", code=2, says=says)
    assert not out.exists() and leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------------
# Every dtype, both paths, against numpy.transpose


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axes,rows", [("0,2,3,1", None), ("0,2,3,1", "1"), ("0,3,1,2", "2"),
                                       ("2,0,3,1", None), ("3,2,1,0", "1")])
def test_every_dtype_matches_numpy(tmp_path, rng, dtype, axes, rows):
    """Bit for bit: NaN payloads and -0.0 survive. Axis 0 first streams in chunks of ``rows``
    first-axis slices; other orders run in one piece (``--chunk-rows`` has no effect)."""
    a = random_array(rng, (5, 3, 4, 7), dtype_of(dtype))
    x = save(tmp_path / "x.npy", a)
    out = tmp_path / "y.npy"
    extra = [] if rows is None else ["--chunk-rows", rows]
    run("permute", x, "-o", out, "--axes", axes, "--device", "cpu", "-q", *extra)
    check(out, a, tuple(int(v) for v in axes.split(",")))


@pytest.mark.parametrize("shape,axes", [
    ((), ""), ((), None), ((9,), "0"), ((9,), None), ((1,), "0"), ((4, 6), None),
    ((4, 6), "0,1"), ((2, 1, 3, 1, 2), "0,4,3,2,1"), ((3, 2, 2, 1, 2, 3, 1, 2), "0,7,6,1,5,4,3,2"),
    ((3, 2, 2, 1, 2, 3, 1, 2), "5,2,0,7,3,1,6,4"), ((6, 5, 4), "-3,-1,-2"),
])
@pytest.mark.parametrize("rows", [None, "1", "4"])
def test_shapes_and_default_axes(tmp_path, rng, shape, axes, rows):
    a = random_array(rng, shape, np.float32)
    x = save(tmp_path / "x.npy", a)
    out = tmp_path / "y.npy"
    extra = [] if rows is None else ["--chunk-rows", rows]
    extra += [] if axes is None else ["--axes", axes]
    run("permute", x, "-o", out, "--device", "cpu", *extra)
    order = None if axes is None else tuple(int(v) for v in axes.split(",") if v)
    check(out, a, order)


@pytest.mark.parametrize("shape,axes", [((0, 3, 5), "0,2,1"), ((0, 3, 5), "2,0,1"),
                                        ((3, 0, 5), "0,2,1"), ((3, 0, 5), "1,2,0"),
                                        ((4, 5, 0), "0,2,1"), ((0,), "0")])
def test_empty_arrays(tmp_path, shape, axes):
    x = save(tmp_path / "x.npy", np.zeros(shape, np.int16))
    out = tmp_path / "y.npy"
    run("permute", x, "-o", out, "--axes", axes, "--device", "cpu")
    order = tuple(int(v) for v in axes.split(","))
    got = np.load(out)
    assert got.shape == tuple(shape[a] for a in order) and got.dtype == np.int16
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("axes", ["0,1,2", "2,1,0", "0,2,1", "1,0,2", "2,0,1"])
@pytest.mark.parametrize("rows", [None, "2"])
def test_fortran_order_input(tmp_path, rng, axes, rows):
    """A Fortran-order file is the C-order array of the reversed shape; the axes are composed
    (so "2,1,0" of a Fortran file streams, and "0,1,2" runs in one piece)."""
    a = np.asfortranarray(random_array(rng, (5, 6, 7), np.uint16))
    x = save(tmp_path / "f.npy", a)
    out = tmp_path / "y.npy"
    extra = [] if rows is None else ["--chunk-rows", rows]
    run("permute", x, "-o", out, "--axes", axes, "--device", "cpu", *extra)
    check(out, a, tuple(int(v) for v in axes.split(",")))


def test_npz_members(tmp_path, rng):
    a = random_array(rng, (4, 5, 6), np.complex64)
    np.savez(tmp_path / "s.npz", acts=a, other=np.ones(3))
    np.savez_compressed(tmp_path / "c.npz", acts=a)
    for spec in (f"{tmp_path}/s.npz:acts", f"{tmp_path}/c.npz:acts", f"{tmp_path}/c.npz"):
        for axes in ("0,2,1", "1,2,0"):
            out = tmp_path / "y.npy"
            run("permute", spec, "-o", out, "--axes", axes, "--device", "cpu", "--overwrite",
                "--chunk-rows", "3")
            check(out, a, tuple(int(v) for v in axes.split(",")))


def test_bfloat16_round_trip(tmp_path, rng):
    """A bfloat16 file (raw V2 records) comes back as bfloat16 records, NaN payloads kept."""
    a = random_array(rng, (3, 8, 5), bf16())
    a.reshape(-1).view(np.uint16)[:4] = (0x7FC1, 0xFF81, 0x8000, 0x7F80)  # NaNs, -0.0, inf
    x = save(tmp_path / "x.npy", a)
    assert np.load(x).dtype == np.dtype("V2")
    run("permute", x, "-o", tmp_path / "y.npy", "--axes", "0,2,1", "--device", "cpu")
    run("permute", tmp_path / "y.npy", "-o", tmp_path / "z.npy", "--axes", "0,2,1",
        "--device", "cpu")
    check(tmp_path / "y.npy", a, (0, 2, 1))
    assert raw(tmp_path / "z.npy") == a.tobytes()


# ------------------------------------------------------------------------------------------
# Refusals, atomic outputs


def test_unsupported_dtypes(tmp_path):
    d = tmp_path
    np.save(d / "str.npy", np.array([["a", "b"]]))
    np.save(d / "obj.npy", np.array([[1, "a"]], dtype=object), allow_pickle=True)
    np.save(d / "date.npy", np.zeros((2, 2), "datetime64[s]"))
    np.save(d / "rec.npy", np.zeros((2, 2), [("a", "<i4"), ("b", "<f4")]))
    np.save(d / "v4.npy", np.zeros((2, 2), "V4"))
    cases = [("str.npy", "has dtype <U1; expected bool, int8..int64, uint8..uint64, float16, "
                         "bfloat16, float32, float64, complex64 or complex128"),
             ("obj.npy", "has Python objects (dtype object)"),
             ("date.npy", "has dtype datetime64[s]"),
             ("rec.npy", "has dtype"), ("v4.npy", "has dtype |V4")]
    if np.dtype(np.longdouble).itemsize > 8:
        np.save(d / "ld.npy", np.zeros((2, 2), np.longdouble))
        cases.append(("ld.npy", "has dtype float"))
    for name, says in cases:
        fails("permute", d / name, "-o", d / "y.npy", "--device", "cpu", code=2, says=says)
    assert not (d / "y.npy").exists() and leftovers(d) == []


def test_input_is_never_overwritten(tmp_path, rng):
    a = random_array(rng, (4, 5), np.float32)
    x = save(tmp_path / "x.npy", a)
    before = digest(x)
    link = tmp_path / "link.npy"
    link.symlink_to(x)
    hard = tmp_path / "hard.npy"
    os.link(x, hard)
    for out in (x, f"{tmp_path}/./x.npy", link, hard):
        for flags in ([], ["--overwrite"]):
            for axes in ("1,0", "0,1"):
                fails("permute", x, "-o", out, "--axes", axes, "--device", "cpu", *flags,
                      code=2, says="is an input file; cukern never writes over its inputs")
    np.savez(tmp_path / "s.npz", a=a)
    fails("permute", f"{tmp_path}/s.npz:a", "-o", tmp_path / "s.npz", "--overwrite",
          "--device", "cpu", code=2, says="must be a .npy file")
    assert digest(x) == before and leftovers(tmp_path) == []


def test_existing_output_needs_overwrite(tmp_path, rng):
    a = random_array(rng, (4, 5, 6), np.int32)
    x = save(tmp_path / "x.npy", a)
    out = tmp_path / "y.npy"
    run("permute", x, "-o", out, "--axes", "0,2,1", "--device", "cpu")
    old = digest(out)
    fails("permute", x, "-o", out, "--axes", "2,1,0", "--device", "cpu", code=2,
          says=f"-o {out} exists; pass --overwrite")
    assert digest(out) == old
    run("permute", x, "-o", out, "--axes", "2,1,0", "--device", "cpu", "--overwrite")
    check(out, a, (2, 1, 0))


def test_file_errors(tmp_path, rng):
    d = tmp_path
    x = save(d / "x.npy", random_array(rng, (4, 5), np.float32))
    (d / "notes.txt").write_text("hello\n")
    os.mkdir(d / "folder.npy")
    for args, says in (
        ([d / "missing.npy", "-o", d / "y.npy"], "missing.npy: no such file"),
        ([d / "notes.txt", "-o", d / "y.npy"], "notes.txt is not an .npy or .npz file"),
        ([x, "-o", d / "y.txt"], f"-o {d / 'y.txt'}: the output must be a .npy file"),
        ([x, "-o", d / "nowhere" / "y.npy"], "does not exist"),
        ([x, "-o", d / "folder.npy", "--overwrite"], "is a directory"),
    ):
        fails("permute", *args, "--device", "cpu", code=2, says=says)
    fails("permute", x, "-o", d / "y.npy", "--device", "tpu", code=2,
          says="--device tpu: expected gpu, gpu:N or cpu")
    assert leftovers(d) == [] and not (d / "y.npy").exists()


def _fail_on_call(monkeypatch, n: int, exc: BaseException):
    """Make the CPU path's permutation raise ``exc`` on its n-th call (the n-th chunk)."""
    return fail_on_call(monkeypatch, n, exc, permute_mod, "_host_permute")


@pytest.mark.parametrize("axes,n", [("0,2,1", 3), ("2,0,1", 1)])
def test_failure_leaves_nothing(tmp_path, rng, monkeypatch, axes, n):
    """A failure in the third chunk (streamed) or in the one piece leaves no output and no
    temporary file, keeps an existing output as it was and never touches the input."""
    x = save(tmp_path / "x.npy", random_array(rng, (9, 4, 5), np.float64))
    before = digest(x)
    calls = _fail_on_call(monkeypatch, n, RuntimeError("injected failure"))
    out = tmp_path / "y.npy"
    fails("permute", x, "-o", out, "--axes", axes, "--device", "cpu", "--chunk-rows", "2",
          code=1, says="RuntimeError: injected failure")
    assert len(calls) == n and not out.exists() and leftovers(tmp_path) == []
    out.write_bytes(b"old")
    calls.clear()
    fails("permute", x, "-o", out, "--axes", axes, "--device", "cpu", "--chunk-rows", "2",
          "--overwrite", code=1, says="injected failure")
    assert out.read_bytes() == b"old" and leftovers(tmp_path) == [] and digest(x) == before


def test_interrupt_leaves_nothing(tmp_path, rng, monkeypatch):
    x = save(tmp_path / "x.npy", random_array(rng, (9, 4, 5), np.int8))
    _fail_on_call(monkeypatch, 2, KeyboardInterrupt())
    out = tmp_path / "y.npy"
    result = run("permute", x, "-o", out, "--axes", "0,2,1", "--device", "cpu",
                 "--chunk-rows", "2", code=130)
    assert "Aborted" in result.stderr
    assert not out.exists() and leftovers(tmp_path) == []


def test_no_gpu(tmp_path, rng, monkeypatch):
    x = save(tmp_path / "x.npy", random_array(rng, (4, 5), np.float32))
    monkeypatch.setattr(cli, "_gpu_problem", lambda dev=0: "no CUDA GPU visible (test)")
    fails("permute", x, "-o", tmp_path / "y.npy", "--axes", "1,0", code=1,
          says="no CUDA GPU visible (test); --device cpu runs the NumPy reference instead")
    assert not (tmp_path / "y.npy").exists()


def test_says_when_the_op_is_missing(tmp_path, rng, monkeypatch):
    x = save(tmp_path / "x.npy", random_array(rng, (4, 5), np.float32))
    monkeypatch.setattr(cli, "_gpu_problem", lambda dev=0: None)
    monkeypatch.delattr(cukern, "permute", raising=False)
    fails("permute", x, "-o", tmp_path / "y.npy", code=1,
          says="permute is not available: this cukern has no cukern.permute")
    assert leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------------
# The GPU code paths on the NumPy stand-in for CuPy: the streamed path's tiles and slots, the
# whole-array path's pieces up and down, the memory checks


@pytest.fixture
def fake_gpu(monkeypatch):
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(cli, "_require", lambda device, name, command: np.transpose)


@pytest.mark.parametrize("dtype", ["bool", "int8", "float16", "bfloat16", "float32",
                                   "complex64", "complex128", ">i2"])
@pytest.mark.parametrize("axes,rows", [("0,2,3,1", None), ("0,2,3,1", "3"), ("0,3,1,2", "1"),
                                       ("1,0,3,2", None), ("3,2,1,0", None)])
def test_gpu_paths_bookkeeping(tmp_path, rng, fake_gpu, monkeypatch, dtype, axes, rows):
    monkeypatch.setattr(permute_mod, "PIECE_BYTES", 100)  # many pieces up and down
    a = random_array(rng, (7, 3, 5, 4), dtype_of(dtype))
    x = save(tmp_path / "x.npy", a)
    out = tmp_path / "y.npy"
    extra = [] if rows is None else ["--chunk-rows", rows]
    run("permute", x, "-o", out, "--axes", axes, *extra)
    check(out, a, tuple(int(v) for v in axes.split(",")))


def test_gpu_path_zero_d_and_empty(tmp_path, rng, fake_gpu):
    for shape, axes in (((), ""), ((0, 4), "1,0"), ((4, 0), "0,1"), ((5,), "0")):
        a = random_array(rng, shape, np.float32)
        x = save(tmp_path / "x.npy", a)
        out = tmp_path / "y.npy"
        run("permute", x, "-o", out, "--axes", axes, "--overwrite")
        check(out, a, tuple(int(v) for v in axes.split(",") if v))


def test_whole_array_refused_when_it_does_not_fit(tmp_path, rng, monkeypatch):
    """Axis 0 moves: input and output must fit on the GPU at once, else a one-line refusal
    (exit 1) before any output is written. Axis 0 first streams whatever the free memory."""
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(cli, "_require", lambda device, name, command: np.transpose)
    a = random_array(rng, (64, 32, 16), np.float32)  # 128 KiB
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(free=200_000))
    x = save(tmp_path / "x.npy", a)
    out = tmp_path / "y.npy"
    line = fails("permute", x, "-o", out, "--axes", "2,0,1", code=1, says="does not fit on GPU 0")
    for words in ("64x32x16", "--axes 2,0,1 moves axis 0", "at once (262.1 KB; 200.0 KB free)",
                  "keep axis 0 first (0,...) stream"):
        assert words in line, (words, line)
    fails("permute", x, "-o", out, code=1, says="the default order (reversed) moves axis 0")
    assert not out.exists() and leftovers(tmp_path) == []
    run("permute", x, "-o", out, "--axes", "0,2,1")  # streams in chunks that fit
    check(out, a, (0, 2, 1))


def test_out_of_gpu_memory_in_one_piece(tmp_path, rng, fake_gpu, monkeypatch):
    class OutOfMemoryError(Exception):
        pass

    def oom(x, axes):
        raise OutOfMemoryError("out of memory allocating 1,024 bytes")

    monkeypatch.setattr(cli, "_require", lambda device, name, command: oom)
    x = save(tmp_path / "x.npy", random_array(rng, (4, 5, 6), np.int16))
    out = tmp_path / "y.npy"
    fails("permute", x, "-o", out, "--axes", "2,1,0", code=1,
          says=f"out of GPU memory permuting {x} (240 bytes) in one piece")
    assert not out.exists() and leftovers(tmp_path) == []


def test_streamed_slice_that_does_not_fit_is_refused(tmp_path, rng, monkeypatch):
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(cli, "_require", lambda device, name, command: np.transpose)
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(free=10_000))
    x = save(tmp_path / "x.npy", random_array(rng, (3, 64, 64), np.float32))
    out = tmp_path / "y.npy"
    fails("permute", x, "-o", out, "--axes", "0,2,1", code=1,
          says=f"one slice {x}[i] of the first axis (64x64, 16.4 KB) and its permutation do "
               f"not fit in GPU memory")
    assert not out.exists() and leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------------
# On a GPU


@pytest.mark.gpu
@needs_gpu_permute
@pytest.mark.parametrize("dtype", ["bool", "int8", "float16", "bfloat16", "float32", "int64",
                                   "complex64", "complex128"])
@pytest.mark.parametrize("shape,axes", [((16, 3, 40, 40), "0,2,3,1"), ((16, 40, 40, 3), "0,3,1,2"),
                                        ((6, 64, 7, 7), "0,2,3,1"), ((5, 7, 9, 11), "0,3,1,2"),
                                        ((4, 6, 3, 5, 7), "0,2,3,4,1"),
                                        ((5, 7, 9, 11), "2,0,3,1"), ((300, 257), "1,0"),
                                        ((3, 5, 7, 9), "3,2,1,0")])
def test_gpu_streamed_and_whole(tmp_path, rng, dtype, shape, axes):
    """Streamed (axis 0 first; one piece and chunks of 1 and 4 slices) and whole-array orders:
    each file equal, bit for bit, to numpy.transpose and to cukern.permute called directly."""
    import cupy as cp

    a = random_array(rng, shape, dtype_of(dtype))
    x = save(tmp_path / "x.npy", a)
    order = tuple(int(v) for v in axes.split(","))
    outs = []
    for tag, extra in (("one", []), ("c1", ["--chunk-rows", "1"]), ("c4", ["--chunk-rows", "4"])):
        out = tmp_path / f"{tag}.npy"
        run("permute", x, "-o", out, "--axes", axes, *extra)
        check(out, a, order)
        outs.append(raw(out))
    direct = cp.asnumpy(cukern.permute(cp.asarray(a), order))
    assert outs[0] == outs[1] == outs[2] == direct.tobytes()


@pytest.mark.gpu
@needs_gpu_permute
def test_gpu_file_of_many_automatic_chunks(tmp_path, rng):
    """600 MB of int8 NCHW -> NHWC: more than one automatic chunk (256 MiB of pinned memory a
    slot); then an order that moves axis 0, in one piece of ten 64 MiB pieces each way."""
    a = random_array(rng, (12, 3, 4096, 4096), np.int8)
    x = save(tmp_path / "x.npy", a)
    out = tmp_path / "y.npy"
    run("permute", x, "-o", out, "--axes", "0,2,3,1")
    assert raw(out) == want(a, (0, 2, 3, 1))
    whole = tmp_path / "z.npy"
    run("permute", out, "-o", whole, "--axes", "3,0,1,2")  # (C, N, H, W)
    assert raw(whole) == want(a, (1, 0, 2, 3))


@pytest.mark.gpu
@needs_gpu_permute
def test_gpu_whole_array_refused_when_too_large(tmp_path, rng, monkeypatch):
    x = save(tmp_path / "x.npy", random_array(rng, (64, 3, 32, 32), np.float16))
    monkeypatch.setattr(permute_mod, "GPU_FIT", 1e-9)  # as if the GPU were nearly full
    out = tmp_path / "y.npy"
    fails("permute", x, "-o", out, "--axes", "2,0,1,3", code=1, says="does not fit on GPU 0")
    assert not out.exists() and leftovers(tmp_path) == []
    run("permute", x, "-o", out, "--axes", "0,2,3,1")  # streamed: not limited by GPU_FIT


@pytest.mark.gpu
@needs_gpu_permute
@pytest.mark.parametrize("axes,n", [("0,2,1", 3), ("2,0,1", 1)])
def test_gpu_failure_leaves_nothing(tmp_path, rng, monkeypatch, axes, n):
    x = save(tmp_path / "x.npy", random_array(rng, (40, 30, 20), np.float32))
    before = digest(x)
    real = cukern.permute
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("injected on the GPU")
        return real(*args, **kwargs)

    monkeypatch.setattr(cukern, "permute", flaky)
    out = tmp_path / "y.npy"
    fails("permute", x, "-o", out, "--axes", axes, "--chunk-rows", "5", code=1,
          says="injected on the GPU")
    assert not out.exists() and leftovers(tmp_path) == [] and digest(x) == before


# ------------------------------------------------------------------------------------------
# explain


def test_explain_axes_belong_to_permute():
    fails("explain", "softmax", "--shape", "4x5", "--axes", "1,0", code=2,
          says="--axes is permute's; softmax takes --axis")


@pytest.mark.skipif("permute" not in registry.OPS,
                    reason="the registry has no permute yet")
def test_explain_permute():
    out = run("explain", "permute", "--shape", "64x3x224x224", "--dtype", "int8", "--axes",
              "0,2,3,1", "--device", "h100").stdout
    assert out.startswith("permute") and "kernel" in out and "H100" in out
    assert "permute" in run("explain", "permute", "--shape", "8x9", "--device", "h100").stdout
    fails("explain", "permute", "--shape", "4x5x6", "--axes", "0,2", "--device", "h100",
          code=2, says="--axes 0,2 names 2 axes; --shape 4x5x6 has 3 dimensions")
    fails("explain", "permute", "--shape", "4x5x6", "--axes", "0,2,2", code=2,
          says="repeats axis 2")
    fails("explain", "permute", "--shape", "4x5x6", "--relu", "--weight", code=2,
          says="--weight, --relu: not permute's options; it takes --axes")

"""The pre-Ampere fallbacks (kernels/types.cuh, memory.cuh: CUKERN_FALLBACKS) on a newer GPU,
forced with -DCUKERN_FORCE_FALLBACKS, against the normal build bit for bit: the bfloat16
conversion over every float32 bit pattern, max.NaN over pairs of special values, and, in a
subprocess per build (CUKERN_FORCE_FALLBACKS=1 or unset), softmax on rows with NaN, +-0, +-inf
and the norms' block, cluster and backward kernels (their cp.async row caches)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cukern import _compile

from .conftest import TOL

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent

# Test kernels beside the library's own helpers (types.cuh, through softmax.cuh's includes).
PROBES = r"""
extern "C" __global__ void probe_range_to_bf16(unsigned base, unsigned n, unsigned short* out) {
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = cukern::Num<cukern::bf16>::from(__uint_as_float(base + i)).bits;
  }
}
extern "C" __global__ void probe_to_bf16(const unsigned* in, unsigned n, unsigned short* out) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = cukern::Num<cukern::bf16>::from(__uint_as_float(in[i])).bits;
}
extern "C" __global__ void probe_max(const unsigned* a, const unsigned* b, unsigned n,
                                     unsigned* m, unsigned* mc) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    const float x = __uint_as_float(a[i]), y = __uint_as_float(b[i]);
    m[i] = __float_as_uint(cukern::max_nan(x, y));
    mc[i] = __float_as_uint(cukern::max_nan_commutative(x, y));
  }
}
"""


def _probes(forced: bool) -> dict:
    """The probe kernels built as the library's kernels are (CuPy adds -ftz=true to both)."""
    module = cp.RawModule(code=_compile.source("softmax") + PROBES,
                          options=_compile.nvrtc_options(forced))
    return {n: module.get_function(n) for n in ("probe_range_to_bf16", "probe_to_bf16",
                                                 "probe_max")}


def _launch(kern, n, *args):
    kern((-(-n // 256),), (256,), (*args,))


def test_bf16_conversion_every_float32_bit_for_bit():
    normal, forced = _probes(False), _probes(True)
    n = 1 << 28
    a, b = cp.empty(n, cp.uint16), cp.empty(n, cp.uint16)
    for chunk in range(16):
        base = chunk * n
        a.fill(0x5555)
        b.fill(0xAAAA)  # poisoned apart: an element left unwritten differs
        for probes, out in ((normal, a), (forced, b)):
            probes["probe_range_to_bf16"]((8192,), (256,), (np.uint32(base), np.uint32(n), out))
        bad = cp.flatnonzero(a != b)
        if bad.size:
            pairs = [(hex(base + int(j)), hex(int(a[j])), hex(int(b[j])))
                     for j in cp.asnumpy(bad[:8])]
            pytest.fail(f"{int(bad.size)} float32 patterns from 0x{base:08x} convert "
                        f"differently (input, cvt.rn.bf16.f32, fallback): {pairs}")


def test_bf16_fallback_rounds_to_nearest_even(rng):
    from ml_dtypes import bfloat16

    ties = [0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7F8000, 0x7F7F7FFF, 0x7F7FFFFF,
            0x00008000, 0x00018000, 0x80000001, 0x807F8000, 0x7F800000, 0xFF800000, 0,
            0x80000000, 0x7F800001, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000]
    bits = np.concatenate([rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32),
                           np.array(ties, np.uint32)])
    out = cp.full(bits.size, 0x5555, cp.uint16)
    _launch(_probes(True)["probe_to_bf16"], bits.size, cp.asarray(bits), np.uint32(bits.size),
            out)
    got = cp.asnumpy(out)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    with np.errstate(invalid="ignore"):  # NaN (ml_dtypes keeps their payloads: not compared)
        ref = bits.view(np.float32).astype(bfloat16).view(np.uint16)
    np.testing.assert_array_equal(got[~nan], ref[~nan])
    assert np.all(got[nan] == 0x7FFF), "NaN: the canonical NaN"


def test_max_nan_bit_for_bit(rng):
    special = np.array([0, 0x80000000, 0x3F800000, 0xBF800000, 0x7F800000, 0xFF800000,
                        0x7FFFFFFF, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x00000001,
                        0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,
                        0x3F800001, 0x40490FDB], np.uint32)
    a = np.concatenate([np.repeat(special, special.size), rng.integers(0, 2**32, 1 << 20,
                                                                       dtype=np.uint64)])
    b = np.concatenate([np.tile(special, special.size), rng.integers(0, 2**32, 1 << 20,
                                                                     dtype=np.uint64)])
    a, b = a.astype(np.uint32), b.astype(np.uint32)
    n = a.size
    results = {}
    for forced in (False, True):
        m, mc = cp.full(n, 0x12345678, cp.uint32), cp.full(n, 0x12345678, cp.uint32)
        _launch(_probes(forced)["probe_max"], n, cp.asarray(a), cp.asarray(b), np.uint32(n),
                m, mc)
        results[forced] = (cp.asnumpy(m), cp.asnumpy(mc))
    for k, what in enumerate(("max_nan", "max_nan_commutative")):
        hw, fb = results[False][k], results[True][k]
        bad = np.flatnonzero(hw != fb)
        assert not bad.size, (what, [(hex(a[i]), hex(b[i]), hex(hw[i]), hex(fb[i]))
                                     for i in bad[:8]])
    # what they agree on: NaN wins as the canonical NaN, max(+0, -0) = +0, else the larger
    fa, fb_, got = a.view(np.float32), b.view(np.float32), results[True][0]
    either_nan = np.isnan(fa) | np.isnan(fb_)
    assert np.all(got[either_nan] == 0x7FFFFFFF)
    zeros = (fa == 0) & (fb_ == 0)
    assert np.all(got[zeros] == (a[zeros] & b[zeros]))
    rest = ~either_nan & ~zeros
    np.testing.assert_array_equal(got[rest].view(np.float32), np.maximum(fa[rest], fb_[rest]))


# ---------------------------------------------------------------------------------------------
# The ops, one process a build (the environment variable is read when a kernel is built).

SCRIPT = r"""
import sys
import numpy as np
import cupy as cp
import cukern
from cukern import _compile

assert _compile.fallbacks_forced() == (sys.argv[3] == "1"), _compile.nvrtc_options()
inputs = dict(np.load(sys.argv[1]))
outs = {}


def arr(key):
    raw = inputs[key]
    if key.endswith(":bfloat16"):
        from ml_dtypes import bfloat16
        raw = raw.view(bfloat16)
    return cp.asarray(raw)


def keep(name, got):
    got = got if isinstance(got, (tuple, list)) else (got,)
    for i, g in enumerate(got):
        if g is not None:
            h = cp.asnumpy(g)
            outs[f"{name}#{i}"] = h.view(f"u{h.dtype.itemsize}")


for key in inputs:
    op, shape, dtype = key.split(":")
    if op != "x":
        continue
    x = arr(key)
    tag = f"{shape}:{dtype}"
    n = x.shape[-1]
    keep(f"softmax {tag}", cukern.softmax(x))
    keep(f"log_softmax {tag}", cukern.log_softmax(x))
    y = cukern.softmax(x)
    dy = arr(f"dy:{shape}:{dtype}")
    keep(f"softmax_backward {tag}", cukern.softmax_backward(y=y, dy=dy))
    w, b = arr(f"w:{shape}:{dtype}"), arr(f"b:{shape}:{dtype}")
    # the norms on rows without infinities (their NaN rows stay)
    xn = arr(f"xn:{shape}:{dtype}")
    ln = cukern.layer_norm(xn, n, w, b, 1e-5, return_stats=True)
    keep(f"layer_norm {tag}", ln)
    keep(f"layer_norm plain {tag}", cukern.layer_norm(xn, n, return_stats=True))
    keep(f"layer_norm residual {tag}", cukern.layer_norm(xn, n, w, b, 1e-5, residual=dy,
                                                          return_stats=True))
    rn = cukern.rms_norm(xn, n, w, 1e-6, return_stats=True)
    keep(f"rms_norm {tag}", rn)
    keep(f"layer_norm_backward {tag}", cukern.layer_norm_backward(dy, xn, ln[1], ln[2], w))
    keep(f"layer_norm_backward plain {tag}", cukern.layer_norm_backward(dy, xn, ln[1], ln[2]))
    keep(f"rms_norm_backward {tag}", cukern.rms_norm_backward(dy, xn, rn[1], w))
np.savez(sys.argv[2], **outs)
"""

# warp (100), block with a row cache (4096), block or cluster (70000), cluster or uncached
# (262144) on an H100. A cold kernel cache compiles some 200 kernels a build, one after another
SHAPES = [(64, 100), (64, 4096), (8, 70000), (8, 262144)]
FB_DTYPES = ["float16", "bfloat16", "float32", "float64"]


def _np_dtype(name):
    if name == "bfloat16":
        from ml_dtypes import bfloat16

        return np.dtype(bfloat16)
    return np.dtype(name)


def _inputs(rng) -> dict:
    """x with special rows (NaN; all -inf; +inf; only +0 and -0; -inf among finite values; a
    huge value), xn (finite but its NaN row) and dy, w, b, by op:shape:dtype; 16-bit values as
    their bits."""
    out = {}
    for shape in SHAPES:
        rows, cols = shape
        for dt in FB_DTYPES:
            big = {"float16": 6e4, "bfloat16": 3e38, "float32": 3e38, "float64": 1e300}[dt]
            x = rng.standard_normal(shape) * 3 + 0.5
            x[1, rng.integers(cols)] = np.nan
            x[2] = -np.inf
            x[3, rng.integers(cols)] = np.inf
            x[4] = np.where(rng.random(cols) < 0.5, 0.0, -0.0)
            x[5, rng.integers(0, cols, max(1, cols // 3))] = -np.inf
            x[6, rng.integers(cols)] = big
            x[7, :] = -0.0
            x[7, rng.integers(cols)] = 0.0
            xn = rng.standard_normal(shape) * 2 + 1
            xn[1, rng.integers(cols)] = np.nan
            xn[2] = 0.0
            xn[3] = 1e4 + rng.standard_normal(cols) * (1e-2 if dt != "float16" else 1.0)
            parts = {"x": x, "xn": xn, "dy": rng.standard_normal(shape),
                     "w": rng.standard_normal(cols) * 0.5 + 1, "b": rng.standard_normal(cols)}
            for name, v in parts.items():
                v = v.astype(_np_dtype(dt))
                out[f"{name}:{rows}x{cols}:{dt}"] = v.view(np.uint16) if dt == "bfloat16" else v
    return out


def _run(tmp_path: Path, inputs: Path, forced: bool) -> dict:
    out = tmp_path / f"out_{int(forced)}.npz"
    script = tmp_path / "run_ops.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    env.pop("CUKERN_FORCE_FALLBACKS", None)
    if forced:
        env["CUKERN_FORCE_FALLBACKS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), str(inputs), str(out), str(int(forced))],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(np.load(out))


def _isnan(bits: np.ndarray, dt: str) -> np.ndarray:
    """NaN where the unsigned bit patterns ``bits`` of dtype ``dt`` hold one."""
    return np.isnan(bits.view(_np_dtype(dt)).astype(np.float64)).ravel()


def _ulps(a: np.ndarray, b: np.ndarray, dt: str) -> np.ndarray:
    """|a - b| in units in the last place, elementwise, for the unsigned bit patterns of two
    arrays of dtype ``dt``, through the ordered integer images of the bits (NaNs count as 0
    apart: their agreement is checked separately)."""
    ints = {2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]

    def ordered(v):
        i = v.ravel().view(ints).astype(np.int64)
        return np.where(i < 0, np.iinfo(ints).min - i, i)

    d = np.abs(ordered(a) - ordered(b))
    return np.where(_isnan(a, dt) & _isnan(b, dt), 0, d)


def test_ops_with_forced_fallbacks_match_bit_for_bit(tmp_path, rng):
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, **_inputs(rng))
    normal = _run(tmp_path, inputs, False)
    forced = _run(tmp_path, inputs, True)
    assert normal.keys() == forced.keys() and len(normal) > 250, len(normal)
    differ = []
    for key, ref in normal.items():
        got = forced[key]
        assert got.shape == ref.shape and got.dtype == ref.dtype, key
        dt = key.split(":")[-1].split("#")[0]
        if key.startswith(("layer_norm", "rms_norm")) and dt in TOL:
            # the norms' cp.async fallback changes the code around their loads, and NVVM may
            # then contract a multiply-add differently (a rounding apart, more where dx cancels):
            # the same NaNs and a relative error a quarter of the float64 tolerance; bit for bit
            # elsewhere (outputs come back as their bits: unsigned integers of the element size)
            assert np.array_equal(_isnan(got, dt), _isnan(ref, dt)), key
            g, r = (v.view(_np_dtype(dt)).astype(np.float64).ravel() for v in (got, ref))
            ok = ~np.isnan(r)
            err = np.linalg.norm(g[ok] - r[ok]) / max(np.linalg.norm(r[ok]), 1e-300)
            bad = np.flatnonzero(_ulps(got, ref, dt) > 0) if err > TOL[dt] / 4 else np.empty(0, int)
        else:
            bad = np.flatnonzero(got.ravel() != ref.ravel())
        if bad.size:
            differ.append(f"{key}: {bad.size} of {ref.size} differ (first at {bad[0]}: "
                          f"{hex(ref.ravel()[bad[0]])} vs {hex(got.ravel()[bad[0]])})")
    assert not differ, "\n".join(differ[:20])
    # the special rows came through: softmax's NaN row is NaN, its all -inf row too
    y = normal["softmax 64x4096:float32#0"].view(np.float32)
    assert np.isnan(y[1]).all() and np.isnan(y[2]).all() and not np.isnan(y[0]).any()

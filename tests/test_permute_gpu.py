"""cukern.permute, to_nhwc and to_nchw on the GPU against numpy.transpose, bit for bit (a
permutation moves bytes: NaN payloads, -0.0 and every other pattern must survive): every
element size (1, 2, 4, 8, 16 bytes) x a sweep of shapes and permutations (all 24 of rank 4 on
odd sizes, NCHW <-> NHWC with C = 3 and HW = 49, 5-D, batched and plain 2-D squares and skinny
matrices, rank 8, size-1 axes, identities, rank 0 and 1, empty arrays); every dtype; views,
negative and zero strides, element offsets that break vector alignment; ``out=`` contiguous,
strided and misaligned (the elements around a strided ``out`` stay as they were); bad input;
PyTorch (channels_last included) and JAX arrays through DLPack; and arrays past 2^31 elements
(``-k "not 2_31"`` leaves them out).

Every result is checked whole: a fresh output lands on pool memory filled with 0xFF first, and
an ``out=`` is filled with the complement of the expected bytes, so an element a kernel fails
to write cannot match."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import cukern

from .conftest import warm_family

cp = pytest.importorskip("cupy")
HAS_PERMUTE = all(hasattr(cukern, n) for n in ("permute", "to_nhwc", "to_nchw"))
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAS_PERMUTE, reason="cukern has no permute yet")]

# one dtype per element size for the sweeps; every other dtype in test_every_dtype
BY_SIZE = {1: "int8", 2: "float16", 4: "float32", 8: "float64", 16: "complex128"}
SIZE_DTYPES = list(BY_SIZE.values())
ALL_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "float16", "bfloat16", "int32",
              "uint32", "float32", "int64", "uint64", "float64", "complex64", "complex128"]


@pytest.fixture(scope="module", autouse=True)
def warm_permute():
    """Compile the permute family's kernels in parallel first (once per session)."""
    from cukern import registry

    for family in sorted({op.family for op in registry.OPS.values()
                          if op.name in ("permute", "to_nhwc", "to_nchw")}):
        warm_family(family)


def np_dtype(name) -> np.dtype:
    if name == "bfloat16":
        from ml_dtypes import bfloat16

        return np.dtype(bfloat16)
    return np.dtype(name)


# Bit patterns planted at the start of every float array: -0.0, quiet and signalling NaNs with
# payloads, negative NaN, infinity, the smallest subnormal (as unsigned words of the size).
SPECIAL = {2: [0x8000, 0x7E01, 0x7C01, 0xFD55, 0x7C00, 0x0001],
           4: [0x80000000, 0x7FC00123, 0x7F800001, 0xFFD55555, 0x7F800000, 0x00000001],
           8: [0x8000000000000000, 0x7FF8000000000123, 0x7FF0000000000001,
               0xFFFD555555555555, 0x7FF0000000000000, 0x0000000000000001]}


def random_host(rng, shape, dtype) -> np.ndarray:
    """Fresh random bytes as ``dtype`` (NaN payloads and all; bool as 0 and 1), C order, with
    the SPECIAL patterns first in float and complex arrays."""
    dt = np_dtype(dtype)
    n = math.prod(shape)
    if dt == np.bool_:
        return (rng.integers(0, 2, n, dtype=np.uint8) == 1).reshape(shape)
    a = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).view(dt)
    if dt.kind in "fcV" or dt == np_dtype("bfloat16"):
        word = min(dt.itemsize, 8)
        words = a.view(f"u{word}")
        special = np.array(SPECIAL[word], dtype=f"u{word}")[:words.size]
        words[:special.size] = special
    return a.reshape(shape)


def raw(a: np.ndarray) -> np.ndarray:
    """The bytes of each element: shape ``a.shape + (itemsize,)``, uint8."""
    return np.asarray(a, order="C")[..., None].view(np.uint8)


def device_from_raw(r: np.ndarray, dtype, shape):
    """A C-contiguous device array of ``dtype`` and ``shape`` holding the bytes ``r``."""
    flat = cp.asarray(np.asarray(r, order="C").reshape(-1))
    return flat.view(np_dtype(dtype)).reshape(shape)


def host(a) -> np.ndarray:
    return cp.asnumpy(a) if isinstance(a, cp.ndarray) else np.asarray(a)


def assert_bits(got, want: np.ndarray, what: str = "result") -> None:
    """Same shape, dtype and bytes; on a mismatch, how many elements and the first one."""
    got = host(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    g, w = raw(got), raw(want)
    bad = (g != w).any(axis=-1)
    if bad.any():
        first = np.unravel_index(int(np.argmax(bad.reshape(-1))), want.shape) if want.ndim \
            else ()
        raise AssertionError(f"{what}: {int(bad.sum())} of {want.size} elements differ; first "
                             f"at {first}: got {g[first].tobytes().hex()}, expected "
                             f"{w[first].tobytes().hex()}")


def poison(nbytes: int) -> None:
    """Return 0xFF-filled memory to CuPy's pool, sized like the output about to be allocated
    (and one large block the pool splits for anything else)."""
    blocks = [cp.full(int(nbytes) + 1, 255, cp.uint8), cp.full(64 << 20, 255, cp.uint8)]
    del blocks


def expected(xh: np.ndarray, axes) -> np.ndarray:
    return np.asarray(np.transpose(xh, axes), order="C")  # 0-d stays 0-d


def check(xd, xh: np.ndarray, axes, out: bool = True):
    """cukern.permute(xd, axes) equals numpy.transpose(xh, axes), C-contiguous and bit for bit:
    into a fresh array over poisoned pool memory and (``out``) into ``out=`` filled with the
    complement of the expected bytes. Returns the fresh result."""
    want = expected(xh, axes)
    poison(want.nbytes)
    y = cukern.permute(xd, axes)
    assert isinstance(y, cp.ndarray) and y.flags.c_contiguous
    if y.size:
        assert y.data.ptr != xd.data.ptr, "the result aliases the input"
    assert_bits(y, want)
    if out:
        o = device_from_raw(~raw(want), want.dtype, want.shape)
        r = cukern.permute(xd, axes, out=o)
        assert r.data.ptr == o.data.ptr and r.shape == o.shape
        assert_bits(o, want, "out=")
    return y


def put(rng, shape, dtype):
    """Host data and its bytes on the GPU (uploaded as raw bytes: cupy.asarray of a 0-d
    float array loses -0.0 and NaN payloads)."""
    xh = random_host(rng, shape, dtype)
    return xh, device_from_raw(raw(xh), xh.dtype, xh.shape)


def clear_launches() -> None:
    """Empty the op's launch caches (they key on layouts, not tunings)."""
    from cukern.ops import permute as ops

    ops._launches.clear()
    ops._fresh.clear()


def plan_with(monkeypatch, **fields) -> None:
    """Plan every permute of the test with the tuning's ``fields`` replaced, and without the
    small arrays' general kernel unless ``fields`` set perm_small_* (the tests of tile
    features use small arrays); the launch caches emptied (empty them again after the test:
    :func:`clear_launches`)."""
    import dataclasses

    from cukern.plan import permute as pp

    fields = dict(perm_small_max_bytes=0, perm_small_flat_max_bytes=0) | fields
    real = pp.tuning_for
    monkeypatch.setattr(pp, "tuning_for",
                        lambda device: dataclasses.replace(real(device), **fields))
    clear_launches()


def out_in_buffer(want: np.ndarray, out_base: int):
    """(buf, o): ``o`` a view of ``want``'s shape ``out_base`` elements into a device buffer
    of 16 elements more, o filled with the complement of ``want``'s bytes and the rest with
    0xA5 (:func:`check_out_buffer`)."""
    n, item = want.size, want.dtype.itemsize
    big = np.full((out_base + n + 16, item), 0xA5, np.uint8)
    big[out_base:out_base + n] = ~raw(want).reshape(n, item)
    buf = device_from_raw(big, want.dtype, (out_base + n + 16,))
    return buf, buf[out_base:out_base + n].reshape(want.shape)


def check_out_buffer(buf, want: np.ndarray, out_base: int) -> None:
    """out= of :func:`out_in_buffer` holds ``want``'s bytes, the bytes beside it untouched."""
    n, item = want.size, want.dtype.itemsize
    got = raw(host(buf))
    assert (got[out_base:out_base + n] == raw(want).reshape(n, item)).all(), \
        "out= holds the wrong bytes"
    assert (got[:out_base] == 0xA5).all() and (got[out_base + n:] == 0xA5).all(), \
        "bytes beside out= were written"


def check_strided_into_buffer(base_d, base_h, xd, xh: np.ndarray, axes, out_base: int,
                              plan_check) -> None:
    """x (``xd``, a view of ``base_d``) permuted into out= ``out_base`` elements into a buffer
    (:func:`out_in_buffer`; ``plan_check(plan)`` asserts the op's plan for it) and into a fresh
    output; the bytes beside out= and the input stay as they were."""
    from cukern.ops import permute as ops

    want = expected(xh, axes)
    buf, o = out_in_buffer(want, out_base)
    plan_check(ops.plan_for(xd, axes, out=o))
    r = cukern.permute(xd, axes, out=o)
    assert r.data.ptr == o.data.ptr
    check_out_buffer(buf, want, out_base)
    check(xd, xh, axes, out=False)
    assert_bits(base_d, base_h, "the input after the calls")


def item_size(dtype: str) -> int:
    """Bytes an element of ``dtype`` (bfloat16 included, which NumPy lacks)."""
    return np.dtype("float16" if dtype == "bfloat16" else dtype).itemsize


def put_misaligned(rng, shape, axes, dtype, pad_in: int, pad_out: int):
    """(xh, xd, want, o, obuf): x of ``shape`` ``pad_in`` elements into its device buffer, out=
    of the permuted shape ``pad_out`` elements into ``obuf`` (filled with 0x5A before it, the
    complement of ``want`` in it)."""
    n = math.prod(shape)
    flat_h, flat_d = put(rng, (n + pad_in,), dtype)
    xh, xd = flat_h[pad_in:].reshape(shape), flat_d[pad_in:].reshape(shape)
    want = expected(xh, axes)
    junk = np.full((n + pad_out, want.dtype.itemsize), 0x5A, np.uint8)
    junk[pad_out:] = ~raw(want).reshape(n, -1)
    obuf = device_from_raw(junk, want.dtype, (n + pad_out,))
    return xh, xd, want, obuf[pad_out:].reshape(want.shape), obuf


def check_misaligned(xd, axes, want: np.ndarray, o, obuf, pad_out: int, kernel: str) -> None:
    """permute(xd, axes, out=o) of :func:`put_misaligned`: ``want``, nothing before o."""
    cukern.permute(xd, axes, out=o)
    assert_bits(o, want, f"misaligned out= ({kernel})")
    assert (raw(host(obuf))[:pad_out] == 0x5A).all(), "out= wrote before its first element"


def check_64_bit(p, xd, xh: np.ndarray, axes):
    """``p`` (the 32-bit tile plan the op made for xd) launched with 64-bit indices (the
    instantiations arrays past 2^31 elements run) into poisoned memory; returns that plan."""
    import dataclasses

    from cukern.families import permute as fam
    from cukern.ops import permute as ops
    from cukern.plan import permute as pp

    assert p.kind == "tile" and p.index == 32
    targs = p.targs[:4] + (64,) + p.targs[5:]
    p64 = dataclasses.replace(p, index=64, targs=targs, kernel=fam._name(targs))
    assert "long long" in p64.kernel and p64.targs in set(pp.reachable_steps())
    want = expected(xh, axes)
    poison(want.nbytes)
    y = cp.empty(want.shape, xd.dtype)
    ops.run_plan(p64, xd, y)
    assert_bits(y, want, p64.kernel)
    return p64


# ---------------------------------------------------------------------------------------------
# Shapes and permutations x every element size

CASES = [
    # NCHW <-> NHWC: image inputs (C = 3), ResNet's 7x7 planes (HW = 49), odd sizes
    ((2, 3, 224, 224), (0, 2, 3, 1)), ((2, 224, 224, 3), (0, 3, 1, 2)),
    ((2, 2048, 7, 7), (0, 2, 3, 1)), ((2, 7, 7, 2048), (0, 3, 1, 2)),
    ((3, 64, 28, 28), (0, 2, 3, 1)), ((3, 28, 28, 64), (0, 3, 1, 2)),
    ((4, 33, 17, 31), (0, 2, 3, 1)), ((4, 17, 31, 33), (0, 3, 1, 2)),
    ((1, 5, 9, 11), (0, 2, 3, 1)), ((2, 16, 4, 14, 14), (0, 2, 3, 4, 1)),
    ((2, 4, 14, 14, 16), (0, 4, 1, 2, 3)),
    # batched 2-D transposes, on and off the tile sizes
    ((5, 37, 41), (0, 2, 1)), ((3, 64, 64), (0, 2, 1)), ((2, 65, 129), (0, 2, 1)),
    ((7, 1, 40), (0, 2, 1)), ((6, 2, 300), (0, 2, 1)), ((6, 300, 2), (0, 2, 1)),
    # axes that merge into a 2-D transpose
    ((2, 3, 4, 5, 6), (3, 4, 0, 1, 2)), ((4, 6, 8, 10), (2, 3, 0, 1)),
    # the innermost axis in place (a copy of rows), odd and even row lengths
    ((7, 9, 16), (1, 0, 2)), ((7, 9, 5), (1, 0, 2)), ((6, 10, 3, 8), (2, 0, 1, 3)),
    ((3, 4, 5, 64), (2, 1, 0, 3)), ((5, 3, 1000), (1, 0, 2)),
    # general orders
    ((3, 5, 7, 9), (3, 1, 0, 2)), ((6, 5, 4, 3, 2), (4, 2, 0, 3, 1)),
    ((2, 3, 4, 5, 6, 7), (5, 3, 1, 4, 2, 0)),
    # 2-D: tiny, around the tiles, squares, skinny
    ((1, 1), (1, 0)), ((2, 3), (1, 0)), ((31, 33), (1, 0)), ((32, 32), (1, 0)),
    ((33, 31), (1, 0)), ((64, 64), (1, 0)), ((1000, 1000), (1, 0)), ((1024, 1024), (1, 0)),
    ((8192, 3), (1, 0)), ((3, 8192), (1, 0)), ((3, 8192 * 8), (1, 0)), ((8192 * 8, 3), (1, 0)),
    ((1, 4097), (1, 0)), ((4097, 2), (1, 0)), ((2, 4097), (1, 0)), ((4097, 33), (1, 0)),
    # rank 8
    ((2, 3, 1, 2, 3, 2, 1, 3), (7, 0, 5, 2, 3, 6, 1, 4)), ((2,) * 8, (1, 0, 3, 2, 5, 4, 7, 6)),
    ((3, 2, 3, 2, 3, 2, 3, 2), (7, 6, 5, 4, 3, 2, 1, 0)),
    ((4, 3, 2, 2, 3, 2, 2, 5), (0, 1, 2, 3, 4, 5, 7, 6)),
    # size-1 axes
    ((1, 5, 1, 7), (3, 1, 0, 2)), ((5, 1, 1, 7, 1), (4, 3, 0, 2, 1)), ((1, 1, 1), (2, 0, 1)),
    ((7, 1), (1, 0)), ((1, 7), (1, 0)), ((4, 1, 6), (1, 0, 2)),
    ((1, 3, 1, 224, 1), (4, 2, 0, 3, 1)),
    # identities: a copy
    ((3, 5, 7), (0, 1, 2)), ((1000,), (0,)), ((2, 3, 4, 5, 6, 7, 2, 3), tuple(range(8))),
    # rank 0 and 1
    ((), ()), ((1,), (0,)), ((17,), (0,)),
    # empty
    ((0, 3, 5), (2, 0, 1)), ((3, 0, 5), (0, 2, 1)), ((4, 5, 0), (1, 0, 2)), ((0,), (0,)),
    ((0, 0), (1, 0)), ((2, 0, 3, 4), (0, 2, 3, 1)),
]


def _id(case) -> str:
    shape, axes = case
    return f"{'x'.join(map(str, shape)) or 'scalar'}-{''.join(map(str, axes)) or 'none'}"


@pytest.mark.parametrize("dtype", SIZE_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_shapes_and_permutations(case, dtype, rng):
    shape, axes = case
    xh, xd = put(rng, shape, dtype)
    check(xd, xh, axes)


@pytest.mark.parametrize("dtype", SIZE_DTYPES)
@pytest.mark.parametrize("axes", list(itertools.permutations(range(4))),
                         ids=["".join(map(str, p)) for p in itertools.permutations(range(4))])
def test_all_rank_4_permutations_odd_sizes(axes, dtype, rng):
    xh, xd = put(rng, (3, 5, 7, 9), dtype)
    check(xd, xh, axes)


@pytest.mark.parametrize("dtype", SIZE_DTYPES)
@pytest.mark.parametrize("axes", list(itertools.permutations(range(3))),
                         ids=["".join(map(str, p)) for p in itertools.permutations(range(3))])
def test_all_rank_3_permutations_past_a_tile(axes, dtype, rng):
    xh, xd = put(rng, (67, 3, 129), dtype)
    check(xd, xh, axes)


@pytest.mark.parametrize("panel", [1, 2, 4])
@pytest.mark.parametrize("dtype", SIZE_DTYPES)
@pytest.mark.parametrize("case", [((2100, 2300), (1, 0)), ((2, 1100, 2300), (0, 2, 1)),
                                  ((2, 2100, 47, 53), (0, 2, 3, 1))], ids=_id)
def test_tiles_in_panels(case, dtype, panel, rng, monkeypatch):
    # tiles run in panels along i (perm_panel_tiles), partial tiles on both sides and batches
    from cukern.ops import permute as ops

    plan_with(monkeypatch, perm_panel_tiles=panel)
    try:
        shape, axes = case
        xh, xd = put(rng, shape, dtype)
        p = ops.plan_for(xd, axes)
        assert p.kind == "tile" and 1 <= p.panel <= panel, p
        check(xd, xh, axes)
    finally:
        clear_launches()


ASYNC_CASES = [((40, 3, 40, 41), (0, 2, 3, 1)),  # C = 3: a flat output run
               ((24, 41, 40, 3), (0, 3, 1, 2)),  # a flat input run of 3
               ((9, 200, 7, 7), (0, 2, 3, 1)),   # a flat input run of 49
               ((9, 7, 7, 200), (0, 3, 1, 2)),   # a flat output run of 49 (skewed columns)
               ((5, 14, 14, 96), (0, 3, 1, 2))]  # of 196


@pytest.mark.parametrize("looping", [False, True], ids=["tile-a-block", "two-buffers"])
@pytest.mark.parametrize("dtype", SIZE_DTYPES)
@pytest.mark.parametrize("case", ASYNC_CASES, ids=[_id(c) for c in ASYNC_CASES])
def test_async_copy(case, dtype, looping, rng, monkeypatch):
    # tiles with a flat side copied by cp.async (perm_async_copy); looping: a grid of 7 blocks,
    # each copying its next tile into the second buffer while it stores this one
    from cukern.ops import permute as ops
    from cukern.plan import permute as pp

    plan_with(monkeypatch, perm_async_copy=pp.ASYNC_SIZES)
    if looping:
        monkeypatch.setattr(pp, "_grid", lambda tiles, *a: min(tiles, 7))
    try:
        shape, axes = case
        xh, xd = put(rng, shape, dtype)
        p = ops.plan_for(xd, axes)
        assert p.kind == "tile" and (p.grid < p.tiles) == looping, p
        assert p.async_copy == (p.flat_in or p.flat_out), p  # 16-byte elements: rows at C = 3
        check(xd, xh, axes)
        # misaligned pointers: words of fewer elements, partial words at the runs' ends
        xh, xd, want, o, obuf = put_misaligned(rng, shape, axes, dtype, 1, 3)
        check_misaligned(xd, axes, want, o, obuf, 3, "async copy")
    finally:
        clear_launches()


SMALL_CASES = [((8192, 3), (1, 0)), ((3, 8192), (1, 0)), ((2, 64, 7, 7), (0, 2, 3, 1)),
               ((2, 7, 7, 64), (0, 3, 1, 2)), ((33, 65), (1, 0)), ((3, 5, 7, 9), (3, 1, 0, 2)),
               ((2, 3, 1, 2, 3, 2, 1, 3), (7, 0, 5, 2, 3, 6, 1, 4)), ((1, 4097), (1, 0)),
               ((7, 9, 5), (1, 0, 2))]


@pytest.mark.parametrize("dtype", SIZE_DTYPES)
@pytest.mark.parametrize("case", SMALL_CASES, ids=[_id(c) for c in SMALL_CASES])
def test_small_arrays_general_kernel(case, dtype, rng, monkeypatch):
    """Small arrays in the general kernel, perm_small_unroll elements a thread in narrow blocks
    (perm_small_max_bytes; the H200's table takes it up to 128 KB): fresh outputs and out=,
    misaligned pointers, a view with negative steps, bit for bit."""
    from cukern.ops import permute as ops
    from cukern.plan import permute as pp

    plan_with(monkeypatch, perm_small_max_bytes=2**30, perm_small_flat_max_bytes=2**30)
    try:
        shape, axes = case
        xh, xd = put(rng, shape, dtype)
        p = ops.plan_for(xd, axes)
        identity = list(axes) == sorted(axes) or math.prod(shape) <= 1
        if not (identity or p.kind == "copy"):
            assert p.kind == "general" and p.targs[3] == pp.SMALL_UNROLLS[0], str(p)
            assert p.block[0] * p.block[1] in (32, 64, 128, 256), str(p)
        check(xd, xh, axes)
        xh, xd, want, o, obuf = put_misaligned(rng, shape, axes, dtype, 1, 3)
        check_misaligned(xd, axes, want, o, obuf, 3, "small general")
        base_h, base_d = put(rng, tuple(2 * s for s in shape), dtype)
        sl = tuple(slice(None, None, -2) for _ in shape)
        check(base_d[sl], base_h[sl], axes)
        assert_bits(base_d, base_h, "the input after the call")
    finally:
        clear_launches()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("case", [((2, 3, 20, 20), (0, 2, 3, 1)), ((2, 20, 20, 3), (0, 3, 1, 2)),
                                  ((5, 7, 9, 11), (2, 0, 3, 1)), ((33, 65), (1, 0)),
                                  ((4, 6, 8), (0, 1, 2)), ((3, 5, 16), (1, 0, 2)),
                                  ((), ())], ids=_id)
def test_every_dtype(case, dtype, rng):
    shape, axes = case
    xh, xd = put(rng, shape, dtype)
    check(xd, xh, axes)


@pytest.mark.parametrize("dtype", ["bool", "float16", "bfloat16", "complex64"])
def test_axes_forms(dtype, rng):
    """axes=None reverses; lists, NumPy integers and negative axes as numpy.transpose takes
    them."""
    xh, xd = put(rng, (3, 4, 5), dtype)
    assert_bits(cukern.permute(xd, None), expected(xh, None))
    for axes in ([2, 0, 1], (np.int64(2), np.int32(0), 1), (-1, 0, -2), np.array([2, 0, 1])):
        assert_bits(cukern.permute(xd, axes), expected(xh, (2, 0, 1)), f"axes={axes!r}")
    sh, sd = put(rng, (), dtype)
    assert_bits(cukern.permute(sd, None), sh)


# ---------------------------------------------------------------------------------------------
# NCHW <-> NHWC helpers


@pytest.mark.parametrize("dtype", SIZE_DTYPES + ["bfloat16", "bool"])
@pytest.mark.parametrize("shape", [(4, 7, 33), (2, 3, 224, 224), (2, 2048, 7, 7), (3, 5, 9, 11),
                                   (2, 16, 4, 14, 14), (1, 3, 2, 5, 7)], ids=str)
def test_to_nhwc_and_back(shape, dtype, rng):
    n = len(shape)
    xh, xd = put(rng, shape, dtype)
    poison(xh.nbytes)
    y = cukern.to_nhwc(xd)
    want = expected(xh, (0, *range(2, n), 1))
    assert isinstance(y, cp.ndarray) and y.flags.c_contiguous
    assert_bits(y, want, "to_nhwc")
    poison(xh.nbytes)
    back = cukern.to_nchw(y)
    assert back.flags.c_contiguous
    assert_bits(back, xh, "to_nchw(to_nhwc(x))")
    # to_nchw of an independent NHWC array, and both into out= holding the complement
    zh, zd = put(rng, want.shape, dtype)
    zwant = expected(zh, (0, n - 1, *range(1, n - 1)))
    assert_bits(cukern.to_nchw(zd), zwant, "to_nchw")
    for fn, src, w in ((cukern.to_nhwc, xd, want), (cukern.to_nchw, zd, zwant)):
        o = device_from_raw(~raw(w), w.dtype, w.shape)
        assert fn(src, out=o).data.ptr == o.data.ptr
        assert_bits(o, w, f"{fn.__name__} out=")


def test_to_nhwc_video_shape(rng):
    """The issue's 5-D shape, (8, 64, 16, 56, 56) in float16, both ways."""
    xh, xd = put(rng, (8, 64, 16, 56, 56), "float16")
    y = cukern.to_nhwc(xd)
    assert_bits(y, expected(xh, (0, 2, 3, 4, 1)), "to_nhwc")
    assert_bits(cukern.to_nchw(y), xh, "to_nchw")


def test_to_nhwc_of_strided_views(rng):
    """A channels-last view in (N, C, H, W) order becomes a plain copy of its memory."""
    mem_h, mem_d = put(rng, (4, 9, 10, 6), "float32")  # NHWC memory
    vh, vd = np.transpose(mem_h, (0, 3, 1, 2)), mem_d.transpose(0, 3, 1, 2)
    assert_bits(cukern.to_nhwc(vd), mem_h, "to_nhwc of channels-last memory")
    assert_bits(cukern.to_nchw(mem_d[:, ::-1, 1::2]), expected(mem_h[:, ::-1, 1::2], (0, 3, 1, 2)))
    assert_bits(cukern.to_nhwc(vd[::2, :, ::-3]), expected(vh[::2, :, ::-3], (0, 2, 3, 1)))


# ---------------------------------------------------------------------------------------------
# Views, strides, offsets

# name -> a view of a (10, 12, 7, 5) array; xp is numpy or cupy
VIEWS = {
    "steps": lambda a, xp: a[::2, 1::3],
    "reversed": lambda a, xp: a[::-1],
    "negative steps": lambda a, xp: a[:, ::-2],
    "all reversed": lambda a, xp: a[::-1, ::-1, ::-1, ::-1],
    "inner slice": lambda a, xp: a[..., 1:4],
    "inner step": lambda a, xp: a[..., ::2],
    "inner reversed": lambda a, xp: a[..., ::-1],
    "transposed": lambda a, xp: a.transpose(2, 0, 3, 1),
    "channels-last": lambda a, xp: a.transpose(0, 3, 1, 2),
    "mixed": lambda a, xp: a.transpose(1, 3, 0, 2)[::-1, 1:, ::3],
    "zero stride": lambda a, xp: xp.broadcast_to(a[:, :1], (10, 12, 7, 5)),
    "one element": lambda a, xp: a[3:4, 5:6, 2:3, 1:2],
}


@pytest.mark.parametrize("dtype", SIZE_DTYPES + ["bool", "bfloat16"])
@pytest.mark.parametrize("axes", [(0, 2, 3, 1), (3, 1, 0, 2), (1, 0, 2, 3), (0, 1, 2, 3)],
                         ids=["nhwc", "3102", "1023", "identity"])
@pytest.mark.parametrize("view", list(VIEWS))
def test_views_and_negative_strides(view, axes, dtype, rng):
    base_h, base_d = put(rng, (10, 12, 7, 5), dtype)
    xh, xd = VIEWS[view](base_h, np), VIEWS[view](base_d, cp)
    check(xd, xh, axes)
    assert_bits(base_d, base_h, "the input after the call")


@pytest.mark.parametrize("dtype", SIZE_DTYPES + ["float16"])
@pytest.mark.parametrize("offset", [1, 3, 5])
@pytest.mark.parametrize("case", [((4, 64, 32), (0, 2, 1)), ((8, 16, 32), (1, 0, 2)),
                                  ((64, 64), (1, 0)), ((2, 3, 40, 40), (0, 2, 3, 1)),
                                  ((2, 40, 40, 3), (0, 3, 1, 2)), ((4, 6, 8), (0, 1, 2)),
                                  ((3, 5, 7, 9), (3, 1, 0, 2))], ids=_id)
def test_misaligned_offsets(case, offset, dtype, rng):
    """Input and output ``offset`` elements into their buffers (x.ravel()[k:].reshape(...)):
    pointers off every vector width above the element size."""
    shape, axes = case
    n = math.prod(shape)
    flat_h, flat_d = put(rng, (n + offset,), dtype)
    xh = flat_h[offset:].reshape(shape)
    xd = flat_d[offset:].reshape(shape)
    check(xd, xh, axes)
    want = expected(xh, axes)
    junk = np.full((n + offset, np_dtype(dtype).itemsize), 0x5A, np.uint8)
    junk[offset:] = ~raw(want).reshape(n, -1)
    obuf = device_from_raw(junk, dtype, (n + offset,))
    o = obuf[offset:].reshape(want.shape)
    cukern.permute(xd, axes, out=o)
    assert_bits(o, want, "misaligned out=")
    assert (raw(host(obuf))[:offset] == 0x5A).all(), "out= wrote before its first element"


# ---------------------------------------------------------------------------------------------
# out=


@pytest.mark.parametrize("dtype", SIZE_DTYPES + ["bool"])
@pytest.mark.parametrize("case", [((3, 5, 7, 9), (0, 2, 3, 1)), ((3, 5, 7, 9), (3, 1, 0, 2)),
                                  ((33, 65), (1, 0)), ((6, 8, 16), (1, 0, 2)),
                                  ((2, 3, 10, 10), (0, 2, 3, 1)), ((4, 6, 8), (0, 1, 2)),
                                  ((17,), (0,))], ids=_id)
@pytest.mark.parametrize("kind", ["steps", "offset", "reversed", "transposed"])
def test_strided_out(kind, case, dtype, rng):
    """out= a slice of a bigger array (steps, an offset, negative steps) or a transposed view:
    its elements written bit for bit, every other element of the buffer untouched."""
    shape, axes = case
    xh, xd = put(rng, shape, dtype)
    want = expected(xh, axes)
    n = want.ndim
    item = want.dtype.itemsize
    big_shape = tuple(2 * s + 3 for s in want.shape)
    if kind == "steps":
        sl = tuple(slice(1, 1 + 2 * s, 2) for s in want.shape)
    elif kind == "offset":
        sl = tuple(slice(2, 2 + s) for s in want.shape)
    elif kind == "reversed":
        sl = tuple(slice(s, 0, -1) for s in want.shape)
    else:  # a C-order block of the buffer seen through a transposition: out is F-ordered
        sl = tuple(slice(1, 1 + s) for s in reversed(want.shape))
    big = np.full(big_shape + (item,), 0xA5, np.uint8) if kind != "transposed" else \
        np.full(tuple(reversed(big_shape)) + (item,), 0xA5, np.uint8)
    region = big[sl]
    if kind == "transposed":
        region = region.transpose(*reversed(range(n)), n)
    assert region.shape[:-1] == want.shape
    region[...] = ~raw(want)
    inside = np.zeros(big.shape[:-1], bool)
    inside[sl] = True
    buf = device_from_raw(big, dtype, big.shape[:-1])
    o = buf[sl]
    if kind == "transposed":
        o = o.transpose(*reversed(range(n)))
    assert o.shape == want.shape
    r = cukern.permute(xd, axes, out=o)
    assert r.data.ptr == o.data.ptr
    got = raw(host(buf))
    region = got[sl]
    if kind == "transposed":
        region = region.transpose(*reversed(range(n)), n)
    assert (region == raw(want)).all(), "out= holds the wrong bytes"
    assert (got[~inside] == 0xA5).all(), "elements outside out= were written"


# ---------------------------------------------------------------------------------------------
# Streams, bad input


def test_runs_on_the_current_stream(rng):
    xh, xd = put(rng, (16, 64, 56, 56), "float16")
    cp.cuda.Device().synchronize()  # the upload ran on the default stream; s does not wait for it
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        y = cukern.permute(xd, (0, 2, 3, 1))
        z = cukern.to_nchw(y)
    s.synchronize()
    assert_bits(y, expected(xh, (0, 2, 3, 1)))
    assert_bits(z, xh)


def test_bad_input_is_named():
    x = cp.zeros((4, 5, 6), cp.float32)
    sq = cp.zeros((6, 6), cp.float32)
    base = cp.zeros(2 * 120, cp.float32)
    cases = [
        (lambda: cukern.permute(np.zeros((4, 5, 6), np.float32), (0, 2, 1)), TypeError,
         "numpy|ndarray"),
        (lambda: cukern.permute(x, (0, 1)), ValueError, "axes"),
        (lambda: cukern.permute(x, (0, 1, 2, 3)), ValueError, "axes"),
        (lambda: cukern.permute(x, (0, 1, 3)), ValueError, "ax"),
        (lambda: cukern.permute(x, (0, 1, -4)), ValueError, "ax"),
        (lambda: cukern.permute(x, (0, 1, 1)), ValueError, "ax"),
        (lambda: cukern.permute(x, (0, -1, 2)), ValueError, "ax"),
        (lambda: cukern.permute(x, (0, 1.5, 2)), (TypeError, ValueError), "axes"),
        (lambda: cukern.permute(x, (0, 2, 1), out=cp.zeros((4, 5, 6), cp.float32)), ValueError,
         "out"),
        (lambda: cukern.permute(x, (0, 2, 1), out=cp.zeros((4, 6, 5), cp.float64)),
         (TypeError, ValueError), "out"),
        (lambda: cukern.permute(x, (0, 2, 1), out=cp.zeros((4, 6, 5), cp.int32)),
         (TypeError, ValueError), "out"),
        (lambda: cukern.permute(x, (0, 2, 1), out=np.zeros((4, 6, 5), np.float32)), TypeError,
         "out"),
        (lambda: cukern.permute(sq, (1, 0), out=sq), ValueError, "out"),
        (lambda: cukern.permute(x, (0, 1, 2), out=x), ValueError, "out"),
        (lambda: cukern.permute(base[:120].reshape(4, 5, 6), (0, 2, 1),
                                out=base[60:180].reshape(4, 6, 5)), ValueError, "out"),
        (lambda: cukern.permute(sq, (1, 0), out=sq.T), ValueError, "out"),
        (lambda: cukern.to_nhwc(cp.zeros((4, 5), cp.float32)), ValueError, "x|rank|dim"),
        (lambda: cukern.to_nhwc(cp.zeros((2,) * 6, cp.float32)), ValueError, "x|rank|dim"),
        (lambda: cukern.to_nchw(cp.zeros((4, 5), cp.float32)), ValueError, "x|rank|dim"),
        (lambda: cukern.to_nchw(cp.zeros((2,) * 6, cp.float32)), ValueError, "x|rank|dim"),
        (lambda: cukern.to_nhwc(np.zeros((2, 3, 4, 5), np.float32)), TypeError, "numpy|ndarray"),
    ]
    for i, (call, kind, says) in enumerate(cases):
        with pytest.raises(kind, match=says):
            call()
            pytest.fail(f"case {i} raised nothing")
    # disjoint halves of one buffer do not overlap
    xh = np.arange(120, dtype=np.float32).reshape(4, 5, 6)
    base[:120] = cp.asarray(xh.reshape(-1))
    o = base[120:].reshape(4, 6, 5)
    cukern.permute(base[:120].reshape(4, 5, 6), (0, 2, 1), out=o)
    assert_bits(o, expected(xh, (0, 2, 1)))


def test_arrays_on_different_devices():
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    x = cp.ones((4, 3, 2, 2), cp.float32)
    with cp.cuda.Device(1):
        o = cp.empty((4, 2, 2, 3), cp.float32)
    with pytest.raises(ValueError, match="GPU|device"):
        cukern.permute(x, (0, 2, 3, 1), out=o)


# ---------------------------------------------------------------------------------------------
# PyTorch and JAX through DLPack

TORCH_DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
                "float32", "float64", "complex64", "complex128"]


def _torch_random(torch, shape, dtype: str, gen):
    tdt = getattr(torch, dtype)
    n = math.prod(shape)
    if dtype == "bool":
        return torch.randint(0, 2, (n,), generator=gen, device="cuda").bool().reshape(shape)
    item = torch.empty((), dtype=tdt).element_size()
    b = torch.randint(0, 256, (n * item,), dtype=torch.uint8, generator=gen, device="cuda")
    return b.view(tdt).reshape(shape)


def _tbits(t) -> bytes:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_tensors(dtype, rng):
    """A tensor in, a new contiguous tensor of the permuted shape out (on the same GPU), equal
    bit for bit to ``x.permute(...).contiguous()``; views of tensors too."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(int(rng.integers(2**31)))
    x = _torch_random(torch, (4, 3, 10, 12), dtype, gen)
    for t, axes in ((x, (0, 2, 3, 1)), (x, (3, 1, 0, 2)), (x, (0, 1, 2, 3)),
                    (x[:, 1:, ::2, 3:], (0, 2, 3, 1)), (x.permute(0, 2, 3, 1), (0, 3, 1, 2)),
                    (x[0, 0], (1, 0))):
        y = cukern.permute(t, axes)
        assert isinstance(y, torch.Tensor) and y.device == t.device and y.dtype == t.dtype
        assert y.is_contiguous() and tuple(y.shape) == tuple(t.permute(*axes).shape)
        assert y.data_ptr() != t.data_ptr()
        assert _tbits(y) == _tbits(t.permute(*axes)), (tuple(t.shape), axes)
    for fn, axes in ((cukern.to_nhwc, (0, 2, 3, 1)), (cukern.to_nchw, (0, 3, 1, 2))):
        y = fn(x)
        assert isinstance(y, torch.Tensor) and y.is_contiguous()
        assert _tbits(y) == _tbits(x.permute(*axes))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8"])
def test_torch_channels_last(dtype, rng):
    """A channels_last tensor (NHWC memory, NCHW shape): to_nhwc gives its memory as an NHWC
    tensor; its NHWC view back to NCHW gives the NCHW-contiguous tensor; permute with the
    identity makes it contiguous. The same for channels_last_3d."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(int(rng.integers(2**31)))
    for shape, fmt in (((8, 6, 10, 12), torch.channels_last),
                       ((4, 6, 3, 5, 7), torch.channels_last_3d)):
        n = len(shape)
        x = _torch_random(torch, shape, dtype, gen).contiguous(memory_format=fmt)
        assert x.is_contiguous(memory_format=fmt) and not x.is_contiguous()
        nhwc = (0, *range(2, n), 1)
        y = cukern.to_nhwc(x)
        assert isinstance(y, torch.Tensor) and y.is_contiguous()
        assert tuple(y.shape) == tuple(x.permute(*nhwc).shape)
        assert _tbits(y) == _tbits(x.permute(*nhwc))
        z = cukern.to_nchw(x.permute(*nhwc))  # the channels-last memory, seen as NHWC
        assert z.is_contiguous() and tuple(z.shape) == shape
        assert _tbits(z) == _tbits(x)
        w = cukern.permute(x, tuple(range(n)))
        assert w.is_contiguous() and _tbits(w) == _tbits(x)


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint8", "int16", "float16", "bfloat16",
                                   "int32", "float32", "complex64"])
def test_jax_arrays(dtype, rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x = jnp.asarray(random_host(rng, (4, 3, 10, 12), dtype))
    xh = np.asarray(x)
    for axes in ((0, 2, 3, 1), (3, 1, 0, 2), (0, 1, 2, 3)):
        y = cukern.permute(x, axes)
        assert isinstance(y, jax.Array) and y.dtype == x.dtype
        assert_bits(np.asarray(y), expected(xh, axes), f"axes {axes}")
    y = cukern.to_nhwc(x)
    assert isinstance(y, jax.Array)
    assert_bits(np.asarray(y), expected(xh, (0, 2, 3, 1)), "to_nhwc")
    assert_bits(np.asarray(cukern.to_nchw(y)), xh, "to_nchw")


# ---------------------------------------------------------------------------------------------
# Past 2^31 elements


def _random_int8(shape, seed: int):
    """Random int8 bytes on the GPU, written in slabs (no full-size temporaries)."""
    x = cp.empty(shape, cp.int8)
    flat = x.reshape(-1)
    gen = cp.random.RandomState(seed)
    step = 1 << 28
    for i in range(0, flat.size, step):
        part = flat[i:i + step]
        part[...] = gen.randint(0, 256, part.size, dtype=cp.uint8).view(cp.int8)
    return x


@pytest.mark.parametrize("shape,axes,slab", [
    ((2, 2**30 + 3), (1, 0), 0),                      # a 2-D transpose, C = 2
    ((2, 3, 2**15 + 1, 2**14 + 3), (0, 2, 3, 1), 2),  # NCHW -> NHWC, C = 3
    ((2, 3, 6, 2**26 + 1), (3, 1, 0, 2), 0),          # a general order, 4-D
    ((2, 32772, 32776), (0, 2, 1), 1),                 # rows: the register phase 2, 64-bit
], ids=["2d", "nhwc", "general", "regs"])
def test_past_2_31_elements(shape, axes, slab, rng):
    """int8 arrays of 2^31 elements and more: element offsets need 64-bit arithmetic. The
    result is compared, slab by slab along its axis ``slab``, with CuPy's own strided view of
    the input. About 2.5 x 2 x 3.2 GB of GPU memory at the peak; leave them out with
    -k "not 2_31"."""
    total = math.prod(shape)
    assert total > 2**31
    free, _ = cp.cuda.runtime.memGetInfo()
    if free + cp.get_default_memory_pool().free_bytes() < 2 * total + (4 << 30):
        pytest.skip(f"needs about {(2 * total >> 30) + 4} GB of free GPU memory")
    x = _random_int8(shape, int(rng.integers(2**31)))
    poison(total)
    y = cukern.permute(x, axes)
    assert y.shape == tuple(shape[a] for a in axes) and y.dtype == cp.int8
    assert y.flags.c_contiguous
    view = x.transpose(axes)
    n = y.shape[slab]
    step = max(1, (1 << 28) // (total // n))
    for i in range(0, n, step):
        sl = (slice(None),) * slab + (slice(i, i + step),)
        assert bool(cp.array_equal(y[sl], view[sl])), f"slab {i}:{i + step} of axis {slab}"
    # the last elements, on the host too
    tail = (slice(None),) * slab + (slice(n - 1, n),)
    assert cp.asnumpy(y[tail]).tobytes() == cp.asnumpy(cp.ascontiguousarray(view[tail])).tobytes()
    del y
    if axes == (1, 0):  # and back, into an out= past 2^31 elements
        back = cp.empty(shape, cp.int8)
        back.fill(0)
        cukern.permute(cukern.permute(x, axes), (1, 0), out=back)
        for i in range(0, shape[1], 1 << 28):
            assert bool(cp.array_equal(back[:, i:i + (1 << 28)], x[:, i:i + (1 << 28)]))

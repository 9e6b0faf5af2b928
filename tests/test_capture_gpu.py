"""CUDA-graph capture of cukern calls that use temporaries, replayed after their memory was
handed out again.

Each test runs one call eagerly (compile, plan, the expected result), captures the same call
on a fresh stream into a graph while recording every allocation CuPy makes during it, and
lets the call return. The allocations that are not among its results are its temporaries
(partial sums, partial statistics, coefficients, copies of parameters and inputs). Then, on
the capturing stream, it allocates arrays of exactly their sizes and fills them with a
sentinel, poisons the results, replays the graph and checks (1) the results equal the eager
ones, (2) every sentinel is intact and (3) no sentinel array was given a temporary's memory.

Before the fix these fail: the temporaries went back to the capturing stream's pool when the
call returned (the pool then holds nothing else of that stream, so the same-size requests get
exactly those blocks back), the sentinels share their memory (3), and the replay, which
still writes and reads the temporaries' addresses, overwrites the sentinels (2). With the fix
cukern keeps a captured call's allocations alive (cukern.capture_memory_bytes() > 0) until
cukern.release_capture_memory().
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import cukern
from cukern.ops import batch_norm as bn_mod
from cukern.ops import layer_norm as ln_mod

from .conftest import TOL

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

SENTINEL = 0x5A  # a byte pattern no kernel here writes as a whole array


def _flat(res) -> list:
    """The arrays of a result (an array, or a tuple that may hold None)."""
    items = res if isinstance(res, (tuple, list)) else (res,)
    return [a for a in items if a is not None]


def _rel(a, b) -> float:
    a64, b64 = cp.asnumpy(a).astype(np.float64), cp.asnumpy(b).astype(np.float64)
    assert np.array_equal(np.isnan(a64), np.isnan(b64)), "NaN pattern differs (unwritten?)"
    den = np.linalg.norm(b64.ravel())
    num = np.linalg.norm((a64 - b64).ravel())
    return float(num / den) if den else float(num)


def _poison(a) -> None:
    if a.dtype.kind == "f":
        a.fill(np.nan)
    else:
        a.fill(-1)


def _recorder():
    """(an allocator over the current one, the (pointer, size) of each allocation it made)."""
    base = cp.cuda.get_allocator()
    allocs: list[tuple[int, int]] = []

    def recording_malloc(size):
        mem = base(size)
        allocs.append((mem.ptr, size))
        return mem

    return recording_malloc, allocs


def _sentinels(temps) -> list:
    """Arrays of the temporaries' sizes on the current stream, filled with SENTINEL: after the
    call, that stream's pool hands out its freed blocks first."""
    out = []
    for _, n in temps:
        s = cp.empty(n, cp.uint8)
        s.fill(SENTINEL)
        out.append(s)
    return out


def _check_sentinels(sentinels, temps) -> None:
    reused = [s for s in sentinels if s.data.mem.ptr in {p for p, _ in temps}]
    assert not reused, (f"{len(reused)} of {len(temps)} temporaries of the captured call were "
                        f"handed out again while its graph can still replay")
    for i, s in enumerate(sentinels):
        bad = int(cp.count_nonzero(s != SENTINEL))
        assert bad == 0, f"the replay overwrote {bad} bytes of sentinel array {i}"


def capture_and_replay(run, tol: float):
    """The test described in the module docstring, for ``run()`` (a call returning arrays)."""
    cukern.release_capture_memory()
    expected = [a.copy() for a in _flat(run())]  # eager, on the default stream: compiles
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    recording_malloc, allocs = _recorder()

    with stream:
        stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
        try:
            with cp.cuda.using_allocator(recording_malloc):
                res = _flat(run())
        finally:
            graph = stream.end_capture()
        held = {a.data.mem.ptr for a in res}
        temps = [(p, n) for p, n in allocs if p not in held]
        assert temps, "the call made no temporaries; this case tests nothing"
        kept = cukern.capture_memory_bytes()
        gc.collect()
        sentinels = _sentinels(temps)
        for a in res:
            _poison(a)
        graph.launch(stream)
        stream.synchronize()
    try:
        _check_sentinels(sentinels, temps)
        assert len(res) == len(expected)
        for got, want in zip(res, expected):
            assert got.shape == want.shape and got.dtype == want.dtype
            assert _rel(got, want) <= tol
        assert kept > 0, "nothing was kept for the captured call"
    finally:
        del graph
        released = cukern.release_capture_memory()
    assert released == kept
    assert cukern.capture_memory_bytes() == 0


def randn(rng, shape, dtype, scale=1.0, shift=0.0):
    return cp.asarray((rng.standard_normal(shape) * scale + shift).astype(dtype))


@pytest.mark.parametrize("path", ["fast", "full"])
@pytest.mark.parametrize("op,dtype", [("layer_norm_backward", "float32"),
                                      ("rms_norm_backward", "float16")])
def test_norm_backward_partial_sums(op, dtype, path, rng):
    """The float32 partial column sums behind dweight (and dbias)."""
    x = randn(rng, (512, 1024), dtype)
    dy = randn(rng, (512, 1024), dtype)
    w = randn(rng, (1024,), dtype, shift=1.0)
    layer = op == "layer_norm_backward"
    if layer:
        _, mean, rstd = cukern.layer_norm(x, 1024, w, return_stats=True)
    else:
        _, rstd = cukern.rms_norm(x, 1024, w, return_stats=True)

    def run():
        if path == "full":
            ln_mod._fresh.clear()
        if layer:
            return cukern.layer_norm_backward(dy, x, mean, rstd, w)
        return cukern.rms_norm_backward(dy, x, rstd, w)

    capture_and_replay(run, TOL[dtype])


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_clusters_sized_at_launch(op, rng):
    """Odd rows past one block's shared memory: clusters whose kernel reads its size at run time,
    launched through cuLaunchKernelEx with the size as an attribute, captured into a graph and
    replayed into poisoned results: the same bits as the eager call."""
    if not cukern.DeviceSpec.from_device().has_clusters:
        pytest.skip("needs thread-block clusters (sm_90)")
    cols = 10**5 + 3
    x = randn(rng, (8, cols), "float16")
    w = randn(rng, (cols,), "float16", shift=1.0)

    def run():
        return getattr(cukern, op)(x, cols, w, return_stats=True)

    cukern.release_capture_memory()
    expected = [cp.asnumpy(a) for a in _flat(run())]
    plan = ln_mod.last_plan(op)
    assert plan.launch_cluster == plan.cluster > 1, plan
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            res = _flat(run())
        finally:
            graph = stream.end_capture()
        for a in res:
            _poison(a)
        graph.launch(stream)
    stream.synchronize()
    for got, want in zip(res, expected, strict=True):
        assert np.array_equal(cp.asnumpy(got).view(np.uint8), want.view(np.uint8))
    cukern.release_capture_memory()


def test_layer_norm_copies(rng):
    """A weight and an input that must be copied first (strided weight, trailing dims that
    are not one run)."""
    wbase = randn(rng, (32, 64), "float32", shift=1.0)
    w = wbase[:, ::2]
    xbase = randn(rng, (64, 32, 64), "float32")
    x = xbase[:, :, ::2]  # trailing (32, 32) with strides that do not merge

    capture_and_replay(lambda: cukern.layer_norm(x, (32, 32), w, return_stats=True),
                       TOL["float32"])


@pytest.mark.parametrize("op", ["softmax", "softmax_backward"])
def test_softmax_copies(op, rng):
    """Leading dimensions that one stride cannot walk (a copy first) and an out= view whose
    rows the kernels cannot address (a temporary output copied into it)."""
    base = randn(rng, (4, 10, 6, 128), "float32")
    x = base[:, ::2]
    out_base = cp.empty((4, 10, 6, 128), cp.float32)
    out = out_base[:, 1::2]
    if op == "softmax":
        capture_and_replay(lambda: cukern.softmax(x, out=out), TOL["float32"])
    else:
        y = cukern.softmax(x)
        dy = randn(rng, y.shape, "float32")
        dyv = cp.empty((4, 10, 6, 128), cp.float32)[:, ::2]
        dyv[...] = dy
        capture_and_replay(lambda: cukern.softmax_backward(y=y, dy=dyv, out=out),
                           TOL["float32"])


@pytest.mark.parametrize("dtype,stats", [("float32", "float32"), ("float16", "float16")])
def test_batch_norm_training(dtype, stats, rng):
    """Partial statistics and coefficients (float32 statistics: the fast path on the captured
    call); float16 running statistics are also converted to float32 copies and back."""
    x = randn(rng, (32, 4, 64, 64), dtype)
    rm = cp.zeros(4, stats)
    rv = cp.ones(4, stats)
    w = randn(rng, (4,), stats, shift=1.0)
    b = randn(rng, (4,), stats)

    def run():
        return cukern.batch_norm(x, rm, rv, w, b, training=True, momentum=0.0,
                                 return_stats=True)

    capture_and_replay(run, TOL[dtype])
    bn_mod._fresh.clear()


def test_batch_norm_backward(rng):
    """Partial sums, coefficients, and float32 dweight/dbias converted to a float16 weight's
    dtype (the float32 ones are temporaries)."""
    x = randn(rng, (32, 4, 64, 64), "float16")
    dy = randn(rng, (32, 4, 64, 64), "float16")
    w = randn(rng, (4,), "float16", shift=1.0)
    _, mean, invstd, _ = cukern.batch_norm(x, None, None, w, None, training=True,
                                           return_stats=True)
    capture_and_replay(lambda: cukern.batch_norm_backward(dy, x, mean, invstd, w),
                       TOL["float16"])


def test_batch_stats(rng):
    x = randn(rng, (64, 8, 64, 64), "float32")
    capture_and_replay(lambda: cukern.batch_stats(x), TOL["float32"])


def test_capture_memory_is_kept_until_released(rng):
    """An eager call keeps nothing; the kept memory of a capture is released once."""
    cukern.release_capture_memory()
    x = randn(rng, (256, 512), "float32")
    dy = randn(rng, (256, 512), "float32")
    w = randn(rng, (512,), "float32")
    _, mean, rstd = cukern.layer_norm(x, 512, w, return_stats=True)
    cukern.layer_norm_backward(dy, x, mean, rstd, w)
    assert cukern.capture_memory_bytes() == 0
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        cukern.layer_norm_backward(dy, x, mean, rstd, w)
        graph = stream.end_capture()
    assert cukern.capture_memory_bytes() > 0
    other = cp.cuda.Stream(non_blocking=True)
    assert cukern.release_capture_memory(other) == 0  # another stream: nothing kept there
    assert cukern.release_capture_memory(stream) > 0
    assert cukern.capture_memory_bytes() == 0
    del graph


def test_torch_graph_keeps_cukern_temporaries(rng):
    """cukern.torch inside torch.cuda.graph (global capture mode, PyTorch's default): the
    layer norm backward's partial sums and its results, CuPy memory, outlive the capture; the
    same allocate-over-and-replay check on the capture stream's CuPy pool. Warmed up on the
    capture stream first, so the capture takes blocks from CuPy's pool without cudaMalloc."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device (a CPU-only build?)")
    import cukern.torch as ct  # registers torch.ops.cukern

    cukern.release_capture_memory()
    x = torch.from_numpy(rng.standard_normal((512, 1024)).astype(np.float32)).cuda()
    dy = torch.from_numpy(rng.standard_normal((512, 1024)).astype(np.float32)).cuda()
    w = torch.from_numpy(rng.standard_normal(1024).astype(np.float32) + 1).cuda()
    _, mean, rstd = torch.ops.cukern.layer_norm(x, [1024], w, None, 1e-5)

    def run():
        return torch.ops.cukern.layer_norm_backward(dy, x, mean, rstd, w)

    expected = [t.clone() for t in run()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # the warm-up on the capture stream: its CuPy blocks go back to that stream's pool
    torch.cuda.synchronize()
    recording_malloc, allocs = _recorder()

    graph = torch.cuda.CUDAGraph()
    with cp.cuda.using_allocator(recording_malloc):
        with torch.cuda.graph(graph, stream=side):
            res = run()
    held = {t.data_ptr() for t in res}
    temps = [(p, n) for p, n in allocs if p not in held]
    assert temps, "the call made no temporaries"
    assert cukern.capture_memory_bytes() > 0
    with ct._base._cupy_stream(side.cuda_stream, torch.cuda.current_device()):  # its CuPy pool
        sentinels = _sentinels(temps)
        side.synchronize()
    for t in res:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    try:
        _check_sentinels(sentinels, temps)
        for got, want in zip(res, expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    finally:
        del graph
        cukern.release_capture_memory()

"""Benchmark harness: effective bandwidth of cukern's ops beside a same-size device copy and
peer libraries (PyTorch, JAX, CuPy), all measured in the same process.

Effective bandwidth = bytes that must move (each input read once, each output written once) /
median kernel time. The copy moves the same number of bytes as a forward op (one read, one
write of the array); ``pct_copy`` is an op's bandwidth over the copy's. Inputs rotate over
enough buffers to leave the L2 cache behind, so small shapes measure memory, not cache.

:func:`sweep` times any op of the registry; what it runs for each op (shapes, inputs, the
peers' calls) is in :mod:`cukern._bench_ops`. ``sweep("permute", ...)`` times 2-D transposes of
(rows, cols) arrays, beside PyTorch's ``copy_`` of ``x.t()`` (what ``.contiguous()`` runs),
CuPy's copy of ``x.T`` (``--vs cupy``) and JAX's jitted transpose;
``benchmarks/bench_permute.py`` times the layout shapes.
"""

from __future__ import annotations

import itertools
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable

import numpy as np

from . import registry

__all__ = ["sweep", "plot", "time_gpu", "time_wall", "jax_pipelined", "host_overhead_us", "OPS",
           "default_cols", "free_memory", "time_peer"]

# The ops benchmarks/bench_softmax.py sweeps by default: the softmax family and permute
# (sweep() itself times every op of the registry).
OPS = tuple(name for name, spec in registry.OPS.items()
            if spec.family == "softmax" or name == "permute")
ROTATE_BYTES = 256 * 2**20  # > 4x the H100's 50 MB L2


def default_cols(lo: int = 32, hi: int = 262144) -> list[int]:
    cols, c = [], lo
    while c <= hi:
        cols.append(c)
        c *= 2
    return cols


_spin_kernel = None


def _spin(us: float) -> None:
    """Keep the GPU busy for at least ``us`` microseconds (one thread spinning on clock64), so
    launches queued behind it run back to back and their timing excludes host overhead."""
    global _spin_kernel
    import cupy as cp

    if _spin_kernel is None:
        _spin_kernel = cp.RawKernel(
            'extern "C" __global__ void cukern_spin(long long cycles) {'
            ' long long t0 = clock64(); while (clock64() - t0 < cycles) {} }', "cukern_spin")
    _spin_kernel((1,), (1,), (np.int64(us * 2000),))  # clocks <= 2 GHz: at least `us`


def time_gpu(fn: Callable[[int], object], n_sets: int, reps: int = 30, warmup: int = 3,
             batch: int = 10) -> float:
    """Median milliseconds of one ``fn(i)`` (i cycles over input sets) on the legacy default
    stream, where CuPy and PyTorch launch by default. Each sample is a batch of calls queued
    behind a spin kernel and bracketed by events, so what is timed is the GPU's work alone,
    however long the host takes to launch it. A sample whose launches took the host longer
    than the spin lasted (the GPU may have waited for them) is dropped and the spin doubled."""
    import cupy as cp

    for i in range(warmup):
        fn(i % n_sets)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for i in range(batch):
        fn(i % n_sets)
    spin_us = 2.0 * (time.perf_counter() - t0) * 1e6 + 100
    cp.cuda.Device().synchronize()
    times: list[float] = []
    r = 0
    while len(times) < max(3, reps // batch * 3):
        _spin(spin_us)
        a, b = cp.cuda.Event(), cp.cuda.Event()
        t0 = time.perf_counter()
        a.record()
        for i in range(batch):
            fn((r * batch + i) % n_sets)
        b.record()
        host_us = (time.perf_counter() - t0) * 1e6
        b.synchronize()
        r += 1
        if host_us > 0.8 * spin_us and r < 20 * reps:  # the GPU may have idled between calls
            spin_us *= 2
            continue
        times.append(cp.cuda.get_elapsed_time(a, b) / batch)
    return statistics.median(times)


def time_wall(fn: Callable[[], object], sync: Callable[[], None], per_call: int,
              reps: int = 30) -> float:
    """Median milliseconds per unit of work for a library on its own streams (JAX): calls of
    ``fn`` (each doing ``per_call`` units) queued asynchronously, synchronised at both ends."""
    for _ in range(3):
        fn()
    sync()
    times = []
    batch = 5
    for _ in range(max(3, reps // batch)):
        sync()
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3 / (batch * per_call))
    return statistics.median(times)


def time_peer(fn: Callable[[int], object], sync: Callable[[], None] | None, n_sets: int,
              reps: int) -> float:
    """Median ms of ``fn(i)``: by device events (:func:`time_gpu`) where ``sync`` is None
    (CuPy and PyTorch, on CuPy's stream), else by the wall clock over pipelined calls, ``sync``
    waiting for the last (JAX, on its own streams)."""
    if sync is None:
        return time_gpu(fn, n_sets, reps)
    calls = itertools.count()
    return time_wall(lambda: fn(next(calls) % n_sets), sync, 1, reps)


def _sets(nbytes: int) -> int:
    return max(1, min(16, math.ceil(ROTATE_BYTES / max(nbytes, 1))))


def jax_pipelined(call: Callable[[int], object]):
    """(run, sync) for :func:`time_wall` around a JAX call ``call(i)``: ``run`` only enqueues
    (JAX dispatches asynchronously) and keeps the latest result; ``sync`` blocks on it, so a
    batch of calls is timed back to back, without a host round trip per call."""
    import jax

    last = []

    def run(i):
        last[:] = [call(i)]

    def sync():
        if last:
            jax.block_until_ready(last[0])

    return run, sync


def copy_ms(nbytes: int, reps: int = 30) -> float:
    """Median milliseconds of a device-to-device copy of ``nbytes``."""
    import cupy as cp

    n_sets = _sets(2 * nbytes)
    src = [cp.empty(nbytes, cp.uint8) for _ in range(n_sets)]
    dst = [cp.empty(nbytes, cp.uint8) for _ in range(n_sets)]
    for s in src:
        s.fill(1)

    def run(i):
        cp.cuda.runtime.memcpyAsync(dst[i].data.ptr, src[i].data.ptr, nbytes,
                                    cp.cuda.runtime.memcpyDeviceToDevice, 0)

    return time_gpu(run, n_sets, reps)


def warm_up(seconds: float = 1.0) -> None:
    """Copies back to back for ``seconds``: the first shape of a sweep otherwise runs on a GPU
    coming out of host-side work (compiles, JAX), measured 10-15% slow for every peer alike."""
    import cupy as cp

    a, b = cp.empty(2**28, cp.uint8), cp.empty(2**28, cp.uint8)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, a.nbytes,
                                        cp.cuda.runtime.memcpyDeviceToDevice, 0)
        cp.cuda.Device().synchronize()
    del a, b


def free_memory() -> None:
    """Returns the cached blocks of CuPy's pool and, where PyTorch is loaded, of its allocator
    (peers' results and out= buffers) to the driver before the next shape."""
    import cupy as cp

    cp.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.cuda.empty_cache()


SMALL_BYTES = 64 * 2**20  # arrays up to this size are timed in SMALL_ROUNDS rounds
SMALL_ROUNDS = 3


def sweep(op: str, dtypes: Iterable[str], cols_list: Iterable[int] | None = None,
          rows_fn: Callable[[int], int] | None = None,
          vs: Iterable[str] = ("torch", "jax", "cupyx"),
          progress: Callable[[dict], None] | None = None, reps: int = 30,
          shapes: Iterable[tuple[int, ...]] | None = None) -> list[dict]:
    """Time ``op`` (any op of the registry) for each dtype and shape, for cukern, a same-size
    copy and each available peer. Shapes: ``shapes``; else (rows_fn(cols), cols) for each of
    ``cols_list`` (rows default 2**27 // cols); else the op's defaults
    (:func:`cukern._bench_ops.plan`). One dict per measurement: op, dtype, shape, rows, cols,
    bytes (moved), peer ('cukern', 'copy', 'torch', ...), ms, gbps, pct_copy.

    Arrays up to SMALL_BYTES run in a few microseconds, where a passing slowdown of the GPU
    moves one median by 5%: the copy and every peer are timed in SMALL_ROUNDS interleaved
    rounds, and each keeps its best round."""
    from . import _bench_ops
    from ._explain import dtype_name

    names = [dtype_name(dt) for dt in dtypes]
    if shapes is None and cols_list is not None:
        rows_fn = rows_fn or (lambda c: max(1, 2**27 // c))
        shapes = [(rows_fn(c), c) for c in cols_list]
    cases = _bench_ops.plan(op, names, shapes=shapes)
    results: list[dict] = []
    copy_cache: dict[int, float] = {}
    peers = ("cukern", *vs)
    warm_up()
    for case in cases:
        array_bytes = case.array_bytes
        rounds = SMALL_ROUNDS if array_bytes <= SMALL_BYTES else 1
        sets = _bench_ops.make_inputs(case, _sets(case.moved_bytes))
        best: dict[str, float] = {}
        errors: dict[str, str] = {}
        made: dict = {}
        for _ in range(rounds):
            c_ms = copy_ms(array_bytes, reps)
            copy_cache[array_bytes] = min(copy_cache.get(array_bytes, c_ms), c_ms)
            for peer in peers:
                if peer in errors:
                    continue
                if rounds == 1:
                    made.clear()  # one peer's buffers at a time for the large arrays
                try:
                    if peer not in made:
                        made[peer] = _bench_ops.timer(case, peer, sets, time_gpu, time_wall,
                                                      jax_pipelined)
                    if made[peer] is None:
                        continue
                    ms = made[peer](reps)
                except ImportError:
                    made[peer] = None
                    continue
                except Exception as err:  # a peer that cannot run a shape is reported
                    errors[peer] = str(err)[:200]
                    continue
                best[peer] = min(best.get(peer, ms), ms)
        c_ms = copy_cache[array_bytes]
        copy_gbps = 2 * array_bytes / c_ms / 1e6
        rows, cols = case.rows_cols
        row = dict(op=case.op, dtype=case.dtype, shape=list(case.shape), rows=rows, cols=cols,
                   bytes=case.moved_bytes)
        results.append(dict(row, peer="copy", ms=c_ms, gbps=copy_gbps, pct_copy=100.0))
        for peer in peers:
            if peer in errors:
                results.append(dict(row, peer=peer, ms=float("nan"), gbps=float("nan"),
                                    pct_copy=float("nan"), error=errors[peer]))
            elif peer in best:
                gbps = case.moved_bytes / best[peer] / 1e6
                results.append(dict(row, peer=peer, ms=best[peer], gbps=gbps,
                                    pct_copy=100.0 * gbps / copy_gbps))
                if progress:
                    progress(results[-1])
        del sets, made
        free_memory()
    return results


def rebase_to_best_copy(results: list[dict]) -> list[dict]:
    """Recompute ``pct_copy`` against the fastest copy of each array size seen anywhere in
    ``results`` (the copy is measured once per sweep, and one slow measurement would otherwise
    inflate a whole sweep's percentages). Conservative: percentages can only go down."""
    best: dict[tuple, float] = {}
    for r in results:
        if r["peer"] == "copy":
            key = (r["rows"] * r["cols"], r["dtype"])
            best[key] = max(best.get(key, 0.0), r["gbps"])
    for r in results:
        key = (r["rows"] * r["cols"], r["dtype"])
        if key in best and r.get("gbps") == r.get("gbps"):  # skip NaN
            r["pct_copy"] = 100.0 * r["gbps"] / best[key]
    return results


def warm_kernels(ops, dtypes, spec) -> None:
    """Compile every kernel ``ops`` can launch for ``dtypes`` on ``spec``'s device, in parallel,
    before anything is timed; prints how long it took and any failure."""
    from . import _compile

    t0 = time.time()
    names = {(source, n) for source, ns in registry.kernel_names(ops, dtypes, spec).items()
             for n in ns}
    errors = _compile.warm_cache(sorted(names), spec.device_id)
    print(f"compiled {len(names)} kernels in {time.time() - t0:.0f} s, {len(errors)} errors",
          flush=True)
    for e in errors[:5]:
        print("  ", e[:300])


def best_host_us(fn: Callable[[], object], n: int = 20000) -> float:
    """Microseconds of host time per call of ``fn`` (best of five batches)."""
    import cupy as cp

    for _ in range(200):
        fn()
    cp.cuda.Device().synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n // 5):
            fn()
        best = min(best, (time.perf_counter() - t0) / (n // 5) * 1e6)
        cp.cuda.Device().synchronize()
    return best


def enqueue_us(fn: Callable[[], object], batches: int = 400, per_batch: int = 16) -> float:
    """Microseconds of host time per call of ``fn``: the median over ``batches`` of the time to
    enqueue ``per_batch`` calls onto an idle GPU, short enough that the launch queue never fills
    and blocks the host. (``best_host_us`` times calls back to back, so where a call's GPU work
    takes longer than its launch, it reads the GPU's time.)"""
    import cupy as cp

    for _ in range(50):
        fn()
    cp.cuda.Device().synchronize()
    samples = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        samples.append((time.perf_counter() - t0) / per_batch * 1e6)
        cp.cuda.Device().synchronize()
    return statistics.median(samples)


def host_overhead_us(n: int = 20000) -> dict:
    """Microseconds of host time per call on a tiny array (the GPU is never the bottleneck)."""
    import cupy as cp

    import cukern

    x = cp.random.standard_normal((4, 8), dtype=cp.float32)
    out = cp.empty_like(x)
    result = {}
    for label, fn in (("softmax", lambda: cukern.softmax(x)),
                      ("softmax_out", lambda: cukern.softmax(x, out=out)),
                      ("cupy_empty_like", lambda: cp.empty_like(x))):
        result[label] = best_host_us(fn, n)
    try:
        import torch

        t = torch.from_dlpack(x)
        for _ in range(200):
            torch.softmax(t, -1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n // 5):
            torch.softmax(t, -1)
        result["torch_softmax"] = (time.perf_counter() - t0) / (n // 5) * 1e6
        torch.cuda.synchronize()
    except ImportError:
        pass
    return result


def plot(results: list[dict], path: str, title: str = "") -> None:
    """Percent of copy bandwidth against cols, one panel per (op, dtype), one line per peer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["op"], r["dtype"]) for r in results})
    ncol = min(3, len(panels))
    nrow = math.ceil(len(panels) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 3.6 * nrow), squeeze=False)
    for ax, (op, dt) in zip(axes.flat, panels):
        sel = [r for r in results if r["op"] == op and r["dtype"] == dt]
        for peer in dict.fromkeys(r["peer"] for r in sel):
            pts = sorted((r["cols"], r["pct_copy"]) for r in sel if r["peer"] == peer)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=peer,
                    lw=2.2 if peer == "cukern" else 1.2, ls="--" if peer == "copy" else "-")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 115)
        ax.set_title(f"{op} {dt}", fontsize=10)
        ax.set_xlabel("cols")
        ax.set_ylabel("% of copy bandwidth")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()) if title else None)
    if title:  # in the half inch kept free above the panels
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)

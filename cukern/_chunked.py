"""The chunked engine behind the command line: a row-wise op over arrays larger than memory.

Every array is seen as ``(P, m, Q)``: ``m`` elements of each row of the op (the reduced extent
for x and dy, 1 for a per-row statistic), ``P`` and ``Q`` the independent axes before and after
it. The engine hands the op tiles ``a[p0:p1, :, q0:q1]`` holding whole rows, so any op that
treats rows independently gives the same result chunked as in one piece. Tiles take whole
``P`` slices while a slice fits the chunk, else ranges of ``Q`` within one slice (softmax over
the first axis of a file is tiled by columns).

An op is a function from input tiles to output tiles: ``fn(x, dy, ...) -> (y, ...)``, arrays of
the device it runs on (NumPy or CuPy). Each output tile is reshaped to ``(p, m, q)`` and
written; a *summed* output (dweight, dbias) is instead added up over tiles in float64.

On the GPU two slots alternate, each with pinned host buffers, device buffers and its own
non-blocking stream: while the GPU uploads, computes and downloads one tile, the host writes the
previous result of the other slot to disk and reads the next tile (with a few threads, since
``np.copyto`` releases the GIL). An event per slot orders reuse of its buffers.
"""

from __future__ import annotations

import ctypes
import math
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from ._io import RunError, _size

__all__ = ["Meter", "Result", "as_rows", "auto_chunk_rows", "phase_rows", "run", "tiles"]

HOST_TILE_BYTES = 256 << 20  # pinned bytes per slot (inputs + outputs); PCIe is saturated well
# below this, and two slots of it stay a small share of host memory.
CPU_TILE_BYTES = 256 << 20  # float64 working set per tile for the NumPy reference
GPU_SHARE = 0.5  # of the free device memory, for both slots together
COPY_PIECE = 8 << 20  # host copies are split into pieces of about this size over threads


@dataclass(frozen=True)
class Result:
    """One output of the op: ``m`` elements per row in ``dtype``, or, when ``summed``, an array
    of any shape added up over all tiles (in float64) and returned by :func:`run`."""

    name: str
    m: int
    dtype: np.dtype
    summed: bool = False


def as_rows(a: np.ndarray, p: int, m: int, q: int) -> np.ndarray:
    """The ``(P, m, Q)`` view of a C-contiguous array (a memory map stays one)."""
    if not a.flags.c_contiguous:  # pragma: no cover - the commands pass _io.c_order arrays
        raise ValueError("as_rows: the array is not C-contiguous; reshaping would copy it")
    return a.reshape(p, m, q)


def tiles(p: int, q: int, rows: int) -> Iterator[tuple[int, int, int, int]]:
    """``(p0, p1, q0, q1)`` tiles of at most ``rows`` rows (a row is one (p, q) pair)."""
    if rows >= q:
        step = rows // q
        for p0 in range(0, p, step):
            yield p0, min(p0 + step, p), 0, q
    else:
        for i in range(p):
            for q0 in range(0, q, rows):
                yield i, i + 1, q0, min(q0 + rows, q)


def phase_rows(rows: int, m: int) -> int:
    """Rows a tile of whole rows of ``m`` elements takes on the GPU: a multiple of the rows
    after which a row's offset in its 16-byte word repeats (``16 / gcd(m, 16)``, for elements
    of any size), where at least that many fit, so every row sits at the offset it has in one
    piece. The softmax and forward norm kernels read rows off the 16-byte grid in 16-byte
    packs of memory (``Plan.shifted``), and a row's sums follow its offset."""
    period = 16 // math.gcd(m, 16)
    return rows // period * period if rows >= period else rows


def _max_rows(p: int, q: int, rows: int) -> int:
    return min(rows // q, p) * q if rows >= q else rows


def auto_chunk_rows(inputs, results, device, work_dtype) -> int:
    """Rows per tile: what fits ``GPU_SHARE`` of the free device memory over two slots (capped
    by the pinned-buffer size), or a bounded float64 working set on the CPU."""
    m_in = [a.shape[1] for a in inputs]
    chunked = [r for r in results if not r.summed]
    if device == "cpu":
        per_row = 8 * 4 * (sum(m_in) + sum(r.m for r in chunked))
        return max(1, CPU_TILE_BYTES // max(per_row, 1))
    import cupy as cp

    work = np.dtype(work_dtype).itemsize
    host_row = sum(m * a.dtype.itemsize for m, a in zip(m_in, inputs)) + \
        sum(r.m * np.dtype(r.dtype).itemsize for r in chunked)
    # Device: the uploaded tile, its cast to the working dtype, the op's outputs and their cast
    # to the file dtype, with a quarter more for the op's own scratch.
    dev_row = sum(m * (a.dtype.itemsize + work) for m, a in zip(m_in, inputs)) + \
        sum(r.m * (work + np.dtype(r.dtype).itemsize) for r in chunked)
    dev_row = int(dev_row * 1.25) + 64
    with cp.cuda.Device(device):
        free = cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()
    rows = int(free * GPU_SHARE) // (2 * dev_row)
    if rows < 1:
        raise RunError(f"one row needs about {_size(2 * dev_row)} of GPU memory and "
                       f"{_size(free)} is free; the rows of this file are too long to process "
                       f"on this GPU")
    return max(1, min(rows, HOST_TILE_BYTES // max(host_row, 1)))


def run(fn: Callable, inputs: list[np.ndarray], results: list[Result], sinks: list, *,
        device, chunk_rows: int | None = None, work_dtype=np.float32,
        progress: Callable[[int, int], None] | None = None) -> dict[str, np.ndarray | None]:
    """Apply ``fn`` to every tile of ``inputs`` ((P, m, Q) arrays, any readable kind) and write
    its outputs into ``sinks`` ((P, m, Q) writable arrays; None for summed results).

    ``device``: ``"cpu"`` (fn takes and returns NumPy arrays) or a CUDA device id (CuPy).
    ``progress(rows, bytes)`` is called as tiles complete. Returns the summed results.
    """
    p, _, q = inputs[0].shape
    for a in inputs[1:]:
        if (a.shape[0], a.shape[2]) != (p, q):  # pragma: no cover - the commands check shapes
            raise ValueError(f"run: operand of shape {a.shape} does not tile like "
                             f"{inputs[0].shape}")
    sums: dict[str, np.ndarray | None] = {r.name: None for r in results if r.summed}
    if inputs[0].size == 0:  # no rows, or rows of no elements: nothing to compute
        return sums
    rows = chunk_rows or auto_chunk_rows(inputs, results, device, work_dtype)
    if device != "cpu" and q == 1:
        rows = phase_rows(rows, inputs[0].shape[1])
    report = progress or (lambda rows, nbytes: None)
    if device == "cpu":
        _run_cpu(fn, inputs, results, sinks, sums, tiles(p, q, rows), report)
    else:
        _run_gpu(fn, inputs, results, sinks, sums, tiles(p, q, rows), _max_rows(p, q, rows),
                 int(device), report)
    return sums


def _sl(t):
    p0, p1, q0, q1 = t
    return slice(p0, p1), slice(None), slice(q0, q1)


def _tile_shape(t, m: int) -> tuple[int, int, int]:
    p0, p1, q0, q1 = t
    return p1 - p0, m, q1 - q0


def _outputs(fn, tiles_in, n_results: int) -> tuple:
    outs = fn(*tiles_in)
    if not isinstance(outs, tuple):
        outs = (outs,)
    if len(outs) != n_results:  # pragma: no cover - a bug in a command, not user input
        raise RuntimeError(f"op returned {len(outs)} outputs, expected {n_results}")
    return outs


def _add(sums: dict, name: str, value) -> None:
    if value is None:
        return
    value = np.asarray(value, dtype=np.float64)
    sums[name] = value.copy() if sums[name] is None else sums[name] + value


def _run_cpu(fn, inputs, results, sinks, sums, tile_iter, report) -> None:
    for t in tile_iter:
        sl = _sl(t)
        tiles_in = [np.ascontiguousarray(a[sl]) for a in inputs]
        outs = _outputs(fn, tiles_in, len(results))
        nbytes = sum(x.nbytes for x in tiles_in)
        for r, o, sink in zip(results, outs, sinks):
            if r.summed:
                _add(sums, r.name, o)
            else:
                sink[sl] = np.asarray(o).reshape(_tile_shape(t, r.m))
                nbytes += sink[sl].nbytes
        report((t[1] - t[0]) * (t[3] - t[2]), nbytes)


def _pieces(dst: np.ndarray, src: np.ndarray):
    """Split a tile copy into about COPY_PIECE-sized parts along its longer free axis."""
    n = max(1, min(32, dst.nbytes // COPY_PIECE))
    axis = 0 if dst.shape[0] >= dst.shape[2] else 2
    length = dst.shape[axis]
    n = min(n, length)
    if n <= 1:
        return [(dst, src)]
    bounds = [length * i // n for i in range(n + 1)]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        idx = (slice(a, b),) if axis == 0 else (slice(None), slice(None), slice(a, b))
        out.append((dst[idx], src[idx]))
    return out


class _Slot:
    """One stage of the pipeline: pinned host buffers, device buffers, a stream, an event."""

    def __init__(self, cp, inputs, results, max_rows: int):
        self.cp = cp
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.done = cp.cuda.Event(block=True, disable_timing=True)  # wait without spinning
        # Native byte order: a big-endian file is converted by the copy into pinned memory.
        dtypes = [a.dtype.newbyteorder("=") for a in inputs]
        self.host_in = [_pinned(cp, max_rows * a.shape[1], d) for a, d in zip(inputs, dtypes)]
        self.dev_in = [cp.empty(max_rows * a.shape[1], d) for a, d in zip(inputs, dtypes)]
        self.host_out = [None if r.summed else _pinned(cp, max_rows * r.m, r.dtype)
                         for r in results]
        self.views: list[np.ndarray] = []  # the tile being filled, shaped, in host_in
        # (tile, device outputs kept alive until downloaded, summed outputs, input bytes)
        self.pending = None

    def fill(self, inputs, t, pool) -> list:
        """Start copying the tile's inputs from disk into the pinned buffers."""
        self.views = []
        futures = []
        for a, buf in zip(inputs, self.host_in):
            shape = _tile_shape(t, a.shape[1])
            view = buf[:math.prod(shape)].reshape(shape)
            self.views.append(view)
            for d, s in _pieces(view, a[_sl(t)]):
                futures.append(pool.submit(np.copyto, d, s))
        return futures

    def launch(self, fn, results, t) -> None:
        """Upload, compute and download on this slot's stream; record the event."""
        cp = self.cp
        s = self.stream
        with s:
            tiles_in = []
            for view, dev in zip(self.views, self.dev_in):
                d = dev[:view.size]
                d.data.copy_from_host_async(view.ctypes.data_as(ctypes.c_void_p), view.nbytes, s)
                tiles_in.append(d.reshape(view.shape))
            outs = _outputs(fn, tiles_in, len(results))
            keep, summed = [], []
            for r, o, host in zip(results, outs, self.host_out):
                if r.summed:
                    summed.append((r.name, o))
                    continue
                o = cp.ascontiguousarray(o.astype(r.dtype, copy=False))
                expected = math.prod(_tile_shape(t, r.m))
                if o.size != expected:  # pragma: no cover - a bug in a command
                    raise RuntimeError(f"op output {r.name} has {o.size} elements, expected "
                                       f"{expected}")
                o.data.copy_to_host_async(host.ctypes.data_as(ctypes.c_void_p), o.nbytes, s)
                keep.append(o)
            self.done.record(s)
        self.pending = (t, keep, summed, sum(v.nbytes for v in self.views))

    def retire(self, results, sinks, sums, pool) -> tuple[list, int, int]:
        """Wait for the slot's tile; start writing its outputs. Returns (futures, rows, bytes)."""
        if self.pending is None:
            return [], 0, 0
        t, _, summed, nbytes = self.pending
        self.done.synchronize()
        for name, arr in summed:
            if arr is not None:
                _add(sums, name, self.cp.asnumpy(arr, stream=self.stream))
        futures = []
        for r, host, sink in zip(results, self.host_out, sinks):
            if r.summed:
                continue
            shape = _tile_shape(t, r.m)
            view = host[:math.prod(shape)].reshape(shape)
            nbytes += view.nbytes
            for d, src in _pieces(sink[_sl(t)], view):
                futures.append(pool.submit(np.copyto, d, src))
        self.pending = None
        return futures, (t[1] - t[0]) * (t[3] - t[2]), nbytes

    def drain(self) -> None:
        try:
            self.stream.synchronize()
        except Exception:  # pragma: no cover - the original error matters more
            pass


def _pinned(cp, count: int, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    mem = cp.cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
    return np.frombuffer(mem, dtype, count)


def _run_gpu(fn, inputs, results, sinks, sums, tile_iter, max_rows, device_id, report) -> None:
    import cupy as cp

    with cp.cuda.Device(device_id):
        slots = [_Slot(cp, inputs, results, max_rows) for _ in range(2)]
        pool = ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4))
        order: list[_Slot] = []  # slots with work in flight, oldest first
        try:
            for i, t in enumerate(tile_iter):
                slot = slots[i % 2]
                writes, rows, nbytes = ([], 0, 0)
                if slot.pending is not None:
                    order.remove(slot)
                    writes, rows, nbytes = slot.retire(results, sinks, sums, pool)
                reads = slot.fill(inputs, t, pool)
                _wait(writes + reads)
                if rows:
                    report(rows, nbytes)
                slot.launch(fn, results, t)
                order.append(slot)
            for slot in order:
                writes, rows, nbytes = slot.retire(results, sinks, sums, pool)
                _wait(writes)
                report(rows, nbytes)
        finally:
            for slot in slots:
                slot.drain()
            pool.shutdown(wait=True, cancel_futures=True)


def _wait(futures) -> None:
    if not futures:
        return
    wait(futures)
    for f in futures:
        f.result()  # re-raise the first error


class Meter:
    """Rows done and bytes moved, for a progress line (GB/s over the run so far)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.rows = 0
        self.bytes = 0

    def add(self, rows: int, nbytes: int) -> None:
        self.rows += rows
        self.bytes += nbytes

    @property
    def gbps(self) -> float:
        return self.bytes / max(time.perf_counter() - self.start, 1e-9) / 1e9

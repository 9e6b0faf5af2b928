"""``--workers N`` and ``--scheduler ADDRESS`` of the row-wise op commands: the chunked engine's
tiles (:mod:`cukern._chunked`) as Dask tasks on several GPUs (a dask-cuda
``LocalCUDACluster`` of N workers), several CPU processes (``--device cpu``: a ``distributed``
``LocalCluster`` running the NumPy reference), or an existing cluster.

Each task reopens the memory-mapped inputs, runs the command's op on its rows and writes them
into the output's ``.part`` file (opened ``r+``) itself; only small per-tile sums (dweight,
dbias) come back, added up in tile order. The command renames the outputs into place only
after every task is done (:class:`cukern._io.Outputs`), so a failure anywhere leaves no
output and no ``.part`` file.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass

import numpy as np

from .._chunked import (
    HOST_TILE_BYTES,
    Result,
    _add,
    _outputs,
    _sl,
    _tile_shape,
    auto_chunk_rows,
    tiles,
)
from .._io import InputError, RunError

__all__ = ["run", "check"]


def check(workers: int | None, scheduler: str | None, device) -> bool:
    """Whether the options ask for Dask (``--workers`` above 1, or ``--scheduler``); refuses
    combinations that cannot work (InputError)."""
    if scheduler is not None and workers is not None:
        raise InputError("give --workers N or --scheduler ADDRESS, not both")
    if scheduler is None and (workers is None or workers == 1):
        return False
    if device not in ("cpu", 0) and scheduler is None:
        raise InputError(f"--workers {workers} runs on GPUs 0 to {workers - 1}; --device "
                         f"gpu:{device} picks one GPU (leave it out, or use "
                         f"CUDA_VISIBLE_DEVICES to choose the GPUs)")
    return True


@dataclass(frozen=True)
class _Source:
    """How a task reopens an input: the memory map's file, offset, dtype and (P, m, Q) shape,
    or the array itself when it is not a memory map (sent with the task)."""

    shape: tuple
    dtype: np.dtype
    filename: str | None = None
    offset: int = 0
    array: np.ndarray | None = None

    def open(self) -> np.ndarray:
        if self.filename is None:
            return self.array
        return np.memmap(self.filename, dtype=self.dtype, mode="r", offset=self.offset,
                         shape=self.shape)


def _source(a: np.ndarray) -> _Source:
    name = getattr(a, "filename", None)
    if isinstance(a, np.memmap) and name and a.flags.c_contiguous and _whole_map(a):
        return _Source(a.shape, a.dtype, str(name), int(a.offset))
    return _Source(a.shape, a.dtype, array=np.ascontiguousarray(a))


def _whole_map(a: np.memmap) -> bool:
    """Whether ``a`` begins where its memory map's data begins (``a.offset`` into the file)."""
    try:
        start = np.frombuffer(a._mmap, np.uint8).ctypes.data
    except (AttributeError, TypeError, ValueError):
        return False
    return a.ctypes.data == start + a.offset % mmap.ALLOCATIONGRANULARITY


@dataclass(frozen=True)
class _Job:
    """What every task shares: the op, its inputs and outputs, and where it runs."""

    fn: object
    sources: tuple
    results: tuple
    sinks: tuple  # per result: the output .part file, or None (summed results)
    shape: tuple  # per result: its (P, m, Q) shape
    gpu: bool


def _task(job: _Job, tile) -> tuple[int, int, dict]:
    """One tile: read, compute, write its rows of every output. Returns (rows, bytes, sums)."""
    sl = _sl(tile)
    host = [np.ascontiguousarray(s.open()[sl]) for s in job.sources]
    nbytes = sum(t.nbytes for t in host)
    if job.gpu:
        import cupy

        outs = _outputs(job.fn, [cupy.asarray(t) for t in host], len(job.results))
        outs = [None if o is None else cupy.asnumpy(o) for o in outs]
    else:
        outs = _outputs(job.fn, host, len(job.results))
    sums: dict = {}
    for r, o, path, shape in zip(job.results, outs, job.sinks, job.shape):
        if r.summed:
            sums[r.name] = None if o is None else np.asarray(o, dtype=np.float64)
            continue
        out = np.lib.format.open_memmap(path, mode="r+")
        try:
            sink = out.reshape(shape)
            sink[sl] = np.asarray(o).astype(r.dtype, copy=False).reshape(_tile_shape(tile, r.m))
            nbytes += sink[sl].nbytes
            out.flush()
        finally:
            del out
    return (tile[1] - tile[0]) * (tile[3] - tile[2]), nbytes, sums


def _rows(inputs, results, device, chunk_rows, work) -> int:
    if chunk_rows:
        return chunk_rows
    if device == "cpu":
        return auto_chunk_rows(inputs, results, "cpu", work)
    row = sum(a.shape[1] * a.dtype.itemsize for a in inputs) + \
        sum(r.m * np.dtype(r.dtype).itemsize for r in results if not r.summed)
    return max(1, HOST_TILE_BYTES // max(row, 1))


def _client(workers: int | None, scheduler: str | None, device):
    """(client, cluster or None) for the options."""
    try:
        from distributed import Client, LocalCluster
    except ImportError as err:
        raise RunError(f"--workers and --scheduler need Dask's distributed ({err}); install "
                       f'it with: pip install "cukern[dask]"') from None
    if scheduler is not None:
        try:
            return Client(scheduler, timeout="10s"), None
        except ValueError as err:  # not an address
            raise InputError(f"--scheduler {scheduler}: {err}") from None
        except OSError as err:
            raise RunError(f"--scheduler {scheduler}: cannot connect ({err})") from None
    # No dashboard; the scheduler's HTTP server (which starts anyway) on a free port: its
    # default, 8787, warns on stderr when a notebook's cluster holds it
    quiet = dict(dashboard_address=None, scheduler_kwargs={"dashboard_address": ":0"},
                 silence_logs=logging.CRITICAL)
    if device == "cpu":
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, **quiet)
        return Client(cluster), cluster
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if workers > count:
        raise InputError(f"--workers {workers}: only {count} GPU{'s' if count != 1 else ''} "
                         f"visible")
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError as err:
        raise RunError(f"--workers on GPUs needs dask-cuda ({err}); install it with: "
                       f'pip install "cukern[dask]"') from None
    # two tasks a GPU: one's file reads and writes overlap the other's transfers and kernels
    cluster = LocalCUDACluster(n_workers=workers, threads_per_worker=2, **quiet)
    return Client(cluster), cluster


def run(fn, inputs: list[np.ndarray], results: list[Result], sinks: list, *, device,
        chunk_rows: int | None = None, work_dtype=np.float32, progress=None,
        workers: int | None = None, scheduler: str | None = None) -> dict:
    """:func:`cukern._chunked.run` on Dask workers (same arguments and result), ``sinks``
    being memory maps of ``.npy`` files (what :class:`cukern._io.Outputs` gives)."""
    p, _, q = inputs[0].shape
    sums: dict = {r.name: None for r in results if r.summed}
    if inputs[0].size == 0:
        return sums
    rows = _rows(inputs, results, device, chunk_rows, work_dtype)
    job = _Job(fn, tuple(_source(a) for a in inputs), tuple(results),
               tuple(None if r.summed else str(_filename(s)) for r, s in zip(results, sinks)),
               tuple(None if s is None else s.shape for s in sinks), device != "cpu")
    report = progress or (lambda rows, nbytes: None)
    work = list(tiles(p, q, rows))
    client, cluster = _client(workers, scheduler, device)
    try:
        from distributed import as_completed

        shared = client.scatter(job, broadcast=True, hash=False)
        futures = [client.submit(_task, shared, t, pure=False) for t in work]
        index = {f.key: i for i, f in enumerate(futures)}
        parts: list = [None] * len(work)
        try:
            for fut in as_completed(futures):
                n, nbytes, part = fut.result()
                parts[index[fut.key]] = part
                report(n, nbytes)
        except BaseException:
            client.cancel(futures)
            raise
        for part in parts:  # in tile order: the same sums on every run
            for name, value in part.items():
                _add(sums, name, value)
        return sums
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def _filename(sink) -> str:
    name = getattr(sink, "filename", None)
    if name is None:  # pragma: no cover - Outputs gives memory maps for non-empty outputs
        raise RuntimeError("--workers: an output is not a memory-mapped file")
    return name

"""CUDA-graph capture safety: device memory that a call captured into a graph uses stays allocated.

A call's temporaries (the norm backward's float32 partial sums, batch norm's partial statistics
and coefficients, parameter and input copies) go back to CuPy's memory pool when the call
returns. A CUDA graph captured from that call keeps their addresses and writes them again on
every replay, so memory the pool has handed to someone else since would be overwritten. While
CuPy's current stream is capturing, cukern therefore keeps every allocation an op makes
(through CuPy's allocator) alive until :func:`release_capture_memory` drops it: by default for
the life of the process, as a graph may be replayed at any time.

Outside a capture this costs one stream lookup and one ``cudaStreamIsCapturing`` per call of an
op's full (validating) path or of a fast path with temporaries (a few hundred nanoseconds); the
fast paths without temporaries do not check at all.
"""

from __future__ import annotations

import functools
import threading

try:
    import cupy as cp
except ImportError:  # pragma: no cover - exercised only where CuPy is missing
    cp = None

__all__ = ["capturing", "capture_safe", "keep", "release_capture_memory",
           "capture_memory_bytes"]

# capturing stream pointer -> the memory (MemoryPointer or ndarray) its captured calls used
_kept: dict[int, list] = {}
_lock = threading.Lock()
if cp is not None:
    _get_stream = cp.cuda.get_current_stream
    _is_capturing = cp.cuda.runtime.streamIsCapturing


def capturing() -> int:
    """The pointer of CuPy's current stream when it is capturing a CUDA graph, else 0. The
    legacy default stream (pointer 0) never captures and is not asked (asking it while another
    stream captures in global mode is itself an error). 0 also where CUDA is unusable."""
    try:
        ptr = _get_stream().ptr
        if ptr and _is_capturing(ptr):
            return ptr
    except cp.cuda.runtime.CUDARuntimeError:  # no usable GPU: the op's own checks say so
        pass
    return 0


def _keep(ptr: int, mem) -> None:
    with _lock:
        _kept.setdefault(ptr, []).append(mem)


def keep(*arrays) -> None:
    """Keep a call's temporaries (None skipped) alive if the current stream is capturing: one
    check for all of them, for fast paths that allocate temporaries without
    :func:`capture_safe`."""
    ptr = capturing()
    if ptr:
        for a in arrays:
            if a is not None:
                _keep(ptr, a)


def capture_safe(fn):
    """Runs ``fn`` as it is, or while the current stream captures, with every allocation it
    makes through CuPy's allocator (its outputs, temporaries and CuPy's own) kept alive."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:  # capturing(), inlined: this runs on every call of an op's full path
            ptr = _get_stream().ptr
            if ptr and not _is_capturing(ptr):
                ptr = 0
        except cp.cuda.runtime.CUDARuntimeError:  # no usable GPU: the op's checks say so
            ptr = 0
        if not ptr:
            return fn(*args, **kwargs)
        base = cp.cuda.get_allocator()

        def malloc(size):
            mem = base(size)
            _keep(ptr, mem)
            return mem

        with cp.cuda.using_allocator(malloc):
            return fn(*args, **kwargs)

    return run


def release_capture_memory(stream=None) -> int:
    """Drop the memory kept for calls captured on ``stream`` (a ``cupy.cuda.Stream``, a
    ``torch.cuda.Stream`` or a stream pointer; None: every stream), returning it to CuPy's
    pool. Call it only once no graph captured there will be launched again. Returns the
    number of bytes released."""
    with _lock:
        if stream is None:
            items = [m for ms in _kept.values() for m in ms]
            _kept.clear()
        else:
            ptr = stream if isinstance(stream, int) else getattr(
                stream, "ptr", None) or getattr(stream, "cuda_stream", 0)
            items = _kept.pop(ptr, [])
    return sum(_nbytes(m) for m in items)


def capture_memory_bytes() -> int:
    """Bytes of device memory kept for captured calls (see :func:`release_capture_memory`)."""
    with _lock:
        return sum(_nbytes(m) for ms in _kept.values() for m in ms)


def _nbytes(m) -> int:
    return int(m.nbytes) if hasattr(m, "nbytes") else int(m.mem.size)

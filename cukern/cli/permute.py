"""The ``permute`` command: ``numpy.transpose(x, axes)`` of an array in a file, written in C
order to an ``.npy`` file.

Where axis 0 stays first (``--axes 0,...``), output slice ``y[i]`` is the permutation of input
slice ``x[i]``: the file streams through the GPU in chunks of first-axis slices
(:mod:`cukern._chunked`: pinned buffers, two streams), so files larger than GPU memory work.
Any other order needs the whole array on the GPU at once, input and output; the command refuses
it before writing anything when they do not fit. Files in Fortran order are read as the C-order
array of the reversed shape, with the axes composed. Outputs appear only when complete
(:mod:`cukern._io`).
"""

from __future__ import annotations

import ctypes
import math
import sys

import click
import numpy as np

from .. import _io
from .._chunked import Meter, Result, as_rows, auto_chunk_rows
from .._io import InputError, RunError
from . import common
from .common import _command, _device, _fmt, _output_path, _show_progress, _spec_path
from .ops import _execute, _summary

__all__ = ["permute_cmd", "parse_axes"]

GPU_FIT = 0.9  # of the free GPU memory, for a whole-array permutation's input and output
PIECE_BYTES = 64 << 20  # host <-> device copies of the whole-array path go in pieces of this


@_command("permute")
@click.argument("input", metavar="IN")
@click.option("-o", "--output", required=True, metavar="OUT.npy",
              help="Where to write the result (an .npy file, C order).")
@click.option("--axes", metavar="LIST",
              help="The order of IN's axes in OUT, e.g. 0,2,3,1 (NCHW -> NHWC) or 0,3,1,2 "
                   "(NHWC -> NCHW); negative axes count from the end  [default: reversed, as "
                   "numpy.transpose]")
@click.option("--device", default="gpu", show_default=True, metavar="gpu|gpu:N|cpu",
              help="The GPU to run on, or cpu for NumPy (the same bytes: a permutation only "
                   "moves them).")
@click.option("--chunk-rows", type=click.IntRange(min=1), metavar="N",
              help="First-axis slices per chunk when axis 0 stays first (default: sized from "
                   "free GPU memory); other orders run in one piece.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or summary.")
def permute_cmd(input, output, axes, device, chunk_rows, overwrite, quiet):
    """Permute the axes of IN (numpy.transpose), written in C order to OUT.npy.

    \b
    OUT = numpy.transpose(IN, AXES): axis k of OUT is axis AXES[k] of IN.
      cukern permute acts.npy -o acts_nhwc.npy --axes 0,2,3,1   (NCHW -> NHWC)
      cukern permute acts_nhwc.npy -o acts.npy --axes 0,3,1,2   (NHWC -> NCHW)
    Any rank and any dtype: bool, int8..int64, uint8..uint64, float16, bfloat16,
    float32, float64, complex64, complex128; the bytes are copied exactly (NaN
    payloads, -0.0). With axis 0 first, the file streams through the GPU in
    chunks of first-axis slices, whatever its size. Other orders need IN and OUT
    on the GPU at once; a file too large for that is refused before anything is
    written.
    """
    x = _io.open_array(input, input, any_dtype=True)
    order = parse_axes(axes, x.shape, input)
    shape = tuple(x.shape[a] for a in order)
    dtype = x.dtype.newbyteorder("=")
    if x.ndim > 1 and not x.flags.c_contiguous and x.flags.f_contiguous:
        # A Fortran-order file is the C-order array of the reversed shape.
        x, order = x.T, tuple(x.ndim - 1 - a for a in order)
    x = _io.c_order(x, input)
    out = _output_path(output, "-o", ".npy")
    _io.check_outputs({"-o": (out, _io.npy_bytes(shape, dtype))}, [_spec_path(input)],
                      overwrite=overwrite)
    dev = _device(device)
    fn = _host_permute if dev == "cpu" else common._require(dev, "permute", "permute")
    stream = x.ndim >= 1 and order[0] == 0
    if not stream and dev != "cpu" and x.size:
        _check_fits(x, axes, input, dev)
    with _io.Outputs() as outs:
        y = outs.npy(out, shape, dtype)
        if stream:
            meter = _streamed(fn, x, order, y, dev, chunk_rows, quiet, input)
        else:
            meter = _whole(fn, x, order, y, dev, quiet, input)
        outs.commit()
    _summary(quiet, "permute", [out], meter)


def parse_axes(text: str | None, shape: tuple[int, ...], spec: str) -> tuple[int, ...]:
    """``--axes`` as a permutation of the axes of ``spec``, an array of ``shape`` (None:
    reversed), or InputError naming the option."""
    ndim = len(shape)
    if text is None:
        return tuple(reversed(range(ndim)))
    items = [v for v in text.replace(" ", ",").split(",") if v]
    example = ",".join(map(str, (0, *range(2, ndim), 1))) if ndim > 2 else "1,0"
    try:
        axes = [int(v) for v in items]
    except ValueError:
        raise InputError(f"--axes {text}: expected IN's axes in their new order, comma-"
                         f"separated, like {example}") from None
    dims = f"{ndim} dimension{'s' if ndim != 1 else ''}"
    if len(axes) != ndim:
        raise InputError(f"--axes {text} names {len(axes)} ax{'is' if len(axes) == 1 else 'es'}"
                         f"; {spec} has {dims} (shape {_fmt(shape)}), so it needs "
                         f"{ndim}")
    for a in axes:
        if not -ndim <= a < ndim:
            raise InputError(f"--axes {text}: axis {a} is out of range for {spec}, which has "
                             f"{dims}")
    norm = [a % ndim for a in axes]
    for a in norm:
        if norm.count(a) > 1:
            raise InputError(f"--axes {text} repeats axis {a}; expected each of "
                             f"0..{ndim - 1} once")
    return tuple(norm)


def _host_permute(x: np.ndarray, axes) -> np.ndarray:
    """``--device cpu``: NumPy's transpose (a view; the writer copies it in C order)."""
    return np.transpose(x, axes)


def _check_fits(x: np.ndarray, text: str | None, spec: str, dev: int) -> None:
    """Refuse a whole-array permutation whose input and output do not fit on the GPU."""
    import cupy as cp

    need = 2 * x.nbytes
    with cp.cuda.Device(dev):
        free = cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()
    if need > GPU_FIT * free:
        how = f"--axes {text}" if text is not None else "the default order (reversed)"
        raise RunError(f"{spec} ({_fmt(x.shape)}, {_io._size(x.nbytes)}) does not fit on GPU "
                       f"{dev}: {how} moves axis 0, which needs the whole array and its "
                       f"permutation on the GPU at once ({_io._size(need)}; "
                       f"{_io._size(free)} free). Orders that keep axis 0 first (0,...) "
                       f"stream through the GPU in chunks")


def _streamed(fn, x, order, y, dev, chunk_rows, quiet, spec) -> Meter:
    """y[i] = permute(x[i]) over chunks of first-axis slices, through the chunked engine."""
    p, rest = x.shape[0], x.shape[1:]
    m = math.prod(rest)
    inputs = [as_rows(x, p, m, 1)]
    results = [Result("y", m, y.dtype)]
    if dev != "cpu" and chunk_rows is None and x.size:
        try:
            chunk_rows = auto_chunk_rows(inputs, results, dev, y.dtype)
        except RunError:
            raise RunError(f"one slice {spec}[i] of the first axis ({_fmt(rest)}, "
                           f"{_io._size(m * x.itemsize)}) and its permutation do not fit in "
                           f"GPU memory twice over (two chunks in flight)") from None

    def permute_tile(tile):
        return fn(tile.reshape((tile.shape[0], *rest)), order)

    _, meter = _execute(permute_tile, inputs, results, [as_rows(y, p, m, 1)], device=dev,
                        chunk_rows=chunk_rows, work=y.dtype, quiet=quiet, label="permute")
    return meter


def _whole(fn, x, order, y, dev, quiet, spec) -> Meter:
    """y = permute(x) in one piece: NumPy on the host, or x uploaded in pieces, permuted on the
    GPU and downloaded in pieces straight into the output file."""
    meter = Meter()
    if x.size == 0:
        return meter
    if dev == "cpu":
        y[...] = fn(x, order)
        meter.add(0, 2 * x.nbytes)
        return meter
    import cupy as cp

    xs, ys = x.reshape(-1), y.reshape(-1)
    step = max(1, PIECE_BYTES // x.itemsize)
    bar = click.progressbar(length=2 * x.nbytes, label="permute", file=sys.stderr) \
        if _show_progress(quiet) else None

    def done(nbytes: int) -> None:
        meter.add(0, nbytes)
        if bar is not None:
            bar.update(nbytes)

    try:
        with cp.cuda.Device(dev):
            s = cp.cuda.Stream(non_blocking=True)
            with s:
                xd = cp.empty(x.size, y.dtype)
                for i in range(0, x.size, step):
                    # native byte order and contiguous on the host; a no-op for most files
                    h = np.ascontiguousarray(xs[i:i + step], dtype=y.dtype)
                    xd[i:i + h.size].data.copy_from_host_async(
                        h.ctypes.data_as(ctypes.c_void_p), h.nbytes, s)
                    s.synchronize()  # before h goes
                    done(h.nbytes)
                yd = cp.ascontiguousarray(fn(xd.reshape(x.shape), order)).reshape(-1)
                del xd
                for i in range(0, x.size, step):
                    h = ys[i:i + step]
                    yd[i:i + h.size].data.copy_to_host_async(
                        h.ctypes.data_as(ctypes.c_void_p), h.nbytes, s)
                    s.synchronize()
                    done(h.nbytes)
    except Exception as err:
        if "OutOfMemory" not in type(err).__name__:
            raise
        raise RunError(f"out of GPU memory permuting {spec} ({_io._size(x.nbytes)}) in one "
                       f"piece: it and its permutation must fit on the GPU at once") from None
    finally:
        if bar is not None:
            bar.render_finish()
    return meter

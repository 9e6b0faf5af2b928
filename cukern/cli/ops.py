"""The op commands: ``softmax``, ``layer-norm`` and ``rms-norm`` on arrays in files
(``batch-norm``: :mod:`cukern.cli.batch_norm`).

Each reads its inputs memory-mapped, runs on the GPU in chunks of whole rows sized from free
GPU memory (upload, kernel and download overlapped; see :mod:`cukern._chunked`), and writes an
``.npy`` file that appears only when complete (:mod:`cukern._io`). ``--device cpu`` runs the
float64 NumPy references instead, through the same chunking and file handling.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from pathlib import Path

import click
import numpy as np

from .. import _io
from .._chunked import Meter, Result, as_rows
from .._chunked import run as _run
from .._io import InputError, RunError
from . import _workers, common
from .common import (
    DTYPES,
    _check_eps,
    _check_row,
    _command,
    _device,
    _fmt,
    _open,
    _output_path,
    _parse_shape,
    _same_shape,
    _show_progress,
    _spec_path,
    _work_dtype,
)

__all__ = ["softmax_cmd", "layer_norm_cmd", "rms_norm_cmd"]


# ------------------------------------------------------------------------------------------
# Shared plumbing of the op commands


def _op_options(fn):
    """Options shared by the op commands (softmax, layer-norm, rms-norm)."""
    decorators = [
        click.argument("input", metavar="IN"),
        click.option("-o", "--output", required=True, metavar="OUT.npy",
                     help="Where to write the result (an .npy file)."),
        click.option("--dtype", type=click.Choice(DTYPES),
                     help="Compute and write in this dtype (default: IN's dtype)."),
        click.option("--device", default="gpu", show_default=True, metavar="gpu|gpu:N|cpu",
                     help="The GPU to run on, or cpu for the float64 NumPy reference."),
        click.option("--chunk-rows", type=click.IntRange(min=1), metavar="N",
                     help="Rows per chunk (default: sized from free GPU memory)."),
        click.option("--overwrite", is_flag=True, help="Replace existing output files."),
        click.option("-q", "--quiet", is_flag=True, help="No progress bar or summary."),
    ]
    for d in reversed(decorators):
        fn = d(fn)
    return fn


def _worker_options(fn):
    """--workers and --scheduler of the row-wise commands (:mod:`cukern.cli._workers`)."""
    fn = click.option("--scheduler", metavar="ADDRESS",
                      help="Run the chunks on the Dask cluster at ADDRESS (tcp://host:port); "
                           "its workers must see IN and OUT's folder.")(fn)
    return click.option("--workers", type=click.IntRange(min=1), metavar="N",
                        help="Spread the chunks over N GPUs (a dask-cuda LocalCUDACluster; "
                             "with --device cpu, N processes); needs cukern[dask].")(fn)


def _on_device(device, arrays):
    """Put parameter arrays (None allowed) on the device, finished before any stream uses them."""
    if device == "cpu":
        return arrays
    import cupy as cp

    with cp.cuda.Device(device):
        out = [None if a is None else cp.asarray(a) for a in arrays]
        cp.cuda.Device(device).synchronize()
    return out


def _execute(fn, inputs, results, sinks, *, device, chunk_rows, work, quiet, label,
             workers=None, scheduler=None):
    """Run the chunked engine with a progress bar (rows and GB/s) on a terminal; on Dask
    workers with ``--workers`` / ``--scheduler`` (:mod:`cukern.cli._workers`)."""
    run = _run
    if _workers.check(workers, scheduler, device):
        run = functools.partial(_workers.run, workers=workers, scheduler=scheduler)
    meter = Meter()
    total = inputs[0].shape[0] * inputs[0].shape[2]
    if not _show_progress(quiet) or total == 0:
        sums = run(fn, inputs, results, sinks, device=device, chunk_rows=chunk_rows,
                   work_dtype=work, progress=meter.add)
    else:
        with click.progressbar(length=total, label=label, file=sys.stderr, show_pos=True,
                               item_show_func=lambda _: f"{meter.gbps:.2f} GB/s") as bar:
            def progress(rows: int, nbytes: int) -> None:
                meter.add(rows, nbytes)
                bar.update(rows, current_item=rows)

            sums = run(fn, inputs, results, sinks, device=device, chunk_rows=chunk_rows,
                       work_dtype=work, progress=progress)
    return sums, meter


def _summary(quiet: bool, what: str, paths, meter: Meter) -> None:
    if quiet:
        return
    secs = time.perf_counter() - meter.start
    click.echo(f"{what}: wrote {', '.join(map(str, paths))} in {secs:.2f} s "
               f"({meter.gbps:.2f} GB/s)", err=True)


# ------------------------------------------------------------------------------------------
# softmax


@_command("softmax")
@_op_options
@_worker_options
@click.option("--axis", type=int, default=-1, show_default=True,
              help="The axis to normalise over.")
@click.option("--log", is_flag=True, help="log-softmax instead of softmax.")
@click.option("--grad", metavar="DY.npy",
              help="Backward pass: DY is the gradient with respect to the output, IN the "
                   "saved output y; writes dx.")
def softmax_cmd(input, output, dtype, device, chunk_rows, overwrite, quiet, workers, scheduler,
                axis, log, grad):
    """Softmax of IN along an axis, written to OUT.npy.

    \b
    y = exp(x - max(x)) / sum(exp(x - max(x)))       (--log: log of that)
    With --grad DY.npy, the backward pass from dy (DY) and the saved output y (IN):
    dx = (dy - sum(dy * y)) * y                      (--log: dx = dy - exp(y) * sum(dy))

    Any axis of any shape; chunks hold whole rows. Softmax over the first axis is
    chunked by columns instead, and a 1-D array is a single row that must fit in
    GPU memory.
    """
    op = ("log_softmax" if log else "softmax") + ("" if grad is None else "_backward")
    x = _open(input)
    arrays, specs = [x], [input]
    if grad is not None:  # the op's order: dy, then y
        dy = _open(grad, "--grad")
        _same_shape("--grad", grad, dy, "IN", x)
        arrays, specs = [dy, x], [grad, input]
    if x.ndim == 0:
        raise InputError(f"{input} is a 0-d array; softmax needs at least one axis")
    if not -x.ndim <= axis < x.ndim:
        raise InputError(f"--axis {axis} is out of range for {input}, which has {x.ndim} "
                         f"dimension{'s' if x.ndim > 1 else ''}")
    ax = axis % x.ndim
    work = _work_dtype(dtype, x.dtype)
    p, m, q = math.prod(x.shape[:ax]), x.shape[ax], math.prod(x.shape[ax + 1:])
    out = _output_path(output, "-o", ".npy")
    _io.check_outputs({"-o": (out, _io.npy_bytes(x.shape, work))},
                      [_spec_path(s) for s in specs], overwrite=overwrite)
    dev = _device(device)
    _check_row(dev, m, f"{input} along axis {ax}")
    f = common._require(dev, op, "softmax" if grad is None else "softmax --grad")
    if dev == "cpu":
        def fn(*tiles):
            # Rows made contiguous first: NumPy's summation order depends on the layout, and a
            # chunk must not change a single bit of the result.
            rows = [np.ascontiguousarray(np.moveaxis(t, 1, 2)).astype(work) for t in tiles]
            return np.moveaxis(f(*rows, axis=-1).astype(work), 2, 1)
    else:
        def fn(*tiles):
            return f(*(t.astype(work, copy=False) for t in tiles), axis=1)

    with _io.Outputs() as outs:
        y = outs.npy(out, x.shape, work)
        inputs = [as_rows(_io.c_order(a, s), p, m, q) for a, s in zip(arrays, specs)]
        _, meter = _execute(fn, inputs, [Result("y", m, work)], [as_rows(y, p, m, q)],
                            device=dev, chunk_rows=chunk_rows, work=work, quiet=quiet,
                            label=op.replace("_", " "), workers=workers, scheduler=scheduler)
        outs.commit()
    _summary(quiet, op.replace("_", "-"), [out], meter)


# ------------------------------------------------------------------------------------------
# layer-norm and rms-norm


def _norm_options(bias: bool, eps: float):
    def deco(fn):
        opts = [
            click.option("--normalized-ndim", type=click.IntRange(min=1), metavar="K",
                         help="Normalise over the last K axes (default: --weight's number of "
                              "axes, else 1)."),
            click.option("--normalized-shape", metavar="SHAPE",
                         help="The normalised trailing shape, e.g. 768 or 12x64 (instead of "
                              "--normalized-ndim)."),
            click.option("--weight", metavar="W.npy", help="Scale (gamma), of the normalized "
                                                          "shape."),
        ]
        if bias:
            opts.append(click.option("--bias", metavar="B.npy",
                                     help="Shift (beta), of the normalized shape."))
        opts += [
            click.option("--eps", type=float, default=eps, show_default=True,
                         help="Added to the variance (mean square) before the square root."),
            click.option("--stats", metavar="STATS.npz",
                         help="Forward: also write the per-row statistics here. Backward: "
                              "read them from here (else they are recomputed from IN)."),
            click.option("--grad", metavar="DY.npy",
                         help="Backward pass: DY is the gradient with respect to the output, "
                              "IN the forward input x; writes dx."),
            click.option("--param-grads", metavar="GRADS.npz",
                         help="Backward pass: also write the gradients of the parameters "
                              "given (dweight with --weight; dbias with --weight or --bias), "
                              "summed over all rows."),
        ]
        for d in reversed(opts):
            fn = d(fn)
        return fn

    return deco


@_command("layer-norm")
@_op_options
@_worker_options
@_norm_options(bias=True, eps=1e-5)
def layer_norm_cmd(**kw):
    """Layer norm over the trailing axes of IN, written to OUT.npy.

    \b
    y = (x - mean) * rstd * weight + bias,   rstd = 1 / sqrt(var + eps)
    --stats STATS.npz keeps mean and rstd per row (arrays "mean", "rstd").
    With --grad DY.npy, the backward pass from dy (DY) and the input x (IN):
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * weight,
    --param-grads GRADS.npz writes "dweight" = sum(dy * xhat) (with --weight),
    "dbias" = sum(dy) (with --weight or --bias).
    """
    _norm("layer_norm", **kw)


@_command("rms-norm")
@_op_options
@_worker_options
@_norm_options(bias=False, eps=1e-6)
def rms_norm_cmd(**kw):
    """RMS norm over the trailing axes of IN, written to OUT.npy.

    \b
    y = x * rstd * weight,   rstd = 1 / sqrt(mean(x^2) + eps)
    --stats STATS.npz keeps rstd per row (array "rstd").
    With --grad DY.npy, the backward pass from dy (DY) and the input x (IN):
    dx = rstd * (g - xhat * mean(g * xhat)),  g = dy * weight,  xhat = x * rstd;
    --param-grads GRADS.npz writes "dweight" = sum(dy * xhat).
    """
    _norm("rms_norm", bias=None, **kw)


def _norm(op, input, output, dtype, device, chunk_rows, overwrite, quiet, workers, scheduler,
          normalized_ndim, normalized_shape, weight, bias, eps, stats, grad,
          param_grads) -> None:
    command = op.replace("_", "-")
    layer = op == "layer_norm"
    stat_names = ("mean", "rstd") if layer else ("rstd",)
    x = _open(input)
    specs = [input]
    w = _open(weight, "--weight") if weight else None
    b = _open(bias, "--bias") if bias else None
    nshape = _normalized_shape(x, input, normalized_ndim, normalized_shape, w)
    k = len(nshape)
    lead = x.shape[:x.ndim - k]
    for opt, spec, a in (("--weight", weight, w), ("--bias", bias, b)):
        if a is not None:
            if a.shape != nshape:
                last = f"last {k} axes" if k > 1 else "last axis"
                raise InputError(f"{opt} {spec} has shape {_fmt(a.shape)}, expected "
                                 f"{_fmt(nshape)}, the normalized shape (the {last} of IN)")
            specs.append(spec)
    backward = grad is not None
    if not backward and param_grads:
        raise InputError("--param-grads needs --grad DY.npy: it is part of the backward pass")
    # the gradients of the parameters given: dweight with --weight, dbias with either
    grad_names = [n for n, on in (("dweight", w is not None),
                                  ("dbias", layer and (w is not None or b is not None))) if on]
    if param_grads and not grad_names:
        raise InputError("--param-grads needs --weight" + (" or --bias" if layer else "") +
                         ": the gradients are the parameters'")
    work = _work_dtype(dtype, x.dtype)
    _check_eps(op, eps, work)
    stat_dtype = np.dtype(np.float64 if work == np.float64 else np.float32)
    p, m = math.prod(lead), math.prod(nshape)
    if m == 0:
        raise InputError(f"{input} has shape {_fmt(x.shape)}: the normalized shape "
                         f"{_fmt(nshape)} holds no elements")

    out = _output_path(output, "-o", ".npy")
    targets = {"-o": (out, _io.npy_bytes(x.shape, work))}
    arrays, array_specs = [x], [input]
    saved: list[np.ndarray] = []
    if backward:  # the op's order: dy, then x (then the statistics)
        dy = _open(grad, "--grad")
        _same_shape("--grad", grad, dy, "IN", x)
        arrays, array_specs = [dy, x], [grad, input]
        specs.append(grad)
        if stats:
            if _spec_path(stats).suffix != ".npz":
                raise InputError(f"--stats {stats}: expected the .npz file the forward pass "
                                 f"wrote")
            for name in stat_names:
                s = _open(f"{stats}:{name}", "--stats")
                if s.shape != lead:
                    raise InputError(f"--stats {stats}:{name} has shape {_fmt(s.shape)}, "
                                     f"expected {_fmt(lead)} (one value per row of IN)")
                saved.append(s)
            specs.append(stats)
        if param_grads:
            targets["--param-grads"] = (_output_path(param_grads, "--param-grads", ".npz"),
                                        2 * _io.npy_bytes(nshape, work))
    elif stats:
        targets["--stats"] = (_output_path(stats, "--stats", ".npz"),
                              2 * len(stat_names) * _io.npy_bytes(lead, stat_dtype))
    _io.check_outputs(targets, [_spec_path(s) for s in specs], overwrite=overwrite)

    dev = _device(device)
    _check_row(dev, m, f"{input} over the normalized shape {_fmt(nshape)}")
    fwd = common._require(dev, op, command)
    bwd = common._require(dev, f"{op}_backward", f"{command} --grad") if backward else None
    params = [None if a is None else np.asarray(a).astype(work).reshape(m) for a in (w, b)]
    wd, bd = _on_device(dev, params)
    copy = dev == "cpu"  # a NumPy tile is a fresh array already; a CuPy one is reused

    def cast(t):
        return t.astype(work, copy=copy)

    want_stats = bool(stats) and not backward
    want_grads = bool(param_grads)
    n_saved = len(saved)

    def fn(*tiles):
        rows = tiles[0].shape[0]
        if not backward:
            xt = cast(tiles[0]).reshape(rows, m)
            res = fwd(xt, (m,), wd, bd, eps, return_stats=True) if layer else \
                fwd(xt, (m,), wd, eps, return_stats=True)
            return tuple(res[:1 + len(stat_names) * want_stats])
        dyt, xt = (cast(t).reshape(rows, m) for t in tiles[:2])
        if n_saved:
            st = [t.reshape(rows).astype(stat_dtype, copy=False) for t in tiles[2:]]
        else:
            res = fwd(xt, (m,), None, None, eps, return_stats=True) if layer else \
                fwd(xt, (m,), None, eps, return_stats=True)
            st = [t.astype(stat_dtype, copy=False) for t in res[1:]]  # as if saved
        res = bwd(dyt, xt, *st, wd, bd) if layer else bwd(dyt, xt, *st, wd)
        dx = res[0].astype(work) if dev == "cpu" else res[0]
        if not want_grads:
            return (dx,)
        return (dx,) + tuple(g for n, g in zip(("dweight", "dbias"), res[1:]) if n in grad_names)

    results = [Result("y", m, work)]
    if want_stats:
        results += [Result(n, 1, stat_dtype) for n in stat_names]
    if want_grads:
        results += [Result(n, m, work, summed=True) for n in grad_names]
    label = command + (" backward" if backward else "")

    with _io.Outputs() as outs:
        y = outs.npy(out, x.shape, work)
        sinks = [as_rows(y, p, m, 1)]
        scratch = []
        if want_stats:
            scratch = [outs.scratch(Path(stats), lead, stat_dtype) for _ in stat_names]
            sinks += [as_rows(s, p, 1, 1) for s in scratch]
        sinks += [None] * want_grads * len(grad_names)
        inputs = [as_rows(_io.c_order(a, s), p, m, 1) for a, s in zip(arrays, array_specs)]
        inputs += [as_rows(_io.c_order(s, "--stats"), p, 1, 1) for s in saved]
        sums, meter = _execute(fn, inputs, results, sinks, device=dev, chunk_rows=chunk_rows,
                               work=work, quiet=quiet, label=label, workers=workers,
                               scheduler=scheduler)
        written = [out]
        if want_stats:
            outs.npz(Path(stats), dict(zip(stat_names, scratch)))
            written.append(Path(stats))
        if want_grads:
            grads = {n: v.reshape(nshape).astype(work) for n, v in sums.items()
                     if v is not None}
            if not grads and p:
                raise RunError(f"{command}: the backward pass returned no parameter "
                               f"gradients")
            if p == 0:  # no rows: the sums are zero
                grads = {n: np.zeros(nshape, work) for n in sums}
            outs.npz(Path(param_grads), grads)
            written.append(Path(param_grads))
        outs.commit()
    _summary(quiet, label, written, meter)


def _normalized_shape(x, spec, ndim, shape_text, w) -> tuple[int, ...]:
    if ndim is not None and shape_text is not None:
        raise InputError("give --normalized-ndim or --normalized-shape, not both")
    if shape_text is not None:
        shape = _parse_shape(shape_text, "--normalized-shape")
        if x.shape[x.ndim - len(shape):] != shape or len(shape) > x.ndim:
            raise InputError(f"--normalized-shape {shape_text} does not match the trailing "
                             f"axes of {spec}, which has shape {_fmt(x.shape)}")
        return shape
    k = ndim if ndim is not None else (w.ndim if w is not None and w.ndim else 1)
    if k > x.ndim:
        raise InputError(f"{spec} has {x.ndim} dimension{'s' if x.ndim != 1 else ''}; "
                         f"normalizing over the last {k} needs at least {k}")
    return tuple(x.shape[x.ndim - k:])

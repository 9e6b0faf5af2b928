"""The ``cukern`` command line: cukern's ops on arrays in ``.npy``/``.npz`` files.

Each op command reads its inputs memory-mapped, runs on the GPU in chunks of whole rows sized
from free GPU memory (upload, kernel and download overlapped; see :mod:`cukern._chunked`), and
writes an ``.npy`` file that appears only when complete (:mod:`cukern._io`). ``--device cpu``
runs the float64 NumPy references instead, through the same chunking and file handling.

Errors are one line on stderr and exit status 2 (the files or arguments are wrong) or 1 (the
machine cannot do it); ``--debug`` shows the traceback.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import sys
import time
from pathlib import Path

import click
import numpy as np

from . import __version__, _io
from ._chunked import Meter, Result, as_rows, run
from ._io import InputError, RunError

__all__ = ["main", "app"]

DTYPES = ("float16", "bfloat16", "float32", "float64")
HELP = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


# ------------------------------------------------------------------------------------------
# The group, errors and shared options


class _Group(click.Group):
    def list_commands(self, ctx):
        return list(self.commands)  # in the order they are defined, not alphabetical


class _Fail(click.ClickException):
    """A one-line ``Error: ...`` on stderr with the given exit status."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.exit_code = code


@click.group("cukern", cls=_Group, context_settings=HELP)
@click.version_option(__version__, prog_name="cukern", message="%(prog)s %(version)s")
@click.option("--debug", is_flag=True, help="Show the full traceback when something fails.")
@click.pass_context
def app(ctx: click.Context, debug: bool) -> None:
    """Fast CUDA kernels for arrays on disk.

    \b
    Op commands read IN.npy (or ARRAY.npz:KEY) and write OUT.npy:
      cukern softmax logits.npy -o probs.npy --dtype float16
      cukern layer-norm x.npy -o y.npy --weight w.npy --bias b.npy --stats stats.npz
    Files larger than the GPU are processed in chunks of whole rows, with the
    same result as in one piece. The output appears only when complete: a
    failed or interrupted run leaves no partial file and never touches the input.
    --device cpu runs the float64 NumPy reference instead (slow; no GPU needed).

    Errors are one line on stderr, exit status 2 for bad files or arguments and 1
    when the machine cannot do it (no GPU, no disk space); --debug shows more.
    """
    ctx.ensure_object(dict)["debug"] = debug


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``cukern`` console script. SIGTERM ends a run like Ctrl-C does:
    through the cleanup that removes its unfinished output files."""
    import signal

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    try:
        signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread: leave signals alone
        pass
    app.main(args=argv, prog_name="cukern")


def _command(name: str):
    """Register a command with a ``--debug`` option and the error policy above."""

    def wrap(fn):
        @functools.wraps(fn)
        def run_it(*args, debug: bool = False, **kwargs):
            ctx = click.get_current_context()
            debug = debug or bool((ctx.find_root().obj or {}).get("debug"))
            try:
                return fn(*args, **kwargs)
            except (click.exceptions.Exit, click.ClickException, click.Abort, KeyboardInterrupt):
                raise
            except InputError as err:
                if debug:
                    raise
                raise _Fail(str(err), 2) from None
            except RunError as err:
                if debug:
                    raise
                raise _Fail(str(err), 1) from None
            except Exception as err:
                if debug:
                    raise
                raise _Fail(_describe(err), 1) from None

        cmd = app.command(name, context_settings=HELP)(run_it)
        cmd.params.append(click.Option(["--debug"], is_flag=True,
                                       help="Show the full traceback when something fails."))
        return cmd

    return wrap


def _describe(err: BaseException) -> str:
    """One line for an unexpected error: its type and the first line of its message."""
    kind = type(err).__name__
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if "OutOfMemory" in kind:
        return (f"out of GPU memory ({text}); pass a smaller --chunk-rows "
                f"(run with --debug for the traceback)")
    return f"{kind}: {text} (run with --debug for the traceback)"


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


# ------------------------------------------------------------------------------------------
# Devices


def _gpu_problem(device_id: int = 0) -> str | None:
    """Why the GPU ``device_id`` cannot be used, or None."""
    try:
        import cupy
    except ImportError as err:
        return f"CuPy is not importable ({err}); install cukern[cuda12] or cukern[cuda13]"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # no driver, a driver too old, no device
        return f"no CUDA GPU visible ({_short(err)})"
    if count == 0:
        return "no CUDA GPU visible"
    if device_id >= count:
        return f"GPU {device_id} does not exist ({count} visible)"
    return None


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text.split(": ", 1)[-1] if text.startswith("cuda") else text


def _device(spec: str, instead: str = "--device cpu runs the NumPy reference instead"):
    """``--device``: ``"cpu"``, or a usable CUDA device id (else RunError, suggesting
    ``instead``)."""
    s = spec.strip().lower()
    if s == "cpu":
        return "cpu"
    if s in ("gpu", "cuda"):
        dev = 0
    else:
        tail = s.split(":", 1)[1] if s.startswith(("gpu:", "cuda:")) else s
        if not tail.isdigit():
            raise InputError(f"--device {spec}: expected gpu, gpu:N or cpu")
        dev = int(tail)
    problem = _gpu_problem(dev)
    if problem:
        raise RunError(f"{problem}; {instead}")
    return dev


def _require(device, name: str, command: str):
    """The op function ``name`` (cukern.NAME on a GPU, cukern.reference.NAME on the CPU)."""
    module = importlib.import_module("cukern.reference" if device == "cpu" else "cukern")
    fn = getattr(module, name, None)
    if fn is None:
        raise RunError(f"{command} is not available: this cukern has no "
                       f"{module.__name__}.{name}")
    return fn


def _on_device(device, arrays):
    """Put parameter arrays (None allowed) on the device, finished before any stream uses them."""
    if device == "cpu":
        return arrays
    import cupy as cp

    with cp.cuda.Device(device):
        out = [None if a is None else cp.asarray(a) for a in arrays]
        cp.cuda.Device(device).synchronize()
    return out


# ------------------------------------------------------------------------------------------
# Shared plumbing of the op commands


def _output_path(value: str, opt: str, suffix: str) -> Path:
    path = Path(value)
    if path.suffix != suffix:
        raise InputError(f"{opt} {value}: the output must be a {suffix} file")
    return path


def _work_dtype(dtype: str | None, like: np.dtype) -> np.dtype:
    return _io.float_dtype(like if dtype is None else _np_dtype(dtype), "--dtype")


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        from ml_dtypes import bfloat16

        return np.dtype(bfloat16)
    return np.dtype(name)


def _same_shape(opt: str, path: str, a: np.ndarray, ref_name: str, ref: np.ndarray) -> None:
    if a.shape != ref.shape:
        raise InputError(f"{opt} {path} has shape {_fmt(a.shape)}, expected {_fmt(ref.shape)} "
                         f"(the shape of {ref_name})")


def _fmt(shape) -> str:
    return "x".join(map(str, shape)) if len(shape) else "()"


def _spec_path(spec: str) -> Path:
    return _io.split_spec(spec)[0]


def _execute(fn, inputs, results, sinks, *, device, chunk_rows, work, quiet, label):
    """Run the chunked engine with a progress bar (rows and GB/s) on a terminal."""
    meter = Meter()
    total = inputs[0].shape[0] * inputs[0].shape[2]
    if quiet or not _isatty(sys.stderr) or total == 0:
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


def _isatty(f) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):
        return False


def _summary(quiet: bool, what: str, paths, meter: Meter) -> None:
    if quiet:
        return
    secs = time.perf_counter() - meter.start
    click.echo(f"{what}: wrote {', '.join(map(str, paths))} in {secs:.2f} s "
               f"({meter.gbps:.2f} GB/s)", err=True)


def _open(spec: str, opt: str | None = None) -> np.ndarray:
    what = f"{opt} {spec}" if opt else spec
    return _io.open_array(spec, what)


# ------------------------------------------------------------------------------------------
# softmax


_SOFTMAX = {(False, False): "softmax", (True, False): "log_softmax",
            (False, True): "softmax_backward", (True, True): "log_softmax_backward"}


@_command("softmax")
@_op_options
@click.option("--axis", type=int, default=-1, show_default=True,
              help="The axis to normalise over.")
@click.option("--log", is_flag=True, help="log-softmax instead of softmax.")
@click.option("--grad", metavar="DY.npy",
              help="Backward pass: IN is the saved output y, DY the gradient with respect to "
                   "it; writes dx.")
def softmax_cmd(input, output, dtype, device, chunk_rows, overwrite, quiet, axis, log, grad):
    """Softmax of IN along an axis, written to OUT.npy.

    \b
    y = exp(x - max(x)) / sum(exp(x - max(x)))       (--log: log of that)
    With --grad DY.npy, the backward pass: IN is y, the saved output, and
    dx = (dy - sum(dy * y)) * y                      (--log: dx = dy - exp(y) * sum(dy))

    Any axis of any shape; chunks hold whole rows. Softmax over the first axis is
    chunked by columns instead, and a 1-D array is a single row that must fit in
    GPU memory.
    """
    op = _SOFTMAX[(log, grad is not None)]
    x = _open(input)
    arrays, specs = [x], [input]
    if grad is not None:
        dy = _open(grad, "--grad")
        _same_shape("--grad", grad, dy, "IN", x)
        arrays.append(dy)
        specs.append(grad)
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
    f = _require(dev, op, "softmax" if grad is None else "softmax --grad")
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
                            label=op.replace("_", " "))
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
                         help="Backward pass: IN is the forward input x, DY the gradient "
                              "with respect to the output; writes dx."),
            click.option("--param-grads", metavar="GRADS.npz",
                         help="Backward pass: also write the weight's (and bias's) gradient, "
                              "summed over all rows."),
        ]
        for d in reversed(opts):
            fn = d(fn)
        return fn

    return deco


@_command("layer-norm")
@_op_options
@_norm_options(bias=True, eps=1e-5)
def layer_norm_cmd(**kw):
    """Layer norm over the trailing axes of IN, written to OUT.npy.

    \b
    y = (x - mean) * rstd * weight + bias,   rstd = 1 / sqrt(var + eps)
    --stats STATS.npz keeps mean and rstd per row (arrays "mean", "rstd").
    With --grad DY.npy, the backward pass: IN is x, and
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * weight,
    --param-grads GRADS.npz writes "dweight" = sum(dy * xhat), "dbias" = sum(dy).
    """
    _norm("layer_norm", **kw)


@_command("rms-norm")
@_op_options
@_norm_options(bias=False, eps=1e-6)
def rms_norm_cmd(**kw):
    """RMS norm over the trailing axes of IN, written to OUT.npy.

    \b
    y = x * rstd * weight,   rstd = 1 / sqrt(mean(x^2) + eps)
    --stats STATS.npz keeps rstd per row (array "rstd").
    With --grad DY.npy, the backward pass: IN is x, and
    dx = rstd * (g - xhat * mean(g * xhat)),  g = dy * weight,  xhat = x * rstd;
    --param-grads GRADS.npz writes "dweight" = sum(dy * xhat).
    """
    _norm("rms_norm", bias=None, **kw)


def _norm(op, input, output, dtype, device, chunk_rows, overwrite, quiet, normalized_ndim,
          normalized_shape, weight, bias, eps, stats, grad, param_grads) -> None:
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
    if param_grads and w is None:
        raise InputError("--param-grads needs --weight: the gradients are the weight's "
                         "(and the bias's)")
    work = _work_dtype(dtype, x.dtype)
    stat_dtype = np.dtype(np.float64 if work == np.float64 else np.float32)
    p, m = math.prod(lead), math.prod(nshape)
    if m == 0:
        raise InputError(f"{input} has shape {_fmt(x.shape)}: the normalized shape "
                         f"{_fmt(nshape)} holds no elements")

    out = _output_path(output, "-o", ".npy")
    targets = {"-o": (out, _io.npy_bytes(x.shape, work))}
    arrays = [x]
    saved: list[np.ndarray] = []
    if backward:
        dy = _open(grad, "--grad")
        _same_shape("--grad", grad, dy, "IN", x)
        arrays.append(dy)
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
    fwd = _require(dev, op, command)
    bwd = _require(dev, f"{op}_backward", f"{command} --grad") if backward else None
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
        xt = cast(tiles[0]).reshape(rows, m)
        if not backward:
            res = fwd(xt, (m,), wd, bd, eps) if layer else fwd(xt, (m,), wd, eps)
            return tuple(res[:1 + len(stat_names) * want_stats])
        dyt = cast(tiles[1]).reshape(rows, m)
        if n_saved:
            st = [t.reshape(rows).astype(stat_dtype, copy=False) for t in tiles[2:]]
        else:
            res = fwd(xt, (m,), None, None, eps) if layer else fwd(xt, (m,), None, eps)
            st = [t.astype(stat_dtype, copy=False) for t in res[1:]]  # as if saved
        res = bwd(dyt, xt, *st, wd)
        dx = res[0].astype(work) if dev == "cpu" else res[0]
        return (dx,) + tuple(res[1:1 + (2 if layer else 1)] if want_grads else ())

    results = [Result("y", m, work)]
    if want_stats:
        results += [Result(n, 1, stat_dtype) for n in stat_names]
    if want_grads:
        results += [Result(n, m, work, summed=True)
                    for n in (("dweight", "dbias") if layer else ("dweight",))]
    label = command + (" backward" if backward else "")

    with _io.Outputs() as outs:
        y = outs.npy(out, x.shape, work)
        sinks = [as_rows(y, p, m, 1)]
        scratch = []
        if want_stats:
            scratch = [outs.scratch(Path(stats), lead, stat_dtype) for _ in stat_names]
            sinks += [as_rows(s, p, 1, 1) for s in scratch]
        sinks += [None] * want_grads * (2 if layer else 1)
        inputs = [as_rows(_io.c_order(a, s), p, m, 1) for a, s in zip(arrays, specs)]
        inputs += [as_rows(_io.c_order(s, "--stats"), p, 1, 1) for s in saved]
        sums, meter = _execute(fn, inputs, results, sinks, device=dev, chunk_rows=chunk_rows,
                               work=work, quiet=quiet, label=label)
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


def _parse_shape(text: str, opt: str) -> tuple[int, ...]:
    parts = [t for t in text.replace(",", "x").replace("*", "x").lower().split("x")]
    try:
        shape = tuple(int(t) for t in parts)
    except ValueError:
        raise InputError(f"{opt} {text}: expected sizes like 768 or 12x64") from None
    if not shape or any(n < 0 for n in shape):
        raise InputError(f"{opt} {text}: expected sizes like 768 or 12x64")
    return shape


# ------------------------------------------------------------------------------------------
# explain, info


@_command("explain")
@click.argument("op", metavar="OP")
@click.option("--shape", required=True, metavar="SHAPE", help="The array's shape, e.g. 49152x1000.")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--axis", type=int, default=-1, show_default=True)
@click.option("--device", default="auto", show_default=True, metavar="auto|h100|a100|gpu:N",
              help="auto: the current GPU if one is visible, else the H100 preset.")
@click.option("--weight", is_flag=True, help="The norm is given a weight.")
@click.option("--bias", is_flag=True, help="The layer norm is given a bias.")
@click.option("--residual", is_flag=True, help="The norm is given a residual.")
def explain_cmd(op, shape, dtype, axis, device, weight, bias, residual):
    """Show the kernel plan for OP on an array, without running anything.

    \b
    OP is one of the planner's ops, e.g. softmax, log-softmax, softmax-backward, layer-norm.
    Works with no GPU: the H100 and A100 presets plan from an occupancy model.
    \b
      cukern explain softmax --shape 49152x1000 --dtype float16
      cukern explain layer-norm --shape 2048x65536 --dtype float16 --weight --residual
    """
    from . import _dispatch
    from ._device import DeviceSpec
    from ._explain import explain

    name = op.replace("-", "_")
    if name not in _dispatch.OPS:
        choices = ", ".join(o.replace("_", "-") for o in _dispatch.OPS)
        raise InputError(f"unknown op {op!r}; expected one of {choices}")
    dims = _parse_shape(shape, "--shape")
    presets = {"h100": DeviceSpec.h100, "a100": DeviceSpec.a100}
    d = device.strip().lower()
    if d == "auto":
        spec = None
    elif d in presets:
        spec = presets[d]()
    else:
        spec = _device(device, "--device h100 or a100 plans for a preset instead")
        if spec == "cpu":
            raise InputError("--device cpu: explain plans GPU kernels; use auto, h100, a100 or "
                             "gpu:N")
    try:
        plan = explain(name, dims, dtype, axis=axis, device=spec, weight=weight, bias=bias,
                       residual=residual)
    except (ValueError, TypeError) as err:
        raise InputError(str(err).removeprefix("explain: ")) from None
    click.echo(str(plan))


@_command("info")
def info_cmd():
    """GPUs, library versions and the kernel cache."""
    rows = [("cukern", __version__), ("NumPy", np.__version__)]
    try:
        import cupy
    except ImportError as err:
        rows.append(("CuPy", f"not importable ({err})"))
        _table(rows)
        return
    rows.append(("CuPy", cupy.__version__))
    rt = cupy.cuda.runtime
    rows.append(("CUDA runtime", _cuda_version(rt.runtimeGetVersion)))
    rows.append(("CUDA driver", _cuda_version(rt.driverGetVersion)))
    try:
        from cupy.cuda import nvrtc

        major, minor = nvrtc.getVersion()
        rows.append(("NVRTC", f"{major}.{minor}"))
    except Exception as err:
        rows.append(("NVRTC", f"not available ({_short(err)})"))
    cache, files, size = _kernel_cache()
    rows.append(("kernel cache", f"{cache} ({files} files, {_io._size(size)})"))
    problem = _gpu_problem()
    if problem:
        rows.append(("GPU", f"none: {problem}"))
    else:
        from ._device import DeviceSpec

        for dev in range(rt.getDeviceCount()):
            spec = DeviceSpec.from_device(dev)
            with cupy.cuda.Device(dev):
                free, total = rt.memGetInfo()
            major, minor = spec.compute_capability
            rows += [
                (f"GPU {dev}", spec.name),
                ("  compute", f"sm_{major}{minor}, {spec.sms} SMs"),
                ("  memory", f"{total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"),
                ("  shared memory", f"{spec.smem_per_block_optin // 1024} KiB per block "
                                    f"(opt-in), {spec.smem_per_sm // 1024} KiB per SM"),
            ]
    _table(rows)


def _cuda_version(get) -> str:
    try:
        v = get()
    except Exception as err:
        return f"unknown ({_short(err)})"
    return f"{v // 1000}.{v % 1000 // 10}" if v else "none"


def _kernel_cache() -> tuple[str, int, int]:
    """CuPy's on-disk kernel cache (where cukern's compiled kernels live): path, files, bytes."""
    path = os.environ.get("CUPY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cupy",
                                                            "kernel_cache")
    files = size = 0
    if os.path.isdir(path):
        for entry in os.scandir(path):
            if entry.is_file():
                files += 1
                size += entry.stat().st_size
    return path, files, size


def _table(rows) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{width}}  {v}")


# ------------------------------------------------------------------------------------------
# bench


@_command("bench")
@click.argument("op", required=False, default="softmax", metavar="[OP]")
@click.option("--cols", default="32..32768", show_default=True, metavar="RANGE|LIST",
              help="Row lengths: A..B (powers of two from A to B) or a list like 1000,4096.")
@click.option("--dtype", "dtypes", default="float16,bfloat16,float32", show_default=True,
              metavar="LIST", help="Comma-separated dtypes.")
@click.option("--rows", type=click.IntRange(min=1), metavar="N",
              help="Rows of every shape (default: the harness's choice, enough to leave L2).")
@click.option("--vs", default="torch,jax,cupyx", show_default=True, metavar="LIST",
              help="Peers to time as well (those not installed are skipped), or none.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON instead.")
@click.option("--plot", metavar="FILE.png", help="Also plot GB/s against cols into FILE.png.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def bench_cmd(op, cols, dtypes, rows, vs, as_json, plot, quiet):
    """Time OP (default softmax) against a device copy and peers.

    \b
    Prints a table of GB/s (bytes that must move / median time) and % of a
    same-size device copy measured in the same run, for cukern and each peer.
      cukern bench softmax --cols 256..16384 --dtype float16 --vs torch
    """
    bench = importlib.import_module("cukern._bench")  # NumPy only until it runs
    known = getattr(bench, "OPS", None) or importlib.import_module("cukern._dispatch").OPS
    name = op.replace("-", "_")
    if name not in known:
        choices = ", ".join(o.replace("_", "-") for o in known)
        raise InputError(f"unknown op {op!r}; bench knows {choices}")
    cols_list = _parse_cols(cols)
    dtype_list = _parse_list(dtypes, "--dtype", DTYPES)
    peers = () if vs.strip().lower() in ("", "none") else tuple(
        _parse_list(vs, "--vs", None))
    if plot is not None and not Path(plot).parent.is_dir():
        raise InputError(f"--plot {plot}: folder {Path(plot).parent} does not exist")
    problem = _gpu_problem()
    if problem:
        raise RunError(f"{problem}; bench times GPU kernels")
    rows_fn = (lambda c: rows) if rows else None
    total = len(cols_list) * len(dtype_list)
    show = not quiet and _isatty(sys.stderr)
    if show:
        with click.progressbar(length=total, label=f"bench {name}", file=sys.stderr,
                               show_pos=True, item_show_func=lambda item: item) as bar:
            results = bench.sweep(name, dtype_list, cols_list, rows_fn=rows_fn, vs=peers,
                                  progress=_BenchProgress(bar))
    else:
        results = bench.sweep(name, dtype_list, cols_list, rows_fn=rows_fn, vs=peers,
                              progress=None)
    if as_json:
        click.echo(json.dumps(results, indent=1, default=_json_default))
    else:
        click.echo(_bench_table(results))
    if plot is not None:
        bench.plot(results, plot)
        if not as_json:
            click.echo(f"plot: {plot}", err=True)


class _BenchProgress:
    """Progress callback for ``_bench.sweep``, which reports each measurement as a dict: the
    bar counts (dtype, cols) shapes and shows the one being measured."""

    def __init__(self, bar):
        self.bar = bar
        self.shape = None

    def __call__(self, result: dict) -> None:
        shape = (result.get("dtype"), result.get("cols"))
        if self.shape is not None and shape != self.shape:
            self.bar.update(1)
        self.shape = shape
        self.bar.current_item = f"{shape[0]} cols={shape[1]}"
        self.bar.render_progress()


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    return str(o)


def _parse_cols(text: str) -> list[int]:
    t = text.replace(" ", "")
    try:
        if ".." in t:
            a, b = (int(v) for v in t.split("..", 1))
            if not 1 <= a <= b:
                raise ValueError
            out = []
            while a <= b:
                out.append(a)
                a *= 2
            return out
        out = [int(v) for v in t.split(",") if v]
        if not out or min(out) < 1:
            raise ValueError
        return out
    except ValueError:
        raise InputError(f"--cols {text}: expected A..B (like 32..32768) or a list like "
                         f"1000,4096") from None


def _parse_list(text: str, opt: str, allowed) -> list[str]:
    items = [v.strip() for v in text.split(",") if v.strip()]
    if not items:
        raise InputError(f"{opt} is empty")
    if allowed is not None:
        bad = [v for v in items if v not in allowed]
        if bad:
            raise InputError(f"{opt}: unknown {', '.join(bad)}; expected {', '.join(allowed)}")
    return items


def _bench_table(results: list[dict]) -> str:
    """One line per (op, dtype, rows, cols): GB/s and % of copy for cukern and each peer."""
    if not results:
        return "no results"
    key = ("op", "dtype", "rows", "cols")
    peers: list[str] = []
    groups: dict[tuple, dict[str, dict]] = {}
    for r in results:
        peer = r.get("peer") or "cukern"
        if peer not in peers:
            peers.append(peer)
        groups.setdefault(tuple(r.get(k) for k in key), {})[peer] = r
    for first in ("copy", "cukern"):  # cukern, then the copy it is measured against
        if first in peers:
            peers.remove(first)
            peers.insert(0, first)
    head = ["op", "dtype", "rows", "cols"] + [f"{p} GB/s  %copy" for p in peers]
    lines = [head]
    for k, by_peer in groups.items():
        cells = [str(v) for v in k]
        for p in peers:
            r = by_peer.get(p)
            if r is None or r.get("gbps") is None:
                cells.append("-")
            elif r.get("error") or r["gbps"] != r["gbps"]:  # NaN: the peer failed this shape
                cells.append("failed")
            else:
                pct = r.get("pct_copy")
                cells.append(f"{r['gbps']:7.1f}  {pct:5.1f}%" if pct is not None
                             else f"{r['gbps']:7.1f}")
        lines.append(cells)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i >= 2 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                     for row in lines)


# ------------------------------------------------------------------------------------------
# selftest, precompile


@_command("selftest")
@click.option("--device", default="gpu", show_default=True, metavar="gpu|gpu:N|cpu",
              help="cpu: check the NumPy reference path (chunking, gradients) instead.")
@click.option("--dtype", "dtypes", default=",".join(DTYPES), show_default=True, metavar="LIST",
              help="Comma-separated dtypes to test.")
@click.option("--seed", type=int, default=0, show_default=True)
def selftest_cmd(device, dtypes, seed):
    """Run every op and kernel variant on random data against the NumPy references.

    \b
    On a GPU: each op (forward and backward) in each dtype, on shapes chosen to
    hit each kernel variant (warp, block_smem, cluster, block_uncached, strided),
    compared with the float64 reference within a per-dtype tolerance; plus the
    chunked file pipeline against a single-shot run (bit for bit).
    With --device cpu (no GPU needed): the reference path the CLI runs with
    --device cpu, chunked against single-shot, and each backward reference against
    finite differences of its forward.
    Prints a pass/fail table; exits with status 1 if anything fails.
    """
    from . import _selftest

    dtype_list = _parse_list(dtypes, "--dtype", DTYPES)
    dev = _device(device, "selftest --device cpu checks the NumPy reference path instead")
    failed = total = 0
    header = f"{'op':<22} {'variant':<24} {'dtype':<9} {'shape':<14} {'error':>9} " \
             f"{'tol':>8}  result"
    click.echo(header)
    for row in _selftest.run(dev, dtype_list, seed):
        ok = row["ok"]
        failed += not ok
        total += 1
        err = row.get("error")
        err_txt = f"{err:9.2e}" if isinstance(err, float) else f"{'-':>9}"
        tol = row.get("tol")
        tol_txt = f"{tol:8.1e}" if isinstance(tol, float) else f"{'-':>8}"
        line = (f"{row['op']:<22} {row['variant']:<24} {row['dtype']:<9} "
                f"{row['shape']:<14} {err_txt} {tol_txt}  {'pass' if ok else 'FAIL'}")
        if row.get("note"):
            line += f"  ({row['note']})"
        click.echo(line)
    click.echo(f"{total - failed} passed, {failed} failed")
    if failed:
        raise _Fail(f"selftest: {failed} of {total} checks failed", 1)


@_command("precompile")
@click.option("--dtype", "dtypes", default=",".join(DTYPES), show_default=True, metavar="LIST",
              help="Comma-separated dtypes.")
@click.option("--op", "ops", default="all", show_default=True, metavar="LIST",
              help="Comma-separated ops (as in explain), or all.")
@click.option("--arch", metavar="sm_XY",
              help="No GPU needed: compile for this architecture with NVRTC as a check (the "
                   "kernel cache is filled only on a GPU).")
@click.option("--device", default="gpu", show_default=True, metavar="gpu|gpu:N")
@click.option("-j", "--jobs", type=click.IntRange(min=1), metavar="N",
              help="Compiler processes (default: one per CPU core).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def precompile_cmd(dtypes, ops, arch, device, jobs, quiet):
    """Compile every kernel the planner can reach, so first calls are fast.

    \b
    On a GPU this fills CuPy's kernel cache (see cukern info) for every kernel
    instantiation the planner can choose for the ops and dtypes given, on this
    GPU's architecture. With --arch sm_90 and no GPU, it compiles them with NVRTC
    for that architecture instead: a check that they build, which caches nothing.
    """
    from . import _dispatch
    from ._device import DeviceSpec

    dtype_list = _parse_list(dtypes, "--dtype", DTYPES)
    names = list(_dispatch.OPS) if ops.strip().lower() == "all" else [
        o.replace("-", "_") for o in _parse_list(ops, "--op", None)]
    bad = [o for o in names if o not in _dispatch.OPS]
    if bad:
        choices = ", ".join(o.replace("_", "-") for o in _dispatch.OPS)
        raise InputError(f"--op: unknown {', '.join(bad)}; expected {choices} or all")
    if arch is not None:
        cc = _parse_arch(arch)
        import dataclasses

        spec = dataclasses.replace(DeviceSpec.h100(), name=f"{arch} (compile check)",
                                   compute_capability=cc)
        dev = None
    else:
        dev = _device(device, "--arch sm_90 compiles them with NVRTC without a GPU instead")
        if dev == "cpu":
            raise InputError("--device cpu: precompile builds GPU kernels; give --arch sm_XY "
                             "to check them without a GPU")
        spec = DeviceSpec.from_device(dev)
    # One job per kernel family: every reachable name, split into batches for the workers.
    by_family: dict[str, set[str]] = {}
    for op in names:
        fam = _dispatch.OPS[op].family
        for dt in dtype_list:
            by_family.setdefault(fam, set()).update(_dispatch.reachable_plans(op, dt, spec))
    batch = 1 if dev is not None else 48
    work = [(fam, sorted(ns)[i:i + batch]) for fam, ns in sorted(by_family.items())
            for i in range(0, len(ns), batch)]
    count = sum(len(ns) for _, ns in work)
    label = f"compiling for {spec.arch}" if dev is None else f"compiling on GPU {dev}"
    jobs = jobs or os.cpu_count() or 1
    start = time.perf_counter()
    done = _compile_all(work, arch, dev, jobs, label, not quiet and _isatty(sys.stderr))
    if not quiet:
        what = "checked" if dev is None else "compiled"
        click.echo(f"{what} {done} of {count} kernel instantiations for {spec.arch} in "
                   f"{time.perf_counter() - start:.1f} s", err=True)


def _parse_arch(arch: str) -> tuple[int, int]:
    a = arch.strip().lower()
    digits = a.removeprefix("sm_").removeprefix("compute_").rstrip("af")
    if not a.startswith(("sm_", "compute_")) or not digits.isdigit() or len(digits) < 2:
        raise InputError(f"--arch {arch}: expected a target like sm_80 or sm_90")
    return int(digits[:-1]), int(digits[-1])


def _compile_all(work, arch, dev, jobs, label, show) -> int:
    """Compile ``work`` ((family, names) batches) in ``jobs`` processes (here when 1): with
    NVRTC for ``arch``, or into CuPy's cache on GPU ``dev``. Returns how many compiled."""
    count = sum(len(ns) for _, ns in work)
    bar = click.progressbar(length=count, label=label, file=sys.stderr, show_pos=True) \
        if show else None
    step = bar.update if bar else (lambda n: None)
    try:
        if dev is not None and jobs > 1:
            from . import _compile

            items = [(fam, n) for fam, ns in work for n in ns]
            errors = _compile.warm_cache(items, dev, processes=jobs, progress=step)
            if errors:
                raise RunError(f"{len(errors)} of {count} kernels failed to compile; the first: "
                               f"{errors[0].splitlines()[0]}")
            return count
        if jobs == 1 or len(work) == 1:
            done = 0
            for fam, ns in work:
                done += _compile_batch(fam, ns, arch, dev)
                step(len(ns))
            return done
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        done = 0
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(jobs, len(work)), mp_context=ctx) as pool:
            futures = {pool.submit(_compile_batch, fam, ns, arch, dev): len(ns)
                       for fam, ns in work}
            for fut in as_completed(futures):
                done += fut.result()
                step(futures[fut])
        return done
    finally:
        if bar:
            bar.render_finish()


def _compile_batch(family: str, names: list[str], arch: str | None, dev: int | None) -> int:
    """Compile one batch (in a worker process, or here): NVRTC only with ``arch``, else into
    CuPy's cache through :func:`cukern._compile.get_kernel`."""
    from . import _compile

    if arch is not None:
        _compile.compile_check(family, names, arch)
    else:
        for n in names:
            _compile.get_kernel(family, n, dev)
    return len(names)


if __name__ == "__main__":
    main()

"""The ``batch-norm`` command: batch norm of an array in a file, eval from running statistics
or training with exact statistics over the whole file (two streaming passes). Shares the op
commands' chunking, file handling and errors (:mod:`cukern.cli.ops`).
"""

from __future__ import annotations

import math
import zipfile
from pathlib import Path

import click
import numpy as np

from .. import _io
from .._chunked import Result, as_rows
from .._io import InputError
from . import common
from .common import (
    _check_eps,
    _command,
    _device,
    _fmt,
    _open,
    _output_path,
    _same_shape,
    _spec_path,
    _work_dtype,
)
from .ops import _execute, _on_device, _op_options, _summary

__all__ = ["batch_norm_cmd"]


PARAM_KEYS = ("running_mean", "running_var", "weight", "bias")


@_command("batch-norm")
@_op_options
@click.option("--params", metavar="P.npz",
              help="Per-channel arrays running_mean, running_var (needed without --train), "
                   "weight and bias (optional).")
@click.option("--train", is_flag=True,
              help="Normalise with the statistics of the whole of IN (two passes over the "
                   "file) and write them to --stats.")
@click.option("--relu", is_flag=True, help="y = max(y, 0), after the addend.")
@click.option("--addend", metavar="A.npy", help="Added before the ReLU; the shape of IN.")
@click.option("--axis", type=int, default=1, show_default=True, help="The channel axis.")
@click.option("--eps", type=float, default=1e-5, show_default=True,
              help="Added to the variance before the square root.")
@click.option("--momentum", type=float, metavar="M",
              help="--train: running = (1 - M) * running + M * batch  [default: 0.1]")
@click.option("--stats", metavar="STATS.npz",
              help="--train: where to write the statistics  [default: OUT with the suffix "
                   ".stats.npz]")
def batch_norm_cmd(**kw):
    """Batch norm of IN over every axis but the channel axis, written to OUT.npy.

    \b
    y = (x - mean) / sqrt(var + eps) * weight + bias  [+ addend]  [then max(y, 0)]
    Without --train, mean and var are running_mean and running_var from
    --params P.npz. With --train they are the mean and biased variance of IN per
    channel, exact over the whole file (per-chunk statistics merged with Chan's
    formula), and a second pass writes y. --train writes STATS.npz (default
    OUT.stats.npz, for -o OUT.npy): "mean", "var" (biased), "invstd", and where
    P.npz has running statistics, "running_mean" and "running_var" updated with
    --momentum (the variance unbiased, times n / (n - 1)).
    Any rank from 2 and any channel axis (--axis -1 for a channels-last file).
    A row for --chunk-rows is the C values at one index of the other axes; chunks
    hold whole samples or, for large samples, a range of the axes after the
    channel axis.
    """
    _batch_norm(**kw)


def _bn_params(spec: str | None, c: int, ax: int, x_spec: str) -> dict[str, np.ndarray]:
    """The arrays of ``--params P.npz`` (memory-mapped), each checked to hold ``c`` values."""
    if spec is None:
        return {}
    path = Path(spec)
    if not path.exists():
        raise InputError(f"--params {spec}: no such file")
    if path.is_dir() or not zipfile.is_zipfile(path):
        raise InputError(f"--params {spec}: expected an .npz file (np.savez) holding "
                         f"{', '.join(PARAM_KEYS)}")
    with zipfile.ZipFile(path) as zf:
        names = sorted(n[:-4] for n in zf.namelist() if n.endswith(".npy"))
    unknown = [n for n in names if n not in PARAM_KEYS]
    if unknown:
        raise InputError(f"--params {spec}: unknown array{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))} (expected {', '.join(PARAM_KEYS)})")
    found = {}
    for key in PARAM_KEYS:
        if key in names:
            a = _open(f"{spec}:{key}", "--params")
            if a.shape != (c,):
                raise InputError(f"--params {spec}:{key} has shape {_fmt(a.shape)}, expected "
                                 f"{c} (one value per channel: axis {ax} of {x_spec})")
            found[key] = a
    return found


def _chan_merge(parts) -> tuple[np.ndarray, np.ndarray, int]:
    """(mean, biased var, count) of the union of chunks, from each chunk's (count, mean, biased
    var), merged in order with Chan's formula in float64."""
    count, mean, m2 = 0, None, None
    for k, mk, vk in parts:
        if count == 0:
            count, mean, m2 = k, mk.copy(), vk * k
            continue
        total = count + k
        delta = mk - mean
        mean = mean + delta * (k / total)
        m2 = m2 + vk * k + delta * delta * (count * k / total)
        count = total
    return mean, m2 / count, count


def _batch_norm(input, output, dtype, device, chunk_rows, overwrite, quiet, params, train,
                relu, addend, axis, eps, momentum, stats) -> None:
    x = _open(input)
    specs = [input]
    if x.ndim < 2:
        raise InputError(f"{input} has {x.ndim} dimension{'s' if x.ndim != 1 else ''}; "
                         f"batch-norm needs at least 2 (N, C, ...)")
    if not -x.ndim <= axis < x.ndim:
        raise InputError(f"--axis {axis} is out of range for {input}, which has {x.ndim} "
                         f"dimensions")
    ax = axis % x.ndim
    c = x.shape[ax]
    if momentum is not None and not train:
        raise InputError("--momentum updates running statistics, which only --train does")
    if stats is not None and not train:
        raise InputError("--stats is where --train writes the statistics of IN; without "
                         "--train there are none to write")
    m = 0.1 if momentum is None else momentum
    if not 0.0 <= m <= 1.0:
        raise InputError(f"--momentum {momentum}: expected a number in [0, 1]")
    found = _bn_params(params, c, ax, input)
    if params is not None:
        specs.append(params)
    has_running = [k for k in ("running_mean", "running_var") if k in found]
    if not train:
        if params is None:
            raise InputError("batch-norm needs --params P.npz with running_mean and "
                             "running_var, or --train to normalise with the statistics of IN")
        if len(has_running) < 2:
            missing = " and ".join(k for k in ("running_mean", "running_var") if k not in found)
            raise InputError(f"--params {params} has no {missing} (it holds: "
                             f"{', '.join(found) or 'nothing'}); without --train batch-norm "
                             f"normalises with running_mean and running_var")
    elif len(has_running) == 1:
        raise InputError(f"--params {params} has {has_running[0]} but not "
                         f"{({'running_mean', 'running_var'} - set(has_running)).pop()}; "
                         f"--train updates both or neither")
    arrays, array_specs = [x], [input]
    if addend is not None:
        a = _open(addend, "--addend")
        _same_shape("--addend", addend, a, "IN", x)
        arrays.append(a)
        array_specs.append(addend)
        specs.append(addend)
    work = _work_dtype(dtype, x.dtype)
    _check_eps("batch_norm", eps, work)
    stat_dtype = np.dtype(np.float64 if work == np.float64 else np.float32)
    n = x.size // c if c else 0
    if train and n < 2:
        raise InputError(f"--train needs more than one value per channel; {input} has shape "
                         f"{_fmt(x.shape)}: {n} per channel (axis {ax})")
    p, q = math.prod(x.shape[:ax]), math.prod(x.shape[ax + 1:])

    out = _output_path(output, "-o", ".npy")
    targets = {"-o": (out, _io.npy_bytes(x.shape, work))}
    stats_path = None
    if train:
        stats_path = _output_path(stats, "--stats", ".npz") if stats is not None else \
            out.with_name(out.stem + ".stats.npz")
        targets["--stats"] = (stats_path, 5 * _io.npy_bytes((c,), np.float64) + 4096)
    _io.check_outputs(targets, [_spec_path(s) for s in specs], overwrite=overwrite)

    dev = _device(device)
    fwd = common._require(dev, "batch_norm", "batch-norm")
    batch_stats = common._require(dev, "batch_stats", "batch-norm --train") if train else None
    cpu = dev == "cpu"

    def cast(t):
        return t.astype(work, copy=cpu)  # a NumPy tile is a fresh array already

    def host(a) -> np.ndarray:
        if cpu:
            return np.asarray(a, dtype=np.float64)
        import cupy as cp

        return np.asarray(cp.asnumpy(a), dtype=np.float64)

    # The op's parameter dtypes: float32 for 16-bit data, else the data's (float64 on the CPU,
    # where the reference computes in float64 anyway).
    param_dtype = np.float64 if cpu else stat_dtype

    def param(a):
        return None if a is None else np.asarray(a, dtype=np.float64).astype(param_dtype)

    with _io.Outputs() as outs:
        y = outs.npy(out, x.shape, work)
        inputs = [as_rows(_io.c_order(a, s), p, c, q) for a, s in zip(arrays, array_specs)]
        if train:
            parts = []

            def stats_fn(xt):
                t = cast(xt)
                mean_t, var_t = batch_stats(t, axis=1)
                parts.append((t.shape[0] * t.shape[2], mean_t, var_t))
                return ()

            _execute(stats_fn, inputs[:1], [], [], device=dev, chunk_rows=chunk_rows,
                     work=work, quiet=quiet, label="batch-norm statistics")
            mean, var, count = _chan_merge((k, host(mt), host(vt)) for k, mt, vt in parts)
            parts.clear()
            norm_mean, norm_var = mean, var
        else:
            norm_mean = np.asarray(found["running_mean"], dtype=np.float64)
            norm_var = np.asarray(found["running_var"], dtype=np.float64)
        rm, rv, w, b = _on_device(dev, [param(norm_mean), param(norm_var),
                                        param(found.get("weight")), param(found.get("bias"))])
        with_addend = addend is not None

        def fn(*tiles):
            xt = cast(tiles[0])
            at = cast(tiles[1]) if with_addend else None
            yt = fwd(xt, rm, rv, w, b, training=False, eps=eps, axis=1, addend=at, relu=relu)
            return yt.astype(work) if cpu else yt

        _, meter = _execute(fn, inputs, [Result("y", c, work)], [as_rows(y, p, c, q)],
                            device=dev, chunk_rows=chunk_rows, work=work, quiet=quiet,
                            label="batch-norm")
        written = [out]
        if train:
            saved = {"mean": mean.astype(stat_dtype), "var": var.astype(stat_dtype),
                     "invstd": (1.0 / np.sqrt(var + eps)).astype(stat_dtype)}
            if has_running:
                old_m, old_v = found["running_mean"], found["running_var"]
                saved["running_mean"] = ((1.0 - m) * np.asarray(old_m, np.float64) +
                                         m * mean).astype(old_m.dtype)
                saved["running_var"] = ((1.0 - m) * np.asarray(old_v, np.float64) +
                                        m * var * (count / (count - 1))).astype(old_v.dtype)
            outs.npz(stats_path, saved)
            written.append(stats_path)
        outs.commit()
    _summary(quiet, "batch-norm", written, meter)

"""``cukern bench``: any op of :mod:`cukern.registry` timed against a same-size device copy
and peer libraries (:mod:`cukern._bench`; what each op runs: :mod:`cukern._bench_ops`).
``--dry-run`` prints the planned shapes and bytes without a GPU."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import click
import numpy as np

from .. import _bench_ops, _io, registry
from .._io import InputError, RunError
from . import common
from .common import DTYPES, _command, _parse_list, _parse_shape, _show_progress

__all__ = ["bench_cmd"]


@_command("bench")
@click.argument("op", required=False, default="softmax", metavar="[OP]")
@click.option("--cols", metavar="RANGE|LIST",
              help="Row lengths (row-wise ops; permute transposes rows x cols): A..B (powers "
                   "of two from A to B) or a list like 1000,4096. Default: the op's own set.")
@click.option("--rows", type=click.IntRange(min=1), metavar="N",
              help="Rows of every shape (default: 2^27 / cols, enough to leave L2).")
@click.option("--shape", "shapes", metavar="LIST",
              help="Shapes instead, comma-separated: 4096x1000,512x8192 (batch norm: "
                   "N x C x ..., NCHW, e.g. 64x256x56x56).")
@click.option("--dtype", "dtypes", default="float16,bfloat16,float32", show_default=True,
              metavar="LIST", help="Comma-separated dtypes.")
@click.option("--vs", default="torch,jax,cupyx", show_default=True, metavar="LIST",
              help="Peers to time as well (those not installed or without the op are "
                   "skipped), or none.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON instead.")
@click.option("--plot", metavar="FILE.png", help="Also plot % of copy against cols into FILE.png.")
@click.option("--dry-run", is_flag=True,
              help="Print the shapes and bytes that would be timed; needs no GPU.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def bench_cmd(op, cols, rows, shapes, dtypes, vs, as_json, plot, dry_run, quiet):
    """Time OP (default softmax; any op) against a device copy and peers.

    \b
    Prints a table of GB/s (bytes that must move / median time) and % of a
    same-size device copy measured in the same run, for cukern and each peer.
    Bytes: the full-size arrays the op reads and writes (cukern.registry's
    traffic: a backward reads two, batch norm training reads x twice), times
    the array's bytes. Each op has a small default set of shapes (--dry-run
    lists them).
      cukern bench softmax --cols 256..16384 --dtype float16 --vs torch
      cukern bench layer-norm-backward --dtype bfloat16
      cukern bench batch-norm --shape 64x256x56x56 --dry-run
    """
    try:
        name = registry.get(op).name
    except ValueError:
        choices = ", ".join(s.cli_name for s in registry.OPS.values())
        raise InputError(f"unknown op {op!r}; bench knows {choices}") from None
    dtype_list = _parse_list(dtypes, "--dtype", DTYPES)
    shape_list = None if shapes is None else [
        _parse_shape(s, "--shape") for s in _parse_list(shapes, "--shape", None)]
    if shape_list is not None and (cols is not None or rows is not None):
        raise InputError("--shape gives whole shapes; leave out --cols and --rows")
    try:
        cases = _bench_ops.plan(name, dtype_list, cols=None if cols is None else
                                _parse_cols(cols), rows=rows, shapes=shape_list)
    except ValueError as err:
        opt = "--shape" if shape_list is not None else "--cols/--rows"
        raise InputError(f"{opt}: {err}") from None
    peers = () if vs.strip().lower() in ("", "none") else tuple(
        _parse_list(vs, "--vs", None))
    if plot is not None and not Path(plot).parent.is_dir():
        raise InputError(f"--plot {plot}: folder {Path(plot).parent} does not exist")
    if dry_run:
        click.echo(_plan_table(cases))
        return
    problem = common._gpu_problem()
    if problem:
        raise RunError(f"{problem}; bench times GPU kernels (--dry-run shows the plan)")
    bench = importlib.import_module("cukern._bench")  # NumPy only until it runs
    planned = list(dict.fromkeys(c.shape for c in cases))
    if _show_progress(quiet):
        with click.progressbar(length=len(cases), label=f"bench {name}", file=sys.stderr,
                               show_pos=True, item_show_func=lambda item: item) as bar:
            results = bench.sweep(name, dtype_list, vs=peers, shapes=planned,
                                  progress=_BenchProgress(bar))
    else:
        results = bench.sweep(name, dtype_list, vs=peers, shapes=planned, progress=None)
    if as_json:
        click.echo(json.dumps(results, indent=1, default=_json_default))
    else:
        click.echo(_bench_table(results))
    if plot is not None:
        bench.plot(results, plot)
        if not as_json:
            click.echo(f"plot: {plot}", err=True)


def _plan_table(cases) -> str:
    """``--dry-run``: one line per case, with the bytes it must move."""
    lines = [("op", "dtype", "shape", "bytes moved")]
    for c in cases:
        lines.append((c.op, c.dtype, "x".join(map(str, c.shape)), _io._size(c.moved_bytes)))
    widths = [max(len(row[i]) for row in lines) for i in range(4)]
    return "\n".join("  ".join(v.rjust(w) if i == 3 else v.ljust(w)
                               for i, (v, w) in enumerate(zip(row, widths))).rstrip()
                     for row in lines)


class _BenchProgress:
    """Progress callback for ``_bench.sweep``, which reports each measurement as a dict: the
    bar counts (dtype, shape) cases and shows the one being measured."""

    def __init__(self, bar):
        self.bar = bar
        self.shape = None

    def __call__(self, result: dict) -> None:
        shape = (result.get("dtype"), tuple(result.get("shape") or ()))
        if self.shape is not None and shape != self.shape:
            self.bar.update(1)
        self.shape = shape
        self.bar.current_item = f"{shape[0]} {'x'.join(map(str, shape[1]))}"
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


def _bench_table(results: list[dict]) -> str:
    """One line per (op, dtype, shape): GB/s and % of copy for cukern and each peer."""
    if not results:
        return "no results"
    peers: list[str] = []
    groups: dict[tuple, dict[str, dict]] = {}
    for r in results:
        peer = r.get("peer") or "cukern"
        if peer not in peers:
            peers.append(peer)
        shape = "x".join(map(str, r.get("shape") or (r.get("rows"), r.get("cols"))))
        groups.setdefault((r.get("op"), r.get("dtype"), shape), {})[peer] = r
    for first in ("copy", "cukern"):  # cukern, then the copy it is measured against
        if first in peers:
            peers.remove(first)
            peers.insert(0, first)
    head = ["op", "dtype", "shape"] + [f"{p} GB/s  %copy" for p in peers]
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



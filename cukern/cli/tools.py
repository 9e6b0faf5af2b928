"""The tool commands: ``explain``, ``info``, ``bench``, ``selftest`` and ``precompile``.

``explain``, ``bench`` and ``precompile`` check op names against :mod:`cukern.registry`;
``selftest`` runs :mod:`cukern._selftest` (every op of the registry) and then the command line's
own pipeline checks (:mod:`cukern.cli.checks`).
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import sys
import time
from pathlib import Path

import click
import numpy as np

from .. import __version__, _io, registry
from .._io import InputError, RunError
from . import common
from .common import (
    DTYPES,
    MOVE_DTYPES,
    _command,
    _device,
    _Fail,
    _parse_list,
    _parse_shape,
    _short,
    _show_progress,
)

__all__ = ["explain_cmd", "info_cmd", "bench_cmd", "selftest_cmd", "precompile_cmd"]


# ------------------------------------------------------------------------------------------
# explain, info


@_command("explain")
@click.argument("op", metavar="OP")
@click.option("--shape", required=True, metavar="SHAPE", help="The array's shape, e.g. 49152x1000.")
@click.option("--dtype", type=click.Choice(DTYPES + MOVE_DTYPES), default="float32",
              show_default=True, metavar="DTYPE",
              help="float16, bfloat16, float32 or float64 (permute also bool, int8..int64, "
                   "uint8..uint64, complex64, complex128).")
@click.option("--axes", metavar="LIST",
              help="Permute: the order of the axes, e.g. 0,2,3,1 (default: reversed).")
@click.option("--axis", type=int, default=None,
              help="The reduced axis (row-wise ops; default -1) or the channel axis (batch "
                   "norm; default 1).")
@click.option("--device", default="auto", show_default=True, metavar="auto|h100|a100|t4|v100|gpu:N",
              help="auto: the current GPU if one is visible, else the H100 preset.")
@click.option("--weight", is_flag=True, help="The norm is given a weight.")
@click.option("--bias", is_flag=True, help="The layer norm is given a bias.")
@click.option("--residual", is_flag=True, help="The norm is given a residual.")
@click.option("--eval", "eval_mode", is_flag=True,
              help="Batch norm in eval mode (running statistics); default: training.")
@click.option("--layout", type=click.Choice(["NCHW", "NHWC"], case_sensitive=False),
              default="NCHW", show_default=True,
              help="Batch norm: the memory order (NHWC: channels last).")
@click.option("--relu", is_flag=True, help="Batch norm: fused ReLU (and its mask).")
@click.option("--addend", is_flag=True, help="Batch norm: fused add before the ReLU.")
def explain_cmd(op, shape, dtype, axes, axis, device, weight, bias, residual, eval_mode,
                layout, relu, addend):
    """Show the kernel plan for OP on an array, without running anything.

    \b
    OP is one of the planner's ops, e.g. softmax, log-softmax, softmax-backward, layer-norm.
    Works with no GPU: the H100, A100, T4 and V100 presets plan from an occupancy model.
    \b
      cukern explain softmax --shape 49152x1000 --dtype float16
      cukern explain layer-norm --shape 2048x65536 --dtype float16 --weight --residual
      cukern explain batch-norm --shape 64x256x56x56 --dtype float16 --layout NHWC --relu
      cukern explain permute --shape 64x256x56x56 --dtype int8 --axes 0,2,3,1
    """
    from .._device import DeviceSpec
    from .._explain import explain

    try:
        name = registry.get(op).name
    except ValueError:
        choices = ", ".join(s.cli_name for s in registry.OPS.values())
        raise InputError(f"unknown op {op!r}; expected one of {choices}") from None
    dims = _parse_shape(shape, "--shape")
    presets = {"h100": DeviceSpec.h100, "a100": DeviceSpec.a100, "t4": DeviceSpec.t4,
               "v100": DeviceSpec.v100}
    d = device.strip().lower()
    if d == "auto":
        spec = None
    elif d in presets:
        spec = presets[d]()
    else:
        spec = _device(device, "--device h100, a100, t4 or v100 plans for a preset instead")
        if spec == "cpu":
            raise InputError("--device cpu: explain plans GPU kernels; use auto, h100, a100, t4, "
                             "v100 or gpu:N")
    if name == "permute":
        click.echo(str(_explain_permute(explain, dims, dtype, axes, spec, shape, axis=axis,
                                        weight=weight, bias=bias, residual=residual,
                                        eval=eval_mode, relu=relu, addend=addend,
                                        layout=layout.upper() != "NCHW")))
        return
    if axes is not None:
        raise InputError(f"--axes is permute's; {op} takes --axis")
    kw = {}
    if not registry.get(name).rowwise:
        kw = dict(training=not eval_mode, layout=layout.upper(), relu=relu, addend=addend)
    elif eval_mode or relu or addend or layout.upper() != "NCHW":
        raise InputError(f"--eval, --layout, --relu and --addend are batch norm's; {op} is "
                         f"row-wise")
    try:
        plan = explain(name, dims, dtype, axis=axis, device=spec, weight=weight, bias=bias,
                       residual=residual, **kw)
    except (ValueError, TypeError) as err:
        raise InputError(str(err).removeprefix("explain: ")) from None
    click.echo(str(plan))


def _explain_permute(explain, dims, dtype, axes, spec, shape_text, **others):
    """permute's plan for a C-contiguous array of ``dims``; the other ops' options refused."""
    from .permute import parse_axes

    given = [f"--{k}" for k, v in others.items() if v not in (None, False)]
    if given:
        raise InputError(f"{', '.join(given)}: not permute's options; it takes --axes")
    order = parse_axes(axes, dims, f"--shape {shape_text}")
    try:
        return explain("permute", dims, dtype, axes=order, device=spec)
    except (ValueError, TypeError) as err:
        raise InputError(str(err).removeprefix("explain: ")) from None


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
    problem = common._gpu_problem()
    if problem:
        rows.append(("GPU", f"none: {problem}"))
    else:
        from .._device import DeviceSpec

        for dev in range(rt.getDeviceCount()):
            spec = DeviceSpec.from_device(dev, check=False)  # reported, not refused
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
            try:
                spec.check_supported()
            except RuntimeError as err:
                rows.append(("  supported", f"no: {err}"))
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
    known = getattr(bench, "OPS", None) or registry.names()
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
    problem = common._gpu_problem()
    if problem:
        raise RunError(f"{problem}; bench times GPU kernels")
    rows_fn = (lambda c: rows) if rows else None
    total = len(cols_list) * len(dtype_list)
    if _show_progress(quiet):
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
    from .. import _selftest
    from .checks import pipeline_checks

    dtype_list = _parse_list(dtypes, "--dtype", DTYPES)
    dev = _device(device, "selftest --device cpu checks the NumPy reference path instead")
    failed = total = 0
    header = f"{'op':<22} {'variant':<24} {'dtype':<9} {'shape':<14} {'error':>9} " \
             f"{'tol':>8}  result"
    click.echo(header)
    app = click.get_current_context().find_root().command  # the group running this command
    rows = itertools.chain(_selftest.run(dev, dtype_list, seed),
                           pipeline_checks(app, dev, dtype_list, seed))
    for row in rows:
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
    from .._device import DeviceSpec

    dtype_list = _parse_list(dtypes, "--dtype", DTYPES)
    names = registry.names() if ops.strip().lower() == "all" else [
        o.replace("-", "_") for o in _parse_list(ops, "--op", None)]
    bad = [o for o in names if o not in registry.OPS]
    if bad:
        choices = ", ".join(s.cli_name for s in registry.OPS.values())
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
    # One job per kernel source: every reachable name, split into batches for the workers.
    by_family = registry.kernel_names(names, dtype_list, spec)
    batch = 1 if dev is not None else 48
    work = [(fam, sorted(ns)[i:i + batch]) for fam, ns in sorted(by_family.items())
            for i in range(0, len(ns), batch)]
    count = sum(len(ns) for _, ns in work)
    label = f"compiling for {spec.arch}" if dev is None else f"compiling on GPU {dev}"
    jobs = jobs or os.cpu_count() or 1
    start = time.perf_counter()
    done = _compile_all(work, arch, dev, jobs, label, _show_progress(quiet))
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
            from .. import _compile

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
    from .. import _compile

    if arch is not None:
        _compile.compile_check(family, names, arch)
    else:
        for n in names:
            _compile.get_kernel(family, n, dev)
    return len(names)

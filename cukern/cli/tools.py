"""The tool commands ``explain``, ``selftest`` and ``precompile`` (``info`` is in
:mod:`cukern.cli.info`, ``bench`` in :mod:`cukern.cli.bench`).

``explain``, ``bench`` and ``precompile`` check op names against :mod:`cukern.registry`;
``selftest`` runs :mod:`cukern._selftest` (every op of the registry) and then the command line's
own pipeline checks (:mod:`cukern.cli.checks`).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
import math
import os
import sys
import time

import click
import numpy as np

from .. import registry
from .._device import PRESETS
from .._io import InputError, RunError
from .common import (
    DTYPES,
    MOVE_DTYPES,
    _command,
    _device,
    _Fail,
    _parse_list,
    _parse_shape,
    _show_progress,
)

__all__ = ["explain_cmd", "selftest_cmd", "precompile_cmd"]


# ------------------------------------------------------------------------------------------
# explain


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
@click.option("--device", default="auto", show_default=True,
              metavar=f"auto|{'|'.join(PRESETS)}|gpu:N",
              help="auto: the current GPU if one is visible, else the H100 preset; "
                   f"{', '.join(PRESETS)}: a preset's occupancy model (no GPU needed).")
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
@click.option("--json", "as_json", is_flag=True,
              help="Print the plan as JSON (keys in docs/cli.md).")
def explain_cmd(op, shape, dtype, axes, axis, device, weight, bias, residual, eval_mode,
                layout, relu, addend, as_json):
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
    from .._explain import explain

    try:
        name = registry.get(op).name
    except ValueError:
        choices = ", ".join(s.cli_name for s in registry.OPS.values())
        raise InputError(f"unknown op {op!r}; expected one of {choices}") from None
    dims = _parse_shape(shape, "--shape")
    spec = _explain_device(device)
    if name == "permute":
        plan = _explain_permute(explain, dims, dtype, axes, spec, shape, axis=axis,
                                weight=weight, bias=bias, residual=residual, eval=eval_mode,
                                relu=relu, addend=addend, layout=layout.upper() != "NCHW")
        click.echo(_plan_json(name, dims, dtype, plan) if as_json else str(plan))
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
    click.echo(_plan_json(name, dims, dtype, plan) if as_json else str(plan))


def _plan_json(op: str, dims, dtype: str, plan) -> str:
    """``explain --json``: op, shape, dtype, device, the kernels launched, the plan's fields
    (those of its dataclass, by family) and the text ``explain`` prints."""
    if hasattr(plan, "kernel_names"):  # batch norm: a kernel a pass
        kernels = list(plan.kernel_names())
    elif hasattr(plan, "name_expression"):  # row-wise
        kernels = [plan.name_expression()]
    else:  # permute
        kernels = [str(plan.kernel or plan.targs)]
    fields = {f.name: _jsonable(getattr(plan, f.name)) for f in dataclasses.fields(plan)
              if f.name != "policy"}  # the family's whole tuning table: not this plan's
    return json.dumps({"op": op, "shape": list(dims), "dtype": dtype, "device": plan.device,
                       "kernels": kernels, "plan": fields, "text": str(plan)}, indent=1)


def _jsonable(v):
    """A plan field as JSON values: dataclasses and named tuples as objects, enums by value."""
    if isinstance(v, enum.Enum):
        return v.value
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _jsonable(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, tuple) and hasattr(v, "_asdict"):
        return {k: _jsonable(x) for k, x in v._asdict().items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN or inf
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def _explain_device(device: str):
    """``explain --device``: None (auto), a preset's :class:`DeviceSpec` or a GPU id."""
    d = device.strip().lower()
    if d == "auto":
        return None
    if d in PRESETS:
        return PRESETS[d]()
    choices = f"auto, {', '.join(PRESETS)}, gpu or gpu:N"
    tail = d.split(":", 1)[1] if d.startswith(("gpu:", "cuda:")) else d
    if d not in ("gpu", "cuda") and not tail.isdigit():
        raise InputError(f"--device {device}: expected {choices}")
    *first, last = PRESETS
    return _device(device, f"--device {', '.join(first)} or {last} plans for a preset instead")


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


# ------------------------------------------------------------------------------------------
# selftest, precompile


@_command("selftest")
@click.option("--device", default="gpu", show_default=True, metavar="gpu|gpu:N|cpu",
              help="cpu: check the NumPy reference path (chunking, gradients) instead.")
@click.option("--dtype", "dtypes", default=",".join(DTYPES), show_default=True, metavar="LIST",
              help="Comma-separated dtypes to test.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True,
              help="Print the checks as JSON instead of the table (keys in docs/cli.md).")
def selftest_cmd(device, dtypes, seed, as_json):
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
    header = f"{'op':<22} {'variant':<24} {'dtype':<9} {'shape':<14} {'error':>9} " \
             f"{'tol':>8}  result"
    if not as_json:
        click.echo(header)
    app = click.get_current_context().find_root().command  # the group running this command
    rows = itertools.chain(_selftest.run(dev, dtype_list, seed),
                           pipeline_checks(app, dev, dtype_list, seed))
    checks = []
    for row in rows:
        checks.append({k: _jsonable(row.get(k)) for k in SELFTEST_KEYS})
        if not as_json:
            click.echo(_selftest_line(row))
    total, failed = len(checks), sum(not c["ok"] for c in checks)
    if as_json:
        click.echo(json.dumps({"device": "cpu" if dev == "cpu" else f"gpu:{dev}",
                               "dtypes": dtype_list, "seed": seed, "passed": total - failed,
                               "failed": failed, "checks": checks}, indent=1))
    else:
        click.echo(f"{total - failed} passed, {failed} failed")
    if failed:
        raise _Fail(f"selftest: {failed} of {total} checks failed", 1)


# selftest --json: the keys of every check (None where a check has no such value)
SELFTEST_KEYS = ("op", "variant", "dtype", "shape", "error", "tol", "ok", "note")


def _selftest_line(row: dict) -> str:
    err, tol = row.get("error"), row.get("tol")
    err_txt = f"{err:9.2e}" if isinstance(err, float) else f"{'-':>9}"
    tol_txt = f"{tol:8.1e}" if isinstance(tol, float) else f"{'-':>8}"
    line = (f"{row['op']:<22} {row['variant']:<24} {row['dtype']:<9} "
            f"{row['shape']:<14} {err_txt} {tol_txt}  {'pass' if row['ok'] else 'FAIL'}")
    return line + (f"  ({row['note']})" if row.get("note") else "")


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
@click.option("--resources", is_flag=True,
              help="With --arch: print each instantiation's registers, stack frame, spill bytes "
                   "and static shared memory as JSON (ptxas at full optimisation, as the ops "
                   "compile them).")
@click.option("--against", metavar="FILE", type=click.Path(exists=True, dir_okay=False),
              help="With --resources: print only the instantiations whose resources differ "
                   "from FILE's (an earlier --resources output, e.g. of another tree).")
def precompile_cmd(dtypes, ops, arch, device, jobs, quiet, resources, against):
    """Compile every kernel the planner can reach, so first calls are fast.

    \b
    On a GPU this fills CuPy's kernel cache (see cukern info) for every kernel
    instantiation the planner can choose for the ops and dtypes given, on this
    GPU's architecture. With --arch sm_90 and no GPU, it compiles them with NVRTC
    for that architecture instead: a check that they build, which caches nothing.
    With --resources it reports what ptxas gave each one (registers, stack,
    spills, static shared memory); --against FILE lists those that changed since
    FILE, e.g. of another tree under the same NVRTC, before measuring speed.
    """
    from .._device import DeviceSpec

    if against is not None and not resources:
        raise InputError("--against: compares the --resources report; give --resources too")
    if resources and arch is None:
        raise InputError("--resources: needs --arch sm_XY (ptxas's report, no GPU used)")
    old = _resources_file(against) if against is not None else None
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
    found = {} if resources else None
    done = _compile_all(work, arch, dev, jobs, label, _show_progress(quiet), found)
    if found is not None:
        _report_resources(found, arch, old, against)
        return
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


def _resources_file(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        kernels = data["kernels"]
        if not (isinstance(kernels, dict) and all(isinstance(v, dict) for v in kernels.values())):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise InputError(f"--against {path}: not a report of precompile --resources") from None
    return data


def _report_resources(found: dict, arch: str, old: dict | None, against: str | None) -> None:
    """Print the resources found as JSON, or (``old``) the instantiations that differ."""
    from cupy.cuda import nvrtc

    version = ".".join(map(str, nvrtc.getVersion()))
    if old is None:
        click.echo(json.dumps({"nvrtc": version, "arch": arch,
                               "kernels": dict(sorted(found.items()))}, indent=1))
        return
    if (old.get("nvrtc"), old.get("arch")) != (version, arch):
        click.echo(f"note: {against} is of NVRTC {old.get('nvrtc')} for {old.get('arch')}, "
                   f"this of NVRTC {version} for {arch}: ptxas's choices differ between "
                   f"versions", err=True)
    before = old["kernels"]
    changed = 0
    for name in sorted(found):
        was, now = before.get(name), found[name]
        if was is None or was == now:
            continue
        changed += 1
        diffs = ", ".join(f"{k} {was.get(k)} -> {v}" for k, v in now.items() if was.get(k) != v)
        click.echo(f"{name}: {diffs}")
    common = sum(n in before for n in found)
    click.echo(f"{changed} of {common} instantiations in both differ from {against}; "
               f"{len(found) - common} only here, {len(set(before) - set(found))} only there",
               err=True)


def _compile_all(work, arch, dev, jobs, label, show, found: dict | None = None) -> int:
    """Compile ``work`` ((family, names) batches) in ``jobs`` processes (here when 1): with
    NVRTC for ``arch``, or into CuPy's cache on GPU ``dev``. Returns how many compiled. With
    ``found`` (NVRTC only), each instantiation's resources go into it
    (:func:`cukern._compile.kernel_resources`)."""
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
        collect = found is not None
        if jobs == 1 or len(work) == 1:
            done = 0
            for fam, ns in work:
                done += _take(_compile_batch(fam, ns, arch, dev, collect), found)
                step(len(ns))
            return done
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        done = 0
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(jobs, len(work)), mp_context=ctx) as pool:
            futures = {pool.submit(_compile_batch, fam, ns, arch, dev, collect): len(ns)
                       for fam, ns in work}
            for fut in as_completed(futures):
                done += _take(fut.result(), found)
                step(futures[fut])
        return done
    finally:
        if bar:
            bar.render_finish()


def _take(result: tuple[int, dict], found: dict | None) -> int:
    """A batch's count, with its resources added to ``found`` (when collecting)."""
    count, resources = result
    if found is not None:
        found.update(resources)
    return count


def _compile_batch(family: str, names: list[str], arch: str | None, dev: int | None,
                   resources: bool = False):
    """Compile one batch (in a worker process, or here): NVRTC only with ``arch``, else into
    CuPy's cache through :func:`cukern._compile.get_kernel`. Returns how many, and with
    ``resources`` (NVRTC) their resources by name (else nothing)."""
    from .. import _compile

    if resources:
        return len(names), _compile.kernel_resources(family, names, arch)
    if arch is not None:
        _compile.compile_check(family, names, arch)
    else:
        for n in names:
            _compile.get_kernel(family, n, dev)
    return len(names), {}

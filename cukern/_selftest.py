"""``cukern selftest``: every op, kernel variant and dtype on random data against the float64
NumPy references, plus the command line's chunked pipeline against a single-shot run.

:func:`run` yields one row per check (a dict: op, variant, dtype, shape, error, tol, ok, note),
so the command can print them as they complete.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

import numpy as np

from . import reference
from ._dispatch import CLUSTER_SIZES, ITEMSIZE, OPS, max_dynamic_smem

__all__ = ["TOL", "run"]

# Relative error ||out - ref|| / ||ref|| allowed per dtype (the tests use the same table).
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-6, "float64": 1e-12}
STAT_TOL = {"float16": 1e-5, "bfloat16": 1e-5, "float32": 1e-5, "float64": 1e-12}

SOFTMAX_OPS = ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward")
NORM_OPS = ("layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward")
_FORWARD = {"softmax_backward": "softmax", "log_softmax_backward": "log_softmax",
            "layer_norm_backward": "layer_norm", "rms_norm_backward": "rms_norm"}
_EPS = {"layer_norm": 1e-5, "rms_norm": 1e-6}


def available_ops(device) -> list[str]:
    """The ops present in this cukern (the norms land separately from softmax)."""
    import cukern

    ops = list(SOFTMAX_OPS)
    for op in NORM_OPS:
        fwd = _FORWARD.get(op, op)
        have_ref = hasattr(reference, op) and hasattr(reference, fwd)
        if have_ref and (device == "cpu" or hasattr(cukern, op)):
            ops.append(op)
    return ops


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        from ml_dtypes import bfloat16

        return np.dtype(bfloat16)
    return np.dtype(name)


def _rel(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom else 1.0))


def run(device, dtypes, seed: int = 0):
    """Yield one result row per check; ``device`` is a CUDA device id or ``"cpu"``."""
    if device == "cpu":
        yield from _cpu_checks(dtypes, seed)
    else:
        yield from _gpu_checks(device, dtypes, seed)
        yield from _pipeline_checks(device, dtypes, seed)


# ------------------------------------------------------------------------------------------
# GPU: kernels against the references


def _inputs_per_row(op: str) -> int:
    info = OPS.get(op)
    return info.inputs if info else (2 if op.endswith("_backward") else 1)


def shapes(op: str, dtype: str, spec) -> list[tuple[str, tuple[int, ...], int]]:
    """(intended variant, shape, axis) for each kernel variant of ``op`` on this device."""
    cap = max_dynamic_smem(spec) // (ITEMSIZE[dtype] * _inputs_per_row(op))
    out = [("warp", (257, 33), -1), ("warp", (256, 1024), -1), ("block_smem", (64, 3000), -1),
           ("cluster", (4, -(-(cap + 100) // 8) * 8), -1),
           ("block_uncached", (2, -(-(CLUSTER_SIZES[-1] * cap + 100) // 8) * 8), -1)]
    if op in SOFTMAX_OPS:
        out.append(("strided", (1000, 63), 0))
    return out


def _variant(op, shape, dtype, axis, device, intended) -> str:
    from ._explain import explain

    try:
        plan = explain(op, shape, dtype, axis=axis, device=device)
    except Exception:
        return f"{intended}?"
    return plan.variant.value + (" strided" if plan.strided else "")


def _warm(device, spec, ops, dtypes) -> None:
    """Compile the kernels the checks will launch in parallel first (a cold cache would
    otherwise compile them one after another); those the model does not foresee compile when
    first used."""
    import dataclasses

    from . import _compile
    from ._explain import explain

    model = dataclasses.replace(spec, device_id=None)  # plans from the model: no compiling
    names = set()
    for op in ops:
        for dtype in dtypes:
            for _, shape, axis in shapes(op, dtype, spec):
                try:
                    plan = explain(op, shape, dtype, axis=axis, device=model)
                except Exception:  # the check itself will report it
                    continue
                names.add((plan.family, plan.name_expression()))
    _compile.warm_cache(sorted(names), device)


def _gpu_checks(device, dtypes, seed):
    import cupy as cp

    from ._device import DeviceSpec

    spec = DeviceSpec.from_device(device)
    rng = np.random.default_rng(seed)
    ops = available_ops(device)
    _warm(device, spec, ops, dtypes)
    with cp.cuda.Device(device):
        for op in ops:
            for dtype in dtypes:
                seen = set()
                for intended, shape, axis in shapes(op, dtype, spec):
                    variant = _variant(op, shape, dtype, axis, device, intended)
                    if variant in seen and intended != "warp":
                        continue  # e.g. no clusters before Hopper: that shape is uncached too
                    seen.add(variant)
                    row = dict(op=op, variant=variant, dtype=dtype,
                               shape="x".join(map(str, shape)), tol=TOL[dtype])
                    try:
                        row["error"] = _gpu_error(cp, op, dtype, shape, axis, rng)
                        row["ok"] = bool(row["error"] <= TOL[dtype])
                    except Exception as err:  # a failure to compile or launch is a FAIL row
                        first = str(err).splitlines()[0] if str(err) else ""
                        row.update(ok=False, note=f"{type(err).__name__}: {first}")
                    yield row


def _data(rng, op, shape, dtype, axis):
    """Inputs (cast to ``dtype``) for op, as a dict of NumPy arrays, and the op's arguments."""
    dt = _np_dtype(dtype)
    x = (rng.standard_normal(shape) * 2).astype(dt)
    if op in SOFTMAX_OPS:
        if op.endswith("_backward"):
            y = getattr(reference, _FORWARD[op])(x, axis=axis).astype(dt)
            dy = rng.standard_normal(shape).astype(dt)
            return [y, dy], {"axis": axis}
        return [x], {"axis": axis}
    cols = shape[-1]
    w = (1 + 0.1 * rng.standard_normal(cols)).astype(dt)
    b = (0.1 * rng.standard_normal(cols)).astype(dt)
    fwd = _FORWARD.get(op, op)
    eps = _EPS[fwd]
    fargs = [x, (cols,), w, b, eps] if fwd == "layer_norm" else [x, (cols,), w, eps]
    if not op.endswith("_backward"):
        return fargs, {}
    stats = [s.astype(np.float64 if dtype == "float64" else np.float32)
             for s in getattr(reference, fwd)(*fargs)[1:]]
    dy = rng.standard_normal(shape).astype(dt)
    return [dy, x, *stats, w], {}


def _gpu_error(cp, op, dtype, shape, axis, rng) -> float:
    """The worst output's error, scaled so that TOL[dtype] is the bound for every output."""
    import cukern

    args, kw = _data(rng, op, shape, dtype, axis)
    ref = getattr(reference, op)(*args, **kw)
    dargs = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    out = getattr(cukern, op)(*dargs, **kw)
    refs = ref if isinstance(ref, tuple) else (ref,)
    outs = out if isinstance(out, tuple) else (out,)
    stats_from = 1 if op in ("layer_norm", "rms_norm") else len(outs)
    ratios = []
    for k, (o, r) in enumerate(zip(outs, refs)):
        if o is None or r is None:
            continue
        got = cp.asnumpy(o)
        if k >= stats_from:
            # Row statistics (float32, float64 for float64 input): a mean near 0 has no useful
            # relative error, so scale by the largest value instead.
            err = float(np.max(np.abs(got - r)) / max(1.0, float(np.max(np.abs(r)))))
            ratios.append(err / STAT_TOL[dtype] * TOL[dtype])
            continue
        # An output can be no closer than the reference rounded to its dtype (float16 rows of
        # 10^6 columns are subnormal): allow twice that when it exceeds the tolerance.
        floor = _rel(np.asarray(r).astype(got.dtype), r)
        ratios.append(_rel(got, r) * TOL[dtype] / max(TOL[dtype], 2 * floor))
    return max(ratios)


# ------------------------------------------------------------------------------------------
# The command line's pipeline: chunked against single-shot, through the real commands


def _cli(args: list[str]) -> None:
    from .cli import app

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        app.main(args=args, prog_name="cukern", standalone_mode=False)


def _pipeline_cases(ops):
    """(label, command builder) for each op command the CLI has for the ops present."""
    cases = [("softmax", lambda d: ["softmax", d["x"]]),
             ("log_softmax", lambda d: ["softmax", d["x"], "--log"]),
             ("softmax_backward", lambda d: ["softmax", d["y"], "--grad", d["dy"]]),
             ("softmax axis 0", lambda d: ["softmax", d["x"], "--axis", "0"])]
    if "layer_norm" in ops:
        cases.append(("layer_norm", lambda d: ["layer-norm", d["x"], "--weight", d["w"],
                                               "--bias", d["b"]]))
    if "layer_norm_backward" in ops:
        cases.append(("layer_norm_backward", lambda d: ["layer-norm", d["x"], "--grad", d["dy"],
                                                        "--weight", d["w"]]))
    if "rms_norm" in ops:
        cases.append(("rms_norm", lambda d: ["rms-norm", d["x"], "--weight", d["w"]]))
    if "rms_norm_backward" in ops:
        cases.append(("rms_norm_backward", lambda d: ["rms-norm", d["x"], "--grad", d["dy"],
                                                      "--weight", d["w"]]))
    return cases


def _pipeline_checks(device, dtypes, seed):
    """Each op command with --chunk-rows 7 gives the same file, bit for bit, as in one piece."""
    rng = np.random.default_rng(seed + 1)
    dev = "cpu" if device == "cpu" else f"gpu:{device}"
    ops = available_ops(device)
    shape = (61, 1500)
    with tempfile.TemporaryDirectory(prefix="cukern-selftest-") as tmp:
        for dtype in dtypes:
            dt = _np_dtype(dtype)
            files = {}
            for name, arr in (("x", rng.standard_normal(shape) * 2),
                              ("y", reference.softmax(rng.standard_normal(shape))),
                              ("dy", rng.standard_normal(shape)),
                              ("w", 1 + 0.1 * rng.standard_normal(shape[-1])),
                              ("b", 0.1 * rng.standard_normal(shape[-1]))):
                files[name] = str(Path(tmp) / f"{name}-{dtype}.npy")
                np.save(files[name], arr.astype(dt))
            for label, build in _pipeline_cases(ops):
                row = dict(op=label, variant="cli chunked", dtype=dtype,
                           shape="x".join(map(str, shape)), tol=0.0)
                try:
                    one, many = (str(Path(tmp) / f"{k}.npy") for k in ("one", "many"))
                    base = build(files) + ["--device", dev, "-q", "--overwrite"]
                    _cli(base + ["-o", one])
                    _cli(base + ["-o", many, "--chunk-rows", "7"])
                    a, b = np.load(one), np.load(many)
                    same = a.shape == b.shape and a.tobytes() == b.tobytes()
                    row["error"] = 0.0 if same else _rel(b.view(dt), a.view(dt))
                    row["ok"] = same
                    if not same:
                        row["note"] = "chunked output differs from single-shot"
                except Exception as err:
                    row.update(ok=False, note=f"{type(err).__name__}: {err}")
                yield row


# ------------------------------------------------------------------------------------------
# CPU: the reference path


def _cpu_checks(dtypes, seed):
    yield from _gradient_checks(seed)
    yield from _property_checks(seed)
    yield from _pipeline_checks("cpu", dtypes, seed)


def _gradient_checks(seed):
    """Each backward reference against central differences of its forward (float64)."""
    rng = np.random.default_rng(seed)
    shape = (5, 17)
    for op in available_ops("cpu"):
        if not op.endswith("_backward"):
            continue
        fwd = getattr(reference, _FORWARD[op])
        x = rng.standard_normal(shape)
        dy = rng.standard_normal(shape)
        v = rng.standard_normal(shape)
        h = 1e-6
        row = dict(op=op, variant="reference vs finite diff", dtype="float64",
                   shape="x".join(map(str, shape)), tol=1e-6)
        if op.startswith(("softmax", "log_softmax")):
            def loss(z):
                return float(np.sum(dy * fwd(z)))
            y = fwd(x)
            dx = getattr(reference, op)(y, dy)
            checks = [(dx, v, lambda t: x + t * v)]
        else:
            cols = shape[-1]
            w = 1 + 0.1 * rng.standard_normal(cols)
            b = 0.1 * rng.standard_normal(cols)
            layer = op.startswith("layer")
            eps = _EPS[_FORWARD[op]]

            def run_fwd(z, ww, bb=b):
                return fwd(z, (cols,), ww, bb, eps) if layer else fwd(z, (cols,), ww, eps)

            def loss(args):
                z, ww = args
                return float(np.sum(dy * run_fwd(z, ww)[0]))

            stats = run_fwd(x, w)[1:]
            grads = getattr(reference, op)(dy, x, *stats, w)
            vw = rng.standard_normal(cols)
            checks = [(grads[0], v, lambda t: (x + t * v, w)),
                      (grads[1], vw, lambda t: (x, w + t * vw))]
        errors = []
        for grad, direction, point in checks:
            fd = (loss(point(h)) - loss(point(-h))) / (2 * h)
            an = float(np.sum(grad * direction))
            errors.append(abs(fd - an) / max(abs(an), 1e-12))
        row["error"] = max(errors)
        row["ok"] = row["error"] <= row["tol"]
        yield row


def _property_checks(seed):
    """Forward references: softmax rows sum to 1, norms give mean 0 / unit (mean) square."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((9, 31)) * 5
    cols = x.shape[-1]
    checks = {
        "softmax": lambda: np.abs(reference.softmax(x).sum(-1) - 1).max(),
        "log_softmax": lambda: np.abs(np.log(np.exp(reference.log_softmax(x)).sum(-1))).max(),
    }
    ops = available_ops("cpu")
    if "layer_norm" in ops:
        def layer():
            y = reference.layer_norm(x, (cols,), None, None, 0.0)[0]
            return max(np.abs(y.mean(-1)).max(), np.abs(y.var(-1) - 1).max())
        checks["layer_norm"] = layer
    if "rms_norm" in ops:
        def rms():
            y = reference.rms_norm(x, (cols,), None, 0.0)[0]
            return np.abs((y * y).mean(-1) - 1).max()
        checks["rms_norm"] = rms
    for op, check in checks.items():
        err = float(check())
        yield dict(op=op, variant="reference properties", dtype="float64",
                   shape="x".join(map(str, x.shape)), error=err, tol=1e-12,
                   ok=bool(err <= 1e-12))

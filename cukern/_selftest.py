"""``cukern selftest``: every op of :mod:`cukern.registry`, kernel variant and dtype on random
data against the float64 NumPy references (on the CPU: the references themselves); permute
against ``numpy.transpose``, bit for bit, at every element size.

:func:`run` yields one row per check (a dict: op, variant, dtype, shape, error, tol, ok, note),
so the command can print them as they complete; the command adds its own file pipeline checks
(:mod:`cukern.cli.checks`).
"""

from __future__ import annotations

import numpy as np

from . import reference, registry
from ._io import np_dtype
from .plan import CLUSTER_SIZES, ITEMSIZE, max_dynamic_smem

__all__ = ["TOL", "rel_error", "run"]

# Relative error ||out - ref|| / ||ref|| allowed per dtype (the tests use the same table).
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-6, "float64": 1e-12}
STAT_TOL = {"float16": 1e-5, "bfloat16": 1e-5, "float32": 1e-5, "float64": 1e-12}

_EPS = {"layer_norm": 1e-5, "rms_norm": 1e-6}  # the norms' default eps


def _growth(n: int) -> float:
    """Rounding in the statistics of a row of n values grows like sqrt(n): TOL holds up to
    2^18 values and grows with that beyond, as in the GPU tests (layer norm float32 over
    921704 columns: 2.1e-6 against TOL's 2e-6)."""
    return max(1.0, (n / 2**18) ** 0.5)


def rel_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (the absolute error when ref is all zeros)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom else 1.0))


def run(device, dtypes, seed: int = 0):
    """Yield one result row per check; ``device`` is a CUDA device id or ``"cpu"``."""
    if device == "cpu":
        yield from _gradient_checks(seed)
        yield from _property_checks(seed)
    else:
        yield from _gpu_checks(device, dtypes, seed)


# ------------------------------------------------------------------------------------------
# GPU: kernels against the references


def shapes(op: str, dtype: str, spec) -> list[tuple[str, tuple[int, ...], int]]:
    """(intended variant, shape, axis) for each kernel variant of ``op`` on this device."""
    spec_op = registry.get(op)
    cap = max_dynamic_smem(spec) // (ITEMSIZE[dtype] * len(spec_op.inputs))
    out = [("warp", (257, 33), -1), ("warp", (256, 1024), -1), ("block_smem", (64, 3000), -1),
           ("cluster", (4, -(-(cap + 100) // 8) * 8), -1),
           ("block_uncached", (2, -(-(CLUSTER_SIZES[-1] * cap + 100) // 8) * 8), -1)]
    if spec_op.family == "softmax":
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
    ops = [op for op in registry.names() if registry.get(op).rowwise]
    _warm(device, spec, ops, dtypes)
    with cp.cuda.Device(device):
        yield from _batch_norm_checks(cp, dtypes, rng)
        if "permute" in registry.OPS:
            yield from _permute_checks(cp, dtypes, rng)
        for op in ops:
            for dtype in dtypes:
                seen = set()
                for intended, shape, axis in shapes(op, dtype, spec):
                    variant = _variant(op, shape, dtype, axis, device, intended)
                    if variant in seen and intended != "warp":
                        continue  # e.g. no clusters before Hopper: that shape is uncached too
                    seen.add(variant)
                    tol = TOL[dtype] * _growth(shape[axis])
                    row = dict(op=op, variant=variant, dtype=dtype,
                               shape="x".join(map(str, shape)), tol=tol)
                    try:
                        row["error"] = _gpu_error(cp, op, dtype, shape, axis, rng)
                        row["ok"] = bool(row["error"] <= tol)
                    except Exception as err:  # a failure to compile or launch is a FAIL row
                        first = str(err).splitlines()[0] if str(err) else ""
                        row.update(ok=False, note=f"{type(err).__name__}: {first}")
                    yield row


# (layout, shape (N, C, *spatial)); channels-last arrays are built as NHWC memory
_BN_CASES = (("NCHW", (4, 6, 5, 7)), ("channels_last", (4, 8, 5, 6)), ("NC", (96, 24)))


def _bn_input(rng, shape, dtype, layout):
    x = rng.standard_normal(shape if layout != "channels_last" else
                            (shape[0], *shape[2:], shape[1])) * 2 + 0.5
    x = x.astype(np_dtype(dtype))
    return x if layout != "channels_last" else np.moveaxis(x, -1, 1)


def _bn_device(cp, a, layout):
    """``a`` on the GPU in the same memory layout (``cupy.asarray`` of a channels-last NumPy
    view would copy it to C order, and the mask's bit order follows memory)."""
    if layout != "channels_last" or a.ndim < 3:
        return cp.asarray(a)
    last = cp.asarray(np.ascontiguousarray(np.moveaxis(a, 1, -1)))
    return cp.moveaxis(last, -1, 1)


def _batch_norm_checks(cp, dtypes, rng):
    """Training batch norm with addend and ReLU (y, statistics, mask) and its backward through
    the mask (dx, dweight, dbias, daddend), per layout, against the references."""
    import cukern

    for dtype, (layout, shape) in ((d, c) for d in dtypes for c in _BN_CASES):
        pdt = np.float64 if dtype == "float64" else np.float32
        x, z, dy = (_bn_input(rng, shape, dtype, layout) for _ in range(3))
        c = shape[1]
        w = (1 + 0.1 * rng.standard_normal(c)).astype(pdt)
        b = (0.1 * rng.standard_normal(c)).astype(pdt)
        ref = reference.batch_norm(x, None, None, w, b, training=True, addend=z, relu=True,
                                   return_stats=True)
        for op in ("batch_norm", "batch_norm_backward"):
            row = dict(op=op, variant=f"{layout} relu+add", dtype=dtype,
                       shape="x".join(map(str, shape)), tol=TOL[dtype])
            try:
                if op == "batch_norm":
                    got = cukern.batch_norm(_bn_device(cp, x, layout), None, None,
                                            cp.asarray(w), cp.asarray(b), training=True,
                                            addend=_bn_device(cp, z, layout), relu=True,
                                            return_stats=True)
                    ratios = [rel_error(cp.asnumpy(got[0]), ref[0])]
                    ratios += [rel_error(cp.asnumpy(g), r) * TOL[dtype] / STAT_TOL[dtype]
                               for g, r in zip(got[1:3], ref[1:3])]
                    # mask bits in memory order; one may differ only where y rounds to 0
                    y = ref[0] if layout != "channels_last" else np.moveaxis(ref[0], 1, -1)
                    keep = reference.unpack_mask(cp.asnumpy(got[3]), y.size)
                    wrong = keep != (y.ravel() > 0)
                    ratios.append(0.0 if np.all(np.abs(y.ravel()[wrong]) <= 4 * TOL[dtype])
                                  else float("inf"))
                else:
                    mean, invstd = (r.astype(pdt) for r in ref[1:3])
                    want = reference.batch_norm_backward(dy, x, mean, invstd, w, mask=ref[3],
                                                         addend=True)
                    got = cukern.batch_norm_backward(
                        _bn_device(cp, dy, layout), _bn_device(cp, x, layout),
                        *(cp.asarray(a) for a in (mean, invstd, w)),
                        mask=cp.asarray(ref[3]), addend=True)
                    ratios = [rel_error(cp.asnumpy(g), r) for g, r in zip(got, want)]
                row["error"] = max(ratios)
                row["ok"] = bool(row["error"] <= TOL[dtype])
            except Exception as err:  # a failure to compile or launch is a FAIL row
                first = str(err).splitlines()[0] if str(err) else ""
                row.update(ok=False, note=f"{type(err).__name__}: {first}")
            yield row


# (label, shape, axes, view of the input, strided out=): NCHW <-> NHWC, an odd rank-4 order, a
# reversed and sliced view into a column slice of a bigger array, 5-D channels last
_PERMUTE_CASES = (("NCHW->NHWC", (3, 5, 17, 19), (0, 2, 3, 1), None, False),
                  ("NHWC->NCHW", (3, 17, 19, 5), (0, 3, 1, 2), None, False),
                  ("rank-4 2031", (3, 5, 7, 9), (2, 0, 3, 1), None, False),
                  ("view -> strided out", (40, 70), (1, 0), (slice(None, None, -1),
                                                             slice(3, None)), True),
                  ("5-D to_nhwc", (2, 6, 3, 5, 7), (0, 2, 3, 4, 1), None, False))


def _elem_bytes(a: np.ndarray) -> np.ndarray:
    """Each element's bytes: shape ``a.shape + (itemsize,)``."""
    return np.asarray(a, order="C")[..., None].view(np.uint8)


def _permute_checks(cp, dtypes, rng):
    """permute against numpy.transpose on random bytes (NaN payloads included), bit for bit:
    every element size (int8, the float dtypes asked for, complex64, complex128), into a fresh
    array and into an ``out=`` (strided where the case says so; the rest of its buffer must
    stay as it was). error: the share of elements that differ."""
    import cukern

    for dtype, (label, shape, axes, view, strided) in (
            (d, c) for d in ("int8", *dtypes, "complex64", "complex128") for c in _PERMUTE_CASES):
        row = dict(op="permute", variant=label, dtype=dtype, shape="x".join(map(str, shape)),
                   tol=0.0)
        try:
            dt = np_dtype(dtype)
            xh = rng.integers(0, 256, int(np.prod(shape)) * dt.itemsize,
                              dtype=np.uint8).view(dt).reshape(shape)
            xd = cp.asarray(xh)
            if view is not None:
                xh, xd = xh[view], xd[view]
            want = np.asarray(np.transpose(xh, axes), order="C")
            if label.endswith("to_nhwc"):
                got = [cp.asnumpy(cukern.to_nhwc(xd))]
            else:
                got = [cp.asnumpy(cukern.permute(xd, axes))]
            # out=: a buffer of 0xA5 bytes whose out region holds the complement of the result
            pad = 3 if strided else 0
            buf = np.full((*want.shape[:-1], want.shape[-1] + pad, dt.itemsize), 0xA5, np.uint8)
            region = (..., slice(pad, None), slice(None))
            buf[region] = ~_elem_bytes(want)
            bd = cp.asarray(buf.reshape(-1)).view(dt).reshape(buf.shape[:-1])
            if not label.endswith("to_nhwc"):
                cukern.permute(xd, axes, out=bd[..., pad:])
                back = _elem_bytes(cp.asnumpy(bd))
                if (back[..., :pad, :] != 0xA5).any():
                    raise AssertionError("out= wrote outside its elements")
                got.append(back[..., pad:, :].view(dt)[..., 0])
            wrong = 0
            for g in got:
                if g.shape != want.shape or g.dtype != want.dtype:
                    raise AssertionError(f"got {g.dtype} {g.shape}, expected {want.dtype} "
                                         f"{want.shape}")
                wrong = max(wrong, int((_elem_bytes(g) != _elem_bytes(want)).any(-1).sum()))
            row["error"] = wrong / max(want.size, 1)
            row["ok"] = wrong == 0
        except Exception as err:  # a failure to compile or launch is a FAIL row
            first = str(err).splitlines()[0] if str(err) else ""
            row.update(ok=False, note=f"{type(err).__name__}: {first}")
        yield row


def _data(rng, op, shape, dtype, axis):
    """Inputs (cast to ``dtype``) for op, as a dict of NumPy arrays, and the op's arguments."""
    dt = np_dtype(dtype)
    op_spec = registry.get(op)
    x = (rng.standard_normal(shape) * 2).astype(dt)
    if op_spec.family == "softmax":
        if op_spec.forward:
            y = registry.get(op_spec.forward).reference(x, axis=axis).astype(dt)
            dy = rng.standard_normal(shape).astype(dt)
            return [dy, y], {"axis": axis}
        return [x], {"axis": axis}
    cols = shape[-1]
    w = (1 + 0.1 * rng.standard_normal(cols)).astype(dt)
    b = (0.1 * rng.standard_normal(cols)).astype(dt)
    fwd = op_spec.forward or op
    eps = _EPS[fwd]
    fargs = [x, (cols,), w, b, eps] if fwd == "layer_norm" else [x, (cols,), w, eps]
    if not op_spec.forward:
        return fargs, {"return_stats": True}
    stats = [s.astype(np.float64 if dtype == "float64" else np.float32)
             for s in registry.get(fwd).reference(*fargs, return_stats=True)[1:]]
    dy = rng.standard_normal(shape).astype(dt)
    return [dy, x, *stats, w], {}


def _gpu_error(cp, op, dtype, shape, axis, rng) -> float:
    """The worst output's error, scaled so that TOL[dtype] is the bound for every output."""
    op_spec = registry.get(op)
    args, kw = _data(rng, op, shape, dtype, axis)
    ref = op_spec.reference(*args, **kw)
    dargs = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    out = op_spec.fn(*dargs, **kw)
    refs = ref if isinstance(ref, tuple) else (ref,)
    outs = out if isinstance(out, tuple) else (out,)
    stats_from = 1 if op_spec.family == "norm" and not op_spec.forward else len(outs)
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
        floor = rel_error(np.asarray(r).astype(got.dtype), r)
        ratios.append(rel_error(got, r) * TOL[dtype] / max(TOL[dtype], 2 * floor))
    return max(ratios)


# ------------------------------------------------------------------------------------------
# CPU: the reference path


def _gradient_checks(seed):
    """Each backward reference against central differences of its forward (float64)."""
    rng = np.random.default_rng(seed)
    shape = (5, 17)
    for op_spec in registry.OPS.values():
        if not op_spec.forward:
            continue
        if not op_spec.rowwise:
            yield _batch_norm_gradient_check(rng, op_spec)
            continue
        op = op_spec.name
        fwd = registry.get(op_spec.forward).reference
        x = rng.standard_normal(shape)
        dy = rng.standard_normal(shape)
        v = rng.standard_normal(shape)
        h = 1e-6
        row = dict(op=op, variant="reference vs finite diff", dtype="float64",
                   shape="x".join(map(str, shape)), tol=1e-6)
        if op_spec.family == "softmax":
            def loss(z):
                return float(np.sum(dy * fwd(z)))
            y = fwd(x)
            dx = op_spec.reference(dy, y)
            checks = [(dx, v, lambda t: x + t * v)]
        else:
            cols = shape[-1]
            w = 1 + 0.1 * rng.standard_normal(cols)
            b = 0.1 * rng.standard_normal(cols)
            layer = op_spec.forward == "layer_norm"
            eps = _EPS[op_spec.forward]

            def run_fwd(z, ww, bb=b):
                return fwd(z, (cols,), ww, bb, eps, return_stats=True) if layer else \
                    fwd(z, (cols,), ww, eps, return_stats=True)

            def loss(args):
                z, ww = args
                return float(np.sum(dy * run_fwd(z, ww)[0]))

            stats = run_fwd(x, w)[1:]
            grads = op_spec.reference(dy, x, *stats, w)
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


def _batch_norm_gradient_check(rng, op_spec) -> dict:
    """Training batch norm's backward reference (dx, dweight, dbias) against central
    differences of sum(dy * y) over x, weight and bias."""
    shape, h = (4, 3, 5), 1e-6
    x, dy, v = (rng.standard_normal(shape) for _ in range(3))
    w, b = 1 + 0.1 * rng.standard_normal(3), 0.1 * rng.standard_normal(3)
    vw, vb = rng.standard_normal(3), rng.standard_normal(3)

    def loss(z, ww, bb):
        return float(np.sum(dy * reference.batch_norm(z, None, None, ww, bb, training=True)))

    _, mean, invstd, _ = reference.batch_norm(x, None, None, w, b, training=True,
                                              return_stats=True)
    dx, dw, db = op_spec.reference(dy, x, mean, invstd, w)
    errors = []
    for grad, d, point in ((dx, v, lambda t: (x + t * v, w, b)),
                           (dw, vw, lambda t: (x, w + t * vw, b)),
                           (db, vb, lambda t: (x, w, b + t * vb))):
        fd = (loss(*point(h)) - loss(*point(-h))) / (2 * h)
        an = float(np.sum(grad * d))
        errors.append(abs(fd - an) / max(abs(an), 1e-12))
    err = max(errors)
    return dict(op=op_spec.name, variant="reference vs finite diff", dtype="float64",
                shape="x".join(map(str, shape)), error=err, tol=1e-6, ok=bool(err <= 1e-6))


def _property_checks(seed):
    """Forward references: softmax rows sum to 1, norms give mean 0 / unit (mean) square."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((9, 31)) * 5
    cols = x.shape[-1]

    def layer():
        y = reference.layer_norm(x, (cols,), None, None, 0.0)
        return max(np.abs(y.mean(-1)).max(), np.abs(y.var(-1) - 1).max())

    def rms():
        y = reference.rms_norm(x, (cols,), None, 0.0)
        return np.abs((y * y).mean(-1) - 1).max()

    checks = {
        "softmax": lambda: np.abs(reference.softmax(x).sum(-1) - 1).max(),
        "log_softmax": lambda: np.abs(np.log(np.exp(reference.log_softmax(x)).sum(-1))).max(),
        "layer_norm": layer,
        "rms_norm": rms,
    }
    for op, check in checks.items():
        err = float(check())
        yield dict(op=op, variant="reference properties", dtype="float64",
                   shape="x".join(map(str, x.shape)), error=err, tol=1e-12,
                   ok=bool(err <= 1e-12))

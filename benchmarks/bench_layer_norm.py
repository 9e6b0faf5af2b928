"""Layer norm / RMS norm benchmark: effective bandwidth beside a same-size copy and peers.

Sweeps (issue 3): cols 32..262144 with rows = 2**27 / cols, for float16, bfloat16 and float32,
with weight (and bias, for layer norm):

* forward, layer and RMS (statistics returned, as a training step needs them);
* backward: dx plus dweight (and dbias);
* the residual-fused forward (``residual=``) against cukern's own add followed by the norm.

Peers in the same run: PyTorch (eager; ``native_layer_norm_backward`` for the layer-norm
backward, autograd for RMS) and JAX (jit). Bytes counted: every byte the call must move.
Forward: x read and y written, the per-row statistics written (float32 mean and rstd, rstd
alone for RMS norm: 8 or 4 bytes a row, 6% of a float16 row of 32 columns), weight (and bias)
read once; residual forward: x and residual read, y and h written, the same
statistics and parameters; backward: x and dy read, dx written, the statistics and weight read,
dweight (and dbias) written once. ``pct_copy`` is an op's bandwidth over a same-size device
copy's (x read, one array written), measured in the same run; each peer is credited the same
bytes (its time is what differs).

    python benchmarks/bench_layer_norm.py [--quick] [--out benchmarks/results] [--ops ...]
    python benchmarks/bench_layer_norm.py --ways [--cols16 LIST] [--cols32 LIST] [--ops ...]
    python benchmarks/bench_layer_norm.py --limits [--reps 40]

Writes layer_norm_<gpu>.json and .png (``_results``: a run of some ops or dtypes keeps the
file's others), appends a row per shape to history.csv, prints a table and checks the issue's
targets. ``--ways`` times the backward's planned way beside every way forced (``_norm_ways``,
norm_backward_ways_<gpu>.*); ``--limits`` the forward at 65536-262144 columns with and without
its parameters and at whole waves (``_norm_limits``, norm_limits_<gpu>.*). What they found:
docs/notes/layer-norm-forward.md and layer-norm-backward.md.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX beside CuPy and torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import _norm_limits  # noqa: E402
import _norm_ways  # noqa: E402
import _results  # noqa: E402
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import cukern  # noqa: E402
from cukern import _bench  # noqa: E402
from cukern._device import DeviceSpec  # noqa: E402
from cukern._io import np_dtype  # noqa: E402
from cukern.ops import layer_norm as ln  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32")
OPS = ("layer_norm", "rms_norm", "layer_norm_backward", "rms_norm_backward",
       "layer_norm_residual", "rms_norm_residual")
# Row-sized arrays each op must move (reads + writes).
ARRAYS = {"layer_norm": 2, "rms_norm": 2, "layer_norm_backward": 3, "rms_norm_backward": 3,
          "layer_norm_residual": 4, "rms_norm_residual": 4}
EPS = {"layer": 1e-5, "rms": 1e-6}
# float32 statistics per row (written by the forward, read by the backward), and column-sized
# parameters (weight and bias read; dweight and dbias written by the backward).
STATS = {"layer": 2, "rms": 1}
PARAMS = {"layer_norm": 2, "rms_norm": 1, "layer_norm_backward": 3, "rms_norm_backward": 2,
          "layer_norm_residual": 2, "rms_norm_residual": 1}


def moved_bytes(op: str, rows: int, cols: int, item: int) -> int:
    """Bytes an op must move for rows x cols of itemsize ``item`` (see the module's docstring)."""
    stats = STATS["layer" if op.startswith("layer") else "rms"]
    return (ARRAYS[op] * rows * cols + PARAMS[op] * cols) * item + stats * rows * 4


def _inputs(op: str, rows: int, cols: int, dtype, n_sets: int) -> list[dict]:
    sets = []
    for _ in range(n_sets):
        d = {"x": cp.random.standard_normal((rows, cols), dtype=cp.float32).astype(dtype),
             "w": (cp.random.standard_normal(cols, dtype=cp.float32) + 1).astype(dtype),
             "b": cp.random.standard_normal(cols, dtype=cp.float32).astype(dtype)}
        if op.endswith("backward"):
            d["dy"] = cp.random.standard_normal((rows, cols), dtype=cp.float32).astype(dtype)
            if op.startswith("layer"):
                _, d["mean"], d["rstd"] = cukern.layer_norm(d["x"], cols, d["w"], d["b"],
                                                            return_stats=True)
            else:
                _, d["rstd"] = cukern.rms_norm(d["x"], cols, d["w"], return_stats=True)
        if op.endswith("residual"):
            d["r"] = cp.random.standard_normal((rows, cols), dtype=cp.float32).astype(dtype)
        sets.append(d)
    return sets


def _cukern_fns(op: str, sets, cols: int) -> dict:
    """peer label -> fn(i) for cukern (and, for the residual ops, its unfused add + norm)."""
    layer = op.startswith("layer")
    if op in ("layer_norm", "rms_norm"):
        if layer:
            return {"cukern": lambda i: cukern.layer_norm(sets[i]["x"], cols, sets[i]["w"],
                                                          sets[i]["b"], return_stats=True)}
        return {"cukern": lambda i: cukern.rms_norm(sets[i]["x"], cols, sets[i]["w"],
                                                    return_stats=True)}
    if op.endswith("backward"):
        if layer:
            return {"cukern": lambda i: cukern.layer_norm_backward(
                sets[i]["dy"], sets[i]["x"], sets[i]["mean"], sets[i]["rstd"], sets[i]["w"])}
        return {"cukern": lambda i: cukern.rms_norm_backward(
            sets[i]["dy"], sets[i]["x"], sets[i]["rstd"], sets[i]["w"])}
    # residual: fused, and cukern's own add followed by the norm
    if layer:
        def fused(i):
            s = sets[i]
            return cukern.layer_norm(s["x"], cols, s["w"], s["b"], residual=s["r"],
                                     return_stats=True)

        def unfused(i):
            s = sets[i]
            h = s["x"] + s["r"]
            return cukern.layer_norm(h, cols, s["w"], s["b"], return_stats=True), h
    else:
        def fused(i):
            s = sets[i]
            return cukern.rms_norm(s["x"], cols, s["w"], residual=s["r"], return_stats=True)

        def unfused(i):
            s = sets[i]
            h = s["x"] + s["r"]
            return cukern.rms_norm(h, cols, s["w"], return_stats=True), h
    return {"cukern": fused, "cukern_add_then_norm": unfused}


def _torch_fn(op: str, sets, cols: int):
    import torch
    import torch.nn.functional as F

    layer = op.startswith("layer")
    t = [{k: torch.from_dlpack(v) for k, v in s.items()} for s in sets]
    eps = EPS["layer" if layer else "rms"]

    def rms(x, w):
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (cols,), w, eps)
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * w

    if op == "layer_norm":
        return lambda i: torch.ops.aten.native_layer_norm(t[i]["x"], [cols], t[i]["w"],
                                                          t[i]["b"], eps)
    if op == "rms_norm":
        return lambda i: rms(t[i]["x"], t[i]["w"])
    if op == "layer_norm_backward":
        for s in t:
            _, s["tmean"], s["trstd"] = torch.ops.aten.native_layer_norm(s["x"], [cols], s["w"],
                                                                         s["b"], eps)
        return lambda i: torch.ops.aten.native_layer_norm_backward(
            t[i]["dy"], t[i]["x"], [cols], t[i]["tmean"], t[i]["trstd"], t[i]["w"], t[i]["b"],
            [True, True, True])
    if op == "rms_norm_backward":
        for s in t:
            s["xr"] = s["x"].detach().requires_grad_()
            s["wr"] = s["w"].detach().requires_grad_()
            s["y"] = rms(s["xr"], s["wr"])
        return lambda i: torch.autograd.grad(t[i]["y"], (t[i]["xr"], t[i]["wr"]), t[i]["dy"],
                                             retain_graph=True)
    if op == "layer_norm_residual":
        def run(i):
            h = t[i]["x"] + t[i]["r"]
            return torch.ops.aten.native_layer_norm(h, [cols], t[i]["w"], t[i]["b"], eps), h
        return run

    def run_rms(i):
        h = t[i]["x"] + t[i]["r"]
        return rms(h, t[i]["w"]), h

    return run_rms


def _jax_fn(op: str, sets, cols: int):
    import jax
    import jax.numpy as jnp

    layer = op.startswith("layer")
    eps = EPS["layer" if layer else "rms"]

    def norm(x, w, b):
        xf = x.astype(jnp.float32)
        if layer:
            m = xf.mean(-1, keepdims=True)
            v = ((xf - m) ** 2).mean(-1, keepdims=True)
            y = (xf - m) * jax.lax.rsqrt(v + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)
        else:
            ms = (xf * xf).mean(-1, keepdims=True)
            y = xf * jax.lax.rsqrt(ms + eps) * w.astype(jnp.float32)
        return y.astype(x.dtype)

    j = [{k: jnp.from_dlpack(v) for k, v in s.items() if k in ("x", "w", "b", "dy", "r")}
         for s in sets]
    if op in ("layer_norm", "rms_norm"):
        f = jax.jit(norm)
        call = lambda i: f(j[i]["x"], j[i]["w"], j[i]["b"])  # noqa: E731
    elif op.endswith("backward"):
        f = jax.jit(lambda x, w, b, dy: jax.vjp(norm, x, w, b)[1](dy))
        call = lambda i: f(j[i]["x"], j[i]["w"], j[i]["b"], j[i]["dy"])  # noqa: E731
    else:
        f = jax.jit(lambda x, r, w, b: (norm(x + r, w, b), x + r))
        call = lambda i: f(j[i]["x"], j[i]["r"], j[i]["w"], j[i]["b"])  # noqa: E731
    return _bench.jax_pipelined(call)


def sweep(op: str, dtypes, cols_list, reps: int, peers=("torch", "jax")) -> list[dict]:
    rows_fn = lambda c: max(1, 2**27 // c)  # noqa: E731
    results, copy_cache = [], {}
    _bench.warm_up()
    for name in dtypes:
        dtype = np_dtype(name)
        item = np.dtype(dtype).itemsize
        for cols in cols_list:
            rows = rows_fn(cols)
            array_bytes = rows * cols * item
            moved = moved_bytes(op, rows, cols, item)
            if array_bytes not in copy_cache:
                copy_cache[array_bytes] = _bench.copy_ms(array_bytes, reps)
            c_ms = copy_cache[array_bytes]
            copy_gbps = 2 * array_bytes / c_ms / 1e6
            row = dict(op=op, dtype=name, rows=rows, cols=cols, bytes=moved)
            results.append(dict(row, peer="copy", bytes=2 * array_bytes, ms=c_ms, gbps=copy_gbps,
                                pct_copy=100.0))
            n_sets = _bench._sets(moved)
            sets = _inputs(op, rows, cols, dtype, n_sets)
            fns = [(label, fn, None) for label, fn in _cukern_fns(op, sets, cols).items()]
            for peer in peers:
                try:
                    if peer == "torch":
                        fns.append(("torch", _torch_fn(op, sets, cols), None))
                    elif peer == "jax":
                        run, sync = _jax_fn(op, sets, cols)
                        fns.append(("jax", run, sync))
                except ImportError:
                    continue
            for label, fn, sync in fns:
                try:
                    # JAX (sync given) by the wall clock, pipelined; CuPy and PyTorch by events
                    ms = _bench.time_peer(fn, sync, n_sets, reps)
                except Exception as err:  # a peer that cannot run a shape is reported
                    results.append(dict(row, peer=label, ms=float("nan"), gbps=float("nan"),
                                        pct_copy=float("nan"), error=str(err)[:200]))
                    continue
                gbps = moved / ms / 1e6
                results.append(dict(row, peer=label, ms=ms, gbps=gbps,
                                    pct_copy=100.0 * gbps / copy_gbps))
                if label == "cukern":
                    results[-1]["variant"] = _ran_variant(op)
            del sets, fns
            _bench.free_memory()
    return results


def _ran_variant(op: str) -> str:
    """The variant of the plan the latest call of ``op`` ran ('' if unknown): the one place
    this file reaches into cukern.ops."""
    plan = ln.last_plan(op.replace("_residual", ""))
    return plan.variant.value if plan else ""


def check_targets(results) -> list[str]:
    """The issue's speed targets, one line per miss (empty when all are met)."""
    misses = []
    keyed = {}
    for r in results:
        keyed.setdefault((r["op"], r["dtype"], r["cols"]), {})[r["peer"]] = r
    for (op, dt, cols), d in sorted(keyed.items()):
        ours = d.get("cukern", {}).get("pct_copy", float("nan"))
        if op in ("layer_norm", "rms_norm"):
            need = 95 if cols <= 32768 else 90
            if not ours >= need:
                misses.append(f"{op} {dt} cols={cols}: {ours:.1f}% of copy < {need}%")
        elif op.endswith("backward"):
            if 256 <= cols <= 32768 and not ours >= 85:
                misses.append(f"{op} {dt} cols={cols}: {ours:.1f}% of copy < 85%")
            theirs = d.get("torch", {}).get("ms", float("nan"))
            if d.get("cukern", {}).get("ms", float("inf")) >= theirs:
                misses.append(f"{op} {dt} cols={cols}: not faster than torch "
                              f"({d['cukern']['ms']:.3f} vs {theirs:.3f} ms)")
        else:
            fused = d.get("cukern", {}).get("ms", float("inf"))
            unfused = d.get("cukern_add_then_norm", {}).get("ms", float("nan"))
            # the add then the norm move 5 arrays, the fused op 4: it must save that 1/5
            if not fused <= unfused * 4 / 5:
                misses.append(f"{op} {dt} cols={cols}: fused {fused:.3f} ms vs add + norm "
                              f"{unfused:.3f} ms (needs <= {unfused * 0.8:.3f})")
    return misses


def host_overhead_us(n: int = 20000) -> dict:
    """Microseconds of host time per call on a tiny array."""
    x = cp.random.standard_normal((4, 64), dtype=cp.float32)
    w, b = cp.ones(64, cp.float32), cp.zeros(64, cp.float32)
    _, mean, rstd = cukern.layer_norm(x, 64, w, b, return_stats=True)
    out = {}
    for label, fn in (("layer_norm", lambda: cukern.layer_norm(x, 64, w, b, return_stats=True)),
                      ("rms_norm", lambda: cukern.rms_norm(x, 64, w, return_stats=True)),
                      ("layer_norm_backward",
                       lambda: cukern.layer_norm_backward(x, x, mean, rstd, w)),
                      ("cupy_empty_like", lambda: cp.empty_like(x))):
        out[label] = _bench.best_host_us(fn, n)
    return out


def table(results) -> None:
    peers = ["cukern", "cukern_add_then_norm", "torch", "jax"]
    print(f"{'op':22s} {'dtype':9s} {'cols':>7s} {'variant':15s} {'copy GB/s':>9s} "
          + " ".join(f"{p[:12] + ' %':>14s}" for p in peers))
    keyed = {}
    for r in results:
        keyed.setdefault((r["op"], r["dtype"], r["cols"]), {})[r["peer"]] = r
    for (op, dt, cols), d in keyed.items():
        cells = " ".join(f"{d[p]['pct_copy']:14.1f}" if p in d else f"{'-':>14s}" for p in peers)
        variant = d.get("cukern", {}).get("variant", "")
        print(f"{op:22s} {dt:9s} {cols:7d} {variant:15s} {d['copy']['gbps']:9.0f} {cells}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--ops", default=None,
                    help=f"default: {','.join(OPS)}; with --ways: {','.join(_norm_ways.OPS)}")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--reps", type=int, default=None,
                    help="timing repetitions (default 30, --quick 10, --limits 40)")
    ap.add_argument("--tag", default="", help="file name tag (default: the GPU, e.g. h100)")
    ap.add_argument("--ways", action="store_true",
                    help="the backward's planned way beside every way it could run, forced")
    ap.add_argument("--cols16", default=_norm_ways.COLS16, help="--ways: widths for float16")
    ap.add_argument("--cols32", default=_norm_ways.COLS32,
                    help="--ways: widths for float32 (empty: none)")
    ap.add_argument("--limits", action="store_true",
                    help="the forward at 65536-262144 columns: parameters' cost, whole waves")
    args = ap.parse_args()
    if args.ways:
        _norm_ways.run(args, moved_bytes)
        return
    if args.limits:
        _norm_limits.run(args)
        return
    spec = DeviceSpec.from_device()
    run = _results.Run(args.out, "layer_norm", spec.name, tag=args.tag, quick=args.quick)
    ops = (args.ops or ",".join(OPS)).split(",")
    dtypes = args.dtypes.split(",")
    reps = args.reps or (10 if args.quick else 30)
    cols_list = _bench.default_cols(32, 262144)
    if args.quick:
        cols_list = cols_list[::3]

    _bench.warm_kernels({op.replace("_residual", "") for op in ops}, dtypes, spec)

    results = []
    for op in ops:
        results += sweep(op, dtypes, cols_list, reps)
        print(f"{op}: done", flush=True)
    overhead = host_overhead_us()
    payload = run.merge_previous(dict(cupy=cp.__version__, results=results,
                                      host_overhead_us=overhead))
    run.save(payload)
    if not args.quick:
        n = run.append(_results.peer_rows(results))
        print(f"history: {n} rows appended to {os.path.join(args.out, _results.HISTORY)}")
    _bench.plot(payload["results"], run.png_path, title=f"cukern layer norm / RMS norm on "
                f"{spec.name} (rows = 2^27 / cols; % of a same-size device copy)")
    table(results)
    print("host overhead (us per call):", {k: round(v, 2) for k, v in overhead.items()})
    misses = check_targets(payload["results"])
    print(f"targets: {'all met' if not misses else f'{len(misses)} missed'}")
    for m in misses:
        print("  ", m)


if __name__ == "__main__":
    main()

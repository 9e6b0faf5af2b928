"""Batch norm benchmark: effective bandwidth beside a same-size copy and peers.

Shapes (issue 23): ResNet-50's batch-norm layers at batch 64 and 256 ((N,64,112,112),
(N,256,56,56), (N,512,28,28), (N,1024,14,14), (N,2048,7,7)), BatchNorm1d (rows x channels),
a video shape (8,64,16,56,56); float16, bfloat16, float32; NCHW and channels-last memory.

Modes: ``train`` (statistics, running-statistics update, y), ``train_relu`` and
``train_add_relu`` (with the 1-bit mask a training step keeps for the backward), ``eval_relu``
(running statistics), ``backward_relu`` (dx, dweight, dbias through the mask). Bytes counted,
the minimum: x read once, y written, the addend read, the mask written (1 bit an element);
backward: x and dy read once, dx written, the mask read. ``pct_copy`` is that over a same-size
device copy (x read, one array written) measured in the same run; ``pct_copy_x2`` counts x
(and dy) read twice, what a two-pass kernel moves. Peers in the same run, each credited the
same bytes: PyTorch (``F.batch_norm`` then ``F.relu``, or ``+ z`` then ``F.relu``; backward:
``threshold_backward`` then ``native_batch_norm_backward``, what autograd runs) and JAX (jit,
timed pipelined).

    python benchmarks/bench_batch_norm.py [--quick] [--modes ...] [--dtypes ...] [--out DIR]

Writes batch_norm_<gpu>.json and .png, appends a row per shape to history.csv, prints a table
and the issue's targets met or missed.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX beside CuPy and torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import _results  # noqa: E402
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import cukern  # noqa: E402
from cukern import _bench  # noqa: E402
from cukern._device import DeviceSpec  # noqa: E402
from cukern._io import np_dtype  # noqa: E402
from cukern.ops import batch_norm as obn  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32")
MODES = ("train", "train_relu", "train_add_relu", "eval_relu", "backward_relu")
EPS, MOMENTUM = 1e-5, 0.1
# Targets, % of copy: training forward and backward counting x (and dy) read twice, eval once.
TARGETS = {"train": ("x2", 85), "train_relu": ("x2", 85), "train_add_relu": ("x2", 85),
           "eval_relu": ("x1", 95), "backward_relu": ("x2", 85)}


def shapes(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(label, logical shape (N, C, *spatial)); 2-D shapes have one layout only."""
    resnet = [(64, 112), (256, 56), (512, 28), (1024, 14), (2048, 7)]
    batches = (64,) if quick else (64, 256)
    out = [(f"resnet N={n}", (n, c, hw, hw)) for n in batches for c, hw in resnet]
    bn1d = [(65536, 256), (16384, 1024), (4096, 4096)] if not quick else [(16384, 1024)]
    out += [("bn1d", s) for s in bn1d]
    if not quick:
        out.append(("video", (8, 64, 16, 56, 56)))
    return out


def make_x(shape, dtype, layout: str) -> cp.ndarray:
    """A random array of logical ``shape`` in NCHW (C order) or channels-last memory."""
    if layout == "NCHW" or len(shape) == 2:
        return cp.random.standard_normal(shape, dtype=cp.float32).astype(dtype)
    last = (shape[0], *shape[2:], shape[1])
    x = cp.random.standard_normal(last, dtype=cp.float32).astype(dtype)
    return x.transpose(0, len(shape) - 1, *range(1, len(shape) - 1))


def moved(mode: str, numel: int, item: int) -> tuple[int, int]:
    """Bytes (x read once, x read twice) a call must move; per-channel vectors aside."""
    mask = -(-numel // 32) * 4
    if mode == "backward_relu":
        once = 3 * numel * item + mask
        return once, once + 2 * numel * item
    once = 2 * numel * item + (numel * item if mode == "train_add_relu" else 0)
    once += mask if mode in ("train_relu", "train_add_relu") else 0
    return once, once + (numel * item if mode.startswith("train") else 0)


def _inputs(mode, shape, dtype, layout, n_sets):
    c = shape[1]
    pdt = np.float32 if np.dtype(dtype).itemsize < 4 else dtype
    sets = []
    for _ in range(n_sets):
        s = {"x": make_x(shape, dtype, layout),
             "w": cp.random.uniform(0.5, 1.5, c).astype(pdt),
             "b": cp.random.uniform(-0.5, 0.5, c).astype(pdt),
             "rm": cp.zeros(c, pdt), "rv": cp.ones(c, pdt)}
        if mode == "train_add_relu":
            s["z"] = make_x(shape, dtype, layout)
        if mode == "backward_relu":
            s["dy"] = make_x(shape, dtype, layout)
            _, s["mean"], s["invstd"], s["mask"] = cukern.batch_norm(
                s["x"], None, None, s["w"], s["b"], training=True, relu=True, return_stats=True)
        sets.append(s)
    return sets


def _cukern_fn(mode, sets):
    def run(i):
        s = sets[i]
        if mode == "backward_relu":
            return cukern.batch_norm_backward(s["dy"], s["x"], s["mean"], s["invstd"], s["w"],
                                              mask=s["mask"])
        train = mode.startswith("train")
        return cukern.batch_norm(s["x"], s["rm"], s["rv"], s["w"], s["b"], training=train,
                                 momentum=MOMENTUM, eps=EPS, addend=s.get("z"),
                                 relu=mode != "train", return_stats=train and mode != "train")

    return run


def _torch_fn(mode, sets):
    import torch
    import torch.nn.functional as F

    t = [{k: torch.from_dlpack(v) for k, v in s.items()} for s in sets]
    if mode == "backward_relu":
        for s, ts in zip(sets, t):
            y = cukern.batch_norm(s["x"], None, None, s["w"], s["b"], training=True, relu=True)
            ts["y"] = torch.from_dlpack(y)

        def run(i):
            s = t[i]
            g = torch.ops.aten.threshold_backward(s["dy"], s["y"], 0)
            return torch.ops.aten.native_batch_norm_backward(
                g, s["x"], s["w"], None, None, s["mean"], s["invstd"], True, EPS,
                [True, True, True])

        return run

    def run(i):
        s = t[i]
        y = F.batch_norm(s["x"], s["rm"], s["rv"], s["w"], s["b"],
                         training=mode.startswith("train"), momentum=MOMENTUM, eps=EPS)
        if mode == "train_add_relu":
            y = y + s["z"]
        return y if mode == "train" else F.relu(y)

    return run


def _jax_fn(mode, sets, axis_last: bool):
    """Jitted batch norm in float32 math over the channel axis (1, or last for channels-last
    arrays handed over as NHWC), timed pipelined by the caller."""
    import jax
    import jax.numpy as jnp

    def norm(x, w, b, z, train: bool, relu: bool):
        caxis = x.ndim - 1 if axis_last else 1
        red = tuple(a for a in range(x.ndim) if a != caxis)
        bshape = [1] * x.ndim
        bshape[caxis] = -1
        xf = x.astype(jnp.float32)
        if train:
            m = xf.mean(red, keepdims=True)
            v = ((xf - m) ** 2).mean(red, keepdims=True)
        else:
            m = jnp.zeros_like(w, jnp.float32).reshape(bshape)  # the running statistics
            v = jnp.ones_like(w, jnp.float32).reshape(bshape)
        y = (xf - m) * jax.lax.rsqrt(v + EPS) * w.reshape(bshape) + b.reshape(bshape)
        if z is not None:
            y = y + z.astype(jnp.float32)
        return (jnp.maximum(y, 0) if relu else y).astype(x.dtype)

    def host(a):  # channels-last views go over as their NHWC memory
        if axis_last and a.ndim > 2:
            a = a.transpose(0, *range(2, a.ndim), 1)
        return jnp.from_dlpack(cp.ascontiguousarray(a))

    j = [{k: host(v) for k, v in s.items() if k in ("x", "w", "b", "z", "dy")} for s in sets]
    train, relu = mode.startswith("train"), mode != "train"
    if mode == "backward_relu":
        f = jax.jit(lambda x, w, b, dy: jax.vjp(lambda x, w, b: norm(x, w, b, None, True, True),
                                                x, w, b)[1](dy))
        call = lambda i: f(j[i]["x"], j[i]["w"], j[i]["b"], j[i]["dy"])  # noqa: E731
    else:
        f = jax.jit(lambda x, w, b, z: norm(x, w, b, z, train, relu))
        call = lambda i: f(j[i]["x"], j[i]["w"], j[i]["b"], j[i].get("z"))  # noqa: E731
    return _bench.jax_pipelined(call)


def sweep(modes, dtypes, shape_list, reps: int, peers=("torch", "jax"),
          ab_one_read: bool = False, layouts=("NCHW", "NHWC", "NC")) -> list[dict]:
    results, copy_cache = [], {}
    _bench.warm_up(2.0)
    for mode, name, (label, shape) in itertools.product(modes, dtypes, shape_list):
        dtype = np_dtype(name)
        item = np.dtype(dtype).itemsize
        numel = math.prod(shape)
        for layout in ("NCHW",) if len(shape) == 2 else ("NCHW", "NHWC"):
            if (layout if len(shape) > 2 else "NC") not in layouts:
                continue
            array_bytes = numel * item
            once, twice = moved(mode, numel, item)
            if array_bytes not in copy_cache:
                copy_cache[array_bytes] = _bench.copy_ms(array_bytes, reps)
            c_ms = copy_cache[array_bytes]
            copy_gbps = 2 * array_bytes / c_ms / 1e6
            row = dict(op=f"batch_norm_{mode}", mode=mode, dtype=name, shape=list(shape),
                       label=label, layout=layout if len(shape) > 2 else "NC",
                       rows=numel // shape[1], cols=shape[1], bytes=once, bytes_x2=twice)
            results.append(dict(row, peer="copy", ms=c_ms, gbps=copy_gbps, pct_copy=100.0))
            n_sets = _bench._sets(once)
            sets = _inputs(mode, shape, dtype, layout, n_sets)
            fns = [("cukern", _cukern_fn(mode, sets), None)]
            if ab_one_read and mode.startswith("train") and _one_read(mode, shape, name, layout):
                fns.append(("cukern_two_pass", _cukern_fn(mode, sets), None))
            for peer in peers:
                try:
                    if peer == "torch":
                        fns.append(("torch", _torch_fn(mode, sets), None))
                    elif peer == "jax":
                        fns.append(("jax",) + _jax_fn(mode, sets, layout == "NHWC"))
                except ImportError:
                    continue
            for who, fn, sync in fns:
                try:
                    if who == "cukern_two_pass":  # the same calls, planned without one read
                        with obn.tuned(bn_one_read_max_bytes=0):
                            ms = _bench.time_gpu(fn, n_sets, reps)
                    else:  # JAX (sync given) by the wall clock, pipelined
                        ms = _bench.time_peer(fn, sync, n_sets, reps)
                except Exception as err:  # a peer that cannot run a shape is reported
                    results.append(dict(row, peer=who, ms=float("nan"), gbps=float("nan"),
                                        pct_copy=float("nan"), error=str(err)[:200]))
                    continue
                gbps = once / ms / 1e6
                results.append(dict(row, peer=who, ms=ms, gbps=gbps,
                                    pct_copy=100.0 * gbps / copy_gbps,
                                    pct_copy_x2=100.0 * twice / ms / 1e6 / copy_gbps))
                if who == "cukern":
                    results[-1]["plan"] = _plan_text(mode, shape, name, layout)
            print(_line(results, row), flush=True)
            del sets, fns
            _bench.free_memory()
    return results


def _one_read(mode, shape, dtype, layout) -> bool:
    """Whether cukern's plan of a training shape is the one-read kernel."""
    plan = cukern.explain("batch_norm", shape, dtype, axis=1, training=True,
                          addend=mode == "train_add_relu", relu=mode != "train",
                          layout=layout if len(shape) > 2 else "NCHW",
                          device=cp.cuda.runtime.getDevice())
    return plan.one_read


def _plan_text(mode, shape, dtype, layout) -> str:
    op = "batch_norm_backward" if mode == "backward_relu" else "batch_norm"
    kw = {} if op.endswith("backward") else {"training": mode.startswith("train"),
                                             "relu": mode != "train",
                                             "addend": mode.endswith("add_relu")}
    try:
        plan = cukern.explain(op, shape, dtype, axis=1, layout=layout if len(shape) > 2
                              else "NCHW", device=cp.cuda.runtime.getDevice(), **kw)
    except Exception as err:  # explain's options are reported, not fatal to the timing
        return f"explain failed: {err}"
    return " ".join(str(plan).split())[:300]


def _line(results, row) -> str:
    by = {r["peer"]: r for r in results if all(r.get(k) == row[k] for k in
                                                ("op", "dtype", "shape", "layout"))}
    ours = by.get("cukern", {})
    peers = "  ".join(f"{p} {by[p]['pct_copy']:5.1f}%" for p in ("cukern_two_pass", "torch", "jax")
                      if p in by)
    return (f"{row['mode']:<15} {row['dtype']:<9} {row['layout']:<4} {str(tuple(row['shape'])):<24}"
            f" cukern {ours.get('pct_copy', float('nan')):5.1f}% (x2 "
            f"{ours.get('pct_copy_x2', float('nan')):5.1f}%)  {peers}")


def check_targets(results) -> list[str]:
    misses = []
    for r in results:
        if r["peer"] != "cukern":
            continue
        how, target = TARGETS[r["mode"]]
        got = r.get("pct_copy_x2" if how == "x2" else "pct_copy", float("nan"))
        peers = [p for p in results if p["peer"] in ("torch", "jax") and all(
            p.get(k) == r[k] for k in ("op", "dtype", "shape", "layout"))]
        slower = [p["peer"] for p in peers if p["ms"] < r["ms"]]
        if not got >= target or slower:
            misses.append(f"{r['mode']} {r['dtype']} {r['layout']} {tuple(r['shape'])}: "
                          f"{got:.1f}% ({'x' + how[1]} counting; target {target})"
                          + (f"; slower than {', '.join(slower)}" if slower else ""))
    return misses


def plot(results, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if any(r["mode"] == m for r in results)]
    layouts = ("NCHW", "NHWC")
    fig, axes = plt.subplots(len(modes), 2, figsize=(14, 2.8 * len(modes)), squeeze=False)
    styles = {"cukern": ("o-", None), "torch": ("s--", None), "jax": ("^:", None)}
    colors = dict(zip(DTYPES, ("C0", "C1", "C2")))
    for row_axes, mode in zip(axes, modes):
        for ax, layout in zip(row_axes, layouts):
            keys = []
            for r in results:
                if r["mode"] == mode and r["layout"] in (layout, "NC") and r["peer"] == "copy":
                    k = (r["label"], tuple(r["shape"]))
                    if k not in keys:
                        keys.append(k)
            xs = range(len(keys))
            for (peer, (style, _)), dtype in itertools.product(styles.items(), DTYPES):
                ys = []
                for k in keys:
                    hit = [r for r in results if r["mode"] == mode and r["peer"] == peer
                           and r["dtype"] == dtype and r["layout"] in (layout, "NC")
                           and tuple(r["shape"]) == k[1]]
                    key = "pct_copy_x2" if TARGETS[mode][0] == "x2" and peer == "cukern" \
                        else "pct_copy"
                    ys.append(hit[0].get(key, float("nan")) if hit else float("nan"))
                ax.plot(xs, ys, style, color=colors[dtype], ms=3, lw=1,
                        label=f"{peer} {dtype}" if peer == "cukern" or dtype == DTYPES[0]
                        else None)
            ax.set_xticks(list(xs))
            ax.set_xticklabels(["x".join(map(str, k[1])) for k in keys], rotation=35,
                               ha="right", fontsize=6)
            ax.axhline(TARGETS[mode][1], color="k", lw=0.5)
            ax.set_ylim(0, 160)  # x read once and counted twice: past 100
            ax.set_title(f"{mode}, {layout}" + (" (cukern: x read twice counted)"
                                                if TARGETS[mode][0] == "x2" else ""), fontsize=8)
            ax.set_ylabel("% of copy", fontsize=7)
    axes[0][0].legend(fontsize=6, ncol=3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=100)


def group_layout(r) -> str:
    """The table's layout column: NCHW planes of 14x14 or fewer values (where per-plane work
    weighs most) apart from the larger ones."""
    small = r["layout"] == "NCHW" and len(r["shape"]) > 2 and math.prod(r["shape"][2:]) <= 196
    return "NCHW<=196" if small else r["layout"]


def table(results) -> None:
    print(f"\n{'mode':<15} {'dtype':<9} {'layout':<9} {'cukern % (x2 / x1)':>20} "
          f"{'torch %':>8} {'jax %':>7}  shapes")
    groups = {}
    for r in results:
        groups.setdefault((r["mode"], r["dtype"], group_layout(r)), []).append(r)
    for (mode, dtype, layout), rs in groups.items():
        def span(peer, key="pct_copy"):
            v = [r.get(key, float("nan")) for r in rs if r["peer"] == peer]
            v = [x for x in v if x == x]
            return f"{min(v):.0f}-{max(v):.0f}" if v else "-"

        print(f"{mode:<15} {dtype:<9} {layout:<9} {span('cukern', 'pct_copy_x2'):>9} / "
              f"{span('cukern'):<9} {span('torch'):>8} {span('jax'):>7}  "
              f"{len([r for r in rs if r['peer'] == 'copy'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 64 and one BatchNorm1d shape")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--layouts", default="NCHW,NHWC,NC",
                    help="memory layouts to time (NC: the 2-D shapes)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--peers", default="torch,jax")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--tuning", default="",
                    help="FIELD=INT[,...]: plan this run with these fields of the device's "
                         "tuning changed (e.g. bn_one_read_max_bytes=0: the two passes)")
    ap.add_argument("--ab-one-read", action="store_true",
                    help="where a training shape's plan reads x once, also time the two passes "
                         "(peer cukern_two_pass, the tuning's bn_one_read_max_bytes = 0)")
    args = ap.parse_args()
    modes, dtypes = args.modes.split(","), args.dtypes.split(",")
    changes = dict((k, int(v)) for k, v in (f.split("=") for f in args.tuning.split(",") if f))
    with obn.tuned(**changes):
        results = sweep(modes, dtypes, shapes(args.quick), args.reps,
                        tuple(p for p in args.peers.split(",") if p), args.ab_one_read,
                        tuple(args.layouts.split(",")))
    device = DeviceSpec.from_device().name
    run = _results.Run(args.out, "batch_norm", device, quick=args.quick)
    payload = run.merge_previous({"results": results},
                                 key=lambda r: (r["mode"], r["dtype"], r["layout"]))
    run.save(payload)
    plot(payload["results"], run.png_path, f"cukern batch norm on {device} (% of copy)")
    hist = [dict(r, op=r["op"] + ("" if r["layout"] == "NC" else f"[{r['layout']}]"))
            for r in results if r["peer"] != "cukern_two_pass"]
    two = {(r["op"], r["dtype"], tuple(r["shape"]), r["layout"]): r["ms"] for r in results
           if r["peer"] == "cukern_two_pass"}

    def note(r) -> str:
        t = two.get((r["op"].split("[")[0], r["dtype"], tuple(r["shape"]), r["layout"]))
        return (f"shape {tuple(r['shape'])}, x read twice: "
                f"{r.get('pct_copy_x2', float('nan')):.1f}%"
                + (f"; the two passes {t * 1000:.1f} us" if t is not None else ""))

    run.append(_results.peer_rows(hist, note=note))
    table(results)
    misses = check_targets(results)
    print(f"\ntargets missed at {len(misses)} shapes" + (":" if misses else ""))
    for m in misses:
        print("  " + m)


if __name__ == "__main__":
    main()

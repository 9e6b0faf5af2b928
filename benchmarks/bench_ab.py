"""A/B of two cukern trees: the softmax and norm sweeps of a base tree and of this one, timed
interleaved shape by shape in one process, beside a same-size device copy.

For changes meant to cost no speed (a refactor, a kernel rewrite): every shape should stay
within 1 point of % of copy.

    python benchmarks/bench_ab.py --base DIR [--rounds 3] [--quick] [--out benchmarks/results]
        [--family softmax,norm] [--ops softmax,...] [--min-cols 65536] [--cols 2048,16384]
        [--dtypes float32] [--col-offset -1]

``--ops``, ``--min-cols``, ``--cols`` and ``--dtypes`` time a subset (the results of the other
shapes are kept from the last run, as for ``--family``). ``--col-offset N`` times rows of N
columns more than the sweep's (-1: odd rows, packs of one element); their rows join the same
results (each row names its base tree), drawn dashed. Each row keeps its rounds' deltas
(``round_deltas``).

DIR holds the base tree's ``cukern/`` and ``kernels/`` (e.g. ``git archive REV | tar -x -C
DIR``). Writes ab_<device>.json and .png and prints the table.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import cukern  # noqa: E402
from cukern import _bench  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32")
SOFTMAX = ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward")
# (label, op, weight, bias, residual)
NORMS = (("layer_norm", "layer_norm", True, True, False),
         ("rms_norm", "rms_norm", True, False, False),
         ("layer_norm+residual", "layer_norm", True, True, True),
         ("rms_norm+residual", "rms_norm", True, False, True),
         ("layer_norm_backward", "layer_norm_backward", True, False, False),
         ("rms_norm_backward", "rms_norm_backward", True, False, False))


def load_base(path: str):
    """The base tree's package, imported as ``cukern_base`` from a copy beside its kernels."""
    root = tempfile.mkdtemp(prefix="cukern_ab_")
    shutil.copytree(os.path.join(path, "cukern"), os.path.join(root, "cukern_base"))
    shutil.copytree(os.path.join(path, "kernels"), os.path.join(root, "kernels"))
    sys.path.insert(0, root)
    return importlib.import_module("cukern_base")


def np_dtype(name: str):
    import ml_dtypes

    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def cases(quick: bool, offset: int = 0):
    cols_list = [32, 1024, 32768, 262144] if quick else _bench.default_cols(32, 262144)
    cols_list = [c + offset for c in cols_list if c + offset > 0]
    out = []
    for dtype in DTYPES:
        for cols in cols_list:
            out += [("softmax", op, op, False, False, False, dtype, cols) for op in SOFTMAX]
            out += [("norm", label, op, w, b, r, dtype, cols) for label, op, w, b, r in NORMS]
    return out


def make_call(lib, case, sets):
    """``fn(i)`` running ``case`` on input set i with library ``lib``, and the bytes moved."""
    family, label, op, w, b, r, dtype, cols = case
    fn = getattr(lib, op)
    if family == "softmax":
        if op.endswith("backward"):
            # by keyword: the base tree may take (y, dy), cukern now takes (dy, y)
            return (lambda i: fn(y=sets[i]["y"], dy=sets[i]["dy"]))
        return (lambda i: fn(sets[i]["x"]))
    if op.endswith("backward"):
        if op.startswith("layer"):
            return (lambda i: fn(sets[i]["dy"], sets[i]["x"], sets[i]["mean"], sets[i]["rstd"],
                                 sets[i]["w"]))
        return (lambda i: fn(sets[i]["dy"], sets[i]["x"], sets[i]["rstd"], sets[i]["w"]))
    def run(i):
        s = sets[i]
        args = (s["x"], cols, s["w"]) + ((s["b"],) if op == "layer_norm" else ())
        return fn(*args, residual=s["r"] if r else None, return_stats=True)

    return run


def moved(case, rows: int) -> int:
    family, label, op, w, b, r, dtype, cols = case
    item = 4 if dtype == "float32" else 2
    arrays = {"softmax": 2, "log_softmax": 2, "softmax_backward": 3,
              "log_softmax_backward": 3, "layer_norm": 2, "rms_norm": 2,
              "layer_norm_backward": 3, "rms_norm_backward": 3}[op]
    if r:
        arrays += 2  # the residual read, h written
    params = (w + b) * cols * item
    stats = {"layer_norm": 2, "layer_norm_backward": 2, "rms_norm": 1,
             "rms_norm_backward": 1}.get(op, 0) * rows * 4
    if op.endswith("norm_backward"):
        params = cols * item * (3 if op.startswith("layer") else 2)  # gamma, dgamma (, dbeta)
    return arrays * rows * cols * item + params + stats


def inputs(case, rows: int, n_sets: int):
    family, label, op, w, b, r, dtype, cols = case
    dt = np_dtype(dtype)
    sets = []
    for _ in range(n_sets):
        def rnd(*shape):
            return cp.random.standard_normal(shape, dtype=cp.float32).astype(dt)

        s = {"x": rnd(rows, cols), "dy": rnd(rows, cols)}
        s["w"], s["b"], s["r"] = rnd(cols), rnd(cols), (rnd(rows, cols) if r else None)
        if op in ("softmax_backward", "log_softmax_backward"):
            s["y"] = getattr(cukern, op.removesuffix("_backward"))(s["x"])
        if op == "layer_norm_backward":
            _, s["mean"], s["rstd"] = cukern.layer_norm(s["x"], cols, return_stats=True)
        if op == "rms_norm_backward":
            _, s["rstd"] = cukern.rms_norm(s["x"], cols, return_stats=True)
        sets.append(s)
    return sets


def prewarm(lib, case_list) -> None:
    """Compile, in parallel, the kernels ``lib``'s planner asks occupancy of for these cases
    (with the device model's answers): first calls then mostly load cubins."""
    spec = lib.DeviceSpec.from_device()
    names = set()

    def record(plan):
        names.add((plan.family, plan.name_expression()))
        return spec.model_occupancy(plan.threads, plan.smem_bytes)

    for family, _label, op, w, b, r, dtype, cols in case_list:
        rows = max(1, 2**27 // cols)
        if hasattr(lib, "_dispatch"):  # a tree from before cukern.plan
            info = lib._dispatch.OPS[op]
            flags = {"weight": w, "bias": b, "residual": r}
            extra = tuple("true" if flags[n] else "false" for n in info.switches) \
                if info.switches else info.extras[0]
            lib._dispatch.plan_rowwise(op, rows, cols, dtype, spec, record, extra=extra)
        else:
            sw = lib.plan.Switches(weight=w, bias=b, residual=r) if family == "norm" else None
            if op.endswith("norm_backward"):
                sw = lib.plan.Switches(weight=w)
            lib.plan.plan_rowwise(op, rows, cols, dtype, spec, record, switches=sw)
    errors = lib._compile.warm_cache(sorted(names), spec.device_id)
    print(f"prewarmed {len(names)} kernels of {lib.__name__}; {len(errors)} failed", flush=True)


def launch_shape(lib, case, rows: int) -> str:
    """The launch ``lib``'s planner picks on this GPU: kernel, grid, block, cluster, smem."""
    family, label, op, w, b, r, dtype, cols = case
    flags = {} if family == "softmax" else {"weight": w, "bias": b, "residual": r}
    p = lib.explain(op, (rows, cols), dtype, device=cp.cuda.runtime.getDevice(), **flags)
    return (f"{p.name_expression()} grid={p.grid} block={p.block[0]}x{p.block[1]} "
            f"cluster={p.cluster} smem={p.smem_bytes}")


def run(base, case_list, rounds: int, reps: int) -> list[dict]:
    rows_out = []
    _bench.warm_up(2.0)
    for n, case in enumerate(case_list):
        family, label, op, w, b, r, dtype, cols = case
        rows = max(1, 2**27 // cols)
        nbytes = moved(case, rows)
        n_sets = max(1, min(8, -(-_bench.ROTATE_BYTES // nbytes)))
        sets = inputs(case, rows, n_sets)
        calls = {"base": make_call(base, case, sets), "new": make_call(cukern, case, sets)}
        for fn in calls.values():  # plan, compile and check the call runs
            fn(0)
        times = {"copy": [], "base": [], "new": []}
        for k in range(rounds):
            times["copy"].append(_bench.copy_ms(nbytes // 2, reps))  # moves nbytes in all
            for who in ("base", "new") if k % 2 == 0 else ("new", "base"):
                times[who].append(_bench.time_gpu(calls[who], n_sets, reps))
        ms = {k: statistics.median(v) for k, v in times.items()}
        row = dict(family=family, op=label, dtype=dtype, rows=rows, cols=cols, bytes=nbytes,
                   copy_ms=ms["copy"], base_ms=ms["base"], new_ms=ms["new"],
                   base_pct=100 * ms["copy"] / ms["base"], new_pct=100 * ms["copy"] / ms["new"])
        row["delta"] = row["new_pct"] - row["base_pct"]
        # each round's new - base (points of copy): how far one shape's runs spread
        row["round_deltas"] = [round(100 * c / n - 100 * c / b, 2) for c, b, n in
                               zip(times["copy"], times["base"], times["new"])]
        row["base_plan"], row["new_plan"] = (launch_shape(lib, case, rows)
                                             for lib in (base, cukern))
        rows_out.append(row)
        print(f"[{n + 1}/{len(case_list)}] {label:<22} {dtype:<9} {cols:>7}  base "
              f"{row['base_pct']:6.1f}%  new {row['new_pct']:6.1f}%  {row['delta']:+5.1f}",
              flush=True)
        if row["delta"] < -1:
            print(f"    rounds {row['round_deltas']}\n    base {row['base_plan']}\n"
                  f"    new  {row['new_plan']}", flush=True)
        del sets, calls
        cp.get_default_memory_pool().free_all_blocks()
    return rows_out


def plot(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({r["op"] for r in rows}, key=[r["op"] for r in rows].index)
    fig, axes = plt.subplots(len(labels), 1, figsize=(9, 2.2 * len(labels)), sharex=True)
    for ax, label in zip(np.atleast_1d(axes), labels):
        for dtype, color in zip(DTYPES, ("C0", "C1", "C2")):
            for offset in sorted({r.get("col_offset", 0) for r in rows}):
                rs = [r for r in rows if r["op"] == label and r["dtype"] == dtype
                      and r.get("col_offset", 0) == offset]
                ax.plot([r["cols"] for r in rs], [r["delta"] for r in rs],
                        "o-" if offset == 0 else "s--", color=color, ms=3,
                        label=dtype if offset == 0 else f"{dtype}, cols {offset:+d}")
        ax.axhline(0, color="k", lw=0.5)
        ax.axhspan(-1, 1, color="0.9")
        ax.set_xscale("log", base=2)
        ax.set_ylabel("new - base\n(points of copy)", fontsize=7)
        ax.set_title(label, fontsize=8)
    np.atleast_1d(axes)[0].legend(fontsize=7)
    np.atleast_1d(axes)[-1].set_xlabel("cols (rows = 2^27 / cols)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="a tree with cukern/ and kernels/")
    ap.add_argument("--base-name", default="", help="how to name the base in the results")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="four column counts")
    ap.add_argument("--family", default="softmax,norm")
    ap.add_argument("--ops", default="", help="only these ops (labels, comma-separated)")
    ap.add_argument("--min-cols", type=int, default=0, help="only rows of at least this many")
    ap.add_argument("--cols", default="", help="only these column counts (comma-separated)")
    ap.add_argument("--dtypes", default="", help="only these dtypes (comma-separated)")
    ap.add_argument("--col-offset", type=int, default=0,
                    help="columns added to each of the sweep's (-1: odd rows)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    base = load_base(args.base)
    fams = set(args.family.split(","))
    ops = set(args.ops.split(",")) if args.ops else None
    only_cols = {int(c) for c in args.cols.split(",")} if args.cols else None
    dtypes = set(args.dtypes.split(",")) if args.dtypes else None
    case_list = [c for c in cases(args.quick, args.col_offset) if c[0] in fams
                 and c[7] >= args.min_cols
                 and (ops is None or c[1] in ops)
                 and (only_cols is None or c[7] in only_cols)
                 and (dtypes is None or c[6] in dtypes)]
    prewarm(base, case_list)
    prewarm(cukern, case_list)
    rows = run(base, case_list, args.rounds, args.reps)
    device = cukern.DeviceSpec.from_device().name
    worst = min(rows, key=lambda r: r["delta"])
    print(f"\n{len(rows)} shapes; new - base, points of copy: median "
          f"{statistics.median(r['delta'] for r in rows):+.2f}, worst {worst['delta']:+.2f} "
          f"({worst['op']} {worst['dtype']} {worst['cols']}); within 1 point: "
          f"{sum(r['delta'] >= -1 for r in rows)} of {len(rows)}")
    from _results import Run  # benchmarks/_results.py

    base_name = args.base_name or args.base
    for r in rows:  # rows of other runs, kept below, may have another base
        r.update(base=base_name, col_offset=args.col_offset)
    result = Run(args.out, "ab", device, quick=args.quick)
    payload = result.merge_previous(  # the shapes this run did not time are kept
        {"base": base_name, "results": rows}, key=lambda r: (r["op"], r["dtype"], r["cols"]))
    result.save(payload)
    result.append([dict(op=r["op"], dtype=r["dtype"], rows=r["rows"], cols=r["cols"],
                        pct_copy=r["new_pct"], gbps=r["bytes"] / r["new_ms"] / 1e6,
                        copy_gbps=r["bytes"] / r["copy_ms"] / 1e6, cukern_ms=r["new_ms"],
                        copy_ms=r["copy_ms"], note=f"base {base_name}: {r['base_pct']:.2f}%")
                   for r in rows])
    plot(payload["results"], result.png_path,
         f"{device}: this tree against {base_name} (% of copy; grey: within 1 point)")


if __name__ == "__main__":
    main()

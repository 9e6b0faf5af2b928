"""``bench_layer_norm.py --limits``: where the forward norms lose time at 65536-262144 columns.

Two measurements on the planned kernels, each beside a same-size device copy in the same run:

* ``affine``: layer norm with no parameters, with weight, and with weight and bias, beside RMS
  norm with no weight and with weight, at rows = 2**27 / cols. Differences between them are the
  cost of each parameter array (read from L2 on every row) and of layer norm's second
  statistic (a second pass over the cached row, a second all-reduce, and Chan's merge across
  the cluster, against RMS norm's one sum);
* ``waves``: layer norm with weight and bias at rows = 2**27 / cols and at the nearest whole
  numbers of waves of resident clusters (the driver's count for the planned kernel): whether
  the last, partial wave costs anything.

Bytes credited: x read and y written only, so the cases of one shape compare by kernel time
alone (the sweep also credits the parameters and statistics: 0.4% more at 262144 columns).

Writes norm_limits_<gpu>.json and .png, a history row per case, and prints both tables.
Notes: docs/notes/layer-norm-forward.md.
"""

from __future__ import annotations

import os

import _results
import numpy as np

DTYPES = ("float16", "bfloat16", "float32")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
COLS = (65536, 131072, 262144)
# (label, op, weight, bias)
AFFINE = (("layer", "layer_norm", False, False), ("layer+w", "layer_norm", True, False),
          ("layer+w+b", "layer_norm", True, True), ("rms", "rms_norm", False, False),
          ("rms+w", "rms_norm", True, False))


def _resident(dtype: str, rows: int, cols: int) -> tuple[int, int]:
    """(rows a wave, cluster) of the planned layer norm with weight and bias: the driver's
    count of resident clusters times the rows each takes a pass. The one place this file
    reaches into the runner."""
    import cukern
    from cukern import runner

    plan = cukern.explain("layer_norm", (rows, cols), dtype, weight=True, bias=True)
    if plan.cluster <= 1:
        return 0, 1
    n = runner._max_active_clusters(runner.kernel(plan, 0), plan)
    return (n or 0) * plan.rows_per_pass, plan.cluster


def _time(label: str, op: str, dtype: str, rows: int, cols: int, weight: bool, bias: bool,
          reps: int) -> dict:
    """Median time of the planned kernel for one case, and a same-size copy's, in % of copy."""
    import cupy as cp

    import cukern
    from cukern import _bench
    from cukern._io import np_dtype

    dt = np.dtype(np_dtype(dtype))
    n_sets = 2
    xs = [cp.random.standard_normal((rows, cols), dtype=cp.float32).astype(dt)
          for _ in range(n_sets)]
    w = (cp.random.standard_normal(cols, dtype=cp.float32) + 1).astype(dt) if weight else None
    b = cp.random.standard_normal(cols, dtype=cp.float32).astype(dt) if bias else None
    if op == "layer_norm":
        def call(i):
            return cukern.layer_norm(xs[i], cols, w, b, return_stats=True)
    else:
        def call(i):
            return cukern.rms_norm(xs[i], cols, w, return_stats=True)
    call(0)
    ms = _bench.time_gpu(call, n_sets, reps=reps)
    nbytes = rows * cols * dt.itemsize
    copy = _bench.copy_ms(nbytes, reps)
    plan = cukern.explain(op, (rows, cols), dtype, weight=weight, bias=bias)
    return dict(case=label, op=op, dtype=dtype, rows=rows, cols=cols, weight=weight, bias=bias,
                variant=plan.variant.value, cluster=plan.cluster,
                rows_per_pass=plan.rows_per_pass, grid=plan.grid, ms=ms, copy_ms=copy,
                pct_copy=100.0 * copy / ms)


def _pct(aff: list[dict], dtype: str, cols: int, label: str) -> float:
    """% of copy of case ``label`` in the affine table."""
    key = (dtype, cols, label)
    return next(r["pct_copy"] for r in aff if (r["dtype"], r["cols"], r["case"]) == key)


def affine(reps: int) -> list[dict]:
    return [_time(label, op, dtype, 2**27 // cols, cols, weight, bias, reps)
            for dtype in DTYPES for cols in COLS for label, op, weight, bias in AFFINE]


def waves(reps: int) -> list[dict]:
    out = []
    for dtype in DTYPES:
        for cols in COLS:
            base = 2**27 // cols
            per, cluster = _resident(dtype, base, cols)
            if per == 0:
                continue
            lo = base // per * per
            for rows in sorted({lo - per, lo, base, lo + per} - {0}):
                r = _time("layer+w+b", "layer_norm", dtype, rows, cols, True, True, reps)
                r.update(rows_a_wave=per, cluster=cluster, waves=rows / per)
                out.append(r)
    return out


def _variant(r: dict) -> str:
    """A case's kernel variant (files that kept the kernel's name instead: from that)."""
    if "variant" in r:
        return r["variant"]
    return "cluster" if "_cluster<" in r.get("kernel", "") else ""


def history_rows(payload: dict) -> list[dict]:
    """One history.csv row per case: x read and y written over the kernel's time."""
    rows = []
    for table in ("affine", "waves"):
        for r in payload[table]:
            item = ITEMSIZE[r["dtype"]]
            copy_gbps = 2 * r["rows"] * r["cols"] * item / r["copy_ms"] / 1e6
            note = f"{table} {r['case']}"
            if table == "waves":
                note += f", {r['waves']:.2f} waves of {r['rows_a_wave']} rows"
            rows.append(dict(op=r["op"], dtype=r["dtype"], rows=r["rows"], cols=r["cols"],
                             variant=_variant(r),
                             pct_copy=r["pct_copy"], gbps=copy_gbps * r["pct_copy"] / 100,
                             copy_gbps=copy_gbps, cukern_ms=r["ms"], copy_ms=r["copy_ms"],
                             note=note))
    return rows


def plot(aff: list[dict], wav: list[dict], path: str, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    ax = axes[0]
    groups = [(d, c) for d in DTYPES for c in COLS]
    width = 0.8 / len(AFFINE)
    for k, (label, *_rest) in enumerate(AFFINE):
        ys = [_pct(aff, d, c, label) for d, c in groups]
        ax.bar(np.arange(len(groups)) + k * width, ys, width, label=label)
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2)
    ax.set_xticklabels([f"{d}\n{c}" for d, c in groups], fontsize=7)
    ax.set_ylim(80, 101)
    ax.axhline(90, color="k", lw=0.6, ls="--")
    ax.set_ylabel("% of a same-size copy (x read, y written)")
    ax.set_title("parameters and statistics (rows = 2^27 / cols)")
    ax.legend(fontsize=8)
    ax = axes[1]
    for dtype in DTYPES:
        for cols in COLS:
            pts = [r for r in wav if (r["dtype"], r["cols"]) == (dtype, cols)]
            if pts:
                ax.plot([r["waves"] for r in pts], [r["pct_copy"] for r in pts], "o-",
                        label=f"{dtype} {cols}")
    ax.axhline(90, color="k", lw=0.6, ls="--")
    ax.set_xlabel("rows / (rows a wave of resident clusters)")
    ax.set_ylabel("% of copy")
    ax.set_title("layer norm with weight and bias: whole and partial waves")
    ax.legend(fontsize=7)
    fig.suptitle(f"cukern forward norms on {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> None:
    """The ``--limits`` mode of bench_layer_norm.py (``args``: its parsed options)."""
    import cupy as cp

    from cukern import _bench
    from cukern._device import DeviceSpec

    spec = DeviceSpec.from_device()
    out = _results.Run(args.out, "norm_limits", spec.name, tag=args.tag)
    reps = args.reps or 40
    _bench.warm_up()
    aff = affine(reps)
    wav = waves(reps)
    payload = dict(cupy=cp.__version__, affine=aff, waves=wav)
    out.save(payload)
    n = out.append(history_rows(payload))
    print(f"history: {n} rows appended to {os.path.join(args.out, _results.HISTORY)}")
    plot(aff, wav, out.png_path, spec.name)
    print("affine (% of copy):", " | ".join(label for label, *_ in AFFINE))
    for dtype in DTYPES:
        for cols in COLS:
            row = [_pct(aff, dtype, cols, label) for label, *_ in AFFINE]
            print(f"  {dtype:9s} {cols:7d}", " ".join(f"{v:6.1f}" for v in row))
    print("waves (layer norm, weight and bias):")
    for r in wav:
        print(f"  {r['dtype']:9s} {r['cols']:7d} rows {r['rows']:5d} waves {r['waves']:6.2f} "
              f"{r['pct_copy']:6.1f}%")

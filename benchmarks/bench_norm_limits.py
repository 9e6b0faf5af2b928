"""Where forward layer norm loses time at 65536-262144 columns (issue 3's shortfall).

Two measurements on the planned kernels, each beside a same-size device copy in the same run:

* ``affine``: layer norm with no parameters, with weight, and with weight and bias, beside RMS
  norm with no weight and with weight, at rows = 2**27 / cols. Differences between them are the
  cost of each parameter array (read from L2 on every row) and of layer norm's second
  statistic (an exact second pass over the cached row, a second all-reduce, and Chan's merge
  across the cluster, against RMS norm's one sum);
* ``waves``: layer norm with weight and bias at rows = 2**27 / cols and at the nearest whole
  numbers of waves of resident clusters (the driver's count for the planned kernel): whether
  the last, partial wave costs anything.

Bytes credited: x read and y written only, so rows of one shape compare by kernel time alone
(bench_layer_norm.py also credits the parameters and statistics: 0.4% more at 262144 columns).

    python benchmarks/bench_norm_limits.py [--out benchmarks/results] [--reps 40]

Writes norm_limits_<device>.json and .png and prints both tables.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import cukern  # noqa: E402
from cukern import _bench  # noqa: E402
from cukern._device import DeviceSpec  # noqa: E402
from cukern.ops import _common  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32")
COLS = (65536, 131072, 262144)
# (label, op, weight, bias)
AFFINE = (("layer", "layer_norm", False, False), ("layer+w", "layer_norm", True, False),
          ("layer+w+b", "layer_norm", True, True), ("rms", "rms_norm", False, False),
          ("rms+w", "rms_norm", True, False))


def _time(label: str, op: str, dtype: str, rows: int, cols: int, weight: bool, bias: bool,
          reps: int) -> dict:
    """Median time of the planned kernel for one case, and a same-size copy's, in % of copy."""
    dt = np.dtype(_bench._np_dtype(dtype))
    n_sets = 2
    xs = [cp.random.standard_normal((rows, cols), dtype=cp.float32).astype(dt)
          for _ in range(n_sets)]
    w = (cp.random.standard_normal(cols, dtype=cp.float32) + 1).astype(dt) if weight else None
    b = cp.random.standard_normal(cols, dtype=cp.float32).astype(dt) if bias else None
    if op == "layer_norm":
        def call(i):
            return cukern.layer_norm(xs[i], cols, w, b)
    else:
        def call(i):
            return cukern.rms_norm(xs[i], cols, w)
    call(0)
    ms = _bench.time_gpu(call, n_sets, reps=reps)
    nbytes = rows * cols * dt.itemsize
    copy = _bench.copy_ms(nbytes, reps)
    plan = cukern.explain(op, (rows, cols), dtype, weight=weight, bias=bias)
    return dict(case=label, op=op, dtype=dtype, rows=rows, cols=cols, weight=weight, bias=bias,
                kernel=plan.name_expression(), grid=plan.grid, ms=ms, copy_ms=copy,
                pct_copy=100.0 * copy / ms)


def _resident(dtype: str, rows: int, cols: int) -> tuple[int, int]:
    """(rows a wave, cluster) of the planned layer norm with weight and bias: the driver's
    count of resident clusters times the rows each takes a pass."""
    plan = cukern.explain("layer_norm", (rows, cols), dtype, weight=True, bias=True)
    if plan.cluster <= 1:
        return 0, 1
    n = _common._max_active_clusters(_common.kernel(plan, 0), plan)
    return (n or 0) * plan.rows_per_pass, plan.cluster


def _pct(aff: list[dict], dtype: str, cols: int, label: str) -> float:
    """% of copy of case ``label`` in the affine table."""
    key = (dtype, cols, label)
    return next(r["pct_copy"] for r in aff if (r["dtype"], r["cols"], r["case"]) == key)


def affine(reps: int) -> list[dict]:
    out = []
    for dtype in DTYPES:
        for cols in COLS:
            for label, op, weight, bias in AFFINE:
                out.append(_time(label, op, dtype, 2**27 // cols, cols, weight, bias, reps))
    return out


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


def _plot(aff: list[dict], wav: list[dict], path: str, device: str) -> None:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    spec = DeviceSpec.from_device()
    tag = re.sub(r"[^a-z0-9]+", "_", spec.name.lower()).strip("_")
    _bench.warm_up()
    aff = affine(args.reps)
    wav = waves(args.reps)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"norm_limits_{tag}")
    with open(base + ".json", "w") as f:
        json.dump(dict(device=spec.name, cupy=cp.__version__, affine=aff, waves=wav), f, indent=1)
    _plot(aff, wav, base + ".png", spec.name)
    print("affine (% of copy):", " | ".join(label for label, *_ in AFFINE))
    for dtype in DTYPES:
        for cols in COLS:
            row = [_pct(aff, dtype, cols, label) for label, *_ in AFFINE]
            print(f"  {dtype:9s} {cols:7d}", " ".join(f"{v:6.1f}" for v in row))
    print("waves (layer norm, weight and bias):")
    for r in wav:
        print(f"  {r['dtype']:9s} {r['cols']:7d} rows {r['rows']:5d} waves {r['waves']:6.2f} "
              f"{r['pct_copy']:6.1f}%")


if __name__ == "__main__":
    main()

"""Softmax family benchmark: effective bandwidth beside a same-size copy and peers.

Sweeps (issue 2): cols 32..262144 with rows = 2**27 / cols, and OneFlow's figure (rows 49152,
cols 32..32768), for float16, bfloat16 and float32, forward and backward; peers torch, JAX (jit)
and cupyx.scipy.special in the same run; host overhead of one call on a tiny array.

    python benchmarks/bench_softmax.py [--quick] [--out benchmarks/results]

Writes softmax_<device>.json and softmax_<device>.png and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX beside CuPy and torch

import cupy as cp  # noqa: E402

import cukern  # noqa: E402
from cukern import _bench  # noqa: E402
from cukern._device import DeviceSpec  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--ops", default=",".join(_bench.OPS))
    ap.add_argument("--tag", default="", help="file name tag (default: the device name)")
    ap.add_argument("--replot", metavar="JSON", nargs="+",
                    help="no GPU: merge saved result files, rebase them on the fastest copy, "
                         "rewrite them and plot all of them to the first one's .png")
    args = ap.parse_args()
    if args.replot:
        replot(args.replot)
        return
    spec = DeviceSpec.from_device()
    tag = re.sub(r"[^a-z0-9]+", "_", spec.name.lower()).strip("_")
    ops = args.ops.split(",")
    reps = 10 if args.quick else 30
    cols_a = _bench.default_cols(32, 262144)
    cols_b = _bench.default_cols(32, 32768)
    if args.quick:
        cols_a, cols_b = cols_a[::3], cols_b[::3]

    _bench.warm_kernels(ops, DTYPES, spec)  # compile everything before timing anything

    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"softmax_{args.tag or tag}{'_quick' if args.quick else ''}")
    results = []
    for op in ops:
        for label, cols, rows_fn in (("rows=2^27/cols", cols_a, None),
                                     ("rows=49152", cols_b, lambda c: 49152)):
            res = _bench.sweep(op, DTYPES, cols, rows_fn=rows_fn, reps=reps)
            for r in res:
                r["sweep"] = label
                if r["peer"] == "cukern":
                    plan = cukern.explain(op, (r["rows"], r["cols"]), r["dtype"])
                    r["variant"] = plan.variant.value
            results += res
            print(f"{op} {label}: done", flush=True)
            save(base, spec, results, None)  # partial results survive an interrupted run
    overhead = _bench.host_overhead_us()
    _bench.rebase_to_best_copy(results)
    save(base, spec, results, overhead)
    main_sweep = [r for r in results if r["sweep"] == "rows=2^27/cols"]
    _bench.plot(main_sweep, base + ".png", title=f"cukern softmax family on {spec.name} "
                "(rows = 2^27 / cols; % of a same-size device copy)")
    table(results)
    print("host overhead (us per call):", {k: round(v, 2) for k, v in overhead.items()})


def replot(paths) -> None:
    loaded = [json.load(open(p)) for p in paths]
    everything = [r for d in loaded for r in d["results"]]
    _bench.rebase_to_best_copy(everything)
    for p, d in zip(paths, loaded):
        with open(p, "w") as f:
            json.dump(d, f, indent=1)
    main_sweep = [r for r in everything if r["sweep"] == "rows=2^27/cols"]
    _bench.plot(main_sweep, os.path.splitext(paths[0])[0] + ".png",
                title=f"cukern softmax family on {loaded[0]['device']} "
                      "(rows = 2^27 / cols; % of the fastest same-size device copy)")
    table(everything)


def save(base, spec, results, overhead) -> None:
    payload = dict(device=spec.name, cupy=cp.__version__, results=results,
                   host_overhead_us=overhead)
    with open(base + ".json", "w") as f:
        json.dump(payload, f, indent=1)


def table(results) -> None:
    peers = ["cukern", "torch", "jax", "cupyx"]
    print(f"{'op':22s} {'sweep':15s} {'dtype':9s} {'cols':>7s} {'variant':15s} "
          f"{'copy GB/s':>9s} " + " ".join(f"{p + ' %':>9s}" for p in peers))
    keyed = {}
    for r in results:
        keyed.setdefault((r["op"], r["sweep"], r["dtype"], r["cols"]), {})[r["peer"]] = r
    for (op, sweep, dt, cols), d in keyed.items():
        cells = " ".join(f"{d[p]['pct_copy']:9.1f}" if p in d else f"{'-':>9s}" for p in peers)
        variant = d.get("cukern", {}).get("variant", "")
        print(f"{op:22s} {sweep:15s} {dt:9s} {cols:7d} {variant:15s} "
              f"{d['copy']['gbps']:9.0f} {cells}")


if __name__ == "__main__":
    main()

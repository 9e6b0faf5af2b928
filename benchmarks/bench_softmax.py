"""Softmax family benchmark: effective bandwidth beside a same-size copy and peers.

Sweeps (issue 2): cols 32..262144 with rows = 2**27 / cols, and OneFlow's figure (rows 49152,
cols 32..32768), for float16, bfloat16 and float32, forward and backward; peers torch, JAX (jit)
and cupyx.scipy.special in the same run; host overhead of one call on a tiny array.

    python benchmarks/bench_softmax.py [--quick] [--out benchmarks/results] [--ops ...]

Writes softmax_<gpu>.json and .png (``_results``: a run of some ops keeps the file's other
ops), appends a row per shape to history.csv and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX beside CuPy and torch

import _results  # noqa: E402
import cupy as cp  # noqa: E402

import cukern  # noqa: E402
from cukern import _bench  # noqa: E402
from cukern._device import DeviceSpec  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--ops", default=",".join(_bench.OPS),
                    help="a subset keeps the other ops' rows of the current file")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--tag", default="", help="file name tag (default: the GPU, e.g. h100)")
    ap.add_argument("--replot", metavar="JSON", nargs="+",
                    help="no GPU: merge saved result files, rebase them on the fastest copy, "
                         "rewrite them and plot all of them to the first one's .png")
    args = ap.parse_args()
    if args.replot:
        replot(args.replot)
        return
    spec = DeviceSpec.from_device()
    run = _results.Run(args.out, "softmax", spec.name, tag=args.tag, quick=args.quick)
    ops = args.ops.split(",")
    dtypes = args.dtypes.split(",")
    reps = 10 if args.quick else 30
    cols_a = _bench.default_cols(32, 262144)
    cols_b = _bench.default_cols(32, 32768)
    if args.quick:
        cols_a, cols_b = cols_a[::3], cols_b[::3]

    _bench.warm_kernels(ops, dtypes, spec)  # compile everything before timing anything

    results = []
    for op in ops:
        for label, cols, rows_fn in (("rows=2^27/cols", cols_a, None),
                                     ("rows=49152", cols_b, lambda c: 49152)):
            res = _bench.sweep(op, dtypes, cols, rows_fn=rows_fn, reps=reps)
            for r in res:
                r["sweep"] = label
                if r["peer"] == "cukern":
                    plan = cukern.explain(op, (r["rows"], r["cols"]), r["dtype"])
                    r["variant"] = plan.variant.value
            results += res
            print(f"{op} {label}: done", flush=True)
            save(run, results, None)  # partial results survive an interrupted run
    overhead = _bench.host_overhead_us()
    _bench.rebase_to_best_copy(results)
    payload = save(run, results, overhead)
    if not args.quick:
        n = run.append(history_rows(results))
        print(f"history: {n} rows appended to {os.path.join(args.out, 'history.csv')}")
    main_sweep = [r for r in payload["results"] if r["sweep"] == "rows=2^27/cols"]
    _bench.plot(main_sweep, run.png_path, title=f"cukern softmax family on {spec.name} "
                "(rows = 2^27 / cols; % of a same-size device copy)")
    table(results)
    print("host overhead (us per call):", {k: round(v, 2) for k, v in overhead.items()})


def replot(paths) -> None:
    loaded = [json.load(open(p)) for p in paths]
    everything = [r for d in loaded for r in d["results"]]
    _bench.rebase_to_best_copy(everything)
    for p, d in zip(paths, loaded):
        _results.write_json(p, d)
    main_sweep = [r for r in everything if r["sweep"] == "rows=2^27/cols"]
    _bench.plot(main_sweep, os.path.splitext(paths[0])[0] + ".png",
                title=f"cukern softmax family on {loaded[0]['device']} "
                      "(rows = 2^27 / cols; % of the fastest same-size device copy)")
    table(everything)


def save(run: _results.Run, results, overhead) -> dict:
    """Write the current JSON, keeping the rows of ops and dtypes this run did not measure."""
    payload = dict(cupy=cp.__version__, results=results, host_overhead_us=overhead)
    payload = run.merge_previous(payload)
    run.save(payload)
    return payload


def history_rows(results) -> list[dict]:
    """One history.csv row per shape: cukern's % of copy and every peer's time."""
    return _results.peer_rows(results)


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

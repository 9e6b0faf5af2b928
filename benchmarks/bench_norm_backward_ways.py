"""Norm backward with a weight: the planner's way beside every way it could take.

The cached kernels of layer and RMS norm's backward (dx, dweight and dbias, rows = 2**27 /
cols) can run a row in many ways: one block a row or a cluster of 2-16 blocks each holding a
slice, 128..1024 threads, the column sums in shared memory or in registers, x and dy in one
buffer or two, gamma converted into shared memory or loaded from memory
(``_dispatch.col_sums_ways`` lists them, best first by the planner's order). For each width
this times the planner's choice and then every way that fits, forced, in the same run, and
reports how far the planner's is from the fastest. Widths default to powers of two and others
between 1024 and 32768 columns (the planner's rule was chosen on them); pass
``--cols16``/``--cols32`` for others. Bytes counted as in ``bench_layer_norm.py`` (every byte
the call must move), over a same-size device copy.

    python benchmarks/bench_norm_backward_ways.py [--cols16 LIST] [--cols32 LIST] [--ops LIST]
                                                  [--out DIR] [--tag SUFFIX]

Writes norm_backward_ways_<device>.json and .png (planned and fastest forced way per width).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

OPS = ("layer_norm_backward", "rms_norm_backward")
COLS16 = ("1024,2048,3000,4096,5000,6144,8192,10000,12288,13000,14000,15000,16384,20000,24576,"
          "32768")
COLS32 = "1024,2048,3000,4096,5000,6144,8192,10000,12288,14000,16384,24576,32768"
REPEATS = 2  # each way timed this many times, interleaved with the others; the best counts


def forced_ways(planned, spec, occ):
    """(way, plan) for every way (one block a row, or a cluster of blocks) that fits a row of
    ``planned``'s shape, in the planner's order (its first is what the planner takes)."""
    from cukern import _dispatch as D

    info, item = D.OPS[planned.op], D.ITEMSIZE[planned.dtype]
    csize = 8 if planned.dtype == "float64" else 4  # the sums' compute type
    out = []
    for rank, plan in enumerate(D.col_sums_ways(planned, spec, occ)):
        values = -(-(plan.cols // plan.pack_size) // plan.cluster) * plan.pack_size  # a slice
        rows_bytes = plan.smem_bytes - info.smem_align - \
            (0 if plan.sums_in_registers else info.col_sums * csize * values) - \
            (csize * values if plan.gamma_in_smem else 0)
        way = dict(cluster=plan.cluster, threads=plan.threads,
                   sums_in_registers=plan.sums_in_registers,
                   buffers=rows_bytes // (item * info.inputs * values),
                   gamma_in_smem=plan.gamma_in_smem, per_sm=occ(plan), rank=rank)
        out.append((way, plan))
    return out


def label(way: dict) -> str:
    size = way.get("cluster", 1)
    return (f"{f'c{size}:' if size > 1 else ''}{way['threads']}"
            f"{'R' if way['sums_in_registers'] else 'S'}{way['buffers']}"
            f"{'g' if way['gamma_in_smem'] else '-'}x{way['per_sm']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cols16", default=COLS16, help="widths for float16")
    ap.add_argument("--cols32", default=COLS32, help="widths for float32 (empty: none)")
    ap.add_argument("--ops", default=",".join(OPS), help="of " + ", ".join(OPS))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--tag", default="", help="suffix of the output files' names")
    args = ap.parse_args()
    ops = [op for op in args.ops.split(",") if op]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        ap.error(f"--ops: unknown {', '.join(unknown)} (choose from {', '.join(OPS)})")

    import cupy as cp
    from bench_layer_norm import moved_bytes

    import cukern
    from cukern import _bench, _compile
    from cukern import _dispatch as D
    from cukern.ops import _common as c
    from cukern.ops import layer_norm as ln

    spec = c.device_spec(0)
    occ = c.driver_occupancy(0)
    shapes = [(op, dt, int(n)) for op in ops
              for dt, cols in (("float16", args.cols16), ("float32", args.cols32))
              for n in cols.split(",") if n]

    plans = {}
    for op, dt, cols in shapes:
        planned = D.plan_rowwise(op, 2**27 // cols, cols, dt, spec, occ, extra=("true",))
        plans[op, dt, cols] = (planned, forced_ways(planned, spec, occ))
    names = {(p.family, p.name_expression()) for planned, ways in plans.values()
             for p in [planned] + [q for _, q in ways]}
    errors = _compile.warm_cache(sorted(names))
    if errors:
        raise SystemExit("\n".join(errors))

    def timed(fn, plan) -> float:
        original = ln._plan
        if plan is not None:
            ln._plan = lambda *a, **k: plan
        ln._launches.clear()
        ln._fresh.clear()
        try:
            fn()
            return _bench.time_gpu(lambda i: fn(), 1, 30)
        finally:
            ln._plan = original
            ln._launches.clear()
            ln._fresh.clear()

    def call(op: str, dt: str, rows: int, cols: int):
        """The backward on fresh random data: (bytes of x, item size, a call of it)."""
        x = cp.random.standard_normal((rows, cols), dtype=cp.float32).astype(dt)
        dy = cp.random.standard_normal((rows, cols), dtype=cp.float32).astype(dt)
        w = (cp.random.standard_normal(cols, dtype=cp.float32) + 1).astype(dt)
        if op == "layer_norm_backward":
            _, mean, rstd = cukern.layer_norm(x, cols, w, w)
            return x.nbytes, x.itemsize, lambda: cukern.layer_norm_backward(dy, x, mean, rstd, w)
        _, rstd = cukern.rms_norm(x, cols, w)
        return x.nbytes, x.itemsize, lambda: cukern.rms_norm_backward(dy, x, rstd, w)

    _bench.warm_up()
    results, copies = [], {}
    for op, dt, cols in shapes:
        rows = 2**27 // cols
        size, item, fn = call(op, dt, rows, cols)
        if size not in copies:
            copies[size] = _bench.copy_ms(size, 30)
        copy_gbps = 2 * size / copies[size] / 1e6
        planned, ways = plans[op, dt, cols]
        best = {}
        for _ in range(REPEATS):
            for i, (_, plan) in enumerate([(None, None)] + ways):
                ms = timed(fn, plan)
                best[i] = min(best.get(i, float("inf")), ms)
        nbytes = moved_bytes(op, rows, cols, item)

        def pct(ms):
            return round(100 * nbytes / ms / 1e6 / copy_gbps, 2)

        results.append(dict(
            op=op, dtype=dt, cols=cols, rows=rows, copy_gbps=round(copy_gbps, 1),
            planned=dict(variant=planned.variant.value, cluster=planned.cluster,
                         threads=planned.threads, sums_in_registers=planned.sums_in_registers,
                         gamma_in_smem=planned.gamma_in_smem, smem_bytes=planned.smem_bytes,
                         per_sm=occ(planned), pct_copy=pct(best[0])),
            ways=[dict(way, pct_copy=pct(best[i + 1])) for i, (way, _) in enumerate(ways)]))
        r = results[-1]
        top = sorted(r["ways"], key=lambda v: -v["pct_copy"])[:3]
        print(f"{op[:-9]:10s} {dt:8s} {cols:6d} planned {r['planned']['pct_copy']:5.1f} "
              f"({planned.variant.value} {planned.threads}) | "
              + "  ".join(f"{label(v)} {v['pct_copy']:5.1f}" for v in top), flush=True)
        fn = None  # frees the arrays
        cp.get_default_memory_pool().free_all_blocks()

    gaps = [max(v["pct_copy"] for v in r["ways"]) - r["planned"]["pct_copy"]
            for r in results if r["ways"]]
    if gaps:
        print(f"planned vs the fastest forced way: {sum(gaps) / len(gaps):.2f} points behind "
              f"on average, {max(gaps):.2f} at most ({len(gaps)} widths)")
    tag = re.sub(r"[^a-z0-9]+", "_", spec.name.lower()).strip("_")
    base = os.path.join(args.out, f"norm_backward_ways_{tag}{args.tag}")
    os.makedirs(args.out, exist_ok=True)
    with open(base + ".json", "w") as f:
        json.dump(dict(device=spec.name, cupy=cp.__version__, results=results), f, indent=1)
    rows = []
    for r in results:
        rows.append(dict(op=r["op"], dtype=r["dtype"], cols=r["cols"], peer="planned",
                         pct_copy=r["planned"]["pct_copy"]))
        if r["ways"]:
            rows.append(dict(op=r["op"], dtype=r["dtype"], cols=r["cols"],
                             peer="fastest forced way",
                             pct_copy=max(v["pct_copy"] for v in r["ways"])))
    _bench.plot(rows, base + ".png", title=f"norm backward: planned vs every way forced, "
                f"{spec.name} (rows = 2^27 / cols; % of copy)")


if __name__ == "__main__":
    main()

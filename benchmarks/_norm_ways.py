"""``bench_layer_norm.py --ways``: the norm backward's planned way beside every way it could take.

The cached kernels of layer and RMS norm's backward with a weight (dx, dweight and dbias;
rows = 2**27 / cols) can run a row in many ways: one block a row or a cluster of 2-16 blocks
each holding a slice, 128..1024 threads, the column sums in shared memory or in registers, x
and dy in one buffer or two, gamma converted into shared memory or loaded from memory
(``cukern.plan.col_sums_ways`` lists them, the planner's choice first). For each width this
times the planned way and then every way that fits, forced, REPEATS rounds interleaved (each
keeps its best), and reports how far the planned way is from the fastest. Widths default to
powers of two and others between 1024 and 32768 columns; ``--cols16``/``--cols32`` take
others. Bytes counted as in the sweep (every byte the call must move), over a same-size copy.

A way's label: ``c<size>:`` for a cluster, threads, ``R``/``S`` (column sums in registers or
shared memory), buffers, ``g``/``-`` (gamma's copy in shared memory or not), ``x`` blocks per
SM: ``c4:128S2gx3`` is clusters of 4 blocks of 128 threads, shared-memory sums, two buffers,
gamma's copy, 3 blocks per SM. Notes: docs/notes/layer-norm-backward.md.

Writes norm_backward_ways_<gpu>.json and .png (planned and fastest forced way per width) and a
history row per width (variant: the planned way; best_way_ms: the fastest forced way).
"""

from __future__ import annotations

import contextlib
import os

import _results

OPS = ("layer_norm_backward", "rms_norm_backward")
COLS16 = ("1024,2048,3000,4096,5000,6144,8192,10000,12288,13000,14000,15000,16384,20000,24576,"
          "32768")
COLS32 = "1024,2048,3000,4096,5000,6144,8192,10000,12288,14000,16384,24576,32768"
REPEATS = 2  # each way timed this many times, interleaved with the others; the best counts
# The backward's shared memory (kernels/layer_norm.cuh): x and dy per buffer, the column sums
# (unless in registers) and gamma's copy in the compute type, 128 bytes of alignment.
INPUTS, SMEM_ALIGN = 2, 128
COL_SUMS = {"layer_norm_backward": 2, "rms_norm_backward": 1}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def _device():
    """(DeviceSpec, the driver's occupancy function) of device 0."""
    from cukern import runner

    return runner.device_spec(0), runner.driver_occupancy(0)


def _plans(op: str, dtype: str, cols: int, spec, occ):
    """(planned, every way in the planner's order): the one place this file calls the planner.
    Rows = 2**27 / cols, a weight given."""
    from cukern import plan as P

    planned = P.plan_rowwise(op, 2**27 // cols, cols, dtype, spec, occ,
                             switches=P.Switches(weight=True))
    return planned, P.col_sums_ways(planned, spec, occ)


def _warm(plans) -> None:
    """Compile every plan's kernel before anything is timed."""
    from cukern import _compile

    names = {(p.family, p.name_expression()) for p in plans}
    errors = _compile.warm_cache(sorted(names))
    if errors:
        raise SystemExit("\n".join(errors))


@contextlib.contextmanager
def _forcing(plan):
    """Calls of the norms inside launch ``plan`` (None: the planner's), with no cached launch
    kept either side: the one place this file reaches into the runner and cukern.ops."""
    from cukern import runner
    from cukern.ops import layer_norm as ln

    original = runner.plan_for
    if plan is not None:
        runner.plan_for = lambda *a, **k: plan
    ln._launches.clear()
    ln._fresh.clear()
    try:
        yield
    finally:
        runner.plan_for = original
        ln._launches.clear()
        ln._fresh.clear()


def describe(op: str, plan, per_sm: int) -> dict:
    """The way ``plan`` runs a row, as the JSON keeps it."""
    item = ITEMSIZE[plan.dtype]
    csize = 8 if plan.dtype == "float64" else 4  # the sums' compute type
    values = -(-(plan.cols // plan.pack_size) // plan.cluster) * plan.pack_size  # a slice
    rows_bytes = plan.smem_bytes - SMEM_ALIGN - \
        (0 if plan.sums_in_registers else COL_SUMS[op] * csize * values) - \
        (csize * values if plan.gamma_in_smem else 0)
    return dict(cluster=plan.cluster, threads=plan.threads,
                sums_in_registers=plan.sums_in_registers,
                buffers=rows_bytes // (item * INPUTS * values),
                gamma_in_smem=plan.gamma_in_smem, per_sm=per_sm)


def label(way: dict) -> str:
    """``c4:128S2gx3`` (see the module's docstring); the buffers left out where unknown."""
    size = way.get("cluster", 1)
    return (f"{f'c{size}:' if size > 1 else ''}{way['threads']}"
            f"{'R' if way['sums_in_registers'] else 'S'}{way.get('buffers', '')}"
            f"{'g' if way['gamma_in_smem'] else '-'}x{way['per_sm']}")


def run(args, moved_bytes) -> None:
    """The ``--ways`` mode of bench_layer_norm.py (``args``: its parsed options)."""
    import cupy as cp

    import cukern
    from cukern import _bench

    ops = [op for op in (args.ops or ",".join(OPS)).split(",") if op]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise SystemExit(f"--ways --ops: unknown {', '.join(unknown)} "
                         f"(choose from {', '.join(OPS)})")
    spec, occ = _device()
    out = _results.Run(args.out, "norm_backward_ways", spec.name, tag=args.tag)
    reps = args.reps or 30
    shapes = [(op, dt, int(n)) for op in ops
              for dt, cols in (("float16", args.cols16), ("float32", args.cols32))
              for n in cols.split(",") if n]

    plans = {}
    for op, dt, cols in shapes:
        planned, ways = _plans(op, dt, cols, spec, occ)
        plans[op, dt, cols] = planned, [(describe(op, p, occ(p)), p) for p in ways]
    _warm([p for planned, ways in plans.values() for p in [planned] + [q for _, q in ways]])

    def timed(fn, plan) -> float:
        with _forcing(plan):
            fn()
            return _bench.time_gpu(lambda i: fn(), 1, reps)

    def call(op: str, dt: str, rows: int, cols: int):
        """The backward on fresh random data: (bytes of x, item size, a call of it)."""
        x = cp.random.standard_normal((rows, cols), dtype=cp.float32).astype(dt)
        dy = cp.random.standard_normal((rows, cols), dtype=cp.float32).astype(dt)
        w = (cp.random.standard_normal(cols, dtype=cp.float32) + 1).astype(dt)
        if op == "layer_norm_backward":
            _, mean, rstd = cukern.layer_norm(x, cols, w, w, return_stats=True)
            return x.nbytes, x.itemsize, lambda: cukern.layer_norm_backward(dy, x, mean, rstd, w)
        _, rstd = cukern.rms_norm(x, cols, w, return_stats=True)
        return x.nbytes, x.itemsize, lambda: cukern.rms_norm_backward(dy, x, rstd, w)

    _bench.warm_up()
    results, copies = [], {}
    for op, dt, cols in shapes:
        rows = 2**27 // cols
        size, item, fn = call(op, dt, rows, cols)
        if size not in copies:
            copies[size] = _bench.copy_ms(size, reps)
        copy_gbps = 2 * size / copies[size] / 1e6
        planned, ways = plans[op, dt, cols]
        best = {}
        for _ in range(REPEATS):
            for i, (_, plan) in enumerate([(None, None)] + ways):
                best[i] = min(best.get(i, float("inf")), timed(fn, plan))
        nbytes = moved_bytes(op, rows, cols, item)

        def timing(ms):
            return dict(ms=float(f"{ms:.6g}"), pct_copy=round(100 * nbytes / ms / 1e6 / copy_gbps,
                                                               2))

        first = describe(op, planned, occ(planned))
        results.append(dict(
            op=op, dtype=dt, cols=cols, rows=rows, bytes=nbytes, copy_gbps=round(copy_gbps, 1),
            planned=dict(variant=planned.variant.value, **first, smem_bytes=planned.smem_bytes,
                         **timing(best[0])),
            ways=[dict(way, rank=i, **timing(best[i + 1])) for i, (way, _) in enumerate(ways)]))
        r = results[-1]
        top = sorted(r["ways"], key=lambda v: -v["pct_copy"])[:3]
        print(f"{op[:-9]:10s} {dt:8s} {cols:6d} planned {r['planned']['pct_copy']:5.1f} "
              f"({label(r['planned'])}) | "
              + "  ".join(f"{label(v)} {v['pct_copy']:5.1f}" for v in top), flush=True)
        fn = None  # frees the arrays
        cp.get_default_memory_pool().free_all_blocks()

    gaps = [max(v["pct_copy"] for v in r["ways"]) - r["planned"]["pct_copy"]
            for r in results if r["ways"]]
    if gaps:
        print(f"planned vs the fastest forced way: {sum(gaps) / len(gaps):.2f} points behind "
              f"on average, {max(gaps):.2f} at most ({len(gaps)} widths)")
    # widths this run did not time are kept (a run of some widths adds to the file)
    payload = out.merge_previous(dict(cupy=cp.__version__, results=results),
                                 key=lambda r: (r["op"], r["dtype"], r["cols"]))
    out.save(payload)
    n = out.append(history_rows(results, moved_bytes))
    print(f"history: {n} rows appended to {os.path.join(args.out, _results.HISTORY)}")
    plot(payload["results"], out.png_path, spec.name)


def _ms(r: dict, entry: dict, moved_bytes) -> float:
    """An entry's time: its own, or (files that kept % of copy alone) from % of copy."""
    if "ms" in entry:
        return entry["ms"]
    nbytes = moved_bytes(r["op"], r["rows"], r["cols"], ITEMSIZE[r["dtype"]])
    return nbytes / (entry["pct_copy"] / 100 * r["copy_gbps"]) / 1e6


def history_rows(results: list[dict], moved_bytes) -> list[dict]:
    """One history.csv row per width: the planned way and the fastest forced way."""
    rows = []
    for r in results:
        planned = dict(r["planned"])
        if "buffers" not in planned and r["ways"] and all(
                r["ways"][0][k] == planned[k] for k in ("cluster", "threads", "per_sm",
                                                        "sums_in_registers", "gamma_in_smem")):
            planned["buffers"] = r["ways"][0]["buffers"]  # the planner's way is its first
        best = max(r["ways"], key=lambda v: v["pct_copy"]) if r["ways"] else None
        copy_ms = 2 * r["rows"] * r["cols"] * ITEMSIZE[r["dtype"]] / r["copy_gbps"] / 1e6
        rows.append(dict(
            op=r["op"], dtype=r["dtype"], rows=r["rows"], cols=r["cols"], variant=label(planned),
            pct_copy=planned["pct_copy"], gbps=planned["pct_copy"] / 100 * r["copy_gbps"],
            copy_gbps=r["copy_gbps"], cukern_ms=_ms(r, planned, moved_bytes), copy_ms=copy_ms,
            best_way_ms=_ms(r, best, moved_bytes) if best else None,
            note=f"fastest forced {label(best)} {best['pct_copy']:.1f}%" if best else ""))
    return rows


def plot(results: list[dict], path: str, device: str) -> None:
    """% of copy of the planned and the fastest forced way, against cols."""
    from cukern import _bench

    rows = []
    for r in results:
        rows.append(dict(op=r["op"], dtype=r["dtype"], cols=r["cols"], peer="planned",
                         pct_copy=r["planned"]["pct_copy"]))
        if r["ways"]:
            rows.append(dict(op=r["op"], dtype=r["dtype"], cols=r["cols"],
                             peer="fastest forced way",
                             pct_copy=max(v["pct_copy"] for v in r["ways"])))
    _bench.plot(rows, path, title=f"norm backward: planned vs every way forced, {device} "
                f"(rows = 2^27 / cols; % of copy)")

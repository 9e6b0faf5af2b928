"""cukern.dask benchmark: the Dask path's overhead on one GPU, and its scaling over several.

``--overhead`` (issue 27): one GPU, the threaded scheduler. A 4 GB float16 array (``--gb``) in
256 MB chunks (``--chunk-mb``) of whole rows, already on the GPU; each op through cukern.dask
(``persist`` of every output, blocks left where they are) against one direct cukern call on
the whole array: softmax (rows of 4096), layer norm forward + backward (weight and bias;
dweight and dbias reduced across blocks) and training batch norm (NCHW, C = 256, 64 x 64,
chunks along N; the running statistics updated). Median of ``--reps`` after a warm-up.
Overhead = Dask time / direct time - 1; target <= 10 %. A "dask floor" row per op times the
same persists of a block function that launches nothing (a view of its first input over the
op's full-size inputs): Dask's own host cost for that many blocks, which no op can go under;
the rest of the gap (dask - direct - floor) is cukern.dask's own (its extra tasks, the
eager statistics pass of batch norm) plus what does not overlap with the GPU. A third row
persists with ``optimize_graph=False`` (Dask's array optimisation skipped).

``--scaling`` (issue 28): a dask-cuda LocalCUDACluster over 1, 2, 4, ... GPUs and all of them,
``--gb-per-gpu`` GB of float16 per GPU (weak scaling: the array grows with the GPUs), made on
the workers and persisted there before timing; the same ops, timed from submission to the
last block done. Speed-up = throughput on N GPUs / throughput on one; targets: >= 0.9 N for
the row-wise ops, batch norm within 15 % of that.

    python benchmarks/bench_dask.py --overhead [--gb 4] [--chunk-mb 256] [--reps 5]
    python benchmarks/bench_dask.py --scaling [--gb-per-gpu 16] [--gpus 1,2,4,8]

Writes dask_overhead_<gpu>.json / dask_scaling_<gpu>.json (and .png where matplotlib is
installed), appends rows to history.csv and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import _results  # noqa: E402
import cupy as cp  # noqa: E402
import dask  # noqa: E402
import dask.array as da  # noqa: E402
import numpy as np  # noqa: E402

import cukern  # noqa: E402
import cukern.dask as cd  # noqa: E402

COLS = 4096  # row length of the row-wise ops
CHANNELS, HW = 256, 64  # batch norm's (N, 256, 64, 64)
OPS = ("softmax", "layer_norm_fwd_bwd", "batch_norm_train")
TARGET_OVERHEAD = 10.0  # % (issue 27)
TARGET_SCALING, BN_SLACK = 0.9, 0.15  # x N for row-wise ops; batch norm within 15 % (issue 28)


# ---------------------------------------------------------------------------------------------
# The ops, direct and through Dask.

def _params():
    """Layer norm's weight and bias (float16, on the current GPU)."""
    rng = cp.random.default_rng(1)
    return tuple(rng.standard_normal(COLS, dtype=cp.float32).astype(cp.float16)
                 for _ in range(2))


def direct(op: str, x, dy):
    """One cukern call (or pair) on the whole array."""
    if op == "softmax":
        return cukern.softmax(x)
    if op == "layer_norm_fwd_bwd":
        w, b = _params()
        y, mean, rstd = cukern.layer_norm(x, COLS, w, b, return_stats=True)
        return y, cukern.layer_norm_backward(dy, x, mean, rstd, w)
    rm, rv = cp.zeros(CHANNELS, cp.float32), cp.ones(CHANNELS, cp.float32)
    return cukern.batch_norm(x, rm, rv, None, None, True)


def through_dask(op: str, x, dy, persist):
    """The op through cukern.dask, every output persisted (``persist`` waits for them)."""
    if op == "softmax":
        return persist(cd.softmax(x))
    if op == "layer_norm_fwd_bwd":
        w, b = _params()
        y, mean, rstd = persist(*cd.layer_norm(x, COLS, w, b, return_stats=True))
        return persist(*cd.layer_norm_backward(dy, x, mean, rstd, w))
    rm, rv = cp.zeros(CHANNELS, cp.float32), cp.ones(CHANNELS, cp.float32)
    return persist(cd.batch_norm(x, rm, rv, None, None, True))


def _view(*blocks):
    """A trivial block function: a view of the first block (no kernel, no copy)."""
    return blocks[0][...]


def floor(op: str, x, dy, persist):
    """Dask's floor for the op: the op's persists of :func:`_view` over its inputs."""
    if op == "layer_norm_fwd_bwd":
        persist(x.map_blocks(_view, dtype=x.dtype, meta=x._meta))
        return persist(da.map_blocks(_view, dy, x, dtype=x.dtype, meta=x._meta))
    return persist(x.map_blocks(_view, dtype=x.dtype, meta=x._meta))


def shapes(op: str, gb: float, chunk_mb: float):
    """(shape, chunks) of the op's float16 input of ``gb`` GB in chunks of ``chunk_mb`` MB."""
    if op == "batch_norm_train":
        per = CHANNELS * HW * HW * 2
        n = max(2, int(gb * 1e9 // per))
        step = max(1, int(chunk_mb * 2**20 // per))
        return (n, CHANNELS, HW, HW), (step, -1, -1, -1)
    rows = int(gb * 1e9 // (COLS * 2))
    step = max(1, int(chunk_mb * 2**20 // (COLS * 2)))
    return (rows, COLS), (step, -1)


def _median_s(fn, reps: int) -> float:
    fn()  # warm-up: compiles, plans, pools
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def overhead(args) -> list[dict]:
    results = []

    def persist(*arrays, optimize_graph=True):
        out = dask.persist(*arrays, scheduler="threads", optimize_graph=optimize_graph)
        cp.cuda.Device().synchronize()
        return out

    def persist_noopt(*arrays):  # Dask's array optimisation skipped: cukern's graphs are flat
        return persist(*arrays, optimize_graph=False)

    for op in OPS:
        shape, chunks = shapes(op, args.gb, args.chunk_mb)
        gen = cp.random.default_rng(0)
        x = gen.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
        dy = gen.standard_normal(shape, dtype=cp.float32).astype(cp.float16) \
            if op == "layer_norm_fwd_bwd" else None
        xd = da.from_array(x, chunks=chunks, asarray=False, name=False)  # no hashing of x
        dyd = None if dy is None else da.from_array(dy, chunks=chunks, asarray=False,
                                                    name=False)
        t_direct = _median_s(lambda: direct(op, x, dy), args.reps)
        t_dask = _median_s(lambda: through_dask(op, xd, dyd, persist), args.reps)
        t_floor = _median_s(lambda: floor(op, xd, dyd, persist), args.reps)
        t_noopt = _median_s(lambda: through_dask(op, xd, dyd, persist_noopt), args.reps)
        pct = 100.0 * (t_dask / t_direct - 1.0)
        own = t_dask - t_direct - t_floor  # cukern.dask's own share of the gap
        results.append(dict(op=op, dtype="float16", shape=list(shape), chunks=xd.numblocks[0],
                            gb=x.nbytes / 1e9, direct_ms=1e3 * t_direct, dask_ms=1e3 * t_dask,
                            floor_ms=1e3 * t_floor, own_ms=1e3 * own, overhead_pct=pct,
                            noopt_ms=1e3 * t_noopt,
                            noopt_overhead_pct=100.0 * (t_noopt / t_direct - 1.0),
                            target_met=pct <= TARGET_OVERHEAD))
        print(f"{op:20s} direct {1e3 * t_direct:9.2f} ms   dask {1e3 * t_dask:9.2f} ms   "
              f"overhead {pct:+6.1f} %  ({xd.numblocks[0]} chunks)\n{'  dask floor':20s} "
              f"{'':16s} {1e3 * t_floor:9.2f} ms   ({100 * t_floor / t_direct:.0f} % of direct; "
              f"cukern.dask's own {1e3 * own:+.2f} ms)\n{'  optimize_graph=False':37s} "
              f"{1e3 * t_noopt:9.2f} ms   overhead {100 * (t_noopt / t_direct - 1):+6.1f} %",
              flush=True)
        x = dy = xd = dyd = None  # free the GPU memory before the next op
        cp.get_default_memory_pool().free_all_blocks()
    return results


# ---------------------------------------------------------------------------------------------
# Scaling over GPUs.

def _random_block(block, seed: int, block_id=None):
    """A float16 normal block made on the worker's GPU (no data from the client)."""
    import cupy

    gen = cupy.random.default_rng(seed + 7919 * sum(block_id))
    return gen.standard_normal(block.shape, dtype=cupy.float32).astype(cupy.float16)


def _random_like(block, seed: int, block_id=None):
    return _random_block(block, seed, block_id=block_id)


def resident(client, shape, chunks, with_dy: bool):
    """x (and dy) made and persisted on the workers; each block of dy is made from, and so on
    the worker of, its block of x (made apart, the two could land on different workers and
    every backward task would pull a block over the network)."""
    import distributed

    meta = cp.empty((0,) * len(shape), cp.float16)
    x = da.zeros(shape, dtype=np.float16, chunks=chunks).map_blocks(
        _random_block, 0, dtype=np.float16, meta=meta)
    dy = x.map_blocks(_random_like, 1, dtype=np.float16, meta=meta) if with_dy else None
    x, dy = client.persist([x, dy]) if with_dy else (client.persist(x), None)
    distributed.wait([a for a in (x, dy) if a is not None])
    return x, dy


def scaling(args) -> list[dict]:
    import distributed
    from dask_cuda import LocalCUDACluster

    total = cp.cuda.runtime.getDeviceCount()
    counts = sorted({int(n) for n in args.gpus.split(",")} if args.gpus else
                    {n for n in (1, 2, 4, 8, 16) if n <= total} | {total})
    counts = [n for n in counts if n <= total]
    results = []
    for n in counts:
        with LocalCUDACluster(n_workers=n, threads_per_worker=1, dashboard_address=None,
                              device_memory_limit=0) as cluster, \
                distributed.Client(cluster) as client:
            client.wait_for_workers(n)

            def persist(*arrays, client=client):
                out = client.persist(list(arrays))
                distributed.wait(out)
                return out

            for op, mb in ((op, mb) for mb in _chunk_sizes(args) for op in OPS):
                shape, chunks = shapes(op, args.gb_per_gpu * n, mb)
                x, dy = resident(client, shape, chunks, op == "layer_norm_fwd_bwd")
                client.run(_clear_transfer_log)
                t = _wall_median(lambda: through_dask(op, x, dy, persist), args.reps)
                moved = sum(client.run(_transferred_bytes).values()) / (args.reps + 1)
                t_floor = _wall_median(lambda: floor(op, x, dy, persist), args.reps)
                nbytes = int(np.prod(shape)) * 2
                results.append(dict(op=op, dtype="float16", gpus=n, shape=list(shape),
                                    chunk_mb=mb, blocks=x.npartitions, gb=nbytes / 1e9,
                                    ms=1e3 * t, gbps=nbytes / t / 1e9, floor_ms=1e3 * t_floor,
                                    moved_mb=moved / 2**20))
                print(f"{n} GPU{'s' if n > 1 else ' '} {op:20s} {mb:6.0f} MiB blocks "
                      f"{1e3 * t:9.2f} ms {nbytes / t / 1e9:7.1f} GB/s (of x), Dask floor "
                      f"{1e3 * t_floor:8.2f} ms, {moved / 2**20:8.2f} MiB between workers "
                      "a call", flush=True)
                x = dy = None  # released on the workers
    one = {(r["op"], r["chunk_mb"]): r["gbps"] for r in results if r["gpus"] == counts[0]}
    for r in results:
        r["speedup"] = r["gbps"] / one[(r["op"], r["chunk_mb"])] * counts[0]
        want = TARGET_SCALING * r["gpus"] * (1 - BN_SLACK if r["op"] == "batch_norm_train"
                                             else 1)
        r["target_met"] = r["speedup"] >= want or r["gpus"] == 1
    return results


def _chunk_sizes(args) -> list[float]:
    return [float(v) for v in str(args.chunk_mb).split(",")]


def _clear_transfer_log(dask_worker) -> None:
    dask_worker.transfer_incoming_log.clear()


def _transferred_bytes(dask_worker) -> int:
    """Bytes this worker fetched from its peers since the log was cleared."""
    return sum(t["total"] for t in dask_worker.transfer_incoming_log)


def _wall_median(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# Results.

def history_rows(results: list[dict], mode: str) -> list[dict]:
    rows = []
    for r in results:
        shape = r["shape"]
        row = dict(op=r["op"], dtype=r["dtype"], rows=shape[0], cols=int(np.prod(shape[1:])))
        if mode == "overhead":
            row.update(cukern_ms=r["dask_ms"], variant="dask threads",
                       note=f"direct {r['direct_ms']:.3f} ms; overhead "
                            f"{r['overhead_pct']:+.1f} %; dask floor {r['floor_ms']:.3f} ms")
        else:
            row.update(cukern_ms=r["ms"], gbps=r["gbps"],
                       variant=f"{r['gpus']} GPUs, {r['chunk_mb']:.0f} MiB blocks",
                       note=f"speed-up {r['speedup']:.2f}; Dask floor {r['floor_ms']:.2f} ms")
        rows.append(row)
    return rows


def plot(results: list[dict], mode: str, path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no figure", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if mode == "overhead":
        ax.bar([r["op"] for r in results], [r["overhead_pct"] for r in results])
        ax.axhline(TARGET_OVERHEAD, color="k", lw=0.6)
        ax.set_ylabel("Dask path over a direct call (%)")
    else:
        for op, mb in dict.fromkeys((r["op"], r["chunk_mb"]) for r in results):
            rs = [r for r in results if (r["op"], r["chunk_mb"]) == (op, mb)]
            ax.plot([r["gpus"] for r in rs], [r["speedup"] for r in rs], "o-",
                    label=f"{op}, {mb:.0f} MiB blocks")
        gpus = sorted({r["gpus"] for r in results})
        ax.plot(gpus, gpus, "k:", lw=0.6, label="linear")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("speed-up (throughput over one GPU)")
        ax.legend(fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--overhead", action="store_true", help="one GPU: Dask path vs direct")
    mode.add_argument("--scaling", action="store_true", help="LocalCUDACluster over 1..N GPUs")
    ap.add_argument("--gb", type=float, default=4.0, help="--overhead: input size (GB)")
    ap.add_argument("--gb-per-gpu", type=float, default=16.0,
                    help="--scaling: input size per GPU (GB, float16)")
    ap.add_argument("--chunk-mb", default="256", help="chunk size (MiB); --scaling: a "
                    "comma-separated list")
    ap.add_argument("--gpus", default="", help="--scaling: GPU counts (default 1, 2, 4, .. all)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--tag", default="", help="file name tag (default: the GPU, e.g. h100)")
    args = ap.parse_args()
    which = "overhead" if args.overhead else "scaling"
    name = cukern.DeviceSpec.from_device().name
    run = _results.Run(args.out, f"dask_{which}", name, tag=args.tag)
    if args.overhead:
        args.chunk_mb = _chunk_sizes(args)[0]
    results = overhead(args) if args.overhead else scaling(args)
    run.save(dict(mode=which, dask=dask.__version__, chunk_mb=args.chunk_mb,
                  gpus_visible=cp.cuda.runtime.getDeviceCount(), results=results))
    n = run.append(history_rows(results, which))
    print(f"history: {n} rows appended to {os.path.join(args.out, _results.HISTORY)}")
    plot(results, which, run.png_path, f"cukern.dask {which} on {name}")
    missed = [r for r in results if not r["target_met"]]
    print(f"targets missed: {len(missed)}" + "".join(
        f"\n  {r['op']}" + (f" on {r['gpus']} GPUs, {r['chunk_mb']:.0f} MiB blocks"
                            if "gpus" in r else "") for r in missed))


if __name__ == "__main__":
    main()

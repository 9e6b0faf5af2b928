"""Permute benchmark: effective bandwidth beside a same-size copy and peers.

Shapes (issue 24): NCHW -> NHWC and back for ResNet-50's activations at batch 64 and 256
((N,64,112,112), (N,256,56,56), (N,512,28,28), (N,1024,14,14), (N,2048,7,7)), image inputs
(N,3,224,224) and the video shape (8,64,16,56,56); 2-D transposes of 1K..32K squares and of
skinny matrices (8192 x 3, 3 x 8192*1024 and their transposes); float16, bfloat16, float32,
int8.

Effective bandwidth = (bytes read + bytes written) / median kernel time (CUDA events behind a
spin kernel, after warm-up; ``_bench.time_gpu``). Inputs and outputs rotate over views of one
buffer each, enough of them to move 256 MiB a round, so no call finds its arrays in the 50 MB
L2. ``pct_copy``: that over a device-to-device copy of the same bytes between the same buffers,
measured in the same run. Peers in the same run, credited the same bytes: PyTorch (the
``copy_`` that ``x.permute(...).contiguous()`` runs, into one output a set as for cukern),
CuPy (``ascontiguousarray(x.transpose(...))``'s copy kernel, through ``cupy.copyto`` into one
output a set) and JAX (jitted ``transpose``, timed pipelined: many calls enqueued, then a block
on the last). Arrays up to 64 MiB are timed in three interleaved rounds, each keeping its best.
Host overhead: time per call on a 4x32 float32 array, best of 5 x 1000 calls.

    python benchmarks/bench_permute.py [--quick] [--groups ...] [--dtypes ...] [--out DIR]
        [--byte-regs 1,2|1|2|none] [--ab-byte-regs] [--flat-regs 1,2,4|...|none]
        [--ab-flat-regs] [--skew-regs 1,2|1|2|none] [--ab-skew-regs]
        [--async-regs 1,2,4,8,16|...|none] [--ab-async-regs] [--tag TAG]

``--byte-regs`` plans with the tuning's perm_byte_regs set to those element sizes (the tile
kernel's phase 2 transposing 32-bit shared-memory words in registers; ``none``: the gather of
one element a load everywhere), for an A/B of the switch; give such a run its own ``--tag``.
``--ab-byte-regs`` times both in one run instead: wherever cukern's plan transposes in
registers, the same plan with the gather (peer ``gather``, interleaved in the same rounds;
its % of copy on each line, its time in the history row's note). ``--flat-regs`` and
``--ab-flat-regs`` do the same for perm_flat_regs (a flat output run of 3-element blocks, C = 3,
interleaved from 16-byte shared-memory row chunks); ``--skew-regs`` and ``--ab-skew-regs`` for
perm_skew_regs (flat output runs of channels read in skewed 32-bit columns: 7x7, 14x14 and int8
28x28 NHWC -> NCHW; its ``gather`` peer is the plan without it: the 7x7 gather, row tiles
elsewhere); ``--async-regs`` and ``--ab-async-regs`` for perm_async_copy (phase 1 of tiles
with a flat side by cp.async: its ``gather`` peer loads through registers); several A/B flags
together time one gather peer wherever any of the paths runs.

Writes permute_<gpu>.json and .png, appends a row per shape to history.csv (every run; the
CuPy peer's time is in the row's note), prints a table and the issue's targets met or missed.
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

import _permute_regs as regs  # noqa: E402
import _results  # noqa: E402
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import cukern  # noqa: E402
from cukern import _bench  # noqa: E402
from cukern._device import DeviceSpec  # noqa: E402
from cukern._io import np_dtype  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32", "int8")
GROUPS = ("NCHW->NHWC", "NHWC->NCHW", "2-D")
PEERS = ("torch", "cupy", "jax")
ROTATE_BYTES = 256 << 20  # moved a round of calls over the rotating sets: > 4x the H100's L2
MAX_SETS = 4096
PITCH = 256  # bytes between sets: every set starts as aligned as a fresh allocation
SMALL_BYTES, SMALL_ROUNDS = 64 << 20, 3
LARGE_BYTES = 512 << 20  # arrays from here are timed with fewer repetitions
MEMORY_SHARE = 0.6  # of the free GPU memory, for one shape's inputs and outputs (peers aside)
# Targets (issue 24), % of copy: the layout shapes from 8 MB, 2- and 4-byte types from 50 MB;
# every 2-D transpose; host time a call.
TARGET_LAYOUT, TARGET_LAYOUT_LARGE, TARGET_2D, TARGET_HOST_US = 90.0, 95.0, 85.0, 15.0


def shapes(quick: bool) -> list[tuple[str, str, tuple[int, ...], tuple[int, ...]]]:
    """(group, label, shape, axes) for every case of the sweep."""
    resnet = [(64, 112), (256, 56), (512, 28), (1024, 14), (2048, 7)]
    if quick:
        resnet = [(64, 112), (512, 28), (2048, 7)]
    batches = (64,) if quick else (64, 256)
    nchw = [(f"resnet N={n}", (n, c, hw, hw)) for n in batches for c, hw in resnet]
    nchw += [(f"image N={n}", (n, 3, 224, 224)) for n in batches]
    if not quick:
        nchw.append(("video", (8, 64, 16, 56, 56)))
    out = []
    for label, s in nchw:
        k = len(s)
        out.append(("NCHW->NHWC", label, s, (0, *range(2, k), 1)))
    for label, s in nchw:
        k = len(s)
        nhwc = (s[0], *s[2:], s[1])
        out.append(("NHWC->NCHW", label, nhwc, (0, k - 1, *range(1, k - 1))))
    sides = (1024, 4096, 16384) if quick else (1024, 2048, 4096, 8192, 16384, 32768)
    out += [("2-D", "square", (n, n), (1, 0)) for n in sides]
    skinny = [(8192, 3), (3, 8192 * 1024)] if quick else \
        [(8192, 3), (3, 8192), (3, 8192 * 1024), (8192 * 1024, 3)]
    out += [("2-D", "skinny", s, (1, 0)) for s in skinny]
    return out


# ---------------------------------------------------------------------------------------------
# Inputs and the timed calls


class Sets:
    """``n`` input arrays of ``shape`` and ``n`` outputs of the permuted shape, views of one
    input and one output buffer ``PITCH``-aligned apart, the inputs filled with hashed bytes."""

    def __init__(self, shape, axes, dtype, n: int):
        self.shape, self.axes, self.dtype, self.n = tuple(shape), tuple(axes), dtype, n
        self.out_shape = tuple(shape[a] for a in axes)
        self.nbytes = math.prod(shape) * dtype.itemsize
        pitch = -(-self.nbytes // PITCH) * PITCH
        words = -(-(n * pitch) // 4)
        self.inbuf = (cp.arange(words, dtype=cp.uint32) * np.uint32(2654435761)).view(cp.uint8)
        self.outbuf = cp.empty(words * 4, cp.uint8)
        self.xs = [self._view(self.inbuf, i * pitch, self.shape) for i in range(n)]
        self.outs = [self._view(self.outbuf, i * pitch, self.out_shape) for i in range(n)]

    def _view(self, buf, start: int, shape):
        return buf[start:start + self.nbytes].view(self.dtype).reshape(shape)


def _cukern_fn(s: Sets):
    return lambda i: cukern.permute(s.xs[i], s.axes, out=s.outs[i])


def _copy_fn(s: Sets):
    d2d = cp.cuda.runtime.memcpyDeviceToDevice
    return lambda i: cp.cuda.runtime.memcpyAsync(s.outs[i].data.ptr, s.xs[i].data.ptr, s.nbytes,
                                                 d2d, 0)


def _peer_fn(peer: str, s: Sets):
    """A ``(fn(i), sync)`` pair for the peer (sync None: on the legacy default stream, timed by
    events), or None where the peer cannot be timed that way. ImportError if not installed."""
    if peer == "torch":
        import torch

        if torch.cuda.current_stream().cuda_stream != 0:
            return None  # not on the legacy default stream: the events would not bracket it
        tx = [torch.from_dlpack(x) for x in s.xs]
        to = [torch.from_dlpack(o) for o in s.outs]
        return (lambda i: to[i].copy_(tx[i].permute(*s.axes))), None
    if peer == "cupy":
        return (lambda i: cp.copyto(s.outs[i], s.xs[i].transpose(s.axes))), None
    if peer == "jax":
        import jax
        import jax.numpy as jnp

        jx = [jnp.from_dlpack(x) for x in s.xs]
        axes = s.axes
        f = jax.jit(lambda a: jnp.transpose(a, axes))
        run, sync = _bench.jax_pipelined(lambda i: f(jx[i]))
        return run, sync
    raise ValueError(f"unknown peer {peer!r}")


def measure(group, label, shape, axes, name, reps, peers, ab=()) -> list[dict]:
    """One shape and dtype: the copy, cukern and each peer (``ab``: switches of
    _permute_regs.SWITCHES; and cukern's gather phase 2 where its plan takes one), rows as
    _bench.sweep's."""
    dtype = np_dtype(name)
    nbytes = math.prod(shape) * dtype.itemsize
    n_sets = max(1, min(MAX_SETS, -(-ROTATE_BYTES // (2 * nbytes))))
    row = dict(op="permute", group=group, label=label, dtype=name, shape=list(shape),
               axes=list(axes), rows=math.prod(shape[:-1]), cols=shape[-1], bytes=2 * nbytes)
    free = cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()
    if 2 * n_sets * nbytes > MEMORY_SHARE * free:
        return [dict(row, peer="cukern", ms=float("nan"), gbps=float("nan"),
                     pct_copy=float("nan"), error=f"skipped: needs {2 * nbytes / 1e9:.1f} GB, "
                                                   f"{free / 1e9:.1f} GB free")]
    s = Sets(shape, axes, dtype, n_sets)
    reps = reps if nbytes < LARGE_BYTES else max(3, reps // 3)
    timers: dict[str, tuple] = {"copy": (_copy_fn(s), None), "cukern": (_cukern_fn(s), None)}
    gather = regs.gather_fn(s.xs, s.outs, s.axes, ab) if ab else None
    if gather is not None:
        timers["gather"] = (gather, None)
    errors: dict[str, str] = {}
    for peer in peers:
        try:
            made = _peer_fn(peer, s)
        except ImportError:
            continue
        except Exception as err:  # a peer that cannot take the dtype is reported
            errors[peer] = f"{type(err).__name__}: {str(err)[:200]}"
            continue
        if made is not None:
            timers[peer] = made
    best: dict[str, float] = {}
    for _ in range(SMALL_ROUNDS if nbytes <= SMALL_BYTES else 1):
        for who, (fn, sync) in timers.items():
            if who in errors:
                continue
            try:
                ms = _bench.time_peer(fn, sync, n_sets, reps)
            except Exception as err:  # a peer that cannot run a shape is reported
                if who == "cukern":
                    raise
                errors[who] = f"{type(err).__name__}: {str(err)[:200]}"
                continue
            best[who] = min(best.get(who, ms), ms)
    copy_gbps = 2 * nbytes / best["copy"] / 1e6
    out = []
    for who in ("copy", "cukern", *peers, "gather"):
        if who == "gather" and who not in best:
            continue
        if who in errors:
            out.append(dict(row, peer=who, ms=float("nan"), gbps=float("nan"),
                            pct_copy=float("nan"), error=errors[who]))
        elif who in best:
            gbps = 2 * nbytes / best[who] / 1e6
            out.append(dict(row, peer=who, ms=best[who], gbps=gbps,
                            pct_copy=100.0 * gbps / copy_gbps))
    variant, plan = _plan(shape, name, axes)
    for r in out:
        if r["peer"] == "cukern":
            r.update(variant=variant, plan=plan)
    del timers, s
    _bench.free_memory()
    return out


def _plan(shape, dtype: str, axes) -> tuple[str, str]:
    """(kernel variant, one-line plan) from cukern.explain, for the history and the JSON."""
    try:
        plan = cukern.explain("permute", shape, dtype, axes=axes,
                              device=cp.cuda.runtime.getDevice())
    except Exception as err:  # explain's details are reported, not fatal to the timing
        return "", f"explain failed: {type(err).__name__}: {err}"[:300]
    variant = str(getattr(plan, "kind", "") or "")  # copy | tile | general
    if variant == "tile" and getattr(plan, "tile", None):
        variant += " {}x{}".format(*plan.tile) + (" regs" if getattr(plan, "regs", False) else "")
        variant += " flat" if getattr(plan, "flat_regs", 0) else ""
        variant += " skew" if getattr(plan, "skew_regs", False) else ""
    return variant, " ".join(str(plan).split())[:400]


def sweep(cases, dtypes, reps: int, peers, ab=()) -> list[dict]:
    results = []
    _bench.warm_up(2.0)
    for (group, label, shape, axes), name in itertools.product(cases, dtypes):
        rows = measure(group, label, shape, axes, name, reps, peers, ab)
        results += rows
        print(_line(rows), flush=True)
    return results


# ---------------------------------------------------------------------------------------------
# Host overhead


def host_overhead_us(n: int = 5000) -> dict:
    """Microseconds of host time per call on a tiny (4, 32) float32 array, best of five
    batches of n / 5 calls: cukern (a new output, and out=), CuPy, PyTorch."""
    x = cp.arange(4 * 32, dtype=cp.float32).reshape(4, 32)
    o = cp.empty((32, 4), cp.float32)
    fns = {"cukern": lambda: cukern.permute(x, (1, 0)),
           "cukern_out": lambda: cukern.permute(x, (1, 0), out=o),
           "cupy": lambda: cp.ascontiguousarray(x.transpose(1, 0)),
           "cupy_empty_like": lambda: cp.empty_like(x)}
    try:
        import torch

        t = torch.from_dlpack(x)
        fns["torch"] = lambda: t.permute(1, 0).contiguous()
    except ImportError:
        pass
    return {k: _bench.best_host_us(fn, n) for k, fn in fns.items()}


# ---------------------------------------------------------------------------------------------
# Output


def _by_case(results) -> dict[tuple, dict[str, dict]]:
    keyed: dict[tuple, dict[str, dict]] = {}
    for r in results:
        key = (r["group"], r["label"], tuple(r["shape"]), r["dtype"])
        keyed.setdefault(key, {})[r["peer"]] = r
    return keyed


def _line(rows) -> str:
    by = {r["peer"]: r for r in rows}
    r0 = rows[0]
    ours = by.get("cukern", {})
    if ours.get("error"):
        return f"{r0['group']:<11} {r0['dtype']:<9} {str(tuple(r0['shape'])):<24} {ours['error']}"
    cells = []
    if "gather" in by:
        cells.append(f"gather {by['gather']['pct_copy']:5.1f}% "
                     f"({by['gather']['ms'] / ours['ms']:5.2f}x)")
    for p in PEERS:
        if p in by and by[p].get("error") is None:
            cells.append(f"{p} {by[p]['pct_copy']:5.1f}% ({by[p]['ms'] / ours['ms']:5.2f}x)")
        elif p in by:
            cells.append(f"{p} failed")
    return (f"{r0['group']:<11} {r0['dtype']:<9} {str(tuple(r0['shape'])):<24} "
            f"{r0['bytes'] / 2 / 1e6:8.1f} MB  copy {by['copy']['gbps']:6.0f} GB/s  cukern "
            f"{ours['pct_copy']:5.1f}%  " + "  ".join(cells))


def table(results) -> None:
    """Per group and dtype: cukern's % of copy (min-max), each peer's, and how many times
    faster cukern is than each (min-max)."""
    groups: dict[tuple, list[dict]] = {}
    for key, by in _by_case(results).items():
        groups.setdefault((key[0], key[3]), []).append(by)
    print(f"\n{'group':<11} {'dtype':<9} {'n':>3} {'cukern %':>11} "
          + " ".join(f"{p + ' %':>11}" for p in PEERS) + "  "
          + " ".join(f"{'vs ' + p:>13}" for p in PEERS))

    def span(vals, fmt):
        vals = [v for v in vals if v == v]
        return f"{fmt.format(min(vals))}-{fmt.format(max(vals))}" if vals else "-"

    for (group, dtype), cases in groups.items():
        ok = [c for c in cases if "cukern" in c and not c["cukern"].get("error")]
        pct = {p: span([c[p]["pct_copy"] for c in ok if p in c], "{:.0f}")
               for p in ("cukern", *PEERS)}
        faster = {p: span([c[p]["ms"] / c["cukern"]["ms"] for c in ok if p in c], "{:.2f}")
                  for p in PEERS}
        print(f"{group:<11} {dtype:<9} {len(ok):>3} {pct['cukern']:>11} "
              + " ".join(f"{pct[p]:>11}" for p in PEERS) + "  "
              + " ".join(f"{faster[p] + 'x':>13}" for p in PEERS))


def check_targets(results, overhead: dict) -> list[str]:
    misses = []
    for (group, _, shape, dtype), by in _by_case(results).items():
        ours = by.get("cukern")
        if ours is None or ours.get("error"):
            continue
        item, nbytes = np_dtype(dtype).itemsize, ours["bytes"] / 2
        got = ours["pct_copy"]
        if group == "2-D":
            target = TARGET_2D
        elif nbytes >= 50e6 and item in (2, 4):
            target = TARGET_LAYOUT_LARGE
        elif nbytes >= 8e6:
            target = TARGET_LAYOUT
        else:
            target = 0.0
        slower = [p for p in PEERS if p in by and by[p]["ms"] < ours["ms"]]
        if not got >= target or slower:
            goal = f" (target {target:.0f})" if target else ""
            misses.append(f"{group} {dtype} {shape}: {got:.1f}% of copy{goal}"
                          + (f"; slower than {', '.join(slower)}" if slower else ""))
    for k in ("cukern", "cukern_out"):
        if overhead.get(k, 0.0) > TARGET_HOST_US:
            misses.append(f"host overhead {k}: {overhead[k]:.1f} us a call "
                          f"(target {TARGET_HOST_US:.0f})")
    return misses


def plot(results, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [g for g in GROUPS if any(r["group"] == g for r in results)]
    fig, axes = plt.subplots(len(groups), 1, figsize=(14, 3.4 * len(groups)), squeeze=False)
    styles = {"cukern": "o-", "torch": "s--", "cupy": "v-.", "jax": "^:"}
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in results)]
    colors = dict(zip(DTYPES, ("C0", "C1", "C2", "C3")))
    for ax, group in zip(axes[:, 0], groups):
        keys = list(dict.fromkeys((r["label"], tuple(r["shape"])) for r in results
                                  if r["group"] == group))
        xs = range(len(keys))
        for peer, dtype in itertools.product(styles, dtypes):
            ys = []
            for _label, shape in keys:
                hit = [r for r in results if r["group"] == group and r["peer"] == peer and
                       r["dtype"] == dtype and tuple(r["shape"]) == shape]
                ys.append(hit[0]["pct_copy"] if hit else float("nan"))
            if all(y != y for y in ys):
                continue
            ax.plot(xs, ys, styles[peer], color=colors[dtype], ms=3,
                    lw=1.6 if peer == "cukern" else 0.8,
                    label=f"{peer} {dtype}" if peer == "cukern" or dtype == dtypes[0] else None)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(["x".join(map(str, k[1])) for k in keys], rotation=30, ha="right",
                           fontsize=6)
        ax.axhline(TARGET_2D if group == "2-D" else TARGET_LAYOUT, color="k", lw=0.5)
        ax.set_ylim(0, 120)
        ax.set_title(group, fontsize=8)
        ax.set_ylabel("% of copy", fontsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=4)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def history_rows(results, forced: str = "") -> list[dict]:
    """One history.csv row per shape: cukern's % of copy and the peers' times (the CuPy peer,
    which has no column, in the note with the shape and axes, and ``forced``: a rule the run
    changed)."""
    rows = []
    for (group, _, shape, _dtype), by in _by_case(results).items():
        if "copy" not in by:  # skipped: too large for this GPU
            continue
        axes = tuple(next(iter(by.values()))["axes"])
        cupy = by.get("cupy", {}).get("ms")
        gather = by.get("gather", {}).get("ms")
        note = f"{group} shape {shape} axes {axes}" + \
            (f"; cupy_ms {cupy:.6g}" if cupy == cupy and cupy is not None else "") + \
            (f"; gather_ms {gather:.6g}" if gather == gather and gather is not None else "") + \
            (f"; {forced}" if forced else "")
        kept = [dict(r, op=f"permute[{group}]") for p, r in by.items()
                if p not in ("cupy", "gather")]
        rows += _results.peer_rows(kept, note=lambda r, note=note: note)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="batch 64, fewer shapes, float16/float32/int8, fewer repetitions")
    ap.add_argument("--groups", default=",".join(GROUPS),
                    help="a subset keeps the other groups' rows of the current file")
    ap.add_argument("--dtypes", default=None,
                    help=f"default: {','.join(DTYPES)} (--quick: float16,float32,int8)")
    ap.add_argument("--reps", type=int, default=None,
                    help="timing repetitions (default 30, --quick 10)")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help="peers to time as well (those not installed are skipped), or none")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--tag", default="", help="file name tag (default: the GPU, e.g. h100)")
    regs.add_args(ap)  # --byte-regs, --ab-byte-regs, --flat-regs, ..., --ab-skew-regs
    args = ap.parse_args()
    groups = [g for g in args.groups.split(",") if g]
    unknown = set(groups) - set(GROUPS)
    if unknown:
        ap.error(f"--groups: unknown {', '.join(sorted(unknown))}; expected {', '.join(GROUPS)}")
    dtypes = (args.dtypes or ("float16,float32,int8" if args.quick else ",".join(DTYPES)))
    dtypes = dtypes.split(",")
    peers = tuple(p for p in args.peers.split(",") if p and p != "none")
    if set(peers) - set(PEERS):
        ap.error(f"--peers: expected some of {', '.join(PEERS)} or none")
    reps = args.reps or (10 if args.quick else 30)
    changes, ab = regs.from_args(args)
    forced = ", ".join(f"{f} {v}" for f, v in changes.items())
    if changes:
        regs.force_regs(changes)
        print(f"planning with {forced}", flush=True)
    spec = DeviceSpec.from_device()
    run = _results.Run(args.out, "permute", spec.name, tag=args.tag, quick=args.quick)
    try:
        _bench.warm_kernels(["permute"], dtypes, spec)  # compile before timing anything
    except Exception as err:  # the first calls compile instead (in the warm-up calls)
        print(f"warm_kernels: {type(err).__name__}: {err}", flush=True)
    cases = [c for c in shapes(args.quick) if c[0] in groups]
    results = sweep(cases, dtypes, reps, peers, ab)
    overhead = host_overhead_us()
    payload = run.merge_previous(dict(cupy=cp.__version__, results=results,
                                      host_overhead_us=overhead,
                                      **({"forced": forced} if forced else {})),
                                 key=lambda r: (r["group"], r["dtype"]))
    run.save(payload)
    n = run.append(history_rows(results, forced))
    print(f"history: {n} rows appended to {os.path.join(args.out, _results.HISTORY)}")
    plot(payload["results"], run.png_path,
         f"cukern permute on {spec.name} (% of a same-size device copy)")
    table(results)
    regs.ab_summary(_by_case(results))
    print("\nhost overhead (us per call, 4x32 float32):",
          {k: round(v, 2) for k, v in overhead.items()})
    _results.print_misses(check_targets(results, overhead), " at {} shapes")


if __name__ == "__main__":
    main()

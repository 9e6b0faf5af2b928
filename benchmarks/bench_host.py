"""Host time of one call on tiny arrays: every public op with CuPy, PyTorch and JAX inputs,
beside PyTorch's and JAX's own op on the same arrays, in one run (issue 26 item 1: PyTorch or
JAX in, the same kind out, <= 15 us; issue 29: CuPy inputs at or below PyTorch's own op).

Host time: the time to enqueue 16 calls onto an idle GPU, a call (``_bench.enqueue_us``): what
the caller's thread spends, apart from the GPU's time; the median over 5 rounds, each the
median of 80 batches, every column of an op's row (cukern with each input kind, the prepared
calls, PyTorch's and JAX's ops) timed in each round, so all see the same machine state. Arrays:
(4, 8) float32 for the row-wise ops and permute, (2, 8, 4, 4) for batch norm; results fresh
(no ``out=``), and ``cukern.prepare``'s call (fresh result, and with ``out=``). PyTorch's ops
are its public functions (``torch.softmax``, ``F.layer_norm``, ...) or the aten backward its
autograd calls; JAX's are jitted.

    python benchmarks/bench_host.py [--out DIR] [--no-jax] [--base DIR]

``--base DIR`` times this tree against the checkout at DIR instead (its ``cukern`` imported
beside this one, every op's CuPy and PyTorch call alternating between the trees, 5 rounds):
history rows only. Otherwise it writes host_<gpu>.json and .png, appends a row per (op, input
kind) to history.csv (times in microseconds in the note), prints the table and the targets met
or missed. The JSON's
``exchange_us`` has the bare DLPack exchanges (PyTorch and JAX to CuPy and back) and a
trivial jitted JAX call: the floor of a JAX array's trip through cukern.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX beside CuPy and torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import _results  # noqa: E402
import cupy as cp  # noqa: E402

import cukern  # noqa: E402
from cukern import _bench  # noqa: E402

TARGET_INTEROP_US = 15.0  # issue 26 item 1
ROUNDS = 5  # interleaved rounds of every column of a row
ROWS, COLS = 4, 8
BN_SHAPE = (2, 8, 4, 4)


def arrays() -> dict:
    """CuPy inputs of every op (float32), made once."""
    rng = cp.random.default_rng(0)
    x = rng.standard_normal((ROWS, COLS), dtype=cp.float32)
    s = {"x": x, "dy": rng.standard_normal((ROWS, COLS), dtype=cp.float32),
         "w": cp.ones(COLS, cp.float32), "b": cp.zeros(COLS, cp.float32),
         "xb": rng.standard_normal(BN_SHAPE, dtype=cp.float32),
         "dyb": rng.standard_normal(BN_SHAPE, dtype=cp.float32),
         "rm": cp.zeros(BN_SHAPE[1], cp.float32), "rv": cp.ones(BN_SHAPE[1], cp.float32),
         "wb": cp.ones(BN_SHAPE[1], cp.float32), "bb": cp.zeros(BN_SHAPE[1], cp.float32)}
    s["rm_train"], s["rv_train"] = s["rm"], s["rv"]  # training updates them in place
    s["y"] = cukern.softmax(x)
    s["ly"] = cukern.log_softmax(x)
    _, s["mean"], s["rstd"] = cukern.layer_norm(x, COLS, s["w"], s["b"], return_stats=True)
    _, s["rrstd"] = cukern.rms_norm(x, COLS, s["w"], return_stats=True)
    _, s["bmean"], s["binvstd"], _ = cukern.batch_norm(s["xb"], None, None, s["wb"], s["bb"],
                                                       training=True, return_stats=True)
    return s


def cukern_calls(cukern=cukern) -> dict:
    """op -> call of ``cukern`` (this tree's, or a base tree's: :func:`import_tree`) on a dict
    of arrays (of any one kind)."""
    return {
        "softmax": lambda a: cukern.softmax(a["x"]),
        "log_softmax": lambda a: cukern.log_softmax(a["x"]),
        "softmax_backward": lambda a: cukern.softmax_backward(dy=a["dy"], y=a["y"]),
        "log_softmax_backward": lambda a: cukern.log_softmax_backward(dy=a["dy"], y=a["ly"]),
        "layer_norm": lambda a: cukern.layer_norm(a["x"], COLS, a["w"], a["b"]),
        "rms_norm": lambda a: cukern.rms_norm(a["x"], COLS, a["w"]),
        "layer_norm_backward": lambda a: cukern.layer_norm_backward(
            a["dy"], a["x"], a["mean"], a["rstd"], a["w"]),
        "rms_norm_backward": lambda a: cukern.rms_norm_backward(a["dy"], a["x"], a["rrstd"],
                                                                a["w"]),
        "batch_norm": lambda a: cukern.batch_norm(a["xb"], a["rm_train"], a["rv_train"],
                                                  a["wb"], a["bb"], training=True),
        "batch_norm_eval": lambda a: cukern.batch_norm(a["xb"], a["rm"], a["rv"], a["wb"],
                                                       a["bb"]),
        "batch_norm_backward": lambda a: cukern.batch_norm_backward(
            a["dyb"], a["xb"], a["bmean"], a["binvstd"], a["wb"]),
        "permute": lambda a: cukern.permute(a["x"], (1, 0)),
    }


def import_tree(path: str, name: str = "cukern_base"):
    """The ``cukern`` package of another checkout at ``path``, imported as ``name`` beside this
    tree's (its ops use relative imports; both share CuPy, its pools and kernel cache)."""
    import importlib.util

    pkg = os.path.join(path, "cukern")
    spec = importlib.util.spec_from_file_location(name, os.path.join(pkg, "__init__.py"),
                                                  submodule_search_locations=[pkg])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def interleaved(timed: dict) -> dict:
    """Name -> host time of each call in ``timed`` (name -> call): the median over ROUNDS
    rounds, each timing every call in turn (``enqueue_us`` over 400 / ROUNDS batches), so all
    of them see the same machine state (a lent machine's host speed drifts within seconds)."""
    samples = {k: [] for k in timed}
    for _ in range(ROUNDS):
        for k, fn in timed.items():
            samples[k].append(_bench.enqueue_us(fn, batches=400 // ROUNDS))
    return {k: statistics.median(v) for k, v in samples.items()}


def _print_row(row: dict) -> None:
    print(" ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{v}" for k, v in row.items()),
          flush=True)


def measure_ab(base_path: str) -> list[dict]:
    """Host time of every op with CuPy and PyTorch inputs in this tree and the tree at
    ``base_path``, in one process, every call of an op's row in each round
    (:func:`interleaved`)."""
    base = import_tree(base_path)
    a = arrays()
    kinds = {"cupy": a}
    try:
        import torch

        kinds["torch"] = {k: torch.from_dlpack(v) for k, v in a.items()}
    except ImportError:
        pass
    trees = {"base": cukern_calls(base), "new": cukern_calls(cukern)}
    rows = []
    for op in trees["new"]:
        timed = {f"{t}_{kind}_us": (lambda c=calls[op], a=args: c(a))
                 for kind, args in kinds.items() for t, calls in trees.items()}
        row = {"op": op, "dtype": "float32", **interleaved(timed)}
        rows.append(row)
        _print_row(row)
    return rows


def prepared_calls(a: dict) -> dict:
    """op -> (prepared call, its array arguments) for the ops cukern.prepare takes."""
    spec = {"softmax": ((a["x"],), ()), "log_softmax": ((a["x"],), ()),
            "softmax_backward": ((a["dy"], a["y"]), ()),
            "log_softmax_backward": ((a["dy"], a["ly"]), ()),
            "layer_norm": ((a["x"],), ((COLS,), a["w"], a["b"])),
            "rms_norm": ((a["x"],), ((COLS,), a["w"])),
            "permute": ((a["x"],), ((1, 0),))}
    out = {}
    for op, (arrays, extra) in spec.items():
        p = cukern.prepare(op, *arrays, *extra)
        args = arrays + tuple(e for e in extra if isinstance(e, cp.ndarray))
        out[op] = (p, args)
    return out


def torch_calls() -> dict:
    import torch
    import torch.nn.functional as F

    aten = torch.ops.aten
    calls = {
        "softmax": lambda t: torch.softmax(t["x"], -1),
        "log_softmax": lambda t: F.log_softmax(t["x"], -1),
        "softmax_backward": lambda t: aten._softmax_backward_data(t["dy"], t["y"], -1,
                                                                  t["y"].dtype),
        "log_softmax_backward": lambda t: aten._log_softmax_backward_data(
            t["dy"], t["ly"], -1, t["ly"].dtype),
        "layer_norm": lambda t: F.layer_norm(t["x"], (COLS,), t["w"], t["b"]),
        "layer_norm_backward": lambda t: aten.native_layer_norm_backward(
            t["dy"], t["x"], (COLS,), t["mean2"], t["rstd2"], t["w"], t["b"], [True, True, True]),
        "batch_norm": lambda t: F.batch_norm(t["xb"], t["rm"], t["rv"], t["wb"], t["bb"],
                                             training=True),
        "batch_norm_eval": lambda t: F.batch_norm(t["xb"], t["rm"], t["rv"], t["wb"], t["bb"]),
        "permute": lambda t: t["x"].t().contiguous(),
    }
    if hasattr(F, "rms_norm"):
        calls["rms_norm"] = lambda t: F.rms_norm(t["x"], (COLS,), t["w"])
    return calls


def jax_calls() -> dict:
    import jax
    import jax.numpy as jnp

    def ln(x, w, b):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) / jnp.sqrt(v + 1e-5) * w + b

    f = {"softmax": jax.jit(lambda x: jax.nn.softmax(x, axis=-1)),
         "log_softmax": jax.jit(lambda x: jax.nn.log_softmax(x, axis=-1)),
         "layer_norm": jax.jit(ln),
         "rms_norm": jax.jit(lambda x, w: x / jnp.sqrt((x * x).mean(-1, keepdims=True)
                                                       + 1e-6) * w),
         "permute": jax.jit(lambda x: x.T)}
    return {"softmax": lambda j: f["softmax"](j["x"]),
            "log_softmax": lambda j: f["log_softmax"](j["x"]),
            "layer_norm": lambda j: f["layer_norm"](j["x"], j["w"], j["b"]),
            "rms_norm": lambda j: f["rms_norm"](j["x"], j["w"]),
            "permute": lambda j: f["permute"](j["x"])}


def measure(jax: bool = True) -> list[dict]:
    a = arrays()
    kinds = {"cupy": a}
    peers = {}
    try:
        import torch

        kinds["torch"] = {k: torch.from_dlpack(v) for k, v in a.items()}
        for k in ("mean", "rstd"):  # PyTorch's native backward takes them as (rows, 1)
            kinds["torch"][k + "2"] = kinds["torch"][k][:, None]
        peers["torch"] = (torch_calls(), kinds["torch"])
    except ImportError:
        print("PyTorch is not installed: no PyTorch rows", flush=True)
    try:
        if not jax:
            raise ImportError
        import jax.numpy as jnp

        kinds["jax"] = {k: jnp.from_dlpack(v) for k, v in a.items()}
        # JAX arrays are immutable: training has no running statistics to update (refused)
        kinds["jax"]["rm_train"] = kinds["jax"]["rv_train"] = None
        peers["jax"] = (jax_calls(), kinds["jax"])
    except ImportError:
        print("JAX is not installed (or --no-jax): no JAX rows", flush=True)
    prepared = prepared_calls(a)
    cp.cuda.Device().synchronize()
    rows = []
    for op, call in cukern_calls().items():
        timed = {f"cukern_{kind}_us": (lambda c=call, a=args: c(a)) for kind, args in
                 kinds.items()}
        if op in prepared:
            p, pargs = prepared[op]
            out = p(*pargs)
            timed["prepared_us"] = lambda p=p, a=pargs: p(*a)
            timed["prepared_out_us"] = lambda p=p, a=pargs, o=out: p(*a, out=o)
        for peer, (calls, args) in peers.items():
            if op in calls:
                timed[f"{peer}_us"] = lambda c=calls[op], a=args: c(a)
        row = {"op": op, "dtype": "float32", **interleaved(timed)}
        rows.append(row)
        _print_row(row)
    return rows


def exchange_us() -> dict:
    """Host time of the bare DLPack exchanges a JAX call needs (its input to CuPy, a CuPy
    result to JAX) beside PyTorch's, and JAX's own cheapest jitted call: what bounds a JAX
    array's trip through cukern from below."""
    x = cp.zeros((ROWS, COLS), cp.float32)
    out = {}
    try:
        import torch
        from torch.utils import dlpack as tdl

        t = torch.zeros((ROWS, COLS), device="cuda")
        out["torch_tensor_to_cupy"] = _bench.enqueue_us(lambda: cp.from_dlpack(tdl.to_dlpack(t)))
        out["cupy_to_torch_tensor"] = _bench.enqueue_us(lambda: torch.from_dlpack(x))
    except ImportError:
        pass
    try:
        import jax
        import jax.numpy as jnp

        j = jnp.zeros((ROWS, COLS), jnp.float32)
        ident = jax.jit(lambda v: v + 0)
        ident(j).block_until_ready()
        out["jax_array_to_cupy"] = _bench.enqueue_us(lambda: cp.from_dlpack(j))
        out["cupy_to_jax_array"] = _bench.enqueue_us(lambda: jnp.from_dlpack(x))
        out["jax_jit_add_zero"] = _bench.enqueue_us(lambda: ident(j))
    except ImportError:
        pass
    print(" ".join(f"{k} {v:.2f}" for k, v in out.items()), flush=True)
    return out


def check_targets(rows: list[dict]) -> list[str]:
    misses = []
    for r in rows:
        for kind in ("torch", "jax"):
            us = r.get(f"cukern_{kind}_us")
            if us is not None and us > TARGET_INTEROP_US:
                misses.append(f"{r['op']}: {kind} in, {us:.1f} us a call (target "
                              f"{TARGET_INTEROP_US} us)")
        if "torch_us" in r and r["cukern_cupy_us"] > r["torch_us"]:
            misses.append(f"{r['op']}: CuPy in, {r['cukern_cupy_us']:.1f} us a call, PyTorch's "
                          f"own op {r['torch_us']:.1f} us")
    return misses


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("cukern_cupy_us", "prepared_us", "prepared_out_us", "cukern_torch_us",
                        "cukern_jax_us", "torch_us", "jax_us") if any(k in r for r in rows)]
    fig, ax = plt.subplots(figsize=(11, 4.2))
    width = 0.8 / len(keys)
    for i, k in enumerate(keys):
        xs = [j + i * width for j, r in enumerate(rows) if k in r]
        ax.bar(xs, [r[k] for r in rows if k in r], width, label=k[:-3].replace("_", " "))
    ax.axhline(TARGET_INTEROP_US, color="k", lw=0.6, ls=":")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([r["op"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("host us a call (lower is better)")
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=len(keys))
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--base", metavar="DIR",
                    help="A/B only: this tree against the checkout at DIR, interleaved in one "
                         "process; history rows only (variant 'host A/B against NAME')")
    ap.add_argument("--base-name", help="the base tree's name in history (its commit)")
    ap.add_argument("--no-jax", action="store_true",
                    help="CuPy and PyTorch rows only, no exchange_us (A/B rounds of the host "
                         "path: JAX's calls take most of a run)")
    args = ap.parse_args()
    _bench.warm_up()
    device = cukern.DeviceSpec.from_device().name
    run = _results.Run(args.out, "host", device)
    if args.base:
        ab = measure_ab(args.base)
        name = args.base_name or os.path.basename(os.path.abspath(args.base))
        run.append([dict(op=r["op"], dtype=r["dtype"], rows=ROWS, cols=COLS,
                         variant=f"host A/B against {name}",
                         note="; ".join(f"{k[:-3]} {v:.2f} us" for k, v in r.items()
                                        if k.endswith("_us"))) for r in ab])
        return
    rows = measure(jax=not args.no_jax)
    exchange = {} if args.no_jax else exchange_us()
    run.save({"shape": [ROWS, COLS], "batch_norm_shape": list(BN_SHAPE), "results": rows,
              "exchange_us": exchange})
    plot(rows, run.png_path, f"cukern host time a call on {device}, tiny float32 arrays")
    run.append([dict(op=r["op"], dtype=r["dtype"], rows=ROWS, cols=COLS,
                     variant="host time, tiny arrays",
                     note="; ".join(f"{k[:-3]} {v:.2f} us" for k, v in r.items()
                                    if k.endswith("_us"))) for r in rows])
    _results.print_misses(check_targets(rows))


if __name__ == "__main__":
    main()

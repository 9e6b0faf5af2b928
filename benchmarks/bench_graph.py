"""Layout graph benchmark: a traced chain optimised for NHWC against the same chain as eager
NCHW cukern calls and as PyTorch eager (NCHW and channels_last), in the same run.

Chains (float16): the ResNet-style block of ``cukern.graph.examples`` (batch norm, ReLU,
depthwise 3x3 conv, batch norm, + residual, ReLU, softmax over channels) at (64, 256, 56, 56),
and the ConvNeXt-style block (depthwise 3x3 conv, layer norm over channels, 1x1 conv to 4C,
ReLU, 1x1 conv, + residual) at (64, 96, 56, 56). The convolutions are the same for every
contender: PyTorch's (cuDNN) ``conv2d`` through DLPack, NCHW or channels_last, registered as
graph ops with both implementations; the rest is cukern (and CuPy elementwise) or PyTorch.

Contenders: the optimised graph called with NCHW in and out (uncaptured, and as a CUDA graph),
the graph optimised for NHWC in and out (``cukern_graph_nhwc_io``, the peer of a channels_last
PyTorch model, whose input is channels_last already), the block as eager cukern calls on NCHW,
PyTorch eager on NCHW and on channels_last tensors.

Times: median of CUDA-event-bracketed batches behind a spin kernel (``_bench.time_gpu``), on the
legacy default stream where CuPy and PyTorch both launch. ``bytes``: the graph's model of bytes
moved (``cukern.graph.api.bytes_moved``: each op reads its activations once, a training batch
norm x twice, writes its result; permutes twice their array), the eager count also credited to
PyTorch. ``pct_copy``: bytes / time against a same-size device copy measured in the same run.
Host time: a captured 10-op chain on (2, 8, 4, 4) float32 (``cap(x)``: input copy + one graph
launch; ``cap.launch()``), beside the same chain eager and uncaptured: the median time to
enqueue 16 calls onto an idle GPU, a call (``_bench.enqueue_us``); also the GPU time of one
replay and the time a call of a back-to-back loop, which is the GPU's where that is longer.

    python benchmarks/bench_graph.py [--quick] [--out DIR]

Writes graph_<gpu>.json and .png, appends a row per chain to history.csv, prints a table and
the issue's targets met or missed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import _results  # noqa: E402
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

import cukern  # noqa: E402
from cukern import _bench, graph  # noqa: E402
from cukern._device import DeviceSpec  # noqa: E402
from cukern.graph import examples as ex  # noqa: E402
from cukern.graph.api import bytes_moved  # noqa: E402

TARGET_TORCH_CL, TARGET_HOST_US = 1.5, 20.0  # issue 25


def _torch():
    import torch
    import torch.nn.functional as F

    return torch, F


def _conv(layout: str, groups_of):
    """conv2d through PyTorch: x cupy (NCHW, or NHWC memory), w cupy (O, C/groups, kh, kw)."""
    def run(x, w):
        torch, _ = _torch()
        s = cp.cuda.get_current_stream().ptr  # PyTorch launches where CuPy does (captures)
        with torch.cuda.stream(torch.cuda.ExternalStream(s)) if s else contextlib.nullcontext():
            return _call(x, w)

    def _call(x, w):
        torch, F = _torch()
        t = torch.from_dlpack(x)
        if layout == "NHWC":
            t = t.permute(0, 3, 1, 2)  # an NCHW view with channels_last strides
        wt = torch.from_dlpack(w)
        if layout == "NHWC":
            wt = wt.contiguous(memory_format=torch.channels_last)
        y = F.conv2d(t, wt, padding=wt.shape[-1] // 2, groups=groups_of(t, wt))
        if layout == "NHWC":
            y = y.permute(0, 2, 3, 1).contiguous()
        return cp.from_dlpack(y)
    return run


def _depthwise(t, w):
    return t.shape[1]


def _dense(t, w):
    return 1


dwconv = graph.register(None, layouts={"NCHW": _conv("NCHW", _depthwise),
                                       "NHWC": _conv("NHWC", _depthwise)}, name="dwconv_cudnn")
conv1 = graph.register(None, layouts={"NCHW": _conv("NCHW", _dense),
                                      "NHWC": _conv("NHWC", _dense)}, name="conv1x1_cudnn",
                       shape=lambda xs, ws: (xs[0], ws[0], xs[2], xs[3]))


resnet = ex.make_resnet_block(dwconv)
convnext = ex.make_convnext_block(dwconv, conv1)


def _params(chain: str, c: int, dtype, rng) -> dict:
    if chain == "resnet":
        p = ex.resnet_params(c, rng, cp)
        p["k1"] = p["k1"].astype(dtype)
        return p
    p = ex.convnext_params(c, rng, cp, dtype=dtype)
    p["w1"], p["w2"] = p["w1"][:, :, None, None], p["w2"][:, :, None, None]
    return p


def _torch_chain(chain: str, p: dict, channels_last: bool):
    torch, F = _torch()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    t = {k: torch.from_dlpack(v) for k, v in p.items()}
    for k in ("k1", "k", "w1", "w2"):
        if k in t and t[k].ndim == 4:
            t[k] = t[k].contiguous(memory_format=fmt)

    if chain == "resnet":
        def run(x):
            h = F.relu(F.batch_norm(x, t["rm1"], t["rv1"], t["w1"], t["b1"], training=True))
            h = F.conv2d(h, t["k1"], padding=1, groups=h.shape[1])
            h = F.batch_norm(h, t["rm2"], t["rv2"], t["w2"], t["b2"], training=True)
            return torch.softmax(F.relu(h + x), dim=1)
    else:
        def run(x):
            h = F.conv2d(x, t["k"], padding=1, groups=x.shape[1])
            h = F.layer_norm(h.permute(0, 2, 3, 1), (h.shape[1],), t["ln_w"], t["ln_b"])
            h = h.permute(0, 3, 1, 2)
            h = F.relu(F.conv2d(h, t["w1"]))
            return F.conv2d(h, t["w2"]) + x
    return run


def bench_chain(chain: str, shape, dtype: str, reps: int) -> list[dict]:
    torch, _ = _torch()
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
    p = _params(chain, shape[1], np.dtype(dtype), rng)
    fn = resnet if chain == "resnet" else convnext
    g = graph.trace(fn, x, p)
    opt = g.optimize(layout="NHWC")
    print(opt.explain().split("\ngraph ")[0])
    eager_bytes, opt_bytes = bytes_moved(g.graph), bytes_moved(opt.graph)
    try:
        cap = opt.capture(x, copy.deepcopy(p))
    except Exception as err:  # cuDNN inside a CUDA graph is PyTorch's to allow
        print(f"{chain}: capture failed: {type(err).__name__}: {err}")
        cap = None
    tx = torch.from_dlpack(x)
    tx_cl = tx.contiguous(memory_format=torch.channels_last)  # a channels_last model's input
    io = g.optimize(layout="NHWC", input_layout="NHWC", output_layout="NHWC")
    x_nhwc = cukern.to_nhwc(x)
    t_nchw, t_cl = _torch_chain(chain, p, False), _torch_chain(chain, p, True)
    contenders = [
        ("cukern_graph", lambda i: opt(x, p), opt_bytes),
        ("cukern_graph_captured", (lambda i: cap.launch()) if cap else None, opt_bytes),
        ("cukern_graph_nhwc_io", lambda i: io(x_nhwc, p), bytes_moved(io.graph)),
        ("cukern_eager_nchw", lambda i: fn(x, p), eager_bytes),
        ("torch_nchw", lambda i: t_nchw(tx), eager_bytes),
        ("torch_channels_last", lambda i: t_cl(tx_cl), eager_bytes),
    ]
    nbytes = x.nbytes
    copy_ms = _bench.copy_ms(nbytes, reps)
    copy_gbps = 2 * nbytes / copy_ms / 1e6
    rows = []
    for name, f, b in contenders:
        ms = _bench.time_gpu(f, 1, reps) if f is not None else float("nan")
        rows.append(dict(chain=chain, shape=list(shape), dtype=dtype, peer=name, ms=ms,
                         bytes=b, gbps=b / ms / 1e6, pct_copy=100 * b / ms / 1e6 / copy_gbps,
                         copy_ms=copy_ms, copy_gbps=copy_gbps,
                         permutes=(io if name.endswith("nhwc_io") else opt if name.startswith(
                             "cukern_graph") else g).permute_count()))
    cap = None  # the capture and its private memory pool go
    return rows


def host_times(n: int) -> dict:
    """Host microseconds a call of a 10-op chain on tiny arrays."""
    rng = np.random.default_rng(1)
    c = 8
    x = cp.asarray(rng.standard_normal((2, c, 4, 4), dtype=np.float32))
    p = {k: cp.asarray(v) for k, v in {
        "rm": np.zeros(c, np.float32), "rv": np.ones(c, np.float32),
        "w": np.ones(c, np.float32), "b": np.zeros(c, np.float32)}.items()}

    def chain(x, p):
        h = cukern.batch_norm(x, p["rm"], p["rv"], p["w"], p["b"], training=True)
        h = graph.relu(h)
        h = h * 0.5
        h = h + x
        h = cukern.softmax(h, axis=1)
        h = graph.bias_add(h, p["b"])
        h = graph.relu(h)
        h = graph.layer_norm(h, p["w"], p["b"], axis=1)
        h = h * 2.0
        return graph.relu(h)

    g = graph.trace(chain, x, p)
    opt = g.optimize(layout="NHWC")
    cap = opt.capture(x, p)
    out = {"ops": len(g.graph.ops()), "ops_optimised": len(opt.graph.ops())}
    for label, f in (("captured_call", lambda: cap(x)), ("captured_launch", cap.launch),
                     ("graph_uncaptured", lambda: opt(x, p)), ("eager", lambda: chain(x, p))):
        out[label + "_us"] = _bench.enqueue_us(f, batches=400 if "captured" in label else 40)
    # back-to-back calls and the GPU time of a replay: where the replay's 10+ kernels take the
    # GPU longer than the host takes to launch them, a loop of calls runs at the GPU's pace
    out["captured_call_back_to_back_us"] = _bench.best_host_us(lambda: cap(x), n)
    out["captured_gpu_us"] = _bench.time_gpu(lambda i: cap(x), 1) * 1e3
    return out


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chains = list(dict.fromkeys(r["chain"] for r in rows))
    fig, axes = plt.subplots(1, len(chains), figsize=(6 * len(chains), 3.6), squeeze=False)
    for ax, ch in zip(axes.flat, chains):
        sel = [r for r in rows if r["chain"] == ch]
        ax.barh([r["peer"] for r in sel], [r["ms"] for r in sel],
                color=["C0" if r["peer"].startswith("cukern_graph") else "C7" for r in sel])
        for i, r in enumerate(sel):
            ax.text(r["ms"], i, f" {r['ms']:.3f} ms, {r['bytes'] / 1e9:.2f} GB", va="center",
                    fontsize=7)
        ax.set_title(f"{ch} {tuple(sel[0]['shape'])} {sel[0]['dtype']}", fontsize=10)
        ax.set_xlabel("median ms (lower is better)")
        ax.invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def check_targets(rows: list[dict], host: dict) -> list[str]:
    misses = []
    by = {(r["chain"], r["peer"]): r for r in rows}
    for ch in dict.fromkeys(r["chain"] for r in rows):
        o, e = by[(ch, "cukern_graph")], by[(ch, "cukern_eager_nchw")]
        t, io = by[(ch, "torch_channels_last")], by[(ch, "cukern_graph_nhwc_io")]
        saved_ms = (e["bytes"] - o["bytes"]) / (o["copy_gbps"] * 1e6)
        if ch == "resnet" and e["ms"] - o["ms"] < saved_ms:
            misses.append(f"{ch}: saves {e['ms'] - o['ms']:.3f} ms over eager NCHW, the bytes "
                          f"removed are worth {saved_ms:.3f} ms at copy bandwidth")
        if ch == "resnet" and t["ms"] / io["ms"] < TARGET_TORCH_CL:
            misses.append(f"{ch}: NHWC in and out, {t['ms'] / io['ms']:.2f}x PyTorch "
                          f"channels_last, target {TARGET_TORCH_CL}x")
    if host["captured_call_us"] > TARGET_HOST_US:
        misses.append(f"host: captured 10-op chain {host['captured_call_us']:.1f} us a call, "
                      f"target {TARGET_HOST_US} us")
    return misses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 8 instead of 64")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    n = 8 if args.quick else 64
    _bench.warm_up()
    rows = bench_chain("resnet", (n, 256, 56, 56), "float16", args.reps)
    rows += bench_chain("convnext", (n, 96, 56, 56), "float16", args.reps)
    host = host_times(20000)
    device = DeviceSpec.from_device().name
    run = _results.Run(args.out, "graph", device, quick=args.quick)
    run.save({"results": rows, "host": host})
    plot(rows, run.png_path, f"cukern layout graph on {device}, float16")
    by = {(r["chain"], r["peer"]): r for r in rows}
    hist = []
    for ch in dict.fromkeys(r["chain"] for r in rows):
        o = by[(ch, "cukern_graph")]
        hist.append(dict(op=f"graph_{ch}", dtype=o["dtype"], rows=o["shape"][0],
                         cols=int(np.prod(o["shape"][1:])), variant="optimised NHWC",
                         pct_copy=o["pct_copy"], gbps=o["gbps"], copy_gbps=o["copy_gbps"],
                         cukern_ms=o["ms"], torch_ms=by[(ch, "torch_channels_last")]["ms"],
                         copy_ms=o["copy_ms"],
                         note=f"shape {tuple(o['shape'])}; captured "
                              f"{by[(ch, 'cukern_graph_captured')]['ms']:.4g} ms, eager NCHW "
                              f"cukern {by[(ch, 'cukern_eager_nchw')]['ms']:.4g} ms, torch "
                              f"NCHW {by[(ch, 'torch_nchw')]['ms']:.4g} ms; host captured "
                              f"call {host['captured_call_us']:.1f} us"))
    run.append(hist)
    print(f"\n{'chain':<9} {'contender':<22} {'ms':>8} {'GB':>6} {'% copy':>7} {'permutes':>8}")
    for r in rows:
        print(f"{r['chain']:<9} {r['peer']:<22} {r['ms']:8.3f} {r['bytes'] / 1e9:6.2f} "
              f"{r['pct_copy']:7.1f} {r['permutes']:8d}")
    print("host us a call:", ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                       for k, v in host.items()))
    _results.print_misses(check_targets(rows, host))


if __name__ == "__main__":
    main()

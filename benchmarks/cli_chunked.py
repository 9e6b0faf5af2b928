"""Throughput of ``cukern softmax`` on a file too large for one piece, against PCIe.

Measures, on one machine: pinned host-to-device and device-to-host copy speed (the ceiling for
any out-of-core pipeline), then the command line end to end on an .npy file as large as the
GPU's free memory allows or the disk does (input and output both have to fit), and checks a
sample of the result against a direct GPU call. A second, smaller run keeps both files in
/dev/shm when it has room, to show the pipeline without the disk.

    python benchmarks/cli_chunked.py [--gb 24] [--cols 4096] [--dtype float16] [--dir DIR]

Writes benchmarks/results/cli_chunked_<gpu>.json and .png, appends a row per run to
history.csv (% of copy: of pinned PCIe copies both ways at once) and prints the table. What it
measured: docs/notes/cli-streaming.md. ``--plot FILE.json`` redraws a saved result's PNG
(no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _results  # noqa: E402
import cupy as cp  # noqa: E402

import cukern  # noqa: E402
from cukern._device import DeviceSpec  # noqa: E402


def pcie_gbps(nbytes: int = 1 << 30, reps: int = 5) -> dict:
    """Median GB/s of pinned host <-> device copies of ``nbytes``."""
    host = np.frombuffer(cp.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)
    host[:] = 1
    dev = cp.empty(nbytes, cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    out = {}
    for name, copy in (("h2d", lambda: dev.data.copy_from_host_async(host.ctypes.data, nbytes,
                                                                      stream)),
                       ("d2h", lambda: dev.data.copy_to_host_async(host.ctypes.data, nbytes,
                                                                    stream))):
        times = []
        for _ in range(reps + 1):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            copy()
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
        out[name] = nbytes / sorted(times[1:])[reps // 2] / 1e9
    # Both directions at once (what a pipeline overlapping upload and download sees).
    dev2 = cp.empty(nbytes, cp.uint8)
    host2 = np.frombuffer(cp.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)
    s2 = cp.cuda.Stream(non_blocking=True)
    t0 = time.perf_counter()
    for _ in range(reps):
        dev.data.copy_from_host_async(host.ctypes.data, nbytes, stream)
        dev2.data.copy_to_host_async(host2.ctypes.data, nbytes, s2)
    stream.synchronize()
    s2.synchronize()
    out["both"] = 2 * reps * nbytes / (time.perf_counter() - t0) / 1e9
    return out


def make_input(path: str, rows: int, cols: int, dtype) -> None:
    """Write a (rows, cols) .npy of random values, a block at a time (the values repeat every
    block: the benchmark measures movement, not statistics)."""
    block_rows = max(1, (256 << 20) // (cols * np.dtype(dtype).itemsize))
    rng = np.random.default_rng(0)
    block = (rng.standard_normal((block_rows, cols), dtype=np.float32) * 3).astype(dtype)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(rows, cols))
    for r0 in range(0, rows, block_rows):
        n = min(block_rows, rows - r0)
        out[r0:r0 + n] = block[:n]
    out.flush()
    del out


def run_cli(src: str, dst: str, dtype: str, extra=()) -> dict:
    """Time ``cukern softmax`` in a fresh process; parse its summary line."""
    cmd = [sys.executable, "-m", "cukern", "softmax", src, "-o", dst, "--overwrite", *extra]
    env = dict(os.environ, PYTHONPATH=ROOT)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"cukern failed: {proc.stderr.strip()}")
    m = re.search(r"in ([0-9.]+) s \(([0-9.]+) GB/s\)", proc.stderr)
    return {"wall_s": wall, "run_s": float(m.group(1)), "run_gbps": float(m.group(2))}


def check_sample(src: str, dst: str, rows: int) -> bool:
    """A few thousand rows of the output equal a direct GPU call on the same rows."""
    x = np.load(src, mmap_mode="r")
    y = np.load(dst, mmap_mode="r")
    ok = True
    for r0 in (0, rows // 2, max(0, rows - 2000)):
        xs = np.ascontiguousarray(x[r0:r0 + 2000])
        ok &= np.ascontiguousarray(y[r0:r0 + 2000]).tobytes() == \
            cp.asnumpy(cukern.softmax(cp.asarray(xs))).tobytes()
    return bool(ok)


def case(label: str, folder: str, gb: float, cols: int, dtype, pcie: dict) -> dict:
    item = np.dtype(dtype).itemsize
    rows = max(1, int(gb * 1e9) // (cols * item))
    src = os.path.join(folder, "cukern-bench-in.npy")
    dst = os.path.join(folder, "cukern-bench-out.npy")
    try:
        t0 = time.perf_counter()
        make_input(src, rows, cols, dtype)
        made = time.perf_counter() - t0
        timing = run_cli(src, dst, np.dtype(dtype).name)
        nbytes = rows * cols * item
        result = dict(label=label, folder=folder, rows=rows, cols=cols,
                      dtype=np.dtype(dtype).name, input_gb=nbytes / 1e9,
                      moved_gb=2 * nbytes / 1e9, write_input_s=made, **timing,
                      identical_sample=check_sample(src, dst, rows))
        # GB/s counts input read plus output written; PCIe carries the same bytes (up + down).
        result["pct_of_pcie_both"] = 100 * result["run_gbps"] / pcie["both"]
        return result
    finally:
        for p in (src, dst):
            if os.path.exists(p):
                os.unlink(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, help="input size in GB (default: as large as allowed)")
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--dir", default=None, help="folder for the files (default: the temp dir)")
    ap.add_argument("--shm-gb", type=float, default=8.0, help="size of the /dev/shm run (0: skip)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--plot", metavar="JSON", help="only redraw the PNG of a saved result")
    args = ap.parse_args()
    if args.plot:
        with open(args.plot) as f:
            report = json.load(f)
        png = os.path.splitext(args.plot)[0] + ".png"
        plot(report, png)
        print(f"wrote {png}")
        return

    spec = DeviceSpec.from_device()
    run = _results.Run(args.out, "cli_chunked", spec.name)
    free_gpu, total_gpu = cp.cuda.runtime.memGetInfo()
    folder = args.dir or tempfile.gettempdir()
    disk_free = shutil.disk_usage(folder).free
    # Input and output must both fit on the disk, with room to spare.
    gb = args.gb or min(1.05 * free_gpu, 0.42 * disk_free) / 1e9
    pcie = pcie_gbps()
    print(f"{spec.name}: {free_gpu / 1e9:.1f} GB free of {total_gpu / 1e9:.1f}; "
          f"PCIe pinned H2D {pcie['h2d']:.1f} GB/s, D2H {pcie['d2h']:.1f} GB/s, "
          f"both at once {pcie['both']:.1f} GB/s; disk free {disk_free / 1e9:.0f} GB", flush=True)
    runs = [case("disk", folder, gb, args.cols, args.dtype, pcie)]
    shm = "/dev/shm"
    if args.shm_gb and os.path.isdir(shm) and \
            shutil.disk_usage(shm).free > 2.2 * args.shm_gb * 1e9:
        runs.append(case("memory (/dev/shm)", shm, args.shm_gb, args.cols, args.dtype, pcie))

    report = dict(gpu_free_gb=free_gpu / 1e9, gpu_total_gb=total_gpu / 1e9,
                  disk_free_gb=disk_free / 1e9, pcie_gbps=pcie, runs=runs,
                  cupy=cp.__version__, cukern=cukern.__version__)
    plot(run.stamp(report), run.png_path)
    run.save(report)
    n = run.append(history_rows(report))
    print(f"history: {n} rows appended to {os.path.join(args.out, _results.HISTORY)}")
    print(table(spec.name, report))


def plot(report: dict, path: str) -> None:
    """Bars: GB/s of each run end to end beside the pinned PCIe copies (the ceiling)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pcie = report["pcie_gbps"]
    labels = ["PCIe\nhost to device", "PCIe\ndevice to host", "PCIe\nboth at once"]
    values = [pcie["h2d"], pcie["d2h"], pcie["both"]]
    for r in report["runs"]:
        labels.append(f"cukern softmax\nfiles: {r['label']}\n{r['input_gb']:.0f} GB "
                      f"{r['dtype']}")
        values.append(r["run_gbps"])
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(values), 3.6))
    bars = ax.bar(range(len(values)), values,
                  color=["#9a9a9a"] * 3 + ["#1f77b4"] * len(report["runs"]))
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel("GB/s (input read + output written)", fontsize=8)
    ax.set_title(f"{report.get('device', '')}: out-of-core softmax against pinned PCIe copies "
                 f"({report.get('commit', '')})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def history_rows(report: dict) -> list[dict]:
    """One history.csv row per run: GB/s end to end, over PCIe copies both ways at once."""
    both = report["pcie_gbps"]["both"]
    return [dict(op="softmax", dtype=r["dtype"], rows=r["rows"], cols=r["cols"],
                 pct_copy=r["pct_of_pcie_both"], gbps=r["run_gbps"], copy_gbps=both,
                 cukern_ms=1000 * r["run_s"],
                 note=f"cukern softmax on files in {r['label']}, {r['input_gb']:.1f} GB; "
                      f"% of copy: of PCIe both ways; wall {r['wall_s']:.1f} s")
            for r in report["runs"]]


def table(device: str, report: dict) -> str:
    pcie = report["pcie_gbps"]
    lines = [
        f"`cukern softmax` on files larger than one piece: {device}",
        f"GPU memory free {report['gpu_free_gb']:.1f} GB of {report['gpu_total_gb']:.1f} GB. "
        f"Pinned PCIe copies: host to device {pcie['h2d']:.1f} GB/s, device to host "
        f"{pcie['d2h']:.1f} GB/s, both directions at once {pcie['both']:.1f} GB/s.",
        "GB/s = (input read + output written) / time from the first chunk to the output "
        "renamed into place (fsync included); wall = the whole process.",
        "",
        f"{'files on':18s} {'shape':>14s} {'dtype':8s} {'input GB':>8s} {'run s':>6s} "
        f"{'GB/s':>6s} {'% PCIe':>6s} {'wall s':>6s} sample identical",
    ]
    for r in report["runs"]:
        lines.append(f"{r['label']:18s} {r['rows']:>8d}x{r['cols']:<5d} {r['dtype']:8s} "
                     f"{r['input_gb']:8.1f} {r['run_s']:6.1f} {r['run_gbps']:6.2f} "
                     f"{r['pct_of_pcie_both']:6.0f} {r['wall_s']:6.1f} {r['identical_sample']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

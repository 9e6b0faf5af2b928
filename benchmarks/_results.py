"""Where every benchmark writes its results.

One current JSON (and PNG) per benchmark and GPU, ``<benchmark>_<gpu>.json`` (``h100`` for an
"NVIDIA H100 80GB HBM3"), rewritten by each run, and one append-only ``history.csv`` beside it
that every full run adds its rows to: commit, date, GPU, shape, cukern's % of copy and each
peer's time. Runs of part of a benchmark (some ops or dtypes) keep the current file's other
rows, and record where those came from under ``merged_from``.

    run = Run(out_dir, "softmax", device_name)
    run.save(payload)                      # <out_dir>/softmax_h100.json, stamped
    run.append(peer_rows(payload["results"]))   # <out_dir>/history.csv
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import re
import subprocess

__all__ = ["COLUMNS", "Run", "gpu_tag", "commit", "today", "peer_rows", "print_misses",
           "write_json"]

# Peers whose time gets a column (``<peer>_ms``): the libraries, the same-size device copy, the
# residual norms' unfused add then norm, and the fastest way forced (bench_layer_norm --ways).
PEERS = ("cukern", "torch", "jax", "cupyx", "copy", "cukern_add_then_norm", "best_way")
COLUMNS = ("commit", "date", "gpu", "benchmark", "op", "dtype", "rows", "cols", "variant",
           "pct_copy", "gbps", "copy_gbps", *(f"{p}_ms" for p in PEERS), "note")
HISTORY = "history.csv"
_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_VENDOR = {"nvidia", "geforce", "tesla", "quadro", "amd", "radeon", "instinct"}


def gpu_tag(device: str) -> str:
    """Short file-name tag of a device name: 'NVIDIA H100 80GB HBM3' -> 'h100',
    'NVIDIA GeForce RTX 4090' -> 'rtx_4090', 'NVIDIA A100-SXM4-80GB' -> 'a100'."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", device) if w and w.lower() not in _VENDOR]
    kept = []
    for w in words:
        kept.append(w.lower())
        if any(ch.isdigit() for ch in w):
            break
    return "_".join(kept) or "gpu"


def commit() -> str:
    """The checkout's short commit, with '-dirty' where files outside benchmarks/results/
    differ from it; $CUKERN_COMMIT where set (a copy of the tree without .git); '' if unknown."""
    if os.environ.get("CUKERN_COMMIT"):
        return os.environ["CUKERN_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=_ROOT, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("-dirty" if dirty else "")


def today() -> str:
    """Today's date, UTC, as YYYY-MM-DD."""
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def write_json(path: str, payload: dict) -> None:
    """``payload`` as JSON with each item of a top-level list on its own line (diffable, and a
    fraction of the size of an indented file)."""
    parts = []
    for key, value in payload.items():
        if isinstance(value, list) and value:
            items = ",\n  ".join(json.dumps(v) for v in value)
            parts.append(f"{json.dumps(key)}: [\n  {items}\n ]")
        else:
            parts.append(f"{json.dumps(key)}: {json.dumps(value)}")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("{\n " + ",\n ".join(parts) + "\n}\n")
    os.replace(tmp, path)


class Run:
    """One run of one benchmark: its file names, and the commit and date it is stamped with
    (taken when the run starts, before it writes anything)."""

    def __init__(self, out: str, benchmark: str, device: str, tag: str = "",
                 quick: bool = False) -> None:
        self.out, self.benchmark, self.device = out, benchmark, device
        self.base = os.path.join(out, f"{benchmark}_{tag or gpu_tag(device)}"
                                      f"{'_quick' if quick else ''}")
        self.commit, self.date = commit(), today()
        os.makedirs(out, exist_ok=True)

    @property
    def json_path(self) -> str:
        return self.base + ".json"

    @property
    def png_path(self) -> str:
        return self.base + ".png"

    def stamp(self, payload: dict) -> dict:
        """``payload`` with the run's commit, date and device first."""
        return {"commit": self.commit, "date": self.date, "device": self.device, **payload}

    def save(self, payload: dict) -> str:
        """Write the current JSON (stamped); returns its path."""
        write_json(self.json_path, self.stamp(payload))
        return self.json_path

    def merge_previous(self, payload: dict, list_key: str = "results",
                       key=lambda r: (r["op"], r["dtype"])) -> dict:
        """Keep the current file's rows of ``list_key`` whose ``key`` this run did not measure
        (a run of some ops or dtypes), after this run's rows; the kept rows' commits and
        dates go under ``merged_from``."""
        try:
            with open(self.json_path) as f:
                old = json.load(f)  # the current file, before this run rewrites it
        except (OSError, ValueError):
            return payload
        measured = {key(r) for r in payload[list_key]}
        kept = [r for r in old.get(list_key, []) if key(r) not in measured]
        if not kept:
            return payload
        groups = sorted({" ".join(map(str, key(r))) for r in kept})
        # kept rows that the current file had itself merged keep their own sources
        earlier = old.get("merged_from", [])

        def within(g: str, e: str) -> bool:  # e names g's rows, or a coarser group holding them
            return g == e or g.startswith(e + " ")

        own = [g for g in groups
               if not any(within(g, e) for src in earlier for e in src.get("rows_of", []))]
        sources = [{k: old[k] for k in ("commit", "date", "device") if k in old}
                   | {"rows_of": own}] if own else []
        for src in earlier:
            rest = [g for g in groups if any(within(g, e) for e in src.get("rows_of", []))]
            if rest:
                sources.append(src | {"rows_of": rest})
        return {**payload, list_key: payload[list_key] + kept,
                "merged_from": payload.get("merged_from", []) + sources}

    def append(self, rows: list[dict]) -> int:
        """Append ``rows`` (dicts over COLUMNS, without commit, date, gpu and benchmark) to
        history.csv; returns how many."""
        stamp = {"commit": self.commit, "date": self.date, "gpu": self.device,
                 "benchmark": self.benchmark}
        return append_history(self.out, [{**stamp, **r} for r in rows])


def append_history(out: str, rows: list[dict]) -> int:
    """Append full rows (every key in COLUMNS) to ``out``/history.csv, writing its header if
    the file is new."""
    path = os.path.join(out, HISTORY)
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    if not new:
        with open(path, newline="") as f:
            header = tuple(next(csv.reader(f), ()))
        if header != COLUMNS:
            raise ValueError(f"{path} has columns {', '.join(header)}; this version writes "
                             f"{', '.join(COLUMNS)}: add the new ones to its header line")
    for r in rows:
        unknown = set(r) - set(COLUMNS)
        if unknown:
            raise ValueError(f"history row has unknown columns {sorted(unknown)}")
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, lineterminator="\n")
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({k: _cell(k, r.get(k)) for k in COLUMNS})
    return len(rows)


def _cell(column: str, v) -> str:
    """A history cell: empty for None and NaN, ms to 6 significant digits, GB/s to 5, % of copy
    to 0.01."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float):
        if column.endswith("_ms"):
            return f"{v:.6g}"
        return f"{v:.5g}" if column.endswith("gbps") else f"{v:.2f}"
    return str(v)


def print_misses(misses: list[str], count: str = ": {}") -> None:
    """Print how many targets a run missed (``count`` formats the number), then each."""
    print("\ntargets missed" + count.format(len(misses)) + (":" if misses else ""))
    for m in misses:
        print("  " + m)


def peer_rows(results: list[dict], note=None) -> list[dict]:
    """History rows from a sweep's results (one dict per shape and peer: op, dtype, rows,
    cols, peer, ms, gbps, pct_copy, cukern's with its variant): one row per shape, cukern's
    bandwidth and % of copy, the copy's GB/s, and every peer's time. ``note(cukern_result)``
    may add a note."""
    shapes: dict[tuple, dict] = {}
    for r in results:
        shapes.setdefault((r["op"], r["dtype"], r["rows"], r["cols"]), {})[r["peer"]] = r
    rows = []
    for (op, dtype, n, cols), by_peer in shapes.items():
        unknown = set(by_peer) - set(PEERS)
        if unknown:
            raise ValueError(f"peer_rows: no history column for peers {sorted(unknown)}")
        ours, copy = by_peer.get("cukern", {}), by_peer.get("copy", {})
        row = dict(op=op, dtype=dtype, rows=n, cols=cols, variant=ours.get("variant", ""),
                   pct_copy=ours.get("pct_copy"), gbps=ours.get("gbps"),
                   copy_gbps=copy.get("gbps"), note=note(ours) if note and ours else "")
        row.update({f"{p}_ms": r.get("ms") for p, r in by_peer.items()})
        rows.append(row)
    return rows

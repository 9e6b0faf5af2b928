"""The command line's own check, run by ``cukern selftest``: each op command gives the same
file, bit for bit, with ``--chunk-rows 7`` as in one piece, through the real commands."""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

import click
import numpy as np

from .. import reference
from .._io import np_dtype
from .._selftest import rel_error

__all__ = ["pipeline_checks"]

# (label, command line from the files {"x", "y", "dy", "w", "b", "x3"}) for each op command
CASES = (
    ("softmax", lambda f: ["softmax", f["x"]]),
    ("log_softmax", lambda f: ["softmax", f["x"], "--log"]),
    ("softmax_backward", lambda f: ["softmax", f["y"], "--grad", f["dy"]]),
    ("softmax axis 0", lambda f: ["softmax", f["x"], "--axis", "0"]),
    ("layer_norm", lambda f: ["layer-norm", f["x"], "--weight", f["w"], "--bias", f["b"]]),
    ("layer_norm_backward", lambda f: ["layer-norm", f["x"], "--grad", f["dy"],
                                       "--weight", f["w"]]),
    ("rms_norm", lambda f: ["rms-norm", f["x"], "--weight", f["w"]]),
    ("rms_norm_backward", lambda f: ["rms-norm", f["x"], "--grad", f["dy"], "--weight", f["w"]]),
    ("permute", lambda f: ["permute", f["x3"], "--axes", "0,2,1"]),  # streamed: axis 0 stays
)


def _run(app: click.Group, args: list[str]) -> None:
    """Run one command line in this process, its output discarded; errors raise."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        app.main(args=args, prog_name="cukern", standalone_mode=False)


def pipeline_checks(app: click.Group, device, dtypes, seed: int = 0):
    """Yield one selftest row (as :func:`cukern._selftest.run` does) per op command of ``app``
    and dtype; ``device`` is a CUDA device id or ``"cpu"``."""
    rng = np.random.default_rng(seed + 1)
    dev = "cpu" if device == "cpu" else f"gpu:{device}"
    shape = (61, 1500)
    with tempfile.TemporaryDirectory(prefix="cukern-selftest-") as tmp:
        for dtype in dtypes:
            dt = np_dtype(dtype)
            files = {}
            for name, arr in (("x", rng.standard_normal(shape) * 2),
                              ("y", reference.softmax(rng.standard_normal(shape))),
                              ("dy", rng.standard_normal(shape)),
                              ("w", 1 + 0.1 * rng.standard_normal(shape[-1])),
                              ("b", 0.1 * rng.standard_normal(shape[-1])),
                              ("x3", rng.standard_normal((shape[0], 30, 50)))):
                files[name] = str(Path(tmp) / f"{name}-{dtype}.npy")
                np.save(files[name], arr.astype(dt))
            for label, build in CASES:
                row = dict(op=label, variant="cli chunked", dtype=dtype,
                           shape="x".join(map(str, shape)), tol=0.0)
                try:
                    one, many = (str(Path(tmp) / f"{k}.npy") for k in ("one", "many"))
                    base = build(files) + ["--device", dev, "-q", "--overwrite"]
                    _run(app, base + ["-o", one])
                    _run(app, base + ["-o", many, "--chunk-rows", "7"])
                    a, b = np.load(one), np.load(many)
                    same = a.shape == b.shape and a.tobytes() == b.tobytes()
                    row["error"] = 0.0 if same else rel_error(b.view(dt), a.view(dt))
                    row["ok"] = same
                    if not same:
                        row["note"] = "chunked output differs from single-shot"
                except Exception as err:
                    row.update(ok=False, note=f"{type(err).__name__}: {err}")
                yield row

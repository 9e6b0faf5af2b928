"""What ``cukern bench`` times for each op of :mod:`cukern.registry`: its default shapes, the
bytes it must move, its inputs and the calls (cukern's and its peers') timed on them.

A :class:`Case` is one (op, dtype, shape). Bytes moved = (reads + writes) of the registry's
``traffic`` times the array's bytes (parameters and per-row or per-channel statistics aside).
Row-wise ops and permute take 2-D shapes (rows, cols; permute transposes them); the batch-norm
family takes (N, C, ...) shapes in NCHW order, in training mode (x read twice, as the registry
counts it). :func:`plan` needs no GPU: ``cukern bench --dry-run`` prints it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import registry

__all__ = ["Case", "plan", "default_shapes", "make_inputs", "timer"]

# Default row lengths (rows = 2^27 / cols: 256 MB to 1 GB an array, past the H100's L2).
DEFAULT_COLS = {
    "softmax": (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
    "norm": (128, 512, 2048, 8192, 32768),
    "permute": (64, 512, 4096, 32768),
}
# Batch norm: ResNet-50 stages at batch 64 and 256 (NCHW), and a BatchNorm1d input.
DEFAULT_BN_SHAPES = ((64, 256, 56, 56), (256, 1024, 14, 14), (16384, 1024))
ELEMENTS = 2**27  # rows = ELEMENTS // cols unless given


@dataclass(frozen=True)
class Case:
    """One measurement: ``op`` on a ``dtype`` array of ``shape``."""

    op: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype == "bfloat16" else np.dtype(self.dtype).itemsize

    @property
    def array_bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def moved_bytes(self) -> int:
        """Bytes the op must move: the registry's reads + writes of full-size arrays."""
        reads, writes = registry.get(self.op).traffic
        return (reads + writes) * self.array_bytes

    @property
    def rows_cols(self) -> tuple[int, int]:
        """(rows, cols) of the reduction: a row-wise op's rows; batch norm's C channels of
        N*H*W values each."""
        if registry.get(self.op).family == "batch_norm":
            return self.shape[1], math.prod(self.shape) // self.shape[1]
        return math.prod(self.shape[:-1]), self.shape[-1]


def default_shapes(op: str) -> list[tuple[int, ...]]:
    spec = registry.get(op)
    if spec.family == "batch_norm":
        return [tuple(s) for s in DEFAULT_BN_SHAPES]
    return [(max(1, ELEMENTS // c), c) for c in DEFAULT_COLS[spec.family]]


def plan(op: str, dtypes, cols=None, rows: int | None = None, shapes=None) -> list[Case]:
    """The cases ``bench`` times: each dtype x each shape, from ``shapes``, from ``cols`` (with
    ``rows`` rows, default 2^27 / cols), or the op's default shapes. ValueError for shapes
    the op does not take (batch norm needs (N, C, ...), the others 2-D)."""
    spec = registry.get(op)
    bn = spec.family == "batch_norm"
    if shapes is not None and cols is not None:
        raise ValueError("give shapes or cols, not both")
    if bn and (cols is not None or rows is not None):
        raise ValueError(f"{spec.cli_name} takes shapes (N, C, ...), not cols or rows")
    if shapes is None:
        if cols is None:
            shapes = default_shapes(op)
            if rows is not None:
                shapes = [(rows, s[-1]) for s in shapes]
        else:
            shapes = [(rows or max(1, ELEMENTS // c), c) for c in cols]
    out = []
    for shape in shapes:
        shape = tuple(int(n) for n in shape)
        if not shape or min(shape) < 1:
            raise ValueError(f"shape {shape} is empty")
        if bn and len(shape) < 2:
            raise ValueError(f"{spec.cli_name} needs shapes (N, C, ...), got {shape}")
        if not bn and len(shape) != 2:
            raise ValueError(f"{spec.cli_name} is timed on 2-D shapes (rows, cols), got {shape}")
        out.extend(Case(spec.name, dt, shape) for dt in dtypes)
    out.sort(key=lambda c: list(dtypes).index(c.dtype))  # a dtype's shapes together
    return out


# ------------------------------------------------------------------------------------------
# Inputs and timers (GPU)


def make_inputs(case: Case, n_sets: int) -> list[dict]:
    """``n_sets`` independent input sets (dicts of CuPy arrays) for ``case``: random x, and
    what the op's backward needs from its forward."""
    import cupy as cp

    import cukern

    from ._io import np_dtype

    dtype = np_dtype(case.dtype)
    spec = registry.get(case.op)
    cols = case.shape[1] if spec.family == "batch_norm" else case.shape[-1]
    # batch norm keeps 16-bit data's parameters in float32, as PyTorch's modules do
    pdt = np.float32 if spec.family == "batch_norm" and dtype.itemsize < 4 else dtype

    def rand(shape=case.shape, dt=dtype):
        return cp.random.standard_normal(shape, dtype=cp.float32).astype(dt)

    sets = []
    for _ in range(n_sets):
        s = {"x": rand(), "w": cp.random.uniform(0.5, 1.5, cols).astype(pdt),
             "b": cp.random.uniform(-0.5, 0.5, cols).astype(pdt)}
        if spec.family == "batch_norm":
            s["rm"], s["rv"] = cp.zeros(cols, pdt), cp.ones(cols, pdt)
        if spec.is_backward:
            s["dy"] = rand()
            if spec.family == "softmax":  # a backward's y is its forward's output
                s["y"] = registry.get(spec.forward).fn(s["x"])
            elif case.op == "layer_norm_backward":
                _, s["mean"], s["rstd"] = cukern.layer_norm(s["x"], (cols,), s["w"], s["b"],
                                                            return_stats=True)
            elif case.op == "rms_norm_backward":
                _, s["rstd"] = cukern.rms_norm(s["x"], (cols,), s["w"], return_stats=True)
            else:
                _, s["mean"], s["invstd"], _ = cukern.batch_norm(
                    s["x"], None, None, s["w"], s["b"], training=True, return_stats=True)
        if case.op == "permute":
            s["out"] = cp.empty(case.shape[::-1], dtype)
        elif spec.family == "softmax":
            s["out"] = cp.empty_like(s["x"])
        sets.append(s)
    return sets


def cukern_call(case: Case, sets: list[dict]) -> Callable[[int], object]:
    """``call(i)``: cukern's op on input set i (softmax family and permute with ``out=``)."""
    import cukern

    op, cols = case.op, case.shape[-1]
    f = registry.get(op).fn
    calls = {
        "softmax": lambda s: f(s["x"], out=s["out"]),
        "log_softmax": lambda s: f(s["x"], out=s["out"]),
        "softmax_backward": lambda s: f(s["dy"], s["y"], out=s["out"]),
        "log_softmax_backward": lambda s: f(s["dy"], s["y"], out=s["out"]),
        "layer_norm": lambda s: f(s["x"], (cols,), s["w"], s["b"], return_stats=True),
        "rms_norm": lambda s: f(s["x"], (cols,), s["w"], return_stats=True),
        "layer_norm_backward": lambda s: f(dy=s["dy"], x=s["x"], mean=s["mean"],
                                           rstd=s["rstd"], weight=s["w"]),
        "rms_norm_backward": lambda s: f(dy=s["dy"], x=s["x"], rstd=s["rstd"], weight=s["w"]),
        "batch_norm": lambda s: f(s["x"], s["rm"], s["rv"], s["w"], s["b"], training=True),
        "batch_norm_backward": lambda s: f(s["dy"], s["x"], s["mean"], s["invstd"], s["w"]),
        "batch_stats": lambda s: f(s["x"]),
        "permute": lambda s: cukern.permute(s["x"], (1, 0), out=s["out"]),
    }
    call = calls[op]
    return lambda i: call(sets[i])


def timer(case: Case, peer: str, sets: list[dict], time_gpu, time_wall, jax_pipelined):
    """``lambda reps: milliseconds`` for ``peer`` ("cukern", "torch", "jax", "cupyx", "cupy")
    running ``case``'s op on ``sets``, or None when the peer has no such op. ImportError when
    the peer is not installed."""
    n = len(sets)
    op = case.op

    def stream(fn):
        return lambda reps: time_gpu(fn, n, reps)

    if peer == "cukern":
        return stream(cukern_call(case, sets))
    if peer == "torch":
        import torch
        import torch.nn.functional as F

        if torch.cuda.current_stream().cuda_stream != 0:
            return None  # not on the legacy default stream: the events would not bracket it
        t = [{k: torch.from_dlpack(v) for k, v in s.items()} for s in sets]
        outs = [torch.empty_like(s["x"]) for s in t]  # permute: viewed transposed
        aten, cols = torch.ops.aten, case.shape[-1]
        # PyTorch's kernels through their out= overloads, one output per input set as cukern:
        # a fresh output from the caching allocator may still sit in L2
        fns = {
            "softmax": lambda i: aten._softmax.out(t[i]["x"], -1, False, out=outs[i]),
            "log_softmax": lambda i: aten._log_softmax.out(t[i]["x"], -1, False, out=outs[i]),
            "softmax_backward": lambda i: aten._softmax_backward_data.out(
                t[i]["dy"], t[i]["y"], -1, t[i]["y"].dtype, grad_input=outs[i]),
            "log_softmax_backward": lambda i: aten._log_softmax_backward_data.out(
                t[i]["dy"], t[i]["y"], -1, t[i]["y"].dtype, out=outs[i]),
            "layer_norm": lambda i: F.layer_norm(t[i]["x"], (cols,), t[i]["w"], t[i]["b"]),
            "batch_norm": lambda i: F.batch_norm(t[i]["x"], t[i]["rm"], t[i]["rv"], t[i]["w"],
                                                 t[i]["b"], training=True),
            "permute": lambda i: outs[i].view(t[i]["x"].shape[::-1]).copy_(t[i]["x"].t()),
        }
        if hasattr(F, "rms_norm"):
            fns["rms_norm"] = lambda i: F.rms_norm(t[i]["x"], (cols,), t[i]["w"])
        return stream(fns[op]) if op in fns else None
    if peer == "jax" and op in ("softmax", "log_softmax", "permute"):
        import jax
        import jax.numpy as jnp

        jx = [jnp.from_dlpack(s["x"]) for s in sets]
        g = {"softmax": lambda x: jax.nn.softmax(x, axis=-1),
             "log_softmax": lambda x: jax.nn.log_softmax(x, axis=-1),
             "permute": lambda x: x.T}[op]
        f = jax.jit(lambda *a: [g(x) for x in a])  # one dispatch for every input set
        run, sync = jax_pipelined(lambda _: f(*jx))
        return lambda reps: time_wall(lambda: run(0), sync, n, reps)
    if peer == "cupyx" and op in ("softmax", "log_softmax"):
        import cupyx.scipy.special as sp

        g = sp.softmax if op == "softmax" else sp.log_softmax
        return stream(lambda i: g(sets[i]["x"], axis=-1))
    if peer == "cupy" and op == "permute":
        import cupy as cp

        outs = [cp.empty(s["x"].shape[::-1], s["x"].dtype) for s in sets]
        return stream(lambda i: cp.copyto(outs[i], sets[i]["x"].T))  # ascontiguousarray's
    return None

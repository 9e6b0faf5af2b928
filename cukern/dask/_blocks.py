"""What the Dask ops share: argument checks, the rechunking rule of the row-wise ops and its
warning, per-block dispatch (a CuPy block runs the cukern op, a NumPy block the float64
reference), tuple-valued blocks and their outputs, and dtype casts that work for bfloat16 on
both kinds of block."""

from __future__ import annotations

import math
import sys
import uuid
import warnings

import dask.array as da
import numpy as np
from dask.highlevelgraph import HighLevelGraph

from .. import runner

__all__ = ["PerformanceWarning", "as_dask", "param", "whole", "align", "check_same",
           "is_cupy", "like", "pick", "output", "per_block", "from_blocks", "cast",
           "to_float", "meta", "stat_dtype", "float_dtype", "fresh_name", "stat_output",
           "tree", "from_tasks", "with_params", "take_params"]


class PerformanceWarning(UserWarning):
    """A Dask op had to rechunk its input (the reduced axis split over several chunks):
    the message says what it cost."""


def is_cupy(a) -> bool:
    return type(a).__module__.split(".", 1)[0] == "cupy"


def _cupy():
    import cupy

    return cupy


def like(a, ref):
    """``a`` (NumPy or CuPy, or None) as an array of ``ref``'s kind: NumPy parameters work with
    CuPy blocks and the reverse."""
    if a is None:
        return None
    if is_cupy(ref):
        return a if is_cupy(a) else _cupy().asarray(a)
    return a.get() if is_cupy(a) else np.asarray(a)


def meta(x: da.Array, dtype, ndim: int | None = None):
    """An empty array of ``x``'s block kind with ``dtype`` and ``ndim`` dimensions (made
    afresh: CuPy cannot ``astype`` to bfloat16, which dask's ``meta_from_array`` would do)."""
    shape = (0,) * (x.ndim if ndim is None else ndim)
    return _cupy().empty(shape, dtype) if is_cupy(x._meta) else np.empty(shape, dtype)


def stat_dtype(dtype) -> np.dtype:
    """The statistics dtype of the ops: float64 for float64 data, else float32."""
    return np.dtype(np.float64 if np.dtype(dtype) == np.float64 else np.float32)


def float_dtype(fn: str, name: str, x) -> str:
    """cukern's name of ``x``'s dtype (TypeError unless float16, bfloat16, float32, float64)."""
    return runner.dtype_name(fn, name, x)


def as_dask(fn: str, name: str, a) -> da.Array:
    """A full-size argument: it must be a Dask array (TypeError otherwise)."""
    if not isinstance(a, da.Array):
        raise TypeError(f"{fn}: {name} must be a dask.array.Array, got {type(a).__name__} "
                        f"(wrap it with dask.array.from_array, or call cukern.{fn} directly)")
    return a


def param(fn: str, name: str, a, chunks):
    """A small argument (weight, statistics): NumPy, CuPy or Dask. A NumPy or CuPy array that
    ``chunks`` leaves whole comes back as it is, for :func:`with_params` to put inside every
    block's task; otherwise a Dask array with ``chunks`` (rechunked if it is a Dask array with
    others). None passes."""
    if a is None:
        return None
    if isinstance(a, da.Array):
        return a if a.chunks == tuple(chunks) else a.rechunk(chunks)
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{fn}: {name} must be an array (NumPy, CuPy or Dask), got "
                        f"{type(a).__name__}")
    if all(len(c) == 1 for c in chunks):
        return a
    # a fresh name: Dask would otherwise hash the array, a device-to-host copy of a CuPy one
    name = fresh_name(f"param-{name}")
    if tuple(a.shape) != tuple(sum(c) for c in chunks):  # the op reports the shape
        return da.from_array(a, chunks=a.shape, asarray=False, name=name)
    return da.from_array(a, chunks=chunks, asarray=False, name=name)


def with_params(args: list, params: dict, inds: dict) -> dict:
    """Small arguments of a blockwise call (``params``: name -> array or None; ``inds``: name
    -> blockwise index): Dask arrays are appended to ``args`` as (array, index) pairs, NumPy
    and CuPy arrays ride inside every block's task. Returns blockwise's keyword arguments
    that carry them (for :func:`take_params`). A task of its own, on one worker, would make
    that worker a candidate for every block's task: the scheduler then weighs moving a whole
    block there against its queues' lengths, and on GPUs it moved most blocks."""
    names, literals = [], {}
    for k, p in params.items():
        if isinstance(p, da.Array):
            args += [p, inds[k]]
            names.append(k)
        elif p is not None:
            literals[k] = p
    return {"dask_params": tuple(names), "literals": literals}


def take_params(rest: tuple, dask_params: tuple, literals: dict, ref) -> tuple[tuple, dict]:
    """In a block function: (the positional blocks before the parameters, name -> parameter
    as ``ref``'s kind) from what :func:`with_params` arranged."""
    k = len(rest) - len(dask_params)
    got = dict(zip(dask_params, rest[k:]))
    got.update(literals)
    return rest[:k], {n: like(v, ref) for n, v in got.items()}


def fresh_name(what: str) -> str:
    """A unique graph-layer name (no hashing of arguments: Dask's tokenize of a CuPy array
    copies it to the host, and of a task's arguments costs more than the task)."""
    return f"cukern-{what}-{uuid.uuid4().hex}"


def _chunk_bytes(chunks, itemsize: int) -> int:
    return math.prod(max(c) if c else 0 for c in chunks) * itemsize


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # pragma: no cover


def _caller() -> int:
    """The ``stacklevel`` of the first frame outside cukern.dask (where a warning is about),
    for a function of this package that calls ``warnings.warn``."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("cukern.dask"):
        frame, level = frame.f_back, level + 1
    return level


def whole(fn: str, name: str, x: da.Array, axes) -> da.Array:
    """``x`` with each of ``axes`` in one chunk: rechunked along those axes only, and only when
    one is split, with a :class:`PerformanceWarning` that says what it cost."""
    split = [a for a in axes if x.numblocks[a] > 1]
    if not split:
        return x
    y = x.rechunk({a: -1 for a in split})
    before = _chunk_bytes(x.chunks, x.dtype.itemsize)
    after = _chunk_bytes(y.chunks, y.dtype.itemsize)
    where = ", ".join(f"axis {a} ({x.numblocks[a]} chunks)" for a in split)
    warnings.warn(
        f"{fn}: {name} is split along {where}, which the op needs whole in each chunk; "
        f"rechunked along {'it' if len(split) == 1 else 'them'} only: {x.npartitions} -> "
        f"{y.npartitions} chunks, the largest {_size(before)} -> {_size(after)} (a copy of "
        f"{name} through the scheduler; chunk it with "
        f"{{{', '.join(f'{a}: -1' for a in split)}}} to avoid it)",
        PerformanceWarning, stacklevel=_caller())
    return y


def align(fn: str, name: str, a: da.Array, ref: da.Array, ref_name: str) -> da.Array:
    """``a`` (of ``ref``'s shape) chunked as ``ref``; a rechunk warns like :func:`whole`."""
    if a.chunks == ref.chunks:
        return a
    warnings.warn(f"{fn}: {name} is chunked unlike {ref_name}; rechunked to {ref_name}'s "
                  f"{ref.npartitions} chunks (a copy of {name} through the scheduler)",
                  PerformanceWarning, stacklevel=_caller())
    return a.rechunk(ref.chunks)


def check_same(fn: str, ref_name: str, ref: da.Array, name: str, a: da.Array) -> None:
    """``a`` must match ``ref`` in shape and dtype (a block's device is the worker's)."""
    runner.check_shape_dtype(fn, ref_name, ref, name, a)


# ---------------------------------------------------------------------------------------------
# Blocks whose value is a tuple of arrays (one op call, several outputs), and their outputs.

def pick(block, i: int):
    """Output ``i`` of a tuple-valued block."""
    return block[i]


def from_tasks(name: str, dsk: dict, deps, chunks, dtype, like: da.Array,
               ndim: int) -> da.Array:
    """A Dask array of the tasks ``dsk`` (keys ``(name, *block index)``) over ``deps``: a
    list of Dask collections, or a ``(graph, layer name)`` pair from :func:`tree`."""
    if isinstance(deps, list):
        graph = HighLevelGraph.from_collections(name, dsk, dependencies=deps)
    else:
        graph = HighLevelGraph.merge(HighLevelGraph({name: dsk}, {name: {deps[1]}}), deps[0])
    return da.Array(graph, name, chunks=chunks, dtype=dtype, meta=meta(like, dtype, ndim))


def output(packed: da.Array, i: int, dtype) -> da.Array:
    """Output ``i`` of the tuple-valued array ``packed`` as a Dask array of ``dtype`` (one
    plain task a block: no tokenizing, no meta inference)."""
    name = f"cukern-out{i}-{packed.name}"
    dsk = {(name, *idx): (pick, (packed.name, *idx), i) for idx in np.ndindex(*packed.numblocks)}
    return from_tasks(name, dsk, [packed], packed.chunks, dtype, packed, packed.ndim)


def stat_output(packed: da.Array, i: int, dtype, lead: int) -> da.Array:
    """Output ``i`` of ``packed``, a per-row statistic of shape ``packed.shape[:lead]`` (the
    trailing axes of ``packed`` are one block each)."""
    name = f"cukern-out{i}-{packed.name}"
    tail = (0,) * (packed.ndim - lead)
    dsk = {(name, *idx): (pick, (packed.name, *idx, *tail), i)
           for idx in np.ndindex(*packed.numblocks[:lead])}
    return from_tasks(name, dsk, [packed], packed.chunks[:lead], dtype, packed, lead)


def tree(name: str, groups: list, combine, extra: tuple, split_every: int, dep: da.Array,
         roots: list | None = None, leaf=None):
    """Fixed-order reduction trees, one over each list of keys in ``groups`` (all of one
    length): each node calls ``combine(list of up to split_every values, level, *extra)``.
    One layer a level (``{name}-sum-{level}``); with ``roots``, group i's root node gets key
    ``roots[i]`` (all in the layer ``roots[0][0]``). ``leaf``: a task a key first
    (``leaf(value)``, layer ``{name}-leaf``) that keeps what the tree needs of a large block
    on the block's worker, so that only that travels to the nodes. Returns ``(graph, root
    keys)``."""
    layers, deps, level, below = {}, {}, 0, dep.name
    groups = [list(g) for g in groups]
    if leaf is not None:
        lname = f"{name}-leaf"
        layers[lname] = {(lname, i, j): (leaf, key) for i, keys in enumerate(groups)
                         for j, key in enumerate(keys)}
        deps[lname] = {below}
        groups = [[(lname, i, j) for j in range(len(keys))] for i, keys in enumerate(groups)]
        below = lname
    while level == 0 or len(groups[0]) > 1:
        last = len(groups[0]) <= split_every and roots is not None
        lname = roots[0][0] if last else f"{name}-sum-{level}"
        layer, nxt = {}, []
        for i, keys in enumerate(groups):
            nodes = []
            for j in range(0, len(keys), split_every):
                key = roots[i] if last else (lname, i, j // split_every)
                layer[key] = (combine, keys[j:j + split_every], level, *extra)
                nodes.append(key)
            nxt.append(nodes)
        layers[lname], deps[lname] = layer, {below}
        groups, level, below = nxt, level + 1, lname
        if last:
            break
    graph = HighLevelGraph.merge(HighLevelGraph(layers, deps), dep.__dask_graph__())
    return graph, [g[0] for g in groups]


def per_block(packed: da.Array, i: int, dtype, lengths: list[int]) -> da.Array:
    """A 1-D array of output ``i`` of every block of ``packed`` concatenated in the C order of
    the blocks (``lengths``: each block's length)."""
    name = f"cukern-blocks-{i}-{packed.name}"
    dsk = {(name, j): (pick, (packed.name, *idx), i)
           for j, idx in enumerate(np.ndindex(*packed.numblocks))}
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=[packed])
    return da.Array(graph, name, chunks=(tuple(lengths),), dtype=dtype,
                    meta=meta(packed, dtype, 1))


def from_blocks(flat: da.Array, like_x: da.Array) -> da.Array:
    """The chunks of a 1-D array made by :func:`per_block` placed back on ``like_x``'s blocks:
    an array that claims ``like_x``'s chunks and whose block at each index is ``flat``'s chunk
    of that block (only for passing to a blockwise call beside ``like_x``; never computed
    whole)."""
    name = f"cukern-unflat-{flat.name}"
    dsk = {(name, *idx): (_same, (flat.name, j))
           for j, idx in enumerate(np.ndindex(*like_x.numblocks))}
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=[flat])
    return da.Array(graph, name, chunks=like_x.chunks, dtype=flat.dtype, meta=flat._meta)


def _same(block):
    return block


# ---------------------------------------------------------------------------------------------
# Casts. CuPy has no bfloat16 arithmetic: its bits are moved by hand (round to nearest even).

def _is_bf16(dtype) -> bool:
    return runner.DTYPE_NAMES.get(np.dtype(dtype)) == "bfloat16"


def to_float(a, dtype):
    """``a`` converted to the float ``dtype`` (float32 or float64), on its own kind."""
    if is_cupy(a) and _is_bf16(a.dtype):
        cp = _cupy()
        f = (a.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
        return f.astype(dtype, copy=False)
    return a.astype(dtype, copy=False)


def cast(a, dtype):
    """``a`` (float) converted to ``dtype``, bfloat16 included, on its own kind."""
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a
    if is_cupy(a) and _is_bf16(a.dtype):
        a = to_float(a, np.float32)
    if is_cupy(a) and _is_bf16(dtype):
        cp = _cupy()
        u = cp.ascontiguousarray(a.astype(cp.float32)).view(cp.uint32)
        r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
        r = cp.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, r)  # NaN stays NaN
        return r.astype(cp.uint16).view(dtype)
    return a.astype(dtype)

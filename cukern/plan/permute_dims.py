"""The permute family's description of an op (``plan.permute``'s first step): NumPy's axes
rules, the dtypes the kernels move, and :func:`simplify`, which turns a permutation of an
array with any strides into merged dims of (size, input stride, output stride) in the output's
memory order. Pure functions; nothing here touches a GPU."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = ["Dim", "Simplified", "MAX_DIMS", "WORDS", "check_dtype", "normalize_axes",
           "c_strides", "output_dims", "simplify", "merge", "fold_inner", "vector_width"]

MAX_DIMS = 8  # kernels/permute_parts.cuh: perm::kMaxDims; the API's rank limit
WORDS = (1, 2, 4, 8, 16)  # bytes a kernel word or element moves


class Dim(NamedTuple):
    """One dim of a permutation: its size and strides (elements) in the input and output."""

    size: int
    in_stride: int
    out_stride: int


class Simplified(NamedTuple):
    """A permutation as merged dims in the output's memory order (outermost first), and the
    offsets (elements) of the first element visited from each array's pointer (non-zero where
    a dim was flipped)."""

    dims: tuple[Dim, ...]
    in_offset: int = 0
    out_offset: int = 0

    @property
    def numel(self) -> int:
        return math.prod(d.size for d in self.dims)


def normalize_axes(axes, ndim: int, fn: str = "permute") -> tuple[int, ...]:
    """``axes`` as a permutation of ``range(ndim)`` by NumPy's rules (None: reversed; negative
    axes count from the end). TypeError for axes that are not a sequence of ints, ValueError
    for a wrong length, an axis out of range or a repeated axis."""
    if axes is None:
        return tuple(range(ndim - 1, -1, -1))
    if isinstance(axes, (str, bytes)) or not hasattr(axes, "__len__"):
        raise TypeError(f"{fn}: axes must be a sequence of ints (a permutation of "
                        f"range({ndim})) or None, got {type(axes).__name__} {axes!r}")
    items = list(axes)
    for a in items:
        if isinstance(a, (bool, np.bool_)) or not isinstance(a, (int, np.integer)):
            raise TypeError(f"{fn}: axes must be ints, got {type(a).__name__} {a!r} in "
                            f"axes={tuple(items)!r}")
    if len(items) != ndim:
        raise ValueError(f"{fn}: axes {tuple(items)} has {len(items)} entries, expected {ndim} "
                         f"(a permutation of the {ndim} axes of x)")
    out = []
    for a in items:
        a = int(a)
        if not -ndim <= a < ndim:
            raise ValueError(f"{fn}: axis {a} in axes {tuple(items)} is out of range for an "
                             f"array of {ndim} dimensions")
        out.append(a % ndim)
    if len(set(out)) != ndim:
        dup = next(a for a in out if out.count(a) > 1)
        raise ValueError(f"{fn}: axes {tuple(items)} repeats axis {dup}; expected a "
                         f"permutation of range({ndim})")
    return tuple(out)


def check_dtype(fn: str, arg: str, dtype) -> np.dtype:
    """``dtype`` if the kernels move it (elements of 1, 2, 4, 8 or 16 bytes of plain data:
    bool, integers, floats, bfloat16, complex, datetimes), else TypeError naming ``arg``."""
    dt = np.dtype(dtype)
    if dt.kind in "OSU" or dt.fields is not None or dt.subdtype is not None \
            or dt.itemsize not in WORDS:
        raise TypeError(f"{fn}: {arg} has dtype {dt} ({dt.itemsize}-byte elements); expected a "
                        f"dtype of 1, 2, 4, 8 or 16 bytes (bool, integers, floats, complex)")
    return dt


def c_strides(shape) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape``."""
    strides, step = [], 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def output_dims(shape, in_strides, axes, out_strides=None) -> tuple[tuple[int, ...],
                                                                    tuple[Dim, ...]]:
    """(the output's shape, its dims in output order) of ``transpose(x, axes)`` for x of
    ``shape`` and ``in_strides`` (elements), written with ``out_strides`` (default C order)."""
    out_shape = tuple(int(shape[a]) for a in axes)
    outs = c_strides(out_shape) if out_strides is None else tuple(int(s) for s in out_strides)
    dims = tuple(Dim(int(shape[a]), int(in_strides[a]), s) for a, s in zip(axes, outs))
    return out_shape, dims


def merge(dims) -> tuple[Dim, ...]:
    """Merge adjacent dims (outermost first) that stay adjacent and in order on both sides:
    dim j and j + 1 merge where each stride of j is the stride of j + 1 times its size."""
    merged: list[Dim] = []
    for d in dims:
        if merged:
            p = merged[-1]
            if p.in_stride == d.in_stride * d.size and p.out_stride == d.out_stride * d.size:
                merged[-1] = Dim(p.size * d.size, d.in_stride, d.out_stride)
                continue
        merged.append(d)
    return tuple(merged)


def simplify(shape, in_strides, out_strides) -> Simplified:
    """The permutation of dims of ``shape`` (in output order) with ``in_strides`` and
    ``out_strides`` (elements, any signs) as :class:`Simplified` dims: size-1 dims dropped,
    dims with negative output strides flipped, sorted by output stride (the output's memory
    order; C order: output order), adjacent dims merged (:func:`merge`). An empty array is one
    dim of size 0; a single element one dim of size 1. ValueError for an output stride of 0 on
    a dim of size > 1 (overlapping output elements)."""
    shape = tuple(int(n) for n in shape)
    if not len(shape) == len(in_strides) == len(out_strides):
        raise ValueError(f"simplify: shape {shape}, input strides {tuple(in_strides)} and "
                         f"output strides {tuple(out_strides)} differ in length")
    if any(n < 0 for n in shape):
        raise ValueError(f"simplify: negative size in shape {shape}")
    if 0 in shape:
        return Simplified((Dim(0, 1, 1),))
    in_off = out_off = 0
    dims = []
    for n, a, b in zip(shape, in_strides, out_strides):
        a, b = int(a), int(b)
        if n == 1:
            continue
        if b == 0:
            raise ValueError(f"simplify: an output dim of size {n} has stride 0 (overlapping "
                             f"output elements)")
        if b < 0:  # walk it forwards on the output: the same pairs of elements
            in_off += (n - 1) * a
            out_off += (n - 1) * b
            a, b = -a, -b
        dims.append(Dim(n, a, b))
    dims.sort(key=lambda d: (-d.out_stride, -abs(d.in_stride)))
    merged = merge(dims)
    return Simplified(merged or (Dim(1, 1, 1),), in_off, out_off)


def fold_inner(dims, elem: int, in_align: int, out_align: int, in_base: int,
               out_base: int) -> tuple[tuple[Dim, ...], int, int, int]:
    """(dims, element bytes, in_base, out_base) after folding an innermost dim contiguous on
    both sides into the element, where there are other dims, its bytes are a power of two up
    to 16, and every other stride, both offsets and both pointers (``in_align``,
    ``out_align``: bytes) allow the wider element; unchanged otherwise."""
    dims = tuple(dims)
    while len(dims) >= 2:
        d = dims[-1]
        n, nbytes = d.size, d.size * elem
        if not (d.in_stride == 1 and d.out_stride == 1 and nbytes <= 16
                and nbytes & (nbytes - 1) == 0 and in_align % nbytes == 0
                and out_align % nbytes == 0 and in_base % n == 0 and out_base % n == 0
                and all(o.in_stride % n == 0 and o.out_stride % n == 0 for o in dims[:-1])):
            break
        dims = merge(Dim(o.size, o.in_stride // n, o.out_stride // n) for o in dims[:-1])
        elem, in_base, out_base = nbytes, in_base // n, out_base // n
    return dims, elem, in_base, out_base


def vector_width(elem: int, align: int, base: int, strides) -> int:
    """Elements a vector access moves: the largest power of two up to 16 bytes dividing the
    pointer's alignment (``align`` bytes) with the first element's offset ``base`` and every
    stride in ``strides`` (elements)."""
    v = 16 // elem
    while v > 1 and (align % (v * elem) or base % v or any(s % v for s in strides)):
        v //= 2
    return max(v, 1)

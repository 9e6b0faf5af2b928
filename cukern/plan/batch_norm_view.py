"""Batch norm's view of a tensor (``plan.batch_norm``'s first step): (A, C, B) = (outer,
channels, inner) in memory order from its shape and strides (:func:`channel_view`), the
layout that follows (planes: B > 1, NCHW; columns: B == 1, NHWC and (N, C)), the pack a
vector access moves and the packs a thread keeps in flight, as the kernels'
(``kernels/batch_norm.cuh``) constants have them. Pure functions."""

from __future__ import annotations

import math
from typing import NamedTuple

from .common import ITEMSIZE

__all__ = ["ChannelView", "channel_view", "layout_strides", "fast_div", "pack_for",
           "flat_pack_for", "spans", "max_pack", "unroll_for", "unroll_cols",
           "elementwise_unroll", "unroll_reduce", "plane_packs", "INT32_MAX", "PLANES",
           "COLUMNS"]

INT32_MAX = 2**31 - 1
PLANES, COLUMNS = "planes", "columns"


class ChannelView(NamedTuple):
    """A dense tensor as (A, C, B) = (outer, channels, inner) in memory order."""

    outer: int
    channels: int
    inner: int

    @property
    def layout(self) -> str:
        return PLANES if self.inner > 1 else COLUMNS

    @property
    def numel(self) -> int:
        return self.outer * self.channels * self.inner

    @property
    def per_channel(self) -> int:
        """Values a channel's statistics are over (A * B)."""
        return self.outer * self.inner


def channel_view(shape, strides, axis: int) -> ChannelView | None:
    """(A, C, B) of an array of ``shape`` and ``strides`` (in elements) with channels on
    ``axis``, or None when it is not dense (a permutation of a C-contiguous array: no gaps, no
    overlaps), which the op then copies. Non-channel axes adjacent in memory merge; size-1 axes
    do not count. A single channel is read as columns (A = numel, B = 1)."""
    shape, strides = tuple(int(n) for n in shape), tuple(int(s) for s in strides)
    numel = math.prod(shape)
    c = shape[axis]
    if numel == 0:
        return ChannelView(numel // c if c else 0, c, 1)
    dims = sorted((abs(s), n) for n, s in zip(shape, strides) if n > 1)
    if any(s < 0 for n, s in zip(shape, strides) if n > 1):
        return None
    expected = 1
    for s, n in dims:
        if s != expected:
            return None
        expected *= n
    if c == 1:
        return ChannelView(numel, 1, 1)
    inner = strides[axis]
    return ChannelView(numel // (c * inner), c, inner)


def layout_strides(shape, axis: int, layout: str) -> tuple[int, ...]:
    """Element strides of a dense array of ``shape`` in ``layout``: "NCHW" (C order) or "NHWC"
    (channels last in memory, the other axes in order: PyTorch's channels_last)."""
    nd = len(shape)
    axis = axis % nd
    if layout.upper() == "NCHW":
        order = list(range(nd))
    elif layout.upper() == "NHWC":
        order = [i for i in range(nd) if i != axis] + [axis]
    else:
        raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")
    strides = [0] * nd
    step = 1
    for i in reversed(order):
        strides[i] = step
        step *= int(shape[i])
    return tuple(strides)


def fast_div(d: int) -> tuple[int, int]:
    """(m, s) of the kernels' FastDiv for divisor ``d`` >= 1: for 0 <= n < 2^31,
    n // d == (((n * m) >> 32) + n) >> s."""
    if d < 1 or d > INT32_MAX:
        raise ValueError(f"fast_div: divisor {d} out of range")
    s = (d - 1).bit_length()  # ceil(log2 d)
    m = (2**32 * (2**s - d)) // d + 1
    return m, s


def unroll_for(pack_bytes: int) -> int:
    """Packs a thread of an elementwise pass keeps in flight (the kernels' bn::unroll_for):
    about 32 bytes, at most 8."""
    return 1 if pack_bytes >= 32 else min(8, 32 // pack_bytes)


def unroll_cols(step_bytes: int) -> int:
    """Packs a thread of a columns elementwise pass keeps in flight (bn::unroll_cols), given
    the bytes one pack index reads (PACK * itemsize per tensor read: x, and the addend or dy):
    about 128 bytes, at most 8."""
    return 1 if step_bytes >= 128 else min(8, 128 // step_bytes)


def elementwise_unroll(kind: str, dtype: str, pack: int, cols: bool, addend: bool) -> int:
    """Packs in flight a thread of the apply / dx pass (the kernels' U)."""
    if not cols:
        return unroll_for(pack * ITEMSIZE[dtype])
    streams = 2 if kind == "dx" or addend else 1
    return unroll_cols(streams * pack * ITEMSIZE[dtype])


def unroll_reduce(pack_bytes: int) -> int:
    """Packs a thread of a reduction keeps in flight (bn::unroll_reduce): about 64 bytes, at
    most 16."""
    return 1 if pack_bytes >= 64 else min(16, 64 // pack_bytes)


def max_pack(dtype: str) -> int:
    return 16 // ITEMSIZE[dtype]


def pack_for(dtype: str, view: ChannelView, align_elems: int = 16) -> int:
    """Elements a vector access moves: the widest power of two <= 16 bytes that divides the
    run a pack must stay in (B for planes, C for columns) and the arrays' alignment."""
    run = view.inner if view.layout == PLANES else view.channels
    p = max_pack(dtype)
    while p > 1 and (run % p or align_elems % p):
        p //= 2
    return p


def flat_pack_for(dtype: str, view: ChannelView, align_elems: int = 16,
                  min_bytes: int = 8) -> int:
    """The plan's pack: :func:`pack_for` where it moves at least ``min_bytes`` (the tuning's
    bn_min_pack_bytes) or the layout is columns; else, for planes (7x7), the widest pack that
    divides C * B (no pack spans two samples) and the alignment, with B >= the pack (a pack
    spans at most two planes) and C * B < 2^31 (the elementwise kernels' element index within
    a sample), where it reaches ``min_bytes`` (the SPAN kernels: :func:`spans`). Reductions
    then read W = :func:`plane_packs` packs a plane and skip the neighbouring planes'
    elements."""
    pack = pack_for(dtype, view, align_elems)
    a, c, b = view
    item = ITEMSIZE[dtype]
    if view.layout != PLANES or c * b > INT32_MAX or pack * item >= min_bytes:
        return pack
    p = max_pack(dtype)
    while p > pack and ((c * b) % p or align_elems % p or b < p):
        p //= 2
    return p if p * item >= min_bytes else pack


def spans(view: ChannelView, pack: int) -> bool:
    """Whether a planes pack may span two planes (B not a multiple of the pack): the SPAN
    template argument of the planes kernels."""
    return view.layout == PLANES and view.inner % pack != 0


def plane_packs(b: int, pack: int) -> int:
    """Packs a planes reduction reads per plane of ``b`` elements (bn::plane_bits): B / PACK
    where PACK divides B, else enough for a plane starting anywhere in its first pack."""
    return b // pack if b % pack == 0 else (b + 2 * pack - 2) // pack

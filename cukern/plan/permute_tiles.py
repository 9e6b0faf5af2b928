"""The tile kernel's shape (``kernels/permute.cuh``: ``permute_tile``): extents, flat sides,
vectors and pitch of a tile (:func:`tile_shape`), and the tuning's rules on how its tiles run:
phase 1 by cp.async (:func:`async_copy`) and the order of tiles (:func:`tile_panel`). Pure
functions; the planner (:mod:`cukern.plan.permute`) calls them and re-exports them."""

from __future__ import annotations

from typing import NamedTuple

from .permute_dims import Dim, vector_width
from .permute_phase2 import skew_run
from .policy import Tuning

__all__ = ["TileShape", "tile_shape", "async_copy", "tile_panel", "p2ceil", "p2floor"]


def p2ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def p2floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _default_tile(elem: int, tuning: Tuning) -> tuple[int, int]:
    for e, ti, to in tuning.perm_tiles:
        if e == elem:
            return ti, to
    raise ValueError(f"plan: no default tile for {elem}-byte elements in perm_tiles")


class TileShape(NamedTuple):
    """The tile kernel's shape: extents along i and o, whether each side is a flat run, the
    vector widths (elements), the shared-memory row pitch (elements) and phase 2's lane
    grouping (log2 of adjacent o-words)."""

    ti: int
    to: int
    flat_in: bool
    flat_out: bool
    vec_in: int
    vec_out: int
    pitch: int
    group: int


def tile_shape(i: Dim, o: Dim, batch, elem: int, tuning: Tuning, in_align: int = 16,
               out_align: int = 16, in_base: int = 0, out_base: int = 0) -> TileShape:
    """The tile for a transpose of dim ``i`` (input stride 1) by dim ``o`` (output stride 1)
    beside ``batch`` dims, for ``elem``-byte elements.

    Default extents come from the tuning's perm_tiles (16 KB, rows of >= 128 bytes). A side is
    flat, its dim held whole, where its rows join into one run (input: o's input stride is si;
    output: i's output stride is so), the dim has at most perm_flat_max_bytes, and its rows
    allow narrower vectors than the run (HW = 49, 196: o_in = 49 is odd), are under 32 bytes
    (C = 3) or are 4 (mod 8) elements of a size in perm_flat_rows4 (float32 HW = 196, whose row
    tiles leave a tile of 4); otherwise rows, whose phase-2 gathers meet fewer bank conflicts;
    an output run the skewed columns take (:func:`skew_run`), or of an element size in
    perm_flat_split, is flat too where its rows are not whole 32-byte sectors. Both sides flat
    only where the whole (i, o) plane fits perm_tile_max_bytes. Beside a flat side the other
    extent fills perm_tile_bytes (at least 16 bytes, 32 or 64 beside a skewed-column run, at
    most its dim and perm_tile_max_extent); a short row side leaves the other grown up to
    perm_tile_bytes.
    Vectors: the widest the pointer, offsets and strides allow, at most the tile's row. Pitch:
    4 (mod 8) elements, ti + 4 (phase 2's lane groups read distinct banks), si for a flat
    input. Group: o-words of 32 bytes together."""
    si, so = i.size, o.size
    ti0, to0 = _default_tile(elem, tuning)
    bin_ = [b.in_stride for b in batch]
    bout = [b.out_stride for b in batch]
    vi_row = vector_width(elem, in_align, in_base, bin_ + [o.in_stride])
    vi_flat = vector_width(elem, in_align, in_base, bin_)
    vo_row = vector_width(elem, out_align, out_base, bout + [i.out_stride])
    vo_flat = vector_width(elem, out_align, out_base, bout)
    cap = tuning.perm_tile_max_bytes
    short = tuning.perm_flat_max_bytes
    fin = (o.in_stride == si and si * elem <= short
           and (vi_row < vi_flat or si * elem < 32
                or (elem in tuning.perm_flat_rows4 and si % 8 == 4)))
    # a long flat output run only where rows would store words under 8 bytes (2-byte and
    # wider elements): its phase 2 gathers element by element; or where rows would split
    # 32-byte sectors between tiles and the skewed columns (perm_skew_regs) or the gather
    # (perm_flat_split) take the run
    run_out = i.out_stride == so and so * elem <= short
    long_ok = so * elem <= tuning.perm_flat_out_max_bytes or (elem > 1 and vo_row * elem < 8)
    fout = run_out and long_ok and (vo_row < vo_flat or so * elem < 32)
    skew = run_out and not fin and skew_run(so, elem, vi_row, vo_flat, tuning) >= 0
    if (run_out and not fin and (so * elem) % 32
            and (skew or elem in tuning.perm_flat_split)):
        fout = True
    if fin and fout and si * so * elem > cap:
        fin, fout = (True, False) if si <= so else (False, True)
    ti = si if fin else min(ti0, p2ceil(si))
    to = so if fout else min(to0, p2ceil(so))
    area, ext, lo = tuning.perm_tile_bytes, tuning.perm_tile_max_extent, 16 // elem
    if fin and not fout:  # a whole i: o as long as the area allows
        to = min(max(p2floor(area // (si * elem)), lo), p2ceil(so), ext)
    elif fout and not fin:  # a whole o: i as long as the area allows (skewed columns: tile
        # rows of whole 32-byte sectors, as phase 1 loads them, and 16 columns where they fit:
        # a warp's loads on distinct banks)
        lo_i = lo if not skew else 64 // elem if 64 * so <= cap else 32 // elem
        ti = min(max(p2floor(area // (so * elem)), lo_i), p2ceil(si), ext)
    elif not fin and not fout:
        if ti < ti0:  # a short i: grow o
            to = max(to, min(p2floor(area // (ti * elem)), p2ceil(so), ext))
        if to < to0:  # a short o: grow i
            ti = max(ti, min(p2floor(area // (to * elem)), p2ceil(si), ext))
    vi = vi_flat if fin else vi_row
    vo = vo_flat if fout else vo_row
    # a word stays inside a tile row (row sides) or the run starts on a word (flat sides: the
    # other extent is a multiple of the vector, or there is one tile along it)
    if not fin:
        vi = min(vi, ti)
    elif not fout:
        vi = min(vi, to)
    if not fout:
        vo = min(vo, to)
    elif not fin:
        vo = min(vo, ti)
    pitch = si if fin else ti + (4 - ti) % 8
    group = 0
    if not fout:
        g = min(max(1, 32 // (vo * elem)), to // vo)
        group = g.bit_length() - 1
    return TileShape(ti, to, fin, fout, vi, vo, pitch, group)


def async_copy(shape: TileShape, elem: int, smem: int, tuning: Tuning) -> bool:
    """Whether the tile's phase 1 copies by cp.async (``permute_tile<..., ASYNC = true>``):
    ``elem`` in the tuning's perm_async_copy, a flat side (C = 3, 7x7 and 14x14 planes: tiles
    whose register-held phase 1 leaves few blocks resident) and a tile of at most
    perm_async_max_bytes of shared memory."""
    return (elem in tuning.perm_async_copy and (shape.flat_in or shape.flat_out)
            and smem <= tuning.perm_async_max_bytes)


def tile_panel(nti: int, nto: int, tuning: Tuning) -> int:
    """Tiles along i a panel (0: all of them): the largest power of two up to the tuning's
    perm_panel_tiles that divides nti, where that leaves more than one panel and o has more
    than one tile. Blocks then run a panel's tiles along i, then along o: an output row's
    neighbouring tiles are stored close in time."""
    cap = tuning.perm_panel_tiles
    if cap < 1 or nto < 2 or nti <= cap:
        return 0
    h = 1 << (cap.bit_length() - 1)
    while nti % h:
        h //= 2
    return h

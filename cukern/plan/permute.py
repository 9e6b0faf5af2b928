"""Planning the permute family (``kernels/permute.cuh``): pure functions from an array's shape,
its strides on both sides, element size, pointer alignment and device to a printable
:class:`PermutePlan`. Nothing here touches a GPU.

1. :func:`simplify` (in :mod:`cukern.plan.permute_dims`): the op as dims of (size, input
   stride, output stride) in elements, in the output's memory order (outermost first). Size-1
   dims are dropped, dims the output walks backwards are flipped (both strides negated, the
   first element moved), and adjacent dims that stay adjacent and in order on both sides merge.
   NCHW -> NHWC of a contiguous array is (N, HW, C) with input strides (C*HW, 1, HW); an
   identity permutation is one dim, a copy.
2. :func:`plan_permute`: an innermost dim contiguous on both sides and of at most 16 bytes is
   folded into the element (a wider word: (N, C, HW, 2) float16 pairs move as 4-byte
   elements), then one kernel:

   - ``copy``: the innermost dim is contiguous on both sides: ``permute_rows`` over it in
     vector words (16 bytes where the pointers, strides and length allow);
   - ``tile``: the innermost output dim o has output stride 1 and another dim i input stride
     1: ``permute_tile``, a batched transpose of (i, o) through shared memory, wide words on
     both sides; a short dim whose tile rows join into one run of memory (C = 3, HW = 49) is
     held whole and moved as that flat run (:func:`tile_shape`). 1- and 2-byte elements
     stored in output rows read shared memory in 32-bit words and transpose them in registers
     (``REGS``; the tuning's perm_byte_regs, :func:`byte_regs`); a flat output run of 3-element
     blocks (C = 3) stored in 16-byte words reads 16-byte row chunks and interleaves them in
     registers (``FO``; the tuning's perm_flat_regs, :func:`flat_regs`); a flat output run of
     channels of 1- and 2-byte elements (7x7, 14x14 planes NHWC -> NCHW) reads 32-bit columns
     over skewed rows (``SK``; the tuning's perm_skew_regs, :func:`skew_regs`);
   - ``general``: anything else: ``permute_rows`` over the innermost output dim, an element
     a word.

Indices are 32-bit where every offset and count fits (:func:`index_bits`), else 64-bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .._device import DeviceSpec
from .permute_dims import (
    MAX_DIMS,
    WORDS,
    Dim,
    Simplified,
    c_strides,
    check_dtype,
    fold_inner,
    merge,
    normalize_axes,
    output_dims,
    simplify,
    vector_width,
)
from .permute_phase2 import (
    FLAT_RUN,
    FLAT_SIZES,
    REGS_SIZES,
    SKEW_SIZES,
    SKEWS,
    byte_regs,
    describe,
    flat_regs,
    skew_regs,
    skew_run,
)
from .permute_tiles import async_copy, p2ceil, tile_panel, tile_shape
from .policy import Tuning, tuning_for

__all__ = ["Dim", "Simplified", "PermutePlan", "MAX_DIMS", "WORDS", "KINDS", "check_dtype",
           "normalize_axes", "c_strides", "output_dims", "simplify", "fold_inner", "merge",
           "vector_width",
           "tile_shape", "byte_regs", "flat_regs", "index_bits", "fast_div", "plan_permute",
           "reachable_steps", "rows_unroll", "small_threads", "TILE_UNROLL", "REGS_SIZES",
           "FLAT_SIZES",
           "FLAT_RUN", "SKEW_SIZES", "SKEWS", "skew_run", "skew_regs", "async_copy",
           "ASYNC_SIZES", "tile_panel"]

KINDS = ("copy", "tile", "general")
TILE_UNROLL = 4  # kernels/permute_parts.cuh: perm::kTileUnroll
MAX_THREADS = 256  # kernels/permute_parts.cuh: perm::kThreads (__launch_bounds__)
# 32-bit kernels: offsets and counts stay below this (a tile or row tile may overhang its dim)
INDEX_LIMIT = 2**31 - 2**20
MAX_TILES = 2**31 - 2**20  # the tile kernel's tile index is 32-bit (perm::fdiv)
ASYNC_SIZES = WORDS  # element sizes permute_tile's ASYNC phase 1 takes (every one)


SMALL_UNROLLS = (4,)  # unrolls the rows kernel takes besides its default (perm_small_unroll)


def rows_unroll(word: int) -> int:
    """Words a rows-kernel thread keeps in flight (kernels/permute_parts.cuh: perm::rows_unroll)."""
    return 4 if word >= 16 else 8


def fast_div(d: int) -> tuple[int, int]:
    """(m, s) of the kernels' perm::fdiv for divisor ``d`` >= 1: for 0 <= n < 2^31,
    n // d == (((n * m) >> 32) + n) >> s; (0, 31) for d >= 2^31, where every quotient is 0."""
    if d < 1:
        raise ValueError(f"fast_div: divisor {d} out of range")
    if d >= 2**31:
        return 0, 31
    s = (d - 1).bit_length()
    return (2**32 * (2**s - d)) // d + 1, s


def index_bits(dims, *counts) -> int:
    """32 where every offset on either side (the sum of (size - 1) * |stride|) and every count
    is below INDEX_LIMIT, else 64."""
    span_in = sum((d.size - 1) * abs(d.in_stride) for d in dims)
    span_out = sum((d.size - 1) * abs(d.out_stride) for d in dims)
    return 32 if max(span_in, span_out, *counts) < INDEX_LIMIT else 64


@dataclass(frozen=True)
class PermutePlan:
    """One permute launch, fully decided. Printable, comparable.

    ``merged``: :func:`simplify`'s dims (array elements); ``dims``: what the kernel runs, in
    ``elem``-byte elements (after :func:`fold_inner`). Rows kernels walk ``walk`` (len, in
    step, out step in ``word``-byte words) for every index of ``batch``; tile kernels
    transpose ``i_dim`` by ``o_dim`` (elements) for every index of ``batch``. ``in_base``,
    ``out_base``: the first element's offset from each pointer, in kernel words."""

    kind: str  # copy | tile | general
    itemsize: int
    merged: tuple[Dim, ...]
    dims: tuple[Dim, ...]
    elem: int
    word: int  # bytes a kernel word (rows: W; tile: T)
    vec_in: int  # elements a global load moves (rows: word // elem)
    vec_out: int  # elements a global store moves
    batch: tuple[Dim, ...]  # in kernel words, outermost first
    in_base: int
    out_base: int
    block: tuple[int, int]
    grid: int
    tiles: int
    index: int  # 32 or 64
    targs: tuple
    kernel: str = ""
    walk: Dim | None = None
    segs: int = 0
    tail: int = 0
    i_dim: Dim | None = None
    o_dim: Dim | None = None
    tile: tuple[int, int] = (0, 0)  # (ti, to)
    flat_in: bool = False
    flat_out: bool = False
    regs: bool = False  # phase 2 transposes 32-bit shared-memory words in registers
    flat_regs: int = 0  # FO: phase 2 interleaves 16-byte row chunks of a flat output run
    skew_regs: bool = False  # SK: phase 2 reads 32-bit columns of a flat run over skewed rows
    pitch: int = 0
    group: int = 0
    panel: int = 0  # tiles along i a panel (tiles run i, o, then panels); 0: one panel
    async_copy: bool = False  # ASYNC: phase 1 by cp.async (a looping block: two buffers)
    smem: int = 0
    device: str = ""
    label: str = ""
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def family(self) -> str:
        return "permute"

    @property
    def numel(self) -> int:
        return math.prod(d.size for d in self.merged)

    @property
    def rows(self) -> int:
        return math.prod(d.size for d in self.batch)

    def __str__(self) -> str:
        def dims_text(dims) -> str:
            return (f"sizes {tuple(d.size for d in dims)} in strides "
                    f"{tuple(d.in_stride for d in dims)} out strides "
                    f"{tuple(d.out_stride for d in dims)}")

        head = f"permute {self.label}" if self.label else "permute"
        lines = [f"{head} ({self.itemsize}-byte elements) on {self.device}",
                 f"  simplified         {dims_text(self.merged)}"]
        if self.elem != self.itemsize:
            lines.append(f"  folded             the inner {self.elem // self.itemsize} "
                         f"elements move as one {self.elem}-byte element: "
                         f"{dims_text(self.dims)}")
        b = f", batch {tuple(d.size for d in self.batch)}" if self.batch else ""
        if self.kind == "tile":
            ti, to = self.tile
            i, o = self.i_dim, self.o_dim
            lines.append(f"  kind               tile: batched transpose of i ({i.size}, input "
                         f"stride 1) x o ({o.size}, output stride 1){b}")
            sides = [s for s, on in (("input", self.flat_in), ("output", self.flat_out)) if on]
            flat = f"; flat {' and '.join(sides)} run" if sides else ""
            lines.append(f"  tile               {ti} x {to} (i x o){flat}, shared memory "
                         f"{self.smem} B (row pitch {self.pitch})")
            if self.async_copy:
                lines.append("  phase 1            cp.async: no registers hold the words in flight"
                             + ("; two buffers, a block's next tile copied while this one is "
                                "stored" if self.grid < self.tiles else ""))
            if self.panel == 1:
                lines.append("  order              tiles along o first, then the next tile along i")
            elif self.panel:
                lines.append(f"  order              panels of {self.panel} tiles along i: "
                             f"i, then o, then the next panel")
            lines.append(f"  vectors            loads {self.vec_in} x {self.elem} B along "
                         f"{'the input run' if self.flat_in else 'i'}, stores {self.vec_out} x "
                         f"{self.elem} B along {'the output run' if self.flat_out else 'o'}")
            lines.append(f"  phase 2            {describe(self)}")
        else:
            w = self.walk
            what = ("copy: the inner dim is contiguous on both sides" if self.kind == "copy"
                    else "general: strided rows of the inner output dim")
            lines.append(f"  kind               {what}{b}")
            lines.append(f"  rows               {self.rows} rows of {w.size} words (in step "
                         f"{w.in_stride}, out step {w.out_stride})"
                         + (f" and a {self.tail}-byte tail" if self.tail else ""))
            lines.append(f"  vectors            {self.word} B words ({self.vec_in} "
                         f"element{'s' if self.vec_in > 1 else ''})")
        lines.append(f"  kernel             {self.kernel or self.targs}")
        lines.append(f"  grid / block       {self.grid} x {self.block} over {self.tiles} "
                     f"tiles")
        lines.append(f"  index              {self.index}-bit")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _align(ptr_align: int) -> int:
    """A pointer alignment (bytes, a power of two) capped at 16."""
    a = int(ptr_align) if ptr_align else 16
    return min(16, a & -a) if a > 0 else 16


# The tuning's switches that name element sizes, and what takes them.
_SIZE_SWITCHES = (("perm_byte_regs", REGS_SIZES, "the register transpose"),
                  ("perm_flat_regs", FLAT_SIZES, "the flat-run interleave"),
                  ("perm_flat_split", WORDS, "a flat split output run"),
                  ("perm_skew_regs", SKEW_SIZES, "the skewed-column phase 2"),
                  ("perm_async_copy", ASYNC_SIZES, "the cp.async phase 1"),
                  ("perm_flat_rows4", WORDS, "a flat input run of rows 4 (mod 8)"))


def plan_permute(simple: Simplified, itemsize: int, device: DeviceSpec | None = None, *,
                 in_align: int = 16, out_align: int = 16, signature=None,
                 label: str = "", tuning: Tuning | None = None) -> PermutePlan:
    """The launch that moves ``simple`` (:func:`simplify`) of ``itemsize``-byte elements.
    ``in_align``, ``out_align``: the alignment (bytes; any value, capped at 16) of the input's
    and output's pointers. ``signature(plan)``: the kernel's name expression (the family's).
    ``tuning``: the table to plan with (default ``tuning_for(device)``; tests and benchmarks
    pass one with a rule changed). ValueError for an empty array (nothing launches), more than
    MAX_DIMS dims, or a tuning the kernels cannot run."""
    if itemsize not in WORDS:
        raise ValueError(f"plan: {itemsize}-byte elements; the permute kernels move 1, 2, 4, "
                         f"8 or 16 bytes")
    if simple.numel == 0:
        raise ValueError("plan: permute of an empty array launches nothing")
    if len(simple.dims) > MAX_DIMS:
        raise ValueError(f"plan: {len(simple.dims)} dims after simplifying; the kernels take "
                         f"at most {MAX_DIMS}")
    device = device or DeviceSpec.h100()
    tuning = tuning if tuning is not None else tuning_for(device)
    threads = tuning.perm_threads
    if threads > MAX_THREADS or threads % 32:
        raise ValueError(f"plan: perm_threads {threads}: the kernels take a multiple of 32 up "
                         f"to {MAX_THREADS}")
    for name, sizes, what in _SIZE_SWITCHES:
        if not set(getattr(tuning, name)) <= set(sizes):
            raise ValueError(f"plan: {name} {getattr(tuning, name)}: {what} takes element "
                             f"sizes {sizes}")
    if tuning.perm_small_unroll not in (0,) + SMALL_UNROLLS:
        raise ValueError(f"plan: perm_small_unroll {tuning.perm_small_unroll}: the rows kernel "
                         f"takes 0 (its default) or {SMALL_UNROLLS}")
    words = tuning.perm_skew_words
    if len(words) != len(SKEW_SIZES) or not set(words) <= {1, 2, 4, 8, 16}:
        raise ValueError(f"plan: perm_skew_words {words}: one of 1, 2, 4, 8, 16 for each "
                         f"element size {SKEW_SIZES}")
    ia, oa = _align(in_align), _align(out_align)
    dims, elem, in_base, out_base = fold_inner(simple.dims, itemsize, ia, oa,
                                               simple.in_offset, simple.out_offset)
    notes = []
    last = dims[-1]
    if last.in_stride == 1 and last.out_stride == 1:
        plan = _rows_plan("copy", dims, elem, ia, oa, in_base, out_base, device, tuning)
    else:
        plan = None
        i_at = [k for k, d in enumerate(dims[:-1]) if d.in_stride == 1]
        if last.out_stride == 1 and i_at:
            plan = _tile_plan(dims, i_at[-1], elem, ia, oa, in_base, out_base, device, tuning)
            if plan is None:
                notes.append("the tile would be under perm_tile_min_bytes: general kernel")
        if plan is None:
            plan = _rows_plan("general", dims, elem, ia, oa, in_base, out_base, device, tuning)
        nbytes = simple.numel * itemsize
        flat = plan.kind == "general" or plan.flat_in or plan.flat_out
        limit = "perm_small_max_bytes" if nbytes <= tuning.perm_small_max_bytes else \
            "perm_small_flat_max_bytes" if flat and nbytes <= tuning.perm_small_flat_max_bytes \
            else ""
        if limit:
            unroll = tuning.perm_small_unroll
            narrow = small_threads(simple.numel * itemsize // elem,
                                   unroll or rows_unroll(elem), device, tuning)
            plan = _rows_plan("general", dims, elem, ia, oa, in_base, out_base, device, tuning,
                              threads=narrow, unroll=unroll)
            notes.append(f"a small array ({nbytes} bytes): the general kernel, {unroll} elements "
                         f"a thread in blocks of {narrow}, spread over the SMs ({limit})")
    if plan.kind == "general" and last.out_stride != 1:
        notes.append("the output has no dim of stride 1: strided stores")
    if plan.vec_in * plan.elem < 16 and plan.kind != "general" and elem < 16:
        notes.append(f"loads of {plan.vec_in * plan.elem} B, stores of "
                     f"{plan.vec_out * plan.elem} B: the alignment of the pointers, strides "
                     f"or sizes allows no wider")
    plan = _replace(plan, itemsize=itemsize, merged=simple.dims, device=device.name,
                    label=label, notes=tuple(notes))
    if signature is not None:
        plan = _replace(plan, kernel=signature(plan))
    return plan


def _replace(plan: PermutePlan, **changes) -> PermutePlan:
    import dataclasses

    return dataclasses.replace(plan, **changes)


def _grid(tiles: int, threads: int, smem: int, device: DeviceSpec, tuning: Tuning) -> int:
    resident = device.sms * max(1, device.model_occupancy(threads, smem))
    return max(1, min(tiles, resident * tuning.perm_waves))


def small_threads(words: int, unroll: int, device: DeviceSpec, tuning: Tuning) -> int:
    """Threads a general-kernel block for a small array of ``words`` elements, ``unroll`` a
    thread: the widest power of two from 32 up to perm_threads that still gives every SM a
    block."""
    per_sm = -(-words // unroll) // device.sms
    threads = 32
    while threads * 2 <= min(per_sm, tuning.perm_threads):
        threads *= 2
    return threads


def _rows_plan(kind: str, dims, elem: int, ia: int, oa: int, in_base: int, out_base: int,
               device: DeviceSpec, tuning: Tuning, threads: int = 0,
               unroll: int = 0) -> PermutePlan:
    walk, batch = dims[-1], tuple(dims[:-1])
    v, tail = 1, 0
    if kind == "copy":
        strides = [s for b in batch for s in (b.in_stride, b.out_stride)]
        v = 16 // elem
        while v > 1 and (ia % (v * elem) or oa % (v * elem) or in_base % v or out_base % v
                         or any(s % v for s in strides) or (batch and walk.size % v)):
            v //= 2
        if not batch:
            tail = (walk.size % v) * elem
        walk = Dim(walk.size // v, 1, 1)
        batch = tuple(Dim(b.size, b.in_stride // v, b.out_stride // v) for b in batch)
        in_base, out_base = in_base // v, out_base // v
    word = v * elem
    u = unroll or rows_unroll(word)
    threads = threads or tuning.perm_threads
    tx = min(threads, p2ceil(-(-walk.size // u)))
    ty = threads // tx
    segs = max(1, -(-walk.size // (tx * u)))
    rows = math.prod(b.size for b in batch)
    tiles = -(-rows // ty) * segs
    grid = _grid(tiles, threads, 0, device, tuning)
    index = index_bits((walk, *batch), rows + ty, walk.size + tx * u, tiles + grid)
    if tiles + grid >= 2**63:
        raise ValueError("plan: too many row tiles")
    return PermutePlan(kind, elem, (), tuple(dims), elem, word, v, v, batch, in_base, out_base,
                       (tx, ty), grid, tiles, index, ("rows", word, index, unroll), walk=walk,
                       segs=segs, tail=tail)


def _tile_plan(dims, i_at: int, elem: int, ia: int, oa: int, in_base: int, out_base: int,
               device: DeviceSpec, tuning: Tuning) -> PermutePlan | None:
    o, i = dims[-1], dims[i_at]
    batch = tuple(d for k, d in enumerate(dims[:-1]) if k != i_at)
    shape = tile_shape(i, o, batch, elem, tuning, ia, oa, in_base, out_base)
    ti, to = shape.ti, shape.to
    if ti * to * elem < tuning.perm_tile_min_bytes:
        return None
    fo = flat_regs(shape, i, o, elem, tuning)
    if fo and not shape.flat_in:  # unpadded rows: 16-byte chunks both phases, no conflicts
        shape = shape._replace(pitch=ti)
    smem = -(-(to * shape.pitch * elem) // 16) * 16
    words1 = -(-(to * ti) // shape.vec_in)
    words2 = -(-(to * ti) // shape.vec_out)
    threads = min(tuning.perm_threads, max(64, p2ceil(-(-max(words1, words2) // TILE_UNROLL))))
    nti = 1 if shape.flat_in else -(-i.size // ti)
    nto = 1 if shape.flat_out else -(-o.size // to)
    tiles = math.prod(b.size for b in batch) * nti * nto
    if tiles >= MAX_TILES:
        raise ValueError(f"plan: {tiles} tiles; the tile kernel takes fewer than 2^31")
    asy = async_copy(shape, elem, smem, tuning)
    grid = _grid(tiles, threads, smem, device, tuning)
    if asy and grid < tiles:  # blocks loop over tiles: a second buffer for the next one
        smem *= 2
    index = index_bits(dims, tiles + grid, i.size + ti, o.size + to)
    regs = byte_regs(shape, elem, tuning)
    sk = skew_regs(shape, o, elem, tuning)
    panel = tile_panel(nti, nto, tuning)
    if sk >= 0:  # phase 2's lanes: runs of perm_skew_words words of a channel
        words = tuning.perm_skew_words[SKEW_SIZES.index(elem)]
        shape = shape._replace(group=words.bit_length() - 1)
    targs = ("tile", elem, shape.vec_in, shape.vec_out, index, regs, fo, sk, asy)
    return PermutePlan("tile", elem, (), tuple(dims), elem, elem, shape.vec_in, shape.vec_out,
                       batch, in_base, out_base, (threads, 1), grid, tiles, index, targs,
                       i_dim=i, o_dim=o, tile=(ti, to), flat_in=shape.flat_in,
                       flat_out=shape.flat_out, regs=regs, flat_regs=fo, skew_regs=sk >= 0,
                       pitch=shape.pitch, group=shape.group, panel=panel, async_copy=asy,
                       smem=smem)


def reachable_steps() -> list[tuple]:
    """Every kernel's template arguments the planner can produce (any shape, strides,
    alignment, dtype, perm_byte_regs, perm_flat_regs or perm_skew_regs): rows kernels of
    every word size, tile kernels of every element size and pair of vector widths up to 16
    bytes, for 1- and 2-byte elements those with words of 4 bytes or more both ways again with
    the register phase 2 (18), for 1-, 2- and 4-byte elements those with loads of 4 bytes or
    more and 16-byte stores again with the flat-run interleave (9), and for 1- and 2-byte
    elements those of 16-byte loads and stores with the skewed columns of each D in SKEWS (6),
    each with 32- and 64-bit indices, and every tile kernel again with phase 1 by cp.async
    (ASYNC_SIZES)."""
    out: list[tuple] = []
    for index in (32, 64):
        out += [("rows", w, index, u) for w in WORDS for u in (0,) + SMALL_UNROLLS]
        for e in WORDS:
            vs = [v for v in WORDS if v * e <= 16]
            out += [("tile", e, vi, vo, index, False, 0, -1, False) for vi in vs for vo in vs]
            ws = [v for v in vs if v * e >= 4]
            if e in REGS_SIZES:
                out += [("tile", e, vi, vo, index, True, 0, -1, False) for vi in ws for vo in ws]
            if e in FLAT_SIZES:
                out += [("tile", e, vi, 16 // e, index, False, FLAT_RUN, -1, False) for vi in ws]
            if e in SKEW_SIZES:
                out += [("tile", e, 16 // e, 16 // e, index, False, 0, d, False) for d in SKEWS]
    # each tile kernel again with phase 1 by cp.async (a tile with a flat side may take any)
    return out + [t[:8] + (True,) for t in out if t[0] == "tile" and t[1] in ASYNC_SIZES]

"""The tile kernel's phase 2 variants (``kernels/permute.cuh``: ``permute_tile<..., REGS, FO,
SK>``): where each takes a planned tile (:class:`cukern.plan.permute_tiles.TileShape`), by the
tuning's switches (perm_byte_regs, perm_flat_regs, perm_skew_regs). Pure functions; the
planner (:mod:`cukern.plan.permute`) calls them and re-exports them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .permute_dims import Dim
from .policy import Tuning

if TYPE_CHECKING:  # the planner's tile shape (cukern.plan.permute_tiles imports this module)
    from .permute_tiles import TileShape

__all__ = ["REGS_SIZES", "FLAT_SIZES", "FLAT_RUN", "SKEW_SIZES", "SKEWS", "byte_regs",
           "flat_regs", "skew_run", "skew_regs", "describe"]

REGS_SIZES = (1, 2)  # element sizes permute_tile's REGS phase 2 takes (perm::store_regs)
FLAT_SIZES = (1, 2, 4)  # element sizes permute_tile's FO phase 2 takes (perm::store_flat)
FLAT_RUN = 3  # the block a flat output run is made of there (FO: C = 3)
SKEW_SIZES = (1, 2)  # element sizes permute_tile's SK phase 2 takes (perm::store_skew)
SKEWS = (0, 1, 4)  # run lengths (mod the 16-byte word's elements) it is instantiated for


def byte_regs(shape: TileShape, elem: int, tuning: Tuning) -> bool:
    """Whether the tile's phase 2 transposes 32-bit words of shared memory in registers
    (``permute_tile<..., REGS = true>``): ``elem`` in the tuning's perm_byte_regs (1 or 2
    bytes), output rows (a flat output run is gathered), tile rows in shared memory 4 (mod 8)
    elements apart (rows; a flat input run of such a length, as HW = 196: 4-byte aligned
    words, lanes on distinct banks; HW = 49 or C = 3 keep the gather) and words of at least 4
    bytes both ways (narrower ones keep the gather: fewer instantiations)."""
    return (elem in tuning.perm_byte_regs and not shape.flat_out and shape.pitch % 8 == 4
            and shape.vec_in * elem >= 4 and shape.vec_out * elem >= 4)


def flat_regs(shape: TileShape, i: Dim, o: Dim, elem: int, tuning: Tuning) -> int:
    """FO of ``permute_tile<..., FO>``: FLAT_RUN where the tile's phase 2 interleaves 16-byte
    row chunks of shared memory in registers (perm::store_flat), else 0 (the gather):
    ``elem`` in the tuning's perm_flat_regs (1, 2 or 4 bytes), a flat output run of blocks of
    FLAT_RUN elements (o of that size: C = 3), stores of 16 bytes, loads of at least 4 (fewer
    instantiations), and rows of shared memory 16-byte aligned: row tiles (the plan's pitch
    becomes ti) or a flat input run of a multiple of the store's elements."""
    ok = (elem in tuning.perm_flat_regs and shape.flat_out and o.size == FLAT_RUN
          and shape.vec_out * elem == 16 and shape.vec_in * elem >= 4
          and shape.ti % shape.vec_out == 0
          and (not shape.flat_in or i.size % shape.vec_out == 0))
    return FLAT_RUN if ok else 0


def skew_run(so: int, elem: int, vec_in: int, vec_out: int, tuning: Tuning) -> int:
    """D = so mod the store word's elements where a flat output run of channels of ``so``
    elements may take the skewed-column phase 2 (``elem`` in the tuning's perm_skew_regs,
    16-byte loads and stores, so at least a word and at most perm_flat_max_bytes, D in
    SKEWS), else -1."""
    vo = 16 // elem
    ok = (elem in tuning.perm_skew_regs and vec_in * elem == 16 and vec_out * elem == 16
          and vo <= so and so * elem <= tuning.perm_flat_max_bytes and so % vo in SKEWS)
    return so % vo if ok else -1


def skew_regs(shape: TileShape, o: Dim, elem: int, tuning: Tuning) -> int:
    """SK of ``permute_tile<..., SK>``: D = L mod VO where the tile's phase 2 reads 32-bit
    shared-memory columns of 4 / elem channels over rows skewed D a channel
    (perm::store_skew), else -1 (the gather): a flat output run of channels of L = o.size
    elements (:func:`skew_run`) beside row tiles 4 (mod 8) elements apart (32-bit aligned
    columns; a flat input side keeps the gather)."""
    if not shape.flat_out or shape.flat_in or shape.pitch % 8 != 4 or shape.ti * elem % 4:
        return -1
    return skew_run(o.size, elem, shape.vec_in, shape.vec_out, tuning)


def describe(plan) -> str:
    """The ``phase 2`` line of a tile plan's explain text (a PermutePlan)."""
    if plan.regs:
        return (f"32-bit shared-memory words, {4 // plan.elem} x {plan.vec_out} blocks "
                f"transposed in registers (perm_byte_regs)")
    if plan.skew_regs:
        d = plan.targs[7]
        return (f"32-bit shared-memory columns of {4 // plan.elem} channels, rows skewed {d} a "
                f"channel (run of {plan.o_dim.size} = {d} mod {plan.vec_out}), interleaved in "
                f"registers (perm_skew_regs; lanes store {1 << plan.group} words of a channel)")
    if plan.flat_regs:
        return (f"16-byte shared-memory row chunks, {plan.flat_regs} a block of the run, "
                f"interleaved in registers (perm_flat_regs)")
    return f"gathers one {plan.elem}-byte element a shared-memory load"

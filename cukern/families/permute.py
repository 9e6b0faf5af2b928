"""The permute family (``kernels/permute.cuh``): any permutation of the axes of a strided array,
materialised, moved as unsigned words by element size (the dtype does not matter).

Kernel signatures (shapes, strides, tiles and grids come with the launch, in one struct)::

    permute_rows<W, IDX[, UN]>(const W* x, W* y, PermuteRowsArgs)    W: 1..16-byte word; UN:
                                                   words a thread where not the default
    permute_tile<T, VI, VO, IDX[, REGS[, FO[, SK]]]>(const T* x, T* y, PermuteTileArgs)
                                                   T: 1..16-byte element; REGS (true) for
                                                   the register phase 2 of 1- and 2-byte ones,
                                                   FO (3) for a flat output run of 3-element
                                                   blocks interleaved in registers, SK (0, 1,
                                                   4: the run length mod VO) for a flat output
                                                   run of channels read in skewed columns

IDX: ``int`` or ``long long``. The argument structs are passed by value as size-1 NumPy
structured arrays (:data:`ROWS_ARGS`, :data:`TILE_ARGS`: the headers' field order with C
alignment), built by :func:`kernel_args` from a plan.
"""

from __future__ import annotations

import numpy as np

from ..plan import permute as pp

__all__ = ["SOURCE", "WORD_TYPES", "BATCH", "ROWS_ARGS", "TILE_ARGS", "name_expression",
           "kernel_names", "kernel_args"]

SOURCE = "permute"
WORD_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int",
              8: "unsigned long long", 16: "uint4"}
_INDEX = {32: "int", 64: "long long"}
_D = pp.MAX_DIMS

# perm::Batch, PermuteRowsArgs, PermuteTileArgs (kernels/permute_parts.cuh), field for field
BATCH = np.dtype([("size", np.int64, (_D,)), ("in", np.int64, (_D,)),
                  ("out", np.int64, (_D,)), ("m", np.uint32, (_D,)), ("s", np.uint32, (_D,)),
                  ("n", np.int32), ("pad_", np.int32)], align=True)
ROWS_ARGS = np.dtype([("batch", BATCH), ("in_base", np.int64), ("out_base", np.int64),
                      ("len", np.int64), ("in_step", np.int64), ("out_step", np.int64),
                      ("rows", np.int64), ("tiles", np.int64), ("segs", np.int64),
                      ("seg_m", np.uint32), ("seg_s", np.uint32), ("tail", np.int32),
                      ("pad_", np.int32)], align=True)
TILE_ARGS = np.dtype([("batch", BATCH), ("in_base", np.int64), ("out_base", np.int64),
                      ("si", np.int64), ("so", np.int64), ("o_in", np.int64),
                      ("i_out", np.int64), ("tiles", np.int64),
                      ("ti", np.int32), ("to", np.int32), ("pitch", np.int32),
                      ("nti", np.int32), ("nto", np.int32),
                      ("nti_m", np.uint32), ("nti_s", np.uint32),
                      ("nto_m", np.uint32), ("nto_s", np.uint32),
                      ("flat_in", np.int32), ("flat_out", np.int32),
                      ("in_words", np.int32), ("in_words_m", np.uint32),
                      ("in_words_s", np.uint32), ("out_words", np.int32), ("group", np.int32),
                      ("ti_m", np.uint32), ("ti_s", np.uint32),
                      ("so_m", np.uint32), ("so_s", np.uint32), ("npi", np.int32),
                      ("npi_m", np.uint32), ("npi_s", np.uint32), ("pad_", np.int32)],
                     align=True)


def _name(targs: tuple) -> str:
    if targs[0] == "rows":
        _, word, index, unroll = targs
        un = f", {unroll}" if unroll else ""
        return f"cukern::permute_rows<{WORD_TYPES[word]}, {_INDEX[index]}{un}>"
    _, elem, vi, vo, index, regs, fo, sk, asy = targs
    # REGS, FO, SK and ASYNC default to false, 0, -1 and false: the names stay as they were
    if asy:
        tail = f", {'true' if regs else 'false'}, {fo}, {sk}, true"
    else:
        tail = ", true" if regs else f", false, {fo}" if fo else f", false, 0, {sk}" \
            if sk >= 0 else ""
    return f"cukern::permute_tile<{WORD_TYPES[elem]}, {vi}, {vo}, {_INDEX[index]}{tail}>"


def name_expression(plan: pp.PermutePlan) -> str:
    """The C++ name expression of a planned launch, in the template order of the header."""
    return _name(plan.targs)


def kernel_names(op: str):
    """(dtype, device) -> every instantiation ``op`` can launch: the same set for every dtype
    and architecture (the kernels move words by size, and an element may move in any wider
    word: a copy's vectors, an inner dim folded into the element)."""
    if op != "permute":
        raise ValueError(f"kernel_names: {op} is not a permute op")

    def names(dtype=None, device=None) -> set[str]:
        return {_name(t) for t in pp.reachable_steps()}

    return names


def _batch(arr, dims) -> None:
    """Fills a BATCH record with ``dims`` (outermost first), innermost first as the kernels
    read them."""
    inner = list(reversed(dims))
    arr["n"] = len(inner)
    for k, d in enumerate(inner):
        m, s = pp.fast_div(d.size)
        arr["size"][k], arr["in"][k], arr["out"][k] = d.size, d.in_stride, d.out_stride
        arr["m"][k], arr["s"][k] = m, s
    for k in range(len(inner), _D):
        arr["size"][k], arr["m"][k] = 1, 1


def kernel_args(plan: pp.PermutePlan) -> np.ndarray:
    """The kernel's argument struct for ``plan``: a size-1 structured array (CuPy passes it by
    value)."""
    if plan.kind == "tile":
        a = np.zeros(1, TILE_ARGS)
        r = a[0]
        _batch(r["batch"], plan.batch)
        i, o = plan.i_dim, plan.o_dim
        ti, to = plan.tile
        nti = 1 if plan.flat_in else -(-i.size // ti)
        npi = nti // plan.panel if plan.panel else 1  # panels along i
        nti //= npi
        nto = 1 if plan.flat_out else -(-o.size // to)
        in_words = 0 if plan.flat_in else ti // plan.vec_in
        out_words = 0 if plan.flat_out else to // plan.vec_out
        r["in_base"], r["out_base"] = plan.in_base, plan.out_base
        r["si"], r["so"], r["o_in"], r["i_out"] = i.size, o.size, o.in_stride, i.out_stride
        r["tiles"] = plan.tiles
        r["ti"], r["to"], r["pitch"], r["nti"], r["nto"] = ti, to, plan.pitch, nti, nto
        r["nti_m"], r["nti_s"] = pp.fast_div(nti)
        r["nto_m"], r["nto_s"] = pp.fast_div(nto)
        r["flat_in"], r["flat_out"] = int(plan.flat_in), int(plan.flat_out)
        r["in_words"] = in_words
        r["in_words_m"], r["in_words_s"] = pp.fast_div(max(in_words, 1))
        r["out_words"], r["group"] = out_words, plan.group
        r["ti_m"], r["ti_s"] = pp.fast_div(ti)
        r["so_m"], r["so_s"] = pp.fast_div(o.size)
        r["npi"] = npi
        r["npi_m"], r["npi_s"] = pp.fast_div(npi)
        return a
    a = np.zeros(1, ROWS_ARGS)
    r = a[0]
    _batch(r["batch"], plan.batch)
    w = plan.walk
    r["in_base"], r["out_base"] = plan.in_base, plan.out_base
    r["len"], r["in_step"], r["out_step"] = w.size, w.in_stride, w.out_stride
    r["rows"], r["tiles"], r["segs"] = plan.rows, plan.tiles, plan.segs
    r["seg_m"], r["seg_s"] = pp.fast_div(plan.segs)
    r["tail"] = plan.tail
    return a

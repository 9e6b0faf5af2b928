"""The tile kernel's register phase 2 (``permute_tile<..., REGS = true>``, the tuning's
perm_byte_regs) without a GPU: where the planner picks it and where it keeps the gather, the
Tuning override, and a model of ``perm::store_regs`` run in Python on tiles of every edge
(partial tiles along i and o, flat input runs, 1- and 2-byte elements, every store width): each
output element written once, from the right shared-memory byte, through the same
``__byte_perm`` selectors; and the shared-memory banks its lanes read."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from cukern import _compile
from cukern._device import DeviceSpec
from cukern.families import permute as fam
from cukern.plan import HOPPER
from cukern.plan import permute as pp

from .test_permute_cpu import NCHW, NHWC, _wavefronts, plan

H100 = DeviceSpec.h100()
OFF = dataclasses.replace(HOPPER, perm_byte_regs=())
# NHWC -> NCHW runs of 196 and 784 int8 bytes go flat to the skewed columns
# (tests/test_permute_skew_cpu.py); without them, row tiles of this phase 2
ROWS = dataclasses.replace(HOPPER, perm_skew_regs=())


# ---------------------------------------------------------------------------------------------
# Where the planner takes it.

@pytest.mark.parametrize("shape,axes,item,vo", [
    ((64, 512, 28, 28), NHWC, 1, 16), ((64, 28, 28, 512), NCHW, 1, 16),
    ((64, 14, 14, 1024), NCHW, 1, 4),      # output rows of 196 bytes: 4-byte stores
    ((64, 1024, 14, 14), NHWC, 1, 16),     # a flat input run of 196 (4 mod 8) bytes
    ((4096, 4096), (1, 0), 1, 16), ((64, 256, 56, 56), NHWC, 2, 8),
    ((64, 1024, 14, 14), NHWC, 2, 8), ((8, 64, 16, 56, 56), (0, 2, 3, 4, 1), 1, 16),
])
def test_register_transpose_is_planned(shape, axes, item, vo):
    rows = axes == NCHW and item == 1
    p = plan(shape, axes, item, tuning=ROWS if rows else None)
    assert p.kind == "tile" and p.regs and not p.flat_out and p.vec_out == vo
    assert p.targs[5] is True and p.kernel.endswith(", true>")
    assert p.targs in set(pp.reachable_steps())
    q = plan(shape, axes, item, tuning=dataclasses.replace(ROWS if rows else HOPPER,
                                                           perm_byte_regs=()))  # the gather
    assert not q.regs and q.kernel == p.kernel.replace(", true>", ">")
    assert dataclasses.replace(q, regs=True, targs=p.targs, kernel=p.kernel) == p


@pytest.mark.parametrize("shape,axes,item,why", [
    ((64, 3, 224, 224), NHWC, 1, "flat output run (C = 3): the flat-run interleave"),
    ((64, 224, 224, 3), NCHW, 1, "flat input run of 3 bytes"),
    ((64, 2048, 7, 7), NHWC, 1, "flat input run of 49 bytes"),
    ((64, 7, 7, 2048), NCHW, 1, "flat output run of 49 bytes"),
    ((4, 33, 17, 31), NHWC, 1, "1-byte stores (C = 33)"),
    ((4, 17, 31, 33), NCHW, 1, "1-byte loads (C = 33)"),
    ((64, 256, 56, 56), NHWC, 4, "4-byte elements"),
    ((64, 256, 56, 56), NHWC, 8, "8-byte elements"),
])
def test_gather_is_kept(shape, axes, item, why):
    p = plan(shape, axes, item)
    assert p.kind == "tile" and not p.regs, why
    assert not p.kernel.endswith(", true>")
    assert "gathers one" in str(p) or p.flat_regs or p.skew_regs  # the other register paths


def test_only_the_sizes_in_the_tuning():
    only1 = dataclasses.replace(HOPPER, perm_byte_regs=(1,))
    assert plan((64, 512, 28, 28), NHWC, 1, tuning=only1).regs
    assert not plan((64, 512, 28, 28), NHWC, 2, tuning=only1).regs
    # int8 pairs fold into 2-byte elements: the kernel's element size decides
    p = plan((64, 512, 28, 28, 2), (0, 2, 3, 1, 4), 1, tuning=only1)
    assert p.elem == 2 and not p.regs
    assert plan((64, 512, 28, 28, 2), (0, 2, 3, 1, 4), 1).regs
    with pytest.raises(ValueError, match="perm_byte_regs"):
        plan((64, 512, 28, 28), NHWC, 1, tuning=dataclasses.replace(HOPPER, perm_byte_regs=(4,)))


def test_tuning_table_and_source():
    assert HOPPER.perm_byte_regs == (1, 2) and set(HOPPER.perm_byte_regs) <= set(pp.REGS_SIZES)
    src = _compile.source("permute")
    assert "bool REGS = false" in src and "store_regs" in src
    # a tile plan's name carries REGS only when on: the gather's names are those of before
    names = fam.kernel_names("permute")()
    regs = sorted(n for n in names if re.search(r", (int|long long), true>$", n))
    assert len(regs) == 36
    for n in regs:
        m = re.match(r"cukern::permute_tile<unsigned (char|short), (\d+), (\d+), (int|long long), "
                     r"true>$", n)
        assert m, n
        e = 1 if m.group(1) == "char" else 2
        assert int(m.group(2)) * e >= 4 and int(m.group(3)) * e >= 4


# ---------------------------------------------------------------------------------------------
# perm::store_regs, modelled.

def byte_perm(x: int, y: int, s: int) -> int:
    """CUDA's __byte_perm(x, y, s) (default mode): byte n of the result is byte s[4n:4n+3]
    of the 8 bytes y:x."""
    both = x | (y << 32)
    return sum(((both >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def regs_row(words: list[int], r: int, e: int) -> list[int]:
    """perm::regs_row: output row r's 32-bit words from the VO loaded words."""
    rr = 4 // e
    out = []
    for m in range(len(words) // rr):
        q = words[m * rr:(m + 1) * rr]
        if rr == 4:
            lo = byte_perm(q[0], q[1], 0x5140 if r < 2 else 0x7362)
            hi = byte_perm(q[2], q[3], 0x5140 if r < 2 else 0x7362)
            out.append(byte_perm(lo, hi, 0x7632 if r & 1 else 0x5410))
        else:
            out.append(byte_perm(q[0], q[1], 0x7632 if r else 0x5410))
    return out


def store_regs(p: pp.PermutePlan, ti_e: int, to_e: int, smem: bytes) -> dict:
    """(il, ol) -> element bytes that perm::store_regs writes for one tile of extents ti_e x
    to_e, from shared memory ``smem`` (the kernel's index arithmetic, item by item)."""
    e, vo = p.elem, p.vec_out
    rr = 4 // e
    ti, to = p.tile
    nq = ti // rr
    items = nq * (to // vo)
    m, sh = pp.fast_div(ti)
    written: dict = {}
    for w in range(items):
        r = w >> p.group
        og = (((r * rr) * m >> 32) + r * rr) >> sh  # perm::fdiv(r << LR, ti)
        il = (r - og * nq) * rr
        ol = ((og << p.group) | (w & ((1 << p.group) - 1))) * vo
        rows, left = ti_e - il, to_e - ol
        if rows <= 0 or left <= 0:
            continue
        words = []
        for j in range(vo):
            at = ((ol + j) * p.pitch + il) * e
            assert at % 4 == 0 and at + 4 <= len(smem), (w, j, at)
            words.append(int.from_bytes(smem[at:at + 4], "little"))
        for k in range(min(rows, rr)):
            row = b"".join(x.to_bytes(4, "little") for x in regs_row(words, k, e))
            for j in range(min(left, vo)):
                key = (il + k, ol + j)
                assert key not in written, f"{key} written twice"
                written[key] = row[j * e:(j + 1) * e]
    return written


# (element bytes, batch, si, so, o_in, i_out): a batched transpose of x (batch, so, si) with
# rows o_in apart (a slice of wider rows) into y (batch, si, so) with rows i_out apart, as the
# GPU tests run them (tests/test_permute_regs_gpu.py). Every store width of both element sizes,
# flat input runs, tiles cut short along i (off multiples of 4) and o (off multiples of VO),
# a short o under one store word, i shorter than a tile.
REGS_CASES = [
    (1, 2, 37, 302, 48, 304),      # 16-byte stores; i = 37 in a 64-row tile
    (1, 2, 150, 200, 160, 200),    # 8-byte stores
    (1, 4, 70, 70, 80, 80),        # 16-byte stores, both tiles cut short
    (1, 2, 196, 203, 196, 204),    # 4-byte loads and stores
    (1, 2, 196, 200, 196, 200),    # a flat input run of 196 bytes
    (1, 3, 5, 1001, 16, 1004),     # i = 5 in an 8-row tile, 4-byte stores
    (1, 2, 301, 5, 304, 16),       # o = 5: under one 8-byte store
    (1, 3, 130, 20, 144, 32),      # a short o, 16-byte stores
    (2, 2, 37, 150, 40, 152),      # 2-byte: 16-byte stores
    (2, 2, 37, 99, 40, 100),       # 2-byte: 8-byte stores
    (2, 2, 37, 99, 40, 102),       # 2-byte: 4-byte stores
    (2, 2, 196, 100, 196, 100),    # 2-byte: a flat input run of 196
    (2, 3, 12, 200, 12, 200),      # 2-byte: a flat input run of 12
    (2, 2, 301, 5, 304, 16),       # 2-byte: o = 5
    (2, 2, 301, 2, 304, 4),        # 2-byte: o = 2, one 4-byte store a row
]


def case_plan(case, tuning=None) -> pp.PermutePlan:
    """The plan of one REGS_CASES transpose (16-byte aligned pointers)."""
    item, b, si, so, o_in, i_out = case
    s = pp.simplify((b, si, so), (so * o_in, 1, o_in), (si * i_out, i_out, 1))
    return pp.plan_permute(s, item, H100, signature=fam.name_expression, tuning=tuning)


def _id(case) -> str:
    return "{}B-b{}-i{}-o{}-in{}-out{}".format(*case)


def _plans():
    return [(_id(c), case_plan(c)) for c in REGS_CASES]


PLANS = _plans()


@pytest.mark.parametrize("name,p", PLANS, ids=[n for n, _ in PLANS])
def test_store_regs_model_writes_the_transpose(name, p):
    assert p.kind == "tile" and p.regs and len(p.batch) == 1, (name, str(p))
    ti, to = p.tile
    i, o = p.i_dim, p.o_dim
    ext_i = [ti] if p.flat_in else sorted({min(ti, i.size), i.size - (i.size - 1) // ti * ti})
    ext_o = sorted({min(to, o.size), o.size - (o.size - 1) // to * to})
    rng = np.random.default_rng(len(name))
    for ti_e in ext_i:
        for to_e in ext_o:
            nbytes = p.smem
            smem = bytearray(rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes())
            tile = rng.integers(0, 256, (to_e, ti_e, p.elem), dtype=np.uint8)
            for ol in range(to_e):  # phase 1: row ol at ol * pitch, i along it
                at = ol * p.pitch * p.elem
                smem[at:at + ti_e * p.elem] = tile[ol].tobytes()
            got = store_regs(p, ti_e, to_e, bytes(smem))
            assert set(got) == {(a, b) for a in range(ti_e) for b in range(to_e)}, \
                (name, ti_e, to_e)
            for (a, b), v in got.items():
                assert v == tile[b, a].tobytes(), (name, ti_e, to_e, a, b)


def test_store_regs_model_covers_the_edges():
    # partial tiles along both dims with extents off multiples of 4 and 16, every store width
    # of both element sizes, flat input runs
    seen = set()
    for _, p in PLANS:
        ti, to = p.tile
        seen.add((p.elem, p.vec_out, p.flat_in))
        if not p.flat_in and p.i_dim.size % ti:
            seen.add(("partial i", p.i_dim.size % ti % 4 != 0))
        if p.o_dim.size % to:
            seen.add(("partial o", p.o_dim.size % to % p.vec_out != 0))
    for want in [(1, 4, False), (1, 8, False), (1, 16, False), (1, 8, True), (2, 2, False),
                 (2, 4, False), (2, 8, False), (2, 4, True), (2, 8, True), ("partial i", True),
                 ("partial o", True)]:
        assert want in seen, want


def _regs_addresses(p: pp.PermutePlan, j: int, first: int = 0) -> list[int]:
    """Byte addresses of the 32-bit words a warp of store_regs reads for o = ol + j."""
    rr = 4 // p.elem
    nq = p.tile[0] // rr
    out = []
    for w in range(first, first + 32):
        r = w >> p.group
        og, q = divmod(r, nq)
        ol = ((og << p.group) | (w & ((1 << p.group) - 1))) * p.vec_out
        out.append(((ol + j) * p.pitch + q * rr) * p.elem)
    return out


@pytest.mark.parametrize("shape,axes,item", [
    ((64, 256, 56, 56), NHWC, 1), ((64, 256, 56, 56), NHWC, 2), ((64, 14, 14, 1024), NCHW, 1),
    ((64, 1024, 14, 14), NHWC, 1), ((64, 1024, 14, 14), NHWC, 2), ((4096, 4096), (1, 0), 1),
    ((8, 64, 16, 56, 56), (0, 2, 3, 4, 1), 2),
])
def test_register_loads_without_bank_conflicts(shape, axes, item):
    """Every warp of the benchmark shapes' row tiles reads 32 distinct banks for each o; in a
    flat input run of 196 (49 items along i) a warp across the end of one row group meets the
    next group's lanes on a bank or two (2 wavefronts), at most once every 49 items."""
    p = plan(shape, axes, item, tuning=ROWS)
    assert p.regs
    items = p.tile[0] // (4 // item) * (p.tile[1] // p.vec_out)
    waves = [_wavefronts(_regs_addresses(p, j, first), 4)
             for first in range(0, items, 32) for j in range(p.vec_out)]
    if p.flat_in:
        assert max(waves) <= 2 and sum(waves) / len(waves) < 1.5, waves
    else:
        assert set(waves) == {1}, waves
    # one shared-memory load a 4 bytes moved, against one an element for the gather
    assert math.prod(p.tile) * item // 4 == items * p.vec_out

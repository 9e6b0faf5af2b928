"""The tile kernel's flat-run interleave (``permute_tile<..., FO = 3>``, the tuning's
perm_flat_regs) without a GPU: where the planner picks it and where it keeps the gather, the
Tuning override, and a model of both phases of ``permute_tile`` with FO (phase 1's whole-word
shared-memory stores, ``perm::store_flat``'s index arithmetic) run in Python on tiles of every
edge (partial tiles along i, runs off multiples of the store word, flat input runs, 1-, 2- and
4-byte elements): every output element written once from the right bytes, every shared-memory
access aligned and inside the tile, every full store word aligned; and the banks both phases
touch."""

from __future__ import annotations

import dataclasses
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
OFF = dataclasses.replace(HOPPER, perm_flat_regs=())


# ---------------------------------------------------------------------------------------------
# Where the planner takes it.

@pytest.mark.parametrize("shape,axes,item", [
    ((64, 3, 224, 224), NHWC, 1), ((64, 3, 224, 224), NHWC, 2), ((64, 3, 224, 224), NHWC, 4),
    ((256, 3, 224, 224), NHWC, 2), ((1, 3, 9, 16), NHWC, 1),
    ((2, 3, 4, 32, 32), (0, 2, 3, 4, 1), 2),
    ((3, 4096), (1, 0), 1), ((3, 8192), (1, 0), 2), ((3, 8192), (1, 0), 4),
])
def test_flat_interleave_is_planned(shape, axes, item):
    p = plan(shape, axes, item)
    assert p.kind == "tile" and p.flat_out and p.flat_regs == 3 and not p.regs, str(p)
    assert p.o_dim.size == 3 and p.vec_out * p.elem == 16 and p.vec_in * p.elem >= 4
    assert p.targs[6] == 3 and p.kernel.endswith(", false, 3>")
    assert p.targs in set(pp.reachable_steps())
    assert "interleaved in registers (perm_flat_regs)" in str(p)
    q = plan(shape, axes, item, tuning=OFF)  # the switch off: the gather, padded rows
    assert not q.flat_regs and q.kernel == p.kernel.replace(", false, 3>", ">")
    assert "gathers one" in str(q)
    if p.flat_in:
        assert p.pitch == q.pitch == p.i_dim.size
    else:  # unpadded rows: 16-byte aligned
        assert q.pitch % 8 == 4 and p.pitch == p.tile[0] and p.smem <= q.smem
    same = dataclasses.replace(q, flat_regs=3, targs=p.targs, kernel=p.kernel, pitch=p.pitch,
                               smem=p.smem)
    assert same == p


@pytest.mark.parametrize("shape,axes,item,why", [
    ((64, 7, 7, 2048), NCHW, 2, "a flat output run of 49-element blocks"),
    ((64, 7, 7, 2048), NCHW, 1, "a flat output run of 49-element blocks"),
    ((64, 5, 224, 224), NHWC, 1, "C = 5"),
    ((4, 3, 5, 5), NHWC, 2, "a batch stride of 75 elements: stores under 16 bytes"),
    ((64, 3, 224, 224), NHWC, 8, "8-byte elements"),
    ((64, 224, 224, 3), NCHW, 1, "a flat input run of 3 (output rows)"),
])
def test_gather_is_kept(shape, axes, item, why):
    p = plan(shape, axes, item)
    assert not p.flat_regs, why
    assert not p.kernel.endswith(", 3>")


def test_misaligned_pointers_keep_the_gather():
    for align in (1, 2, 4, 8):
        p = plan((8, 3, 32, 32), NHWC, 1, out_align=align)
        assert p.flat_out and p.vec_out == align and not p.flat_regs
    p = plan((8, 3, 32, 32), NHWC, 1, in_align=2)  # 2-byte loads: under 4 bytes
    assert p.flat_out and p.vec_in == 2 and not p.flat_regs
    p = plan((8, 3, 32, 32), NHWC, 1, in_align=4)  # 4-byte loads
    assert p.vec_in == 4 and p.flat_regs == 3


def test_only_the_sizes_in_the_tuning():
    only1 = dataclasses.replace(HOPPER, perm_flat_regs=(1,))
    assert plan((64, 3, 224, 224), NHWC, 1, tuning=only1).flat_regs
    assert not plan((64, 3, 224, 224), NHWC, 2, tuning=only1).flat_regs
    # perm_byte_regs does not switch it
    assert plan((64, 3, 224, 224), NHWC, 2,
                tuning=dataclasses.replace(HOPPER, perm_byte_regs=())).flat_regs
    for bad in ((8,), (3,), (1, 16)):
        with pytest.raises(ValueError, match="perm_flat_regs"):
            plan((64, 3, 224, 224), NHWC, 1,
                 tuning=dataclasses.replace(HOPPER, perm_flat_regs=bad))


def test_tuning_table_and_source():
    assert HOPPER.perm_flat_regs == (1, 2, 4) == pp.FLAT_SIZES
    src = _compile.source("permute")
    assert "int FO = 0" in src and "store_flat" in src
    names = fam.kernel_names("permute")()
    flat = sorted(n for n in names if n.endswith(", 3>"))
    assert len(flat) == 18
    for n in flat:
        m = re.match(r"cukern::permute_tile<unsigned (char|short|int), (\d+), (\d+), "
                     r"(int|long long), false, 3>$", n)
        assert m, n
        e = {"char": 1, "short": 2, "int": 4}[m.group(1)]
        assert int(m.group(2)) * e >= 4 and int(m.group(3)) * e == 16


# ---------------------------------------------------------------------------------------------
# Both phases of permute_tile<..., FO>, modelled.

def phase1(p: pp.PermutePlan, x_tile: np.ndarray, ti_e: int, smem: bytearray) -> None:
    """Phase 1's shared-memory stores of one tile (x_tile: (3, ti_e, elem) bytes, input
    order): the kernel's word loop, each word stored whole (SU = VI * E) where aligned."""
    e, vi, ti, to = p.elem, p.vec_in, *p.tile
    if p.flat_in:
        n_in = to * ti_e
        words = -(-n_in // vi)
    else:
        words = to * (ti // vi)
    flat = x_tile.reshape(-1, e)
    for w in range(words):
        if p.flat_in:
            q = w * vi
            nv, at = min(vi, n_in - q), q
            src = [flat[q + j] for j in range(nv)]
        else:
            ol, il = divmod(w, ti // vi)
            il *= vi
            nv = min(vi, ti_e - il) if ol < to and ti_e - il > 0 else 0
            at = ol * p.pitch + il
            src = [x_tile[ol, il + j] for j in range(nv)]
        if nv == vi:  # one store of VI * E bytes: aligned to it
            assert (at * e) % (vi * e) == 0 and (at + vi) * e <= p.smem, (w, at)
        for j in range(nv):
            smem[(at + j) * e:(at + j + 1) * e] = bytes(src[j])


def store_flat(p: pp.PermutePlan, ti_e: int, y0: int, smem: bytes) -> dict:
    """Output offset (elements, from the output pointer) -> bytes that perm::store_flat
    writes for one tile whose run starts at y0: the kernel's arithmetic, word by word."""
    e, vo, fo = p.elem, p.vec_out, p.flat_regs
    n_out = ti_e * fo
    words = -(-n_out // vo)
    written: dict = {}
    for w in range(words):
        u, kk = divmod(w, fo)
        rows = []
        for ol in range(fo):
            at = (u * vo + ol * p.pitch) * e
            assert at % 16 == 0 and at + 16 <= p.smem, (w, ol, at)
            rows.append(smem[at:at + 16])
        out = [[b""] * vo for _ in range(fo)]
        for q in range(fo * vo):
            r = rows[q % fo]
            out[q // vo][q % vo] = r[(q // fo) * e:(q // fo + 1) * e]
        v = out[kk]
        nv = min(vo, n_out - w * vo)
        g = y0 + w * vo
        if nv == vo:
            assert (g * e) % 16 == 0, (w, g)
        for j in range(nv):
            assert g + j not in written
            written[g + j] = v[j]
    return written


# (element bytes, batch, si, o_in, out_base): x (batch, 3, si) with channel rows o_in apart
# (a slice of wider rows where o_in > si) into y (batch, si, 3), the output offset out_base
# elements from a 16-byte aligned pointer; planned with tiles down to 16 bytes (TINY), so that
# short runs and flat input runs (si * elem < 32) take the tile kernel too.
FLAT_CASES = [
    (1, 2, 50176, 50176, 0),     # (2, 3, 224, 224) int8: row tiles of 2048
    (1, 1, 2100, 2112, 0),       # a partial last tile of 52 (not a multiple of 16)
    (1, 1, 37, 48, 0),           # i = 37 in a tile of 64: a run of 111 bytes
    (1, 2, 16, 16, 16),          # a flat input run of 16, out= 16 elements in
    (2, 2, 50176, 50176, 8),     # (2, 3, 224, 224) float16, output 16 bytes in
    (2, 1, 1030, 1032, 0),       # a partial last tile of 6
    (2, 1, 81, 88, 0),           # 9x9 planes as a row tile: a run of 243
    (2, 3, 8, 8, 0),             # a flat input run of 8
    (4, 2, 1000, 1000, 0),       # float32: 1000 = 512 + 488
    (4, 1, 25, 28, 4),           # 5x5 planes as rows, out= 16 bytes in
    (4, 1, 7, 8, 0),             # a run of 21 elements in one tile
    (4, 2, 4, 4, 0),             # a flat input run of 4
]
TINY = dataclasses.replace(HOPPER, perm_tile_min_bytes=16)


def flat_case_plan(case, tuning=TINY) -> pp.PermutePlan:
    """The plan of one FLAT_CASES transpose."""
    item, b, si, o_in, out_base = case
    s = pp.simplify((b, si, 3), (3 * o_in, 1, o_in), (si * 3, 3, 1))._replace(
        out_offset=out_base)
    return pp.plan_permute(s, item, H100, signature=fam.name_expression, tuning=tuning)


def _id(case) -> str:
    return "{}B-b{}-i{}-in{}-at{}".format(*case)


PLANS = [(_id(c), c, flat_case_plan(c)) for c in FLAT_CASES]


@pytest.mark.parametrize("name,case,p", PLANS, ids=[n for n, _, _ in PLANS])
def test_flat_model_writes_the_transpose(name, case, p):
    item, b, si, o_in, out_base = case
    assert p.kind == "tile" and p.flat_regs == 3 and p.flat_out, (name, str(p))
    assert p.out_base == out_base and p.i_dim.out_stride == 3
    ti = p.tile[0]
    assert p.flat_in == (o_in == si and si * item < 32), str(p)
    assert p.pitch == (si if p.flat_in else ti), str(p)
    nti = 1 if p.flat_in else -(-si // ti)
    rng = np.random.default_rng(len(name) + si)
    x = rng.integers(0, 256, (3, si, item), dtype=np.uint8)
    y: dict = {}
    for t in range(nti):
        i0 = t * ti
        ti_e = min(ti, si - i0)
        smem = bytearray(rng.integers(0, 256, p.smem, dtype=np.uint8).tobytes())  # garbage
        phase1(p, x[:, i0:i0 + ti_e], ti_e, smem)
        got = store_flat(p, ti_e, out_base + i0 * 3, bytes(smem))
        assert not set(got) & set(y), "a tile wrote over another"
        y.update(got)
    assert set(y) == set(range(out_base, out_base + si * 3)), name
    for q, v in y.items():
        il, ol = divmod(q - out_base, 3)
        assert v == x[ol, il].tobytes(), (name, il, ol)


def test_flat_model_covers_the_edges():
    seen = set()
    for _, (item, _b, si, _o_in, out_base), p in PLANS:
        seen.add((item, p.flat_in))
        ti = p.tile[0]
        last = si - (si - 1) // ti * ti
        if not p.flat_in and si % ti:
            seen.add(("partial tile", item))
        if last * 3 % p.vec_out:
            seen.add(("run off the word", item))
        if out_base:
            seen.add(("offset", item))
    for want in [(1, False), (1, True), (2, False), (2, True), (4, False), (4, True),
                 ("partial tile", 1), ("partial tile", 2), ("partial tile", 4),
                 ("run off the word", 1), ("run off the word", 2), ("run off the word", 4),
                 ("offset", 1), ("offset", 2), ("offset", 4)]:
        assert want in seen, want


@pytest.mark.parametrize("shape,item", [((64, 3, 224, 224), 1), ((64, 3, 224, 224), 2),
                                        ((64, 3, 224, 224), 4), ((8, 3, 36, 56), 2)])
def test_banks(shape, item):
    """Phase 2: each of a warp's 16-byte row-chunk loads reads consecutive chunks (three lanes
    a chunk, the same address: a broadcast), no more wavefronts than any 16-byte warp load,
    where the gather makes one load an element. Phase 1: a warp's whole-word stores are
    contiguous (unpadded rows): no bank conflicts (the gather's padded rows split int8 and
    float16 words into 4- and 8-byte stores)."""
    p = plan(shape, NHWC, item)
    assert p.flat_regs == 3 and not p.flat_in
    e, vo, vi, ti = p.elem, p.vec_out, p.vec_in, p.tile[0]
    words = -(-ti * 3 // vo)
    for first in range(0, words, 32):
        for ol in range(3):
            addrs = [((w // 3) * vo + ol * p.pitch) * e
                     for w in range(first, min(first + 32, words))]
            assert _wavefronts(addrs, 16) <= 4 and len({a // 16 for a in addrs}) <= 12
    in_words = ti // vi
    for first in range(0, 3 * in_words, 32):
        addrs = [((w // in_words) * p.pitch + (w % in_words) * vi) * e
                 for w in range(first, min(first + 32, 3 * in_words))]
        ideal = -(-len(addrs) * vi * e // 128)
        assert _wavefronts(addrs, vi * e) == ideal

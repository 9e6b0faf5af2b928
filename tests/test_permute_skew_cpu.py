"""The tile kernel's skewed-column phase 2 (``permute_tile<..., SK = D>``, the tuning's
perm_skew_regs) without a GPU: where the planner picks it (flat output runs of channels of
L = D (mod VO) elements: 7x7, 14x14 and int8 28x28 planes NHWC -> NCHW) and where it keeps the
gather or row tiles, the Tuning override, and a model of phase 1 and ``perm::store_skew`` run
in Python on tiles of every edge (partial tiles, runs whose end is off the word, each D, 1- and
2-byte elements): every output element written once from the right bytes through the same
``__byte_perm`` selectors, every shared-memory load aligned and inside the tile, every full
store aligned; and the shared-memory wavefronts per 512 bytes of output against the gather."""

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
OFF = dataclasses.replace(HOPPER, perm_skew_regs=())


# ---------------------------------------------------------------------------------------------
# Where the planner takes it.

@pytest.mark.parametrize("shape,item,d,tile", [
    ((64, 7, 7, 2048), 1, 1, (128, 49)), ((256, 7, 7, 2048), 2, 1, (64, 49)),
    ((64, 14, 14, 1024), 1, 4, (64, 196)), ((64, 14, 14, 1024), 2, 4, (32, 196)),
    ((64, 28, 28, 512), 1, 0, (32, 784)), ((2, 9, 9, 96), 1, 1, (64, 81)),
    ((2, 5, 5, 64), 2, 1, (64, 25)), ((2, 3, 3, 64), 2, 1, (64, 9)),
])
def test_skewed_columns_are_planned(shape, item, d, tile):
    p = plan(shape, NCHW, item)
    assert p.kind == "tile" and p.flat_out and not p.flat_in and p.skew_regs, str(p)
    assert not p.regs and not p.flat_regs and p.tile == tile
    assert p.vec_in * item == 16 and p.vec_out * item == 16 and p.pitch % 8 == 4
    assert p.targs[7] == d == p.o_dim.size % p.vec_out
    assert p.kernel.endswith(f", false, 0, {d}>") and p.targs in set(pp.reachable_steps())
    words = 2 if item == 1 else 4  # the table's perm_skew_words
    assert "rows skewed" in str(p) and f"(perm_skew_regs; lanes store {words} words" in str(p)
    assert p.tile[0] * item >= 32  # phase 1 loads whole sectors a tile row


@pytest.mark.parametrize("shape,item,before", [
    ((64, 7, 7, 2048), 1, "flat"), ((64, 7, 7, 2048), 2, "flat"),
    ((64, 14, 14, 1024), 1, "rows"), ((64, 14, 14, 1024), 2, "rows"),
    ((64, 28, 28, 512), 1, "rows"),
])
def test_switch_off_is_the_old_plan(shape, item, before):
    """perm_skew_regs () plans as before: the gather of 7x7 runs, row tiles of longer ones."""
    q = plan(shape, NCHW, item, tuning=OFF)
    assert not q.skew_regs and q.targs[7] == -1
    assert q.flat_out == (before == "flat"), str(q)
    if before == "rows":
        assert q.regs and q.tile[1] == 64


@pytest.mark.parametrize("shape,axes,item,why", [
    ((64, 28, 28, 512), NCHW, 2, "fp16 rows of 1568 bytes: whole sectors, row tiles"),
    ((64, 14, 14, 1024), NCHW, 4, "4-byte elements"),
    ((64, 7, 7, 2048), NCHW, 4, "4-byte elements: the gather"),
    ((64, 5, 5, 64), NCHW, 1, "int8 L = 25 = 9 (mod 16)"),
    ((2, 3, 3, 64), NCHW, 1, "int8 L = 9 under the 16-byte word"),
    ((4, 7, 7, 40), NCHW, 1, "a batch stride of 1960 bytes: stores under 16 bytes"),
    ((64, 2048, 7, 7), NHWC, 1, "a flat input run"),
    ((64, 3, 224, 224), NHWC, 1, "C = 3: the flat-run interleave"),
    ((8, 46, 46, 512), NCHW, 1, "int8 L = 2116 over perm_flat_max_bytes: stays rows"),
])
def test_kept(shape, axes, item, why):
    p = plan(shape, axes, item)
    assert not p.skew_regs and p.targs[7] == -1, (why, str(p))
    assert not re.search(r", false, 0, \d>$", p.kernel)


def test_only_the_sizes_in_the_tuning():
    only1 = dataclasses.replace(HOPPER, perm_skew_regs=(1,))
    assert plan((64, 7, 7, 2048), NCHW, 1, tuning=only1).skew_regs
    assert not plan((64, 7, 7, 2048), NCHW, 2, tuning=only1).skew_regs
    # the other switches do not change it
    assert plan((64, 14, 14, 1024), NCHW, 2, tuning=dataclasses.replace(
        HOPPER, perm_byte_regs=(), perm_flat_regs=())).skew_regs
    for bad in ((4,), (8,), (1, 16)):
        with pytest.raises(ValueError, match="perm_skew_regs"):
            plan((64, 7, 7, 2048), NCHW, 1,
                 tuning=dataclasses.replace(HOPPER, perm_skew_regs=bad))


def test_misaligned_pointers_keep_the_old_plan():
    for align in (1, 2, 4, 8):
        p = plan((8, 14, 14, 1024), NCHW, 1, out_align=align)
        assert not p.skew_regs, str(p)
        p = plan((8, 14, 14, 1024), NCHW, 1, in_align=align)
        assert not p.skew_regs, str(p)
    assert plan((8, 14, 14, 1024), NCHW, 1, in_align=16, out_align=16).skew_regs


def test_tuning_table_and_source():
    assert HOPPER.perm_skew_regs == (1, 2) == pp.SKEW_SIZES
    src = _compile.source("permute")
    assert "int SK = -1" in src and "store_skew" in src
    names = fam.kernel_names("permute")()
    skew = sorted(n for n in names if re.search(r", false, 0, \d>$", n))
    assert len(skew) == 12  # 2 sizes x D in (0, 1, 4) x 2 index widths
    for n in skew:
        m = re.match(r"cukern::permute_tile<unsigned (char|short), (\d+), (\d+), "
                     r"(int|long long), false, 0, ([014])>$", n)
        assert m, n
        e = {"char": 1, "short": 2}[m.group(1)]
        assert int(m.group(2)) * e == 16 == int(m.group(3)) * e


# ---------------------------------------------------------------------------------------------
# Both phases of permute_tile<..., SK>, modelled.

def skew_spill(e: int, d: int) -> int:
    """perm::skew_spill: loads of the column before an item makes at most."""
    r, vo = 4 // e, 16 // e
    return 0 if (r * d) % vo == 0 else vo - np.gcd(r * d, vo)


def phase1(p: pp.PermutePlan, x_tile: np.ndarray, ti_e: int, smem: bytearray) -> None:
    """Phase 1 of one row tile (x_tile: (L, ti_e, elem) bytes, input order): tile row ol at
    ol * pitch, elements ti_e.. of each row left as they were (garbage)."""
    e, pitch = p.elem, p.pitch
    assert (pitch * e) % 4 == 0
    for ol in range(x_tile.shape[0]):
        at = ol * pitch * e
        smem[at:at + ti_e * e] = x_tile[ol].tobytes()


def _byte_perm(x: int, y: int, s: int) -> int:
    b = x.to_bytes(4, "little") + y.to_bytes(4, "little")
    return int.from_bytes(bytes(b[(s >> (4 * n)) & 7] for n in range(4)), "little")


def store_skew(p: pp.PermutePlan, ti_e: int, y0: int, smem: bytes, loads=None) -> dict:
    """Output offset (elements) -> bytes that perm::store_skew writes for one tile whose run
    starts at y0: the kernel's arithmetic item by item (``loads``: item -> the byte addresses
    of its 32-bit loads, for the bank model)."""
    e, vo, d = p.elem, p.vec_out, p.targs[7]
    r, ti, L = 4 // e, p.tile[0], p.o_dim.size
    ns_slots, na = vo + (r - 1) * d, skew_spill(e, d)
    n_out = ti_e * L
    nu, k_items = ti // r, L // vo + 1
    pw, gk = p.pitch // r, p.group

    def word(index: int) -> int:
        at = index * 4
        assert at % 4 == 0 and 0 <= at and at + 4 <= p.smem, index
        if loads is not None:
            loads.setdefault(it, []).append(at)
        return int.from_bytes(smem[at:at + 4], "little")

    written: dict = {}
    for it in range((nu * -(-k_items // (1 << gk))) << gk):
        kb, u = divmod(it >> gk, nu)
        k = (kb << gk) + (it & ((1 << gk) - 1))
        c0 = u * r
        b = (c0 * L) & (vo - 1) if na else 0
        assert b == (c0 * L) & (vo - 1) and b + (r - 1) * d < vo
        t0 = k * vo - b - (r - 1) * d
        ns = -t0 if t0 < 0 else 0
        w = []
        for q in range(ns_slots):
            t = t0 + q + L if t0 + q < 0 else t0 + q
            w.append(word(t * pw + u) if t < L else 0)
        sp = [word((t0 + (r - 1) * d + m + L) * pw + u - 1) if m < ns - (r - 1) * d else 0
              for m in range(na)]
        for j in range(r):
            c = c0 + j
            wc = (c * L) // vo
            g = wc + k
            if k >= ((c + 1) * L) // vo - wc or g * vo >= n_out:
                continue
            src, sel = [], []
            for m in range(vo):
                q = m + (r - 1 - j) * d
                neg = q < ns
                if j == 0 and m < na and neg:
                    src.append(sp[m])
                    sel.append(r - 1)
                else:
                    assert not (j == 0 and neg), "j = 0 before row 0 past the spill loads"
                    src.append(w[q])
                    sel.append(j - 1 if neg else j)
            out = b""
            for m4 in range(4):
                s_, l_ = src[m4 * r:(m4 + 1) * r], sel[m4 * r:(m4 + 1) * r]
                if r == 4:
                    lo = _byte_perm(s_[0], s_[1], l_[0] | (l_[1] + 4) << 4)
                    hi = _byte_perm(s_[2], s_[3], l_[2] | (l_[3] + 4) << 4)
                    v = _byte_perm(lo, hi, 0x5410)
                else:
                    h0, h1 = 2 * l_[0], 2 * l_[1] + 4
                    v = _byte_perm(s_[0], s_[1], h0 | (h0 + 1) << 4 | h1 << 8 | (h1 + 1) << 12)
                out += v.to_bytes(4, "little")
            full = (g + 1) * vo <= n_out
            if full:
                assert ((y0 + g * vo) * e) % 16 == 0, (it, j, g)
            for x in range(vo if full else n_out - g * vo):
                assert y0 + g * vo + x not in written, (it, j, x)
                written[y0 + g * vo + x] = out[x * e:(x + 1) * e]
    return written


# (element bytes, batch, C (i), input row pitch, HW (L, o), out_base): x (batch, HW, C), a
# slice of channel rows c_in apart (16-byte loads), into y (batch, C, HW) out_base elements into
# a 16-byte aligned buffer: each D, partial tiles and columns, runs whose end is off the word
# (a batch of one: no batch stride to align), L just over the word.
SKEW_CASES = [
    (1, 2, 256, 256, 49, 0),     # 7x7: D = 1, two tiles of 128
    (1, 1, 300, 304, 49, 0),     # tiles of 128, 128, 44: the run ends 12 bytes into a word
    (1, 1, 37, 48, 49, 0),       # one partial tile of 37 (ti 64): a partial column
    (1, 2, 64, 64, 196, 16),     # 14x14: D = 4, out= 16 elements in
    (1, 1, 45, 48, 196, 0),      # a partial tile of 13
    (1, 2, 64, 64, 784, 0),      # 28x28: D = 0
    (1, 1, 50, 64, 784, 0),      # a partial tile of 18
    (1, 1, 70, 80, 17, 0),       # L = 17: two words a channel at most, skew 1
    (1, 1, 40, 48, 81, 0),       # 9x9
    (2, 2, 128, 128, 49, 8),     # fp16 7x7: D = 1, out= 16 bytes in
    (2, 1, 75, 80, 49, 0),       # a partial tile of 11
    (2, 2, 32, 32, 196, 0),      # 14x14: D = 4
    (2, 1, 23, 24, 196, 0),      # a partial tile of 7
    (2, 1, 33, 40, 9, 0),        # L = 9: one word and an element, skew 1
    (2, 1, 21, 24, 25, 0),       # 5x5
    (2, 1, 41, 48, 24, 0),       # D = 0 (48-byte rows split sectors), a partial tile of 41
]


def skew_case_plan(case, tuning=HOPPER) -> pp.PermutePlan:
    """The plan of one SKEW_CASES permute."""
    item, b, c, c_in, L, out_base = case
    s = pp.simplify((b, c, L), (L * c_in, 1, c_in), (c * L, L, 1))._replace(
        out_offset=out_base)
    return pp.plan_permute(s, item, H100, signature=fam.name_expression, tuning=tuning)


def _id(case) -> str:
    return "{}B-b{}-c{}-in{}-L{}-at{}".format(*case)


PLANS = [(_id(c), c, skew_case_plan(c)) for c in SKEW_CASES]


def run_model(p: pp.PermutePlan, x: np.ndarray, out_base: int, seed: int) -> dict:
    """y (offset -> bytes) for x (L, C, elem) through the model, tile by tile, over shared
    memory that starts as garbage."""
    rng = np.random.default_rng(seed)
    L, c = x.shape[:2]
    ti = p.tile[0]
    y: dict = {}
    for t in range(-(-c // ti)):
        i0 = t * ti
        ti_e = min(ti, c - i0)
        smem = bytearray(rng.integers(0, 256, p.smem, dtype=np.uint8).tobytes())
        phase1(p, x[:, i0:i0 + ti_e], ti_e, smem)
        got = store_skew(p, ti_e, out_base + i0 * L, bytes(smem))
        assert not set(got) & set(y), "a tile wrote over another"
        y.update(got)
    return y


@pytest.mark.parametrize("name,case,p", PLANS, ids=[n for n, _, _ in PLANS])
def test_skew_model_writes_the_transpose(name, case, p):
    item, b, c, _c_in, L, out_base = case
    assert p.kind == "tile" and p.skew_regs and p.flat_out, (name, str(p))
    assert p.out_base == out_base and p.i_dim.out_stride == L and p.targs[7] == L % p.vec_out
    rng = np.random.default_rng(c * L + item)
    x = rng.integers(0, 256, (L, c, item), dtype=np.uint8)
    y = run_model(p, x, out_base, c + L)
    assert set(y) == set(range(out_base, out_base + c * L)), name
    for q, v in y.items():
        il, ol = divmod(q - out_base, L)
        assert v == x[ol, il].tobytes(), (name, il, ol)


@pytest.mark.parametrize("words", [1, 4, 8, 16])
@pytest.mark.parametrize("case", [SKEW_CASES[k] for k in (1, 2, 4, 6, 7, 10, 12, 13, 15)],
                         ids=_id)
def test_skew_model_other_lane_runs(case, words):
    """perm_skew_words other than the default: the same bytes, each once."""
    p = skew_case_plan(case, dataclasses.replace(HOPPER, perm_skew_words=(words, words)))
    assert p.skew_regs and p.group == words.bit_length() - 1
    assert f"lanes store {words} words" in str(p)
    item, b, c, _c_in, L, out_base = case
    rng = np.random.default_rng(words * c + L)
    x = rng.integers(0, 256, (L, c, item), dtype=np.uint8)
    y = run_model(p, x, out_base, words)
    assert set(y) == set(range(out_base, out_base + c * L))
    for q, v in y.items():
        il, ol = divmod(q - out_base, L)
        assert v == x[ol, il].tobytes(), (il, ol)


def test_skew_words_checked():
    for words in ((3, 2), (2,), (2, 4, 4)):
        with pytest.raises(ValueError, match="perm_skew_words"):
            plan((64, 7, 7, 2048), NCHW, 1,
                 tuning=dataclasses.replace(HOPPER, perm_skew_words=words))
    # the table's: 2 words for int8, 4 for 16-bit elements
    p = plan((64, 7, 7, 2048), NCHW, 1)
    assert p.group == 1 and "lanes store 2 words of a channel" in str(p)
    p = plan((64, 7, 7, 2048), NCHW, 2)
    assert p.group == 2 and "lanes store 4 words of a channel" in str(p)


def test_skew_model_covers_the_edges():
    seen = set()
    for _, (item, _b, c, _c_in, L, out_base), p in PLANS:
        ti = p.tile[0]
        seen.add((item, p.targs[7]))
        last = c - (c - 1) // ti * ti
        if c % ti:
            seen.add(("partial tile", item))
        if last % 4:
            seen.add(("partial column", item))
        if last * L % p.vec_out:
            seen.add(("run off the word", item))
        if out_base:
            seen.add(("offset", item))
    for want in [(1, 0), (1, 1), (1, 4), (2, 0), (2, 1), (2, 4),
                 ("partial tile", 1), ("partial tile", 2), ("partial column", 1),
                 ("run off the word", 1), ("run off the word", 2), ("offset", 1), ("offset", 2)]:
        assert want in seen, want


# ---------------------------------------------------------------------------------------------
# Shared-memory wavefronts a warp per 512 bytes of output, and loads a 16-byte word.

def _phase2_cost(p: pp.PermutePlan) -> tuple[float, float]:
    """(wavefronts, load instructions) a warp of store_skew spends per 512 bytes of output,
    over one full tile (warps of 32 consecutive items; the q-th load of each lane of a warp
    one instruction)."""
    c, L = p.tile[0], p.o_dim.size
    e, vo, r = p.elem, p.vec_out, 4 // p.elem
    loads: dict = {}  # item -> byte addresses of its loads, in order
    store_skew(p, c, 0, bytes(p.smem), loads=loads)
    items = ((c // r) * -(-(L // vo + 1) // (1 << p.group))) << p.group
    wave = instr = 0
    for w0 in range(0, items, 32):
        lanes = [loads.get(it, []) for it in range(w0, min(w0 + 32, items))]
        for q in range(max(len(a) for a in lanes)):
            wave += _wavefronts([a[q] for a in lanes if q < len(a)], 4)
            instr += 1
    out_bytes = c * L * e
    return wave * 512 / out_bytes, instr * 512 / out_bytes


def _gather_cost(p: pp.PermutePlan) -> float:
    """Wavefronts a warp of the flat gather (one element a load) spends per 512 bytes."""
    c, L = p.tile[0], p.o_dim.size
    e, vo, pitch = p.elem, p.vec_out, p.pitch
    words = c * L // vo
    wave = 0
    for w0 in range(0, words, 32):
        for j in range(vo):
            addrs = []
            for w in range(w0, min(w0 + 32, words)):
                il, ol = divmod(w * vo + j, L)
                addrs.append((ol * pitch + il) * e)
            wave += _wavefronts(addrs, e)
    return wave * 512 / (c * L * e)


@pytest.mark.parametrize("shape,item,words,most,gather", [
    ((64, 7, 7, 2048), 1, 2, 11, 99), ((64, 7, 7, 2048), 2, 2, 8, 29),
    ((64, 14, 14, 1024), 1, 2, 8, None), ((64, 14, 14, 1024), 2, 2, 6.5, None),
    ((64, 28, 28, 512), 1, 2, 8.5, None),
    ((64, 7, 7, 2048), 2, 4, 15.5, 29), ((64, 14, 14, 1024), 2, 4, 12.5, None),
])
def test_banks(shape, item, words, most, gather):
    """Phase 2's 32-bit loads: at most ``most`` wavefronts a warp per 512 bytes of output
    (the model's figures: the REGS phase 2 of row tiles makes 4, with stores that split
    sectors between tiles; the gather of a 7x7 run ``gather``). 16 columns a tile put a warp's
    two k of a pair and 16 columns on distinct banks; 8 (int8 28x28, 25 KB tiles) 2-way. Lanes
    storing 4 words of a channel (the table's for 16-bit elements) meet 2-way conflicts: about
    twice the wavefronts, yet they measured faster (longer store runs; policy.py)."""
    tuning = dataclasses.replace(HOPPER, perm_skew_words=(words, words))
    p = plan(shape, NCHW, item, tuning=tuning)
    wave, instr = _phase2_cost(p)
    assert wave <= most, (wave, instr)
    assert instr <= 8.5
    if gather:
        q = plan(shape, NCHW, item, tuning=OFF)
        assert q.flat_out and _gather_cost(q) >= gather > (2 if words == 2 else 1.8) * wave


def test_benchmark_flags():
    """bench_permute.py's --skew-regs / --ab-skew-regs (benchmarks/_permute_regs.py)."""
    import argparse
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "_permute_regs.py"
    spec = importlib.util.spec_from_file_location("_permute_regs", path)
    regs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regs)
    ap = argparse.ArgumentParser()
    regs.add_args(ap)
    changes, ab = regs.from_args(ap.parse_args(["--ab-skew-regs"]))
    assert changes == {} and ab == ("skew",)
    changes, ab = regs.from_args(ap.parse_args(["--skew-regs", "none", "--ab-byte-regs",
                                                "--flat-regs", "1,4"]))
    assert changes == {"perm_skew_regs": (), "perm_flat_regs": (1, 4)} and ab == ("byte",)
    assert regs.from_args(ap.parse_args(["--skew-regs", "2,1"]))[0] == {
        "perm_skew_regs": (1, 2)}
    with pytest.raises(SystemExit):
        ap.parse_args(["--skew-regs", "4"])
    assert regs.SWITCHES["skew"] == ("perm_skew_regs", "skew_regs", pp.SKEW_SIZES)
    assert regs.from_args(ap.parse_args(["--skew-words", "4", "--ab-skew-regs"])) == (
        {"perm_skew_words": (4, 4)}, ("skew",))
    with pytest.raises(SystemExit):
        ap.parse_args(["--skew-words", "3"])


def test_kernel_source_on_the_host(tmp_path):
    """perm::store_skew itself (the header's code, not the model), compiled by the host's C++
    compiler with the CUDA builtins stubbed (tests/permute_skew_host.cpp) and run over tiles
    of 1..ti channels, runs of every D, 1- and 2-byte elements, lane runs of 1, 2, 4, 16."""
    import shutil
    import subprocess
    from pathlib import Path

    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    root = Path(__file__).resolve().parents[1]
    exe = tmp_path / "skew_host"
    subprocess.run([cxx, "-std=c++17", "-O1", "-w", f'-DPERMUTE_CUH="{root}/kernels/permute.cuh"',
                    "-o", str(exe), str(root / "tests" / "permute_skew_host.cpp")],
                   check=True, capture_output=True, timeout=300)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith(" 0 failed"), out.stdout
    assert int(out.stdout.split()[0]) > 5000

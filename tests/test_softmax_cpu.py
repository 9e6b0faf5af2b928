"""Softmax family tests that need no GPU: planning, NVRTC compilation, references, layouts."""

from __future__ import annotations

import itertools
import sys
import types

import numpy as np
import pytest

import cukern
from cukern import _compile, reference, registry, runner
from cukern import plan as planner
from cukern._device import DeviceSpec
from cukern.ops import softmax as softmax_ops
from cukern.plan import HOPPER, Variant, plan_rowwise

from .conftest import NVRTC_ARCHS, block_tail, cluster_tail, nvrtc_results

H100 = DeviceSpec.h100()
A100 = DeviceSpec.a100()
FWD = ("softmax", "log_softmax")
BWD = ("softmax_backward", "log_softmax_backward")
ITEM = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


# ---------------------------------------------------------------------------------------------
# Planner: the documented rules, one shape at a time.

LONG = 2**23  # rows enough for many waves of the warp kernel
# (cols, rows, dtype) -> (pack, width, cols_per_thread, rows_per_access, padding). The warp
# kernel holds a power-of-two number of packs per lane, so cols_per_thread rounds up.
WARP_TABLE = [
    (1, 8, "float32", 1, 1, 1, 2, False),
    (1, 7, "float32", 1, 1, 1, 1, False),
    (2, 8, "float32", 2, 1, 2, 2, False),
    (31, 10, "float16", 1, 32, 1, 2, True),
    (32, 10, "float16", 8, 4, 8, 2, False),
    (32, 9, "float32", 4, 8, 4, 1, False),
    (33, 9, "float32", 1, 32, 2, 1, True),
    (64, 4, "float32", 4, 16, 4, 2, False),
    (64, 4, "float16", 8, 8, 8, 2, False),
    (129, 4, "float32", 1, 32, 8, 1, True),  # 5 packs of 1 -> 8
    (256, 4, "float16", 8, 32, 8, 2, False),
    (264, 4, "float16", 8, 32, 16, 1, True),
    (1000, 49152, "float16", 8, 32, 32, 1, True),
    (1023, 3, "float32", 1, 32, 32, 1, True),
    (1024, 3, "float32", 4, 32, 32, 1, False),
    (1024, 3, "float64", 2, 32, 32, 1, False),
    (1024, 3, "bfloat16", 8, 32, 32, 1, False),
]


@pytest.mark.parametrize("op", FWD + BWD)
@pytest.mark.parametrize("cols,rows,dtype,pack,width,cpt,rpa,padding", WARP_TABLE)
def test_warp_plans(op, cols, rows, dtype, pack, width, cpt, rpa, padding):
    # rows + LONG: the same parity on a grid long enough for OneFlow's rows_per_access rule;
    # arrays whose rows start at different offsets in their 16-byte words (no shifted packs)
    p = plan_rowwise(op, rows + LONG, cols, dtype, H100, shift_ok=False)
    assert p.variant is Variant.WARP
    assert (p.pack_size, p.thread_group_width, p.cols_per_thread, p.rows_per_access,
            p.padding) == (pack, width, cpt, rpa, padding)
    assert p.block == (width, 128 // width)
    # every column is covered once by (pack id, lane), with the fewest packs a power of two
    # allows
    npacks = cpt // pack
    assert npacks & (npacks - 1) == 0  # a power of two
    assert cpt * width >= cols  # every column has a slot
    assert cols <= pack * width or cpt // 2 * width < cols  # and not twice as many as needed
    assert p.smem_bytes == 0


def test_short_grids_take_one_row_per_access():
    # float16, 32 columns: groups of 4 lanes, 32 a block; one wave is 132 SMs x 16 blocks
    wave = 132 * (2048 // 128)
    edge = HOPPER.short_grid_waves * wave * 32  # rows whose one-row grid is exactly 4 waves
    for op in FWD + BWD:
        assert plan_rowwise(op, 49152, 32, "float16", H100).rows_per_access == 1
        assert plan_rowwise(op, edge, 32, "float16", H100).rows_per_access == 1
        assert plan_rowwise(op, edge + 32, 32, "float16", H100).rows_per_access == 2
        assert plan_rowwise(op, edge + 33, 32, "float16", H100).rows_per_access == 1  # odd


def test_pack_respects_alignment_and_stride():
    assert plan_rowwise("softmax", 8, 64, "float16", H100, align_elems=16).pack_size == 8
    for align in (4, 1):  # arrays whose rows start at different offsets of their 16-byte words
        assert plan_rowwise("softmax", 8, 64, "float16", H100, align_elems=align,
                            shift_ok=False).pack_size == align
    assert plan_rowwise("softmax", 8, 62, "float16", H100, shift_ok=False).pack_size == 2
    assert plan_rowwise("softmax", 8, 64, "float16", H100, strided=True).pack_size == 1


# (cols, dtype, align_elems) of rows off the 16-byte grid -> (variant, pack, cols the plan is
# sized for: the most a row's packs span, its first element anywhere in its first pack)
SHIFTED = [
    (513, "float16", 16, Variant.WARP, 8, 520),  # warp rows: 32 values a lane either way
    (700, "float16", 16, Variant.WARP, 8, 712),
    (1001, "float16", 16, Variant.WARP, 8, 1008),
    (1001, "float32", 16, Variant.WARP, 4, 1004),
    (1017, "float16", 16, Variant.WARP, 8, 1024),  # the warp kernel's widest
    (1025, "float32", 16, Variant.BLOCK_SMEM, 4, 1028),
    (50257, "float16", 16, Variant.BLOCK_SMEM, 8, 50264),
    (10001, "float64", 16, Variant.BLOCK_SMEM, 2, 10002),
    (262143, "float32", 16, Variant.CLUSTER, 4, 262148),
]


@pytest.mark.parametrize("op", FWD + BWD)
@pytest.mark.parametrize("cols,dtype,align,variant,pack,sized", SHIFTED)
def test_rows_off_the_grid_take_shifted_16_byte_packs(op, cols, dtype, align, variant, pack,
                                                      sized):
    p = plan_rowwise(op, 4096, cols, dtype, H100, align_elems=align)
    assert (p.variant, p.pack_size, p.shifted, p.cols) == (variant, pack, True, cols), p
    assert p.name_expression().endswith(", true>")
    assert "shifted" in str(p)
    if variant is Variant.WARP:
        assert p.cols_per_thread * p.thread_group_width >= sized
        assert p.cols_per_thread // 2 * p.thread_group_width < sized or p.cols_per_thread == pack
    elif variant is Variant.BLOCK_SMEM:  # the row's packs (then the all-reduce's buffers)
        assert p.smem_bytes >= sized * ITEM[dtype] * registry.policy(op).inputs
    # not shifted: rows on the grid, arrays at other offsets, strided columns, short rows
    same = plan_rowwise(op, 4096, cols, dtype, H100, align_elems=align, shift_ok=False)
    assert not same.shifted and same.pack_size < pack
    assert not plan_rowwise(op, 4096, cols, dtype, H100, strided=True).shifted
    assert not plan_rowwise(op, 4096, 1024, dtype, H100).shifted
    assert not plan_rowwise(op, 4096, 4 * pack - 1, dtype, H100).shifted
    # nor warp rows whose shifted packs would leave slots empty that narrow packs fill
    for c in (33, 127, 255, 333, 511):
        assert not plan_rowwise(op, 4096, c, dtype, H100).shifted, c
    # nor rows the warp kernel holds whose packs would span more than it holds: narrow packs
    for c, align in ((1023, 16), (1024, 2)):
        if pack > align and planner.rowwise.shifted_cols(c, pack) > 1024:
            p = plan_rowwise(op, 4096, c, dtype, H100, align_elems=align)
            assert p.variant is Variant.WARP and not p.shifted, p


def test_same_offsets():
    assert runner.same_offsets(2, [32, 64 + 16], [1001])
    assert runner.same_offsets(2, [2, 18, 34], [1001, 1001 + 8])
    assert not runner.same_offsets(2, [2, 16], [1001])
    assert not runner.same_offsets(2, [0, 0], [1001, 1002])
    assert runner.same_offsets(4, [4, 20], [])
    assert not runner.same_offsets(4, [0, 0], [3, 5])


def test_grids():
    # the warp kernel: a block for every 8 groups of 16 lanes, each group 2 rows (no cap)
    p = plan_rowwise("softmax", 10**7, 64, "float32", H100)
    assert (p.block, p.rows_per_access) == ((16, 8), 2)
    assert p.grid == 10**7 // 16
    # the block kernels: OneFlow's GetNumBlocks, at most 32 waves of resident threads
    p = plan_rowwise("softmax", 10**7, 2048, "float32", H100)
    assert p.variant is Variant.BLOCK_SMEM and p.block == (128, 1)
    assert p.grid == 132 * 2048 // 128 * 32
    p = plan_rowwise("softmax", 5, 64, "float32", H100)
    assert p.grid == 1  # 5 rows, one per group of 16 lanes, 8 groups a block
    p = plan_rowwise("softmax", 3, 4096, "float32", H100)
    assert p.grid == 3


def test_widths_tied_on_threads_take_the_fewest_load_rounds():
    """Of block widths with as many threads resident (registers: 12 blocks of 128 or 6 of 256
    an SM), the forward takes the one whose threads load the row in one round of 4 packs;
    the backward (no load_round) keeps OneFlow's width; a block alone on its SM ranks last."""
    def occ(blocks):
        return lambda plan: blocks.get(plan.threads, 0)

    regs = occ({128: 12, 256: 6, 512: 3, 1024: 1})  # 1536 threads resident but at 1024
    for op in FWD:
        assert plan_rowwise(op, 16384, 8192, "float16", H100, regs).threads == 256  # 4 packs
        assert plan_rowwise(op, 16384, 4096, "float16", H100, regs).threads == 128  # 4 packs
    for op in BWD:
        assert plan_rowwise(op, 16384, 8192, "float16", H100, regs).threads == 128
    lone = occ({128: 3, 256: 3, 512: 2, 1024: 1})  # 1024 threads with 512 or 1024
    for op in FWD:
        assert plan_rowwise(op, 8192, 16384, "float32", H100, lone).threads == 512


@pytest.mark.parametrize("cols, dtype", [(65536, "float16"), (32768, "float32")])
def test_lone_forward_blocks_run_in_one_wave(cols, dtype):
    """A forward block alone on its SM (a 128 KiB row) loops over rows in one wave, its next
    row's loads beside this row's stores; the backward keeps OneFlow's waves of blocks."""
    for op in FWD:
        p = plan_rowwise(op, 2048, cols, dtype, H100)
        assert p.variant is Variant.BLOCK_SMEM and p.threads == 1024, p
        assert p.grid == 132, p
        assert plan_rowwise(op, 100, cols, dtype, H100).grid == 100  # fewer rows than SMs
        # two blocks an SM (a 64 KiB row): OneFlow's waves, one row a block
        assert plan_rowwise(op, 2048, cols // 2, dtype, H100).grid == 2048
    for op in BWD:
        p = plan_rowwise(op, 2048, cols // 2, dtype, H100)
        assert p.variant is Variant.BLOCK_SMEM and p.threads == 1024, p
        assert p.grid == 2048, p


def _block_tail(op, dtype, threads):
    tail = block_tail(op, dtype, threads)
    assert (dtype in registry.policy(op).tail_in_blocks) == (tail > 0)
    return tail


def _smem_boundary(op, dtype, device):
    """Largest cols (a multiple of the widest pack) whose row(s) fit one block's shared memory
    beside the all-reduce's buffers of its narrowest block (128 threads)."""
    inputs = registry.policy(op).inputs
    pack = 16 // ITEM[dtype]
    limit = device.smem_per_block_optin - HOPPER.static_smem - _block_tail(op, dtype, 128)
    return limit // (ITEM[dtype] * inputs) // pack * pack


@pytest.mark.parametrize("op", FWD + BWD)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_block_smem_boundary(op, dtype):
    edge = _smem_boundary(op, dtype, H100)
    inside = plan_rowwise(op, 1000, edge, dtype, H100)
    assert inside.variant is Variant.BLOCK_SMEM
    assert inside.smem_bytes == edge * ITEM[dtype] * registry.policy(op).inputs + \
        _block_tail(op, dtype, inside.threads)
    assert inside.smem_bytes <= planner.max_dynamic_smem(H100)
    below = plan_rowwise(op, 1000, edge - 1, dtype, H100, shift_ok=False)
    assert below.variant is Variant.BLOCK_SMEM
    # in shifted packs, a row's packs may span up to 2 packs less one element more
    shifted = plan_rowwise(op, 1000, edge - 1, dtype, H100)
    fits = planner.rowwise.shifted_cols(edge - 1, 16 // ITEM[dtype]) <= edge
    assert shifted.shifted
    assert shifted.variant is (Variant.BLOCK_SMEM if fits else Variant.CLUSTER)
    above = plan_rowwise(op, 1000, edge + planner.pack_size(dtype, edge, 16, False), dtype,
                         H100)
    assert above.variant is Variant.CLUSTER  # Hopper: the row moves to a cluster
    assert above.cluster == 2  # the smallest cluster that holds the row
    # Ampere has no clusters: the same row is read twice from memory
    a_edge = _smem_boundary(op, dtype, A100)
    assert plan_rowwise(op, 1000, a_edge, dtype, A100).variant is Variant.BLOCK_SMEM
    assert plan_rowwise(op, 1000, a_edge + 8, dtype, A100).variant is Variant.BLOCK_UNCACHED


def test_block_size_follows_occupancy_rule():
    # Shared memory limits residency: 1024 threads keep the same number of blocks.
    p = plan_rowwise("softmax", 4096, 32768, "float32", H100)  # 128 KiB per block: 1 per SM
    assert p.variant is Variant.BLOCK_SMEM and p.block == (1024, 1)
    assert p.name_expression() == "cukern::softmax_block_smem<float, 0, false, 4, 1024>"
    # Shared memory and threads alone would fit two 1024-thread blocks of a 64 KiB row, but the
    # width compiled in may use 64 registers a thread: one such block an SM (the model knows),
    # so 512 threads, three blocks, keep the most resident.
    p = plan_rowwise("softmax", 4096, 32768, "float16", H100)
    assert p.block == (512, 1) and p.name_expression().endswith(", 0>")
    assert planner.model_occupancy(H100)(planner.replace(p, block=(1024, 1))) == 1
    # Threads limit residency: 128 threads give 16 blocks, no larger block matches it.
    p = plan_rowwise("softmax", 4096, 2048, "float32", H100)
    assert p.block == (128, 1)
    assert p.name_expression() == "cukern::softmax_block_smem<float, 0, false, 4, 0>"

    # Registers limit residency (47 a thread, as float32 softmax at 16384 columns takes): 128
    # and 256 threads fit 3 blocks of 64 KiB, 512 fit 2, 1024 one. OneFlow's rule (the widest
    # with the 128-thread count) would take 256, 768 threads; the planner takes the narrowest
    # width that keeps the most resident: 512, 1024 threads.
    def regs47(plan):
        by_regs = 65536 // (plan.threads // 32 * 48 * 32)
        return min(H100.model_occupancy(plan.threads, plan.smem_bytes), by_regs)

    p = plan_rowwise("softmax", 8192, 16384, "float32", H100, regs47)
    assert p.variant is Variant.BLOCK_SMEM and p.block == (512, 1) and regs47(p) == 2

    # A driver that reports 0 blocks for anything makes the block kernel unusable.
    def none(plan):
        return 0

    p = plan_rowwise("softmax", 4096, 2048, "float32", H100, none)
    assert p.variant is Variant.BLOCK_UNCACHED and p.block == (1024, 1)


def test_cluster_rule():
    """_plan_cluster: the smallest cluster whose blocks of 256 (or 512) threads share an SM
    two or more at a time with at least the op's resident threads; else the smallest cluster
    that fits, widest block; one wave of clusters for softmax, OneFlow's waves for the norms.
    A block's dynamic shared memory ends with its reduction buffers: the all-reduce's two a warp
    and the cluster merge's four, of softmax's (max, sum) forward, its sum backward, in float32
    (tail_scratch)."""
    for op in FWD + BWD:
        inputs = registry.policy(op).inputs

        def scratch(threads):
            return cluster_tail(op, "float32", threads)  # float16 data: float32 states too
        # 64 KiB slices: 3 blocks of 256 threads per SM (the device model counts no registers)
        cols = 4 * 32768 // inputs
        p = plan_rowwise(op, 2**27 // cols, cols, "float16", H100)
        assert (p.variant, p.cluster, p.block, p.smem_bytes) == \
            (Variant.CLUSTER, 4, (256, 1), 65536 + scratch(256)), p
        assert p.grid == 132 * 3 // 4 * 4  # one wave of clusters, each looping over rows
        # 1 MiB of cached rows: 16 blocks (past the portable 8) of 64 KiB, 3 per SM
        cols = 262144 // inputs
        p = plan_rowwise(op, 512, cols, "float32", H100)
        assert (p.cluster, p.block, p.smem_bytes) == (16, (256, 1), 65536 + scratch(256)), p
        assert p.grid == 132 * 3 // 16 * 16
        # 2 MiB: 16 blocks of 128 KiB, one per SM, of 1024 threads
        cols = 2 * 262144 // inputs
        p = plan_rowwise(op, 256, cols, "float32", H100)
        assert (p.cluster, p.block, p.smem_bytes) == (16, (1024, 1), 131072 + scratch(1024)), p
        assert p.grid == 132 // 16 * 16
    p = plan_rowwise("layer_norm", 1024, 131072, "float16", H100)
    # 1536 threads an SM; the reduction buffers after the slice, none static (aligned slices)
    assert (p.cluster, p.block, p.smem_bytes) == \
        (4, (512, 1), 65536 + cluster_tail("layer_norm", "float32", 512)), p
    assert p.grid == min(1024, 132 * 3 // 4 * HOPPER.waves) * 4  # the norms: waves

    # the driver may fit fewer clusters than SMs x blocks per SM / cluster size (GPCs)
    def occ(plan):
        return H100.model_occupancy(plan.threads, plan.smem_bytes)

    occ.max_clusters = lambda plan: 90
    p = plan_rowwise("softmax", 1024, 131072, "float16", H100, occ)
    assert p.grid == 90 * 4
    # registers that leave one block of 256 threads an SM: the widest block that launches
    occ2 = lambda plan: 1 if plan.threads <= 256 else 0  # noqa: E731
    p = plan_rowwise("softmax", 1024, 131072, "float16", H100, occ2)
    assert (p.cluster, p.block) == (2, (256, 1)), p


def test_refused_cluster_size_falls_back():
    """A driver that takes no cluster of 16 (the occupancy hook answers 0 for it, as
    runner.driver_occupancy does when the driver fits none) leaves the planner to the
    portable sizes, or to the uncached kernel."""
    def portable_only(plan):
        return 0 if plan.cluster > 8 else H100.model_occupancy(plan.threads, plan.smem_bytes)

    p = plan_rowwise("softmax", 128, 262144, "float32", H100, portable_only)  # 1 MiB row
    assert (p.variant, p.cluster, p.block, p.smem_bytes) == \
        (Variant.CLUSTER, 8, (1024, 1), 131072 + cluster_tail("softmax", "float32", 1024)), p
    p = plan_rowwise("softmax_backward", 128, 262144, "float32", H100, portable_only)  # 2 MiB
    assert p.variant is Variant.BLOCK_UNCACHED, p
    assert plan_rowwise("softmax_backward", 128, 262144, "float32", H100).cluster == 16


def test_cluster_sizes_and_uncached_fallback():
    p = plan_rowwise("softmax", 128, 262144, "float32", H100)  # 1 MiB row
    assert p.variant is Variant.CLUSTER and p.cluster == 16
    assert p.smem_bytes == 262144 * 4 // 16 + cluster_tail("softmax", "float32", p.threads)
    assert p.grid % p.cluster == 0
    p = plan_rowwise("softmax", 8, 10**6, "float32", H100)  # 4 MB row: no cluster holds it
    assert p.variant is Variant.BLOCK_UNCACHED
    p = plan_rowwise("softmax", 8, 65536, "float32", H100, strided=True)
    assert p.variant is Variant.BLOCK_UNCACHED  # clusters need contiguous rows


def test_plan_is_printable_and_hashable():
    p = cukern.explain("softmax", (49152, 1000), "float16", device=H100)
    text = str(p)
    assert "warp" in text and "cukern::softmax_warp<cukern::f16" in text
    assert p == cukern.explain("softmax", (49152, 1000), np.float16, device=H100)
    assert len({p, cukern.explain("softmax", (49152, 1000), "float16", device=H100)}) == 1


def test_explain_axes_and_errors():
    p = cukern.explain("log_softmax", (3, 40, 5), "float32", axis=1, device=H100)
    assert (p.rows, p.cols, p.strided) == (15, 40, True)
    p = cukern.explain("softmax", (3, 40, 1), "float32", axis=1, device=H100)
    assert not p.strided
    with pytest.raises(ValueError, match="unknown op"):
        cukern.explain("sofmax", (4, 4), "float32", device=H100)
    with pytest.raises(ValueError, match="axis"):
        cukern.explain("softmax", (4, 4), "float32", axis=2, device=H100)
    with pytest.raises(TypeError, match="int32"):
        cukern.explain("softmax", (4, 4), "int32", device=H100)
    with pytest.raises(ValueError, match="empty"):
        cukern.explain("softmax", (0, 4), "float32", device=H100)
    with pytest.raises(TypeError, match="device"):
        cukern.explain("softmax", (4, 4), "float32", device=1.5)
    assert cukern.explain("softmax", (4, 4), "float32", device="h100") == \
        cukern.explain("softmax", (4, 4), "float32", device=H100)  # a preset by name


def test_explain_takes_the_command_line_spelling():
    shapes = {"softmax": (8, 1000), "norm": (8, 1000), "batch_norm": (4, 8, 7, 7),
              "permute": (4, 8, 3)}
    for op, spec in registry.OPS.items():
        plan = cukern.explain(spec.cli_name, shapes[spec.family], "float16", device=H100)
        assert str(plan) == str(cukern.explain(op, shapes[spec.family], "float16", device=H100))
    with pytest.raises(ValueError, match="unknown op 'layer_nrom'"):
        cukern.explain("layer-nrom", (4, 4), "float32", device=H100)


@pytest.mark.parametrize("op", FWD + BWD)
def test_longest_row(op):
    """Rows of up to MAX_COLS = 2^31 - 4096 columns are planned, longer ones refused (by the
    planner, so by explain too): the kernels count a row's columns and packs in 32-bit ints,
    and a block's loops step up to 4 x blockDim.x packs past the row's end."""
    longest = planner.MAX_COLS
    assert longest == 2**31 - 4096
    for dtype, align in itertools.product(("float16", "float32", "float64"), (1, 16)):
        p = plan_rowwise(op, 1, longest, dtype, H100, align_elems=align)
        assert p.variant is Variant.BLOCK_UNCACHED and p.block[0] <= 1024
        assert longest // p.pack_size - 1 + 4 * 1024 <= 2**31 - 1  # the furthest pack index
    p = cukern.explain(op, (longest, 3), "float32", axis=0, device=H100)
    assert (p.cols, p.strided) == (longest, True)
    for cols in (longest + 1, 2**31 - 1, 2**31, 2**40):
        says = rf"plan: {op} over rows of {cols} columns; at most 2147479552 \(2\^31 - 4096\)"
        with pytest.raises(ValueError, match=says):
            plan_rowwise(op, 1, cols, "float16", H100)
        with pytest.raises(ValueError, match=says):
            cukern.explain(op, (1, cols), "float16", device=H100)
        with pytest.raises(ValueError, match=says):
            cukern.explain(op, (cols, 2), "float32", axis=0, device=H100)


def test_model_occupancy():
    assert H100.model_occupancy(128, 0) == 16
    assert H100.model_occupancy(1024, 0) == 2
    assert H100.model_occupancy(1024, 131072) == 1
    assert H100.model_occupancy(128, 232448 + 1) == 0
    assert H100.model_occupancy(256, 60000) == 3  # 233472 // 61024


# ---------------------------------------------------------------------------------------------
# NVRTC: every instantiation the planner can produce compiles for Turing, Ampere and Hopper.

@pytest.mark.nvrtc("softmax")
@pytest.mark.parametrize("arch", list(NVRTC_ARCHS))
def test_every_reachable_instantiation_compiles(arch):
    # every kernel the softmax ops can launch, compiled in the background since collection
    # ended (conftest.nvrtc_results): the kernels take the group width and block size at run
    # time, so one (op, dtype) alone reaches fewer than 100 instantiations
    device = getattr(DeviceSpec, NVRTC_ARCHS[arch])()  # the device model the check plans for
    lowered = {}
    for source, _, names, result in nvrtc_results("softmax", arch):
        assert source == "softmax"
        assert set(result) == set(names)
        lowered.update(result)
    for dt in ITEM:
        names = registry.kernel_names(FWD + BWD, [dt], device)["softmax"]
        missing = [n for n in names if not lowered.get(n)]
        assert not missing, (dt, missing[:3])
        assert len(names) > 100, dt


def test_reachable_covers_planner_output():
    reach = {op: {dt: planner.reachable_plans(op, dt, H100) for dt in ITEM} for op in FWD + BWD}
    rng = np.random.default_rng(0)
    for op in FWD + BWD:
        for dt in ITEM:
            for cols in list(range(1, 1100)) + list(rng.integers(1, 3_000_000, 100)):
                for rows in (1, 2):
                    for align in (1, 2, 4, 8, 16):
                        for strided, shift_ok in ((False, False), (False, True), (True, True)):
                            p = plan_rowwise(op, rows, int(cols), dt, H100, align_elems=align,
                                             strided=strided, shift_ok=shift_ok)
                            assert p.name_expression() in reach[op][dt], p


def test_source_inlines_includes_once():
    src = _compile.source("softmax")
    assert '#include "' not in src  # every local include inlined
    assert src.count("struct MaxSum") == 1
    assert "softmax_cluster" in src


# ---------------------------------------------------------------------------------------------
# References.

def test_reference_softmax_properties(rng):
    x = rng.standard_normal((7, 33))
    y = reference.softmax(x)
    np.testing.assert_allclose(y.sum(-1), 1.0, rtol=1e-14)
    np.testing.assert_allclose(reference.softmax(x + 1e3), y, rtol=1e-12)
    np.testing.assert_allclose(np.exp(reference.log_softmax(x)), y, rtol=1e-12)
    assert np.isnan(reference.softmax(np.full((1, 4), -np.inf))).all()


@pytest.mark.parametrize("log", [False, True])
def test_reference_backward_matches_finite_differences(rng, log):
    x = rng.standard_normal((3, 9))
    dy = rng.standard_normal((3, 9))
    fwd = reference.log_softmax if log else reference.softmax
    bwd = reference.log_softmax_backward if log else reference.softmax_backward
    dx = bwd(dy, fwd(x))
    eps = 1e-6
    num = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = eps
        num[idx] = np.sum(dy * (fwd(x + e) - fwd(x - e))) / (2 * eps)
    np.testing.assert_allclose(dx, num, rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# Layout description (pure: works on NumPy arrays).

def test_layout_contiguous_and_views():
    a = np.zeros((4, 6, 5), np.float32)
    assert runner.layout(a, 2) == (24, 5, 1, 5, 0, 1)
    assert runner.layout(a, 1) == (20, 6, 5, 30, 1, 5)
    assert runner.layout(a, 0) == (30, 4, 30, 0, 1, 30)
    b = np.zeros((8, 10), np.float32)[:, :7]
    assert runner.layout(b, 1) == (8, 7, 1, 10, 0, 1)
    assert runner.layout(b.T, 1) == (7, 8, 1, 1, 0, 10)
    c = np.zeros((4, 6, 5), np.float32).transpose(1, 0, 2)[:, :, ::2]
    assert runner.layout(c, 0) is None  # (4, 3) remaining dims cannot merge into one stride
    assert runner.layout(np.zeros((), np.float32), 0) == (1, 1, 1, 0, 0, 1)


def test_align_elems():
    assert runner.align_elems(2, [0, 32], [64]) == 16
    assert runner.align_elems(2, [0, 6], [64]) == 1
    assert runner.align_elems(4, [0, 16], [6]) == 2


def test_host_arrays_are_refused():
    pytest.importorskip("cupy")
    with pytest.raises(TypeError, match="numpy.ndarray"):
        cukern.softmax(np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match="CuPy array"):
        cukern.softmax([1.0, 2.0])


# ---------------------------------------------------------------------------------------------
# The plan and launch caches: bounded.

def test_bounded_dict_drops_its_older_half():
    d = runner.BoundedDict(8)
    for i in range(8):
        d[i] = str(i)
    d[3] = "three"  # stored again: now the newest
    assert list(d) == [0, 1, 2, 4, 5, 6, 7, 3]
    d[8] = "8"  # full: the four oldest go first
    assert list(d) == [5, 6, 7, 3, 8]
    assert d.get(3) == "three" and d.get(0) is None and d[8] == "8"
    for i in range(9, 1000):
        d[i] = str(i)
        assert len(d) <= 8
    assert list(d)[-1] == 999
    one = runner.BoundedDict(1)
    one["a"], one["b"] = 1, 2
    assert dict(one) == {"b": 2}
    with pytest.raises(ValueError, match="maxsize must be >= 1, got 0"):
        runner.BoundedDict(0)


def test_caches_stay_bounded(monkeypatch):
    """The ops' plan and launch caches, keyed by exact shapes and strides, are BoundedDicts:
    100,000 distinct shapes through softmax's keep it at most maxsize long. (The planner
    itself caches nothing.)"""
    from cukern.ops import batch_norm, layer_norm, permute

    for mod in (softmax_ops, layer_norm, batch_norm, permute):
        for name in ("_launches", "_fresh"):
            cache = getattr(mod, name)
            assert type(cache) is runner.BoundedDict, (mod.__name__, name)
            assert cache.maxsize == runner.CACHE_SIZE <= 8192
    cache = runner.BoundedDict()
    monkeypatch.setattr(softmax_ops, "_launches", cache)
    table = 0  # the largest the dict's own table has been
    for rows in range(1, 100_001):
        key = ("softmax", 0, 1, "float16", (rows, 1000), ((2000, 2),), (2000, 2), 0)
        assert cache.get(key) is None
        cache[key] = types.SimpleNamespace(plan=types.SimpleNamespace(rows=rows))  # a Launch
        assert len(cache) <= cache.maxsize
        if rows <= 2 * cache.maxsize:
            table = max(table, sys.getsizeof(cache))
        else:
            assert sys.getsizeof(cache) <= table  # memory flat
    assert softmax_ops.last_plan("softmax").rows == 100_000

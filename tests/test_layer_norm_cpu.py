"""Layer norm / RMS norm tests that need no GPU: planning, NVRTC compilation of every reachable
instantiation, references against independent formulations, argument validation."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import cukern
from cukern import _compile, reference, registry, runner
from cukern import plan as planner
from cukern._device import DeviceSpec
from cukern.families import norm
from cukern.ops import layer_norm as ln
from cukern.plan import HOPPER, Switches, Variant, plan_rowwise, replace
from cukern.registry import policy

from .conftest import NVRTC_ARCHS, cluster_tail, col_sums_expected, nvrtc_results, static_smem

H100 = DeviceSpec.h100()
A100 = DeviceSpec.a100()
H200 = DeviceSpec.h200()
FWD = ("layer_norm", "rms_norm")
BWD = ("layer_norm_backward", "rms_norm_backward")
NORM_OPS = FWD + BWD
WEIGHT = Switches(weight=True)  # a backward's switches with a weight
ITEM = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
CPP = {"float16": "cukern::f16", "bfloat16": "cukern::bf16", "float32": "float",
       "float64": "double"}


def default_switches(op):
    return policy(op).switch_sets[0]


def switch_flags(op, sw, variant=Variant.WARP):
    """``sw`` as the switch flags of the op's ``variant`` kernel's template arguments, in their
    order, "true"/"false" (the forward's weight and bias are kernel arguments of its warp and
    block kernels, template ones of its clusters)."""
    return tuple("true" if getattr(sw, f) else "false"
                 for f in norm.template_switches(op, variant))


def trailing(a, ndims):
    """runner.trailing_layout as (rows, cols, row stride), or None."""
    v = runner.trailing_layout(a, ndims)
    return None if v is None else (v.rows, v.cols, v.s_outer)


# ---------------------------------------------------------------------------------------------
# Planner: the documented rules.

LONG = 2**23  # rows enough for many waves of the warp kernel
# (cols, rows, dtype) -> (pack, width, cols_per_thread, rows_per_access, padding). The norms'
# warp kernel holds a power-of-two number of packs per lane, so cols_per_thread rounds up.
WARP_TABLE = [
    (1, 8, "float32", 1, 1, 1, 2, False),
    (1, 7, "float32", 1, 1, 1, 1, False),
    (2, 8, "float32", 2, 1, 2, 2, False),
    (31, 10, "float16", 1, 32, 1, 2, True),
    (32, 10, "float16", 8, 4, 8, 2, False),
    (32, 9, "float32", 4, 8, 4, 1, False),
    (33, 9, "float32", 1, 32, 2, 1, True),
    (64, 4, "float16", 8, 8, 8, 2, False),
    (24, 4, "float16", 8, 4, 8, 2, True),  # 3 packs of 8
    (40, 4, "float16", 8, 8, 8, 2, True),  # 5 packs of 8
    (100, 4, "float32", 4, 32, 4, 2, True),
    (129, 4, "float32", 1, 32, 8, 1, True),  # 5 packs of 1 -> 8
    (256, 4, "float16", 8, 32, 8, 2, False),
    (264, 4, "float16", 8, 32, 16, 1, True),
    (768, 4, "float16", 8, 32, 32, 1, True),  # 3 packs of 8 -> 4
    (768, 4, "float32", 4, 32, 32, 1, True),  # 6 packs of 4 -> 8
    (1000, 49152, "bfloat16", 8, 32, 32, 1, True),
    (1023, 3, "float32", 1, 32, 32, 1, True),
    (1024, 3, "float32", 4, 32, 32, 1, False),
    (1024, 3, "float64", 2, 32, 32, 1, False),
]


# The forward norms (OpInfo.two_packs_a_lane): rows of 3..8 full 16-byte packs take two packs of
# one row a lane, where the table (OneFlow's rule) has one pack of each of two rows.
TWO_PACKS = {(32, "float16"): (2, 16, 1, False), (32, "float32"): (4, 8, 1, False),
             (64, "float16"): (4, 16, 1, False), (24, "float16"): (2, 16, 1, True),
             (40, "float16"): (4, 16, 1, True)}


@pytest.mark.parametrize("op", NORM_OPS)
@pytest.mark.parametrize("cols,rows,dtype,pack,width,cpt,rpa,padding", WARP_TABLE)
def test_warp_plans(op, cols, rows, dtype, pack, width, cpt, rpa, padding):
    if policy(op).two_packs_a_lane and (cols, dtype) in TWO_PACKS:
        width, cpt, rpa, padding = TWO_PACKS[(cols, dtype)]
    # rows + LONG: the same parity on a grid long enough for OneFlow's rows_per_access rule;
    # arrays at other offsets, so that rows off the 16-byte grid keep narrow packs (the forward
    # takes shifted ones at 1023 float32 columns otherwise: test_norm_shifted_cpu)
    p = plan_rowwise(op, rows + LONG, cols, dtype, H100, shift_ok=False)
    assert p.variant is Variant.WARP
    assert (p.pack_size, p.thread_group_width, p.cols_per_thread, p.rows_per_access,
            p.padding) == (pack, width, cpt, rpa, padding)
    assert p.block == (width, 128 // width)
    npacks = cpt // pack
    assert npacks & (npacks - 1) == 0  # a power of two
    assert cpt * width >= cols  # every column has a slot
    assert cols <= pack * width or cpt // 2 * width < cols  # and not twice as many as needed
    if policy(op).two_packs_a_lane:  # not with a residual: OneFlow's shape
        p = plan_rowwise(op, rows + LONG, cols, dtype, H100, switches=Switches(residual=True),
                         shift_ok=False)
        assert (p.thread_group_width, p.cols_per_thread, p.rows_per_access, p.padding) == \
            next(row[4:] for row in WARP_TABLE if row[:3] == (cols, rows, dtype))
    assert p.smem_bytes == 0


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_h200_two_packs_a_lane(op):
    """The H200's table (Tuning.two_packs_max_packs 32): forward warp rows of 3 up to 32 full
    16-byte packs take two packs of one row a lane (the H100: up to 8), 16-bit layer norm rows
    of more than 8 four (Tuning.warp_four_packs); with a residual, and in smaller packs,
    OneFlow's shape on both; the reachable set of the architecture has both."""
    assert planner.tuning_for(H200).two_packs_max_packs == 32
    assert planner.tuning_for(H100).two_packs_max_packs == 8
    assert planner.tuning_for(H200).warp_four_packs == (("layer_norm", 2),)
    assert planner.tuning_for(H100).warp_four_packs == ()
    four = op == "layer_norm"
    for cols, dtype, h200, h100 in (
            (128, "float16", (4, 32, 1, False) if four else (8, 16, 1, False), (16, 8, 2, False)),
            (200, "bfloat16", (8, 32, 1, True) if four else (16, 16, 1, True), (32, 8, 2, True)),
            (256, "float16", (8, 32, 1, False) if four else (16, 16, 1, False), (32, 8, 2, False)),
            (128, "float32", (16, 8, 1, False), (32, 4, 2, False)),
            (64, "float16", (4, 16, 1, False), (4, 16, 1, False)),
            (512, "float16", (32, 16, 1, False), (32, 16, 1, False))):
        for device, want in ((H200, h200), (H100, h100)):
            p = plan_rowwise(op, 2 * LONG, cols, dtype, device, switches=Switches(weight=True))
            assert (p.thread_group_width, p.cols_per_thread, p.rows_per_access,
                    p.padding) == want, (device.name, cols, dtype, p)
            assert p.name_expression() in planner.reachable_plans(op, dtype, H100)
        # a residual, or packs under 16 bytes (cols odd in 8), keep the H100's shape
        p = plan_rowwise(op, 2 * LONG, cols, dtype, H200, switches=Switches(residual=True))
        q = plan_rowwise(op, 2 * LONG, cols, dtype, H100, switches=Switches(residual=True))
        assert (p.thread_group_width, p.cols_per_thread) == (q.thread_group_width,
                                                             q.cols_per_thread)
    p = plan_rowwise(op, 2 * LONG, 132, "float16", H200)  # packs of 4 (8 bytes)
    assert (p.pack_size, p.thread_group_width, p.cols_per_thread) == (4, 32, 8)


def test_name_expressions():
    p = plan_rowwise("layer_norm", 4096, 768, "float16", H100,
                     switches=Switches(weight=True, bias=True))
    assert p.name_expression() == \
        "cukern::layer_norm_warp<cukern::f16, 0, 8, 32, 1, false, true>"
    # the forward's weight and bias: compiled in where both are given (AFFINE, the last
    # argument), else null pointers where absent: one kernel for the other three
    assert {plan_rowwise("layer_norm", 4096, 768, "float16", H100, switches=Switches(w, b)
                         ).name_expression() for w in (False, True) for b in (False, True)} == \
        {p.name_expression(), "cukern::layer_norm_warp<cukern::f16, 0, 8, 32, 1, false, false>"}
    p = plan_rowwise("rms_norm", 4096, 4096, "bfloat16", H100,
                     switches=Switches(weight=True, residual=True))
    assert not p.overlap  # the fifth argument: whether blocks overlap their rows
    assert p.name_expression() == \
        "cukern::layer_norm_block_smem<cukern::bf16, 1, 8, true, false, true>"
    p = plan_rowwise("layer_norm_backward", 8, 100000, "float32", H100, switches=WEIGHT)
    assert p.variant is Variant.CLUSTER
    regs = "true" if p.sums_in_registers else "false"
    gamma = "true" if p.gamma_in_smem else "false"
    assert p.name_expression() == \
        f"cukern::layer_norm_grad_cluster<float, 0, 4, {p.cluster}, true, {regs}, {gamma}>"
    # the last two arguments: whether the column sums live in registers, and gamma in shared
    # memory (neither without a weight)
    p = plan_rowwise("rms_norm_backward", 8, 3000, "float64", A100)
    assert p.name_expression() == \
        "cukern::layer_norm_grad_block_smem<double, 1, 2, false, false, false>"
    # a forward cluster's last two arguments: MIN_BLOCKS of its __launch_bounds__, 3 for
    # blocks of at most 512 threads that do not overlap rows (at most 40 registers), else 1;
    # and ROWS, the rows it caches a pass (Plan.rows_per_pass)
    p = plan_rowwise("layer_norm", 1024, 131072, "float16", H100,
                     switches=Switches(weight=True, bias=True))
    assert (p.variant, p.threads, p.overlap, p.rows_per_pass) == (Variant.CLUSTER, 512, False, 2)
    assert p.name_expression() == \
        "cukern::layer_norm_cluster<cukern::f16, 0, 8, 8, true, true, false, false, 3, 2>"
    assert replace(p, block=(256, 1)).name_expression().endswith(", false, 3, 2>")
    assert replace(p, block=(1024, 1)).name_expression().endswith(", false, 1, 2>")
    assert replace(p, rows_per_pass=1).name_expression().endswith(", false, 3, 1>")
    p = plan_rowwise("rms_norm", 512, 262144, "float32", H100,
                     switches=Switches(weight=True, residual=True))
    assert p.variant is Variant.CLUSTER and p.overlap
    assert p.name_expression() == \
        f"cukern::layer_norm_cluster<float, 1, 4, {p.cluster}, true, false, true, true, 1, 1>"
    # packs under 16 bytes (a misaligned or odd row whose arrays start at other offsets, so no
    # shifted packs): the cluster's size is set at launch, and is not a template argument
    p = plan_rowwise("layer_norm", 512, 262144, "float32", H100, align_elems=2,
                     switches=Switches(weight=True), shift_ok=False)
    assert (p.variant, p.pack_size, p.launch_cluster) == (Variant.CLUSTER, 2, p.cluster)
    assert p.cluster in (2, 4, 8, 16)
    assert p.name_expression() == \
        "cukern::layer_norm_cluster_dyn<float, 0, 2, true, false, false, false, 3, 1>"
    assert f"{p.cluster} blocks per row (set at launch)" in str(p)
    # the planner's cluster sizes are the ones the kernel's reductions are compiled for; any
    # other is refused before a launch (the kernel would trap)
    assert set(planner.tuning_for(H100).cluster_sizes) <= set(norm.LAUNCH_CLUSTER_SIZES)
    with pytest.raises(ValueError, match="cluster of 3 blocks sized at launch"):
        replace(p, cluster=3, grid=3).name_expression()
    p = plan_rowwise("layer_norm_backward", 8, 100001, "float16", H100, switches=WEIGHT)
    assert (p.variant, p.pack_size, p.launch_cluster) == (Variant.CLUSTER, 1, 1)
    assert p.name_expression().startswith(
        f"cukern::layer_norm_grad_cluster<cukern::f16, 0, 1, {p.cluster}, true,")
    assert plan_rowwise("layer_norm", 512, 262144, "float32", H100).launch_cluster == 1
    # the default switches are the first listed: no weight, no bias, no residual
    assert plan_rowwise("layer_norm", 4, 64, "float32", H100).switches == Switches()
    assert policy("layer_norm").switch_sets[0] == Switches()
    assert plan_rowwise("rms_norm_backward", 4, 64, "float32", H100).switches == Switches()
    assert policy("rms_norm_backward").switch_sets[0] == Switches()


def test_plan_rejects_what_the_kernels_lack():
    with pytest.raises(ValueError, match="strided"):
        plan_rowwise("layer_norm", 4, 64, "float32", H100, strided=True)
    with pytest.raises(ValueError, match="switches"):
        plan_rowwise("rms_norm", 4, 64, "float32", H100, switches=Switches(weight=True, bias=True))
    with pytest.raises(ValueError, match="switches"):
        plan_rowwise("layer_norm", 4, 64, "float32", H100, switches=("true",))  # the old form


def test_pack_respects_alignment():
    for op in NORM_OPS:
        assert plan_rowwise(op, 8, 64, "float16", H100, align_elems=16).pack_size == 8
        assert plan_rowwise(op, 8, 64, "float16", H100, align_elems=2).pack_size == 2
        assert plan_rowwise(op, 8, 66, "float16", H100).pack_size == 2
        assert plan_rowwise(op, 8, 65, "float32", H100).pack_size == 1


def smem_per_col(op, dtype, weight):
    """Shared memory per column of a cached row: the row(s) in their storage type, plus the
    backward's per-column sums (compute type) when there is a weight."""
    sums = policy(op).col_sums if weight else 0
    return ITEM[dtype] * policy(op).inputs + sums * (8 if dtype == "float64" else 4)


def smem_edge(op, dtype, weight, device):
    """Largest cols (a multiple of the widest pack) that one block's shared memory holds,
    beside the bytes that align the row (OpPolicy.smem_align)."""
    pack = 16 // ITEM[dtype]
    room = planner.max_dynamic_smem(device) - policy(op).smem_align
    return room // smem_per_col(op, dtype, weight) // pack * pack


# (a backward with a weight also sums columns, planned by other rules: test_col_sums_shared_memory)
@pytest.mark.parametrize("op,weight", [(op, w) for op in NORM_OPS for w in (False, True)
                                       if not (w and op in BWD)])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_block_smem_boundary(op, dtype, weight):
    sw = replace(policy(op).switch_sets[-1], weight=True) if weight else default_switches(op)
    if policy(op).split_lone_blocks:
        # with a residual: a lone block at the edge would go to a cluster without one
        # (test_lone_blocks_go_to_clusters)
        sw = replace(sw, residual=True)
    assert sw in policy(op).switch_sets
    edge = smem_edge(op, dtype, weight, H100)
    wide = 16 // ITEM[dtype]
    inside = plan_rowwise(op, 1000, edge, dtype, H100, switches=sw)
    assert inside.variant is Variant.BLOCK_SMEM
    align = policy(op).smem_align
    # the backward's kernels start their cached rows on 128-byte boundaries with 128 bytes
    # more; the forward's are aligned as they are (static buffers of 256-byte multiples in a
    # block, none in a cluster, whose reduction buffers follow its slice)
    assert align == (128 if op in BWD else 0)
    assert inside.smem_bytes == edge * smem_per_col(op, dtype, weight and op in BWD) + align
    above = plan_rowwise(op, 1000, edge + wide, dtype, H100, switches=sw)
    assert above.variant is Variant.CLUSTER  # Hopper: the row moves to a cluster
    tail = 0 if op in BWD else cluster_tail(op, dtype, above.threads)
    assert above.smem_bytes == -(-(edge + wide) // wide // above.cluster) * wide * \
        smem_per_col(op, dtype, weight and op in BWD) + align + tail
    assert above.smem_bytes <= planner.max_dynamic_smem(H100)
    a_edge = smem_edge(op, dtype, weight, A100)
    assert plan_rowwise(op, 1000, a_edge, dtype, A100, switches=sw).variant is Variant.BLOCK_SMEM
    assert plan_rowwise(op, 1000, a_edge + wide, dtype, A100,
                        switches=sw).variant is Variant.BLOCK_UNCACHED


@pytest.mark.parametrize("op", FWD)
def test_lone_blocks_go_to_clusters(op):
    # float16 rows of 65536: one block of 1024 threads per SM (128 KiB) -> two blocks of 512
    # sharing SMs three at a time (rule 1 of _plan_cluster), OneFlow's waves of clusters
    p = plan_rowwise(op, 2048, 65536, "float16", H100)
    assert (p.variant, p.cluster, p.block, p.smem_bytes) == \
        (Variant.CLUSTER, 2, (512, 1), 32768 * 2 + cluster_tail(op, "float32", 512)), p
    assert p.grid == min(2048, 132 * 3 // 2 * HOPPER.waves) * 2
    assert "alone on its SM" in p.notes[-1]
    assert plan_rowwise(op, 2048, 32768, "float32", H100).variant is Variant.CLUSTER
    # registers that leave blocks of 256 threads five an SM, where six of 128 fit (1280 threads
    # against 768; bfloat16 at 16384 columns, H200): not lone, the block stays, and with no
    # wider block as many an SM as of 128 threads (OneFlow's rule), the most threads: 256
    by_regs = {128: 6, 256: 5, 512: 2, 1024: 1}

    def occ(plan):  # the clusters' blocks (16 KiB each) six an SM
        if plan.variant is Variant.BLOCK_SMEM:
            return by_regs[plan.threads]
        return H100.model_occupancy(plan.threads, plan.smem_bytes)

    p = plan_rowwise(op, 8192, 16384, "bfloat16", H100, occ)
    assert (p.variant, p.threads) == (Variant.BLOCK_SMEM, 256), p
    # blocks that share an SM stay: float16 rows of 32768 (3 blocks of 512 threads per SM)
    p = plan_rowwise(op, 4096, 32768, "float16", H100)
    assert p.variant is Variant.BLOCK_SMEM and p.threads * H100.model_occupancy(
        p.threads, p.smem_bytes) > HOPPER.lone_block_resident
    # a residual keeps the lone block, which loads its next row while it writes this one
    sw = replace(policy(op).switch_sets[-1], residual=True)
    p = plan_rowwise(op, 2048, 65536, "float16", H100, switches=sw)
    assert p.variant is Variant.BLOCK_SMEM and p.overlap
    # no cluster whose blocks share an SM: the lone block stays; no clusters at all (A100) too
    p = plan_rowwise(op, 2048, 65536, "float16", H100, lambda plan: 1)
    assert p.variant is Variant.BLOCK_SMEM and p.threads == 1024
    assert plan_rowwise(op, 2048, 65536, "float16", A100).variant is Variant.BLOCK_SMEM
    # other ops keep their lone blocks (measured only for the forward norms)
    for other, cols in (("softmax", 65536), ("layer_norm_backward", 32768)):  # 128 KiB
        assert not policy(other).split_lone_blocks
        p = plan_rowwise(other, 2048, cols, "float16", H100)
        assert p.variant is Variant.BLOCK_SMEM and p.threads == 1024, p


def test_layer_norm_float32_keeps_three_blocks_of_512():
    """Rows of 64 KiB: 3 blocks of 512 threads an SM (OneFlow's width, 1536 threads) or 2 of
    1024 (more threads). Layer norm float32 without a residual keeps the 3 blocks
    (OpPolicy.oneflow_width_dtypes); RMS norm, 16-bit rows and residual rows take the 1024."""
    for device in (H100, H200):
        for cols in (14848, 16384, 18944):
            p = plan_rowwise("layer_norm", 8192, cols, "float32", device,
                             switches=Switches(True, True, False))
            assert (p.variant, p.threads) == (Variant.BLOCK_SMEM, 512), p
            assert device.model_occupancy(p.threads, p.smem_bytes) == 3
            assert device.model_occupancy(1024, p.smem_bytes) == 2  # 2048 threads an SM
        wider = [plan_rowwise("rms_norm", 8192, 16384, "float32", device),
                 plan_rowwise("layer_norm", 4096, 32768, "float16", device),
                 plan_rowwise("layer_norm", 4096, 32768, "bfloat16", device),
                 plan_rowwise("layer_norm", 8192, 16384, "float32", device,
                              switches=Switches(True, True, True))]
        for p in wider:
            assert (p.variant, p.threads) == (Variant.BLOCK_SMEM, 1024), p
        # 6 blocks of 256 (OneFlow's width at 8192 columns): not few, the rule does not apply
        p = plan_rowwise("layer_norm", 8192, 8192, "float32", device)
        assert p.threads * device.model_occupancy(p.threads, p.smem_bytes) == 2048, p
    assert registry.policy("layer_norm").oneflow_width_dtypes == ("float32",)
    assert registry.policy("rms_norm").oneflow_width_dtypes == ()


@pytest.mark.parametrize("device", [H100, H200], ids=["h100", "h200"])
@pytest.mark.parametrize("op", BWD)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_col_sums_shared_memory(op, dtype, device):
    pack = 16 // ITEM[dtype]
    for cols in (1024, 2048, 3000, 4096, 8192, 10000, 12288, 13000, 16384, 18000, 20000, 24000,
                 32768, 65536, 131072, 262144):
        cols = cols // pack * pack
        for occ in (None, lambda plan: 1, lambda plan: 2):
            p = plan_rowwise(op, 1000, cols, dtype, device, occ, switches=WEIGHT)
            expected = col_sums_expected(op, dtype, cols, device, occ)
            if expected is None:
                assert p.variant is Variant.BLOCK_UNCACHED, (cols, p)
                continue
            size, threads, smem, in_regs, gamma = expected
            assert p.variant is (Variant.BLOCK_SMEM if size == 1 else Variant.CLUSTER), (cols, p)
            assert (p.cluster, p.threads, p.smem_bytes, p.sums_in_registers,
                    p.gamma_in_smem) == expected, (cols, p)
            assert p.name_expression().endswith(f", true, {str(in_regs).lower()}, "
                                                f"{str(gamma).lower()}>")
            per_sm = occ(p) if occ else device.model_occupancy(threads, smem)
            assert p.grid == min(1000 * size, device.sms * per_sm // size * size)
    rms = op == "rms_norm_backward"
    sums = policy(op).col_sums * 4  # bytes per column

    def way(p):
        return p.variant, p.threads, p.smem_bytes, p.sums_in_registers, p.gamma_in_smem

    # gamma in shared memory first, even where it costs resident blocks: RMS norm float16 8192
    # columns, two 512-thread blocks per SM without it (98432 bytes each), one of 1024 threads
    # with it (resident threads 1024 either way)
    if rms:
        p = plan_rowwise(op, 1000, 8192, "float16", H100, switches=WEIGHT)
        assert way(p) == (Variant.BLOCK_SMEM, 1024, 2 * 2 * 2 * 8192 + sums * 8192 + 4 * 8192 +
                          128, False, True)
    # then resident threads nearest 1024: rows of 2048 halves (256 packs), 9 blocks of 128
    # threads (1152 threads) before 8 of 256 (2048); layer norm's sums in registers, two
    # buffers, RMS norm's in shared memory, one buffer (24704 bytes either way)
    p = plan_rowwise(op, 1000, 2048, "float16", H100, switches=WEIGHT)
    expected = (2 * 2 * 2048 + sums * 2048, False) if rms else (2 * 2 * 2 * 2048, True)
    assert way(p) == (Variant.BLOCK_SMEM, 128, expected[0] + 4 * 2048 + 128, expected[1], True)
    assert H100.model_occupancy(128, p.smem_bytes) == 9
    # a block alone on its SM that cannot hold x and dy twice beside gamma and shared-memory
    # sums (float16 16384 columns: layer norm's sums would be in registers, RMS norm's beside
    # one buffer) hands the row to clusters that can: RMS norm 2 blocks of 512 threads (the
    # smaller cluster, blocks nearest 512); layer norm takes its narrow way first (8 blocks of
    # 128 threads, 5 per SM: test_layer_norm_narrow_way), and without it (a driver that
    # keeps fewer than three such blocks an SM) 4 blocks of 256 threads, two per SM (resident
    # threads nearest 512 among those with two)
    occ2 = None if rms else (lambda plan: min(2, H100.model_occupancy(plan.threads,
                                                                      plan.smem_bytes)))
    p = plan_rowwise(op, 1000, 16384, "float16", H100, occ2, switches=WEIGHT)
    size = 2 if rms else 4
    values = 16384 // size
    assert (way(p), p.cluster) == ((Variant.CLUSTER, 512 if rms else 256,
                                    2 * 2 * 2 * values + sums * values + 4 * values + 128, False,
                                    True), size)
    assert H100.model_occupancy(p.threads, p.smem_bytes) == (1 if rms else 2)
    # with one block per SM everywhere (a live device counting registers), layer norm's
    # clusters of 2 blocks of 512 threads too (resident nearest 512, the smaller cluster)
    p = plan_rowwise(op, 1000, 16384, "float16", H100, lambda plan: 1, switches=WEIGHT)
    assert (p.variant, p.cluster, p.threads) == (Variant.CLUSTER, 2, 512)
    # float32 rows: a lone block stays beside one buffer, gamma and shared sums (10000 columns)
    p = plan_rowwise(op, 1000, 10000, "float32", H100, lambda plan: 1, switches=WEIGHT)
    assert p.variant is Variant.BLOCK_SMEM and p.gamma_in_smem and not p.sums_in_registers
    assert p.smem_bytes == 2 * 4 * 10000 + sums * 10000 + 4 * 10000 + 128
    # and float16 rows the same size in bytes do not (20000 columns: no block fits beside
    # gamma; clusters with two buffers)
    p = plan_rowwise(op, 1000, 20000, "float16", H100, lambda plan: 1, switches=WEIGHT)
    assert p.variant is Variant.CLUSTER and p.gamma_in_smem and not p.sums_in_registers
    # rows of at most 128 packs (one a thread of 128 threads): sums in registers where the
    # resident threads tie
    p = plan_rowwise(op, 1000, 1024, "float16", H100, lambda plan: 8, switches=WEIGHT)
    assert way(p) == (Variant.BLOCK_SMEM, 128, 2 * 2 * 2 * 1024 + 4 * 1024 + 128, True, True)
    # no gamma in shared memory for float64 (its compute type)
    for cols in (1024, 4096):
        p = plan_rowwise(op, 1000, cols, "float64", H100, switches=WEIGHT)
        assert p.variant is Variant.BLOCK_SMEM and not p.gamma_in_smem


def test_param_reduce_shape():
    """norm_param_grad_reduce's launch: 32 column lanes of 16 bytes of sums where the columns
    divide into them and the grid keeps a block for every other SM, else of one column; row
    lanes the power of two (up to 32) nearest a quarter of the partial rows (an eighth with
    single columns); the grid covers every column."""
    from cukern.plan import param_reduce_shape

    assert param_reduce_shape(32768, 35, 2, "float16", H100) == (True, (32, 8), (256, 2))
    assert param_reduce_shape(16384, 77, 2, "float16", H100) == (True, (32, 16), (128, 2))
    assert param_reduce_shape(65536, 14, 2, "float64", H100) == (True, (32, 4), (1024, 2))
    assert param_reduce_shape(4096, 330, 2, "float16", H100) == (False, (32, 32), (128, 2))
    assert param_reduce_shape(1024, 1056, 2, "float32", H100) == (False, (32, 32), (32, 2))
    assert param_reduce_shape(36001, 35, 2, "float32", H100) == (False, (32, 4), (1126, 2))
    for cols, prows, nacc, dtype in itertools.product((1, 31, 1024, 4100, 36000, 36001, 262144),
                                                      (1, 3, 4, 5, 35, 129, 5000), (1, 2),
                                                      ("float16", "float32", "float64")):
        vec, (lanes, rows), (gx, gy) = param_reduce_shape(cols, prows, nacc, dtype, H100)
        width = 2 if dtype == "float64" else 4
        assert lanes == 32 and gy == nacc
        assert not vec or (cols % width == 0 and 2 * gx * nacc >= H100.sms)
        share = prows / (4 if vec else 8)  # partial rows a row lane, ideally
        assert rows in (1, 2, 4, 8, 16, 32)
        assert rows == 32 or rows * math.sqrt(2) >= share
        assert rows == 1 or rows / math.sqrt(2) < share
        per_block = 32 * (width if vec else 1)
        assert (gx - 1) * per_block < cols <= gx * per_block


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_layer_norm_narrow_way(dtype):
    """Layer norm's backward over 16-bit rows past 2048 columns: in 16-byte packs the first
    of one block a row and clusters of 2, 4, 8, 16 whose slice, held by 128 threads with x
    and dy twice, gamma and the sums in shared memory, keeps three blocks an SM; in 8-byte
    packs the smallest cluster whose slice a block holds with the sums in registers."""
    op = "layer_norm_backward"
    for cols, size, per_sm in ((3000, 1, 3), (4096, 2, 5), (8192, 4, 5), (12288, 4, 3),
                               (16384, 8, 5), (20000, 8, 4), (32768, 16, 5)):
        p = plan_rowwise(op, 10**4, cols, dtype, H100, switches=WEIGHT)
        values = -(-(cols // p.pack_size) // size) * p.pack_size
        assert (p.variant, p.cluster, p.threads, p.sums_in_registers, p.gamma_in_smem) == (
            Variant.BLOCK_SMEM if size == 1 else Variant.CLUSTER, size, 128, False, True), (
            cols, p)
        assert p.smem_bytes == 2 * 2 * 2 * values + 2 * 4 * values + 4 * values + 128
        assert H100.model_occupancy(128, p.smem_bytes) == per_sm, cols
        assert "double-buffered" in p.notes[0], p.notes
    # 8-byte packs (4 mod 8 columns): the smallest cluster whose slice the narrowest block
    # holds with the sums in registers (4 packs a thread), two buffers and gamma
    for cols, size, threads in ((2052, 2, 128), (4100, 2, 256), (10500, 2, 512),
                                (14500, 2, 512), (20004, 2, 1024), (40004, 4, 1024)):
        p = plan_rowwise(op, 10**4, cols, dtype, H100, switches=WEIGHT)
        values = -(-(cols // 4) // size) * 4
        assert p.pack_size == 4
        assert (p.variant, p.cluster, p.threads, p.sums_in_registers, p.gamma_in_smem) == (
            Variant.CLUSTER, size, threads, True, True), (cols, p)
        assert p.smem_bytes == 2 * 2 * 2 * values + 4 * values + 128
        assert p.name_expression().endswith(", true, true, true>"), p.name_expression()
    # neither at 2048 columns and fewer, nor where no S2g way keeps three blocks an SM (65536
    # columns; a driver that counts fewer), nor for 4-byte packs, RMS norm, float32, or
    # devices without clusters
    for cols, dt, occ, device, other in ((2048, dtype, None, H100, op),
                                         (2044, dtype, None, H100, op),
                                         (65536, dtype, None, H100, op),
                                         (8192, dtype, lambda plan: 2, H100, op),
                                         (4098, dtype, None, H100, op),
                                         (8192, dtype, None, H100, "rms_norm_backward"),
                                         (8196, dtype, None, H100, "rms_norm_backward"),
                                         (8192, "float32", None, H100, op),
                                         (3000, dtype, None, A100, op)):
        p = plan_rowwise(other, 10**4, cols, dt, device, occ, switches=WEIGHT)
        assert not (p.threads == 128 and (p.cluster > 1 or cols == 3000)), (cols, other, p)
        assert not (p.cluster > 1 and p.sums_in_registers and p.gamma_in_smem), (cols, p)
        assert p == planner.col_sums_ways(p, device, occ)[0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_h200_backward_ways(dtype):
    """The H200's table (Tuning.norm_bwd_narrow): 16-bit rows in 16-byte packs take layer
    norm's R2g from 2048 columns (one block, then clusters: the narrowest block holding its
    slice with the sums in registers) and RMS norm's narrow S2g past 2048 (128 threads,
    everything on chip, three blocks an SM), else its R2g; the H100 keeps layer norm's S2g and
    no RMS rule; 8-byte packs plan alike on both, and float32 but for its sums in registers
    from 32768 columns."""
    assert planner.tuning_for(H200).norm_bwd_narrow == (
        ("layer_norm_backward", ("r2g",), 1024), ("rms_norm_backward", ("s2g", "r2g"), 2048))
    assert planner.tuning_for(H100).norm_bwd_narrow == (("layer_norm_backward", ("s2g",), 2048),)
    occ = lambda plan: 1  # noqa: E731 (any resident count: the rules' shapes do not depend on it)
    lay, rms = "layer_norm_backward", "rms_norm_backward"
    for cols, size, threads in ((2048, 1, 128), (4096, 1, 256), (8192, 1, 512), (16384, 1, 1024),
                                (32768, 2, 1024), (65536, 4, 1024)):
        p = plan_rowwise(lay, 10**4, cols, dtype, H200, occ, switches=WEIGHT)
        values = cols // size
        assert (p.variant, p.cluster, p.threads, p.sums_in_registers, p.gamma_in_smem) == (
            Variant.BLOCK_SMEM if size == 1 else Variant.CLUSTER, size, threads, True, True), (
            cols, p)
        assert p.smem_bytes == 2 * 2 * 2 * values + 4 * values + 128
        assert p == planner.col_sums_ways(p, H200, occ)[0]
        q = plan_rowwise(lay, 10**4, cols, dtype, H100, occ, switches=WEIGHT)
        assert not q.sums_in_registers or cols == 2048, (cols, q)
    for cols, size in ((4096, 1), (8192, 2), (16384, 4), (32768, 8), (65536, 16)):
        p = plan_rowwise(rms, 10**4, cols, dtype, H200, switches=WEIGHT)
        values = cols // size
        assert (p.variant, p.cluster, p.threads, p.sums_in_registers, p.gamma_in_smem) == (
            Variant.BLOCK_SMEM if size == 1 else Variant.CLUSTER, size, 128, False, True), (
            cols, p)
        assert p.smem_bytes == 2 * 2 * 2 * values + 4 * values + 4 * values + 128
        assert H200.model_occupancy(128, p.smem_bytes) >= 3
        q = plan_rowwise(rms, 10**4, cols, dtype, H100, switches=WEIGHT)
        assert q.threads > 128, (cols, q)
    # RMS norm rows no S2g way holds three times an SM: R2g, the smallest cluster whose slice
    # 1024 threads hold (two packs a thread)
    for cols, size in ((131072, 8), (262144, 16)):
        p = plan_rowwise(rms, 10**3, cols, dtype, H200, occ, switches=WEIGHT)
        values = cols // size
        assert (p.variant, p.cluster, p.threads, p.sums_in_registers, p.gamma_in_smem) == (
            Variant.CLUSTER, size, 1024, True, True), (cols, p)
        assert p.smem_bytes == 2 * 2 * 2 * values + 4 * values + 128
        q = plan_rowwise(rms, 10**3, cols, dtype, H100, occ, switches=WEIGHT)
        assert not q.sums_in_registers or not q.gamma_in_smem, (cols, q)
    # ... and where a driver keeps fewer than three S2g blocks an SM: 8192 columns, one block
    p = plan_rowwise(rms, 10**4, 8192, dtype, H200, lambda plan: 2, switches=WEIGHT)
    assert (p.cluster, p.threads, p.sums_in_registers, p.gamma_in_smem) == (1, 512, True, True)
    # float32 rows of 32768 columns and more (norm_bwd_regs_min_cols_32bit): the H100's way,
    # its sums in registers (the slice four packs a thread or fewer); 36000 columns do not fit
    for op, cols, size, threads in ((lay, 32768, 8, 256), (lay, 65536, 16, 256),
                                    (lay, 131072, 16, 512), (rms, 32768, 4, 512),
                                    (rms, 65536, 8, 512), (rms, 131072, 16, 512)):
        p200 = plan_rowwise(op, 10**3, cols, "float32", H200, switches=WEIGHT)
        p100 = plan_rowwise(op, 10**3, cols, "float32", H100, switches=WEIGHT)
        assert (p200.cluster, p200.threads) == (p100.cluster, p100.threads) == (size, threads)
        assert p200.sums_in_registers and not p100.sums_in_registers, (op, cols)
        assert p200.smem_bytes == p100.smem_bytes - policy(op).col_sums * 4 * (cols // size)
        assert p200 == planner.col_sums_ways(p200, H200)[0]
    p200 = plan_rowwise(lay, 10**3, 36000, "float32", H200, switches=WEIGHT)
    assert not p200.sums_in_registers, p200
    assert planner.tuning_for(H200).norm_bwd_regs_min_cols_32bit == 32768
    assert planner.tuning_for(H100).norm_bwd_regs_min_cols_32bit == 0
    # float32 blocks wider than 128 threads hold two packs a thread of their slice
    # (norm_bwd_min_packs_32bit): with every width at 1024 resident threads, the H100 takes
    # the widest block (a pack a thread), the H200 one of half its width
    assert planner.tuning_for(H200).norm_bwd_min_packs_32bit == 2
    assert planner.tuning_for(H100).norm_bwd_min_packs_32bit == 1
    flat = lambda plan: max(1, 1024 // plan.threads)  # noqa: E731
    for op, cols, t100, t200 in ((lay, 1024, 256, 128), (lay, 2048, 512, 256),
                                 (rms, 4096, 1024, 512)):
        p200 = plan_rowwise(op, 10**4, cols, "float32", H200, flat, switches=WEIGHT)
        p100 = plan_rowwise(op, 10**4, cols, "float32", H100, flat, switches=WEIGHT)
        assert (p100.cluster, p100.threads) == (1, t100), (op, cols, p100)
        assert (p200.cluster, p200.threads) == (1, t200), (op, cols, p200)
        for way in planner.col_sums_ways(p200, H200, flat):
            assert way.threads == 128 or 2 * way.threads <= -(-cols // 4 // way.cluster), way
        assert p200 == planner.col_sums_ways(p200, H200, flat)[0]
    # the general order on both: RMS norm at 2048 columns, 8-byte packs, float32, layer norm at
    # 1024 columns
    for op, cols, dt, o in ((rms, 2048, dtype, None),
                            (lay, 8196, dtype, None), (lay, 8192, "float32", None),
                            (rms, 8192, "float32", None), (lay, 1024, dtype, None)):
        p200 = plan_rowwise(op, 10**4, cols, dt, H200, o, switches=WEIGHT)
        p100 = plan_rowwise(op, 10**4, cols, dt, H100, o, switches=WEIGHT)
        assert (p200.variant, p200.cluster, p200.threads, p200.smem_bytes,
                p200.sums_in_registers) == (p100.variant, p100.cluster, p100.threads,
                                            p100.smem_bytes, p100.sums_in_registers), (op, cols)


@pytest.mark.parametrize("op", BWD)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_col_sums_ways(op, dtype):
    """col_sums_ways lists every way of the cached backward, one block a row or a cluster,
    best first: the planner takes the first; each fits, is distinct, has the grid of one wave
    (of blocks or of clusters) and a note; empty without a weight."""
    limit = planner.max_dynamic_smem(H100)
    for cols in (1024, 3000, 4096, 8192, 13000, 16384, 32768, 65536):
        p = plan_rowwise(op, 1000, cols, dtype, H100, switches=WEIGHT)
        ways = planner.col_sums_ways(p, H100)
        assert ways[0] == p, (cols, p, ways[:1])
        keys = {(w.cluster, w.threads, w.smem_bytes, w.sums_in_registers, w.gamma_in_smem)
                for w in ways}
        assert len(keys) == len(ways)
        # layer norm's narrow way (16-bit rows past 2048 columns) may come first from past
        # the sizes of the rest
        narrow = op == "layer_norm_backward" and dtype == "float16" and cols > 2048 and \
            ways[0].threads == 128 and ways[0].gamma_in_smem and \
            not ways[0].sums_in_registers and \
            H100.model_occupancy(128, ways[0].smem_bytes) >= 3
        assert narrow == (op == "layer_norm_backward" and dtype == "float16" and
                          2048 < cols < 65536), (cols, ways[0])
        sizes = {w.cluster for w in (ways[1:] if narrow else ways)}
        assert max(sizes) <= 4 * min(sizes)
        for w in ways:
            per_sm = H100.model_occupancy(w.threads, w.smem_bytes)
            assert w.smem_bytes <= limit and per_sm > 0
            assert w.variant is (Variant.BLOCK_SMEM if w.cluster == 1 else Variant.CLUSTER)
            assert w.grid == min(1000 * w.cluster, 132 * per_sm // w.cluster * w.cluster)
            assert not (w.gamma_in_smem and dtype == "float64")
            assert w.notes and f"{per_sm} resident per SM" in w.notes[0]
            slice_packs = -(-(cols // w.pack_size) // w.cluster)
            assert w.threads <= max(128, slice_packs)
            assert w.cluster == 1 or slice_packs >= 128
        if cols <= 4096:
            assert 1 in sizes
    unweighted = plan_rowwise(op, 1000, 4096, dtype, H100, switches=Switches())
    assert planner.col_sums_ways(unweighted, H100) == []


@pytest.mark.parametrize("op", BWD)
def test_col_sums_leave_the_warp_kernel_past_512(op):
    # the warp kernel would hold the column sums in registers too: blocks from 513 columns
    assert plan_rowwise(op, 10**5, 512, "float16", H100, switches=WEIGHT).variant is Variant.WARP
    for cols in (513, 1024):
        p = plan_rowwise(op, 10**5, cols, "float16", H100, switches=WEIGHT)
        assert p.variant is Variant.BLOCK_SMEM, p
    assert plan_rowwise(op, 10**5, 1024, "float16", H100).variant is Variant.WARP


@pytest.mark.parametrize("device", [H100, A100, DeviceSpec.t4()], ids=lambda d: d.arch)
def test_rows_of_one_column_never_reach_the_cached_backward(device):
    """The cached backward kernels leave out dx's one-column test (kernels/layer_norm_grad.cuh,
    GradX's ONE): a row of one column must go to the warp kernel (or, with float32 parameters,
    the uncached one), at any row count and alignment."""
    sets = [Switches(), WEIGHT, Switches(weight=True, float32_params=True)]
    for op, dtype, sw, rows, align in itertools.product(BWD, ITEM, sets, (1, 7, 10**6), (1, 16)):
        if sw.float32_params and ITEM[dtype] != 2:
            continue
        p = plan_rowwise(op, rows, 1, dtype, device, align_elems=align, switches=sw)
        assert p.variant in (Variant.WARP, Variant.BLOCK_UNCACHED), p


def test_col_sums_clusters_fit_the_gpu():
    """The one-wave grid of a cluster plan has no more clusters than the driver says fit at
    once (GPC sizes), else a second, nearly empty wave would double the time."""
    def occ(plan):
        return H100.model_occupancy(plan.threads, plan.smem_bytes)

    occ.max_clusters = lambda plan: 7
    p = plan_rowwise("layer_norm_backward", 1000, 65536, "float16", H100, occ, switches=WEIGHT)
    assert p.variant is Variant.CLUSTER and p.grid == 7 * p.cluster
    occ.max_clusters = lambda plan: None  # the driver cannot say: SMs x blocks per SM / size
    q = plan_rowwise("layer_norm_backward", 1000, 65536, "float16", H100, occ, switches=WEIGHT)
    assert q.grid == 132 * occ(q) // q.cluster * q.cluster


def test_forward_smem_ignores_weight():
    # the forward reads gamma/beta from global memory: only x (or x + residual) is cached
    a = plan_rowwise("layer_norm", 8, 5000, "float16", H100,
                     switches=Switches(weight=True, bias=True, residual=True))
    assert a.smem_bytes == 5000 * 2  # aligned after the block's 256-byte reduction buffers


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_residual_blocks_overlap_their_rows(op):
    """With a residual a block may load its next row while it writes this one (Plan.overlap):
    it does where the planner's blocks would leave at most OVERLAP_RESIDENT threads on an SM, with
    the widest block its row allows, and in one wave where that block is alone on its SM.
    Clusters with a residual always do, in one wave. Without a residual: OneFlow's rules."""
    bias = op == "layer_norm"
    fused, plain = Switches(True, bias, True), Switches(True, bias, False)

    def occ(plan):  # 64 registers a thread: one 1024-thread block per SM
        by_smem = H100.model_occupancy(plan.threads, plan.smem_bytes)
        return min(by_smem, 65536 // (64 * plan.threads))

    # OneFlow's blocks would be 3 of 256 threads (64 KiB each), 768 threads an SM; 2 of 512
    # keep more resident (the block-width rule), still at most OVERLAP_RESIDENT
    q = plan_rowwise(op, 8192, 16384, "float32", H100, occ, switches=plain)
    assert q.block == (512, 1) and occ(q) * 512 <= HOPPER.overlap_resident
    assert not q.overlap and q.grid == 8192  # OneFlow's waves: one row a block
    p = plan_rowwise(op, 8192, 16384, "float32", H100, occ, switches=fused)
    assert p.variant is Variant.BLOCK_SMEM and p.overlap
    assert p.block == (1024, 1) and occ(p) == 1 and p.grid == 132  # one wave
    assert p.name_expression().endswith(", true, true>")
    # overlapping blocks that share an SM: OneFlow's waves of them
    r = plan_rowwise(op, 65536, 2048, "float32", H100, occ, switches=fused)
    assert r.overlap and r.block == (256, 1) and occ(r) == 4
    assert r.grid == min(65536, 132 * 8 * 32)
    # many blocks an SM (16 of 128 threads): they take turns at memory, no overlap
    s = plan_rowwise(op, 65536, 2048, "float16", H100, switches=fused)
    assert not s.overlap and s.block == (128, 1) and s.grid == 65536
    # a cluster: one wave, with a residual even where several blocks fit an SM
    c = plan_rowwise(op, 1024, 131072, "float16", H100, switches=fused)
    d = plan_rowwise(op, 1024, 131072, "float16", H100, switches=plain)
    assert c.variant is d.variant is Variant.CLUSTER and c.overlap and not d.overlap
    per_sm = H100.model_occupancy(d.threads, d.smem_bytes)
    # without a residual: OneFlow's waves of clusters, but one wave of layer norm's clusters of
    # two rows a pass (test_paired_rows)
    assert d.rows_per_pass == (2 if op == "layer_norm" else 1)
    waves = 1 if d.rows_per_pass == 2 else 32
    assert per_sm > 1 and d.grid == min(1024 // d.rows_per_pass,
                                        132 * per_sm // d.cluster * waves) * d.cluster
    assert c.rows_per_pass == 1 and c.grid == 132 * per_sm // c.cluster * c.cluster


def test_paired_rows():
    """Layer norm's clusters over 16-bit rows of PAIRED_MIN_COLS columns or more, with a weight
    or bias and no residual, cache two rows a pass on twice the blocks (rule 1 of
    _plan_cluster: three blocks of 512 threads an SM), in one wave of clusters, where that
    takes at most PAIRED_MAX_CLUSTER blocks. Not RMS norm, not float32 or float64, not below
    PAIRED_MIN_COLS, not a single row, not where two rows would need 16 blocks. Clusters of
    16 blocks (float32 at 262144 columns) run in one wave too; smaller ones of one row a pass
    in OneFlow's waves."""
    lim = HOPPER.paired_min_cols
    assert HOPPER.paired_max_cluster == 8
    wb = Switches(weight=True, bias=True)
    for dt in ("float16", "bfloat16"):
        for sw in (wb, Switches(weight=True), Switches(bias=True)):
            for cols in (lim, 153152):
                p = plan_rowwise("layer_norm", 1001, cols, dt, H100, switches=sw)
                one = replace(p, rows_per_pass=1)
                assert p.variant is Variant.CLUSTER and p.rows_per_pass == 2, p
                assert p.threads == 512 and norm.min_blocks(p) == 3 and not p.overlap
                per_sm = H100.model_occupancy(p.threads, p.smem_bytes)
                assert per_sm == 3
                # each block holds two slices of a cluster twice as wide as one row needs
                slice_bytes = -(-cols // 8 // p.cluster) * 16
                assert p.smem_bytes == 2 * slice_bytes + cluster_tail("layer_norm", "float32",
                                                                     512, rows_per_pass=2)
                if cols == lim:  # the buffers' one block all-reduce buffer: three blocks in the
                    # 196 KiB carveout step (128-byte units beside 1 KiB reserved a block)
                    step = 3 * (-(-(p.smem_bytes + 1024) // 128) * 128)
                    assert p.smem_bytes == 65536 + 224 and step <= 196 * 1024, p
                q = plan_rowwise("layer_norm", 1001, cols, dt, H100, switches=Switches())
                assert q.rows_per_pass == 1 and q.cluster * 2 == p.cluster, q
                # one wave: 501 passes over the resident clusters
                assert p.grid == min(501, 132 * per_sm // p.cluster) * p.cluster
                assert one.name_expression().endswith(", 3, 1>")
                assert p.name_expression().endswith(", 3, 2>")
                assert "rows_per_pass      2" in str(p) and "2 rows a pass" in str(p)
        # from 153160 columns two rows of 16-bit values need 16 blocks: one row a pass (over 4
        # blocks up to 153248 columns, then 8), in OneFlow's waves
        for cols, size in ((153160, 4), (153256, 8), (3 * lim // 2, 8), (2 * lim, 8)):
            p = plan_rowwise("layer_norm", 1001, cols, dt, H100, switches=wb)
            per_sm = H100.model_occupancy(p.threads, p.smem_bytes)
            assert (p.variant, p.cluster, p.rows_per_pass) == (Variant.CLUSTER, size, 1), p
            assert per_sm >= 3 and p.grid == min(1001, 132 * per_sm // size * 32) * size, p
            assert p.name_expression().endswith(", false, false, 3, 1>")
        # the rows it may not pair
        for op, rows, cols, ex in (("layer_norm", 1001, lim // 2, wb),
                                   ("layer_norm", 1, lim, wb),
                                   ("layer_norm", 1001, lim, Switches()),
                                   ("layer_norm", 1001, lim, Switches(True, True, True)),
                                   ("rms_norm", 1001, lim, Switches(weight=True))):
            p = plan_rowwise(op, rows, cols, dt, H100, switches=ex)
            assert p.variant is Variant.CLUSTER and p.rows_per_pass == 1, (op, rows, cols, ex)
            assert "rows_per_pass" not in str(p)
    for dt in ("float32", "float64"):
        p = plan_rowwise("layer_norm", 1001, 2 * lim, dt, H100, switches=wb)
        assert p.variant is Variant.CLUSTER and p.rows_per_pass == 1
    # one wave for clusters of 16 blocks, OneFlow's waves for smaller ones
    p = plan_rowwise("layer_norm", 512, 262144, "float32", H100, switches=wb)
    per_sm = H100.model_occupancy(p.threads, p.smem_bytes)
    assert (p.cluster, p.rows_per_pass, per_sm) == (16, 1, 3)
    assert p.grid == 132 * 3 // 16 * 16
    p = plan_rowwise("layer_norm", 1024, 131072, "float32", H100, switches=wb)
    per_sm = H100.model_occupancy(p.threads, p.smem_bytes)
    assert p.cluster == 8 and p.grid == min(1024, 132 * per_sm // 8 * 32) * 8


def test_backward_with_weight_uses_one_wave_of_blocks():
    # one partial row of dweight/dbias per block: the grid is what is resident at once
    p = plan_rowwise("layer_norm_backward", 10**5, 64, "float32", H100, switches=WEIGHT)
    assert p.variant is Variant.WARP and p.grid == 132 * 16  # 128 threads, 16 blocks per SM
    q = plan_rowwise("layer_norm_backward", 10**5, 64, "float32", H100, switches=Switches())
    assert q.grid == min(-(-10**5 // 2 // q.block[1]), 132 * 16 * 32)  # OneFlow's waves
    p = plan_rowwise("layer_norm_backward", 3, 64, "float32", H100, switches=WEIGHT)
    assert p.grid == 1  # never more blocks than rows need
    p = plan_rowwise("rms_norm_backward", 4096, 4096, "float16", H100, switches=WEIGHT)
    assert p.variant is Variant.BLOCK_SMEM
    assert p.smem_bytes == 2 * 2 * 4096 * 2 + 4096 * 4 + 128  # x and dy twice, the sums
    per_sm = H100.model_occupancy(p.threads, p.smem_bytes)
    assert p.grid == 132 * per_sm
    p = plan_rowwise("layer_norm_backward", 4096, 50000, "float16", H100, switches=WEIGHT)
    assert p.variant is Variant.CLUSTER
    per_sm = H100.model_occupancy(p.threads, p.smem_bytes)
    assert p.grid == 132 * per_sm // p.cluster * p.cluster
    # the uncached kernel leaves the column sums to norm_param_grad_partial: OneFlow's waves
    p = plan_rowwise("layer_norm_backward", 4096, 50000, "float16", A100, switches=WEIGHT)
    assert p.variant is Variant.BLOCK_UNCACHED and p.grid == 4096
    assert any("norm_param_grad_partial" in n for n in p.notes)


def test_explain_knows_the_norms():
    p = cukern.explain("layer_norm", (8, 197, 768), "float16", device=H100)
    assert (p.rows, p.cols, p.variant) == (8 * 197, 768, Variant.WARP)
    assert "layer_norm_warp<cukern::f16, 0, 8, 32, 1, false, false>" in str(p)
    p = cukern.explain("rms_norm_backward", (64, 8192), "bfloat16", device=H100)
    assert p.variant is Variant.BLOCK_SMEM
    # the call's weight, bias and residual choose the kernel too
    p = cukern.explain("layer_norm", (8, 197, 768), "float16", device=H100, weight=True,
                       residual=True)
    assert p.switches == Switches(weight=True, residual=True)
    p = cukern.explain("rms_norm", (2048, 65536), "float16", device=H100, residual=True)
    assert p.switches == Switches(residual=True) and p.overlap and p.grid == 132
    assert not cukern.explain("rms_norm", (2048, 65536), "float16", device=H100).overlap
    p = cukern.explain("layer_norm_backward", (64, 8192), "float32", device=H100, weight=True)
    assert p.switches == Switches(weight=True)
    assert p.name_expression().startswith("cukern::layer_norm_grad_block_smem<float, 0, 4, true,")
    with pytest.raises(ValueError, match="rms_norm takes no bias"):
        cukern.explain("rms_norm", (4, 64), "float32", device=H100, bias=True)
    with pytest.raises(ValueError, match="layer_norm_backward takes no residual"):
        cukern.explain("layer_norm_backward", (4, 64), "float32", device=H100, residual=True)
    with pytest.raises(ValueError, match="softmax takes no weight"):
        cukern.explain("softmax", (4, 64), "float32", device=H100, weight=True)
    with pytest.raises(TypeError, match="weight must be True or False, got 'yes'"):
        cukern.explain("layer_norm", (4, 64), "float32", device=H100, weight="yes")


# ---------------------------------------------------------------------------------------------
# Reachable instantiations and NVRTC.

def test_reachable_covers_planner_output():
    rng = np.random.default_rng(0)
    short = list(range(1, 1100))  # the warp kernel (the same on both devices) and its edge
    long = [int(c) for c in rng.integers(1100, 2_000_000, 80)]
    for op in NORM_OPS:
        # the switches only append template arguments, except the backward's WEIGHT, which also
        # sizes shared memory: try the first and the last of each op's list
        switch_sets = {policy(op).switch_sets[0], policy(op).switch_sets[-1]}
        for dt in ITEM:
            for device in (H100, H200, A100):  # the H200: its own rules, in the H100's set
                reach = planner.reachable_plans(op, dt, device)
                for sw in switch_sets:
                    for cols in (short if device is not A100 else []) + long:
                        for rows in (1, 2):
                            for align in (1, 2, 4, 16):
                                p = plan_rowwise(op, rows, cols, dt, device, align_elems=align,
                                                 switches=sw)
                                assert p.name_expression() in reach, p


def reachable(op, dtype, device):
    """Every kernel ``op`` can launch (auxiliary kernels included): its source's names."""
    by_source = registry.kernel_names([op], [dtype], device)
    assert set(by_source) == {policy(op).source}
    return by_source[policy(op).source]


def test_reachable_sets():
    for op in NORM_OPS:
        pol = policy(op)
        for dt in ITEM:
            names = reachable(op, dt, H100)
            kernels = [n for n in names if "param_grad" not in n]
            assert set(kernels) == planner.reachable_plans(op, dt, H100)
            # rows off the 16-byte grid (the forward): the SHIFT twin (last argument true) of a
            # warp, block or cluster instantiation of 16-byte packs, never of the uncached ones
            plain = planner.reachable_plans(replace(pol, shifted_rows=False), dt, H100)
            twins = set(kernels) - plain
            assert bool(twins) == (op not in BWD) == pol.shifted_rows, op
            for n in twins:
                assert n.endswith(", true>") and n[:-len(", true>")] + ">" in plain, n
                assert int(n.split(", ")[2]) * ITEM[dt] == 16, n
                assert "_uncached<" not in n and "_dyn<" not in n, n
                assert not n.endswith(", 2, true>"), n  # one row a pass
            kernels = [n for n in kernels if n not in twins]
            # float32 weight and bias of 16-bit data: the uncached kernels alone, P = float, for
            # each of their instantiations with P = T (every pack, with a residual or not; the
            # backward's with a weight)
            f32 = [n for n in kernels if n.endswith(", float>")]
            kernels = [n for n in kernels if n not in f32]
            if ITEM[dt] == 2:
                assert all("_block_uncached<" in n for n in f32), f32
                assert {n[:-len(", float>")] + ">" for n in f32} == \
                    {n for n in kernels if "_block_uncached<" in n and
                     (op not in BWD or n.endswith(", true>"))}
            else:
                assert not f32, f32

            def takes_affine(name):
                return op not in BWD and ("_warp<" in name or "_block_smem<" in name)

            def switches(name):
                """The op's template switches of the kernel: the forward's cached kernels end in
                Plan.overlap (its clusters, with weight and bias switches, in Plan.overlap,
                Plan.min_blocks, then Plan.rows_per_pass)."""
                cluster = "_cluster<" in name or "_cluster_dyn<" in name
                template_switches = norm.template_switches(
                    op, Variant.CLUSTER if cluster else Variant.WARP)
                n_extra = len(template_switches)
                overlap_switch = (template_switches.index("residual")
                                  if pol.overlap_with_residual else -1)
                args = name[:-1].split(", ")
                if takes_affine(name):  # AFFINE last: checked below
                    assert args[-1] in ("false", "true"), name
                    args = args[:-1]
                if overlap_switch >= 0 and cluster:
                    # two rows a pass only for 16-bit layer norm with weight or bias and no
                    # residual, blocks of at most 512 threads (MIN_BLOCKS 3) and no overlap
                    assert args[-1] == "1" or (args[-1] == "2" and args[-2] == "3" and ITEM[dt] == 2
                                               and op == "layer_norm" and args[-4] == "false"
                                               and "true" in args[-6:-4]), name
                    # MIN_BLOCKS 3 only for blocks that do not overlap their rows
                    assert args[-2] == "1" or args[-2] == "3" and args[-3] == "false", name
                    args = args[:-2]
                if overlap_switch >= 0 and ("_warp<" not in name and
                                            "_uncached<" not in name):
                    assert args[-1] in ("false", "true")
                    # blocks overlap their rows only where the op's switch allows it
                    assert args[-1] == "false" or args[-1 - n_extra + overlap_switch] \
                        == "true", name
                    args = args[:-1]
                return tuple(args[-n_extra:])

            # every switch combination, and nothing else, for each kind of kernel (the
            # forward's clusters over weight, bias and residual; the rest over residual)
            clusters = [n for n in kernels if ("_cluster<" in n or "_cluster_dyn<" in n)
                        and op in norm.CLUSTER_SWITCHES]
            # the forward's cluster size compiled in at 16-byte packs, set at launch below them;
            # the backward's always compiled in
            for n in kernels:
                if "_cluster" in n:
                    nbytes = int(n.split(", ")[2]) * ITEM[dt]
                    assert ("_cluster_dyn<" in n) is (nbytes < 16 and op not in BWD), n
            others = [n for n in kernels if n not in clusters]
            assert {switches(n) for n in others} == {switch_flags(op, sw)
                                                     for sw in pol.switch_sets}
            if op in norm.CLUSTER_SWITCHES:
                assert {switches(n) for n in clusters} == {switch_flags(op, sw, Variant.CLUSTER)
                                                           for sw in pol.switch_sets}
            # the forward's warp and block-cache kernels: AFFINE where the call gives every
            # parameter the norm has, for each residual setting
            for kind in ("_warp<", "_block_smem<"):
                got = {(switches(n), n[:-1].split(", ")[-1] == "true") for n in kernels
                       if kind in n and takes_affine(n)}
                if op not in BWD:
                    assert got == {(switch_flags(op, sw), norm.affine(pol, sw))
                                   for sw in pol.switch_sets}, (op, dt, kind)
            if op == "rms_norm":  # no bias (its kernels, ALGO 1, never read beta)
                assert not any(sw.bias for sw in pol.switch_sets)
                assert all(n.split(", ")[1] == "1" for n in kernels)
                assert all(switches(n)[1] == "false" for n in clusters)
            if pol.overlap_with_residual:  # both ways with a residual, for the block kernel
                assert any(n.endswith(", true, true>") and "_block_smem<" in n for n in kernels)
                assert any(n.endswith(", true, false>") and "_block_smem<" in n for n in kernels)
                # clusters: both launch bounds without overlap, the wide one with it; two rows a
                # pass for 16-bit layer norm
                ends = [", false, false, 1, 1>", ", false, false, 3, 1>", ", true, true, 1, 1>"]
                if op == "layer_norm" and ITEM[dt] == 2:
                    ends.append(", false, false, 3, 2>")
                for end in ends:
                    assert any(n.endswith(end) and "_cluster<" in n for n in kernels), end
                assert any(n.endswith(", 2>") and "_cluster<" in n for n in kernels) is (
                    op == "layer_norm" and ITEM[dt] == 2)
            if op in BWD:
                assert f"cukern::norm_param_grad_reduce<{CPP[dt]}>" in names
                algo = pol.algo
                assert f"cukern::norm_param_grad_partial<{CPP[dt]}, {algo}, 1>" in names
            a100 = reachable(op, dt, A100)
            assert not any("cluster" in n for n in a100)
            assert {n for n in names if "cluster" not in n} == a100


@pytest.mark.nvrtc("norm")
@pytest.mark.parametrize("arch", list(NVRTC_ARCHS))
def test_every_reachable_instantiation_compiles(arch):
    # every kernel each op can launch, by kernel source (forward "layer_norm", backward
    # "layer_norm_grad", with its auxiliary kernels), compiled in the background since
    # collection ended (conftest.nvrtc_results: a source's names of a dtype in a few programs)
    device = getattr(DeviceSpec, NVRTC_ARCHS[arch])()  # the device model the check plans for
    lowered = {}
    for source, _, names, result in nvrtc_results("norm", arch):
        assert set(result) == set(names), source
        lowered.update(((source, n), v) for n, v in result.items())
    for op in NORM_OPS:
        for dtype in ITEM:
            n = 0
            for source, names in registry.kernel_names([op], [dtype], device).items():
                missing = [name for name in names if not lowered.get((source, name))]
                assert not missing, (op, dtype, missing[:3])
                n += len(names)
            assert n > 20, (op, dtype)


def test_source_inlines_includes_once():
    src = _compile.source("layer_norm")
    grad = _compile.source("layer_norm_grad")  # the backward's kernels
    assert '#include "' not in src and '#include "' not in grad  # every local include inlined
    assert src.count("struct Welford") == 1
    assert "layer_norm_cluster" in src and "norm_param_grad_reduce" in grad


# ---------------------------------------------------------------------------------------------
# References, against independent formulations.

def _naive_layer_norm(x, k, w, b, eps):
    """Row by row with the statistics module's view of mean and population variance."""
    lead = x.shape[:x.ndim - k]
    flat = x.reshape(int(np.prod(lead)), -1)
    y = np.empty_like(flat)
    means, rstds = [], []
    for i, row in enumerate(flat):
        m = sum(row.tolist()) / row.size
        var = sum((v - m) ** 2 for v in row.tolist()) / row.size
        rstd = 1 / np.sqrt(var + eps)
        y[i] = (row - m) * rstd
        means.append(m)
        rstds.append(rstd)
    y = y.reshape(x.shape)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y, np.array(means).reshape(lead), np.array(rstds).reshape(lead)


def test_reference_layer_norm_matches_naive(rng):
    x = rng.standard_normal((3, 4, 5, 6)) * 3 + 2
    w, b = rng.standard_normal((5, 6)), rng.standard_normal((5, 6))
    y, mean, rstd = reference.layer_norm(x, (5, 6), w, b, eps=1e-3, return_stats=True)
    ny, nm, nr = _naive_layer_norm(x, 2, w, b, 1e-3)
    np.testing.assert_allclose(y, ny, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(mean, nm, rtol=1e-12)
    np.testing.assert_allclose(rstd, nr, rtol=1e-12)
    assert mean.shape == rstd.shape == (3, 4)
    # normalised rows have mean 0 and variance var / (var + eps)
    y0 = reference.layer_norm(x, 6, eps=1e-9)
    np.testing.assert_allclose(y0.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(y0.var(-1), 1, rtol=1e-6)


def test_reference_rms_norm_matches_naive(rng):
    x = rng.standard_normal((7, 33)) + 1
    w = rng.standard_normal(33)
    y, rstd = reference.rms_norm(x, 33, w, eps=1e-6, return_stats=True)
    ms = np.array([sum(v * v for v in row.tolist()) / 33 for row in x])
    np.testing.assert_allclose(rstd, 1 / np.sqrt(ms + 1e-6), rtol=1e-12)
    np.testing.assert_allclose(y, x / np.sqrt(ms + 1e-6)[:, None] * w, rtol=1e-12)


def test_reference_return_tuples_and_residual(rng):
    x = rng.standard_normal((4, 8)).astype(np.float16)
    r = rng.standard_normal((4, 8)).astype(np.float16)
    out = reference.layer_norm(x, 8, residual=r, return_stats=True)
    assert len(out) == 4
    y, mean, _, h = out
    # h is the sum rounded to x's dtype, and the statistics are those of h
    np.testing.assert_array_equal(h, (x + r).astype(np.float64))
    np.testing.assert_allclose(mean, h.mean(-1), rtol=1e-12)
    y2, h2 = reference.layer_norm(x, 8, residual=r)  # (y, h) by default
    np.testing.assert_array_equal(y2, y)
    np.testing.assert_array_equal(h2, h)
    assert isinstance(reference.layer_norm(x, 8), np.ndarray)  # y alone, as F.layer_norm
    assert isinstance(reference.rms_norm(x, 8), np.ndarray)
    assert len(reference.rms_norm(x, 8, return_stats=True)) == 2
    assert len(reference.rms_norm(x, 8, residual=r, return_stats=True)) == 3
    assert len(reference.rms_norm(x, 8, residual=r)) == 2
    with pytest.raises(ValueError, match="trailing"):
        reference.layer_norm(x, 7)


def _fd(f, a, eps=1e-6):
    """Central differences of scalar f with respect to every element of a."""
    g = np.zeros_like(a)
    for idx in np.ndindex(a.shape):
        e = np.zeros_like(a)
        e[idx] = eps
        g[idx] = (f(a + e) - f(a - e)) / (2 * eps)
    return g


@pytest.mark.parametrize("affine", [False, True])
def test_reference_layer_norm_backward_matches_finite_differences(rng, affine):
    x = rng.standard_normal((3, 2, 5)) * 2 + 1
    dy = rng.standard_normal(x.shape)
    w = rng.standard_normal((2, 5)) if affine else None
    b = rng.standard_normal((2, 5)) if affine else None
    eps = 1e-2

    def loss_x(xx):
        return np.sum(dy * reference.layer_norm(xx, (2, 5), w, b, eps, return_stats=False))

    _, mean, rstd = reference.layer_norm(x, (2, 5), w, b, eps, return_stats=True)
    dx, dw, db = reference.layer_norm_backward(dy, x, mean, rstd, w)
    np.testing.assert_allclose(dx, _fd(loss_x, x), rtol=1e-6, atol=1e-8)
    if not affine:
        assert dw is None and db is None
        return
    np.testing.assert_allclose(
        dw, _fd(lambda ww: np.sum(dy * reference.layer_norm(x, (2, 5), ww, b, eps,
                                                            return_stats=False)), w),
        rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(
        db, _fd(lambda bb: np.sum(dy * reference.layer_norm(x, (2, 5), w, bb, eps,
                                                            return_stats=False)), b),
        rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("affine", [False, True])
def test_reference_rms_norm_backward_matches_finite_differences(rng, affine):
    x = rng.standard_normal((4, 7)) + 0.5
    dy = rng.standard_normal(x.shape)
    w = rng.standard_normal(7) if affine else None
    eps = 1e-2

    def loss_x(xx):
        return np.sum(dy * reference.rms_norm(xx, 7, w, eps, return_stats=False))

    _, rstd = reference.rms_norm(x, 7, w, eps, return_stats=True)
    dx, dw = reference.rms_norm_backward(dy, x, rstd, w)
    np.testing.assert_allclose(dx, _fd(loss_x, x), rtol=1e-6, atol=1e-8)
    if affine:
        np.testing.assert_allclose(
            dw, _fd(lambda ww: np.sum(dy * reference.rms_norm(x, 7, ww, eps,
                                                              return_stats=False)), w),
            rtol=1e-6, atol=1e-8)
    else:
        assert dw is None


def test_naive_variance_would_fail_where_the_reference_holds(rng):
    """The large-offset case the GPU tests use: E[x^2] - E[x]^2 in float32 loses every digit."""
    x = (1e4 + rng.standard_normal((4, 4096)) * 0.5).astype(np.float32)
    x64 = x.astype(np.float64)
    true_var = x64.var(-1)
    naive = (x * x).mean(-1, dtype=np.float32) - x.mean(-1, dtype=np.float32) ** 2
    assert np.max(np.abs(naive - true_var) / true_var) > 0.1
    _, _, rstd = reference.layer_norm(x, 4096, eps=1e-12, return_stats=True)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(true_var + 1e-12), rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# Validation and layouts (pure: NumPy stand-ins for device arrays).

def test_normalized_shape_validation():
    x = np.zeros((2, 3, 4))
    assert ln._normalized_shape("f", 4, x) == (4,)
    assert ln._normalized_shape("f", (3, 4), x) == (3, 4)
    assert ln._normalized_shape("f", [np.int64(4)], x) == (4,)
    with pytest.raises(ValueError, match=r"normalized_shape \(3,\) does not match"):
        ln._normalized_shape("f", 3, x)
    with pytest.raises(ValueError, match="does not match"):
        ln._normalized_shape("f", (1, 2, 3, 4), x)
    with pytest.raises(ValueError, match="empty"):
        ln._normalized_shape("f", (), x)
    with pytest.raises(TypeError, match="normalized_shape"):
        ln._normalized_shape("f", 4.0, x)
    with pytest.raises(TypeError, match="normalized_shape"):
        ln._normalized_shape("f", True, x)
    with pytest.raises(TypeError, match="normalized_shape"):
        ln._normalized_shape("f", (3, "4"), x)


def test_eps_validation():
    """Every op that takes eps checks it with runner.check_eps: a real number, finite, > 0 and
    normal in the kernels' compute type (float32 for 16-bit data), so it never rounds to 0."""
    check = runner.check_eps
    assert check("f", 1e-5, "float16") == 1e-5
    assert check("f", np.float32(1e-3), "float32") == pytest.approx(1e-3)
    assert check("f", 1e-300, "float64") == 1e-300
    tiny = float(np.finfo(np.float32).tiny)
    assert check("f", tiny, "bfloat16") == tiny
    for bad in (0.0, -1e-5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="f: eps must be finite and > 0"):
            check("f", bad, "float32")
    for dtype in ("float16", "bfloat16", "float32"):
        for bad in (1e-50, 1e-40, tiny / 2):  # zero, or subnormal, in float32
            with pytest.raises(ValueError, match=f"f: eps={bad} underflows float32, the "
                                                 f"compute type of {dtype} data"):
                check("f", bad, dtype)
        with pytest.raises(ValueError, match=r"f: eps=1e\+39 overflows float32"):
            check("f", 1e39, dtype)
    with pytest.raises(ValueError, match="f: eps=1e-320 underflows float64"):
        check("f", 1e-320, "float64")
    for bad in ("1e-5", None, True, 1j):
        with pytest.raises(TypeError, match="eps"):
            check("f", bad, "float32")


@pytest.mark.parametrize("op", NORM_OPS)
def test_longest_row(op):
    """Rows of up to MAX_COLS = 2^31 - 4096 values are planned, longer ones refused by the
    planner, so by explain (the ops refuse them before they allocate: the GPU tests)."""
    longest = planner.MAX_COLS
    sw = WEIGHT if op in BWD else Switches()
    for dtype in ("float16", "float32"):
        p = plan_rowwise(op, 3, longest, dtype, H100, align_elems=1, switches=sw)
        assert p.variant is Variant.BLOCK_UNCACHED and p.block[0] <= 1024
        assert longest // p.pack_size - 1 + 4 * 1024 <= 2**31 - 1  # the furthest pack index
    for cols in (longest + 1, 2**31 - 1, 2**31):
        says = rf"plan: {op} over rows of {cols} columns; at most 2147479552 \(2\^31 - 4096\)"
        with pytest.raises(ValueError, match=says):
            plan_rowwise(op, 3, cols, "float16", H100, switches=sw)
        with pytest.raises(ValueError, match=says):
            cukern.explain(op, (3, cols), "float16", device=H100, weight=op in BWD)


def test_trailing_layout():
    a = np.zeros((4, 6, 5), np.float32)
    assert trailing(a, 1) == (24, 5, 5)
    assert trailing(a, 2) == (4, 30, 30)
    assert trailing(a[:, :, :3], 1) == (24, 3, 5)  # row stride > cols
    assert trailing(a[:, :3, :], 2) == (4, 15, 30)
    assert trailing(a[:, :3, :3], 2) is None  # trailing dims not one run
    assert trailing(a[:, :, ::2], 1) is None  # columns not contiguous
    assert trailing(a.transpose(1, 0, 2), 1) is None  # leading dims: two strides
    assert trailing(np.zeros((1, 7), np.float32), 1) == (1, 7, 7)
    assert trailing(np.zeros((5, 1), np.float32)[::2], 1) == (3, 1, 2)


def test_host_arrays_are_refused():
    pytest.importorskip("cupy")
    with pytest.raises(TypeError, match="numpy.ndarray"):
        cukern.layer_norm(np.zeros((2, 3), np.float32), 3)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        cukern.rms_norm_backward(np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32),
                                 np.zeros(2, np.float32))


@pytest.mark.nvrtc
def test_kernels_of_64k_slices_have_no_static_buffers():
    """The carveout (docs/notes/kernels.md, "Shared memory"): three blocks of 64 KiB fit the
    196 KiB step only with at most 256 more bytes each. The softmax forwards and the forward
    norms' clusters keep every reduction buffer in the tail of the dynamic shared memory (none
    static: a slice at the start is aligned; two 16-bit rows a pass with one all-reduce
    buffer); the forward norms' blocks and the softmax backwards' (but float64's) keep 256
    static bytes, a 128-byte multiple, so their rows start aligned with no bytes added."""
    cases = {"softmax": [("softmax", "float16", 32768, {}), ("softmax", "float32", 262144, {}),
                         ("softmax_backward", "float16", 16384, {}),
                         ("softmax_backward", "float32", 131072, {})],
             "layer_norm": [("layer_norm", "float16", 131072, dict(weight=True, bias=True)),
                            ("layer_norm", "float32", 262144, dict(weight=True, bias=True)),
                            ("rms_norm", "bfloat16", 262144, dict(weight=True)),
                            ("layer_norm", "float16", 32768, dict(weight=True, bias=True))]}
    for family, shapes in cases.items():
        plans = [cukern.explain(op, (2**27 // cols, cols), dt, device="h100", **kw)
                 for op, dt, cols, kw in shapes]
        sizes = {n: static_smem(family, n) for n in {p.name_expression() for p in plans}}
        for p in plans:
            per_block = -(-(p.smem_bytes + sizes[p.name_expression()]) // 128) * 128 + 1024
            static = p.variant is Variant.BLOCK_SMEM and (
                family == "layer_norm" or p.op.endswith("_backward"))
            if static:
                assert sizes[p.name_expression()] == 256 and p.smem_bytes == 65536, p
            else:
                assert sizes[p.name_expression()] == 0, p
            # 64 KiB of rows a block: three fit the 196 KiB step (blocks of 1024 threads: two
            # an SM at most, within the 132 KiB step)
            resident = min(3, 2048 // p.threads)
            assert resident * per_block <= (200704 if resident == 3 else 135168), p
            assert p.rows_per_pass == (2 if p.op == "layer_norm" and p.cols == 131072 else 1)

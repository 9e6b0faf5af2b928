"""Backward kernels that also sum over rows (the norms' dweight, dbias): which way the cached
kernels hold a row, its column sums and gamma, and the launch shapes of the auxiliary kernels
that add the partial rows up.

A way is a cluster size (1: the block kernel), a block width, where the sums live (shared
memory beside x and dy, or registers), one or two buffers for x and dy, and whether gamma is
converted once into shared memory. The grid is one wave of resident blocks (or clusters), each
looping over rows and writing one partial row of sums. The rules are ordered by measurement on
the H100; the numbers are in docs/notes/layer-norm-backward.md under each rule's name.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from .._device import DeviceSpec
from .common import (
    ITEMSIZE,
    Occupancy,
    Plan,
    Variant,
    block_threads_for,
    max_dynamic_smem,
    model_occupancy,
    replace,
    resident_clusters,
)
from .policy import Tuning, tuning_for

__all__ = ["col_sums_ways", "plan_col_sums", "param_reduce_shape", "plan_param_grad",
           "ParamGradPlan", "reg_sum_packs"]

Way = tuple  # (plan without its grid, blocks per SM, two buffers, slice packs)


def reg_sum_packs(dtype: str, pack: int) -> int:
    """Packs a thread whose column sums a kernel keeps in registers (RegSums in
    kernels/layer_norm_grad.cuh): 16 values of each sum (8 in double)."""
    return max(1, (8 if dtype == "float64" else 16) // pack)


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _sums(base: dict) -> int:
    return base["policy"].col_sums if base["switches"].weight else 0


def plan_col_sums(base: dict, no_warp: dict, device: DeviceSpec, occ: Occupancy) -> Plan | None:
    """The first of ``ways`` with its grid; None where no way fits."""
    found = ways(base, no_warp, device, occ, first_only=True)
    return _with_grid(*found[0], _sums(base), device, occ) if found else None


def col_sums_ways(plan: Plan, device: DeviceSpec, occupancy: Occupancy | None = None
                  ) -> list[Plan]:
    """Every way the cached kernels could run a row of ``plan``'s shape, best first by the
    planner's order; empty where none fits or the op sums no columns (a tool for
    ``benchmarks/bench_layer_norm.py --ways``, which times them all)."""
    sums = plan.policy.col_sums if plan.switches.weight else 0
    if not sums:
        return []
    base = dict(op=plan.op, dtype=plan.dtype, rows=plan.rows, cols=plan.cols,
                pack_size=plan.pack_size, strided=plan.strided, device=device.name,
                switches=plan.switches, policy=plan.policy)
    no_warp = dict(cols_per_thread=0, thread_group_width=0, rows_per_access=0, padding=False)
    occ = occupancy or model_occupancy(device)
    return [_with_grid(*w, sums, device, occ) for w in ways(base, no_warp, device, occ)]


def ways(base: dict, no_warp: dict, device: DeviceSpec, occ: Occupancy,
         first_only: bool = False) -> list[Way]:
    """The ways, best first, as (plan without its grid, blocks per SM, two buffers).
    ``first_only``: stop at the narrow way where there is one, or at the block kernel's best
    where rule 1 keeps it (no occupancy queries, so no compiles, for ways the planner would
    not take).

    Clusters are tried from the smallest size any way fits, up to two doublings past it, while
    each block keeps at least 128 packs; blocks wider than 128 threads hold a pack a thread
    (float32: ``Tuning.norm_bwd_min_packs_32bit``). Of the ways that fit:
    1. the block kernel's best (``_block_key``) where ``_keeps_block``;
    2. else the "S2g" clusters (x and dy twice, gamma and the sums in shared memory) of the
       smallest size that has one and twice that, by ``_cluster_key``;
    3. else the block kernel's best, or with no block way, ``_cluster_fallback``.
    Before them, over 16-bit rows in 16-byte packs, the first of the op's ways in
    ``Tuning.norm_bwd_narrow`` that fits (the H100: layer norm's ``_narrow_s2g`` past 2048
    columns), and layer norm's ``_pair_r2g`` in 8-byte packs past 2048, where one fits. Over
    float32 rows of at least ``Tuning.norm_bwd_regs_min_cols_32bit`` columns the first way
    keeps its sums in registers where its slice fits them (``_regs_32bit``).
    """
    tune = tuning_for(device)
    pol, dtype, cols, pack = base["policy"], base["dtype"], base["cols"], base["pack_size"]
    strided, sums, item = base["strided"], _sums(base), ITEMSIZE[base["dtype"]]
    csize = 8 if dtype == "float64" else 4
    packs = cols // pack
    apt = reg_sum_packs(dtype, pack)
    limit = max_dynamic_smem(device)
    least = tune.norm_bwd_min_packs_32bit if item == 4 else 1  # packs a thread, past 128
    clusters_ok = device.has_clusters and not strided
    narrow = None
    if sums and item == 2 and clusters_ok:
        rule = next(((named, past) for op, named, past in tune.norm_bwd_narrow
                     if op == base["op"]), None)
        if pack * item == 16 and rule is not None and cols > rule[1]:
            for way in rule[0]:
                narrow = (_narrow_s2g(base, no_warp, packs, device, occ) if way == "s2g" else
                          _pair_r2g(base, no_warp, packs, occ, limit, (1,) + tune.cluster_sizes))
                if narrow is not None:
                    break
        elif pack * item == 8 and sums == 2 and cols > 2048:
            narrow = _pair_r2g(base, no_warp, packs, occ, limit, tune.cluster_sizes)
        if narrow is not None and first_only:
            return [narrow[:3]]
    sizes = (1,) + (tune.cluster_sizes if clusters_ok else ())
    blocks, clusters, first = [], [], None
    # each candidate: this plan with its shape (replace skips a constructor's work)
    proto = Plan(variant=Variant.BLOCK_SMEM, block=(128, 1), grid=1, smem_bytes=0, **no_warp,
                 **base)
    for size in sizes:
        slice_packs = -(-packs // size)
        if (first is not None and size > 4 * first) or (size > 1 and slice_packs < 128):
            break
        values = slice_packs * pack
        rows_smem = item * pol.inputs * values
        variant = Variant.BLOCK_SMEM if size == 1 else Variant.CLUSTER
        for threads, in_regs, two, gamma in itertools.product(
                (128,) + tune.block_sizes, (False, True), (True, False), (False, True)):
            if (threads > 128 and threads * least > slice_packs) or \
                    (in_regs and -(-slice_packs // threads) > apt) or \
                    (two and pack * item < 4) or (gamma and csize != 4):
                continue
            smem = rows_smem * (2 if two else 1) + (0 if in_regs else sums * csize * values) + \
                (csize * values if gamma else 0) + pol.smem_align
            if smem > limit:
                continue
            plan = replace(proto, variant=variant, block=(threads, 1), grid=size,
                           smem_bytes=smem, cluster=size, sums_in_registers=in_regs,
                           gamma_in_smem=gamma)
            per_sm = occ(plan)
            if per_sm > 0:
                (blocks if size == 1 else clusters).append((plan, per_sm, two, slice_packs))
        if first_only and size == 1 and blocks:  # rule 1 needs no cluster asked about
            best = max(blocks, key=lambda w: _block_key(*w[1:], w[0]))
            if _keeps_block(best, item):
                return [_regs_32bit(best, base, tune, occ)[:3]]
        if (blocks or clusters) and first is None:
            first = size
    if narrow is not None:  # first; and not again among the rest
        blocks = [w for w in blocks if w[0] != narrow[0]]
        clusters = [w for w in clusters if w[0] != narrow[0]]
    blocks.sort(key=lambda w: _block_key(*w[1:], w[0]), reverse=True)
    s2g = [w for w in clusters if w[2] and w[0].gamma_in_smem and not w[0].sums_in_registers]
    if s2g:
        s0 = min(w[0].cluster for w in s2g)
        s2g = sorted((w for w in s2g if w[0].cluster <= 2 * s0),
                     key=lambda w: _cluster_key(w[0], w[1], sums), reverse=True)
    taken = {id(w) for w in s2g}
    rest = sorted((w for w in clusters if id(w) not in taken),
                  key=lambda w: (-w[0].cluster, _block_key(*w[1:], w[0])), reverse=True)
    if blocks and (not s2g or _keeps_block(blocks[0], item)):
        order = blocks + s2g + rest
    elif s2g:
        order = s2g + blocks + rest
    else:
        order = rest
        fallback = _cluster_fallback(base, no_warp, device, occ) if clusters_ok else None
        if fallback is not None:
            order = [fallback] + [w for w in rest if w[0] != fallback[0]]
    if narrow is not None:
        order = [narrow] + order
    if order:
        head = _regs_32bit(order[0], base, tune, occ)
        order = [head] + [w for w in order[1:] if w[0] != head[0]]
    return [w[:3] for w in order]


def _regs_32bit(way: Way, base: dict, tune: Tuning, occ: Occupancy) -> Way:
    """``way`` with its column sums in registers in place of shared memory, for float32 rows of
    at least Tuning.norm_bwd_regs_min_cols_32bit columns in 16-byte packs where its slice
    fits them and it stays resident; else ``way``."""
    plan, per_sm, two, slice_packs = way
    if ITEMSIZE[base["dtype"]] != 4 or plan.pack_size != 4 or \
            not tune.norm_bwd_regs_min_cols_32bit or \
            base["cols"] < tune.norm_bwd_regs_min_cols_32bit or plan.sums_in_registers or \
            slice_packs > reg_sum_packs(base["dtype"], plan.pack_size) * plan.threads:
        return way
    sums = _sums(base) * 4 * slice_packs * plan.pack_size
    regs = replace(plan, smem_bytes=plan.smem_bytes - sums, sums_in_registers=True)
    per = occ(regs)
    return (regs, per, two, slice_packs) if per > 0 else way


def _narrow_s2g(base: dict, no_warp: dict, packs: int, device: DeviceSpec,
                occ: Occupancy) -> Way | None:
    """16-bit rows in 16-byte packs, for the ops that name "s2g" in Tuning.norm_bwd_narrow (the
    H100: layer norm past 2048 columns): the block kernel, then clusters of 2..16, the first
    whose slice (at least 128 packs a block in a cluster), held by 128 threads as S2g, keeps
    three or more blocks resident an SM."""
    pol, pack = base["policy"], base["pack_size"]
    item = ITEMSIZE[base["dtype"]]
    for size in (1,) + tuning_for(device).cluster_sizes:
        slice_packs = -(-packs // size)
        if size > 1 and slice_packs < 128:
            return None
        values = slice_packs * pack
        smem = 2 * item * pol.inputs * values + (pol.col_sums + 1) * 4 * values + pol.smem_align
        if smem * 3 > device.smem_per_sm:
            continue
        variant = Variant.BLOCK_SMEM if size == 1 else Variant.CLUSTER
        plan = Plan(variant=variant, block=(128, 1), grid=size, smem_bytes=smem, cluster=size,
                    sums_in_registers=False, gamma_in_smem=True, **no_warp, **base)
        per_sm = occ(plan)
        if per_sm >= 3:
            return plan, per_sm, True, slice_packs
    return None


def _pair_r2g(base: dict, no_warp: dict, packs: int, occ: Occupancy, limit: int,
              sizes: tuple[int, ...]) -> Way | None:
    """Layer norm, 16-bit rows past 2048 columns in 8-byte packs (and the ops that name "r2g"
    in Tuning.norm_bwd_narrow, from one block): the smallest of ``sizes`` (1: one block a row)
    whose slice the narrowest block holds with the sums in registers, x and dy twice and gamma
    in shared memory ("R2g")."""
    pol, pack = base["policy"], base["pack_size"]
    item = ITEMSIZE[base["dtype"]]
    apt = reg_sum_packs(base["dtype"], pack)
    for size in sizes:
        slice_packs = -(-packs // size)
        threads = max(128, _pow2_at_least(-(-slice_packs // apt)))
        if threads > 1024:
            continue
        if size > 1 and slice_packs < 128:
            return None
        values = slice_packs * pack
        smem = 2 * item * pol.inputs * values + 4 * values + pol.smem_align
        if smem > limit:
            continue
        variant = Variant.BLOCK_SMEM if size == 1 else Variant.CLUSTER
        plan = Plan(variant=variant, block=(threads, 1), grid=size, smem_bytes=smem,
                    cluster=size, sums_in_registers=True, gamma_in_smem=True, **no_warp, **base)
        per_sm = occ(plan)
        if per_sm > 0:
            return plan, per_sm, True, slice_packs
    return None


def _cluster_fallback(base: dict, no_warp: dict, device: DeviceSpec,
                      occ: Occupancy) -> Way | None:
    """A row no block holds and no cluster holds as S2g (float64, odd 16-bit widths): the
    smallest cluster that fits, its slice held (in this order) with shared-memory sums and two
    buffers, one buffer, register sums and two buffers, one buffer; the first keeping two
    blocks an SM, else the first with two buffers, else the first; then gamma in shared memory
    where that costs no resident block (float compute, two buffers)."""
    tune = tuning_for(device)
    pol, dtype, cols, pack = base["policy"], base["dtype"], base["cols"], base["pack_size"]
    item, sums = ITEMSIZE[dtype], _sums(base)
    csize = 8 if dtype == "float64" else 4
    apt = reg_sum_packs(dtype, pack)
    limit = max_dynamic_smem(device)
    asynchronous = pack * item >= 4
    for size in tune.cluster_sizes:
        slice_packs = -(-(cols // pack) // size)
        values = slice_packs * pack
        rows_smem = item * pol.inputs * values
        found = []
        for in_regs, two in itertools.product((False, True), (True, False)):
            if (two and not asynchronous) or (in_regs and slice_packs > apt * 1024):
                continue
            threads = min(tune.cluster_max_block, block_threads_for(slice_packs, tune))
            if in_regs:
                threads = max(threads, min(1024, _pow2_at_least(-(-slice_packs // apt))))
            smem = rows_smem * (2 if two else 1) + (0 if in_regs else sums * csize * values) \
                + pol.smem_align
            if smem > limit:
                continue
            plan = Plan(variant=Variant.CLUSTER, block=(threads, 1), grid=size, smem_bytes=smem,
                        cluster=size, sums_in_registers=in_regs, **no_warp, **base)
            per_sm = occ(plan)
            if per_sm > 0:
                found.append((plan, per_sm, two, slice_packs))
        if not found:
            continue
        pick = next((f for f in found if f[1] >= 2), None) or \
            next((f for f in found if f[2]), None) or found[0]
        plan, per_sm, two, sp = pick
        if two and csize == 4:
            cached = replace(plan, smem_bytes=plan.smem_bytes + csize * values, gamma_in_smem=True)
            if cached.smem_bytes <= limit and occ(cached) >= per_sm:
                plan = cached
        return plan, per_sm, two, sp
    return None


def _with_grid(plan: Plan, per_sm: int, two: bool, sums: int, device: DeviceSpec,
               occ: Occupancy) -> Plan:
    """``plan`` with its grid (one wave of resident blocks or clusters) and its note."""
    if plan.cluster == 1:
        grid, what = max(1, min(plan.rows, device.sms * per_sm)), "row"
    else:
        groups = resident_clusters(plan, per_sm, device, occ)
        grid = max(1, min(plan.rows, groups)) * plan.cluster
        what = f"row split over a cluster of {plan.cluster} blocks"
    notes = (f"{what}: x and dy {'double' if two else 'single'}-buffered in shared memory, "
             f"{sums} column sums in {'registers' if plan.sums_in_registers else 'shared memory'}"
             f"{', gamma in shared memory' if plan.gamma_in_smem else ''} "
             f"({plan.smem_bytes} bytes per block, {per_sm} resident per SM)",)
    return replace(plan, grid=grid, notes=notes)


def _block_key(per_sm: int, two: bool, packs: int, plan: Plan) -> tuple:
    """The block kernel's ways, larger first: gamma in shared memory; resident threads an SM
    nearest 1024; sums in shared memory (in registers for rows of at most 128 packs); the
    larger share of busy threads in the last pass; the wider block; two buffers."""
    passes = -(-packs // plan.threads)
    in_regs = plan.sums_in_registers
    return (plan.gamma_in_smem, -abs(math.log2(per_sm * plan.threads) - 10),
            in_regs if packs <= 128 else not in_regs, packs / (plan.threads * passes),
            plan.threads, two)


def _keeps_block(way: Way, item: int) -> bool:
    """The block's best way stays before the S2g clusters with two or more blocks an SM, or
    alone holding x and dy twice (4-byte values: once) with gamma and shared-memory sums."""
    plan, per_sm, two, _ = way
    on_chip = plan.gamma_in_smem and not plan.sums_in_registers
    return per_sm >= 2 or (on_chip and (two or item == 4))


def _cluster_key(plan: Plan, per_sm: int, sums: int) -> tuple:
    """The S2g clusters, larger first. Layer norm (two sums): two or more blocks an SM,
    resident threads nearest 512, the smaller cluster, the wider block. RMS norm: the smaller
    cluster, blocks nearest 512 threads, more of them an SM."""
    if sums == 2:
        return (per_sm >= 2, -abs(math.log2(per_sm * plan.threads) - 9), -plan.cluster,
                plan.threads)
    return (-plan.cluster, -abs(math.log2(plan.threads) - 9), per_sm)


def reachable_shapes(dtype: str, device: DeviceSpec, strided: bool) -> list[dict]:
    """The cached kernel shapes ``ways`` can reach with a weight (name-expression fields)."""
    tune = tuning_for(device)
    regs = (False, True)
    gammas = (False, True) if dtype != "float64" else (False,)
    shapes = [dict(variant=Variant.BLOCK_SMEM, threads=t, sums_in_registers=r, gamma_in_smem=g)
              for t, r, g in itertools.product((128,) + tune.block_sizes, regs, gammas)]
    if device.has_clusters and not strided:
        widths = [(t, r) for t in (128, 256, tune.cluster_max_block) for r in regs] + [(1024, True)]
        shapes += [dict(variant=Variant.CLUSTER, threads=t, cluster=size, sums_in_registers=r,
                        gamma_in_smem=g)
                   for size, (t, r), g in itertools.product(tune.cluster_sizes, widths, gammas)]
    return shapes


# ---------------------------------------------------------------------------------------------
# The auxiliary kernels: partial rows straight from x and dy (for the uncached kernel), and the
# reduction of the partial rows into dweight (and dbias).

@dataclass(frozen=True)
class AuxLaunch:
    grid: tuple[int, ...]
    block: tuple[int, ...]
    pack_size: int = 1
    vec: bool = False  # the reduction's 16-byte column lanes


@dataclass(frozen=True)
class ParamGradPlan:
    """How dweight (and dbias) are finished after ``plan``'s main kernel: ``prows`` partial rows
    of ``nacc`` sums, written by the main kernel or by ``partial``, added up by ``reduce``."""

    nacc: int
    prows: int
    reduce: AuxLaunch
    partial: AuxLaunch | None = None


def plan_param_grad(plan: Plan, device: DeviceSpec) -> ParamGradPlan | None:
    """The auxiliary launches of a backward with column sums (None without a weight)."""
    nacc = plan.policy.col_sums
    if not (nacc and plan.switches.weight):
        return None
    partial = None
    if plan.variant is Variant.BLOCK_UNCACHED:
        tune = tuning_for(device)
        threads = tune.partial_threads
        tiles = -(-plan.cols // (threads * plan.pack_size))
        waves = tune.partial_waves * device.sms * (device.max_threads_per_sm // threads)
        prows = max(1, min(plan.rows, waves // tiles))
        partial = AuxLaunch(grid=(tiles, prows), block=(threads,), pack_size=plan.pack_size)
    else:
        prows = plan.grid // plan.cluster
    vec, block, grid = param_reduce_shape(plan.cols, prows, nacc, plan.dtype, device)
    return ParamGradPlan(nacc, prows, AuxLaunch(grid=grid, block=block, vec=vec), partial)


def param_reduce_shape(cols: int, prows: int, nacc: int, dtype: str,
                       device: DeviceSpec) -> tuple[bool, tuple[int, int], tuple[int, int]]:
    """(vec, block, grid) of norm_param_grad_reduce, which adds ``prows`` partial rows of
    ``nacc`` column sums into dweight (and dbias). Each of a block's 32 column lanes takes 16
    bytes of adjacent sums (``vec``) where the columns divide into them and the grid still has
    a block for every other SM, else one column; its row lanes (a power of two up to 32) take
    about four partial rows each with 16-byte lanes and eight with single columns."""
    width = 16 // (8 if dtype == "float64" else 4)
    vec = cols % width == 0 and -(-cols // (32 * width)) * nacc * 2 >= device.sms
    per_lane = 4 if vec else 8
    lanes = 1
    while lanes < 32 and 2 * (lanes * per_lane) ** 2 < prows * prows:  # nearest power of two
        lanes *= 2
    return vec, (32, lanes), (-(-cols // (32 * (width if vec else 1))), nacc)

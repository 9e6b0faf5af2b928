"""The row-wise cascade: (op, rows, cols, dtype, device, occupancy) -> Plan.

OneFlow's three variants (warp, block with shared memory, block
uncached) with its thresholds, plus thread-block clusters for rows past one block's shared
memory. cukern's departures, each with its numbers in ``docs/notes/``: up to 16-byte packs;
rows cached in their storage type with the full opt-in shared memory; clusters (plan_cluster);
the warp kernel's short grids and grids without a cap of waves; a block width that keeps
``packs_per_thread`` packs a thread and the most threads resident; overlapping rows with a
residual (plan_overlap). A
backward that also sums over rows goes to ``col_sums.plan_col_sums``.
"""

from __future__ import annotations

import functools
import itertools

from .._device import DeviceSpec
from . import col_sums
from .common import (
    ITEMSIZE,
    Occupancy,
    Plan,
    Switches,
    Variant,
    block_threads_for,
    max_dynamic_smem,
    model_occupancy,
    num_blocks,
    pack_size,
    replace,
    resident_clusters,
    warp_shape,
)
from .policy import OpPolicy, Tuning, arch_tunings, tuning_for

__all__ = ["plan_rowwise", "reachable_plans", "MAX_COLS"]

# The longest row: the kernels count a row's columns and packs in 32-bit ints, and a block's
# loops step up to 4 x 1024 packs past the row's end (softmax_scan, scan_packs).
MAX_COLS = 2**31 - 4096

NO_WARP = dict(cols_per_thread=0, thread_group_width=0, rows_per_access=0, padding=False)


def _policy(op) -> OpPolicy:
    return op if isinstance(op, OpPolicy) else _registered(op)


@functools.cache  # the planner asks once a plan
def _registered(op: str) -> OpPolicy:
    from ..registry import policy  # the families declare the policies

    return policy(op)


# Rows of at least this many 16-byte packs take them shifted (Plan.shifted) where narrower
# packs would divide them.
SHIFT_MIN_PACKS = 4


def _shifted(pol: OpPolicy, dtype: str, cols: int, pack: int, strided: bool, shift_ok: bool,
             sw: Switches, tune: Tuning) -> bool:
    """Shifted packs for rows past the warp kernel; a warp row takes them only where they
    fill 32 values a lane in no more lanes and slots than its narrow packs do."""
    full = 16 // ITEMSIZE[dtype]
    if not (pol.shifted_rows and shift_ok and not strided and pack < full
            and cols >= SHIFT_MIN_PACKS * full and not sw.float32_params):
        return False
    warp_max = tune.warp_max_cols_with_sums if pol.col_sums and sw.weight else tune.warp_max_cols
    return cols > warp_max or _shifted_warp(pol, cols, pack, full, warp_max)


def _shifted_warp(pol: OpPolicy, cols: int, pack: int, full: int, warp_max: int) -> bool:
    """Whether a row the warp kernel holds in narrow packs takes shifted ones: in the warp
    kernel (``shifted_warp_fits``, or ``OpPolicy.shifted_half_warps``), or past it in the
    block kernel (``OpPolicy.shifted_past_warp``)."""
    span = shifted_cols(cols, full)
    if span > warp_max:
        return pol.shifted_past_warp
    if pol.shifted_half_warps and warp_shape(span, full, 1)[1] == 32:
        return True
    return shifted_warp_fits(cols, pack, full, warp_max)


def shifted_warp_fits(cols: int, pack: int, full: int, warp_max: int) -> bool:
    """A warp row of ``cols`` in narrow packs of ``pack`` that shifted packs of ``full`` serve
    as well: 32 values a lane, no more slots. Rows with packs just past a power of two leave
    half the shifted slots empty: H200, softmax float16 127-511 columns 42-65% of copy shifted
    against 65-87% in 1-element packs; at 1001 columns (32 a lane) every op and dtype 98-104%
    against 70-105 (docs/notes/softmax.md)."""
    span = shifted_cols(cols, full)
    if span > warp_max:
        return False
    width, cpt, _, _ = warp_shape(span, full, 1)
    narrow_width, narrow_cpt, _, _ = warp_shape(cols, pack, 1)
    return cpt == 32 and width * cpt <= narrow_width * narrow_cpt


def shifted_cols(cols: int, pack: int) -> int:
    """The columns a shifted row's packs span at most (kernels/memory.cuh, row_packs): its
    first element anywhere in its first 16-byte pack."""
    return (cols + 2 * pack - 2) // pack * pack


def _two_packs(pol: OpPolicy, sw: Switches, pack_bytes: int, tune: Tuning) -> int:
    """Warp rows of 3 up to this many packs take two packs a lane (0: none): full 16-byte
    packs, no residual, Tuning.two_packs_max_packs."""
    ok = pol.two_packs_a_lane and pack_bytes == 16 and not sw.residual
    return tune.two_packs_max_packs if ok else 0


def _may_pair(pol: OpPolicy, sw: Switches, dtype: str) -> bool:
    """Clusters two rows a pass: 16-bit rows with gamma or beta and no residual."""
    return pol.pair_rows and ITEMSIZE[dtype] == 2 and not sw.residual and (sw.weight or sw.bias)


def plan_rowwise(op, rows: int, cols: int, dtype: str, device: DeviceSpec,
                 occupancy: Occupancy | None = None, *, align_elems: int = 16,
                 strided: bool = False, switches: Switches | None = None,
                 shift_ok: bool = True) -> Plan:
    """Choose the kernel for a row-wise op over a (rows, cols) view.

    ``align_elems``: the largest power of two (in elements, up to 16) dividing every pointer's
    address and every row stride; ``strided``: rows or columns are not contiguous, so every
    access is a single element. ``occupancy`` defaults to the device model. ``switches``: the
    optional operands the call passes (None: none). ``shift_ok``: every array's rows start at
    the same offset within their 16-byte words (pointers and row strides congruent modulo 16
    bytes, as for fresh C-contiguous arrays), so rows off the 16-byte grid may be read in
    16-byte packs of memory (``OpPolicy.shifted_rows``).
    """
    pol = _policy(op)
    if dtype not in ITEMSIZE:
        raise ValueError(f"plan: unsupported dtype {dtype!r}; expected one of {sorted(ITEMSIZE)}")
    if rows < 1 or cols < 1:
        raise ValueError(f"plan: rows and cols must be positive, got rows={rows}, cols={cols}")
    if cols > MAX_COLS:
        raise ValueError(f"plan: {pol.op} over rows of {cols} columns; at most {MAX_COLS} "
                         f"(2^31 - 4096) are supported (the kernels' 32-bit column index)")
    sw = Switches() if switches is None else switches
    if not isinstance(sw, Switches) or \
            (replace(sw, float32_params=False) if sw.float32_params else sw) \
            not in pol.switch_sets:
        raise ValueError(f"plan: {pol.op} takes switches from {[str(s) for s in pol.switch_sets]}"
                         f", got {sw}")
    if sw.float32_params:
        _check_float32_params(pol, sw, dtype, strided)
    if strided and not pol.strided:
        raise ValueError(f"plan: {pol.op} has no strided kernels; rows must have contiguous "
                         f"columns")
    occ = occupancy or model_occupancy(device)
    tune = tuning_for(device)
    item = ITEMSIZE[dtype]
    pack = pack_size(dtype, cols, align_elems, strided)
    shifted = _shifted(pol, dtype, cols, pack, strided, shift_ok, sw, tune)
    if shifted:
        pack = 16 // ITEMSIZE[dtype]
    base = dict(op=pol.op, dtype=dtype, rows=rows, cols=cols, pack_size=pack, strided=strided,
                device=device.name, switches=sw, policy=pol, shifted=shifted)
    if shifted:  # sized by the most packs a row covers on the 16-byte grid
        cols = shifted_cols(cols, pack)
    # dweight/dbias: kept on chip beside a cached row, one wave of blocks, each a partial row
    sums = pol.col_sums if sw.weight else 0
    if sw.float32_params:  # the uncached kernel, a block as wide as the row's packs need
        plan = _uncached(base, sums, device, rows,
                         min(tune.uncached_block, block_threads_for(cols // pack, tune)))
        return replace(plan, notes=("float32 weight and bias with 16-bit data: the uncached "
                                    "kernel (x read twice), the one instantiated for them",)
                       + plan.notes[1:])

    if cols <= (tune.warp_max_cols_with_sums if sums else tune.warp_max_cols):
        return _plan_warp(pol, base, rows, cols, pack, item, sums, device, occ, tune)
    if sums:
        plan = col_sums.plan_col_sums(base, NO_WARP, device, occ)
        return plan if plan is not None else _uncached(base, sums, device, rows)

    smem_per_col = item * pol.inputs
    overlap = pol.overlap_with_residual and sw.residual
    paired = rows >= 2 and cols >= tune.paired_min_cols and _may_pair(pol, sw, dtype) and \
        (pol.shifted_pairs or not shifted)
    smem = cols * smem_per_col + pol.smem_align

    @functools.cache
    def sized(threads: int) -> tuple[Plan, int]:  # a block and its resident blocks an SM
        total = with_tail(pol, dtype, smem, threads, cluster=False) \
            if dtype in pol.tail_in_blocks else smem
        plan = Plan(variant=Variant.BLOCK_SMEM, block=(threads, 1), grid=1, smem_bytes=total,
                    **NO_WARP, **base)
        return plan, occ(plan) if plan.smem_bytes <= max_dynamic_smem(device) else 0

    candidate, occ128 = sized(128)
    if occ128 > 0:
        widest = block_threads_for(cols // pack, tune)
        # OneFlow's width (the widest with the 128-thread occupancy) where it keeps the most
        # threads resident; else (registers cut a wider block's count) the narrowest that does,
        # or with the op's load_round, of those sharing an SM the one loading a row in the
        # fewest rounds. Other widths are asked (a compile each on a GPU) only where an SM has
        # room left.
        threads = next((t for t in tune.block_sizes
                        if t <= widest and sized(t)[1] == occ128), 128)

        def rank(t: int) -> tuple[int, int]:  # threads resident, then fewer load rounds
            per_sm, rounds = sized(t)[1], 0
            if pol.load_round:  # a block alone on its SM ranks last among equals
                packs_each = -(-(cols // pack) // t)
                rounds = -(-packs_each // pol.load_round) if per_sm > 1 else MAX_COLS
            return per_sm * t, -rounds

        most = sized(threads)[1] * threads
        keep = dtype in pol.oneflow_width_dtypes and not sw.residual and \
            most >= tune.kept_width_threads and sized(threads)[1] <= tune.kept_width_blocks
        if most < device.max_threads_per_sm and not keep:
            widths = [t for t in (128,) + tune.block_sizes if t <= max(widest, 128)]
            best = max(widths, key=lambda t: (rank(t), -t))
            if rank(best) > rank(threads):
                threads, most = best, sized(best)[1] * best
        candidate = sized(threads)[0]
        plan = replace(candidate, notes=(
            f"row cached in shared memory as {dtype} ({candidate.smem_bytes} bytes per block)",))
        if overlap:
            return plan_overlap(plan, sized(threads)[1], widest, device, occ, rows)
        # lone: at most lone_block_resident threads an SM with the width that keeps the most
        # (not only the one taken: registers can leave a wider block fewer blocks, more threads)
        if pol.split_lone_blocks and device.has_clusters and not strided and \
                most <= tune.lone_block_resident:
            shared = plan_cluster(base, cols, pack, smem_per_col, device, occ, rows,
                                  shared_only=True, paired=paired)
            if shared is not None:
                return replace(shared, notes=shared.notes + (
                    f"one block of {plan.threads} threads would be alone on its SM",))
        if pol.lone_block_one_wave and sized(threads)[1] == 1:
            return replace(plan, grid=max(1, min(rows, device.sms)), notes=plan.notes + (
                "one wave of blocks, each alone on its SM, looping over rows",))
        return replace(plan, grid=num_blocks(device, plan.threads, rows))

    if device.has_clusters and not strided:
        plan = plan_cluster(base, cols, pack, smem_per_col, device, occ, rows, overlap,
                            paired=paired)
        if plan is not None:
            return plan
    if shifted and not pol.shifted_uncached:  # the uncached kernel of narrow packs
        return plan_rowwise(op, rows, base["cols"], dtype, device, occupancy,
                            align_elems=align_elems, strided=strided, switches=switches,
                            shift_ok=False)
    return _uncached(base, sums, device, rows)


def _plan_warp(pol, base, rows, cols, pack, item, sums, device, occ, tune: Tuning) -> Plan:
    width, cpt, rpa, padding = warp_shape(
        cols, pack, rows, two_packs=_two_packs(pol, base["switches"], pack * item, tune),
        four_packs=(pol.op, item) in tune.warp_four_packs)
    block = (width, tune.warp_block_threads // width)
    resident = device.sms * (device.max_threads_per_sm // tune.warp_block_threads)
    if rpa == 2 and -(-rows // block[1]) <= tune.short_grid_waves * resident:
        rpa = 1  # a short grid: each thread's chain of loads, shuffles and stores is the time
    groups = -(-rows // rpa)
    needed = -(-groups // block[1])
    # every group of rows its own block, no cap of waves (100.2 vs 99.7% of copy, H100)
    plan = Plan(variant=Variant.WARP, cols_per_thread=cpt, thread_group_width=width,
                rows_per_access=rpa, padding=padding, block=block,
                grid=1 if sums else min(needed, tune.max_grid), smem_bytes=0, **base)
    if sums:  # one wave of resident blocks, each writing a partial row of the sums
        return replace(plan, grid=max(1, min(needed, device.sms * max(1, occ(plan)))))
    return plan


def plan_overlap(plan: Plan, per_sm: int, widest: int, device: DeviceSpec, occ: Occupancy,
                 rows: int) -> Plan:
    """A block kernel that may overlap its rows (Plan.overlap) does so where ``plan`` (the
    block-width rule's blocks, ``per_sm`` resident an SM) leaves at most ``overlap_resident``
    threads on an SM: then the widest block the row allows that launches; a block alone on its
    SM loops over rows in one wave. Numbers: docs/notes/layer-norm-forward.md."""
    tune = tuning_for(device)
    if per_sm * plan.threads > tune.overlap_resident:
        return replace(plan, grid=num_blocks(device, plan.threads, rows))
    for threads in tune.block_sizes + (128,):
        ov = replace(plan, block=(threads, 1), overlap=True)
        n = occ(ov) if threads <= widest else 0
        if n > 0:
            break
    else:
        return replace(plan, grid=num_blocks(device, plan.threads, rows))
    if n == 1:
        grid, note = device.sms, "one wave of blocks, each overlapping its rows"
    else:
        grid = num_blocks(device, ov.threads, rows)
        note = f"blocks overlapping their rows, {n} resident per SM"
    return replace(ov, grid=max(1, min(rows, grid)), notes=ov.notes + (note,))


def plan_cluster(base: dict, cols: int, pack: int, smem_per_col: int, device: DeviceSpec,
                 occ: Occupancy, rows: int, overlap: bool = False, shared_only: bool = False,
                 paired: bool = False, rows_per_pass: int = 1) -> Plan | None:
    """A row too long for one block's shared memory, split over a thread-block cluster: each
    block caches a slice and the reductions meet in distributed shared memory.

    1. the smallest cluster and narrowest block (``cluster_shared``) that keep two or more
       blocks and the op's ``cluster_threads_per_sm`` threads resident on an SM;
    2. else the smallest cluster that fits, with the widest block that launches.

    Grid: one wave of resident clusters looping over rows where blocks overlap rows (the op's
    ``rows_overlap``, or ``overlap``), one block fits an SM, two rows a pass, or the cluster
    has ``one_wave_cluster`` blocks or more; else OneFlow's waves. ``shared_only``: rule 1 or
    None. ``paired``: first rule 1 with two rows a pass (``rows_per_pass``), on clusters of at
    most ``paired_max_cluster``. Numbers: docs/notes/ (plan_cluster).
    """
    tune = tuning_for(device)
    if paired:
        plan = plan_cluster(base, cols, pack, smem_per_col, device, occ, rows,
                            shared_only=True, rows_per_pass=2)
        if plan is not None:
            return plan
    pol = base["policy"]
    fits = []
    sizes = [n for n in tune.cluster_sizes if rows_per_pass == 1 or n <= tune.paired_max_cluster]
    for size in sizes:
        slice_packs = -(-(cols // pack) // size)
        smem = rows_per_pass * slice_packs * pack * smem_per_col + pol.smem_align
        if smem <= max_dynamic_smem(device):
            fits.append((size, smem))

    def cluster(size: int, smem: int, threads: int) -> tuple[Plan, int]:
        if pol.tail_scratch_words:
            smem = with_tail(pol, base["dtype"], smem, threads, rows_per_pass)
        plan = Plan(variant=Variant.CLUSTER, block=(threads, 1), grid=size, smem_bytes=smem,
                    cluster=size, overlap=overlap, rows_per_pass=rows_per_pass, **NO_WARP,
                    **base)
        return plan, occ(plan) if smem <= max_dynamic_smem(device) else 0

    shared = (cluster(s, m, t) for s, m in fits for t in tune.cluster_shared)
    choice = next(((p, n) for p, n in shared
                   if n >= 2 and n * p.threads >= pol.cluster_threads_per_sm), None)
    if choice is None and shared_only:
        return None
    if choice is None:
        alone = (cluster(s, m, t) for s, m in fits for t in tune.cluster_blocks)
        choice = next(((p, n) for p, n in alone if n > 0), None)
    if choice is None:
        return None
    plan, per_sm = choice
    size = plan.cluster
    resident = resident_clusters(plan, per_sm, device, occ)
    one_wave = rows_per_pass > 1 or 0 < pol.one_wave_cluster <= size
    if pol.rows_overlap or overlap or per_sm == 1 or one_wave:
        clusters, grid_note = resident, f"one wave of {resident} clusters"
    else:
        clusters, grid_note = resident * tune.waves, f"up to {tune.waves} waves of {resident} " \
                                                     f"clusters"
    notes = (f"row split over a cluster of {size} blocks, {plan.smem_bytes} bytes of shared "
             f"memory each, {per_sm} resident per SM; {grid_note}",)
    if rows_per_pass > 1:
        notes += (f"{rows_per_pass} rows a pass, each block's gamma and beta read once for them",)
    passes = -(-rows // rows_per_pass)
    return replace(plan, grid=max(1, min(passes, clusters)) * size, notes=notes)


def tail_scratch(pol: OpPolicy, dtype: str, threads: int, rows_per_pass: int = 1,
                 cluster: bool = True) -> int:
    """Bytes of a block's reduction buffers at the end of its dynamic shared memory
    (kernels/memory.cuh): the block all-reduce's two states a warp (``tail_scratch_words`` a row
    of the pass; one in a cluster of two rows a pass, which keeps three blocks of two 16-bit
    rows of 16384 columns in the 196 KiB carveout step) in 16-byte units, then in a cluster the
    merge's four (``tail_merge_words``).
    Static ones would push three blocks of 64 KiB past the 196 KiB carveout into the 228 KiB
    one, leaving the SM 28 KiB of L1 for its loads in flight instead of 60
    (docs/notes/softmax.md)."""
    word = (8 if dtype == "float64" else 4) * rows_per_pass
    buffers = 1 if cluster and rows_per_pass > 1 else 2
    partials = -(-buffers * (threads // 32) * pol.tail_scratch_words * word // 16) * 16
    merge = 4 * pol.tail_merge_words * word if cluster else 0
    return partials + merge


def with_tail(pol: OpPolicy, dtype: str, smem: int, threads: int, rows_per_pass: int = 1,
              cluster: bool = True) -> int:
    """``smem`` bytes of cached rows, then the reduction buffers (:func:`tail_scratch`) from the
    16-byte boundary after them (rows of odd lengths end anywhere)."""
    return -(-smem // 16) * 16 + tail_scratch(pol, dtype, threads, rows_per_pass, cluster)


def _check_float32_params(pol: OpPolicy, sw: Switches, dtype: str, strided: bool) -> None:
    if not pol.float32_params:
        raise ValueError(f"plan: {pol.op} takes no float32 parameters")
    if ITEMSIZE[dtype] != 2:
        raise ValueError(f"plan: float32 parameters go with float16 or bfloat16 data, not "
                         f"{dtype}")
    if not (sw.weight or sw.bias) or strided:
        raise ValueError("plan: float32 parameters need a weight or a bias, and rows with "
                         "contiguous columns")


def _uncached(base: dict, sums: int, device: DeviceSpec, rows: int,
              threads: int | None = None) -> Plan:
    notes = ("row too long to keep on chip: read twice from memory",)
    if sums:
        notes += ("column sums by a separate pass over x and dy (norm_param_grad_partial)",)
    tune = tuning_for(device)
    plan = Plan(variant=Variant.BLOCK_UNCACHED, block=(threads or tune.uncached_block, 1),
                grid=1, smem_bytes=0, notes=notes, **NO_WARP, **base)
    return replace(plan, grid=num_blocks(device, plan.threads, rows))


def reachable_plans(op, dtype: str, device: DeviceSpec) -> set[str]:
    """Every kernel instantiation the planner can produce for ``op`` and ``dtype`` on a device
    of this architecture, whatever the shape, alignment or occupancy: the name expressions of
    the shapes the rules above (and ``col_sums``) can reach, from the same tables."""
    pol = _policy(op)
    tune = tuning_for(device)
    item = ITEMSIZE[dtype]
    packs = sorted({pack_size(dtype, c, 16, False) for c in (1, 2, 4, 8, 16)})
    layouts = [(p, False, False) for p in packs] + ([(1, True, False)] if pol.strided else [])
    if pol.shifted_rows:
        layouts.append((16 // item, False, True))
    names: set[str] = set()
    # every switch set: the forward's warp and block names collapse over weight and bias (kernel
    # arguments, null where absent), its cluster names do not (template switches)
    for (pack, strided, shifted), sw in itertools.product(layouts, pol.switch_sets):
        if shifted and sw.float32_params:
            continue
        base = dict(op=pol.op, dtype=dtype, rows=1, cols=1, pack_size=pack, strided=strided,
                    device=device.name, grid=1, switches=sw, policy=pol, shifted=shifted)

        def add(variant: Variant, threads: int, **kw) -> None:
            shape = {} if variant is Variant.WARP else NO_WARP
            names.add(Plan(variant=variant, block=(threads, 1), smem_bytes=0, **shape, **kw,
                           **base).name_expression())

        # two (or four) packs a lane as far as any GPU model of the architecture takes them
        lanes = {(_two_packs(pol, sw, pack * item, t), (pol.op, item) in t.warp_four_packs)
                 for t in arch_tunings(device)}
        widths = range(pack, tune.warp_max_cols + 1, pack)
        if shifted:  # the packs a row covers at most, as plan_rowwise sizes them
            spans = {shifted_cols(c, pack) for c in range(SHIFT_MIN_PACKS * pack,
                                                          tune.warp_max_cols + 1)
                     if any(_shifted_warp(pol, c, p, pack, tune.warp_max_cols)
                            for p in packs if p < pack)}
            widths = sorted(c for c in spans if c <= tune.warp_max_cols)  # wider: blocks
        shapes = {warp_shape(cols, pack, rows, two_packs=n, four_packs=f)
                  for cols, rows, (n, f) in itertools.product(widths, (1, 2), lanes)}
        for width, cpt, rpa, padding in shapes:  # each distinct shape once
            add(Variant.WARP, width, cols_per_thread=cpt, thread_group_width=width,
                rows_per_access=rpa, padding=padding)
        sums = pol.col_sums if sw.weight else 0
        overlaps = (False, True) if pol.overlap_with_residual and sw.residual else (False,)
        for threads, o in itertools.product((128,) + tune.block_sizes, overlaps):
            if not sums:
                add(Variant.BLOCK_SMEM, threads, overlap=o)
        if pol.shifted_uncached or not shifted:
            add(Variant.BLOCK_UNCACHED, tune.uncached_block)
        if pol.float32_params and item == 2 and not (strided or shifted) and \
                (sw.weight or sw.bias):
            base["switches"] = replace(sw, float32_params=True)
            add(Variant.BLOCK_UNCACHED, tune.uncached_block)
            base["switches"] = sw
        if sums:
            for shape in col_sums.reachable_shapes(dtype, device, strided):
                add(shape.pop("variant"), shape.pop("threads"), **shape)
        elif device.has_clusters and not strided:
            for size, threads in itertools.product(
                    tune.cluster_sizes, {*tune.cluster_shared, *tune.cluster_blocks}):
                add(Variant.CLUSTER, threads, cluster=size, overlap=overlaps[-1])
            if _may_pair(pol, sw, dtype) and (pol.shifted_pairs or not shifted):
                for size, threads in itertools.product(tune.cluster_sizes, tune.cluster_shared):
                    if size <= tune.paired_max_cluster:
                        add(Variant.CLUSTER, threads, cluster=size, rows_per_pass=2)
    return names

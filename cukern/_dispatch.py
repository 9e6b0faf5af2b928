"""Pure planners: (op, rows, cols, dtype, device, occupancy) -> Plan.

Nothing here touches a GPU. Occupancy is a function passed in: the CUDA driver's answer for a
compiled kernel on a live device, or :meth:`DeviceSpec.model_occupancy` for a preset.

The cascade follows OneFlow's tuned softmax (the thresholds and shapes are theirs; DESIGN.md
section 2), with these departures, each measured in ``benchmarks/``:

* vector width: up to 16 bytes per access (8 halves, 4 floats, 2 doubles) where ``cols``, the
  pointers and the row strides allow, instead of OneFlow's 2 elements;
* the block kernel caches the row in its storage type (not float) and opts in to the device's
  full shared memory per block (227 KiB on Hopper) instead of 48 KiB;
* rows too long for one block's shared memory are split over a thread-block cluster (Hopper):
  each block keeps a slice on chip and the partial reductions meet in distributed shared memory
  (cluster and block sizes: ``_plan_cluster``). The uncached kernel (which reads the row twice)
  is left for rows no cluster can hold;
* the warp kernel takes one row per access on short grids (SHORT_GRID_WAVES), and its grid
  is every group of rows, not at most 32 waves of them;
* the block kernel's width is capped so each thread gets at least PACKS_PER_THREAD packs
  (OneFlow's rule alone takes 1024 threads whenever occupancy allows, and short rows then leave
  most threads idle: 22% of copy against 92% for 2048 halves on the H100);
* a backward that also sums over rows (the norms' dweight, dbias) runs one wave of blocks that
  each loop over rows, with its own rules for where the sums live and whether rows are
  double-buffered (``_plan_col_sums``), and leaves the warp kernel past 512 columns.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ._device import DeviceSpec

__all__ = ["Plan", "Variant", "plan_rowwise", "col_sums_ways", "param_reduce_shape", "OPS"]

WARP_MAX_COLS = 1024  # OneFlow: the warp kernel holds at most 32 values a lane, 32 lanes a row
WARP_MAX_COLS_WITH_SUMS = 512  # a backward with column sums (registers: see plan_rowwise)
WARP_BLOCK_THREADS = 128  # OneFlow: 128 threads per block for the warp kernel
BLOCK_SIZES = (1024, 512, 256)  # tried, largest first, against the 128-thread occupancy
UNCACHED_BLOCK = 1024
# Cluster sizes tried, smallest first. 16 is past the portable 8: Hopper allows it per kernel
# (ops/_common.kernel opts in), and where a driver refuses it its occupancy is 0.
CLUSTER_SIZES = (2, 4, 8, 16)
PACKS_PER_THREAD = 2  # the fewest packs per thread worth a wider block (measured, H100)
CLUSTER_MAX_BLOCK = 512  # a backward with column sums: wider cluster blocks measured slower
CLUSTER_SHARED = (256, 512)  # blocks that may share an SM in a cluster plan (_plan_cluster)
CLUSTER_BLOCKS = (1024, 512, 256)  # else the widest of these that launches
WAVES = 32  # OneFlow's GetNumBlocks: at most 32 waves of resident threads
MAX_GRID = 2**31 - 1  # CUDA's limit on gridDim.x (the kernels loop over what lies past it)
# The warp kernel takes one row per access (not OneFlow's two) when that grid is at most this
# many waves of resident blocks: 95-97% of copy against 93-95% for float16 and bfloat16 at
# rows 49152, cols 32-128, on the H100; far more rows keep OneFlow's two.
SHORT_GRID_WAVES = 4
# A block kernel with Plan.overlap available takes it where OneFlow's blocks would leave at most
# this many threads on an SM (_plan_overlap)
OVERLAP_RESIDENT = 1024
# An op with OpInfo.split_lone_blocks moves a row whose block would leave at most this many
# threads on an SM to a cluster of blocks that share SMs (_plan_cluster's first rule)
LONE_BLOCK_RESIDENT = 1024
# A layer norm cluster plan over 16-bit rows with a weight or bias takes two rows a pass
# (Plan.rows_per_pass) from this many columns (_plan_cluster)
PAIRED_MIN_COLS = 131072
# ... over clusters of at most this many blocks (_plan_cluster)
PAIRED_MAX_CLUSTER = 8
STATIC_SMEM = 2048  # kept back from the opt-in limit for static shared memory (up to 1.6 KiB)


class Variant(str, enum.Enum):
    WARP = "warp"
    BLOCK_SMEM = "block_smem"
    CLUSTER = "cluster"
    BLOCK_UNCACHED = "block_uncached"


@dataclass(frozen=True)
class OpInfo:
    """How an op maps onto a kernel family."""

    family: str  # kernels/<family>.cuh
    kernel: str  # kernel name prefix in that file
    algo: int  # template ALGO argument
    inputs: int  # row-sized inputs that a cached variant keeps on chip
    # The kernels read the group width, the block size and padding from the launch, so only what
    # sizes a register array is a template argument (pack, cols_per_thread, rows_per_access,
    # cluster). Their warp kernel guards every pack, and cols_per_thread is rounded up to a power
    # of two packs: far fewer instantiations, for some idle registers.
    runtime_shape: bool = False
    strided: bool = True  # the kernels take a STRIDED argument (strided layouts are plannable)
    extras: tuple[tuple[str, ...], ...] = ((),)  # every `extra` the kernels take; [0]: default
    # A backward that also sums over rows (dweight, dbias): how many per-column sums, in the
    # compute type, it keeps when its first extra switch (WEIGHT) is "true". A cached variant
    # keeps them on chip beside the row, and the grid is one wave of resident blocks, each
    # writing one partial row that `aux_kernels` add up. The uncached variant leaves them to a
    # separate pass over x and dy (`aux_kernels`' norm_param_grad_partial).
    col_sums: int = 0
    # Other kernels the op launches: "{t}" the C++ type, "{algo}" ALGO, "{pack}" a pack size.
    aux_kernels: tuple[str, ...] = ()
    # Cluster plans (_plan_cluster): the resident threads per SM worth a larger cluster, and
    # whether a block's rows overlap (its writes of one row with its reads of the next: then
    # the grid is one wave of clusters looping over rows; else OneFlow's waves of them).
    cluster_threads_per_sm: int = 512
    rows_overlap: bool = True
    # The index in `extra` of a switch under which a cached kernel may overlap a block's rows
    # (load the next row while it writes this one; Plan.overlap, a last template argument of
    # the block and cluster kernels): the norms with a residual. -1: none.
    overlap_switch: int = -1
    # What each position of `extra` switches on, by the name of the op's argument (explain)
    switches: tuple[str, ...] = ()
    # Bytes a cached kernel's shared memory asks for beyond its rows (and sums), to start them
    # on a 128-byte boundary (kernels/common.cuh, aligned_dynamic_smem): the norms
    smem_align: int = 0
    # A row whose block would be alone on its SM (LONE_BLOCK_RESIDENT) goes to a cluster whose
    # blocks share SMs, where one exists (and the kernel does not overlap rows itself). Measured
    # on the H100 for the forward norms (% of copy, one block of 1024 threads -> clusters of 2
    # blocks of 512, 3 per SM): layer norm float16 at 65536 columns 88 -> 92, float32 at 32768
    # 95 -> 96; RMS norm 91 -> 96 and 97.5 -> 98.7.
    split_lone_blocks: bool = False
    # Rows of 3..8 full 16-byte packs: each lane of the warp kernel holds two packs of one row
    # (half the lanes, one shuffle level fewer per reduction) instead of one pack of each of two
    # rows (warp_shape). Measured on the H100 (% of copy, forward norms): layer norm float16 at
    # 64 columns 95.0 -> 96.4, bfloat16 94.5 -> 96.7, float32 at 32 95.9 -> 97.0, RMS norm
    # 97.1 -> 98.0 and 98.0 -> 98.9; 16-bit at 32 columns 93.3 -> 93.4-93.9. From 16 packs a
    # row (a group of 8 lanes) it measured 0.4-0.6 points slower, and with a residual (x and
    # the residual loaded, h stored) 2-3.5 points slower at 32-64 columns: not then.
    two_packs_a_lane: bool = False
    # The indices in `extra` of switches that give each row a parameter row to read (weight,
    # bias): a cluster plan over 16-bit rows with one on may take two rows a pass
    # (Plan.rows_per_pass, _plan_cluster); layer norm only, as measured
    param_switches: tuple[int, ...] = ()
    # Cluster plans of this many blocks or more run as one wave of clusters looping over rows
    # (_plan_cluster); 0: never by size
    one_wave_cluster: int = 0


_TF = ("false", "true")
_NORM = {"runtime_shape": True, "strided": False, "cluster_threads_per_sm": 1536,
         "rows_overlap": False, "smem_align": 128}
_PARAM_REDUCE = ("cukern::norm_param_grad_reduce<{t}>",
                 "cukern::norm_param_grad_partial<{t}, {algo}, {pack}>")

OPS: dict[str, OpInfo] = {
    "softmax": OpInfo("softmax", "softmax", 0, 1),
    "log_softmax": OpInfo("softmax", "softmax", 1, 1),
    "softmax_backward": OpInfo("softmax", "softmax_grad", 0, 2),
    "log_softmax_backward": OpInfo("softmax", "softmax_grad", 1, 2),
    # extra = (WEIGHT, BIAS, RESIDUAL)
    "layer_norm": OpInfo("layer_norm", "layer_norm", 0, 1, **_NORM, overlap_switch=2,
                         split_lone_blocks=True, two_packs_a_lane=True, param_switches=(0, 1),
                         one_wave_cluster=16,
                         extras=tuple((w, b, r) for w in _TF for b in _TF for r in _TF),
                         switches=("weight", "bias", "residual")),
    "rms_norm": OpInfo("layer_norm", "layer_norm", 1, 1, **_NORM, overlap_switch=2,
                       split_lone_blocks=True, two_packs_a_lane=True, one_wave_cluster=16,
                       extras=tuple((w, "false", r) for w in _TF for r in _TF),
                       switches=("weight", "bias", "residual")),
    # extra = (WEIGHT,): dx uses dy * gamma, and dgamma (and dbeta) are summed over rows
    "layer_norm_backward": OpInfo("layer_norm", "layer_norm_grad", 0, 2, **_NORM,
                                  extras=(("false",), ("true",)), col_sums=2,
                                  aux_kernels=_PARAM_REDUCE, switches=("weight",)),
    "rms_norm_backward": OpInfo("layer_norm", "layer_norm_grad", 1, 2, **_NORM,
                                extras=(("false",), ("true",)), col_sums=1,
                                aux_kernels=_PARAM_REDUCE, switches=("weight",)),
}

CPP_TYPES = {"float16": "cukern::f16", "bfloat16": "cukern::bf16", "float32": "float",
             "float64": "double"}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True)
class Plan:
    """One kernel launch, fully decided. Printable, comparable, hashable."""

    op: str
    variant: Variant
    dtype: str
    rows: int
    cols: int
    pack_size: int
    cols_per_thread: int  # warp kernel only (0 otherwise)
    thread_group_width: int  # warp kernel only (0 otherwise)
    rows_per_access: int  # warp kernel only (0 otherwise)
    padding: bool
    block: tuple[int, int]
    grid: int
    smem_bytes: int
    cluster: int = 1
    strided: bool = False
    device: str = ""
    extra: tuple[str, ...] = ()  # op-specific template arguments, appended to the kernel's
    # A cached backward with column sums: they live in registers (else in shared memory); the
    # kernel's next-to-last template argument (REGS)
    sums_in_registers: bool = False
    # A cached backward with weight: gamma is converted once into shared memory beside the
    # row cache (else loaded from memory and converted at each use); the kernel's last
    # template argument (GAMMA)
    gamma_in_smem: bool = False
    # A cached kernel of an op with OpInfo.overlap_switch: each block loads its next row while
    # it writes this one (the kernel's last template argument)
    overlap: bool = False
    # A forward norm cluster plan: the rows each cluster caches and writes in one pass, its
    # blocks' gamma and beta loaded once for them (the kernel's last template argument, ROWS)
    rows_per_pass: int = 1
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1]

    @property
    def min_blocks(self) -> int:
        """A forward norm cluster kernel's MIN_BLOCKS (its ``__launch_bounds__``): 3 for blocks
        of at most 512 threads that do not overlap rows (at most 40 registers a thread, so three
        share an SM; the kernel then spends the room on loading gamma and beta ahead of its
        stores), else 1 (64 registers)."""
        return 3 if self.threads <= 512 and not self.overlap else 1

    def name_expression(self) -> str:
        """The C++ name of the kernel instantiation this plan launches."""
        info = OPS[self.op]
        t = CPP_TYPES[self.dtype]
        s = "true" if self.strided else "false"
        if info.runtime_shape:
            if self.variant is Variant.WARP:
                args = [t, info.algo, self.pack_size, self.cols_per_thread, self.rows_per_access]
            elif self.variant is Variant.CLUSTER:
                args = [t, info.algo, self.pack_size, self.cluster]
            else:
                args = [t, info.algo, self.pack_size]
        elif self.variant is Variant.WARP:
            pad = "true" if self.padding else "false"
            args = [t, info.algo, s, self.pack_size, self.cols_per_thread,
                    self.thread_group_width, self.rows_per_access, pad]
        elif self.variant is Variant.CLUSTER:
            args = [t, info.algo, self.pack_size, self.threads, self.cluster]
        else:
            args = [t, info.algo, s, self.pack_size, self.threads]
        args += list(self.extra)
        if info.col_sums and self.variant in (Variant.BLOCK_SMEM, Variant.CLUSTER):
            args.append("true" if self.sums_in_registers else "false")
            args.append("true" if self.gamma_in_smem else "false")
        if info.overlap_switch >= 0 and self.variant in (Variant.BLOCK_SMEM, Variant.CLUSTER):
            args.append("true" if self.overlap else "false")
        if info.overlap_switch >= 0 and self.variant is Variant.CLUSTER:
            args += [self.min_blocks, self.rows_per_pass]
        return f"cukern::{info.kernel}_{self.variant.value}<{', '.join(map(str, args))}>"

    @property
    def family(self) -> str:
        return OPS[self.op].family

    def __str__(self) -> str:
        lines = [
            f"{self.op} {self.dtype} rows={self.rows} cols={self.cols} on {self.device}",
            f"  variant            {self.variant.value}",
            f"  kernel             {self.name_expression()}",
            f"  pack_size          {self.pack_size} ({self.pack_size * ITEMSIZE[self.dtype]} "
            f"bytes per access)",
        ]
        if self.variant is Variant.WARP:
            lines += [
                f"  thread_group_width {self.thread_group_width}",
                f"  cols_per_thread    {self.cols_per_thread}",
                f"  rows_per_access    {self.rows_per_access}",
                f"  padding            {self.padding}",
            ]
        if self.variant is Variant.CLUSTER:
            lines.append(f"  cluster            {self.cluster} blocks per row")
            if self.rows_per_pass > 1:
                lines.append(f"  rows_per_pass      {self.rows_per_pass} (gamma and beta read "
                             "once for them)")
        if self.overlap:
            lines.append("  overlap            each block loads its next row as it writes one")
        lines += [
            f"  block              {self.block}",
            f"  grid               {self.grid}",
            f"  smem_bytes         {self.smem_bytes}",
            f"  strided            {self.strided}",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# Occupancy query: (candidate plan) -> resident blocks per SM; 0 means it cannot launch. It may
# carry ``max_clusters(plan) -> int | None``: how many clusters of a cluster plan fit the GPU at
# once (the driver's answer; SMs x blocks per SM / cluster size when absent), which sizes the
# one-wave grids of the backward with column sums.
Occupancy = Callable[[Plan], int]


def model_occupancy(device: DeviceSpec) -> Occupancy:
    """Occupancy from the device model (threads and shared memory only)."""

    def occ(plan: Plan) -> int:
        return device.model_occupancy(plan.threads, plan.smem_bytes)

    return occ


def block_threads_for(packs: int) -> int:
    """The widest block (128..1024 threads) that still gives each thread PACKS_PER_THREAD packs
    of a row of ``packs`` packs: wider blocks leave threads idle and make barriers dearer."""
    threads = 1024
    while threads > 128 and threads * PACKS_PER_THREAD > packs:
        threads //= 2
    return threads


def max_dynamic_smem(device: DeviceSpec) -> int:
    """Dynamic shared memory a block may ask for: the opt-in limit less STATIC_SMEM."""
    return device.smem_per_block_optin - STATIC_SMEM


def num_blocks(device: DeviceSpec, block_threads: int, needed: int) -> int:
    """OneFlow's GetNumBlocks: enough blocks for the work, at most WAVES waves of them."""
    limit = device.sms * device.max_threads_per_sm // block_threads * WAVES
    return max(1, min(needed, limit))


def pack_size(dtype: str, cols: int, align_elems: int, strided: bool) -> int:
    """Elements per vector access: the largest power of two up to 16 bytes that divides cols
    and the alignment (in elements) of every pointer and row stride."""
    if strided:
        return 1
    p = 16 // ITEMSIZE[dtype]
    while p > 1 and (cols % p or align_elems % p):
        p //= 2
    return p


def _two_packs(info: OpInfo, extra: tuple[str, ...], pack_bytes: int) -> bool:
    """Whether warp_shape gives rows of 3..8 packs two packs a lane (OpInfo.two_packs_a_lane):
    full 16-byte packs, and no residual (the overlap switch)."""
    residual = info.overlap_switch >= 0 and extra[info.overlap_switch] == "true"
    return info.two_packs_a_lane and pack_bytes == 16 and not residual


def _may_pair(info: OpInfo, extra: tuple[str, ...], dtype: str) -> bool:
    """Whether a cluster plan may take two rows a pass (Plan.rows_per_pass, _plan_cluster):
    16-bit rows with a parameter switch on (OpInfo.param_switches) and no residual (the overlap
    switch: clusters that overlap their rows take one a pass)."""
    residual = info.overlap_switch >= 0 and extra[info.overlap_switch] == "true"
    return (ITEMSIZE[dtype] == 2 and not residual
            and any(extra[i] == "true" for i in info.param_switches))


def warp_shape(cols: int, pack: int, rows: int, pow2: bool = False,
               two_packs: bool = False) -> tuple[int, int, int, bool]:
    """(thread_group_width, cols_per_thread, rows_per_access, padding) for the warp kernel.
    ``pow2``: cols_per_thread is a power-of-two number of packs (runtime-shape kernels).
    ``two_packs``: rows of 3..8 packs take two packs of one row a lane (OpInfo.two_packs_a_lane)
    where OneFlow's rule gives one pack of each of two rows."""
    if two_packs and 2 * pack < cols <= 8 * pack:
        width = 1
        while width * 2 * pack < cols:
            width *= 2
        return width, 2 * pack, 1, cols != 2 * pack * width
    if cols <= 32 * pack:
        width = 1
        while width * pack < cols:
            width *= 2
        cpt = pack
        rpa = 2 if rows % 2 == 0 else 1
    else:
        width = 32
        cpt = pack
        while 32 * cpt < cols:
            cpt = cpt * 2 if pow2 else cpt + pack
        rpa = 1
    return width, cpt, rpa, cols != cpt * width


def plan_rowwise(op: str, rows: int, cols: int, dtype: str, device: DeviceSpec,
                 occupancy: Occupancy | None = None, *, align_elems: int = 16,
                 strided: bool = False, extra: tuple[str, ...] | None = None) -> Plan:
    """Choose the kernel for a row-wise op over a (rows, cols) view.

    ``align_elems``: the largest power of two (in elements, up to 16) dividing every pointer's
    address and every row stride; ``strided``: rows or columns are not contiguous, so every
    access is a single element. ``occupancy`` defaults to the device model. ``extra``: template
    arguments an op appends to the kernel's (fused-functor switches, for example); None: the
    op's default, ``OpInfo.extras[0]``.
    """
    if op not in OPS:
        raise ValueError(f"plan: unknown op {op!r}; expected one of {sorted(OPS)}")
    if dtype not in ITEMSIZE:
        raise ValueError(f"plan: unsupported dtype {dtype!r}; expected one of {sorted(ITEMSIZE)}")
    if rows < 1 or cols < 1:
        raise ValueError(f"plan: rows and cols must be positive, got rows={rows}, cols={cols}")
    occ = occupancy or model_occupancy(device)
    info = OPS[op]
    extra = info.extras[0] if extra is None else tuple(extra)
    if extra not in info.extras:
        raise ValueError(f"plan: {op} takes extra template arguments from {list(info.extras)}, "
                         f"got {extra}")
    if strided and not info.strided:
        raise ValueError(f"plan: {op} has no strided kernels; rows must have contiguous columns")
    item = ITEMSIZE[dtype]
    pack = pack_size(dtype, cols, align_elems, strided)
    base = dict(op=op, dtype=dtype, rows=rows, cols=cols, pack_size=pack, strided=strided,
                device=device.name, extra=extra)
    # Sums over rows (a backward's dweight, dbias): kept on chip beside a cached row, and a grid
    # of one wave of resident blocks, since every block writes one partial row of them.
    col_sums = info.col_sums if extra[:1] == ("true",) else 0
    smem_per_col = item * info.inputs + col_sums * (8 if dtype == "float64" else 4)

    def grid_for(plan: Plan, needed: int) -> int:
        if col_sums and plan.variant is not Variant.BLOCK_UNCACHED:
            return max(1, min(needed, device.sms * max(1, occ(plan))))
        return num_blocks(device, plan.threads, needed)

    # With column sums the warp kernel also holds them in registers: over 512 columns that is
    # 150-170 registers a thread (3 blocks per SM), 76-81% of copy at 1024 columns on the H100,
    # against 87-93% for the block kernel at 2048.
    if cols <= (WARP_MAX_COLS_WITH_SUMS if col_sums else WARP_MAX_COLS):
        width, cpt, rpa, padding = warp_shape(cols, pack, rows, pow2=info.runtime_shape,
                                              two_packs=_two_packs(info, extra, pack * item))
        block = (width, WARP_BLOCK_THREADS // width)
        resident = device.sms * (device.max_threads_per_sm // WARP_BLOCK_THREADS)
        if rpa == 2 and -(-rows // block[1]) <= SHORT_GRID_WAVES * resident:
            rpa = 1  # a short grid: each thread's chain of loads, shuffles and stores is the time
        groups = -(-rows // rpa)
        plan = Plan(variant=Variant.WARP, cols_per_thread=cpt, thread_group_width=width,
                    rows_per_access=rpa, padding=padding, block=block, grid=1, smem_bytes=0,
                    **base)
        needed = -(-groups // block[1])
        if col_sums:
            return _replace(plan, grid=grid_for(plan, needed))
        # Every group of rows its own block (no cap of waves): 100.2-100.3% of copy against
        # 99.7-99.8% with OneFlow's 32 waves, float32 softmax at 64-256 columns on the H100.
        return _replace(plan, grid=min(needed, MAX_GRID))

    no_warp = dict(cols_per_thread=0, thread_group_width=0, rows_per_access=0, padding=False)
    if col_sums:
        plan = _plan_col_sums(base, no_warp, cols, pack, item, info, col_sums, device, occ,
                              strided)
        if plan is not None:
            return plan
        return _uncached(base, no_warp, col_sums, device, rows)
    # The kernels can overlap a block's rows (OpInfo.overlap_switch, Plan.overlap)
    overlap = info.overlap_switch >= 0 and extra[info.overlap_switch] == "true"
    # A cluster may take two rows a pass (Plan.rows_per_pass)
    paired = rows >= 2 and cols >= PAIRED_MIN_COLS and _may_pair(info, extra, dtype)
    smem = cols * smem_per_col + info.smem_align
    candidate = Plan(variant=Variant.BLOCK_SMEM, block=(128, 1), grid=1, smem_bytes=smem,
                     **no_warp, **base)
    smem_limit = max_dynamic_smem(device)
    occ128 = occ(candidate) if smem <= smem_limit else 0
    if occ128 > 0:
        block = 128
        widest = block_threads_for(cols // pack)
        for threads in BLOCK_SIZES:
            if threads <= widest and occ(_replace(candidate, block=(threads, 1))) == occ128:
                block = threads
                break
        what = f"row cached in shared memory as {dtype}"
        if col_sums:
            what += f", beside {col_sums} column sums"
        plan = _replace(candidate, block=(block, 1), notes=(f"{what} ({smem} bytes per block)",))
        # the block was picked to keep occ128 blocks per SM
        if overlap:
            return _plan_overlap(plan, occ128, widest, device, occ, rows)
        if info.split_lone_blocks and device.has_clusters and not strided and \
                occ128 * plan.threads <= LONE_BLOCK_RESIDENT:
            shared = _plan_cluster(base, no_warp, cols, pack, smem_per_col, device, occ, rows,
                                   shared_only=True, paired=paired)
            if shared is not None:
                return _replace(shared, notes=shared.notes + (
                    f"one block of {plan.threads} threads would be alone on its SM",))
        return _replace(plan, grid=grid_for(plan, rows))

    if device.has_clusters and not strided:
        plan = _plan_cluster(base, no_warp, cols, pack, smem_per_col, device, occ, rows,
                             overlap, paired=paired)
        if plan is not None:
            return plan

    return _uncached(base, no_warp, col_sums, device, rows)


def _plan_overlap(plan: Plan, per_sm: int, widest: int, device: DeviceSpec, occ: Occupancy,
                  rows: int) -> Plan:
    """A block kernel whose blocks may overlap their rows (Plan.overlap): they do where
    ``plan``, OneFlow's blocks that take turns at memory (``per_sm`` of them resident on an
    SM), leaves at most OVERLAP_RESIDENT threads on an SM. Then the block is the widest the row
    allows (``widest``) that runs, whatever that does to blocks per SM, and a block alone on its
    SM loops over rows in one wave. Measured on the H100, norms with a residual (% of copy):
    float32 layer norm at 8192 and 16384 columns 85 -> 95 (OneFlow's 3-6 blocks of 128-256
    threads: 768 an SM), float16 at 65536 and float32 at 32768 87-90 -> 94-95 (one block of
    1024 threads); where OneFlow's blocks fill 1280 threads or more (16-bit rows up to 32768,
    float32 up to 4096, RMS float32 up to 16384) they stay, at 95-98 (overlapping blocks
    measured 1-4 points either side)."""
    if per_sm * plan.threads > OVERLAP_RESIDENT:
        return _replace(plan, grid=num_blocks(device, plan.threads, rows))
    for threads in BLOCK_SIZES + (128,):
        ov = _replace(plan, block=(threads, 1), overlap=True)
        n = occ(ov) if threads <= widest else 0
        if n > 0:
            break
    else:
        return _replace(plan, grid=num_blocks(device, plan.threads, rows))
    if n == 1:
        grid, note = device.sms, "one wave of blocks, each overlapping its rows"
    else:
        grid = num_blocks(device, ov.threads, rows)
        note = f"blocks overlapping their rows, {n} resident per SM"
    return _replace(ov, grid=max(1, min(rows, grid)), notes=ov.notes + (note,))


def _plan_cluster(base: dict, no_warp: dict, cols: int, pack: int, smem_per_col: int,
                  device: DeviceSpec, occ: Occupancy, rows: int,
                  overlap: bool = False, shared_only: bool = False,
                  paired: bool = False, rows_per_pass: int = 1) -> Plan | None:
    """A row too long for one block's shared memory, split over a thread-block cluster.

    Each block of a cluster reads its slice into shared memory, the row's reductions meet in
    distributed shared memory, and the block writes its slice out: its reads and its writes
    take turns, with cluster-wide barriers between them. What keeps memory busy is other
    blocks on the same SM in other phases, so, measured on the H100 (``benchmarks/``):

    1. the smallest cluster and the narrowest block (CLUSTER_SHARED) that keep two or more
       blocks and the op's ``cluster_threads_per_sm`` threads resident on an SM. Softmax
       needs 512 (float16 at 131072 columns: 4 blocks of 64 KiB, 3 of 256 threads per SM,
       92% of copy, against 74% for 2 blocks of 128 KiB, 1 of 512 threads per SM); the norms,
       whose blocks make three passes over their slice between reads and writes, 1536 (layer
       norm, same shape: 89% with 3 blocks of 512 threads per SM, 69% with 3 of 256);
    2. else the smallest cluster that fits, with the widest block that launches (1024
       threads: the most loads in flight; float32 softmax at 262144 columns over 8 blocks of
       128 KiB: 91% against 85% with 512 threads; over 16 blocks of 64 KiB, 3 per SM, by
       rule 1: 95%).

    The grid: one wave of resident clusters (the driver's count when it gives one), each
    looping over rows, where the op's blocks overlap rows (softmax; the norms with a residual,
    ``overlap``: 92% of copy against 76% for float16 layer norm at 131072 columns, 4 blocks
    of 512 threads, 2 per SM) or only one block fits an SM, or for clusters of two rows a
    pass and of the op's ``one_wave_cluster`` blocks or more; else OneFlow's waves of clusters
    (the norms, 1-4 points faster at 3 blocks per SM, but for layer norm float32 at 262144
    columns, 16 blocks of 512 threads: 82.8% in waves, 86.7% in one wave).

    ``shared_only``: rule 1 or nothing (None), for a row that one block could hold alone
    (OpInfo.split_lone_blocks).

    ``paired``: first rule 1 for clusters that cache two rows a pass (Plan.rows_per_pass),
    twice as many blocks with the same slice, each block's slice of gamma and beta read once
    for both rows. Measured on the H100 for layer norm (% of copy, one wave of paired clusters
    against one row a pass in waves, means of three runs): float16 at 131072 columns 89.6 ->
    92.0 (weight and bias), 92.2 -> 92.9 (weight); bfloat16 90.8 -> 91.5 and 89.6 -> 92.7; at
    262144 columns float16 88.0 -> 88.7 and 90.7 -> 90.2, bfloat16 88.4 -> 87.7 and 86.9 ->
    89.7. Not taken where it lost: float32 at 32768-131072 columns (1.4-4.8 points), 16-bit at
    65536 (up to 3.2), RMS norm (0.6-1.9 at 131072-262144 columns), and paired clusters in
    OneFlow's waves (2-6 points below one row a pass). Nor over more than PAIRED_MAX_CLUSTER
    blocks: once clusters of one row a pass fetch their first gamma and beta before the
    all-reduces (session 14), 16-bit layer norm at 262144 columns ran at 89.6-89.7% of copy
    over 8 blocks, one row a pass, in waves, against 89.2-89.3 (float16) and 88.4-88.5
    (bfloat16) for two rows a pass over 16 blocks in one wave; with session 15's cluster
    barrier (relaxed arrives, gamma and beta loaded while it is pending) 90.2-90.3 and 90.8
    over 8 blocks against 89.8-90.4 and 89.2-89.5 over 16. The driver fits 21 clusters of 16
    blocks on the H100, 3 blocks an SM: 20 of its 132 SMs stay idle (Nsight Compute).
    """
    if paired:
        plan = _plan_cluster(base, no_warp, cols, pack, smem_per_col, device, occ, rows,
                             shared_only=True, rows_per_pass=2)
        if plan is not None:
            return plan
    info = OPS[base["op"]]
    fits = []
    # two rows a pass only on the sizes it may take: no occupancy query (on a GPU, a kernel
    # compiled) for a plan that would be discarded
    sizes = [n for n in CLUSTER_SIZES if rows_per_pass == 1 or n <= PAIRED_MAX_CLUSTER]
    for size in sizes:
        slice_packs = -(-(cols // pack) // size)
        smem = rows_per_pass * slice_packs * pack * smem_per_col + info.smem_align
        if smem <= max_dynamic_smem(device):
            fits.append((size, smem))

    def cluster(size: int, smem: int, threads: int) -> tuple[Plan, int]:
        plan = Plan(variant=Variant.CLUSTER, block=(threads, 1), grid=size, smem_bytes=smem,
                    cluster=size, overlap=overlap, rows_per_pass=rows_per_pass, **no_warp,
                    **base)
        return plan, occ(plan)

    shared = (cluster(size, smem, threads) for size, smem in fits for threads in CLUSTER_SHARED)
    choice = next(((p, n) for p, n in shared
                   if n >= 2 and n * p.threads >= info.cluster_threads_per_sm), None)
    if choice is None and shared_only:
        return None
    if choice is None:
        alone = (cluster(size, smem, threads) for size, smem in fits for threads in CLUSTER_BLOCKS)
        choice = next(((p, n) for p, n in alone if n > 0), None)
    if choice is None:
        return None
    plan, per_sm = choice
    size = plan.cluster
    resident = _resident_clusters(plan, per_sm, device, occ)
    one_wave = rows_per_pass > 1 or 0 < info.one_wave_cluster <= size
    if info.rows_overlap or overlap or per_sm == 1 or one_wave:
        clusters, grid_note = resident, f"one wave of {resident} clusters"
    else:
        clusters, grid_note = resident * WAVES, f"up to {WAVES} waves of {resident} clusters"
    notes = (f"row split over a cluster of {size} blocks, {plan.smem_bytes} bytes of shared "
             f"memory each, {per_sm} resident per SM; {grid_note}",)
    if rows_per_pass > 1:
        notes += (f"{rows_per_pass} rows a pass, each block's gamma and beta read once for them",)
    passes = -(-rows // rows_per_pass)
    return _replace(plan, grid=max(1, min(passes, clusters)) * size, notes=notes)


def _resident_clusters(plan: Plan, per_sm: int, device: DeviceSpec, occ: Occupancy) -> int:
    """Clusters of ``plan`` resident at once: SMs x blocks per SM / cluster size, or fewer where
    the driver says so (GPC sizes can leave fewer clusters room)."""
    resident = device.sms * per_sm // plan.cluster
    fit = getattr(occ, "max_clusters", None)
    if fit is not None:
        resident = min(resident, fit(plan) or resident)
    return resident


def _uncached(base: dict, no_warp: dict, col_sums: int, device: DeviceSpec, rows: int) -> Plan:
    notes = ("row too long to keep on chip: read twice from memory",)
    if col_sums:
        notes += ("column sums by a separate pass over x and dy (norm_param_grad_partial)",)
    plan = Plan(variant=Variant.BLOCK_UNCACHED, block=(UNCACHED_BLOCK, 1), grid=1, smem_bytes=0,
                notes=notes, **no_warp, **base)
    return _replace(plan, grid=num_blocks(device, plan.threads, rows))


def reg_sum_packs(dtype: str, pack: int) -> int:
    """Packs per thread whose column sums a backward kernel keeps in registers (RegSums in
    kernels/layer_norm.cuh): 16 values of each sum (8 in double)."""
    return max(1, (8 if dtype == "float64" else 16) // pack)


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _plan_col_sums(base: dict, no_warp: dict, cols: int, pack: int, item: int, info: OpInfo,
                   col_sums: int, device: DeviceSpec, occ: Occupancy,
                   strided: bool) -> Plan | None:
    """A cached backward that also sums over rows (dweight, dbias): a grid of one wave of
    resident blocks (or clusters), each looping over rows and writing one partial row of sums
    at the end. The first of ``_col_sums_ways``; None where no way fits."""
    ways = _col_sums_ways(base, no_warp, cols, pack, item, info, col_sums, device, occ, strided,
                          first_only=True)
    return _with_grid(*ways[0], col_sums, device, occ) if ways else None


def _cluster_fallback(base: dict, no_warp: dict, cols: int, pack: int, item: int,
                      info: OpInfo, col_sums: int, device: DeviceSpec,
                      occ: Occupancy) -> tuple[Plan, int, bool] | None:
    """Session 8's cluster for a row that no block holds and no cluster holds with two
    buffers, gamma and shared-memory sums (float64 rows, rows of odd 16-bit widths): the
    smallest cluster that fits, and for its share of the row (``values`` columns) four ways,
    tried in this order:

    1. sums in shared memory beside x and dy, x and dy double-buffered (needs packs of at
       least 4 bytes, for asynchronous copies);
    2. the same, single-buffered;
    3. sums in registers (slices of at most ``reg_sum_packs * 1024`` packs; the block is made
       wide enough), double-buffered;
    4. the same, single-buffered.

    The first that keeps two blocks resident per SM (they overlap each other's reductions),
    else the first double-buffered one that fits, else the first that fits; then, with two
    buffers and float compute, gamma in shared memory where that fits and keeps as many
    blocks per SM. Returns (plan, blocks per SM, two buffers), or None where no cluster fits.
    """
    csize = 8 if base["dtype"] == "float64" else 4
    apt = reg_sum_packs(base["dtype"], pack)
    limit = max_dynamic_smem(device)
    asynchronous = pack * item >= 4
    for size in CLUSTER_SIZES:
        slice_packs = -(-(cols // pack) // size)
        values = slice_packs * pack
        rows_smem = item * info.inputs * values
        found = []
        for in_regs, two in itertools.product((False, True), (True, False)):
            if (two and not asynchronous) or (in_regs and slice_packs > apt * 1024):
                continue
            threads = min(CLUSTER_MAX_BLOCK, block_threads_for(slice_packs))
            if in_regs:
                threads = max(threads, min(1024, _pow2_at_least(-(-slice_packs // apt))))
            smem = rows_smem * (2 if two else 1) + (0 if in_regs else col_sums * csize * values) \
                + info.smem_align
            if smem > limit:
                continue
            plan = Plan(variant=Variant.CLUSTER, block=(threads, 1), grid=size, smem_bytes=smem,
                        cluster=size, sums_in_registers=in_regs, **no_warp, **base)
            per_sm = occ(plan)
            if per_sm > 0:
                found.append((plan, per_sm, two))
        if not found:
            continue
        pick = next((f for f in found if f[1] >= 2), None) or \
            next((f for f in found if f[2]), None) or found[0]
        plan, per_sm, two = pick
        if two and csize == 4:  # gamma beside them, where that costs no resident block
            cached = _replace(plan, smem_bytes=plan.smem_bytes + csize * values,
                              gamma_in_smem=True)
            if cached.smem_bytes <= limit and occ(cached) >= per_sm:
                plan = cached
        return plan, per_sm, two
    return None


def col_sums_ways(plan: Plan, device: DeviceSpec, occupancy: Occupancy | None = None
                  ) -> list[Plan]:
    """Every way the cached kernels of a backward with column sums could run a row of
    ``plan``'s shape (op, dtype, rows, cols, pack, extra), one block a row or a cluster of
    blocks, best first by the planner's order (``_col_sums_ways``); empty where none fits or
    the op sums no columns. ``benchmarks/bench_norm_backward_ways.py`` times them all."""
    info = OPS[plan.op]
    col_sums = info.col_sums if plan.extra[:1] == ("true",) else 0
    if not col_sums:
        return []
    base = dict(op=plan.op, dtype=plan.dtype, rows=plan.rows, cols=plan.cols,
                pack_size=plan.pack_size, strided=plan.strided, device=device.name,
                extra=plan.extra)
    no_warp = dict(cols_per_thread=0, thread_group_width=0, rows_per_access=0, padding=False)
    occ = occupancy or model_occupancy(device)
    ways = _col_sums_ways(base, no_warp, plan.cols, plan.pack_size, ITEMSIZE[plan.dtype], info,
                          col_sums, device, occ, plan.strided)
    return [_with_grid(*way, col_sums, device, occ) for way in ways]


def _col_sums_ways(base: dict, no_warp: dict, cols: int, pack: int, item: int, info: OpInfo,
                   col_sums: int, device: DeviceSpec, occ: Occupancy,
                   strided: bool, first_only: bool = False) -> list[tuple[Plan, int, bool]]:
    """The cached kernels' ways for a backward with column sums, best first, as (plan without
    its grid, blocks per SM, two buffers): ``_with_grid`` completes the one a caller takes.
    ``first_only``: the planner's call, which stops at the narrow way below where there is one
    (no occupancy queries, and so no compiles, for the ways it would not take).

    A way is a cluster size (1: the block kernel; clusters from the smallest size any way
    fits, up to two doublings past it, while each block keeps at least 128 packs of the
    row), a block width (128..1024 threads, each with at least one pack of its slice), where
    the sums live (shared memory beside x and dy, or registers: at most ``reg_sum_packs``
    packs a thread), one or two buffers for x and dy (two need packs of at least 4 bytes,
    for asynchronous copies) and, with float compute (every dtype but float64), gamma
    converted once into floats in shared memory or loaded and converted twice an element
    from memory. Of the ways that fit (the occupancy query keeps a block per SM):

    1. the block kernel's best way by ``_block_key`` (session 9's order), where it keeps two
       or more blocks per SM, or holds x and dy twice with gamma and shared-memory sums
       ("S2g"), or, for 4-byte values, once with gamma and shared-memory sums;
    2. else the S2g clusters of the smallest size that has one and of twice that size, by
       ``_cluster_key``: a lone block that must reduce with memory idle hands its row to
       blocks that hold a slice each with everything on chip;
    3. else the block kernel's best way, or with no block way, ``_cluster_fallback``.

    Before all of them, for layer norm over 16-bit rows wider than 2048 columns: the way of
    ``_narrow_s2g`` (16-byte packs) or ``_pair_r2g`` (8-byte packs) where there is one (it
    may lie past the sizes above).

    The rest follow (block ways, then clusters, each in their order) for
    ``benchmarks/bench_norm_backward_ways.py``, which times them all. Chosen on its
    measurements on the H100 (% of copy, every byte counted, rows = 2^27 / cols, weight
    given; layer and RMS norm, float16 and float32) at 58 widths of 1024-32768 columns, then
    measured with the rule in place: the planned way 3.2 points behind the fastest forced way
    on average (4.4 by session 9's block rule and session 8's clusters), at least 83.9% of
    copy where those fell to 79.3 (layer norm float16 at 12288-32768 columns: 79-90 ->
    85-91); at 14 other widths 1.6 (2.7), and at 26 more (5500-131072 columns) 3.1 (about 7).
    """
    csize = 8 if base["dtype"] == "float64" else 4
    packs = cols // pack
    apt = reg_sum_packs(base["dtype"], pack)
    limit = max_dynamic_smem(device)
    narrow = None
    if col_sums == 2 and item == 2 and cols > 2048 and device.has_clusters and not strided:
        if pack * item == 16:
            narrow = _narrow_s2g(base, no_warp, packs, pack, info, device, occ)
        elif pack * item == 8:
            narrow = _pair_r2g(base, no_warp, packs, pack, info, device, occ, limit)
        if narrow is not None and first_only:
            return [narrow[:3]]
    sizes = (1,) + (CLUSTER_SIZES if device.has_clusters and not strided else ())
    blocks, clusters, first = [], [], None
    for size in sizes:
        slice_packs = -(-packs // size)
        if (first is not None and size > 4 * first) or (size > 1 and slice_packs < 128):
            break
        values = slice_packs * pack
        rows_smem = item * info.inputs * values
        for threads, in_regs, two, gamma in itertools.product(
                (128,) + BLOCK_SIZES, (False, True), (True, False), (False, True)):
            if threads > max(128, slice_packs) or \
                    (in_regs and -(-slice_packs // threads) > apt) or \
                    (two and pack * item < 4) or (gamma and csize != 4):
                continue
            smem = rows_smem * (2 if two else 1) + \
                (0 if in_regs else col_sums * csize * values) + \
                (csize * values if gamma else 0) + info.smem_align
            if smem > limit:
                continue
            variant = Variant.BLOCK_SMEM if size == 1 else Variant.CLUSTER
            plan = Plan(variant=variant, block=(threads, 1), grid=size, smem_bytes=smem,
                        cluster=size, sums_in_registers=in_regs, gamma_in_smem=gamma,
                        **no_warp, **base)
            per_sm = occ(plan)
            if per_sm <= 0:
                continue
            (blocks if size == 1 else clusters).append((plan, per_sm, two, slice_packs))
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
                     key=lambda w: _cluster_key(w[0], w[1], col_sums), reverse=True)
    taken = {id(w) for w in s2g}
    rest = sorted((w for w in clusters if id(w) not in taken),
                  key=lambda w: (-w[0].cluster, _block_key(*w[1:], w[0])), reverse=True)
    if blocks and (not s2g or _keeps_block(blocks[0], item)):
        order = blocks + s2g + rest
    elif s2g:
        order = s2g + blocks + rest
    else:
        order = rest
        fallback = None
        if device.has_clusters and not strided:
            fallback = _cluster_fallback(base, no_warp, cols, pack, item, info, col_sums,
                                         device, occ)
        if fallback is not None:
            order = [fallback] + [w for w in rest if w[0] != fallback[0]]
    if narrow is not None:
        order = [narrow] + order
    return [w[:3] for w in order]


def _narrow_s2g(base: dict, no_warp: dict, packs: int, pack: int, info: OpInfo,
                device: DeviceSpec, occ: Occupancy) -> tuple | None:
    """Layer norm's way for rows of 16-bit values wider than 2048 columns in 16-byte packs:
    of one block a row, then clusters of 2, 4, 8 and 16, the first whose share of
    the row (at least 128 packs a block in a cluster), held by 128 threads with x and dy
    twice, gamma and the column sums in shared memory ("S2g"), keeps three or more blocks
    resident per SM; None where none does (``_col_sums_ways``'s rule then). As a tuple
    (plan without its grid, blocks per SM, two buffers, slice packs).

    Narrow blocks that share an SM with others take turns at memory while each waits on its
    reductions (two row sums and two column sums an element for layer norm). Measured on the
    H100 (% of copy, every byte counted, rows = 2^27 / cols, float16, weight given, every way
    with gamma's copy forced at the 26 widths of 1024-65536 columns that session 10's rule was
    chosen and checked on; it applies at 23): 1.3 points behind the fastest forced way on
    average where session 10's rule was 2.8; layer norm float16 at 8192 columns 95.0 against
    87.4 (one block of 1024 threads), 16384 92.9 against 87.8 (clusters of 4 blocks of 256
    threads, 2 per SM), 32768 85.2 against 84.8; 0.8 lower at 10000 (91.7 against 92.5). At
    2048 columns and fewer the block's rule is faster (layer norm float16 2048: 93.5 against
    89.7 for 128 threads, 5 per SM).
    """
    item = ITEMSIZE[base["dtype"]]
    for size in (1,) + CLUSTER_SIZES:
        slice_packs = -(-packs // size)
        if size > 1 and slice_packs < 128:
            return None
        values = slice_packs * pack
        smem = 2 * item * info.inputs * values + (info.col_sums + 1) * 4 * values + \
            info.smem_align
        if smem * 3 > device.smem_per_sm:
            continue
        variant = Variant.BLOCK_SMEM if size == 1 else Variant.CLUSTER
        plan = Plan(variant=variant, block=(128, 1), grid=size, smem_bytes=smem, cluster=size,
                    sums_in_registers=False, gamma_in_smem=True, **no_warp, **base)
        per_sm = occ(plan)
        if per_sm >= 3:
            return plan, per_sm, True, slice_packs
    return None


def _pair_r2g(base: dict, no_warp: dict, packs: int, pack: int, info: OpInfo,
              device: DeviceSpec, occ: Occupancy, limit: int) -> tuple | None:
    """Layer norm's way for rows of 16-bit values wider than 2048 columns in 8-byte packs
    (widths of 4 mod 8 columns): the smallest cluster whose slice the narrowest block holds
    with the column sums in registers (``reg_sum_packs`` packs a thread, at most 1024
    threads), x and dy twice and gamma in shared memory ("R2g"); None where none fits. As
    ``_narrow_s2g``'s tuple.

    Measured on the H100 (% of copy, rows = 2^27 / cols, weight given, every way with
    gamma's copy forced; why shared-memory sums lose with these packs is not established):
    clusters of 2 blocks of 256-512 threads, R2g, were the fastest way at every such width
    tried: float16 5500 columns 91.6 against 81.2 (session 10's rule: one block of 512
    threads, 2 per SM, sums in shared memory), 6500 91.3 against 71.6, 10500 87.4 against
    74.1, 14500 89.0 against 71.2; bfloat16 5500 91.8 against 80.9, 10500 87.6 against 74.3.
    """
    item = ITEMSIZE[base["dtype"]]
    apt = reg_sum_packs(base["dtype"], pack)
    for size in CLUSTER_SIZES:
        slice_packs = -(-packs // size)
        threads = max(128, _pow2_at_least(-(-slice_packs // apt)))
        if threads > 1024:
            continue
        if slice_packs < 128:
            return None
        values = slice_packs * pack
        smem = 2 * item * info.inputs * values + 4 * values + info.smem_align
        if smem > limit:
            continue
        plan = Plan(variant=Variant.CLUSTER, block=(threads, 1), grid=size, smem_bytes=smem,
                    cluster=size, sums_in_registers=True, gamma_in_smem=True, **no_warp, **base)
        per_sm = occ(plan)
        if per_sm > 0:
            return plan, per_sm, True, slice_packs
    return None


def _with_grid(plan: Plan, per_sm: int, two: bool, col_sums: int, device: DeviceSpec,
               occ: Occupancy) -> Plan:
    """``plan`` with its grid (one wave of resident blocks or clusters) and its note."""
    if plan.cluster == 1:
        grid, what = max(1, min(plan.rows, device.sms * per_sm)), "row"
    else:
        groups = _resident_clusters(plan, per_sm, device, occ)
        grid = max(1, min(plan.rows, groups)) * plan.cluster
        what = f"row split over a cluster of {plan.cluster} blocks"
    notes = (f"{what}: x and dy {'double' if two else 'single'}-buffered in shared memory, "
             f"{col_sums} column sums in "
             f"{'registers' if plan.sums_in_registers else 'shared memory'}"
             f"{', gamma in shared memory' if plan.gamma_in_smem else ''} "
             f"({plan.smem_bytes} bytes per block, {per_sm} resident per SM)",)
    return _replace(plan, grid=grid, notes=notes)


def _block_key(per_sm: int, two: bool, packs: int, plan: Plan) -> tuple:
    """Session 9's order of the block kernel's ways (larger first); ``packs``: the row's.

    1. gamma in shared memory;
    2. resident threads per SM (blocks per SM times threads) nearest 1024;
    3. sums in shared memory (in registers where the row has at most 128 packs, one pack a
       thread of the narrowest block: layer norm 16-bit at 1024 columns 89.6-90.2% of copy
       against 86.5-86.9, RMS norm within a point, H100, session 6);
    4. the larger share of busy threads in the last pass over the row (packs / (threads *
       passes));
    5. the wider block;
    6. two buffers.

    Chosen on the H100 over every block way at 50 widths (session 9): 2.3 points of copy
    behind the fastest on average, 3.8 for the rule it replaced. Gamma's copy is the largest
    term: loaded from memory it costs 5-20 points where a block is alone on its SM.
    """
    passes = -(-packs // plan.threads)
    in_regs = plan.sums_in_registers
    return (plan.gamma_in_smem, -abs(math.log2(per_sm * plan.threads) - 10),
            in_regs if packs <= 128 else not in_regs, packs / (plan.threads * passes),
            plan.threads, two)


def _keeps_block(way: tuple, item: int) -> bool:
    """Whether the block kernel's best way stays before the S2g clusters (``_col_sums_ways``):
    two or more blocks per SM overlap each other's reductions; one block alone does where it
    holds x and dy twice with gamma and shared-memory sums, or (4-byte values, whose rows
    take twice as long to load) once. Else, measured on the H100: layer norm float16 at
    16384 columns, one 1024-thread block with register sums 80.8% of copy, clusters of 4
    blocks of 256 threads, 2 per SM, 87.3; RMS float16 at 20000 91.1 -> 97.5 (clusters of 2,
    512 threads); float32 at 16384: layer norm 91.5 -> 97.6, RMS 94.2 -> 95.6."""
    plan, per_sm, two, _ = way
    on_chip = plan.gamma_in_smem and not plan.sums_in_registers
    return per_sm >= 2 or (on_chip and (two or item == 4))


def _cluster_key(plan: Plan, per_sm: int, col_sums: int) -> tuple:
    """The order of the S2g clusters (larger first). Layer norm (two column sums and two row
    sums a row: a longer wait between loads): two or more blocks per SM, then resident
    threads nearest 512, the smaller cluster, the wider block. RMS norm: the smaller
    cluster, then blocks nearest 512 threads, then more of them per SM. Measured on the H100
    (% of copy): layer norm float16 at 12288 columns, clusters of 4 blocks of 128 threads, 3
    per SM, 89.0, of 2 blocks of 512, 1 per SM, 81.1; RMS norm float16 at 16384, clusters of
    2 blocks of 512 threads 96.7, of 4 blocks of 128, 3 per SM, 89.4."""
    if col_sums == 2:
        return (per_sm >= 2, -abs(math.log2(per_sm * plan.threads) - 9), -plan.cluster,
                plan.threads)
    return (-plan.cluster, -abs(math.log2(plan.threads) - 9), per_sm)


def param_reduce_shape(cols: int, prows: int, nacc: int, dtype: str,
                       device: DeviceSpec) -> tuple[bool, tuple[int, int], tuple[int, int]]:
    """(vec, block, grid) of norm_param_grad_reduce, which adds ``prows`` partial rows of
    ``nacc`` column sums (in the compute type of ``dtype``) into dweight (and dbias).

    Each of a block's 32 column lanes takes 16 bytes of adjacent sums (``vec``) where the
    columns divide into them and the grid still has a block for every other SM, else one
    column; its row lanes (blockDim.y, a power of two up to 32) take about four partial rows
    each with 16-byte lanes and eight with single columns. Measured on the H100 (us, every
    shape forced): layer norm float16 at 32768 columns (35 partial rows) 4.2 where 32 row
    lanes of single columns took 10.9, 16384 (77 rows) 4.4 against 7.6, 1024 (1056 rows) 8.3
    for single columns against 9.1 with 16 bytes (a grid of 16 blocks); this rule's pick was
    within 0.5 of the fastest at each of 10 shapes of 1024-32768 columns."""
    width = 16 // (8 if dtype == "float64" else 4)
    vec = cols % width == 0 and -(-cols // (32 * width)) * nacc * 2 >= device.sms
    per_lane = 4 if vec else 8  # rows
    lanes = 1
    while lanes < 32 and 2 * (lanes * per_lane) ** 2 < prows * prows:  # nearest power of two
        lanes *= 2
    return vec, (32, lanes), (-(-cols // (32 * (width if vec else 1))), nacc)


def _replace(plan: Plan, **changes) -> Plan:
    from dataclasses import replace

    return replace(plan, **changes)


def reachable_plans(op: str, dtype: str, device: DeviceSpec) -> set[str]:
    """Every kernel instantiation ``plan_rowwise`` can produce for ``op`` and ``dtype`` on a
    device of this architecture, whatever the shape, alignment or occupancy. Used by the
    compile check and ``cukern precompile``."""
    info = OPS[op]
    packs = sorted({pack_size(dtype, c, a, False) for c in (1, 2, 4, 8, 16) for a in (16,)})
    names: set[str] = {k.format(t=CPP_TYPES[dtype], algo=info.algo, pack=p)
                       for k in info.aux_kernels for p in packs}
    layouts = [(p, False) for p in packs] + ([(1, True)] if info.strided else [])
    for (pack, strided), extra in itertools.product(layouts, info.extras):
        base = dict(op=op, dtype=dtype, rows=1, cols=1, pack_size=pack, strided=strided,
                    device=device.name, grid=1, extra=extra)
        # Warp kernel: every cols up to the limit that this pack size divides, both parities.
        for cols in range(pack, WARP_MAX_COLS + 1, pack):
            for rows in (1, 2):
                width, cpt, rpa, padding = warp_shape(
                    cols, pack, rows, pow2=info.runtime_shape,
                    two_packs=_two_packs(info, extra, pack * ITEMSIZE[dtype]))
                names.add(Plan(variant=Variant.WARP, cols_per_thread=cpt,
                               thread_group_width=width, rows_per_access=rpa, padding=padding,
                               block=(width, WARP_BLOCK_THREADS // width), smem_bytes=0,
                               **base).name_expression())
        no_warp = dict(cols_per_thread=0, thread_group_width=0, rows_per_access=0, padding=False)
        weighted = bool(info.col_sums) and extra[:1] == ("true",)  # a backward with weight
        regs = (False, True) if weighted else (False,)
        gammas = (False, True) if weighted and dtype != "float64" else (False,)
        overlaps = (False, True) if info.overlap_switch >= 0 and \
            extra[info.overlap_switch] == "true" else (False,)
        for threads, r, o, g in itertools.product((128,) + BLOCK_SIZES, regs, overlaps, gammas):
            names.add(Plan(variant=Variant.BLOCK_SMEM, block=(threads, 1), smem_bytes=0,
                           sums_in_registers=r, overlap=o, gamma_in_smem=g, **no_warp,
                           **base).name_expression())
        names.add(Plan(variant=Variant.BLOCK_UNCACHED, block=(UNCACHED_BLOCK, 1), smem_bytes=0,
                       **no_warp, **base).name_expression())
        if device.has_clusters and not strided:
            if len(regs) > 1:  # _col_sums_ways (the block width is a launch parameter here)
                shapes = [(t, r) for t in (128, 256, CLUSTER_MAX_BLOCK) for r in regs]
                shapes.append((1024, True))
            else:  # _plan_cluster
                shapes = [(t, False) for t in {*CLUSTER_SHARED, *CLUSTER_BLOCKS}]
            for size, (threads, r), g in itertools.product(CLUSTER_SIZES, shapes, gammas):
                names.add(Plan(variant=Variant.CLUSTER, block=(threads, 1), smem_bytes=0,
                               cluster=size, sums_in_registers=r, overlap=overlaps[-1],
                               gamma_in_smem=g, **no_warp, **base).name_expression())
            if _may_pair(info, extra, dtype):  # _plan_cluster's rule 1, two rows a pass
                paired_sizes = [n for n in CLUSTER_SIZES if n <= PAIRED_MAX_CLUSTER]
                for size, threads in itertools.product(paired_sizes, CLUSTER_SHARED):
                    names.add(Plan(variant=Variant.CLUSTER, block=(threads, 1), smem_bytes=0,
                                   cluster=size, rows_per_pass=2, **no_warp,
                                   **base).name_expression())
    return names

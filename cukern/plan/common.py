"""What every planner shares: the plan record, the switches an op's call sets, the occupancy
question, and the small device arithmetic (waves, packs, warp shapes, resident clusters).

Nothing here touches a GPU. Occupancy is a function passed in: the CUDA driver's answer for a
compiled kernel on a live device (``cukern.runner.driver_occupancy``), or
:meth:`DeviceSpec.model_occupancy` for a preset.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from .._device import DeviceSpec
from .policy import OpPolicy, Tuning, tuning_for

__all__ = ["Variant", "Switches", "Plan", "Occupancy", "ITEMSIZE", "CPP_TYPES", "replace",
           "model_occupancy", "block_threads_for", "max_dynamic_smem", "num_blocks",
           "pack_size", "warp_shape", "resident_clusters"]

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
CPP_TYPES = {"float16": "cukern::f16", "bfloat16": "cukern::bf16", "float32": "float",
             "float64": "double"}


class Variant(str, enum.Enum):
    WARP = "warp"
    BLOCK_SMEM = "block_smem"
    CLUSTER = "cluster"
    BLOCK_UNCACHED = "block_uncached"


@dataclass(frozen=True)
class Switches:
    """The optional operands a call passes, each a fused functor of the kernel (norms: gamma,
    beta, the residual added before normalising)."""

    weight: bool = False
    bias: bool = False
    residual: bool = False
    # weight and bias in float32 with 16-bit data (OpPolicy.float32_params): kernels of their own
    float32_params: bool = False

    def __str__(self) -> str:
        on = [f.name for f in dataclasses.fields(self) if getattr(self, f.name)]
        return ", ".join(on) or "none"


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
    switches: Switches = Switches()
    # A cached backward with column sums keeps them in registers (else in shared memory)
    sums_in_registers: bool = False
    # A cached backward with weight converts gamma once into shared memory
    gamma_in_smem: bool = False
    # A cached forward with a residual loads its next row while it writes this one
    overlap: bool = False
    # A forward norm cluster caches this many rows a pass, gamma and beta read once for them
    rows_per_pass: int = 1
    # Rows off the 16-byte grid read and written in 16-byte packs of memory, each row's first
    # and last pack masked (OpPolicy.shifted_rows; kernels/memory.cuh, RowWindow)
    shifted: bool = False
    policy: OpPolicy | None = field(default=None, repr=False, compare=False)
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1]

    @property
    def family(self) -> str:
        """The kernel source (``kernels/<family>.cuh``) of this plan's kernel."""
        return self.policy.source

    def name_expression(self) -> str:
        """The C++ name of the kernel instantiation this plan launches (its family's
        signature, beside its kernels)."""
        return self.policy.signature(self)

    @property
    def launch_cluster(self) -> int:
        """The cluster size the launch sets (its kernel reads it at run time), or 1 where the
        kernel has its size compiled in or runs no clusters."""
        if self.variant is Variant.CLUSTER and self.policy is not None and \
                self.pack_size * ITEMSIZE[self.dtype] < self.policy.cluster_at_launch_below:
            return self.cluster
        return 1

    def __str__(self) -> str:
        lines = [
            f"{self.op} {self.dtype} rows={self.rows} cols={self.cols} on {self.device}",
            f"  variant            {self.variant.value}",
            f"  kernel             {self.name_expression()}",
            f"  pack_size          {self.pack_size} ({self.pack_size * ITEMSIZE[self.dtype]} "
            f"bytes per access)",
        ]
        if self.shifted:
            lines.append("  shifted            packs on memory's 16-byte grid, each row's end "
                         "packs masked")
        if self.variant is Variant.WARP:
            lines += [
                f"  thread_group_width {self.thread_group_width}",
                f"  cols_per_thread    {self.cols_per_thread}",
                f"  rows_per_access    {self.rows_per_access}",
                f"  padding            {self.padding}",
            ]
        if self.variant is Variant.CLUSTER:
            at = " (set at launch)" if self.launch_cluster > 1 else ""
            lines.append(f"  cluster            {self.cluster} blocks per row{at}")
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
# once (the driver's answer; SMs x blocks per SM / cluster size when absent).
Occupancy = Callable[[Plan], int]


def replace(plan, **changes):
    """``dataclasses.replace`` for the planner's frozen dataclasses (Plan, Switches: no
    ``__post_init__``, no init-only fields), without its per-call field introspection, which
    was most of a plan's cost."""
    new = object.__new__(type(plan))
    fields = new.__dict__
    fields.update(plan.__dict__)
    if not changes.keys() <= fields.keys():
        name = next(n for n in changes if n not in fields)
        raise TypeError(f"replace: {type(plan).__name__} has no field {name!r}")
    fields.update(changes)
    return new


REGISTERS_PER_SM = 65536  # every supported architecture (sm_70 and newer)


def model_occupancy(device: DeviceSpec) -> Occupancy:
    """Occupancy from the device model (threads and shared memory), and for a block kernel with
    its width compiled in (``OpPolicy.fixed_widths``) the register budget that width allows a
    thread (``__launch_bounds__(width)``: one block of 1024 threads an SM)."""

    def occ(plan: Plan) -> int:
        n = device.model_occupancy(plan.threads, plan.smem_bytes)
        pol = plan.policy
        if plan.variant is Variant.BLOCK_SMEM and pol is not None and \
                plan.threads in pol.fixed_widths:
            per_thread = min(255, REGISTERS_PER_SM // plan.threads)
            n = min(n, REGISTERS_PER_SM // (per_thread * plan.threads))
        return n

    return occ


def block_threads_for(packs: int, tuning: Tuning | None = None) -> int:
    """The widest block (128..1024 threads) that still gives each thread ``packs_per_thread``
    packs of a row of ``packs`` packs: wider blocks leave threads idle and make barriers
    dearer."""
    per = (tuning or tuning_for(None)).packs_per_thread
    threads = 1024
    while threads > 128 and threads * per > packs:
        threads //= 2
    return threads


def max_dynamic_smem(device: DeviceSpec) -> int:
    """Dynamic shared memory a block may ask for: the opt-in limit less the static reserve."""
    return device.smem_per_block_optin - tuning_for(device).static_smem


def num_blocks(device: DeviceSpec, block_threads: int, needed: int) -> int:
    """OneFlow's GetNumBlocks: enough blocks for the work, at most ``waves`` waves of them."""
    limit = device.sms * device.max_threads_per_sm // block_threads * tuning_for(device).waves
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


def warp_shape(cols: int, pack: int, rows: int, two_packs: int = 0,
               four_packs: bool = False) -> tuple[int, int, int, bool]:
    """(thread_group_width, cols_per_thread, rows_per_access, padding) for the warp kernel.
    Small rows: the narrowest group that holds them, a pack a lane, two rows a group for an
    even row count (OneFlow). Longer rows: 32 lanes and a power-of-two number of packs a lane
    (the kernels guard every pack, so one instantiation serves every width up to it).
    ``two_packs``: rows of 3 up to that many packs take two packs of one row a lane instead
    (0: none); ``four_packs``: of them, rows of more than 8 packs take four."""
    if two_packs and 2 * pack < cols <= two_packs * pack:
        k = 4 if four_packs and cols > 8 * pack else 2
        width = 1
        while width * k * pack < cols:
            width *= 2
        return width, k * pack, 1, cols != k * pack * width
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
            cpt *= 2
        rpa = 1
    return width, cpt, rpa, cols != cpt * width


def resident_clusters(plan: Plan, per_sm: int, device: DeviceSpec, occ: Occupancy) -> int:
    """Clusters of ``plan`` resident at once: SMs x blocks per SM / cluster size, or fewer where
    the driver says so (GPC sizes can leave fewer clusters room)."""
    resident = device.sms * per_sm // plan.cluster
    fit = getattr(occ, "max_clusters", None)
    if fit is not None:
        resident = min(resident, fit(plan) or resident)
    return resident

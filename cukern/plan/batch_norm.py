"""Planning the batch-norm family (``kernels/batch_norm.cuh``): pure functions from a tensor's
shape and strides, dtype and device to a printable :class:`BatchNormPlan` of launches.

A tensor is seen as (A, C, B) = (outer, channels, inner) in memory order (:func:`channel_view`,
in :mod:`cukern.plan.batch_norm_view`, with the packs and unrolls that follow from it):
dense tensors in any axis order qualify; the element at flat memory index e is in channel
(e // B) % C. B > 1 is the planes layout (NCHW: each channel a run of B elements per outer
index), B == 1 the columns layout (NHWC, (N, C): channels adjacent).

Passes (each a kernel; the shapes are read at run time, only dtype, pack width, layout and
the addend are template arguments):

- training forward: statistics partials per (channel, split) -> a fixed-order merge per channel
  (mean, invstd, running statistics, coefficients) -> the apply pass (y, add, ReLU, mask); or,
  planes whose channel fits a block's shared memory (``bn_one_read_max_bytes``), one launch
  reading x once (``train_planes``: a block a channel); over columns, tiles of channels whose
  rows fit a block's (or a cluster's) shared memory likewise (``train_cols``);
- eval forward: the coefficients from the running statistics -> the apply pass;
- backward: gradient-sum partials (sum g, sum g (x - mean)) -> merge (dweight, dbias, dx
  coefficients) -> the dx pass (and daddend);
- ``batch_stats``: the statistics partials and their merge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .._device import DeviceSpec
from .batch_norm_one_read import one_read_cols_step, one_read_planes_step
from .batch_norm_step import _COMPUTE, MAX_REDUCE_THREADS, Step
from .batch_norm_view import (
    COLUMNS,
    INT32_MAX,
    PLANES,
    ChannelView,
    channel_view,
    elementwise_unroll,
    fast_div,
    flat_pack_for,
    layout_strides,
    max_pack,
    pack_for,
    plane_packs,
    spans,
    unroll_cols,
    unroll_for,
    unroll_reduce,
)
from .common import ITEMSIZE
from .policy import AMPERE, HOPPER, Tuning, tuning_for

__all__ = ["ChannelView", "Step", "BatchNormPlan", "channel_view", "layout_strides",
           "fast_div", "pack_for", "flat_pack_for", "spans", "plane_packs", "flat_args",
           "partial_cap", "unroll_for", "unroll_cols", "elementwise_unroll", "unroll_reduce",
           "plan_batch_norm", "reachable_steps", "OPS", "INT32_MAX"]

OPS = ("batch_norm", "batch_norm_backward", "batch_stats")
@dataclass(frozen=True)
class BatchNormPlan:
    """The launches of one batch-norm call, fully decided. Printable, comparable."""

    op: str
    dtype: str
    view: ChannelView
    pack: int
    steps: tuple[Step, ...]
    training: bool = True
    relu: bool = False
    addend: bool = False
    mask: bool = False
    splits: int = 0  # partial states a channel (0: no reduction pass)
    copied: bool = False  # the input was not dense and is copied first
    device: str = ""
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def layout(self) -> str:
        return self.view.layout

    @property
    def family(self) -> str:
        return "batch_norm"

    @property
    def one_read(self) -> bool:
        """Training forward in one launch reading x once (batch_norm_train_planes or, over
        columns, batch_norm_train_cols)."""
        return bool(self.steps) and self.steps[0].kind in ("train_planes", "train_cols")

    def kernel_names(self) -> tuple[str, ...]:
        return tuple(s.kernel for s in self.steps)

    def step(self, kind_prefix: str) -> Step | None:
        for s in self.steps:
            if s.kind.startswith(kind_prefix):
                return s
        return None

    def __str__(self) -> str:
        a, c, b = self.view
        item = ITEMSIZE[self.dtype]
        mode = "training" if self.training else "eval"
        kind = ("NCHW-like: runs of B per channel" if self.layout == PLANES
                else "NHWC-like: channels adjacent")
        lines = [f"{self.op} {self.dtype} ({mode}) A={a} C={c} B={b} on {self.device}",
                 f"  layout             {self.layout} ({kind})"]
        if self.copied:
            lines.append("  copy               the input is not dense: copied to C order first")
        lines.append(f"  pack_size          {self.pack} ({self.pack * item} bytes per access)")
        if self.layout == PLANES and b % self.pack:
            lines.append(f"  spanning packs     B = {b} is not a multiple of {self.pack}: a pack "
                         f"may span two planes (reductions skip the other's elements)")
        fused = [n for n, on in (("addend", self.addend), ("relu", self.relu),
                                 ("mask", self.mask)) if on]
        if fused:
            lines.append(f"  fused              {', '.join(fused)}")
        if self.one_read and self.layout == COLUMNS:
            k = self.steps[0].cluster
            lines.append("  passes             one read: a block holds a tile of channels over "
                         "its rows in shared memory" + (f", a cluster of {k} blocks the whole "
                                                        "tile" if k > 1 else "")
                         + "; statistics, finish and y in one launch")
        elif self.one_read:
            lines.append("  passes             one read: a block a channel holds x in shared "
                         "memory; statistics, finish and y in one launch")
        elif self.op == "batch_norm" and self.training or self.op == "batch_norm_backward":
            reads = "x and dy" if self.op == "batch_norm_backward" else "x"
            lines.append(f"  passes             two-pass: a reduction pass reads {reads}, the "
                         f"elementwise pass reads {reads} again (from L2 when it still holds it)")
        elif self.op == "batch_norm":
            lines.append("  passes             one read: the apply pass, coefficients from the "
                         "running statistics")
        else:
            lines.append("  passes             one read: the statistics pass and its merge")
        if self.splits and not self.one_read:
            lines.append(f"  splits             {self.splits} partial states a channel, merged "
                         f"in a fixed order (deterministic)")
        chip = []
        if self.one_read:
            what = "each tile's rows of" if self.layout == COLUMNS else "each channel's"
            chip.append(f"{what} x{' and addend' if self.addend else ''} in its block's "
                        f"shared memory ({self.steps[0].smem} bytes)")
        elif self.splits:
            chip.append("per-thread partial states in registers, a block's folded "
                        + ("in shared memory" if self.layout == COLUMNS else "by shuffles"))
        if self.op != "batch_stats" and not self.one_read:
            chip.append("per-channel coefficients " + ("in registers" if self.layout == COLUMNS
                                                       else "read through L1"))
        lines.append(f"  on chip            {'; '.join(chip)}")
        for s in self.steps:
            lines.append(f"  {s.kind:<18} {s.kernel}")
            lines.append(f"  {'':<18} grid {s.grid} block {s.block}"
                         + (f" cluster {s.cluster}" if s.cluster > 1 else "")
                         + (f" smem {s.smem}" if s.smem else "") + (f": {s.what}" if s.what
                                                                   else ""))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _occupancy(device: DeviceSpec, threads: int, smem: int = 0) -> int:
    return max(1, device.model_occupancy(threads, smem))


def _reduce_step(kind: str, dtype: str, view: ChannelView, pack: int, device: DeviceSpec,
                 tuning: Tuning, state_values: int) -> tuple[Step, int]:
    """The partial-reduction launch (statistics or gradient sums) and its splits."""
    a, c, b = view
    item = ITEMSIZE[dtype]
    csize = ITEMSIZE[_COMPUTE[dtype]]
    u = unroll_reduce(pack * item)
    threads = tuning.bn_reduce_threads
    if threads > MAX_REDUCE_THREADS or threads % 32:
        raise ValueError(f"plan: bn_reduce_threads {threads}: the kernels take a multiple of 32 "
                         f"up to {MAX_REDUCE_THREADS} (kBnReduceThreads)")
    cols = view.layout == COLUMNS
    smem = threads * pack * state_values * csize if cols else 0
    occupancy = _occupancy(device, threads, smem)
    if cols:
        occupancy = min(occupancy, tuning.bn_cols_stats_blocks_per_sm if kind == "stats"
                        else tuning.bn_cols_reduce_blocks_per_sm)
    resident = device.sms * occupancy
    waves = ((tuning.bn_cols_stats_waves if kind == "stats" else tuning.bn_cols_grad_waves)
             if cols else tuning.bn_reduce_waves)
    target = resident * waves
    # columns splits are ranges of rows; planes splits ranges of a channel's packs (a split may
    # begin or end inside a plane: (2, 8, 2^27) had 2 splits of 2^27 values a channel, 16
    # blocks for 4 GB, and float32 sums of 2^19 values a thread, 1.4e-4 off in invstd)
    units = a if cols else a * plane_packs(b, pack)
    cap = min(tuning.bn_max_splits, max(1, units), partial_cap(view, dtype, state_values,
                                                               tuning))

    def split(lanes: int, rows_a_pass: int) -> int:
        min_packs = tuning.bn_cols_min_packs_per_thread if cols else tuning.bn_min_packs_per_thread
        per_split_cap = max(1, rows_a_pass // (u * min_packs))
        n = min(-(-target // lanes), per_split_cap, cap)
        if cols and lanes * n > resident:  # whole waves: no tail wave of a few blocks
            n = max(1, (lanes * n // resident) * resident // lanes)
        return max(1, n)

    if cols:
        # tiles of TX channel packs by TY rows; narrower tiles (down to the tuning's
        # bn_cols_min_tile_packs) where the widest leave the SMs short of blocks
        cp = c // pack
        shapes = []
        tx = min(1 << max(0, (cp - 1).bit_length()), 32)
        while True:
            lanes = -(-cp // tx)
            blocks = lanes * split(lanes, a // (threads // tx))
            shapes.append((min(blocks, resident), -tx, tx))
            if tx <= tuning.bn_cols_min_tile_packs or blocks >= resident:
                break
            tx //= 2
        tx = max(shapes)[2]
        lanes, block = -(-cp // tx), (tx, threads // tx)
        splits = split(lanes, a // (threads // tx))
    else:
        bp = plane_packs(b, pack)
        lanes, block = c, (threads,)
        splits = split(lanes, (a * bp) // threads)
        splits = max(splits, -(-(a * bp) // 2**30))  # a split's packs in 32 bits
    if not cols and splits == 1:  # small channels (7x7): blocks only as wide as their work
        need = max(1, (a * bp) // (u * tuning.bn_block_min_packs_per_thread))
        block = (min(threads, max(64, 1 << (need - 1).bit_length())),)
    targs = (dtype, pack) if cols else (dtype, pack, spans(view, pack))
    step = Step(f"{kind}_{'cols' if cols else 'planes'}", targs, (lanes, splits), block, smem)
    return step, splits


def partial_cap(view: ChannelView, dtype: str, state_values: int, tuning: Tuning) -> int:
    """The most splits whose partial states (C x splits x state) stay within
    1 / bn_partial_fraction of the bytes the reduction reads (x; x and dy for the gradient
    sums, state_values == 2)."""
    reads = 2 if state_values == 2 else 1
    state = state_values * ITEMSIZE[_COMPUTE[dtype]]
    return max(1, view.per_channel * ITEMSIZE[dtype] * reads
               // (tuning.bn_partial_fraction * state))


def _elementwise_grid(view: ChannelView, pack: int, dtype: str, device: DeviceSpec,
                      tuning: Tuning, u: int) -> int:
    """The apply / dx grid for ``u`` packs in flight a thread: up to bn_apply_waves waves; in
    the columns layout, where that leaves a thread too few packs to amortise loading its PACK
    channels' coefficients (bn_apply_cols_coefs_per_pack, bn_apply_cols_few_packs_16bit),
    about one resident wave (bn_apply_blocks_per_sm_cols an SM), each thread looping over many
    rows of its fixed channels."""
    threads = tuning.bn_apply_threads
    total = view.numel // pack
    need = max(1, -(-total // (threads * u)))
    waves = device.sms * _occupancy(device, threads) * tuning.bn_apply_waves
    grid = min(need, waves)
    few = total * tuning.bn_apply_cols_coefs_per_pack < waves * threads * pack
    if ITEMSIZE[dtype] == 2:
        few = few or total < waves * threads * tuning.bn_apply_cols_few_packs_16bit
    if view.layout == COLUMNS and few:  # too few packs a thread for its PACK channels' setup
        grid = min(need, device.sms * tuning.bn_apply_blocks_per_sm_cols)
    if view.layout == COLUMNS:  # a thread's channels stay fixed: grid * threads % (C/pack) == 0
        cbp = view.channels // pack
        q = cbp // math.gcd(cbp, threads)
        # down to a multiple of q where one fits (no second, partial wave), else up to q
        grid = max(q, grid // q * q)
    return grid


def _merge_grid(channels: int, splits: int, device: DeviceSpec, tuning: Tuning) -> tuple[int]:
    """The merge kernels' grid (blocks of (32, bn_finalize_channels)): a warp a channel, or,
    where that leaves the SMs mostly idle and each lane would fold several states in a row
    (few channels, many splits: C = 64 with 528 splits was 8 blocks, 17 dependent merges a
    lane), a block a channel (bn::Merger: the kernels tell the two by gridDim.x == C); the
    tuning's bn_block_merge_sm_fraction says how idle "mostly" is."""
    warps = -(-channels // tuning.bn_finalize_channels)
    if splits > 32 and warps * tuning.bn_block_merge_sm_fraction < device.sms:
        return (channels,)
    return (warps,)


def plan_batch_norm(op: str, view: ChannelView, dtype: str, device: DeviceSpec | None = None,
                    *, align_elems: int = 16, training: bool = True, relu: bool = False,
                    addend: bool = False, mask: bool = False, copied: bool = False,
                    return_stats: bool = False, signature=None,
                    tuning: Tuning | None = None) -> BatchNormPlan:
    """The launches of ``op`` ("batch_norm", "batch_norm_backward", "batch_stats") over
    ``view``. ``align_elems``: the largest power of two (elements) dividing every array's
    address. ``mask``: forward: write the ReLU mask; backward: apply one to dy. ``addend``:
    forward: add it before the ReLU; backward: also write daddend. ``return_stats``: an eval
    forward returns mean and invstd (a finalize launch writes them; without, the apply pass
    computes the coefficients itself). ``signature(step)``: the
    step's kernel name expression (the family's). ``tuning``: the device's table
    (:func:`tuning_for`) unless given."""
    if op not in OPS:
        raise ValueError(f"plan: unknown batch-norm op {op!r}; expected one of {OPS}")
    if dtype not in ITEMSIZE:
        raise ValueError(f"plan: unsupported dtype {dtype!r}")
    device = device or DeviceSpec.h100()
    tuning = tuning or tuning_for(device)
    a, c, b = view
    if view.numel == 0:
        raise ValueError(f"plan: {op} over an empty tensor launches nothing")
    pack = flat_pack_for(dtype, view, align_elems, tuning.bn_min_pack_bytes)
    span = spans(view, pack)
    if c * b // pack > INT32_MAX:
        raise ValueError(f"plan: {op}: one sample of C * B = {c * b} elements is past the "
                         f"kernels' 32-bit sample index")
    if c > INT32_MAX or b > INT32_MAX:  # C * B in packs fits, but not C or B in elements
        raise ValueError(f"plan: {op}: C = {c} channels of planes of B = {b} elements; the "
                         f"kernels count channels and a plane's elements in 32-bit ints (at "
                         f"most {INT32_MAX})")
    compute = _COMPUTE[dtype]
    fin = (32, tuning.bn_finalize_channels)
    fin_grid = (-(-c // fin[1]),)
    steps: list[Step] = []
    splits = 0
    cols = view.layout == COLUMNS
    ew_block = (tuning.bn_apply_threads,)
    notes = []
    # columns reductions keep at most bn_cols_reduce_max_pack channels' states a thread
    rpack = min(pack, tuning.bn_cols_reduce_max_pack) if cols else pack
    one_read = None
    if op == "batch_norm" and training:
        one_read = (one_read_cols_step(view, dtype, pack, addend, device, tuning, relu, mask)
                    if cols else
                    one_read_planes_step(view, dtype, pack, span, addend, device, tuning, relu,
                                         mask))
    if one_read is not None:
        steps.append(one_read)
        splits = 1
    elif op in ("batch_stats",) or (op == "batch_norm" and training):
        red, splits = _reduce_step("stats", dtype, view, rpack, device, tuning, 3)
        outs = ("mean, invstd, running stats, coefficients" if op == "batch_norm"
                else "mean, var")
        if splits == 1:  # a block holds whole channels: it finishes them itself
            steps.append(Step(red.kind, red.targs, red.grid, red.block, red.smem,
                              "per-thread shifted sums -> Welford states, folded per block; "
                              + outs))
        else:
            steps.append(Step(red.kind, red.targs, red.grid, red.block, red.smem,
                              "per-thread shifted sums -> Welford states, folded per block"))
            steps.append(Step("finalize", (compute,), _merge_grid(c, splits, device, tuning),
                              fin, what="Chan merge of the splits in a fixed order; " + outs))
    elif op == "batch_norm" and return_stats:
        steps.append(Step("finalize", (compute,), fin_grid, fin,
                          what="mean, invstd and coefficients from the running statistics"))

    def ew_grid(kind: str) -> tuple[int]:
        u = elementwise_unroll(kind, dtype, pack, cols, addend)
        return (_elementwise_grid(view, pack, dtype, device, tuning, u),)

    if op == "batch_norm" and one_read is None:
        own = "" if training or return_stats else " (scale, shift from the running stats)"
        steps.append(Step("apply", (dtype, pack, cols, addend, span), ew_grid("apply"), ew_block,
                          what="y = (x - mean) * scale + shift" + own
                               + (" + addend" if addend else "")
                               + (", ReLU" if relu else "") + (", mask by ballot" if mask
                                                                 else "")))
    if op == "batch_norm_backward":
        red, splits = _reduce_step("grad", dtype, view, rpack, device, tuning, 2)
        what = "sum g, sum g (x - mean)" + (" (dy masked)" if mask else "")
        if splits == 1:  # a block holds whole channels: it finishes them itself
            steps.append(Step(red.kind, red.targs, red.grid, red.block, red.smem,
                              what + "; dweight, dbias, dx coefficients"))
        else:
            steps.append(Step(red.kind, red.targs, red.grid, red.block, red.smem, what))
            steps.append(Step("grad_finalize", (compute,), _merge_grid(c, splits, device, tuning),
                              fin,
                              what="fixed-order merge; dweight, dbias, dx coefficients"))
        steps.append(Step("dx", (dtype, pack, cols, span), ew_grid("dx"), ew_block,
                          what="dx" + (" and daddend" if addend else "")
                               + ("" if training else " (eval: x not read)")))
    if pack * ITEMSIZE[dtype] < 16:
        notes.append(f"{pack * ITEMSIZE[dtype]}-byte accesses: "
                     f"{'B' if not cols else 'C'} or the alignment allows no wider")
    if signature is not None:
        steps = [Step(s.kind, s.targs, s.grid, s.block, s.smem, s.what, signature(s),
                      s.cluster) for s in steps]
    return BatchNormPlan(op, dtype, view, pack, tuple(steps), training=training, relu=relu,
                         addend=addend, mask=mask, splits=splits, copied=copied,
                         device=device.name, notes=tuple(notes))


def flat_args(plan: BatchNormPlan) -> tuple[int, int, int, int, int, int]:
    """The elementwise kernels' index arguments (total, CBp, d, d_m, d_s, upp): flat packs,
    packs a sample, the divisor of a pack's offset within its sample (units per plane), its
    fast_div constants and units a pack (bn::plane_span: planes whose B the pack divides count
    in packs, upp = 1; others in elements, upp = pack; columns: d = 1)."""
    a, c, b = plan.view
    p = plan.pack
    total, cbp = plan.view.numel // p, c * b // p
    if plan.layout == COLUMNS:
        cbp, d, upp = c // p, 1, 1
    elif b % p == 0:
        d, upp = b // p, 1
    else:
        d, upp = b, p
    m, s = fast_div(d)
    return total, cbp, d, m, s, upp


def reachable_steps(op: str, dtype: str) -> list[tuple[str, tuple]]:
    """Every (kind, template arguments) ``op`` can launch for ``dtype`` (any shape, alignment
    or switches), from the same rules as :func:`plan_batch_norm`: planes packs that span two
    planes only where a dividing pack is under the tuning's bn_min_pack_bytes and the
    spanning one reaches it (:func:`flat_pack_for`)."""
    packs = [p for p in (1, 2, 4, 8, 16) if p <= max_pack(dtype)]
    item = ITEMSIZE[dtype]
    spanning = {p for t in (HOPPER, AMPERE) for p in packs
                if item < t.bn_min_pack_bytes <= p * item}
    planes = [(p, False) for p in packs] + [(p, True) for p in sorted(spanning)]
    compute = _COMPUTE[dtype]
    out: list[tuple[str, tuple]] = []
    if op in ("batch_norm", "batch_stats"):
        out += [("stats_planes", (dtype, p, sp)) for p, sp in planes]
        out += [("stats_cols", (dtype, p)) for p in packs]
        out.append(("finalize", (compute,)))
    if op == "batch_norm":
        out += [("apply", (dtype, p, False, add, sp)) for p, sp in planes
                for add in (False, True)]
        out += [("apply", (dtype, p, True, add, False)) for p in packs for add in (False, True)]
        out += [(kind, (dtype, p, add)) for kind in ("train_planes", "train_cols")
                for p in packs for add in (False, True)
                if any(t.bn_one_read_max_bytes and p * item >= t.bn_min_pack_bytes and not (
                    add and p * item < t.bn_one_read_min_pack_bytes_addend) and not (
                    add and kind == "train_cols" and not t.bn_one_read_cols_addend)
                    for t in (HOPPER, AMPERE))]
    if op == "batch_norm_backward":
        out += [("grad_planes", (dtype, p, sp)) for p, sp in planes]
        out += [("grad_cols", (dtype, p)) for p in packs]
        out.append(("grad_finalize", (compute,)))
        out += [("dx", (dtype, p, False, sp)) for p, sp in planes]
        out += [("dx", (dtype, p, True, False)) for p in packs]
    return out

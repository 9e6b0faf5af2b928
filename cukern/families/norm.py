"""The norm family: layer norm and RMS norm over contiguous rows, forward
(``kernels/layer_norm.cuh``) and backward with dweight/dbias (``kernels/layer_norm_grad.cuh``;
two headers only to keep each readable, both on ``kernels/norm.cuh``).

Kernel signatures (group width and block size are read from the launch; the switches that
are template arguments are the forward's RESIDUAL, which adds a read and a write, its cluster
kernels' WEIGHT and BIAS, and the backward's WEIGHT, which sizes its column sums; the forward's
warp and block kernels have AFFINE, every parameter given (``affine``), and otherwise read
weight and bias at run time, absent as null pointers, so two instantiations serve every
Switches of a residual setting, while its clusters keep them as switches: run-time presence
cost 16-bit layer norm 1-10 points of copy speed). Float32 weight and bias with
float16 or bfloat16 data (Switches.float32_params) run the uncached kernels with their type P =
float, the only kernels instantiated for them (P defaults to T). The forward's cluster kernels
of packs under 16 bytes (misaligned or odd rows) take the cluster's size at launch
(``layer_norm_cluster_dyn``, ``Plan.launch_cluster``): one instantiation for every size, where
16-byte packs keep it compiled in (docs/notes/kernels.md, "Cluster sizes set at launch")::

    layer_norm_warp<T, ALGO, PACK, CPT, RPA, R, AFFINE>
    layer_norm_block_smem<T, ALGO, PACK, R, OVERLAP, AFFINE>
    layer_norm_block_uncached<T, ALGO, PACK, R[, P]>
    layer_norm_cluster<T, ALGO, PACK, CLUSTER, W, B, R, OVERLAP, MIN_BLOCKS, ROWS>
    layer_norm_cluster_dyn<T, ALGO, PACK, W, B, R, OVERLAP, MIN_BLOCKS, ROWS>
    layer_norm_grad_warp<T, ALGO, PACK, CPT, RPA, W>
    layer_norm_grad_block_smem<T, ALGO, PACK, W, REGS, GAMMA>
    layer_norm_grad_block_uncached<T, ALGO, PACK, W[, P]>
    layer_norm_grad_cluster<T, ALGO, PACK, CLUSTER, W, REGS, GAMMA>
    norm_param_grad_partial<T, ALGO, PACK>, norm_param_grad_reduce<T>   (auxiliary)
"""

from __future__ import annotations

import itertools

from ..plan import CPP_TYPES, OpPolicy, Plan, Switches, Variant

__all__ = ["POLICIES", "LAUNCH_CLUSTER_SIZES", "TEMPLATE_SWITCHES", "CLUSTER_SWITCHES",
           "template_switches", "affine", "name_expression", "aux_kernels", "min_blocks"]

FORWARD, BACKWARD = "layer_norm", "layer_norm_grad"  # kernel sources
# the cluster sizes layer_norm_cluster_dyn's reductions are compiled for (kernels/cluster.cuh)
LAUNCH_CLUSTER_SIZES = (2, 4, 8, 16)


# The switches that are template arguments, in the kernels' order: the forward's residual (a
# read and a write more), the backward's weight (column sums). The forward's warp and block
# kernels take weight and bias as kernel arguments, null where absent; its clusters take them
# as template switches too (CLUSTER_SWITCHES; RMS norm's bias is always false).
TEMPLATE_SWITCHES = {"layer_norm": ("residual",), "rms_norm": ("residual",),
                     "layer_norm_backward": ("weight",), "rms_norm_backward": ("weight",)}
CLUSTER_SWITCHES = {"layer_norm": ("weight", "bias", "residual"),
                    "rms_norm": ("weight", "bias", "residual")}


def template_switches(op: str, variant: Variant) -> tuple[str, ...]:
    """The switches of ``op`` that are template arguments of its ``variant`` kernel, in order."""
    if variant is Variant.CLUSTER and op in CLUSTER_SWITCHES:
        return CLUSTER_SWITCHES[op]
    return TEMPLATE_SWITCHES[op]


def _tf(flag: bool) -> str:
    return "true" if flag else "false"


def min_blocks(plan: Plan) -> int:
    """A forward cluster kernel's ``__launch_bounds__`` minimum: 3 blocks an SM (at most 40
    registers a thread) for blocks of at most 512 threads that do not overlap rows, else 1."""
    return 3 if plan.threads <= 512 and not plan.overlap else 1


def affine(pol: OpPolicy, sw: Switches) -> bool:
    """Whether a forward call gives every parameter its norm has (the weight, and for layer
    norm the bias): the warp and block-cache kernels' AFFINE, compiled with them present."""
    return sw.weight and (sw.bias or pol.algo == 1)


def name_expression(plan: Plan) -> str:
    pol, sw, v = plan.policy, plan.switches, plan.variant
    args = [CPP_TYPES[plan.dtype], pol.algo, plan.pack_size]
    if v is Variant.WARP:
        args += [plan.cols_per_thread, plan.rows_per_access]
    elif v is Variant.CLUSTER and plan.launch_cluster == 1:
        args.append(plan.cluster)
    cached = v in (Variant.BLOCK_SMEM, Variant.CLUSTER)
    args += [_tf(getattr(sw, s)) for s in template_switches(pol.op, v)]
    if pol.col_sums:  # backward
        if cached:
            args += [_tf(plan.sums_in_registers), _tf(plan.gamma_in_smem)]
    elif cached:
        args.append(_tf(plan.overlap))
        if v is Variant.CLUSTER:
            args += [min_blocks(plan), plan.rows_per_pass]
    if not pol.col_sums and v in (Variant.WARP, Variant.BLOCK_SMEM):
        args.append(_tf(affine(pol, sw)))
    if sw.float32_params:  # the parameters' type P (the uncached kernels only)
        args.append(CPP_TYPES["float32"])
    if plan.shifted:  # the last template argument, SHIFT (never of the uncached kernels)
        args.append("true")
    dyn = "_dyn" if plan.launch_cluster > 1 else ""
    if dyn and plan.cluster not in LAUNCH_CLUSTER_SIZES:  # the kernel traps on any other
        raise ValueError(f"plan: a cluster of {plan.cluster} blocks sized at launch; "
                         f"layer_norm_cluster_dyn takes {LAUNCH_CLUSTER_SIZES}")
    return f"cukern::{pol.kernel}_{v.value}{dyn}<{', '.join(map(str, args))}>"


def aux_kernels(op: str):
    """(dtype, pack) -> (reduce, partial): the auxiliary kernels of ``op``'s backward with
    column sums, which add up the partial rows of dweight (and dbias), and write them straight
    from x and dy for the uncached kernel."""

    def names(dtype: str, pack: int) -> tuple[str, str]:
        t = CPP_TYPES[dtype]
        return (f"cukern::norm_param_grad_reduce<{t}>",
                f"cukern::norm_param_grad_partial<{t}, {POLICIES[op].algo}, {pack}>")

    return names


_NORM = dict(strided=False, cluster_threads_per_sm=1536, rows_overlap=False,
             signature=name_expression, float32_params=True)
_TF = (False, True)
# forward: cached rows start aligned with no bytes added (block kernels' static buffers are
# 256-byte multiples; clusters keep theirs in the tail: one sum a row of a pass, merged as
# layer norm's (count, mean, M2) or RMS norm's sum)
_FORWARD = dict(_NORM, source=FORWARD, kernel="layer_norm", inputs=1,
                switches=("weight", "bias", "residual"), overlap_with_residual=True,
                split_lone_blocks=True, two_packs_a_lane=True, one_wave_cluster=16,
                cluster_at_launch_below=16, tail_scratch_words=1, shifted_rows=True,
                shifted_uncached=False, shifted_pairs=False, shifted_past_warp=True)
_BACKWARD = dict(_NORM, source=BACKWARD, kernel="layer_norm_grad", inputs=2, smem_align=128,
                 switches=("weight",), switch_sets=(Switches(), Switches(weight=True)))

POLICIES = {
    "layer_norm": OpPolicy(op="layer_norm", algo=0, pair_rows=True, tail_merge_words=3,
                           oneflow_width_dtypes=("float32",),
                           **_FORWARD, switch_sets=tuple(
        Switches(w, b, r) for w, b, r in itertools.product(_TF, _TF, _TF))),
    "rms_norm": OpPolicy(op="rms_norm", algo=1, tail_merge_words=1, shifted_half_warps=True,
                         **_FORWARD, switch_sets=tuple(
        Switches(w, False, r) for w, r in itertools.product(_TF, _TF))),
    "layer_norm_backward": OpPolicy(op="layer_norm_backward", algo=0, col_sums=2, **_BACKWARD),
    "rms_norm_backward": OpPolicy(op="rms_norm_backward", algo=1, col_sums=1, **_BACKWARD),
}

"""The softmax family (``kernels/softmax.cuh``): softmax and log-softmax, forward and backward,
along any axis (strided kernels for columns that are not adjacent in memory).

Kernel signatures (the group width, block size and padding are read from the launch; WIDTH is
a cached block's width where it is compiled in, ``OpPolicy.fixed_widths``, else 0)::

    softmax_warp<T, ALGO, STRIDED, PACK, CPT, RPA>      softmax_grad_warp<...same...>
    softmax_block_smem<T, ALGO, STRIDED, PACK, WIDTH>   softmax_grad_block_smem<...>
    softmax_block_uncached<T, ALGO, STRIDED, PACK>      softmax_grad_block_uncached<...>
    softmax_cluster<T, ALGO, PACK, CLUSTER>             softmax_grad_cluster<...>

each with a last argument SHIFT (default false; true for rows off the 16-byte grid, Plan.shifted).
"""

from __future__ import annotations

from ..plan import CPP_TYPES, OpPolicy, Plan, Switches, Variant

__all__ = ["POLICIES", "name_expression"]

SOURCE = "softmax"
FIXED_WIDTHS = (1024,)


def _tf(flag: bool) -> str:
    return "true" if flag else "false"


def name_expression(plan: Plan) -> str:
    pol = plan.policy
    args = [CPP_TYPES[plan.dtype], pol.algo]
    if plan.variant is Variant.CLUSTER:
        args += [plan.pack_size, plan.cluster]
    else:
        args += [_tf(plan.strided), plan.pack_size]
        if plan.variant is Variant.WARP:
            args += [plan.cols_per_thread, plan.rows_per_access]
        elif plan.variant is Variant.BLOCK_SMEM:
            args.append(plan.threads if plan.threads in pol.fixed_widths else 0)
    if plan.shifted:
        args.append("true")
    return f"cukern::{pol.kernel}_{plan.variant.value}<{', '.join(map(str, args))}>"


def _policy(op: str, kernel: str, algo: int, inputs: int) -> OpPolicy:
    # cluster reductions: (max, sum) forward, one sum backward (a state of 2 or 1 words)
    return OpPolicy(op=op, source=SOURCE, kernel=kernel, algo=algo, inputs=inputs,
                    tail_scratch_words=3 - inputs, tail_merge_words=3 - inputs,
                    tail_in_blocks=tuple(CPP_TYPES) if inputs == 1 else ("float64",),
                    signature=name_expression,
                    switch_sets=(Switches(),), fixed_widths=FIXED_WIDTHS,
                    lone_block_one_wave=inputs == 1, load_round=4 if inputs == 1 else 0,
                    shifted_rows=True)


POLICIES = {
    "softmax": _policy("softmax", "softmax", 0, 1),
    "log_softmax": _policy("log_softmax", "softmax", 1, 1),
    "softmax_backward": _policy("softmax_backward", "softmax_grad", 0, 2),
    "log_softmax_backward": _policy("log_softmax_backward", "softmax_grad", 1, 2),
}

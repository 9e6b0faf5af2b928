"""The planner: pure functions from (op, shape, dtype, device, occupancy) to a printable
:class:`Plan`, one module per decision family.

- ``common``: the plan record, switches, occupancy and device arithmetic;
- ``policy``: tuning tables per architecture, and the per-op policy families declare;
- ``rowwise``: the row-wise cascade (warp, block, cluster, uncached) of softmax and the norms;
- ``col_sums``: backward kernels that also sum over rows, and their auxiliary launches;
- ``batch_norm``, ``permute``: the families that plan themselves (``PermutePlan``).
"""

from __future__ import annotations

from .col_sums import ParamGradPlan, col_sums_ways, param_reduce_shape, plan_param_grad
from .common import (
    CPP_TYPES,
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
    warp_shape,
)
from .permute import PermutePlan, plan_permute, simplify
from .policy import AMPERE, HOPPER, OpPolicy, Tuning, tuning_for
from .rowwise import MAX_COLS, plan_rowwise, reachable_plans

# Hopper's table entries most callers ask for by name
CLUSTER_SIZES = HOPPER.cluster_sizes

__all__ = ["AMPERE", "CLUSTER_SIZES", "CPP_TYPES", "HOPPER", "ITEMSIZE", "MAX_COLS", "Occupancy",
           "OpPolicy", "ParamGradPlan", "PermutePlan", "Plan", "Switches", "Tuning", "Variant",
           "block_threads_for", "col_sums_ways", "max_dynamic_smem", "model_occupancy",
           "num_blocks", "pack_size",
           "param_reduce_shape", "plan_param_grad", "plan_permute", "plan_rowwise",
           "reachable_plans", "replace", "simplify", "tuning_for", "warp_shape"]

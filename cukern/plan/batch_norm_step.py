"""A batch-norm launch as the planner decides it (:class:`Step`), and the kernels' limits it
plans within."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Step", "MAX_REDUCE_THREADS", "MAX_ONE_READ_THREADS"]

MAX_REDUCE_THREADS = 256  # kernels/batch_norm_parts.cuh: kBnReduceThreads (__launch_bounds__)
MAX_ONE_READ_THREADS = 512  # ... kBnOneReadThreads
_COMPUTE = {"float16": "float32", "bfloat16": "float32", "float32": "float32",
            "float64": "float64"}


@dataclass(frozen=True)
class Step:
    """One kernel launch: its kind and template arguments (the family spells its name), grid,
    block, dynamic shared memory and what it does."""

    kind: str  # stats_planes | stats_cols | finalize | apply | train_planes | grad_planes |
    #            grad_cols | grad_finalize | dx
    targs: tuple
    grid: tuple[int, ...]
    block: tuple[int, ...]
    smem: int = 0
    what: str = ""
    kernel: str = ""  # the name expression (set by the family's signature)
    cluster: int = 1  # blocks a cluster along grid x, set at launch (sm_90)

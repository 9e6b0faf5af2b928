"""The batch-norm family (``kernels/batch_norm.cuh``): batch norm forward (training and eval,
fused add and ReLU, the ReLU bit mask), its backward, and per-channel batch statistics, over
the channel axis of a dense tensor in the planes (NCHW) or columns (NHWC) layout.

Kernel signatures (every shape, split count and grid is read from the launch)::

    batch_norm_stats_planes<T, PACK, SPAN>    batch_norm_stats_cols<T, PACK>
    batch_norm_finalize<C>                    (C: float, or double for double data)
    batch_norm_apply<T, PACK, COLS, ADD, SPAN>
    batch_norm_grad_planes<T, PACK, SPAN>     batch_norm_grad_cols<T, PACK>
    batch_norm_grad_finalize<C>
    batch_norm_dx<T, PACK, COLS, SPAN>
    batch_norm_train_planes<T, PACK, ADD>   (training forward in one read; B % PACK == 0)
    batch_norm_train_cols<T, PACK, ADD>     (the same over columns; its cluster's size, sm_90,
                                             set at launch)

SPAN (planes only; false for COLS): B is not a multiple of PACK, so a pack may span two
channels' planes (7x7 in 16-byte packs: ``cukern.plan.batch_norm.spans``).
"""

from __future__ import annotations

from ..plan import CPP_TYPES
from ..plan import batch_norm as bnplan

__all__ = ["SOURCE", "name_expression", "kernel_names"]

SOURCE = "batch_norm"
_KERNELS = {"stats_planes": "batch_norm_stats_planes", "stats_cols": "batch_norm_stats_cols",
            "finalize": "batch_norm_finalize", "apply": "batch_norm_apply",
            "grad_planes": "batch_norm_grad_planes", "grad_cols": "batch_norm_grad_cols",
            "grad_finalize": "batch_norm_grad_finalize", "dx": "batch_norm_dx",
            "train_planes": "batch_norm_train_planes", "train_cols": "batch_norm_train_cols"}


def _arg(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return CPP_TYPES[v]
    return str(v)


def _name(kind: str, targs: tuple) -> str:
    return f"cukern::{_KERNELS[kind]}<{', '.join(_arg(a) for a in targs)}>"


def name_expression(step: bnplan.Step) -> str:
    """The C++ name expression of a planned step, in the template order of the header."""
    return _name(step.kind, step.targs)


def kernel_names(op: str):
    """(dtype, device) -> every instantiation ``op`` can launch for ``dtype`` (the same on every
    architecture: nothing here needs sm_90)."""

    def names(dtype: str, device=None) -> set[str]:
        return {_name(kind, targs) for kind, targs in bnplan.reachable_steps(op, dtype)}

    return names

"""Layout graph: trace a function over cukern ops into a graph, run it channels-last with the
transposes cancelled or folded into strided reads, batch norm + ReLU (+ add) fused, buffers
reused, and optionally as one CUDA graph.

    >>> from cukern import graph
    >>> g = graph.trace(block, x, params)        # records; runs nothing
    >>> opt = g.optimize(layout="NHWC")          # auto_nhwc, cancel, fuse, fold
    >>> print(opt.explain())
    >>> y = opt(x, params)                       # NCHW in, NCHW out
    >>> cap = opt.capture(x, params); y = cap(x) # one CUDA-graph launch a call
"""

from __future__ import annotations

from .api import TracedGraph, check_user_ops, optimize_graph
from .execute import Captured, Program
from .ir import Graph, GraphError, LogEntry, Node
from .layout import LAYOUT, LayoutRule
from .ops import UserOp, bias_add, layer_norm, register, relu, rms_norm
from .passes import auto_nhwc, cancel_transposes, fold_transposes, fuse_bn_activation
from .trace import Tracer, TracingError, patched, trace

__all__ = [
    "Captured", "Graph", "GraphError", "LAYOUT", "LayoutRule", "LogEntry", "Node", "Program",
    "TracedGraph", "Tracer", "TracingError", "UserOp", "auto_nhwc", "bias_add",
    "cancel_transposes", "check_user_ops", "eager", "fold_transposes", "fuse_bn_activation",
    "layer_norm", "optimize_graph", "register", "relu", "rms_norm", "trace",
]


def eager(fn, *args):
    """``fn(*args)`` run op by op, with registered user ops swapped in as while tracing; on
    NumPy arrays the cukern ops run their float64 references (``cukern.reference``): the eager
    baseline a graph's result is compared with."""
    with patched(fn):
        return fn(*args)

"""How each op relates to memory layout, as data: the table the graph passes read.

Keys are ``cukern.registry`` op names (forward ops) and the graph's own elementwise ops; a
registered user op carries its rule itself (:class:`cukern.graph.ops.UserOp`). Registry ops
absent here (the backward ops, ``batch_stats``) cannot be traced.

- ``kind="axis"``: the op works along one axis (``attrs["axis"]``); its NHWC twin is the same
  op along the remapped axis, used when the axis is the channel axis of an NCHW value
  (softmax over axis 1 becomes softmax over the last axis; a norm over channels becomes a
  contiguous row-wise norm; batch norm reads channels-last from strides).
- ``kind="agnostic"``: elementwise; moved to NHWC when an input already comes out of a
  transpose (the greedy rule), with any constant operand permuted once at optimize time.
- ``kind="permute"``: a transpose, what the passes cancel, merge and fold.
- ``operands``: argument positions that carry the layout (the rest are per-channel vectors
  or statistics, which keep their shape).
- ``strided_in``: reads any input strides in one pass, so a permute feeding it can become a
  view (softmax reads strided rows; CuPy elementwise kernels index any strides). The norms
  copy a non-contiguous row first and batch norm writes its output in its input's memory
  layout, so neither takes a folded permute.
- ``strided_out``: writes any output strides through ``out=`` at no extra cost, so a permute
  right after it can be folded into its output (batch norm's ``out=`` of another layout costs
  a copy).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayoutRule", "LAYOUT", "rule"]


@dataclass(frozen=True)
class LayoutRule:
    kind: str  # "axis" | "agnostic" | "permute" | "user" | "source"
    operands: tuple[int, ...] = (0,)
    strided_in: bool = False
    strided_out: bool = False


_ROWWISE = LayoutRule("axis", (0,), strided_in=True, strided_out=True)
_NORM = LayoutRule("axis", (0,))
_ELEMENTWISE = LayoutRule("agnostic", (0, 1), strided_in=True, strided_out=True)

LAYOUT: dict[str, LayoutRule] = {
    # registry ops
    "softmax": _ROWWISE,
    "log_softmax": _ROWWISE,
    "layer_norm": _NORM,  # args (x, weight, bias): weight and bias are per-channel
    "rms_norm": _NORM,  # args (x, weight)
    "batch_norm": LayoutRule("axis", (0, 5)),  # args (x, rm, rv, weight, bias, addend)
    "permute": LayoutRule("permute", (0,)),
    # the graph's elementwise ops
    "relu": LayoutRule("agnostic", (0,), strided_in=True, strided_out=True),
    "add": _ELEMENTWISE,
    "mul": _ELEMENTWISE,
    "bias_add": LayoutRule("agnostic", (0,), strided_in=True, strided_out=True),  # (x, b)
    # graph inputs, parameters and constants
    "input": LayoutRule("source", ()),
    "param": LayoutRule("source", ()),
    "user": LayoutRule("user", (0,)),  # (x, *weights); the UserOp says whether it has NHWC
}


def rule(op: str) -> LayoutRule:
    return LAYOUT[op]

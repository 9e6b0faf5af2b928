"""The graph IR: nodes in topological order, each computing one value from earlier values.

A node's value has a logical shape, a dtype and a layout tag ("NCHW", "NHWC" or None). Every
node means what it computes on logical arrays: a ``permute`` node is ``numpy.transpose``, so
rewriting an op ``f`` into ``T^-1 . f' . T`` is exact by construction. Execution details are
attributes: a permute with ``view=True`` is not materialised (its consumers read strides), a
producer with ``out_axes`` writes its result through a transposed view of its buffer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Node", "Graph", "LogEntry", "GraphError", "flatten", "leaf_at", "fmt_path",
           "compose", "inverse", "NHWC", "NCHW", "permuted_tag"]

NHWC = (0, 2, 3, 1)  # NCHW -> NHWC
NCHW = (0, 3, 1, 2)  # NHWC -> NCHW


class GraphError(ValueError):
    """A graph that cannot be optimised or run as asked (wrong shapes, arguments)."""


@dataclass(frozen=True)
class Node:
    id: int
    op: str  # input param permute relu add mul bias_add softmax log_softmax layer_norm ...
    args: tuple  # value ids (int) or None
    attrs: dict = field(default_factory=dict, compare=False, hash=False)
    shape: tuple = ()
    dtype: np.dtype = np.dtype(np.float32)
    layout: str | None = None

    def with_(self, **kw) -> Node:
        return dataclasses.replace(self, **kw)

    @property
    def inputs(self) -> tuple[int, ...]:
        return tuple(a for a in self.args if a is not None)

    @property
    def materialised(self) -> bool:
        """A permute that moves memory (not folded into its consumers as a view)."""
        return self.op == "permute" and not self.attrs.get("view", False)


@dataclass(frozen=True)
class LogEntry:
    pass_name: str
    message: str
    removed: tuple[int, ...] = ()
    added: tuple[int, ...] = ()

    def __str__(self) -> str:
        r = f" (removed {', '.join(f'%{i}' for i in self.removed)})" if self.removed else ""
        return f"  {self.pass_name}: {self.message}{r}"


def compose(first: tuple[int, ...], second: tuple[int, ...]) -> tuple[int, ...]:
    """Axes of ``transpose(transpose(x, first), second)`` as one transpose of x."""
    return tuple(first[a] for a in second)


def inverse(axes: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(axes)
    for i, a in enumerate(axes):
        inv[a] = i
    return tuple(inv)


def permuted_tag(tag: str | None, axes: tuple[int, ...]) -> str | None:
    if axes == NHWC and tag == "NCHW":
        return "NHWC"
    if axes == NCHW and tag == "NHWC":
        return "NCHW"
    if axes == tuple(range(len(axes))):
        return tag
    return None


def flatten(obj, path: tuple = ()) -> list[tuple[tuple, object]]:
    """(path, leaf) of every leaf of nested dicts, lists and tuples (None and scalars included)."""
    if isinstance(obj, dict):
        return [kv for k in obj for kv in flatten(obj[k], path + (k,))]
    if isinstance(obj, (list, tuple)):
        return [kv for i, v in enumerate(obj) for kv in flatten(v, path + (i,))]
    return [(path, obj)]


def leaf_at(obj, path: tuple):
    for k in path:
        obj = obj[k]
    return obj


def fmt_path(path: tuple, names: tuple[str, ...] = ()) -> str:
    """``args[1]["rm1"]`` written as ``p["rm1"]`` using the traced function's parameter names."""
    if not path:
        return "?"
    head = names[path[0]] if path[0] < len(names) else f"arg{path[0]}"
    return head + "".join(f"[{k!r}]" if isinstance(k, str) else f"[{k}]" for k in path[1:])


@dataclass
class Graph:
    """A traced function: ``nodes`` in topological order, ``outputs`` the value ids it returns
    (``out_tree`` rebuilds their nesting), ``arg_names`` the function's parameter names."""

    nodes: list[Node]
    outputs: tuple[int, ...]
    out_tree: object  # the returned structure with leaves replaced by output indices
    name: str = "graph"
    arg_names: tuple[str, ...] = ()
    next_id: int = 0

    def __post_init__(self) -> None:
        self.next_id = max([self.next_id] + [n.id + 1 for n in self.nodes])
        self._by_id = {n.id: n for n in self.nodes}

    # --- queries
    def node(self, i: int) -> Node:
        return self._by_id[i]

    def consumers(self) -> dict[int, list[int]]:
        """value id -> ids of the nodes reading it (a node reading it twice counts twice)."""
        uses: dict[int, list[int]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            for a in n.inputs:
                uses[a].append(n.id)
        return uses

    def permute_count(self) -> int:
        """Permutes that move memory (views excluded); hidden copies are counted by
        :meth:`copy_count`."""
        return sum(n.materialised for n in self.nodes)

    def copy_count(self) -> int:
        """Ops that copy their input into another layout inside (a norm over a non-trailing
        axis)."""
        return sum(n.op in ("layer_norm", "rms_norm") and n.attrs["axis"] != len(n.shape) - 1
                   for n in self.nodes)

    def ops(self) -> list[str]:
        return [n.op for n in self.nodes if n.op not in ("input", "param")]

    # --- building
    def copy(self, nodes: list[Node] | None = None, outputs: tuple[int, ...] | None = None
             ) -> Graph:
        return Graph(list(self.nodes if nodes is None else nodes),
                     self.outputs if outputs is None else outputs, self.out_tree, self.name,
                     self.arg_names, self.next_id)

    def dce(self) -> tuple[Graph, tuple[int, ...]]:
        """Drop nodes nothing reads (graph inputs and training batch norms, which update
        running statistics, stay); returns the graph and the removed ids."""
        live = set(self.outputs)
        for n in reversed(self.nodes):
            if n.op == "input" or (n.op == "batch_norm" and n.attrs.get("training")):
                live.add(n.id)
            if n.id in live:
                live.update(n.inputs)
        keep = [n for n in self.nodes if n.id in live]
        removed = tuple(n.id for n in self.nodes if n.id not in live)
        return self.copy(keep), removed

    def check(self) -> None:
        """Every argument defined before use (raises GraphError)."""
        seen: set[int] = set()
        for n in self.nodes:
            for a in n.inputs:
                if a not in seen:
                    raise GraphError(f"%{n.id} = {n.op} reads %{a} before it is defined")
            seen.add(n.id)
        for o in self.outputs:
            if o not in seen:
                raise GraphError(f"output %{o} is not defined")

    # --- printing
    def describe(self, n: Node) -> str:
        if n.op == "input":
            rhs = f"input {fmt_path(n.attrs['path'], self.arg_names)}"
        elif n.op == "param":
            rhs = f"param {fmt_path(n.attrs['path'], self.arg_names)}"
            for t in n.attrs.get("transform", ()):  # done once, at optimize time
                rhs += (f" |> {t[1]}.weight_layout (shape before it)" if t[0] == "user"
                        else f" |> {t[0]}{tuple(t[1])}")
        else:
            args = ", ".join("None" if a is None else f"%{a}" for a in n.args)
            attrs = ", ".join(f"{k}={_short(v)}" for k, v in n.attrs.items()
                              if k not in ("fn", "userop") and v is not None and v is not False)
            name = n.attrs["userop"].name if n.op == "user" else n.op
            rhs = f"{name}({args}{', ' if args and attrs else ''}{attrs})"
        shape = "(" + ",".join(map(str, n.shape)) + ")"
        tag = f" {n.layout}" if n.layout else ""
        return f"%{n.id} = {rhs}".ljust(64) + f" : {shape} {np.dtype(n.dtype).name}{tag}"

    def __str__(self) -> str:
        head = (f"graph {self.name}: {len(self.ops())} ops, {self.permute_count()} permutes")
        lines = [head] + ["  " + self.describe(n) for n in self.nodes]
        lines.append("  return " + ", ".join(f"%{o}" for o in self.outputs))
        return "\n".join(lines)

    __repr__ = __str__


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, tuple):
        return "(" + ",".join(map(str, v)) + ")"
    return str(v)

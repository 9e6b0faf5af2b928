"""Graph passes, each ``graph -> (graph, log)``; the log's entries name every node removed.

- :func:`auto_nhwc`: ops with an NHWC twin run channels-last between transposes; elementwise
  ops whose input already comes out of such a transpose follow (the greedy rule); constant
  operands are transposed once, at optimize time.
- :func:`cancel_transposes`: inverse pairs vanish, chains merge into one permute, a permute of
  a constant becomes part of the constant, duplicate permutes of one value are shared.
- :func:`fuse_bn_activation`: batch_norm -> relu and batch_norm -> add -> relu become one
  batch norm with ``relu=True`` (and ``addend``), where the intermediates have no other reader.
- :func:`fold_transposes`: a permute whose readers all read strides becomes a view; one whose
  producer writes any strides is folded into the producer's output.
"""

from __future__ import annotations

from .ir import NCHW, NHWC, Graph, LogEntry, Node, compose
from .layout import rule

__all__ = ["auto_nhwc", "cancel_transposes", "fuse_bn_activation", "fold_transposes",
           "PASSES"]


class _Builder:
    def __init__(self, g: Graph, name: str) -> None:
        self.g, self.name = g, name
        self.nodes: list[Node] = []
        self.next = g.next_id
        self.new: dict[int, int] = {}  # old id -> id of what replaces its value
        self.log: list[LogEntry] = []
        self.pos: dict[int, int] = {}  # id -> index in self.nodes

    def node(self, i: int) -> Node:
        return self.nodes[self.pos[i]] if i in self.pos else self.g.node(i)

    def set(self, n: Node) -> None:
        self.nodes[self.pos[n.id]] = n

    def add(self, op, args, attrs, shape, dtype, layout) -> int:
        n = Node(self.next, op, tuple(args), dict(attrs), tuple(shape), dtype, layout)
        self.next += 1
        self.pos[n.id] = len(self.nodes)
        self.nodes.append(n)
        return n.id

    def keep(self, n: Node) -> None:
        args = tuple(None if a is None else self.new.get(a, a) for a in n.args)
        self.pos[n.id] = len(self.nodes)
        self.nodes.append(n.with_(args=args, attrs=dict(n.attrs)))
        self.new[n.id] = n.id

    def note(self, message: str, removed=(), added=()) -> None:
        self.log.append(LogEntry(self.name, message, tuple(removed), tuple(added)))

    def finish(self, outputs: tuple[int, ...]) -> tuple[Graph, list[LogEntry]]:
        g = Graph(self.nodes, tuple(self.new.get(o, o) for o in outputs), self.g.out_tree,
                  self.g.name, self.g.arg_names, self.next)
        g, dead = g.dce()
        g.check()
        logged = {i for e in self.log for i in e.removed}
        gone = [n.id for n in self.g.nodes if n.id not in {m.id for m in g.nodes}]
        rest = [i for i in gone if i not in logged]
        if rest:
            self.note(f"{len(rest)} node{'s' if len(rest) > 1 else ''} no longer read "
                      f"({', '.join(self.g.node(i).op for i in rest)})", rest)
        return g, self.log


def _nhwc_shape(shape) -> tuple:
    return tuple(shape[a] for a in NHWC)


def _convertible(g: Graph, n: Node, free: set[int]) -> str | None:
    """Why ``n`` moves to NHWC ("twin" / "greedy"), or None."""
    r = rule(n.op)
    x = g.node(n.args[0]) if n.args and n.args[0] is not None else None
    if x is None or x.layout != "NCHW" or len(x.shape) != 4 or len(n.shape) != 4:
        return None
    if r.kind == "axis":
        return "twin" if n.attrs["axis"] == 1 else None
    if r.kind == "user":
        op = n.attrs["userop"]
        if op.nhwc is None:
            return None
        for i, w in enumerate(n.args[1:]):  # converted weights must be constants
            if op.weight_fn(i) is not None and g.node(w).op != "param":
                return None
        return "twin"
    if r.kind == "agnostic":
        if n.layout != "NCHW":
            return None
        for pos, a in enumerate(n.args):
            v = g.node(a)
            if pos in r.operands and v.op != "param" and not (
                    v.layout == "NCHW" and v.shape == n.shape):
                return None
        return "greedy" if any(a in free for a in n.args if a is not None) else None
    return None


def auto_nhwc(g: Graph, *, convert: bool = True, input_layout: str = "NCHW",
              output_layout: str = "NCHW") -> tuple[Graph, list[LogEntry]]:
    """Move every op with an NHWC twin to channels-last, wrapped in permute(0,2,3,1) on its
    layout operands and permute(0,3,1,2) on its result, and elementwise ops whose input comes
    out of such a permute with it. ``input_layout``/``output_layout`` "NHWC": the graph's 4-D
    inputs arrive, and its 4-D results leave, channels-last. ``convert=False`` changes only
    those."""
    b = _Builder(g, "auto_nhwc")
    consts: dict[int, int] = {}  # old constant -> its channels-last version
    free: set[int] = set()  # old values produced channels-last (their NHWC version is free)

    def to_nhwc(old: int) -> int:
        """A channels-last version of ``old``: a fresh permute of an activation (the naive
        wrapping, which cancel_transposes then cleans up), or a constant transposed once."""
        v = g.node(old)
        if v.op != "param":
            return b.add("permute", (b.new[old],), {"axes": NHWC}, _nhwc_shape(v.shape),
                         v.dtype, "NHWC")
        if old not in consts:  # reshaped to rank 4 and transposed, at optimize time
            shape4 = (1,) * (4 - len(v.shape)) + tuple(v.shape)
            t = tuple(v.attrs.get("transform", ()))
            if shape4 != tuple(v.shape):
                t += (("reshape", shape4),)
            consts[old] = b.add("param", (), {**v.attrs, "transform": t + (("permute", NHWC),)},
                                _nhwc_shape(shape4), v.dtype, None)
            b.note(f"constant %{old} transposed to NHWC once, at optimize time", (),
                   (consts[old],))
        return consts[old]

    for n in g.nodes:
        if n.op == "input" and input_layout == "NHWC" and n.layout == "NCHW":
            i = b.add("input", (), {**n.attrs, "layout": "NHWC"}, _nhwc_shape(n.shape),
                      n.dtype, "NHWC")
            back = b.add("permute", (i,), {"axes": NCHW}, n.shape, n.dtype, "NCHW")
            b.new[n.id] = back
            free.add(n.id)
            b.note(f"input %{n.id} arrives NHWC as %{i}", (n.id,), (i, back))
            continue
        why = _convertible(g, n, free) if convert else None
        if why is None:
            b.keep(n)
            continue
        r = rule(n.op)
        args, attrs = [], dict(n.attrs)
        for pos, a in enumerate(n.args):
            if a is None:
                args.append(None)
            elif pos in r.operands:
                args.append(to_nhwc(a))
            else:  # per-channel vectors, statistics, user-op weights
                args.append(b.new.get(a, a))
        if r.kind == "user":
            op = n.attrs["userop"]
            for i, w in enumerate(n.args[1:]):
                if op.weight_fn(i) is not None:
                    v = g.node(w)
                    args[1 + i] = b.add("param", (), {**v.attrs, "transform": tuple(
                        v.attrs.get("transform", ())) + (("user", op.name, i),),
                        "userop": op}, v.shape, v.dtype, None)
                    b.note(f"weight %{w} of {op.name} converted once by its weight_layout, at "
                           f"optimize time: %{args[1 + i]}", (w,), (args[1 + i],))
            attrs["impl"] = "NHWC"
        if "axis" in attrs:
            attrs["axis"] = NHWC.index(attrs["axis"])
        twin = b.add(n.op, args, attrs, _nhwc_shape(n.shape), n.dtype, "NHWC")
        back = b.add("permute", (twin,), {"axes": NCHW}, n.shape, n.dtype, "NCHW")
        b.new[n.id] = back
        free.add(n.id)
        what = "NHWC twin" if why == "twin" else "follows its input to NHWC"
        axis = f" (axis {n.attrs['axis']} -> {attrs['axis']})" if "axis" in n.attrs else ""
        name = n.attrs["userop"].name if n.op == "user" else n.op
        b.note(f"{name} %{n.id}: {what} %{twin}{axis}", (n.id,), (twin, back))
    outs = []
    for o in g.outputs:
        v = g.node(o)
        if output_layout == "NHWC" and v.layout == "NCHW" and len(v.shape) == 4:
            outs.append(to_nhwc(o))
            b.note(f"output %{o} leaves NHWC")
        else:
            outs.append(b.new.get(o, o))
    b.new.clear()  # outputs are mapped already
    return b.finish(tuple(outs))


def cancel_transposes(g: Graph) -> tuple[Graph, list[LogEntry]]:
    """Delete adjacent inverse permutes, merge chains of permutes into one, make a permute of a
    constant part of the constant (done once at optimize time), share duplicate permutes."""
    b = _Builder(g, "cancel_transposes")
    seen: dict[tuple, int] = {}  # (input, axes) -> the permute computing it
    for n in g.nodes:
        if n.op != "permute":
            b.keep(n)
            continue
        x = b.new.get(n.args[0], n.args[0])
        src = b.node(x)
        axes = n.attrs["axes"]
        ident = tuple(range(len(axes)))
        if src.op == "permute" and src.materialised:
            axes, x = compose(src.attrs["axes"], axes), src.args[0]
            src = b.node(x)
            if axes == ident:
                b.new[n.id] = x
                b.note(f"permute %{n.id} cancels permute %{n.args[0]}: reads %{x}", (n.id,))
                continue
        elif axes == ident:
            b.new[n.id] = x
            b.note(f"identity permute %{n.id} removed", (n.id,))
            continue
        if src.op == "param":
            nid = b.add("param", (), {**src.attrs, "transform": tuple(
                src.attrs.get("transform", ())) + (("permute", axes),)}, n.shape, n.dtype,
                n.layout)
            b.new[n.id] = nid
            b.note(f"permute %{n.id} of constant %{src.id} done once at optimize time",
                   (n.id,), (nid,))
            continue
        key = (x, axes)
        if key in seen:
            b.new[n.id] = seen[key]
            b.note(f"permute %{n.id} is a duplicate of %{seen[key]}", (n.id,))
            continue
        if x != n.args[0] or axes != n.attrs["axes"]:
            nid = b.add("permute", (x,), {"axes": axes}, n.shape, n.dtype, n.layout)
            b.new[n.id] = nid
            b.note(f"permute %{n.id} merged with the permute before it: %{nid} = "
                   f"permute(%{x}, {axes})", (n.id,), (nid,))
        else:
            b.keep(n)
            nid = n.id
        seen[key] = nid
    return b.finish(g.outputs)


def fuse_bn_activation(g: Graph) -> tuple[Graph, list[LogEntry]]:
    """batch_norm -> relu becomes ``batch_norm(relu=True)``; batch_norm -> add(., z) -> relu
    becomes ``batch_norm(addend=z, relu=True)``; only where the batch norm's result (and the
    sum) has no other reader and is not a graph output. The fused node can return its ReLU
    mask for a backward (``attrs["mask"]``)."""
    b = _Builder(g, "fuse_bn_activation")
    uses = g.consumers()
    outs = set(g.outputs)

    def single(i: int, reader: int) -> bool:
        return uses[i] == [reader] and i not in outs

    def plain_bn(i: int) -> bool:
        n = g.node(i)
        return n.op == "batch_norm" and not n.attrs["relu"] and n.args[5] is None

    plan: dict[int, tuple] = {}  # relu id -> (bn id, add id or None, addend)
    for r in g.nodes:
        if r.op != "relu":
            continue
        a = g.node(r.args[0])
        if plain_bn(a.id) and single(a.id, r.id):
            plan[r.id] = (a.id, None, None)
        elif (a.op == "add" and "scalar" not in a.attrs and single(a.id, r.id)
              and a.args[0] != a.args[1]):
            for i, j in ((0, 1), (1, 0)):
                bn, z = a.args[i], a.args[j]
                zn = g.node(z)
                if (plain_bn(bn) and single(bn, a.id) and zn.shape == g.node(bn).shape
                        and zn.dtype == g.node(bn).dtype and a.dtype == g.node(bn).dtype):
                    plan[r.id] = (bn, a.id, z)
                    break
    skip = {i for v in plan.values() for i in v[:2] if i is not None}
    for n in g.nodes:
        if n.id in skip:
            continue
        if n.id not in plan:
            b.keep(n)
            continue
        bn_id, add_id, z = plan[n.id]
        bn = g.node(bn_id)
        args = [None if a is None else b.new.get(a, a) for a in bn.args]
        if z is not None:
            args[5] = b.new.get(z, z)
        nid = b.add("batch_norm", args, {**bn.attrs, "relu": True, "mask": True}, bn.shape,
                    bn.dtype, bn.layout)
        b.new[n.id] = nid
        removed = (bn_id, n.id) if add_id is None else (bn_id, add_id, n.id)
        what = "batch_norm -> relu" if add_id is None else "batch_norm -> add -> relu"
        b.note(f"{what} (%{', %'.join(map(str, removed))}) fused into %{nid}", removed, (nid,))
    return b.finish(g.outputs)


def fold_transposes(g: Graph) -> tuple[Graph, list[LogEntry]]:
    """A materialised permute becomes a view (no kernel) when every reader reads strides
    (softmax, log_softmax, elementwise), or when its producer writes any strides and the
    permute is that producer's only reader (the producer then writes the permuted layout
    through ``out=``). Graph results stay with the permute kernel (coalesced on both sides,
    C order)."""
    b = _Builder(g, "fold_transposes")
    uses = g.consumers()
    outs = set(g.outputs)
    for n in g.nodes:
        if not n.materialised or n.id in outs:
            b.keep(n)
            continue
        readers = [g.node(c) for c in uses[n.id]]
        src = b.node(b.new.get(n.args[0], n.args[0]))
        if readers and all(rule(c.op).strided_in for c in readers):
            b.keep(n)
            b.set(n.with_(args=b.node(n.id).args, attrs={**n.attrs, "view": True}))
            b.note(f"permute %{n.id} is a view read by "
                   f"{', '.join(f'{c.op} %{c.id}' for c in readers)} (they read strides)")
        elif (rule(src.op).strided_out and uses[src.id] == [n.id] and src.id not in outs
              and "out_axes" not in src.attrs):
            b.set(src.with_(attrs={**src.attrs, "out_axes": n.attrs["axes"]}))
            b.keep(n)
            b.set(n.with_(args=b.node(n.id).args, attrs={**n.attrs, "view": True}))
            b.note(f"permute %{n.id} folded into the output strides of {src.op} %{src.id}")
        else:
            b.keep(n)
    return b.finish(g.outputs)


PASSES = {"auto_nhwc": auto_nhwc, "cancel_transposes": cancel_transposes,
          "fuse_bn_activation": fuse_bn_activation, "fold_transposes": fold_transposes}

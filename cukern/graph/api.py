"""What :func:`cukern.graph.trace` returns: a traced graph that prints, runs, optimises and
captures; and the optimisation pipeline with its log."""

from __future__ import annotations

import numpy as np

from . import passes as P
from .execute import Captured, Program, convert_param
from .ir import Graph, GraphError, LogEntry, flatten

__all__ = ["TracedGraph", "optimize_graph", "check_user_ops", "bytes_moved"]


def _rebuild(tree, leaves):
    if isinstance(tree, dict):
        return {k: _rebuild(v, leaves) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_rebuild(v, leaves) for v in tree)
    return leaves[tree]


def optimize_graph(g: Graph, layout: str = "NHWC", input_layout: str = "NCHW",
                   output_layout: str = "NCHW", fuse: bool = True, fold: bool = True):
    """The passes in order; returns (graph, [(pass, entries, permutes before, after)]).

    With ``layout="NHWC"``: auto_nhwc, cancel_transposes, then fuse_bn_activation and
    fold_transposes. ``layout="auto"``: the same, unless the result moves more bytes through
    permutes than the graph with only the input/output layouts changed (NCHW-only ops between
    channels-last ones): that graph is kept instead, and the log says so."""
    for name, v in (("layout", layout), ("input_layout", input_layout),
                    ("output_layout", output_layout)):
        if v not in ("NCHW", "NHWC") and not (name == "layout" and v == "auto"):
            raise ValueError(f"optimize: {name} must be 'NCHW' or 'NHWC', got {v!r}")

    def run(convert: bool):
        log = []
        cur = g
        steps = [("auto_nhwc", lambda h: P.auto_nhwc(h, convert=convert,
                                                     input_layout=input_layout,
                                                     output_layout=output_layout)),
                 ("cancel_transposes", P.cancel_transposes)]
        if fuse:
            steps.append(("fuse_bn_activation", P.fuse_bn_activation))
        if fold:
            steps.append(("fold_transposes", P.fold_transposes))
        for name, f in steps:
            before = cur.permute_count()
            cur, entries = f(cur)
            log.append((name, entries, before, cur.permute_count()))
        return cur, log

    out, log = run(layout != "NCHW")
    if layout == "auto":
        plain, plain_log = run(False)
        if _permute_bytes(plain) < _permute_bytes(out):
            note = LogEntry("optimize", f"NHWC needs {_permute_bytes(out)} bytes of permutes, "
                            f"NCHW {_permute_bytes(plain)}: the NCHW graph is kept")
            plain_log.append(("optimize", [note], out.permute_count(), plain.permute_count()))
            return plain, plain_log
    return out, log


def _permute_bytes(g: Graph) -> int:
    """Bytes moved by permutes, and by the two copies of a norm over a non-trailing axis."""
    off_axis = {n.id for n in g.nodes if n.op in ("layer_norm", "rms_norm")
                and n.attrs["axis"] != len(n.shape) - 1}
    return sum((2 if n.id in off_axis else 1) * 2 * int(np.prod(n.shape))
               * np.dtype(n.dtype).itemsize for n in g.nodes if n.materialised or n.id in off_axis)


def bytes_moved(g: Graph) -> int:
    """A model of the bytes a run moves: each op reads its activation operands once (a training
    batch norm reads x twice) and writes its result once; a fused ReLU mask is a bit an
    element; permutes move their array twice; a norm over a non-trailing axis adds two copies;
    views and parameters are free."""
    total = 0
    for n in g.nodes:
        if n.op in ("input", "param") or (n.op == "permute" and n.attrs.get("view")):
            continue
        size = int(np.prod(n.shape))
        item = np.dtype(n.dtype).itemsize
        reads = 0
        for i, a in enumerate(n.args):
            v = g.node(a) if a is not None else None
            if v is None or v.op == "param" or int(np.prod(v.shape)) != size:
                continue
            twice = n.op == "batch_norm" and i == 0 and n.attrs["training"]
            reads += (2 if twice else 1) * size * np.dtype(v.dtype).itemsize
        total += reads + size * item
        if n.op == "batch_norm" and n.attrs.get("mask"):
            total += -(-size // 8)
        if n.op in ("layer_norm", "rms_norm") and n.attrs["axis"] != len(n.shape) - 1:
            total += 4 * size * item
    return total


def check_user_ops(g: Graph, kind: str) -> None:
    """Run each registered op's implementation once on a zero batch of one (NumPy, or CuPy for
    a GPU graph) and check its result shape; GraphError naming the op otherwise."""
    if kind == "gpu":
        import cupy as xp
    else:
        xp = np
    for n in g.nodes:
        if n.op != "user":
            continue
        op = n.attrs["userop"]
        impl = op.nhwc if n.attrs["impl"] == "NHWC" else op.nchw
        args = []
        for i, a in enumerate(n.args):
            v = g.node(a)
            if v.op == "param" and "value" in v.attrs:
                w = convert_param(v, v.attrs["value"])
                args.append(w if isinstance(w, xp.ndarray) else xp.asarray(w))
            else:
                args.append(xp.zeros((1,) + v.shape[1:] if i == 0 else v.shape, v.dtype))
        want = (1,) + n.shape[1:]
        try:
            got = tuple(impl(*args).shape)
        except Exception as err:
            raise GraphError(f"registered op {op.name}: its {n.attrs['impl']} implementation "
                             f"failed on a zero input of shape {tuple(args[0].shape)}: "
                             f"{type(err).__name__}: {err}") from err
        if got != want:
            raise GraphError(f"registered op {op.name}: its {n.attrs['impl']} implementation "
                             f"returned shape {got} for an input of shape "
                             f"{tuple(args[0].shape)}, expected {want} (checked at optimize "
                             f"time on a zero batch of one)")


class TracedGraph:
    """A traced function as a graph: ``print(g)`` shows the IR, ``g(*args)`` runs it (the
    traced function's arguments, same structure), ``g.optimize(...)`` rewrites it,
    ``g.capture(*args)`` records it as a CUDA graph. Called with arrays of other shapes than
    traced, it traces again (once per shape) and applies the same optimisation."""

    def __init__(self, graph: Graph, fn=None, trace_kw: dict | None = None,
                 options: dict | None = None, log: list | None = None) -> None:
        self.graph = graph
        self.fn, self.trace_kw = fn, dict(trace_kw or {})
        self.options = options  # None: not optimised
        self.log = log or []
        self._programs: dict[tuple, Program] = {}
        self._others: dict[tuple, TracedGraph] = {}
        self.kind = "numpy" if any(n.attrs.get("kind") == "numpy" for n in graph.nodes
                                   if n.op == "input") else "gpu"
        self.signature = self._signature_of_graph()

    @classmethod
    def of(cls, g: Graph) -> TracedGraph:
        return cls(g)

    def __str__(self) -> str:
        return str(self.graph)

    __repr__ = __str__

    def _signature_of_graph(self) -> tuple:
        ins = sorted((n for n in self.graph.nodes if n.op == "input"),
                     key=lambda n: n.attrs["path"])
        return tuple((n.attrs["path"], n.shape, np.dtype(n.dtype).str, n.attrs["kind"])
                     for n in ins)

    def _signature(self, args) -> tuple:
        const = self.trace_kw.get("const_argnums")
        if const is None:
            const = tuple(i for i, a in enumerate(args) if isinstance(a, dict))
        sig = []
        for p, v in flatten(tuple(args)):
            if p[0] in const or not hasattr(v, "shape"):
                continue
            kind = "numpy" if isinstance(v, np.ndarray) else "gpu"
            sig.append((p, tuple(v.shape), np.dtype(v.dtype).str, kind))
        return tuple(sorted(sig, key=lambda s: s[0]))

    def _for(self, args) -> TracedGraph:
        """This graph, or the one traced for ``args``'s shapes."""
        sig = self._signature(args)
        if sig == self.signature:
            return self
        if self.options is not None and self.options["input_layout"] == "NHWC":
            raise GraphError(f"graph optimised for NHWC inputs {self.signature}, called with "
                             f"{sig}: trace and optimise again for new shapes")
        other = self._others.get(sig)
        if other is None:
            if self.fn is None:
                raise GraphError(f"graph traced for inputs {self.signature}, called with {sig}")
            from .trace import trace

            other = trace(self.fn, *args, **self.trace_kw)
            if self.options is not None:
                other = other.optimize(**self.options)
            self._others[sig] = other
        return other

    def program(self, kind: str | None = None) -> Program:
        kind = kind or self.kind
        p = self._programs.get(kind)
        if p is None:
            keep = bool(self.options and self.options.get("keep_stats"))
            p = self._programs[kind] = Program(self.graph, kind, keep)
        return p

    def __call__(self, *args):
        g = self._for(args)
        p = g.program()
        return _rebuild(g.graph.out_tree, p.outputs(p.run(args)))

    def capture(self, *args) -> Captured:
        """Run once and record the run as a CUDA graph (CuPy arrays only); see
        :class:`~cukern.graph.execute.Captured`. The capture's first run counts as a call
        (training batch norms update their running statistics)."""
        g = self._for(args)
        if g.kind != "gpu":
            raise GraphError("capture: needs CuPy arrays (a CUDA graph)")
        keep = bool(self.options and self.options.get("keep_stats"))
        return Captured(Program(g.graph, "gpu", keep),
                        args, lambda leaves: _rebuild(g.graph.out_tree, leaves))

    def optimize(self, layout: str = "NHWC", *, input_layout: str = "NCHW",
                 output_layout: str = "NCHW", fuse: bool = True, fold: bool = True,
                 keep_stats: bool = False, check: bool = True) -> TracedGraph:
        """The optimised graph (a new TracedGraph; this one is unchanged).

        Parameters
        ----------
        layout : "NHWC", "NCHW" or "auto"
            Where ops with a channels-last twin run ("NCHW": only fusion and folding; "auto":
            NHWC unless that moves more bytes through permutes than NCHW).
        input_layout, output_layout : "NCHW" or "NHWC"
            The layout the 4-D inputs arrive in and the 4-D results leave in (NHWC: shapes
            (N, H, W, C)).
        fuse, fold : bool
            Run fuse_bn_activation / fold_transposes.
        keep_stats : bool
            Fused batch norms return their (mean, invstd, ReLU mask) into ``.saved()`` each
            call (for a backward).
        check : bool
            Run each registered op's implementations once on a zero batch of one and check
            their result shapes (GraphError at optimize time).
        """
        g, log = optimize_graph(self.graph, layout, input_layout, output_layout, fuse, fold)
        if check:
            check_user_ops(g, self.kind)
        options = dict(layout=layout, input_layout=input_layout, output_layout=output_layout,
                       fuse=fuse, fold=fold, keep_stats=keep_stats, check=check)
        out = TracedGraph(g, self.fn, self.trace_kw, options, log)
        out.program()  # constants converted now, at optimize time
        return out

    def refresh_constants(self) -> None:
        """Forget the converted constants (after a weight was changed in place: conversions
        are cached by array identity)."""
        for p in self._programs.values():
            p.forget_constants()

    def saved(self) -> dict:
        """Fused batch norm id -> (mean, invstd, mask) of the latest plain call (keep_stats)."""
        return self.program().saved

    def permute_count(self) -> int:
        return self.graph.permute_count()

    def explain(self) -> str:
        """Each pass: what it rewrote and the permutes before and after; then the graph."""
        if self.options is None:
            return f"not optimised\n{self.graph}"
        o = self.options
        lines = [f"optimize {self.graph.name}: layout {o['layout']}, input "
                 f"{o['input_layout']}, output {o['output_layout']}"]
        for name, entries, before, after in self.log:
            lines.append(f"{name}: permutes {before} -> {after}, {len(entries)} rewrite"
                         f"{'s' if len(entries) != 1 else ''}")
            lines.extend(str(e) for e in entries)
        hidden = self.graph.copy_count()
        lines.append(f"final: {self.graph.permute_count()} permutes"
                     + (f", {hidden} norms over a non-trailing axis (copied)" if hidden else "")
                     + f"; bytes moved (model): {bytes_moved(self.graph)}")
        lines.append(str(self.graph))
        return "\n".join(lines)

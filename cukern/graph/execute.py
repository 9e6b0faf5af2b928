"""Running a graph: buffers planned once per input shape and reused as lifetimes end, on CuPy
(cukern's kernels) or NumPy (``cukern.reference``, float64), and CUDA-graph capture.

Ops that take ``out=`` (permute, the elementwise ops, softmax, log_softmax, batch_norm) write
into planned buffers: a buffer is handed to a later node once every reader of its value (and
of views of it) has run, never to a node reading it. Results are fresh arrays per call (or the
capture's own buffers on replay). The norms and user ops allocate their results themselves.
"""

from __future__ import annotations

import numpy as np

from .ir import Graph, GraphError, inverse, leaf_at

__all__ = ["Program", "Captured", "norm_along", "convert_param"]

OUT_OPS = {"permute", "relu", "add", "mul", "bias_add", "softmax", "log_softmax", "batch_norm"}
_RESULT = -1  # a node whose buffer is a graph result


def _cp():
    import cupy

    return cupy


def norm_along(op: str, x, weight, bias, axis: int, eps: float):
    """layer_norm / rms_norm of ``x`` along ``axis`` (C-order result of x's shape)."""
    nd = x.ndim
    axis %= nd
    perm = tuple(a for a in range(nd) if a != axis) + (axis,)
    if isinstance(x, np.ndarray):
        from .. import reference as ref

        xt = np.transpose(x, perm)
        y = (ref.layer_norm(xt, xt.shape[-1], weight, bias, eps, return_stats=False)
             if op == "layer_norm" else
             ref.rms_norm(xt, xt.shape[-1], weight, eps, return_stats=False))
        return np.ascontiguousarray(np.transpose(y, inverse(perm)))
    from ..ops.layer_norm import layer_norm, rms_norm
    from ..ops.permute import permute

    xt = x if axis == nd - 1 else x.transpose(perm)
    y = (layer_norm(xt, xt.shape[-1], weight, bias, eps, return_stats=False)
         if op == "layer_norm" else rms_norm(xt, xt.shape[-1], weight, eps, return_stats=False))
    return y if axis == nd - 1 else permute(y, inverse(perm))


def convert_param(node, value):
    """A constant after its optimize-time transforms (reshape, permute, a user op's
    weight_layout), C-contiguous."""
    xp = np if isinstance(value, np.ndarray) else _cp()
    for step in node.attrs.get("transform", ()):
        if step[0] == "reshape":
            value = value.reshape(step[1])
        elif step[0] == "permute":
            value = xp.ascontiguousarray(xp.transpose(value, step[1]))
        else:  # ("user", name, weight index)
            value = node.attrs["userop"].weight_fn(step[2])(value)
    return value


def _out_view(buf, n):
    axes = n.attrs.get("out_axes")
    return buf if axes is None else buf.transpose(inverse(axes))


def _storage(n) -> tuple:
    axes = n.attrs.get("out_axes")
    return n.shape if axes is None else tuple(n.shape[a] for a in axes)


class _Backend:
    """The array module and the out=-taking ops of one kind of array."""

    def __init__(self, gpu: bool) -> None:
        if gpu:
            from ..ops import softmax as sm
            from ..ops.batch_norm import batch_norm
            from ..ops.permute import permute

            self.xp, self.permute, self.batch_norm = _cp(), permute, batch_norm
            self.rowwise = {"softmax": sm.softmax, "log_softmax": sm.log_softmax}
        else:
            from .. import reference as ref

            self.xp, self.batch_norm = np, ref.batch_norm
            self.permute = lambda x, axes, out: _into(out, np.transpose(x, axes))
            self.rowwise = {op: (lambda f: lambda x, axis, out: _into(out, f(x, axis)))(
                getattr(ref, op)) for op in ("softmax", "log_softmax")}


def _into(out, v):
    out[...] = v
    return out


_BACKENDS: dict[bool, _Backend] = {}


def _run_node(n, a, out, gpu: bool, saved: dict):
    """The value of node ``n`` from its argument values ``a`` (None for absent ones), written
    into ``out`` where the op takes it."""
    op = n.op
    at = n.attrs
    be = _BACKENDS.get(gpu) or _BACKENDS.setdefault(gpu, _Backend(gpu))
    if op == "permute":
        return be.permute(a[0], at["axes"], out=out)
    if op == "relu":
        return be.xp.maximum(a[0], 0, out=out)
    if op in ("add", "mul"):
        f = be.xp.add if op == "add" else be.xp.multiply
        return f(a[0], at["scalar"] if "scalar" in at else a[1], out=out)
    if op == "bias_add":
        return be.xp.add(a[0], _bshape(a[1], len(n.shape), at["axis"]), out=out)
    if op in ("softmax", "log_softmax"):
        return be.rowwise[op](a[0], at["axis"], out=out)
    if op == "batch_norm":
        keep = at.get("mask", False) and saved is not None
        r = be.batch_norm(a[0], a[1], a[2], a[3], a[4], at["training"], at["momentum"],
                          at["eps"], axis=at["axis"], addend=a[5], relu=at["relu"], out=out,
                          return_stats=keep)
        if keep:
            saved[n.id] = r[1:]
            return r[0]
        return r
    if op in ("layer_norm", "rms_norm"):
        w, b = (a[1:] + [None, None])[:2]
        return norm_along(op, a[0], w, b, at["axis"], at["eps"])
    if op == "user":
        uo = at["userop"]
        impl = uo.nhwc if at["impl"] == "NHWC" else uo.nchw
        y = impl(*a)
        if tuple(y.shape) != n.shape:
            raise GraphError(f"registered op {uo.name}: its {at['impl']} implementation "
                             f"returned shape {tuple(y.shape)}, expected {n.shape}")
        return y
    raise GraphError(f"cannot run op {op!r}")


def _numpy_dtypes(g: Graph) -> dict[int, np.dtype]:
    """Each value's dtype on the NumPy path, as eager reference code gives it: the references
    return float64, permutes and elementwise ops follow their inputs, a user op is assumed to
    return its input's dtype."""
    dt: dict[int, np.dtype] = {}
    for n in g.nodes:
        if n.op in ("input", "param"):
            v = n.attrs.get("value")
            dt[n.id] = np.dtype(v.dtype if v is not None else n.dtype)
        elif n.op in ("permute", "relu", "user"):
            dt[n.id] = dt[n.args[0]]
        elif n.op in ("add", "mul", "bias_add"):
            dt[n.id] = np.result_type(*(dt[a] for a in n.inputs))
        else:
            dt[n.id] = np.dtype(np.float64)
    return dt


def _bshape(b, nd: int, axis: int):
    shape = [1] * nd
    shape[axis] = -1
    return b.reshape(shape)


class Program:
    """A graph planned for execution on one kind of array ("numpy" or "gpu")."""

    def __init__(self, graph: Graph, kind: str, keep_stats: bool = False) -> None:
        self.graph, self.kind = graph, kind
        self.gpu = kind == "gpu"
        self.keep_stats = keep_stats
        self.saved: dict[int, tuple] = {}  # batch norm id -> (mean, invstd, mask), last call
        self.allocations = 0
        self._buffers: list | None = None
        self._params: dict[int, tuple] = {}  # param id -> (source array, converted)
        self._plan()
        for n in graph.nodes:  # constants converted now, once
            if n.op == "param" and n.attrs.get("transform") and "value" in n.attrs:
                self._param(n, n.attrs["value"])

    def _plan(self) -> None:
        nodes = self.graph.nodes
        self.root = root = {}
        for n in nodes:
            view = n.op == "permute" and n.attrs.get("view")
            root[n.id] = root[n.args[0]] if view else n.id
        last: dict[int, int] = {}
        for i, n in enumerate(nodes):
            for a in n.inputs:
                last[root[a]] = i
        results = {root[o] for o in self.graph.outputs}
        ends: dict[int, list[int]] = {}
        for r, i in last.items():
            ends.setdefault(i, []).append(r)
        self.slots: list[tuple] = []  # (shape, dtype) of each reused buffer
        self.slot_of: dict[int, int] = {}
        free: dict[tuple, list[int]] = {}
        self.dtypes = ({n.id: np.dtype(n.dtype) for n in nodes} if self.gpu
                       else _numpy_dtypes(self.graph))
        for i, n in enumerate(nodes):
            if n.op in OUT_OPS and not (n.op == "permute" and n.attrs.get("view")):
                dt = self.dtypes[n.id]
                key = (_storage(n), dt.str)
                if n.id in results:
                    self.slot_of[n.id] = _RESULT
                else:
                    pool = free.setdefault(key, [])
                    self.slot_of[n.id] = pool.pop() if pool else len(self.slots)
                    if len(self.slots) == self.slot_of[n.id]:
                        self.slots.append((key[0], dt))
            done = ends.get(i, []) + ([n.id] if n.id not in last else [])
            for r in done:
                s = self.slot_of.get(r)
                if s is not None and s != _RESULT:
                    free.setdefault((self.slots[s][0], self.slots[s][1].str), []).append(s)
        self.steps = [(n, tuple(n.args), self.slot_of.get(n.id)) for n in nodes
                      if n.op not in ("input", "param")]
        self.sources = [n for n in nodes if n.op in ("input", "param")]

    def buffers(self) -> list:
        if self._buffers is None:
            xp = _cp() if self.gpu else np
            self._buffers = [xp.empty(s, dt) for s, dt in self.slots]
            self.allocations += len(self.slots)
        return self._buffers

    def forget_constants(self) -> None:
        self._params.clear()

    def _param(self, n, value):
        if not n.attrs.get("transform"):
            return value
        hit = self._params.get(n.id)
        if hit is not None and hit[0] is value:
            return hit[1]
        conv = convert_param(n, value)
        self._params[n.id] = (value, conv)
        return conv

    def sources_from(self, args) -> dict:
        vals = {}
        for n in self.sources:
            p = n.attrs.get("path")
            v = n.attrs["value"] if p is None else leaf_at(args, p)
            vals[n.id] = self._param(n, v) if n.op == "param" else v
        return vals

    def run(self, args, results: dict | None = None) -> dict:
        """Values of every node for ``args`` (the traced function's arguments); ``results``:
        buffers to write graph results into (the capture's), else fresh ones."""
        vals = self.sources_from(args)
        bufs = self.buffers()
        xp = _cp() if self.gpu else np
        saved = self.saved if self.keep_stats else None
        for n, argids, slot in self.steps:
            a = [None if i is None else vals[i] for i in argids]
            out = None
            if slot is not None:
                if slot == _RESULT:
                    buf = results.get(n.id) if results is not None else None
                    if buf is None:
                        buf = xp.empty(_storage(n), self.dtypes[n.id])
                else:
                    buf = bufs[slot]
                out = _out_view(buf, n)
            if n.op == "permute" and n.attrs.get("view"):
                vals[n.id] = a[0].transpose(n.attrs["axes"])
            else:
                vals[n.id] = _run_node(n, a, out, self.gpu, saved)
        return vals

    def outputs(self, vals: dict) -> list:
        return [vals[o] for o in self.graph.outputs]


class Captured:
    """A CUDA graph of one call: ``cap(*inputs)`` copies the inputs (the traced function's
    non-parameter arrays, in order) into the captured input buffers and launches the graph on
    the current stream; ``cap.launch()`` replays with what the input buffers hold. Results are
    the capture's own buffers, overwritten by each replay. Parameters are those given to
    :meth:`capture`, read (and running statistics updated) in place on every replay."""

    def __init__(self, program: Program, args, rebuild) -> None:
        cp = _cp()
        self.program = program  # its own: no other call shares its buffers
        self._rebuild = rebuild
        self.pool = cp.cuda.MemoryPool()  # private: nothing else reuses what the graph writes
        self.stream = cp.cuda.Stream(non_blocking=True)
        ins = [n for n in program.sources if n.op == "input"]
        given = [leaf_at(args, n.attrs["path"]) for n in ins]
        cp.cuda.get_current_stream().synchronize()  # the caller's arrays are ready
        with cp.cuda.using_allocator(self.pool.malloc), self.stream:
            self.inputs = [cp.empty(n.shape, n.dtype) for n in ins]
            self._copy_in(given)
            args = _replace(args, {n.attrs["path"]: b for n, b in zip(ins, self.inputs)})
            vals = program.run(args)  # warm-up: compiles, plans, fills the private pool
            self.warmup = rebuild(program.outputs(vals))
            results = {program.root[o]: vals[o] for o in program.graph.outputs}
            self.stream.synchronize()
            self.stream.begin_capture()
            try:
                self._vals = program.run(args, results)
            finally:
                self.graph = self.stream.end_capture()
            self.graph.upload(self.stream)
            self.stream.synchronize()
        self.results = program.outputs(self._vals)

    def _copy_in(self, xs) -> None:
        cp = _cp()
        if len(xs) != len(self.inputs):
            raise GraphError(f"captured graph: expected {len(self.inputs)} input arrays, got "
                             f"{len(xs)}")
        stream = cp.cuda.get_current_stream()
        for x, b in zip(xs, self.inputs):
            if x is b:
                continue
            if type(x) is not cp.ndarray or x.shape != b.shape or x.dtype != b.dtype:
                raise GraphError(f"captured graph: input of shape {getattr(x, 'shape', None)} "
                                 f"{getattr(x, 'dtype', type(x).__name__)}, captured for "
                                 f"{b.shape} {b.dtype} (capture again for new shapes)")
            if x.flags.c_contiguous:
                cp.cuda.runtime.memcpyAsync(b.data.ptr, x.data.ptr, b.nbytes, 3, stream.ptr)
            else:
                b[...] = x

    def __call__(self, *inputs):
        self._copy_in(inputs)
        self.graph.launch()
        return self._rebuild(self.results)

    def launch(self):
        """Replay on the current stream with the input buffers as they are."""
        self.graph.launch()
        return self._rebuild(self.results)


def _replace(args, by_path: dict):
    """``args`` with the leaves at ``by_path``'s paths replaced."""
    def walk(obj, path):
        if path in by_path:
            return by_path[path]
        if isinstance(obj, dict):
            return {k: walk(v, path + (k,)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v, path + (i,)) for i, v in enumerate(obj))
        return obj
    return walk(tuple(args), ())

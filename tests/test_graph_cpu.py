"""Layout graph on the CPU: tracing, printing, each pass on hand-built graphs, the example
blocks and random chains run through the NumPy (float64 reference) path against eager
reference execution, tracing errors, optimize-time shape checks, buffer reuse."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import cukern
from cukern import graph
from cukern.graph import examples as ex
from cukern.graph.execute import Program
from cukern.graph.ir import NCHW, NHWC, Graph, Node


def _x(rng, shape=(2, 8, 5, 6)):
    return rng.standard_normal(shape).astype(np.float32)


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               rtol=1e-10, atol=1e-10)


def _gone(before: Graph, after: Graph) -> set[int]:
    return {n.id for n in before.nodes} - {n.id for n in after.nodes}


def _run(g: Graph, *args):
    p = Program(g, "numpy")
    return p.outputs(p.run(args))


# ---- tracing and printing

def test_trace_records_without_running(rng):
    x, p = _x(rng), ex.resnet_params(8, rng, stat_dtype=np.float64)
    before = copy.deepcopy(p)
    g = graph.trace(ex.resnet_block, x, p)
    for k in p:  # training batch norm would have updated the running statistics
        np.testing.assert_array_equal(p[k], before[k])
    assert g.graph.ops() == ["batch_norm", "relu", "user", "batch_norm", "add", "relu",
                             "softmax"]
    text = str(g)
    assert "batch_norm(%0" in text and "softmax(" in text and "axis=1" in text
    assert "dwconv3x3(" in text and "p['rm1']" in text and "input x" in text
    assert "(2,8,5,6) float32 NCHW" in text


def test_cukern_names_restored_after_trace(rng):
    orig = cukern.softmax
    graph.trace(lambda x: cukern.softmax(x, axis=1), _x(rng))
    assert cukern.softmax is orig


def test_trace_names_bound_before_tracing(rng):
    from cukern import softmax  # noqa: F401  (bound in this module: swapped while tracing)

    g = graph.trace(_softmax_bound, _x(rng))
    assert g.graph.ops() == ["softmax"]


def _softmax_bound(x):
    from cukern import softmax

    return softmax(x, axis=1)


# ---- tracing errors name the line

def _branch(x):
    if cukern.softmax(x, axis=1):  # LINE-BRANCH
        return x
    return x


def _numpy_call(x):
    return np.tanh(cukern.softmax(x, axis=1))  # LINE-NUMPY


def _item(x):
    return float(cukern.softmax(x, axis=1))  # LINE-FLOAT


def _unregistered(x):
    def helper(a):
        return a - 1.0  # LINE-SUB
    return helper(graph.relu(x))


def _backward(x):
    return cukern.softmax_backward(x, x, axis=1)  # LINE-BACKWARD


def _index(x):
    return graph.relu(x)[0]  # LINE-INDEX


def _get(x):
    return graph.relu(x).get()  # LINE-GET


@pytest.mark.parametrize("fn, mark, what", [
    (_branch, "LINE-BRANCH", "bool()"), (_numpy_call, "LINE-NUMPY", "numpy.tanh"),
    (_item, "LINE-FLOAT", "float()"), (_unregistered, "LINE-SUB", "operator __sub__"),
    (_backward, "LINE-BACKWARD", "softmax_backward"), (_index, "LINE-INDEX", "indexing"),
    (_get, "LINE-GET", ".get()")])
def test_tracing_errors_name_the_line(rng, fn, mark, what):
    with pytest.raises(graph.TracingError) as err:
        graph.trace(fn, _x(rng))
    msg = str(err.value)
    assert what in msg and mark in msg and "test_graph_cpu.py:" in msg


def _cupy_call(x):
    import cupy

    return cupy.exp(graph.relu(x))  # LINE-CUPY


def test_cupy_function_on_traced_array(rng):
    pytest.importorskip("cupy")
    with pytest.raises(graph.TracingError, match="library function.*LINE-CUPY"):
        graph.trace(_cupy_call, _x(rng))


def test_layout_table_covers_registry():
    """Every forward op of the registry has a layout rule, or tracing refuses it."""
    from cukern import registry
    from cukern.graph.layout import LAYOUT
    from cukern.graph.trace import PATCHED, RECORDERS

    for name, spec in registry.OPS.items():
        traceable = name in RECORDERS
        assert traceable == (name in LAYOUT and not spec.is_backward and name != "batch_stats")
        assert name in PATCHED


def test_trace_refuses_non_traced_results(rng):
    with pytest.raises(graph.TracingError, match="returns int"):
        graph.trace(lambda x: 3, _x(rng))


# ---- passes on hand-built graphs

def _chain(*specs, shape=(2, 3, 4, 5)):
    """input -> specs (op, attrs, shape or None) -> output, each reading the previous."""
    nodes = [Node(0, "input", (), {"path": (0,), "kind": "numpy"}, shape, np.dtype("f4"),
                  "NCHW")]
    cur = shape
    for i, (op, attrs) in enumerate(specs, 1):
        if op == "permute":
            cur = tuple(cur[a] for a in attrs["axes"])
        nodes.append(Node(i, op, (i - 1,), attrs, cur, np.dtype("f4"), None))
    return Graph(nodes, (len(specs),), 0)


def test_cancel_inverse_pair_and_merge_chain(rng):
    g = _chain(("permute", {"axes": NHWC}), ("permute", {"axes": NCHW}), ("relu", {}))
    out, log = graph.cancel_transposes(g)
    assert out.permute_count() == 0 and out.ops() == ["relu"]
    assert _gone(g, out) <= {i for e in log for i in e.removed}
    g = _chain(("permute", {"axes": NHWC}), ("permute", {"axes": (0, 2, 1, 3)}), ("relu", {}))
    out, log = graph.cancel_transposes(g)
    assert out.permute_count() == 1
    x = _x(rng, (2, 3, 4, 5))
    _close(_run(out, x)[0], _run(g, x)[0])
    assert _gone(g, out) <= {i for e in log for i in e.removed}


def test_fold_into_strided_readers_and_out_strides(rng):
    x = _x(rng, (2, 3, 4, 5))
    g = _chain(("permute", {"axes": NHWC}), ("softmax", {"axis": 3}), ("relu", {}))
    out, log = graph.fold_transposes(g)
    assert g.permute_count() == 1 and out.permute_count() == 0 and log
    _close(_run(out, x)[0], _run(g, x)[0])
    # a permute after softmax folds into softmax's out= strides; the result stays C order
    g = _chain(("softmax", {"axis": 1}), ("permute", {"axes": NHWC}),
               ("layer_norm", {"axis": 3, "eps": 1e-5}))
    out, _ = graph.fold_transposes(g)
    assert out.permute_count() == 0 and out.node(1).attrs["out_axes"] == NHWC
    y = _run(out, x)[0]
    assert y.flags.c_contiguous
    _close(y, _run(g, x)[0])
    # a permute feeding a layer norm (which copies strided rows) or a result stays
    g = _chain(("permute", {"axes": NHWC}), ("layer_norm", {"axis": 3, "eps": 1e-5}))
    assert graph.fold_transposes(g)[0].permute_count() == 1
    # a permute producing a result stays (the permute kernel writes it in C order)
    g = _chain(("relu", {}), ("permute", {"axes": NHWC}))
    assert graph.fold_transposes(g)[0].permute_count() == 1
    g = _chain(("layer_norm", {"axis": 3, "eps": 1e-5}), ("permute", {"axes": NHWC}))
    assert graph.fold_transposes(g)[0].permute_count() == 1  # layer norm has no out=


def _bn_graph(x, p, extra_reader: bool):
    def fn(x, p):
        h = cukern.batch_norm(x, p["rm"], p["rv"], p["w"], p["b"], training=True)
        y = graph.relu(h + x)
        return (y, h) if extra_reader else y
    return fn


@pytest.mark.parametrize("extra", [False, True])
def test_fuse_bn_add_relu_only_without_other_readers(rng, extra):
    x = _x(rng)
    p = {"rm": np.zeros(8), "rv": np.ones(8), "w": rng.random(8) + 0.5,
         "b": rng.standard_normal(8)}
    fn = _bn_graph(x, p, extra)
    g = graph.trace(fn, x, p)
    out, log = graph.fuse_bn_activation(g.graph)
    fused = [n for n in out.nodes if n.op == "batch_norm" and n.attrs["relu"]]
    assert len(fused) == (0 if extra else 1)
    if not extra:
        assert fused[0].args[5] == 0 and out.ops() == ["batch_norm"]
        assert _gone(g.graph, out) <= {i for e in log for i in e.removed}
    pa, pb = copy.deepcopy(p), copy.deepcopy(p)
    want = graph.eager(fn, x, pa)
    got = g.optimize(layout="NCHW")(x, pb)
    for a, b in zip(want if extra else [want], got if extra else [got]):
        _close(a, b)
    _close(pa["rm"], pb["rm"])
    _close(pa["rv"], pb["rv"])


# ---- the example blocks

def test_resnet_block_permutes_and_values(rng, capsys):
    x = _x(rng)
    p = ex.resnet_params(8, rng, stat_dtype=np.float64)
    g = graph.trace(ex.resnet_block, x, p)
    assert g.permute_count() == 0
    opt = g.optimize(layout="NHWC")
    text = opt.explain()
    print(text)
    g2 = opt.graph
    perms = [n for n in g2.nodes if n.materialised]
    assert [n.attrs["axes"] for n in perms] == [NHWC, NCHW]  # one in, one out
    assert g2.node(perms[0].args[0]).op == "input" and g2.outputs == (perms[1].id,)
    assert sum(n.op == "batch_norm" and n.attrs["relu"] for n in g2.nodes) == 2
    assert "auto_nhwc: permutes 0 ->" in text and "final: 2 permutes" in text
    nhwc_out = g.optimize(layout="NHWC", output_layout="NHWC")
    assert [n.attrs["axes"] for n in nhwc_out.graph.nodes if n.materialised] == [NHWC]
    both = g.optimize(layout="NHWC", input_layout="NHWC", output_layout="NHWC")
    assert both.permute_count() == 0
    pa, pb, pc, pd = (copy.deepcopy(p) for _ in range(4))
    want = graph.eager(ex.resnet_block, x, pa)
    _close(opt(x, pb), want)
    _close(nhwc_out(x, pc), want.transpose(NHWC))
    _close(both(np.ascontiguousarray(x.transpose(NHWC)), pd), want.transpose(NHWC))
    for k in ("rm1", "rv1", "rm2", "rv2"):
        for q in (pb, pc, pd):
            _close(q[k], pa[k])
    print(f"permutes: eager 0, optimised {opt.permute_count()}, NHWC out "
          f"{nhwc_out.permute_count()}")


def test_convnext_block_layer_norm_contiguous(rng):
    x = _x(rng, (2, 8, 5, 6))
    p = ex.convnext_params(8, rng, dtype=np.float64)
    g = graph.trace(ex.convnext_block, x, p)
    assert g.graph.copy_count() == 1  # eager: layer norm over the channels of NCHW
    opt = g.optimize(layout="NHWC")
    ln = [n for n in opt.graph.nodes if n.op == "layer_norm"]
    assert len(ln) == 1 and ln[0].attrs["axis"] == 3 and opt.graph.copy_count() == 0
    src = opt.graph.node(ln[0].args[0])
    assert src.op == "user" and src.attrs["impl"] == "NHWC"  # a C-order NHWC result
    assert opt.permute_count() == 2
    _close(opt(x, p), graph.eager(ex.convnext_block, x, p))


def test_convnext_with_explicit_permutes(rng):
    def block(x, p):
        h = ex.dwconv3x3(x, p["k"])
        h = cukern.permute(h, (0, 2, 3, 1))
        h = cukern.layer_norm(h, h.shape[-1], p["ln_w"], p["ln_b"], return_stats=False)
        h = cukern.to_nchw(h)
        return ex.conv1x1(graph.relu(ex.conv1x1(h, p["w1"])), p["w2"]) + x
    x = _x(rng)
    p = ex.convnext_params(8, rng, dtype=np.float64)
    g = graph.trace(block, x, p)
    assert g.permute_count() == 2
    opt = g.optimize(layout="NHWC")
    assert opt.permute_count() == 2  # the block's own two cancel; one in, one out remain
    assert [n.attrs["axis"] for n in opt.graph.nodes if n.op == "layer_norm"] == [3]
    _close(opt(x, p), graph.eager(block, x, p))


def test_wrong_nhwc_shape_reported_at_optimize(rng):
    bad = graph.register(None, layouts={"NCHW": lambda x: x * 2,
                                        "NHWC": lambda x: x.transpose(0, 3, 1, 2) * 2},
                         name="bad_op")

    def fn(x):
        return cukern.softmax(bad(x), axis=1)
    x = _x(rng, (1, 3, 4, 5))
    g = graph.trace(fn, x)
    with pytest.raises(graph.GraphError, match="bad_op: its NHWC implementation returned "
                                                r"shape \(1, 3, 4, 5\)"):
        g.optimize(layout="NHWC")
    g.optimize(layout="NCHW")  # the NCHW implementation is right


def test_weights_converted_once(rng):
    calls = []

    def convert(k):
        calls.append(1)
        return np.ascontiguousarray(k[:, 0].transpose(1, 2, 0))
    op = graph.register(None, layouts={"NCHW": ex.dwconv_nchw, "NHWC": ex.dwconv_nhwc},
                        weight_layout=convert, name="dw_counted")

    def fn(x, p):
        return cukern.softmax(op(x, p["k"]), axis=1)
    x = _x(rng)
    p = {"k": rng.standard_normal((8, 1, 3, 3))}
    opt = graph.trace(fn, x, p).optimize(layout="NHWC", check=False)
    assert len(calls) == 1  # at optimize time
    for _ in range(3):
        y = opt(x, p)
    assert len(calls) == 1
    _close(y, graph.eager(fn, x, p))
    p2 = {"k": p["k"] * 2}  # a new weight array: converted once more
    _close(opt(x, p2), graph.eager(fn, x, p2))
    opt(x, p2)
    assert len(calls) == 2
    p2["k"] *= 0.5  # changed in place: refresh
    opt.refresh_constants()
    _close(opt(x, p2), graph.eager(fn, x, p2))
    assert len(calls) == 3


def test_register_validates():
    with pytest.raises(ValueError, match="layouts has keys"):
        graph.register(lambda x: x, layouts={"NCWH": abs})
    with pytest.raises(TypeError, match="NHWC implementation must be callable"):
        graph.register(lambda x: x, layouts={"NHWC": 3})
    with pytest.raises(ValueError, match="const_argnums has 3"):
        graph.trace(graph.relu, np.ones((2, 2)), const_argnums=(3,))
    with pytest.raises(ValueError, match="layout must be"):
        graph.optimize_graph(graph.trace(graph.relu, np.ones((2, 2))).graph, layout="NWHC")


def test_keep_stats_saves_mask(rng):
    x = _x(rng)
    p = ex.resnet_params(8, rng, stat_dtype=np.float64)
    opt = graph.trace(ex.resnet_block, x, p).optimize(keep_stats=True)
    opt(x, copy.deepcopy(p))
    saved = opt.saved()
    assert len(saved) == 2
    for nid, (mean, invstd, mask) in saved.items():
        n = opt.graph.node(nid)
        assert mean.shape == (8,) and invstd.shape == (8,)
        assert mask.dtype == np.int32 and mask.size == -(-int(np.prod(n.shape)) // 32)


# ---- execution: buffers, shapes

def relu_chain(k: int, scale: float):
    """``k`` times relu(h * scale): 2k elementwise ops."""
    def fn(x):
        h = x
        for _ in range(k):
            h = graph.relu(h * scale)
        return h
    return fn


def test_buffers_planned_once_and_reused(rng):
    fn = relu_chain(6, 1.5)
    x = _x(rng).astype(np.float64)
    g = graph.trace(fn, x)
    p = g.program()
    assert len(p.slots) == 2  # ping-pong between two buffers for 11 intermediates
    y1 = g(x)
    first = list(p.buffers())
    y2 = g(x * 2)
    assert p.allocations == 2 and all(a is b for a, b in zip(first, p.buffers()))
    _close(y1, np.maximum(x, 0) * 1.5 ** 6)
    _close(y2, 2 * y1)
    assert y1 is not y2  # results are fresh arrays


def test_new_shape_traces_again(rng):
    g = graph.trace(lambda x: cukern.softmax(graph.relu(x), axis=1), _x(rng))
    opt = g.optimize()
    x = _x(rng, (3, 4, 2, 2))
    _close(opt(x), cukern.reference.softmax(np.maximum(x, 0), axis=1))


# ---- random chains

def _random_chain(rng, c: int):
    """A chain of 3-12 steps over every op kind; returns fn(x, p) and its parameters."""
    kinds = ["bn_train", "bn_eval", "relu", "add_prev", "add_const", "mul_scalar", "bias_add",
             "softmax1", "log_softmax1", "softmax_last", "ln_channels", "rms_channels",
             "ln_last", "permute_pair", "user_nhwc", "user_nchw_only", "add_relu"]
    steps = [kinds[i] for i in rng.integers(0, len(kinds), int(rng.integers(3, 13)))]
    p = {}
    for i, _k in enumerate(steps):
        p[f"rm{i}"], p[f"rv{i}"] = rng.uniform(-.1, .1, c), rng.uniform(.5, 1.5, c)
        p[f"w{i}"], p[f"b{i}"] = rng.uniform(.5, 1.5, c), rng.uniform(-.5, .5, c)
        p[f"k{i}"] = rng.standard_normal((c, 1, 3, 3)) / 3
        p[f"c{i}"] = rng.standard_normal((c, 1, 1))

    def fn(x, p):
        vals = [x]
        h = x
        for i, k in enumerate(steps):
            if k in ("bn_train", "bn_eval"):
                h = cukern.batch_norm(h, p[f"rm{i}"], p[f"rv{i}"], p[f"w{i}"], p[f"b{i}"],
                                      training=k == "bn_train")
            elif k == "relu":
                h = graph.relu(h)
            elif k == "add_prev":
                h = h + vals[len(vals) // 2]
            elif k == "add_const":
                h = h + p[f"c{i}"]
            elif k == "mul_scalar":
                h = h * 0.75
            elif k == "bias_add":
                h = graph.bias_add(h, p[f"b{i}"])
            elif k in ("softmax1", "log_softmax1"):
                h = getattr(cukern, k[:-1])(h, axis=1)
            elif k == "softmax_last":
                h = cukern.softmax(h)
            elif k == "ln_channels":
                h = graph.layer_norm(h, p[f"w{i}"], p[f"b{i}"], axis=1)
            elif k == "rms_channels":
                h = graph.rms_norm(h, p[f"w{i}"], axis=1)
            elif k == "ln_last":
                h = cukern.layer_norm(h, h.shape[-1], return_stats=False)
            elif k == "permute_pair":
                h = cukern.to_nchw(cukern.softmax(cukern.to_nhwc(h), axis=-1))
            elif k == "user_nhwc":
                h = ex.dwconv3x3(h, p[f"k{i}"])
            elif k == "user_nchw_only":
                h = _nchw_only(h)
            else:
                h = cukern.batch_norm(h, p[f"rm{i}"], p[f"rv{i}"], p[f"w{i}"], p[f"b{i}"],
                                      training=True)
                h = graph.relu(h + vals[-1])
            vals.append(h)
        return h
    return fn, p, steps


_nchw_only = graph.register(None, layouts={"NCHW": lambda x: x[:, ::-1] * 0.5},
                            name="flip_channels")


@pytest.mark.parametrize("seed", range(24))
@pytest.mark.parametrize("layout", ["NHWC", "auto"])
def test_random_chains(seed, layout):
    rng = np.random.default_rng(seed)
    fn, p, steps = _random_chain(rng, 6)
    x = rng.standard_normal((2, 6, 4, 5)).astype(np.float32)
    g = graph.trace(fn, x, p)
    opt = g.optimize(layout=layout)
    # every pass's log names every node it removed
    cur = g.graph
    for f in (graph.auto_nhwc, graph.cancel_transposes, graph.fuse_bn_activation,
              graph.fold_transposes):
        out, log = f(cur)
        assert _gone(cur, out) <= {i for e in log for i in e.removed}, (f.__name__, steps)
        cur = out
    naive = opt.log[0][3]  # after auto_nhwc: every twin wrapped
    assert opt.permute_count() <= max(naive, g.permute_count()), steps
    if layout == "auto":
        assert opt.permute_count() <= g.permute_count() or _bytes(opt) <= _bytes(g)
    pa, pb = copy.deepcopy(p), copy.deepcopy(p)
    want = graph.eager(fn, x, pa)
    _close(opt(x, pb), want)
    for k in p:
        _close(pa[k], pb[k])


def _bytes(g) -> int:
    return graph.api._permute_bytes(g.graph)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("io", ["out", "in_out"])
def test_random_chain_nhwc_io(seed, io):
    r = np.random.default_rng(100 + seed)
    fn, p, steps = _random_chain(r, 6)
    x = r.standard_normal((2, 6, 4, 5)).astype(np.float32)
    opt = graph.trace(fn, x, p).optimize(
        layout="NHWC", output_layout="NHWC", input_layout="NHWC" if io == "in_out" else "NCHW")
    pa, pb = copy.deepcopy(p), copy.deepcopy(p)
    xin = np.ascontiguousarray(x.transpose(NHWC)) if io == "in_out" else x
    _close(opt(xin, pb), graph.eager(fn, x, pa).transpose(NHWC))

"""Layout graph on the GPU: optimised graphs against eager cukern calls and float64 NumPy (the
ResNet- and ConvNeXt-style blocks in float16 and float32, random chains in float32), running
statistics, buffers reused (and poisoned between calls), CUDA-graph capture and replay with
changing inputs."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from cukern import graph
from cukern.graph import examples as ex
from cukern.graph.ir import NHWC

from .test_graph_cpu import _random_chain, relu_chain

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

# relative L2 error of a whole block's result (several roundings in a row)
BLOCK_TOL = {"float16": 1e-2, "float32": 2e-5}
STAT_RTOL = {"float16": 2e-3, "float32": 1e-5}


def _rel(a, b) -> float:
    a = cp.asnumpy(a).astype(np.float64) if not isinstance(a, np.ndarray) else a
    b = cp.asnumpy(b).astype(np.float64) if not isinstance(b, np.ndarray) else b
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _to_gpu(p: dict, dtype=None) -> dict:
    return {k: cp.asarray(v if dtype is None else v.astype(dtype)) for k, v in p.items()}


def _host64(p: dict) -> dict:
    return {k: cp.asnumpy(v).astype(np.float64) for k, v in p.items()}


def _check_stats(pa: dict, pb: dict, dtype: str, keys) -> None:
    for k in keys:
        np.testing.assert_allclose(cp.asnumpy(pb[k]), cp.asnumpy(pa[k]),
                                   rtol=STAT_RTOL[dtype], atol=STAT_RTOL[dtype])


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("out_layout", ["NCHW", "NHWC"])
def test_resnet_block(rng, dtype, out_layout):
    shape = (4, 32, 9, 11)
    x = cp.asarray(rng.standard_normal(shape).astype(dtype))
    p = ex.resnet_params(32, rng, cp)
    pa, pb = copy.deepcopy(p), copy.deepcopy(p)
    ref = graph.eager(ex.resnet_block, cp.asnumpy(x).astype(np.float64), _host64(p))
    want = graph.eager(ex.resnet_block, x, pa)
    opt = graph.trace(ex.resnet_block, x, p).optimize(layout="NHWC", output_layout=out_layout)
    assert opt.permute_count() == (2 if out_layout == "NCHW" else 1)
    got = opt(x, pb)
    assert got.dtype == x.dtype and got.flags.c_contiguous
    if out_layout == "NHWC":
        got = got.transpose(0, 3, 1, 2)
    assert _rel(got, ref) <= BLOCK_TOL[dtype]
    assert _rel(got, want) <= BLOCK_TOL[dtype]
    _check_stats(pa, pb, dtype, ("rm1", "rv1", "rm2", "rv2"))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_convnext_block(rng, dtype):
    x = cp.asarray(rng.standard_normal((2, 16, 7, 9)).astype(dtype))
    p = ex.convnext_params(16, rng, cp, dtype=np.dtype(dtype))
    ref = graph.eager(ex.convnext_block, cp.asnumpy(x).astype(np.float64), _host64(p))
    want = graph.eager(ex.convnext_block, x, p)
    opt = graph.trace(ex.convnext_block, x, p).optimize(layout="NHWC")
    ln = [n for n in opt.graph.nodes if n.op == "layer_norm"]
    assert [n.attrs["axis"] for n in ln] == [3] and opt.graph.copy_count() == 0
    got = opt(x, p)
    assert _rel(got, ref) <= BLOCK_TOL[dtype] and _rel(got, want) <= BLOCK_TOL[dtype]


@pytest.mark.parametrize("seed", range(8))
def test_random_chains(seed):
    r = np.random.default_rng(seed)
    fn, p, steps = _random_chain(r, 6)
    x = cp.asarray(r.standard_normal((2, 6, 4, 5)).astype(np.float32))
    pa, pb = _to_gpu(p, np.float32), _to_gpu(p, np.float32)
    want = graph.eager(fn, x, pa)
    ref = graph.eager(fn, cp.asnumpy(x).astype(np.float64), copy.deepcopy(p))
    got = graph.trace(fn, x, _to_gpu(p, np.float32)).optimize(layout="NHWC")(x, pb)
    assert _rel(got, want) <= BLOCK_TOL["float32"] * 10, steps
    assert _rel(got, ref) <= BLOCK_TOL["float32"] * 10, steps
    _check_stats(pa, pb, "float32", [k for k in p if k[:2] in ("rm", "rv")])


def test_buffers_reused_and_poison_proof(rng):
    x = cp.asarray(rng.standard_normal((4, 32, 9, 11)).astype(np.float32))
    p = ex.resnet_params(32, rng, cp)
    opt = graph.trace(ex.resnet_block, x, p).optimize(layout="NHWC")
    y1 = opt(x, copy.deepcopy(p))
    prog = opt.program()
    bufs = list(prog.buffers())
    n = prog.allocations
    assert n == len(prog.slots) and n >= 1
    for b in bufs:
        b.fill(np.nan)  # stale data must never be read
    y2 = opt(x, copy.deepcopy(p))
    assert prog.allocations == n and all(a is b for a, b in zip(bufs, prog.buffers()))
    assert y1 is not y2 and y1.data.ptr != y2.data.ptr
    cp.testing.assert_allclose(y1, y2, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_capture_replay(rng, dtype):
    shape = (4, 32, 9, 11)
    xs = [cp.asarray(rng.standard_normal(shape).astype(dtype)) for _ in range(4)]
    p = ex.resnet_params(32, rng, cp)
    pa, pb = copy.deepcopy(p), copy.deepcopy(p)
    opt = graph.trace(ex.resnet_block, xs[0], p).optimize(layout="NHWC")
    cap = opt.capture(xs[0], pb)  # runs once
    want = graph.eager(ex.resnet_block, xs[0], pa)
    assert _rel(cap.warmup, want) <= BLOCK_TOL[dtype]
    for x in xs[1:3]:  # replays see new inputs and the updated running statistics
        want = graph.eager(ex.resnet_block, x, pa)
        got = cap(x)
        assert _rel(got, want) <= BLOCK_TOL[dtype]
    cap.inputs[0][...] = xs[3]
    want = graph.eager(ex.resnet_block, xs[3], pa)
    assert _rel(cap.launch(), want) <= BLOCK_TOL[dtype]
    cp.cuda.get_current_stream().synchronize()
    _check_stats(pa, pb, dtype, ("rm1", "rv1", "rm2", "rv2"))
    with pytest.raises(graph.GraphError, match="capture again"):
        cap(xs[0][:2])


def test_capture_ten_op_chain(rng):
    chain = relu_chain(5, 0.9)
    x = cp.asarray(rng.standard_normal((2, 3, 4, 5)).astype(np.float32))
    cap = graph.trace(chain, x).optimize().capture(x)
    x2 = cp.asarray(rng.standard_normal((2, 3, 4, 5)).astype(np.float32))
    cp.testing.assert_allclose(cap(x2), cp.maximum(x2, 0) * 0.9 ** 5, rtol=1e-6)


def test_nhwc_input(rng):
    x = cp.asarray(rng.standard_normal((4, 32, 9, 11)).astype(np.float32))
    p = ex.resnet_params(32, rng, cp)
    pa, pb = copy.deepcopy(p), copy.deepcopy(p)
    opt = graph.trace(ex.resnet_block, x, p).optimize(input_layout="NHWC",
                                                       output_layout="NHWC")
    assert opt.permute_count() == 0
    got = opt(cp.ascontiguousarray(x.transpose(NHWC)), pb)
    want = graph.eager(ex.resnet_block, x, pa)
    assert _rel(got.transpose(0, 3, 1, 2), want) <= BLOCK_TOL["float32"]


def _cupy_exp(x):
    return cp.exp(graph.relu(x))  # LINE-CUPY-GPU


def test_errors_on_gpu_arrays(rng):
    x = cp.asarray(rng.standard_normal((1, 3, 4, 5)).astype(np.float32))
    with pytest.raises(graph.TracingError, match="LINE-CUPY-GPU"):
        graph.trace(_cupy_exp, x)
    bad = graph.register(None, layouts={"NCHW": lambda x: x * 2,
                                        "NHWC": lambda x: x[:, :, :, :1] * 2},
                         name="bad_gpu_op")
    g = graph.trace(lambda x: bad(x), x)
    with pytest.raises(graph.GraphError, match=r"bad_gpu_op: its NHWC implementation returned "
                                                r"shape \(1, 4, 5, 1\)"):
        g.optimize(layout="NHWC")

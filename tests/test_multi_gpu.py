"""Device placement on a machine with two GPUs: every public op, forward and backward, with its
arrays on GPU 1 while GPU 0 is current and on GPU 0 while GPU 1 is current, as CuPy arrays,
as PyTorch tensors through cukern's functions, and through cukern.torch's autograd ops.

Each call must leave its results on the arrays' GPU, leave the current device as it was, and
give what the same call gives on GPU 0 with GPU 0 current. The shapes include plans that
need the large dynamic shared memory opt-in (float32 rows of 20000 values: over 48 KiB) and
clusters (float16 rows of 262144 values: clusters of 8 and, in the backward, 16, which needs
the non-portable cluster opt-in): a kernel compiled, configured or launched on the wrong GPU
fails to launch there or writes nothing. Arrays on two GPUs in one call are refused with a
ValueError naming both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

import cukern
from cukern.ops import batch_norm as bn_mod
from cukern.ops import layer_norm as ln_mod
from cukern.ops import permute as pm_mod
from cukern.ops import softmax as sm_mod

from .conftest import TOL

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def _gpus() -> int:
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # no driver: the gpu marker skips these anyway
        return 0


N_GPUS = _gpus()
needs_two = pytest.mark.skipif(N_GPUS < 2, reason=f"needs 2 GPUs (cupy sees {N_GPUS})")
# (the arrays' GPU, the current GPU during the call)
DIRECTIONS = [pytest.param(1, 0, id="data1-current0"), pytest.param(0, 1, id="data0-current1")]
SMEM_48K = 48 * 1024


@dataclass
class Case:
    name: str
    dtype: str
    make: Callable  # rng -> dict of host arrays
    call: Callable  # dict of device arrays -> tuple of result arrays
    check_plan: Callable | None = None  # () -> None, asserts on the plan just used


def _rand(rng, shape, dtype, shift=0.0):
    return (rng.standard_normal(shape) + shift).astype(dtype)


def _rows(dtype, rows, cols, names=("x",)):
    return lambda rng: {n: _rand(rng, (rows, cols), dtype) for n in names}


def _smem_plan(op):
    def check():
        plan = sm_mod.last_plan(op)
        assert plan.smem_bytes > SMEM_48K and plan.cluster == 1, plan
    return check


def _cluster_plan(op):
    def check():
        plan = sm_mod.last_plan(op)
        assert plan.cluster > 1, plan
    return check


def _optin_plan(op):
    """A norm plan that needs an opt-in: over 48 KiB of shared memory, or clusters."""
    def check():
        plan = ln_mod.last_plan(op)
        assert plan.smem_bytes > SMEM_48K or plan.cluster > 1, plan
    return check


def _norm_make(dtype, rows, cols):
    def make(rng):
        return {"x": _rand(rng, (rows, cols), dtype), "dy": _rand(rng, (rows, cols), dtype),
                "w": _rand(rng, (cols,), dtype, 1.0), "b": _rand(rng, (cols,), dtype)}
    return make


def _ln_bwd(a):
    cols = a["x"].shape[-1]
    _, mean, rstd = cukern.layer_norm(a["x"], cols, a["w"], a["b"], return_stats=True)
    return cukern.layer_norm_backward(a["dy"], a["x"], mean, rstd, a["w"])


def _rms_bwd(a):
    cols = a["x"].shape[-1]
    _, rstd = cukern.rms_norm(a["x"], cols, a["w"], return_stats=True)
    return cukern.rms_norm_backward(a["dy"], a["x"], rstd, a["w"])


def _bn_make(dtype):
    def make(rng):
        shape = (16, 8, 32, 32)
        return {"x": _rand(rng, shape, dtype), "dy": _rand(rng, shape, dtype),
                "rm": np.zeros(8, np.float32), "rv": np.ones(8, np.float32),
                "w": _rand(rng, (8,), np.float32, 1.0), "b": _rand(rng, (8,), np.float32)}
    return make


def _bn_bwd(a):
    _, mean, invstd, _ = cukern.batch_norm(a["x"], None, None, a["w"], a["b"], training=True,
                                           return_stats=True)
    return cukern.batch_norm_backward(a["dy"], a["x"], mean, invstd, a["w"])


def _nchw(rng):
    return {"x": _rand(rng, (4, 16, 24, 40), np.float32)}


CASES = [
    Case("softmax-smem", "float32", _rows(np.float32, 64, 20000),
         lambda a: (cukern.softmax(a["x"]),), _smem_plan("softmax")),
    Case("log_softmax-smem", "float32", _rows(np.float32, 64, 20000),
         lambda a: (cukern.log_softmax(a["x"]),), _smem_plan("log_softmax")),
    Case("softmax-cluster", "float16", _rows(np.float16, 8, 262144),
         lambda a: (cukern.softmax(a["x"]),), _cluster_plan("softmax")),
    Case("softmax-axis0", "float32", _rows(np.float32, 300, 40),
         lambda a: (cukern.softmax(a["x"], axis=0),)),
    Case("softmax_backward-smem", "float32", _rows(np.float32, 64, 20000, ("y", "dy")),
         lambda a: (cukern.softmax_backward(y=a["y"], dy=a["dy"]),),
         _smem_plan("softmax_backward")),
    Case("log_softmax_backward-cluster", "float16", _rows(np.float16, 8, 262144, ("y", "dy")),
         lambda a: (cukern.log_softmax_backward(y=a["y"], dy=a["dy"]),),
         _cluster_plan("log_softmax_backward")),
    Case("layer_norm-smem", "float32", _norm_make(np.float32, 64, 20000),
         lambda a: cukern.layer_norm(a["x"], 20000, a["w"], a["b"], return_stats=True),
         _optin_plan("layer_norm")),
    Case("layer_norm_backward-optin", "float32", _norm_make(np.float32, 64, 20000), _ln_bwd,
         _optin_plan("layer_norm_backward")),
    Case("rms_norm-optin", "float16", _norm_make(np.float16, 8, 262144),
         lambda a: cukern.rms_norm(a["x"], 262144, a["w"], return_stats=True),
         _optin_plan("rms_norm")),
    Case("rms_norm_backward-optin", "float16", _norm_make(np.float16, 8, 262144), _rms_bwd,
         _optin_plan("rms_norm_backward")),
    Case("layer_norm_backward-small", "float32", _norm_make(np.float32, 512, 768), _ln_bwd),
    Case("batch_norm-train", "float16", _bn_make(np.float16),
         lambda a: cukern.batch_norm(a["x"], a["rm"], a["rv"], a["w"], a["b"], training=True,
                                     return_stats=True)[:3] + (a["rm"], a["rv"])),
    Case("batch_norm-eval-relu", "float32", _bn_make(np.float32),
         lambda a: (cukern.batch_norm(a["x"], a["rm"], a["rv"], a["w"], a["b"], relu=True),)),
    Case("batch_norm_backward", "float32", _bn_make(np.float32), _bn_bwd),
    Case("batch_stats", "float32", _bn_make(np.float32), lambda a: cukern.batch_stats(a["x"])),
    Case("permute", "float32", _nchw, lambda a: (cukern.permute(a["x"], (3, 1, 0, 2)),)),
    Case("to_nhwc", "float32", _nchw, lambda a: (cukern.to_nhwc(a["x"]),)),
    Case("to_nchw", "float32", _nchw, lambda a: (cukern.to_nchw(a["x"]),)),
]
CASE_PARAMS = [pytest.param(c, id=c.name) for c in CASES]


def _close(got: np.ndarray, want: np.ndarray, dtype: str, what: str) -> None:
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.array_equal(np.isnan(got64), np.isnan(want64)), f"{what}: NaN pattern differs"
    den = np.linalg.norm(np.nan_to_num(want64).ravel()) or 1.0
    err = np.linalg.norm(np.nan_to_num(got64 - want64).ravel()) / den
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} against GPU 0's result"


def _forget_plans() -> None:
    """Empty the ops' launch caches, so that the next call plans, and configures its kernels,
    with the other GPU current (compiled kernels stay cached per device)."""
    for mod in (sm_mod, ln_mod, bn_mod, pm_mod):
        mod._launches.clear()
        mod._fresh.clear()


def _on_gpu0(case: Case, host: dict) -> list[np.ndarray]:
    """The call on GPU 0 with GPU 0 current, as host arrays."""
    with cp.cuda.Device(0):
        res = case.call({k: cp.asarray(v) for k, v in host.items()})
        return [cp.asnumpy(r) for r in res if r is not None]


@needs_two
class TestCupyPlacement:
    @pytest.mark.parametrize("data_dev,cur_dev", DIRECTIONS)
    @pytest.mark.parametrize("case", CASE_PARAMS)
    def test_op(self, case, data_dev, cur_dev, rng):
        host = case.make(rng)
        want = _on_gpu0(case, host)
        with cp.cuda.Device(data_dev):
            arrays = {k: cp.asarray(v) for k, v in host.items()}
        _forget_plans()
        with cp.cuda.Device(cur_dev):
            res = [r for r in case.call(arrays) if r is not None]
            assert cp.cuda.runtime.getDevice() == cur_dev, "the call changed the current device"
            if case.check_plan is not None:
                case.check_plan()
        assert len(res) == len(want)
        for i, (r, w) in enumerate(zip(res, want)):
            assert r.device.id == data_dev, f"result {i} on GPU {r.device.id}"
            with r.device:
                got = cp.asnumpy(r)
            _close(got, w, case.dtype, f"{case.name} result {i}")

    @pytest.mark.parametrize("data_dev,cur_dev", DIRECTIONS)
    def test_out_on_the_input_gpu(self, data_dev, cur_dev, rng):
        """out= on the input's GPU (softmax, batch norm, permute) while the other is current."""
        x_h = _rand(rng, (64, 20000), np.float32)
        with cp.cuda.Device(0):
            want = cp.asnumpy(cukern.softmax(cp.asarray(x_h)))
        with cp.cuda.Device(data_dev):
            x = cp.asarray(x_h)
            out = cp.full(x.shape, np.nan, np.float32)
            xt = cp.asarray(_rand(rng, (4, 8, 6, 5), np.float32))
            pout = cp.full((4, 6, 5, 8), np.nan, np.float32)
        with cp.cuda.Device(cur_dev):
            assert cukern.softmax(x, out=out) is out
            assert cukern.to_nhwc(xt, out=pout) is pout
            assert cp.cuda.runtime.getDevice() == cur_dev
        with out.device:
            _close(cp.asnumpy(out), want, "float32", "softmax out=")
            np.testing.assert_array_equal(cp.asnumpy(pout),
                                          np.transpose(cp.asnumpy(xt), (0, 2, 3, 1)))

    @pytest.mark.parametrize("op,dtype,cols", [("softmax", np.float32, 20000),
                                               ("softmax_backward", np.float16, 262144)])
    def test_explain_for_the_other_gpu(self, op, dtype, cols):
        """explain(device=1) with GPU 0 current asks GPU 1's driver about GPU 1's kernels."""
        for cur in (1, 0):
            _forget_plans()
            with cp.cuda.Device(cur):
                text = str(cukern.explain(op, (64, cols), dtype, device=1))
                assert cp.cuda.runtime.getDevice() == cur
            if cur == 1:
                want = text
        assert text == want

    def test_mixed_devices_are_refused(self, rng):
        with cp.cuda.Device(0):
            x0 = cp.asarray(_rand(rng, (16, 64), np.float32))
            w0 = cp.ones(64, np.float32)
            v0 = cp.ones(4, np.float32)
            b0 = cp.asarray(_rand(rng, (2, 4, 6, 8), np.float32))
        with cp.cuda.Device(1):
            x1 = cp.asarray(_rand(rng, (16, 64), np.float32))
            w1 = cp.ones(64, np.float32)
            v1 = cp.ones(4, np.float32)
            b1 = cp.asarray(_rand(rng, (2, 4, 6, 8), np.float32))
            o1 = cp.empty((2, 6, 8, 4), np.float32)
        _, mean1, rstd1 = _on(1, lambda: cukern.layer_norm(x1, 64, w1, return_stats=True))
        _, m1, s1, _ = _on(1, lambda: cukern.batch_norm(b1, None, None, training=True,
                                                        return_stats=True))
        o0, mean0, s0 = _on(0, lambda: cp.empty((16, 64), np.float32)), _to(0, mean1), _to(0, s1)
        calls = {
            "out": lambda: cukern.softmax(x1, out=o0),
            "dy": lambda: cukern.softmax_backward(y=x1, dy=x0),
            "weight": lambda: cukern.layer_norm(x1, 64, w0),
            "residual": lambda: cukern.rms_norm(x1, 64, residual=x0),
            "mean": lambda: cukern.layer_norm_backward(x1, x1, mean0, rstd1, w1),
            "running_mean": lambda: cukern.batch_norm(b1, v0, v1),
            "invstd": lambda: cukern.batch_norm_backward(b1, b1, m1, s0),
            "addend": lambda: cukern.batch_norm(b1, v1, v1, addend=b0),
            "permute out": lambda: cukern.to_nhwc(b0, out=o1),
        }
        for cur in (0, 1):
            with cp.cuda.Device(cur):
                for name, call in calls.items():
                    with pytest.raises(ValueError, match=r"GPU [01].*GPU [01]"):
                        call()
                    assert cp.cuda.runtime.getDevice() == cur, name


def _on(dev: int, fn):
    with cp.cuda.Device(dev):
        return fn()


def _to(dev: int, a):
    """A copy of ``a`` on GPU ``dev``."""
    with a.device:
        h = cp.asnumpy(a)
    with cp.cuda.Device(dev):
        return cp.asarray(h)


# ---------------------------------------------------------------------------------------------
# PyTorch tensors.

def _torch():
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (torch sees {torch.cuda.device_count()})")
    return torch


@needs_two
class TestTorchPlacement:
    @pytest.mark.parametrize("data_dev,cur_dev", DIRECTIONS)
    @pytest.mark.parametrize("case", CASE_PARAMS)
    def test_op(self, case, data_dev, cur_dev, rng):
        """cukern's functions on PyTorch tensors: tensors of the input's GPU come back."""
        torch = _torch()
        host = case.make(rng)
        want = _on_gpu0(case, host)
        tensors = {k: torch.from_numpy(v).to(f"cuda:{data_dev}") for k, v in host.items()}
        _forget_plans()
        with cp.cuda.Device(cur_dev), torch.cuda.device(cur_dev):
            res = [r for r in case.call(tensors) if r is not None]
            assert cp.cuda.runtime.getDevice() == cur_dev
            assert torch.cuda.current_device() == cur_dev
        assert len(res) == len(want)
        for i, (r, w) in enumerate(zip(res, want)):
            assert isinstance(r, torch.Tensor), type(r)
            assert r.device == torch.device("cuda", data_dev), f"result {i} on {r.device}"
            _close(r.cpu().numpy(), w, case.dtype, f"{case.name} result {i}")

    @pytest.mark.parametrize("data_dev,cur_dev", DIRECTIONS)
    @pytest.mark.parametrize("op", ["softmax", "log_softmax", "layer_norm", "rms_norm",
                                    "batch_norm", "batch_stats", "to_nhwc"])
    def test_autograd_op(self, op, data_dev, cur_dev, rng):
        """cukern.torch's ops, forward and backward, against the same on GPU 0."""
        torch = _torch()
        import cukern.torch as ct

        if op in ("batch_norm", "batch_stats", "to_nhwc"):
            shape = (16, 8, 32, 32)
        elif op in ("softmax", "log_softmax"):
            shape = (64, 20000)
        else:
            shape = (8, 262144)
        dtype = torch.float16 if shape == (8, 262144) else torch.float32
        x_h = torch.from_numpy(_rand(rng, shape, np.float32)).to(dtype)
        gs: dict[int, object] = {}  # output index -> its upstream gradient (host, float32)
        ncols = shape[-1]
        pc = 8 if op == "batch_norm" else ncols
        w_h = torch.from_numpy(_rand(rng, (pc,), np.float32, 1.0))
        w_h = w_h.to(dtype) if op != "batch_norm" else w_h

        def run(dev):
            x = x_h.to(f"cuda:{dev}").requires_grad_(True)
            w = w_h.to(f"cuda:{dev}").requires_grad_(True)
            if op in ("softmax", "log_softmax"):
                outs = [getattr(ct, op)(x, dim=-1)]
            elif op == "layer_norm":
                outs = [ct.layer_norm(x, (ncols,), w)]
            elif op == "rms_norm":
                outs = [ct.rms_norm(x, (ncols,), w)]
            elif op == "batch_norm":
                outs = [ct.batch_norm(x, None, None, w, None, training=True)]
            elif op == "batch_stats":
                outs = list(ct.batch_stats(x))
            else:
                outs = [ct.to_nhwc(x)]
            loss = 0
            for i, o in enumerate(outs):
                if i not in gs:
                    gs[i] = torch.from_numpy(_rand(rng, tuple(o.shape), np.float32))
                loss = loss + (o.float() * gs[i].to(o.device)).sum()
            loss.backward()
            grads = [x.grad] + ([w.grad] if w.grad is not None else [])
            return outs + grads

        want = [t.detach().cpu().float().numpy() for t in run(0)]
        _forget_plans()
        with cp.cuda.Device(cur_dev), torch.cuda.device(cur_dev):
            got = run(data_dev)
            assert cp.cuda.runtime.getDevice() == cur_dev
            assert torch.cuda.current_device() == cur_dev
        assert len(got) == len(want)
        name = "float16" if dtype == torch.float16 else "float32"
        for i, (t, w) in enumerate(zip(got, want)):
            assert t.device == torch.device("cuda", data_dev), f"{op} tensor {i} on {t.device}"
            _close(t.detach().cpu().float().numpy(), w, name, f"{op} tensor {i}")

    def test_mixed_devices_are_refused(self, rng):
        torch = _torch()
        x1 = torch.randn(16, 64, device="cuda:1")
        for cur in (0, 1):
            with torch.cuda.device(cur):
                with pytest.raises(ValueError, match=r"GPU [01].*GPU [01]"):
                    cukern.softmax(x1, out=torch.empty(16, 64, device="cuda:0"))
                with pytest.raises(ValueError, match=r"GPU [01].*GPU [01]"):
                    cukern.layer_norm(x1, 64, torch.ones(64, device="cuda:0"))
                assert torch.cuda.current_device() == cur

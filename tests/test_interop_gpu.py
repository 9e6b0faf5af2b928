"""out= and arguments from PyTorch and JAX on the GPU: a JAX array as out= is refused (JAX
arrays are immutable) and left as it was; a PyTorch out= written while the caller works on
another PyTorch stream is complete when read on that stream right after the call; a tensor
that requires grad is refused with a TypeError naming the argument and pointing to
cukern.torch."""

from __future__ import annotations

import numpy as np
import pytest

import cukern

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device (a CPU-only build?)")
    return torch


def _jax_gpu():
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError as err:
        pytest.skip(f"JAX has no GPU backend here ({err})")
    return jax, gpu


# ---------------------------------------------------------------------------------------------
# JAX out=.

@pytest.mark.parametrize("x_kind", ["cupy", "jax"])
def test_jax_out_is_refused(x_kind, rng):
    jax, gpu = _jax_gpu()
    import jax.numpy as jnp

    host = rng.standard_normal((8, 64)).astype(np.float32)
    out = jax.device_put(jnp.full((8, 64), 7.0, jnp.float32), gpu)
    x = cp.asarray(host) if x_kind == "cupy" else jax.device_put(jnp.asarray(host), gpu)
    with pytest.raises(TypeError, match=r"softmax: out.*JAX.*immutable"):
        cukern.softmax(x, out=out)
    xb = jax.device_put(jnp.asarray(rng.standard_normal((2, 4, 3, 5)).astype(np.float32)), gpu)
    with pytest.raises(TypeError, match=r"out"):
        cukern.batch_norm(xb, None, None, training=True,
                          out=jax.device_put(jnp.zeros((2, 4, 3, 5), jnp.float32), gpu))
    with pytest.raises(TypeError, match=r"to_nhwc: out.*JAX"):
        cukern.to_nhwc(cp.asarray(np.asarray(xb)),
                       out=jax.device_put(jnp.zeros((2, 3, 5, 4), jnp.float32), gpu))
    np.testing.assert_array_equal(np.asarray(out), np.full((8, 64), 7.0, np.float32))


# ---------------------------------------------------------------------------------------------
# PyTorch out= on another stream.

def _delayed(torch, fn):
    """Runs ``fn()`` (a cukern call with a PyTorch out=) while the caller's current stream is
    a side stream, with the default stream (CuPy's current stream, where the kernel goes)
    kept busy for ~50 ms first: without handing the stream back, a read of out on the side
    stream runs before the kernel has written it."""
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # on the default stream (CuPy's null stream too)
    with torch.cuda.stream(side):
        res = fn()
        snapshot = res.clone()  # read on the caller's stream right after the call
    torch.cuda.synchronize()
    return res, snapshot


def test_torch_out_on_a_side_stream_softmax():
    torch = _torch()
    x = torch.randn(256, 1000, device="cuda")
    torch.cuda.synchronize()
    out = torch.full_like(x, float("nan"))
    res, snap = _delayed(torch, lambda: cukern.softmax(x, out=out))
    assert res is out
    want = torch.softmax(x.double(), dim=-1).float()
    torch.testing.assert_close(snap, want, rtol=1e-5, atol=1e-7)


def test_torch_out_on_a_side_stream_permute_and_batch_norm():
    torch = _torch()
    x = torch.randn(8, 16, 12, 10, device="cuda")
    out = torch.full((8, 12, 10, 16), float("nan"), device="cuda")
    res, snap = _delayed(torch, lambda: cukern.to_nhwc(x, out=out))
    assert res is out
    torch.testing.assert_close(snap, x.permute(0, 2, 3, 1), rtol=0, atol=0)

    rm, rv = torch.zeros(16, device="cuda"), torch.ones(16, device="cuda")
    out = torch.full_like(x, float("nan"))
    res, snap = _delayed(torch, lambda: cukern.batch_norm(x, rm, rv, out=out))
    assert res is out
    torch.testing.assert_close(snap, x / (1 + 1e-5) ** 0.5, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# PyTorch in and out without the stream handshake, only where the streams are one.

def test_torch_on_cupys_stream_skips_the_handshake(rng):
    """On the default stream of both, a tensor is exchanged without DLPack's stream handshake
    (``same_stream``) and the results are right; on a side stream it takes the handshake."""
    from cukern import runner

    torch = _torch()
    x = torch.from_numpy(rng.standard_normal((64, 300)).astype(np.float32)).cuda()
    torch.cuda.synchronize()
    assert runner.adapt("softmax", "x", x).same_stream
    want = torch.softmax(x.double(), dim=-1).float()
    for _ in range(2):  # the first call plans, the second takes the cached launch
        torch.testing.assert_close(cukern.softmax(x), want, rtol=1e-5, atol=1e-7)
    from cukern.ops import softmax as ops_softmax

    fast = ops_softmax._fast_torch("softmax", x, -1)  # the repeated call's path
    assert isinstance(fast, torch.Tensor)
    torch.testing.assert_close(fast, want, rtol=1e-5, atol=1e-7)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert not runner.adapt("softmax", "x", x).same_stream


def test_torch_input_on_a_side_stream_is_ordered():
    """A tensor made on a side stream, the call on that stream, the result read there at once:
    complete, though CuPy's stream (where the kernel runs) was kept busy."""
    torch = _torch()
    x = torch.randn(256, 1000, device="cuda")
    torch.cuda.synchronize()

    def call():
        y = x * 2  # made on the side stream
        return cukern.softmax(y)

    res, snap = _delayed(torch, call)
    want = torch.softmax((2 * x).double(), dim=-1).float()
    torch.testing.assert_close(snap, want, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Tensors that require grad.

def test_tensors_requiring_grad_are_refused():
    torch = _torch()
    x = torch.randn(16, 64, device="cuda", requires_grad=True)
    w = torch.ones(64, device="cuda", requires_grad=True)
    plain = torch.randn(16, 64, device="cuda")
    cases = {
        "x": lambda: cukern.softmax(x),
        "weight": lambda: cukern.layer_norm(plain, 64, w),
        "dy": lambda: cukern.softmax_backward(y=plain, dy=x),
        "out": lambda: cukern.softmax(plain, out=torch.empty(16, 64, device="cuda",
                                                              requires_grad=True)),
    }
    for name, call in cases.items():
        with pytest.raises(TypeError, match=rf"\b{name} is a PyTorch tensor that requires "
                                            rf"grad.*cukern\.torch"):
            call()
    # detached, the same calls run
    y = cukern.softmax(x.detach())
    torch.testing.assert_close(y, torch.softmax(x.detach(), -1), rtol=1e-5, atol=1e-7)


def test_cukern_torch_still_takes_tensors_requiring_grad():
    """cukern.torch (autograd) is the way for such tensors: it detaches before calling in."""
    torch = _torch()
    import cukern.torch as ct

    x = torch.randn(16, 64, device="cuda", requires_grad=True)
    ct.softmax(x, dim=-1).sum().backward()
    assert x.grad is not None and x.grad.abs().max().item() < 1e-5  # d(sum softmax)/dx = 0

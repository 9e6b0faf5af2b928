"""out= and arguments from PyTorch and JAX on the GPU: a JAX array as out= is refused (JAX
arrays are immutable) and left as it was; a PyTorch out= written while the caller works on
another PyTorch stream is complete when read on that stream right after the call; a tensor
that requires grad is refused with a TypeError naming the argument and pointing to
cukern.torch. Every op's PyTorch fast path: tensors on CuPy's stream take the cached launch of
a validated layout and give the CuPy call's bits; tensors on a side stream take the full path,
ordered; tensors that require grad still meet the TypeError."""

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
        # read on the caller's stream right after the call (each tensor of a tuple)
        snapshot = res.clone() if isinstance(res, torch.Tensor) else tuple(
            None if r is None else r.clone() for r in res)
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

    fast = ops_softmax._fast("softmax", x, -1)  # the repeated call's path
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


# ---------------------------------------------------------------------------------------------
# Every op's PyTorch fast path: tensors on CuPy's current stream through their CuPy views.

R, C = 8, 64  # the row-wise ops' (rows, columns)
BN = (4, 8, 5, 6)  # batch norm's x (N, C, H, W)


def _host(rng) -> dict:
    """Fresh float32 inputs of every op; the backwards' y and statistics are the forwards'
    (float64 reference, rounded)."""
    from cukern import reference

    f, n, u = np.float32, rng.standard_normal, rng.uniform
    a = {"x": n((R, C)).astype(f), "dy": n((R, C)).astype(f), "w": u(0.5, 1.5, C).astype(f),
         "b": n(C).astype(f), "x3": n((3, 5, 7)).astype(f), "xb": n(BN).astype(f),
         "dyb": n(BN).astype(f), "zb": n(BN).astype(f), "xh": n((4, 5, 6, 8)).astype(f),
         "rm": n(8).astype(f), "rv": u(0.5, 2, 8).astype(f), "wb": u(0.5, 1.5, 8).astype(f),
         "bb": n(8).astype(f),
         "mask": rng.integers(-2**31, 2**31, -(-np.prod(BN) // 32)).astype(np.int32)}
    a["y"] = reference.softmax(a["x"]).astype(f)
    a["ly"] = reference.log_softmax(a["x"]).astype(f)
    _, mean, rstd = reference.layer_norm(a["x"], C, return_stats=True)
    _, rrstd = reference.rms_norm(a["x"], C, return_stats=True)
    bmean, bvar = reference.batch_stats(a["xb"])
    a.update(mean=mean.astype(f), rstd=rstd.astype(f), rrstd=rrstd.astype(f),
             bmean=bmean.astype(f), binvstd=(1 / np.sqrt(bvar + 1e-5)).astype(f))
    return a


def _nchw(a):
    """A channels-last (N, H, W, C) array as its (N, C, H, W) view, of any kind."""
    return a.permute(0, 3, 1, 2) if type(a).__module__ == "torch" else a.transpose(0, 3, 1, 2)


def _ref():
    from types import SimpleNamespace

    from cukern import reference as r

    return SimpleNamespace(**{n: getattr(r, n) for n in (
        "softmax", "log_softmax", "softmax_backward", "log_softmax_backward", "layer_norm",
        "rms_norm", "layer_norm_backward", "rms_norm_backward", "batch_norm",
        "batch_norm_backward", "batch_stats", "permute")},
        to_nhwc=lambda x: r.permute(x, (0, 2, 3, 1)), to_nchw=lambda x: r.permute(x, (0, 3, 1, 2)))


def _cases() -> dict:
    """name -> (module, its full path's function, the call on a dict of arrays of one kind
    with m = cukern or the reference, arrays written in place)."""
    from cukern.ops import batch_norm as bn
    from cukern.ops import layer_norm as ln
    from cukern.ops import permute as pm
    from cukern.ops import softmax as sm

    return {
        "softmax": (sm, "_run", lambda m, a: m.softmax(a["x"]), ()),
        "log_softmax": (sm, "_run", lambda m, a: m.log_softmax(a["x"]), ()),
        "softmax_backward": (sm, "_run", lambda m, a: m.softmax_backward(a["dy"], a["y"]), ()),
        "log_softmax_backward": (sm, "_run",
                                 lambda m, a: m.log_softmax_backward(a["dy"], a["ly"]), ()),
        "layer_norm": (ln, "_forward_checked",
                       lambda m, a: m.layer_norm(a["x"], C, a["w"], a["b"]), ()),
        "layer_norm_stats": (ln, "_forward_checked", lambda m, a: m.layer_norm(
            a["x"], C, a["w"], a["b"], return_stats=True), ()),
        "rms_norm": (ln, "_forward_checked",
                     lambda m, a: m.rms_norm(a["x"], C, a["w"], return_stats=True), ()),
        "layer_norm_backward": (ln, "_backward_checked", lambda m, a: m.layer_norm_backward(
            a["dy"], a["x"], a["mean"], a["rstd"], a["w"], a["b"]), ()),
        "rms_norm_backward": (ln, "_backward_checked", lambda m, a: m.rms_norm_backward(
            a["dy"], a["x"], a["rrstd"], a["w"]), ()),
        "batch_norm_training": (bn, "_batch_norm", lambda m, a: m.batch_norm(
            a["xb"], a["rm"], a["rv"], a["wb"], a["bb"], training=True), ("rm", "rv")),
        "batch_norm_fused": (bn, "_batch_norm", lambda m, a: m.batch_norm(
            a["xb"], a["rm"], a["rv"], a["wb"], a["bb"], True, addend=a["zb"], relu=True,
            return_stats=True), ("rm", "rv")),
        "batch_norm_channels_last": (bn, "_batch_norm", lambda m, a: m.batch_norm(
            _nchw(a["xh"]), a["rm"], a["rv"], None, a["bb"], True, 0.25, return_stats=True),
            ("rm", "rv")),
        "batch_norm_eval": (bn, "_batch_norm", lambda m, a: m.batch_norm(
            a["xb"], a["rm"], a["rv"], a["wb"], a["bb"]), ()),
        "batch_norm_backward": (bn, "_batch_norm_backward", lambda m, a: m.batch_norm_backward(
            a["dyb"], a["xb"], a["bmean"], a["binvstd"], a["wb"]), ()),
        "batch_norm_backward_masked": (bn, "_batch_norm_backward",
                                       lambda m, a: m.batch_norm_backward(
            a["dyb"], a["xb"], a["bmean"], a["binvstd"], None, mask=a["mask"], addend=True,
            training=False), ()),
        "batch_stats": (bn, "_batch_stats", lambda m, a: m.batch_stats(a["xb"]), ()),
        "batch_stats_channels_last": (bn, "_batch_stats",
                                      lambda m, a: m.batch_stats(a["xh"], axis=-1), ()),
        "permute": (pm, "_run", lambda m, a: m.permute(a["x3"], (2, 0, 1)), ()),
        "to_nhwc": (pm, "_run", lambda m, a: m.to_nhwc(a["xb"]), ()),
        "to_nchw": (pm, "_run", lambda m, a: m.to_nchw(a["xh"]), ()),
    }


CASE_NAMES = ["softmax", "log_softmax", "softmax_backward", "log_softmax_backward",
              "layer_norm", "layer_norm_stats", "rms_norm", "layer_norm_backward",
              "rms_norm_backward", "batch_norm_training", "batch_norm_fused",
              "batch_norm_channels_last", "batch_norm_eval", "batch_norm_backward",
              "batch_norm_backward_masked", "batch_stats", "batch_stats_channels_last",
              "permute", "to_nhwc", "to_nchw"]


def test_case_names_cover_the_table():
    assert CASE_NAMES == list(_cases())


def _kinds(torch, host: dict):
    """The host arrays as new CuPy arrays and as new PyTorch tensors on the GPU."""
    return ({k: cp.asarray(v) for k, v in host.items()},
            {k: torch.from_numpy(v.copy()).cuda() for k, v in host.items()})


def _results(res, arrays: dict, inplace) -> list:
    """An op's results as a list, then the arrays it wrote in place."""
    return (list(res) if isinstance(res, tuple) else [res]) + [arrays[k] for k in inplace]


def _same_as_cupy(torch, got, want, device) -> None:
    """Tensors on ``device`` with the CuPy results' dtypes, shapes, strides and bits."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, i
            continue
        assert isinstance(g, torch.Tensor) and g.device == device, (i, type(g))
        gn, wn = g.cpu().numpy(), cp.asnumpy(w)
        assert (gn.dtype, gn.shape) == (wn.dtype, wn.shape), i
        assert tuple(g.stride()) == tuple(s // w.itemsize for s in w.strides), i
        assert gn.tobytes() == wn.tobytes(), f"result {i} differs from the CuPy call's"


def _close_to_ref(got, ref) -> None:
    for i, (g, r) in enumerate(zip(got, ref)):
        if g is None or r is None or not g.dtype.is_floating_point:
            continue
        g64 = g.cpu().numpy().astype(np.float64)
        r64 = np.asarray(r, np.float64).reshape(g64.shape)
        err = np.linalg.norm((g64 - r64).ravel()) / max(np.linalg.norm(r64.ravel()), 1e-30)
        assert err <= 1e-5, f"result {i}: relative error {err:.3g} against float64"


def _count_full_path(monkeypatch, mod, full) -> list:
    """Records each call of ``mod.full`` (the op's validating path) in the list returned."""
    calls = []
    orig = getattr(mod, full)
    monkeypatch.setattr(mod, full, lambda *a, **k: calls.append(1) or orig(*a, **k))
    return calls


@pytest.mark.parametrize("name", CASE_NAMES)
def test_same_stream_tensors_take_the_fast_path(name, rng, monkeypatch):
    """A tensor call plans once, fills the op's fast-path cache, and a repeated call of the
    layout (fresh data) takes it; a CuPy call of that layout finds the same entry; results are
    tensors on the input's GPU with the CuPy call's bits (in-place running statistics
    included) and within float32 rounding of the float64 reference."""
    from cukern import runner

    torch = _torch()
    mod, full, call, inplace = _cases()[name]
    calls = _count_full_path(monkeypatch, mod, full)
    monkeypatch.setattr(mod, "_fresh", runner.BoundedDict())
    ref = _ref()
    for rep in range(2):  # the first call validates and plans, the second takes the fast path
        host = _host(rng)
        arrays, tensors = _kinds(torch, host)
        got = _results(call(cukern, tensors), tensors, inplace)
        device = tensors["x"].device
        assert len(calls) == 1, f"call {rep + 1}: the full path ran {len(calls)} times"
        assert len(mod._fresh) == 1
        want = _results(call(cukern, arrays), arrays, inplace)
        assert len(calls) == 1  # one key for both kinds: the CuPy call found the entry
        _same_as_cupy(torch, got, want, device)
        on_host = {k: v.copy() for k, v in host.items()}
        _close_to_ref(got, _results(call(ref, on_host), on_host, inplace))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_fast_path_results_come_from_pytorchs_allocator(name, rng):
    """A repeated tensor call's results are allocated by PyTorch's caching allocator on its
    current stream (no CuPy memory handed over through DLPack): PyTorch's count of allocated
    bytes grows by at least their size while they live, and falls back once they are gone."""
    torch = _torch()
    _, _, call, _ = _cases()[name]
    host = _host(rng)
    for _ in range(2):
        call(cukern, _kinds(torch, host)[1])  # the second call takes the fast path
    tensors = _kinds(torch, host)[1]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    res = call(cukern, tensors)
    res = list(res) if isinstance(res, tuple) else [res]
    grown = torch.cuda.memory_allocated() - before
    size = sum(r.numel() * r.element_size() for r in res if r is not None)
    assert size > 0 and grown >= size, f"{name}: PyTorch allocated {grown} of {size} bytes"
    del res
    assert torch.cuda.memory_allocated() == before


def test_lazy_conjugate_and_negative_views_are_read_as_the_values_they_stand_for():
    """A tensor whose conjugate or negative bit is set (its memory holds the values before the
    lazy operation, and DLPack hands that memory over as it is) gives the operation's values,
    also with the layout's fast path ready; where cukern would write it (out=, training's
    running statistics) it is refused with a TypeError."""
    torch = _torch()
    x = torch.randn(8, 6, dtype=torch.complex64, device="cuda")
    for _ in range(2):
        cukern.permute(x, (1, 0))  # the layouts' fast paths are ready
        cukern.softmax(x.imag)
    conj, neg = x.conj(), x.conj().imag
    assert conj.is_conj() and neg.is_neg()
    for _ in range(2):
        torch.testing.assert_close(cukern.permute(conj, (1, 0)),
                                   x.conj().resolve_conj().t(), rtol=0, atol=0)
        torch.testing.assert_close(cukern.softmax(neg), torch.softmax(-x.imag, -1),
                                   rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError, match=r"softmax: out is a PyTorch tensor with its conjugate"):
        cukern.softmax(x.real.contiguous(), out=neg)
    xb = torch.randn(4, 6, 3, 3, device="cuda")
    rm = torch.randn(6, dtype=torch.complex64, device="cuda").conj().imag
    rv = torch.ones(6, device="cuda")
    with pytest.raises(TypeError, match=r"batch_norm: running_mean is a PyTorch tensor with"):
        cukern.batch_norm(xb, rm, rv, training=True)
    want = (xb - rm.resolve_neg()[:, None, None]) / (1 + 1e-5) ** 0.5  # eval reads it
    torch.testing.assert_close(cukern.batch_norm(xb, rm, rv), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["complex32", "float8_e4m3fn", "float8_e5m2", "quantized"])
def test_tensors_of_dtypes_cupy_lacks_are_refused(kind):
    """A CUDA tensor CuPy cannot hold (complex32, float8, quantized) gets a TypeError naming
    the argument and its dtype from every op, not PyTorch's or CuPy's exchange error; its
    bytes viewed as uint8 permute as they are."""
    torch = _torch()
    x = torch.randn(4, 8, device="cuda")
    if kind == "quantized":
        try:
            t = torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)
        except (RuntimeError, NotImplementedError) as err:
            pytest.skip(f"this PyTorch has no CUDA quantized tensors ({err})")
        pattern = r"x is a quantized PyTorch tensor"
    else:
        if not hasattr(torch, kind):
            pytest.skip(f"this PyTorch has no {kind}")
        try:
            t = x.to(getattr(torch, kind))
        except (RuntimeError, TypeError) as err:
            pytest.skip(f"this PyTorch cannot make a CUDA {kind} tensor ({err})")
        pattern = rf"x is a PyTorch tensor of dtype torch.{kind}, which CuPy has no dtype for"
    for call in (lambda: cukern.permute(t, (1, 0)), lambda: cukern.softmax(t),
                 lambda: cukern.layer_norm(t, 8)):
        with pytest.raises(TypeError, match=pattern):
            call()
    if kind.startswith("float8"):
        y = cukern.permute(t.view(torch.uint8), (1, 0)).view(t.dtype)
        assert y.dtype == t.dtype and torch.equal(y.view(torch.uint8), t.view(torch.uint8).T)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "int4"])
def test_jax_arrays_of_dtypes_cupy_lacks_are_refused(name):
    """A JAX array of a float8 or 4-bit type gets a TypeError naming the argument and dtype,
    not CuPy's or JAX's exchange error."""
    jax, gpu = _jax_gpu()
    jnp = jax.numpy
    if not hasattr(jnp, name):
        pytest.skip(f"this JAX has no {name}")
    a = jax.device_put(jnp.ones((4, 8), jnp.float32), gpu).astype(getattr(jnp, name))
    for call in (lambda: cukern.permute(a, (1, 0)), lambda: cukern.softmax(a)):
        with pytest.raises(TypeError, match=rf"x is a JAX array of dtype {name}, which CuPy "
                                            r"has no dtype for"):
            call()


def test_sparse_tensors_are_refused():
    """A sparse CUDA tensor gets a TypeError naming the argument, also with the layout's fast
    path ready (it has no strides to read)."""
    torch = _torch()
    x = torch.randn(8, 6, device="cuda")
    for _ in range(2):
        cukern.softmax(x)
    sparse = x.to_sparse()
    with pytest.raises(TypeError, match=r"softmax: x is a PyTorch tensor of layout "
                                        r"torch.sparse_coo"):
        cukern.softmax(sparse)


def test_jax_running_statistics_are_refused_in_training():
    """Training writes the running statistics in place: JAX arrays (immutable) are refused
    there, and accepted in eval, which only reads them."""
    jax, gpu = _jax_gpu()
    x = cp.random.standard_normal((4, 6, 3, 3), dtype=cp.float32)
    rm = jax.device_put(np.zeros(6, np.float32), gpu)
    rv = jax.device_put(np.ones(6, np.float32), gpu)
    with pytest.raises(TypeError, match=r"batch_norm: running_mean is a JAX array; JAX arrays "
                                        r"are immutable"):
        cukern.batch_norm(x, rm, rv, training=True)
    np.testing.assert_allclose(cp.asnumpy(cukern.batch_norm(x, rm, rv)),
                               cp.asnumpy(x) / np.sqrt(1 + 1e-5), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(rm), 0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_fast_path_takes_tensors_of_every_float_dtype(dtype, rng, monkeypatch):
    """Tensors of each float dtype find the fast-path entry their first call made (their
    dtype's key is CuPy's), and give the CuPy call's bits."""
    from cukern import runner
    from cukern.ops import layer_norm as ln
    from cukern.ops import softmax as sm

    torch = _torch()
    tdt = getattr(torch, dtype)
    for mod, full, call in ((sm, "_run", lambda t, w: (cukern.softmax(t),)),
                            (ln, "_forward_checked", lambda t, w: cukern.layer_norm(
                                t, 64, w, return_stats=True))):
        calls = _count_full_path(monkeypatch, mod, full)
        monkeypatch.setattr(mod, "_fresh", runner.BoundedDict())
        for rep in range(2):
            t = torch.as_tensor(rng.standard_normal((8, 64)), device="cuda").to(tdt)
            w = torch.as_tensor(rng.uniform(0.5, 1.5, 64), device="cuda").to(tdt)
            got = call(t, w)
            assert len(calls) == 1, f"{dtype} call {rep + 1}: the full path ran {len(calls)}"
            # the CuPy call of the same data takes the same entry
            want = call(cp.from_dlpack(t), cp.from_dlpack(w))
            assert len(calls) == 1
            for g, w in zip(got, want):
                assert isinstance(g, torch.Tensor)
                assert g.view(torch.uint8).cpu().numpy().tobytes() == cp.asnumpy(
                    w.view(cp.uint8)).tobytes()


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint8", "int16", "int32", "int64",
                                   "complex128"])
def test_permute_fast_path_takes_tensors_of_every_element_kind(dtype, rng, monkeypatch):
    """Integer, bool and complex tensors find permute's fast-path entry their first call made,
    come back as new contiguous tensors of their dtype (from PyTorch's allocator) and hold
    numpy.transpose's values, bit for bit; the CuPy call of the same data takes the entry."""
    from cukern import runner
    from cukern.ops import permute as pm

    torch = _torch()
    calls = _count_full_path(monkeypatch, pm, "_run")
    monkeypatch.setattr(pm, "_fresh", runner.BoundedDict())
    axes = (0, 2, 3, 1)
    for rep in range(2):
        if dtype == "bool":
            host = rng.integers(0, 2, (2, 5, 3, 7)).astype(bool)
        elif dtype.startswith("complex"):
            host = (rng.standard_normal((2, 5, 3, 7))
                    + 1j * rng.standard_normal((2, 5, 3, 7))).astype(dtype)
        else:
            info = np.iinfo(dtype)
            host = rng.integers(info.min, info.max, (2, 5, 3, 7), endpoint=True, dtype=dtype)
        t = torch.from_numpy(host.copy()).cuda()
        got = cukern.permute(t, axes)
        assert len(calls) == 1, f"{dtype} call {rep + 1}: the full path ran {len(calls)} times"
        assert isinstance(got, torch.Tensor) and got.dtype == t.dtype and got.is_contiguous()
        assert got.device == t.device and tuple(got.shape) == (2, 3, 7, 5)
        want = np.ascontiguousarray(np.transpose(host, axes))
        assert got.cpu().numpy().tobytes() == want.tobytes()
        y = cukern.permute(cp.asarray(host), axes)  # the same entry, a CuPy result
        assert len(calls) == 1 and isinstance(y, cp.ndarray)
        assert cp.asnumpy(y).tobytes() == want.tobytes()


@pytest.mark.parametrize("name", CASE_NAMES)
def test_tensors_on_a_side_stream_are_exchanged_in_order(name, rng, monkeypatch):
    """With the layout's fast path ready, tensors made on a side stream take the full path
    (the DLPack handshake), and results and running statistics read on that stream right after
    the call are complete, though CuPy's stream was kept busy."""
    torch = _torch()
    mod, full, call, inplace = _cases()[name]
    host = _host(rng)
    for _ in range(2):
        call(cukern, _kinds(torch, host)[1])  # on the default stream: the fast path is ready
    arrays, tensors = _kinds(torch, host)
    calls = _count_full_path(monkeypatch, mod, full)

    def on_side_stream():
        made = {k: v * 1 for k, v in tensors.items()}  # made on the side stream
        return tuple(_results(call(cukern, made), made, inplace))

    _, snapshot = _delayed(torch, on_side_stream)
    assert len(calls) == 1  # the streams differ: not the fast path
    want = _results(call(cukern, arrays), arrays, inplace)
    _same_as_cupy(torch, list(snapshot), want, tensors["x"].device)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_tensors_requiring_grad_are_refused_beside_the_fast_path(name, rng):
    """With the layout's fast path ready, the same call with tensors that require grad still
    meets the full path's TypeError, and writes nothing (running statistics unchanged)."""
    torch = _torch()
    _, _, call, inplace = _cases()[name]
    host = _host(rng)
    for _ in range(2):
        call(cukern, _kinds(torch, host)[1])
    tensors = {k: v.requires_grad_() if v.is_floating_point() else v
               for k, v in _kinds(torch, host)[1].items()}
    with pytest.raises(TypeError, match=r"is a PyTorch tensor that requires grad"):
        call(cukern, tensors)
    for k in inplace:
        np.testing.assert_array_equal(tensors[k].detach().cpu().numpy(), host[k])


def test_tensor_results_raise_no_deprecation_warning(rng):
    """The fast path hands results to PyTorch without CuPy's deprecated toDlpack method, whose
    warning users would see pointing into cukern."""
    import warnings

    torch = _torch()
    t = torch.as_tensor(rng.standard_normal((4, 40)), dtype=torch.float32, device="cuda")
    cukern.softmax(t)  # plans; the second call takes the fast path
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = cukern.softmax(t)
    assert [str(w.message) for w in caught] == []
    torch.testing.assert_close(y, torch.softmax(t, -1), rtol=1e-5, atol=1e-6)

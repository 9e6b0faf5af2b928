"""cukern.torch without a GPU: every registry op is a custom op with a functional schema, the
fake (meta) implementations give the kernels' shapes, dtypes and layouts, and the autograd
wiring, the fakes and torch.compile are checked end to end with cukern's kernels replaced by
float64 PyTorch stand-ins that keep the kernels' contracts (arguments, result kinds and
layouts). The kernels themselves are checked in test_torch_gpu.py."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch.library, "custom_op"):
    pytest.skip("cukern.torch needs PyTorch 2.4+", allow_module_level=True)

import cukern  # noqa: E402
import cukern.torch as ct  # noqa: E402
from cukern import registry  # noqa: E402

F = torch.nn.functional


def meta(*shape, dtype=torch.float32, channels_last=False):
    x = torch.empty(*shape, dtype=dtype, device="meta")
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


# ---------------------------------------------------------------------------------------------
# Registration and fakes.

def test_every_registry_op_is_a_custom_op():
    assert set(ct.OPS) == set(registry.OPS)
    for name in registry.OPS:
        schema = getattr(torch.ops.cukern, name).default._schema
        assert not schema.is_mutable, name  # register_autograd needs functional ops


def test_fakes_rowwise():
    x = meta(6, 5).t()  # a transposed view: the kernels write a contiguous result
    for op in ("softmax", "log_softmax"):
        y = getattr(torch.ops.cukern, op)(x, 0)
        assert y.shape == (5, 6) and y.is_contiguous()
        assert getattr(torch.ops.cukern, f"{op}_backward")(y, y, -1).is_contiguous()
    x = meta(3, 4, 5, dtype=torch.bfloat16)
    y, mean, rstd = torch.ops.cukern.layer_norm(x, [4, 5], None, None, 1e-5)
    assert y.dtype == torch.bfloat16 and mean.shape == rstd.shape == (3,)
    assert mean.dtype == rstd.dtype == torch.float32
    y, rstd = torch.ops.cukern.rms_norm(meta(2, 3, 4, dtype=torch.float64), [4], None, 1e-5)
    assert rstd.shape == (2, 3) and rstd.dtype == torch.float64
    dx, dw, db = torch.ops.cukern.layer_norm_backward(x, x, mean, rstd.new_empty(3), None, None)
    assert dx.shape == x.shape and dw.numel() == db.numel() == 0
    b = meta(4, 5, dtype=torch.bfloat16)
    dx, dw, db = torch.ops.cukern.layer_norm_backward(x, x, mean, mean, None, b)
    assert dw.numel() == 0 and db.shape == (4, 5) and db.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="normalized_shape"):
        torch.ops.cukern.layer_norm(x, [5, 4], None, None, 1e-5)
    with pytest.raises(IndexError, match="dim 2"):
        torch.ops.cukern.softmax(meta(3, 4), 2)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("relu", [False, True])
def test_fake_batch_norm_layout_and_mask(channels_last, relu):
    x = meta(4, 6, 5, 7, dtype=torch.bfloat16, channels_last=channels_last)
    rm = meta(6)
    y, mean, invstd, mask, rm2, rv2 = torch.ops.cukern.batch_norm(
        x, rm, rm, None, None, None, True, 0.1, 1e-5, relu)
    assert y.shape == x.shape and y.stride() == x.stride() and y.dtype == torch.bfloat16
    assert mean.shape == invstd.shape == (6,) and mean.dtype == torch.float32
    assert mask.dtype == torch.int32 and mask.shape == ((4 * 6 * 5 * 7 + 31) // 32 if relu else 0,)
    assert rm2.shape == rv2.shape == (6,)
    _, _, _, _, rm3, _ = torch.ops.cukern.batch_norm(x, rm, rm, None, None, None, False, 0.1,
                                                     1e-5, relu)
    assert rm3.numel() == 0  # eval updates nothing
    dx, dw, db, da = torch.ops.cukern.batch_norm_backward(x, x, mean, invstd, None, None, True,
                                                          True)
    assert dx.stride() == da.stride() == x.stride() and dw.dtype == torch.float32
    strided = meta(4, 6, 10, 7)[:, :, ::2]  # not dense: copied to C order first
    assert torch.ops.cukern.batch_norm(strided, None, None, None, None, None, True, 0.1, 1e-5,
                                       False)[0].is_contiguous()


def test_fake_permute():
    x = meta(2, 3, 4, 5)
    assert ct.to_nhwc(x).shape == (2, 4, 5, 3) and ct.to_nhwc(x).is_contiguous()
    assert ct.to_nchw(meta(2, 4, 5, 3)).shape == (2, 3, 4, 5)
    assert ct.permute(x, (-1, 0, 2, 1)).shape == (5, 2, 4, 3)
    with pytest.raises(ValueError, match="permutation"):
        ct.permute(x, (0, 0, 1, 2))
    with pytest.raises(ValueError, match="3 to 5"):
        ct.to_nhwc(meta(2, 3))


def test_cpu_tensor_is_refused():
    with pytest.raises(TypeError, match="CUDA tensor"):
        ct.softmax(torch.randn(3, 4))


# ---------------------------------------------------------------------------------------------
# Stand-ins: cukern's functions as float64 PyTorch code with the kernels' contracts.

def _fresh(t):
    return t.clone(memory_format=torch.contiguous_format)


def _sdt(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def sm(x, axis=-1):
    return _fresh(torch.softmax(x.double(), axis).to(x.dtype))


def lsm(x, axis=-1):
    return _fresh(torch.log_softmax(x.double(), axis).to(x.dtype))


def sm_bwd(dy, y, axis=-1):
    y, dy = y.double(), dy.double()
    return _fresh(((dy - (dy * y).sum(axis, keepdim=True)) * y).to(dy.dtype))


def lsm_bwd(dy, y, axis=-1):
    yd, dd = y.double(), dy.double()
    return _fresh((dd - yd.exp() * dd.sum(axis, keepdim=True)).to(y.dtype))


def _norm(x, normalized_shape, weight, bias, eps, layer):
    dims = tuple(range(-len(normalized_shape), 0))
    xd = x.double()
    mean = xd.mean(dims, keepdim=True) if layer else 0 * xd.sum(dims, keepdim=True)
    rstd = ((xd - mean).pow(2).mean(dims, keepdim=True) + eps).rsqrt()
    y = (xd - mean) * rstd
    y = y * weight.double() if weight is not None else y
    y = y + bias.double() if bias is not None else y
    lead = x.shape[:x.dim() - len(dims)]
    sdt = _sdt(x.dtype)
    return _fresh(y.to(x.dtype)), mean.reshape(lead).to(sdt), rstd.reshape(lead).to(sdt)


def ln(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, return_stats=False):
    res = _norm(x, normalized_shape, weight, bias, eps, True)
    return res if return_stats else res[0]


def rms(x, normalized_shape, weight=None, eps=1e-6, *, return_stats=False):
    y, _, rstd = _norm(x, normalized_shape, weight, None, eps, False)
    return (y, rstd) if return_stats else y


def _norm_bwd(dy, x, mean, rstd, weight, layer, bias=None):
    k = x.dim() - rstd.dim()
    dims, lead = tuple(range(-k, 0)), tuple(range(x.dim() - k))
    shape = list(rstd.shape) + [1] * k
    xd, dd = x.double(), dy.double()
    r = rstd.double().reshape(shape)
    xhat = (xd - mean.double().reshape(shape)) * r if layer else xd * r
    g = dd * weight.double() if weight is not None else dd
    dx = g - xhat * (g * xhat).mean(dims, keepdim=True)
    dx = r * (dx - g.mean(dims, keepdim=True) if layer else dx)
    dw = db = None
    if weight is not None:
        dw = (dd * xhat).sum(lead).to(x.dtype)
    if weight is not None or bias is not None:
        db = dd.sum(lead).to(x.dtype)
    return _fresh(dx.to(x.dtype)), dw, db


def ln_bwd(dy, x, mean, rstd, weight=None, bias=None):
    return _norm_bwd(dy, x, mean, rstd, weight, True, bias)


def rms_bwd(dy, x, rstd, weight=None):
    return _norm_bwd(dy, x, None, rstd, weight, False)[:2]


def _order(x):
    """x's dims in memory order (outermost first)."""
    return sorted(range(x.dim()), key=lambda i: (-x.stride(i), i))


def _pack(y):
    bits = (y.permute(_order(y)).reshape(-1) > 0).long()
    bits = torch.cat([bits, bits.new_zeros(-bits.numel() % 32)]).view(-1, 32)
    words = (bits << torch.arange(32)).sum(1)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def _unpack(mask, like):
    order = _order(like)
    bits = ((mask.long().unsqueeze(1) >> torch.arange(32)) & 1).view(-1)[:like.numel()]
    inverse = [order.index(i) for i in range(like.dim())]
    return bits.view([like.shape[i] for i in order]).permute(inverse).to(torch.float64)


def _channel(v, nd):
    return v.double().view([1, -1] + [1] * (nd - 2))


def bn(x, running_mean=None, running_var=None, weight=None, bias=None, training=False,
       momentum=0.1, eps=1e-5, *, addend=None, relu=False, return_stats=True):
    nd, dims = x.dim(), [i for i in range(x.dim()) if i != 1]
    xd = x.double()
    if training:
        mean, var = xd.mean(dims), xd.var(dims, unbiased=False)
        n = x.numel() // x.shape[1]
        if running_mean is not None:
            running_mean.copy_((1 - momentum) * running_mean.double() + momentum * mean)
        if running_var is not None:
            running_var.copy_((1 - momentum) * running_var.double() +
                              momentum * var * n / (n - 1))
    else:
        mean, var = running_mean.double(), running_var.double()
    invstd = (var + eps).rsqrt()
    y = (xd - _channel(mean, nd)) * _channel(invstd, nd)
    y = y * _channel(weight, nd) if weight is not None else y
    y = y + _channel(bias, nd) if bias is not None else y
    y = y + addend.double() if addend is not None else y
    y = torch.empty_like(x).copy_(y.relu() if relu else y)
    sdt = _sdt(x.dtype)
    return y, _fresh(mean.to(sdt)), _fresh(invstd.to(sdt)), _pack(y) if relu else None


def bn_bwd(dy, x, mean, invstd, weight=None, *, axis=1, mask=None, addend=False,
           training=True):
    nd, dims = x.dim(), [i for i in range(x.dim()) if i != 1]
    g = dy.double() * (_unpack(mask, x) if mask is not None else 1)
    xhat = (x.double() - _channel(mean, nd)) * _channel(invstd, nd)
    db, dw = g.sum(dims), (g * xhat).sum(dims)
    n = x.numel() // x.shape[1]
    w = _channel(weight, nd) if weight is not None else 1
    if training:
        dx = w * _channel(invstd, nd) * (g - _channel(db, nd) / n - xhat * _channel(dw, nd) / n)
    else:
        dx = w * _channel(invstd, nd) * g
    pdt = weight.dtype if weight is not None else _sdt(x.dtype)
    res = (torch.empty_like(x).copy_(dx), dw.to(pdt), db.to(pdt))
    return res + (torch.empty_like(x).copy_(g),) if addend else res


def stats(x):
    dims = [i for i in range(x.dim()) if i != 1]
    return (x.double().mean(dims).to(_sdt(x.dtype)),
            x.double().var(dims, unbiased=False).to(_sdt(x.dtype)))


def perm(x, axes):
    return _fresh(x.permute(axes))


STAND_INS = {"softmax": sm, "log_softmax": lsm, "softmax_backward": sm_bwd,
             "log_softmax_backward": lsm_bwd, "layer_norm": ln, "rms_norm": rms,
             "layer_norm_backward": ln_bwd, "rms_norm_backward": rms_bwd, "batch_norm": bn,
             "batch_norm_backward": bn_bwd, "batch_stats": stats, "permute": perm}


@pytest.fixture
def stand_ins(monkeypatch):
    """cukern's functions replaced by the stand-ins, and CPU tensors let through."""
    assert set(STAND_INS) == set(registry.OPS)
    for name, fn in STAND_INS.items():
        monkeypatch.setattr(cukern, name, fn)
    monkeypatch.setattr(ct._base, "_cuda", lambda fn, t: contextlib.nullcontext())


def _r(*shape, dtype=torch.float64, grad=True, channels_last=False):
    x = torch.randn(*shape, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_(grad)


def test_stand_ins_match_torch(stand_ins):
    """The stand-ins are right: the checks below test the wiring, not them."""
    x, w, b = _r(4, 6, 3, 5, grad=False), _r(6, grad=False), _r(6, grad=False)
    rm, rv = torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    y = bn(x, rm.clone(), rv.clone(), w, b, True)[0]
    torch.testing.assert_close(y, F.batch_norm(x, rm, rv, w, b, True))
    torch.testing.assert_close(ln(x, (3, 5)), F.layer_norm(x, (3, 5)))
    mask = _pack(x)
    torch.testing.assert_close(_unpack(mask, x), (x > 0).double())


def test_gradcheck_with_stand_ins(stand_ins):
    x = _r(3, 7)
    for fn in (ct.softmax, ct.log_softmax):
        assert torch.autograd.gradcheck(lambda t: fn(t, 0), (x,))
        assert torch.autograd.gradcheck(lambda t: fn(t, -1), (x,))
    w, b = _r(7), _r(7)
    assert torch.autograd.gradcheck(lambda t, w, b: ct.layer_norm(t, 7, w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda t, b: ct.layer_norm(t, 7, None, b), (x, b))
    assert torch.autograd.gradcheck(lambda t: ct.layer_norm(t, (3, 7)), (x,))
    assert torch.autograd.gradcheck(lambda t, w: ct.rms_norm(t, [7], w), (x, w))
    assert torch.autograd.gradcheck(lambda t: ct.permute(t, (1, 0)), (x,))
    assert torch.autograd.gradcheck(lambda t: ct.batch_stats(t), (_r(4, 3, 2),))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("channels_last", [False, True])
def test_gradcheck_batch_norm_with_stand_ins(stand_ins, training, channels_last):
    x = _r(3, 4, 2, 3, channels_last=channels_last)
    z = _r(3, 4, 2, 3)  # NCHW addend: copied to x's layout
    w, b = _r(4), _r(4)
    rm, rv = torch.randn(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5

    def fn(x, w, b, z):
        return ct.batch_norm(x, None if training else rm, None if training else rv, w, b,
                             training, addend=z, relu=True)

    assert torch.autograd.gradcheck(fn, (x, w, b, z))
    y = fn(x, w, b, z)
    assert y.stride() == x.stride()
    y.sum().backward()
    assert x.grad.stride() == x.stride()


def test_batch_norm_running_stats_with_stand_ins(stand_ins):
    rm, rv = torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64)
    trm, trv = rm.clone(), rv.clone()
    for _ in range(3):
        x = torch.randn(8, 5, 3, dtype=torch.float64) * 2 + 1
        ct.batch_norm(x, rm, rv, training=True, momentum=0.2)
        F.batch_norm(x, trm, trv, training=True, momentum=0.2)
    torch.testing.assert_close(rm, trm)
    torch.testing.assert_close(rv, trv)


def _opcheck_cases():
    x, w, b = _r(3, 7), _r(7), _r(7)
    y = torch.softmax(x, -1).detach()
    mean, rstd = ln(x.detach(), (7,), return_stats=True)[1:]
    xc = _r(3, 4, 2, 3, channels_last=True)
    w4, b4, z = _r(4), _r(4), _r(3, 4, 2, 3, channels_last=True)
    y4, m4, i4, mask = bn(xc.detach(), None, None, w4.detach(), None, True, relu=True)
    rm, rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    return [
        ("softmax", (x, 1)), ("log_softmax", (x, 0)),
        ("softmax_backward", (x.detach(), y, -1)), ("log_softmax_backward", (x.detach(), y, 1)),
        ("layer_norm", (x, [7], w, b, 1e-5)), ("layer_norm", (x, [3, 7], None, None, 1e-5)),
        ("layer_norm_backward", (x.detach(), x.detach(), mean, rstd, w.detach(), b.detach())),
        ("layer_norm_backward", (x.detach(), x.detach(), mean, rstd, None, b.detach())),
        ("layer_norm_backward", (x.detach(), x.detach(), mean, rstd, None, None)),
        ("rms_norm", (x, [7], w, 1e-6)),
        ("rms_norm_backward", (x.detach(), x.detach(), rstd, None)),
        ("batch_norm", (xc, rm, rv, w4, b4, z, True, 0.1, 1e-5, True)),
        ("batch_norm", (xc, rm, rv, w4, None, None, False, 0.1, 1e-5, False)),
        ("batch_norm_backward", (y4, xc.detach(), m4, i4, w4.detach(), mask, True, True)),
        ("batch_stats", (xc,)), ("permute", (xc, [0, 2, 3, 1])),
    ]


def test_opcheck_with_stand_ins(stand_ins):
    for name, args in _opcheck_cases():
        torch.library.opcheck(getattr(torch.ops.cukern, name).default, args)


def test_compile_fullgraph_with_stand_ins(stand_ins):
    """Dynamo and AOTAutograd (aot_eager: no code generation) trace the ops as opaque calls;
    the compiled function updates the running statistics like eager."""
    torch._dynamo.reset()

    def fn(x, w, b, rm, rv, bw):
        h = ct.batch_norm(x, rm, rv, bw, None, training=True, relu=True)
        h = ct.to_nhwc(h).flatten(1, 2)
        h = ct.layer_norm(h, h.shape[-1:], w, b)
        return ct.log_softmax(ct.rms_norm(h, [4]), dim=-1)

    x, w, b, bw = _r(2, 4, 3, 3), _r(4), _r(4), _r(4)
    rm, rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    crm, crv = rm.clone(), rv.clone()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    want = fn(x, w, b, rm, rv, bw)
    got = compiled(x, w, b, crm, crv, bw)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close((crm, crv), (rm, rv))
    g_want = torch.autograd.grad(want.square().sum(), (x, w, b, bw))
    g_got = torch.autograd.grad(got.square().sum(), (x, w, b, bw))
    torch.testing.assert_close(g_got, g_want)

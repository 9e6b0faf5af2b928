"""cukern.torch on the GPU: gradcheck in float64 for every op, values and gradients against
PyTorch's own ops in float32 and bfloat16 (cukern's error against a float64 reference at most
twice PyTorch's, or the dtype's floor), batch norm's running statistics, two tiny models
trained for five steps with cukern's ops and with PyTorch's from one initialisation,
torch.compile(fullgraph=True), channels-last batch norm, opcheck, and the stream the kernels
run on."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch.library, "custom_op"):
    pytest.skip("cukern.torch needs PyTorch 2.4+", allow_module_level=True)

import cukern  # noqa: E402
import cukern.torch as ct  # noqa: E402

pytestmark = pytest.mark.gpu
F = torch.nn.functional
DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Relative error (||out - ref|| / ||ref|| against float64) allowed whatever PyTorch's own is.
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def _torch_cuda(rng):
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device (a CPU-only build?)")
    torch.manual_seed(int(rng.integers(2**31)))


@pytest.fixture
def no_tf32():
    """Convolutions and matmuls in full float32, so that two runs differ only by the ops
    under test."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def randn(*shape, dtype=torch.float64, grad=True, channels_last=False, scale=1.0, shift=0.0):
    x = torch.randn(*shape, dtype=torch.float64, device="cuda") * scale + shift
    x = x.to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_(grad)


def rel(a, ref) -> float:
    ref = ref.double()
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_like_torch(name, ours, theirs, ref, dtype):
    """cukern's result within twice PyTorch's error against the float64 reference (or the
    dtype's floor)."""
    e_ours, e_torch = rel(ours, ref), rel(theirs, ref)
    assert e_ours <= max(2 * e_torch, FLOOR[dtype]), \
        f"{name}: relative error {e_ours:.3g}, PyTorch's {e_torch:.3g}"


def grads(out, inputs, dy):
    return torch.autograd.grad(out, inputs, dy)


# ---------------------------------------------------------------------------------------------
# gradcheck, float64.

@pytest.mark.parametrize("fn", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dim", [-1, 0])
def test_gradcheck_softmax(fn, dim):
    f = getattr(ct, fn)
    assert torch.autograd.gradcheck(lambda x: f(x, dim), (randn(5, 7),))


def test_gradcheck_layer_norm():
    x, w, b = randn(4, 3, 8), randn(8), randn(8)
    assert torch.autograd.gradcheck(lambda x, w, b: ct.layer_norm(x, 8, w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, b: ct.layer_norm(x, [8], None, b), (x, b))
    assert torch.autograd.gradcheck(lambda x: ct.layer_norm(x, (3, 8), eps=1e-3), (x,))


def test_gradcheck_rms_norm():
    x, w = randn(4, 3, 8), randn(8)
    assert torch.autograd.gradcheck(lambda x, w: ct.rms_norm(x, 8, w, 1e-5), (x, w))
    assert torch.autograd.gradcheck(lambda x: ct.rms_norm(x, (3, 8)), (x,))


@pytest.mark.parametrize("training,relu,addend,channels_last", [
    (True, True, True, False), (True, False, False, True), (False, True, False, False),
    (False, False, True, True)])
def test_gradcheck_batch_norm(training, relu, addend, channels_last):
    x = randn(3, 4, 2, 3, channels_last=channels_last)
    z = randn(3, 4, 2, 3) if addend else None  # NCHW: copied to x's layout when it is not
    w, b = randn(4), randn(4)
    rm, rv = randn(4, grad=False), randn(4, grad=False).abs() + 0.5

    def f(x, w, b, *z):
        return ct.batch_norm(x, None if training else rm, None if training else rv, w, b,
                             training, addend=z[0] if z else None, relu=relu)

    assert torch.autograd.gradcheck(f, (x, w, b) + ((z,) if addend else ()))


def test_gradcheck_permute_and_batch_stats():
    x = randn(2, 3, 4, 5)
    assert torch.autograd.gradcheck(lambda x: ct.permute(x, (3, 0, 2, 1)), (x,))
    assert torch.autograd.gradcheck(lambda x: ct.to_nchw(ct.to_nhwc(x) * 2), (x,))
    assert torch.autograd.gradcheck(ct.batch_stats, (randn(4, 3, 5),))


# ---------------------------------------------------------------------------------------------
# Against PyTorch's ops, float32 and bfloat16.

@pytest.mark.parametrize("dtype", list(DT))
@pytest.mark.parametrize("fn", ["softmax", "log_softmax"])
@pytest.mark.parametrize("shape,dim", [((33, 1000), -1), ((64, 7, 5), 1)])
def test_softmax_like_torch(dtype, fn, shape, dim):
    dt = DT[dtype]
    x = randn(*shape, dtype=dt, scale=3)
    dy = randn(*shape, dtype=dt, grad=False)
    ours = getattr(ct, fn)(x, dim)
    theirs = getattr(F, fn)(x, dim)
    xd = x.detach().double().requires_grad_()
    ref = getattr(F, fn)(xd, dim)
    assert ours.dtype == dt and ours.shape == x.shape
    check_like_torch(fn, ours, theirs, ref, dt)
    check_like_torch(f"d{fn}", grads(ours, x, dy)[0], grads(theirs, x, dy)[0],
                     grads(ref, xd, dy.double())[0], dt)


def _params(n, dtype, bias=True):
    w = randn(n, dtype=dtype, scale=0.5, shift=1.0)
    return w, (randn(n, dtype=dtype, scale=0.5) if bias else None)


@pytest.mark.parametrize("dtype", list(DT))
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_norms_like_torch(dtype, norm):
    dt = DT[dtype]
    x = randn(48, 768, dtype=dt, scale=2, shift=0.5)
    dy = randn(48, 768, dtype=dt, grad=False)
    layer = norm == "layer_norm"
    w, b = _params(768, dt, bias=layer)
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    bd = b.detach().double().requires_grad_() if layer else None

    def torch_norm(x, w, b):
        if layer:
            return F.layer_norm(x, (768,), w, b, 1e-5)
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (768,), w, 1e-5)
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-5).to(x.dtype) * w

    ours = ct.layer_norm(x, 768, w, b) if layer else ct.rms_norm(x, 768, w, 1e-5)
    theirs, ref = torch_norm(x, w, b), torch_norm(xd, wd, bd)
    check_like_torch(norm, ours, theirs, ref, dt)
    inputs, ref_inputs = [x, w] + ([b] if layer else []), [xd, wd] + ([bd] if layer else [])
    for name, g_ours, g_theirs, g_ref in zip(
            ("dx", "dweight", "dbias"), grads(ours, inputs, dy), grads(theirs, inputs, dy),
            grads(ref, ref_inputs, dy.double())):
        assert g_ours.dtype == dt
        check_like_torch(f"{norm} {name}", g_ours, g_theirs, g_ref, dt)


@pytest.mark.parametrize("dtype", list(DT))
def test_bias_only_layer_norm_gives_bias_grad(dtype):
    """A layer norm with a bias and no weight: bias.grad comes from cukern's backward op
    (torch.ops.cukern.layer_norm_backward's dbias), like PyTorch's."""
    dt = DT[dtype]
    x = randn(64, 3, 96, dtype=dt, scale=2, shift=0.5)
    b = randn(3, 96, dtype=dt)
    dy = randn(64, 3, 96, dtype=dt, grad=False)
    xd, bd = (t.detach().double().requires_grad_() for t in (x, b))
    ours = ct.layer_norm(x, (3, 96), None, b)
    theirs, ref = F.layer_norm(x, (3, 96), None, b), F.layer_norm(xd, (3, 96), None, bd)
    check_like_torch("y", ours, theirs, ref, dt)
    for name, g_ours, g_theirs, g_ref in zip(
            ("dx", "dbias"), grads(ours, (x, b), dy), grads(theirs, (x, b), dy),
            grads(ref, (xd, bd), dy.double())):
        assert g_ours.dtype == dt and g_ours.shape == g_ref.shape
        check_like_torch(f"bias-only layer_norm {name}", g_ours, g_theirs, g_ref, dt)
    _, mean, rstd = torch.ops.cukern.layer_norm(x.detach(), [3, 96], None, b.detach(), 1e-5)
    _, dw, db = torch.ops.cukern.layer_norm_backward(dy, x.detach(), mean, rstd, None,
                                                     b.detach())
    assert dw.numel() == 0 and db.shape == (3, 96)


@pytest.mark.parametrize("dtype", list(DT))
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_relu_like_torch(dtype, channels_last, training):
    """relu(batch_norm(x) + z) against F.batch_norm + relu: y, dx, dweight, dbias, dz; the
    parameters and statistics in float32 (the mixed-precision setup) for bfloat16 data."""
    dt = DT[dtype]
    shape = (8, 16, 7, 7)
    x = randn(*shape, dtype=dt, channels_last=channels_last, scale=2, shift=0.3)
    z = randn(*shape, dtype=dt, channels_last=channels_last)
    dy = randn(*shape, dtype=dt, grad=False, channels_last=channels_last)
    w, b = _params(16, torch.float32)
    rm0 = randn(16, dtype=torch.float32, grad=False, scale=0.1)
    rv0 = randn(16, dtype=torch.float32, grad=False).abs() + 0.5

    def run(x, w, b, z, ours):
        rm, rv = rm0.clone().to(w.dtype), rv0.clone().to(w.dtype)
        if ours:
            y = ct.batch_norm(x, rm, rv, w, b, training, 0.1, 1e-5, addend=z, relu=True)
        else:
            y = F.relu(F.batch_norm(x, rm, rv, w, b, training, 0.1, 1e-5) + z)
        return y, rm, rv

    inputs = [x, w, b, z]
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    (ours, rm, rv), (theirs, trm, trv) = run(*inputs, True), run(*inputs, False)
    ref, rrm, rrv = run(*ref_inputs, False)
    assert ours.dtype == dt
    assert ours.is_contiguous(memory_format=torch.channels_last) == channels_last
    check_like_torch("batch_norm", ours, theirs, ref, dt)
    check_like_torch("running_mean", rm, trm, rrm, torch.float32)
    check_like_torch("running_var", rv, trv, rrv, torch.float32)
    for name, g_ours, g_theirs, g_ref in zip(
            ("dx", "dweight", "dbias", "daddend"), grads(ours, inputs, dy),
            grads(theirs, inputs, dy), grads(ref, ref_inputs, dy.double())):
        check_like_torch(f"batch_norm {name}", g_ours, g_theirs, g_ref, dt)


@pytest.mark.parametrize("dtype", list(DT))
def test_permute_like_torch(dtype):
    x = randn(4, 6, 5, 7, dtype=DT[dtype])
    dy = randn(4, 5, 7, 6, dtype=DT[dtype], grad=False)
    y = ct.to_nhwc(x)
    assert y.is_contiguous() and torch.equal(y, x.permute(0, 2, 3, 1))
    assert torch.equal(grads(y, x, dy)[0], dy.permute(0, 3, 1, 2))
    y = ct.permute(x, (2, -1, 0, 1))
    assert torch.equal(y, x.permute(2, 3, 0, 1))
    assert torch.equal(ct.to_nchw(ct.to_nhwc(x)), x)


def test_batch_norm_running_stats_after_steps():
    """Three training steps then eval: the running statistics as F.batch_norm's, bfloat16 data
    with float32 statistics, and eval leaves them alone."""
    rm, rv = torch.zeros(12, device="cuda"), torch.ones(12, device="cuda")
    trm, trv = rm.clone(), rv.clone()
    for step in range(3):
        x = randn(16, 12, 5, 5, dtype=torch.bfloat16, grad=False, scale=1 + step, shift=step)
        ct.batch_norm(x, rm, rv, training=True, momentum=0.3, eps=1e-3)
        F.batch_norm(x, trm, trv, training=True, momentum=0.3, eps=1e-3)
        torch.testing.assert_close((rm, rv), (trm, trv), rtol=1e-5, atol=1e-6)
    before = rm.clone(), rv.clone()
    y = ct.batch_norm(x, rm, rv, training=False, eps=1e-3)
    torch.testing.assert_close((rm, rv), before, rtol=0, atol=0)
    ref = F.batch_norm(x.double(), rm.double(), rv.double(), training=False, eps=1e-3)
    assert rel(y, ref) < 1e-2


# ---------------------------------------------------------------------------------------------
# Tiny models: five SGD steps with cukern's ops and with PyTorch's, from one initialisation.

class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = (torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                       torch.nn.Linear(32, 10))

    def forward(self, x, ours: bool):
        h = self.fc1(x)
        if ours:
            h = torch.relu(ct.layer_norm(h, 32, self.ln.weight, self.ln.bias))
            return ct.log_softmax(self.fc2(h), dim=-1)
        h = torch.relu(F.layer_norm(h, (32,), self.ln.weight, self.ln.bias))
        return F.log_softmax(self.fc2(h), dim=-1)


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.conv2, self.bn2 = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 10)

    def bn(self, m, x, ours: bool, addend=None):
        if ours:
            return ct.batch_norm(x, m.running_mean, m.running_var, m.weight, m.bias,
                                 self.training, m.momentum, m.eps, addend=addend, relu=True)
        y = F.batch_norm(x, m.running_mean, m.running_var, m.weight, m.bias, self.training,
                         m.momentum, m.eps)
        return F.relu(y if addend is None else y + addend)

    def forward(self, x, ours: bool):
        h = self.bn(self.bn1, self.conv1(x), ours)
        h = self.bn(self.bn2, self.conv2(h), ours, addend=h)  # a residual block
        logits = self.fc(h.mean((2, 3)))
        return ct.log_softmax(logits, -1) if ours else F.log_softmax(logits, -1)


def _train(model, data, ours: bool) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, target in data:
        opt.zero_grad()
        loss = F.nll_loss(model(x, ours), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("make", ["mlp", "cnn", "cnn_channels_last"])
def test_tiny_model_trains_like_torch(make, no_tf32):
    model = (MLP() if make == "mlp" else CNN()).cuda()
    shape = (32, 16) if make == "mlp" else (8, 3, 12, 12)
    fmt = torch.channels_last if make == "cnn_channels_last" else torch.contiguous_format
    model = model.to(memory_format=fmt)
    x = torch.randn(*shape, device="cuda")
    if make == "cnn_channels_last":
        x = x.contiguous(memory_format=fmt)
    data = [(x, torch.randint(0, 10, (shape[0],), device="cuda"))] * 5  # fit one batch
    ours = copy.deepcopy(model)
    want, got = _train(model, data, False), _train(ours, data, True)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5), (got, want)
    assert got[-1] < got[0]
    for (name, a), b in zip(ours.state_dict().items(), model.state_dict().values()):
        if a.is_floating_point():  # weights and running statistics
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


# ---------------------------------------------------------------------------------------------
# torch.compile, layouts, opcheck, streams.

def test_compile_fullgraph_matches_eager():
    """The ops stay opaque calls in one graph (fullgraph: any graph break fails), the
    compiled function gives eager's values and gradients, and training batch norm updates the
    running statistics from inside the graph."""
    torch._dynamo.reset()

    def fn(x, w, b, rm, rv, bw):
        h = ct.batch_norm(x, rm, rv, bw, None, training=True, relu=True)
        h = ct.to_nhwc(h).flatten(1, 2) * 2
        h = ct.layer_norm(h, h.shape[-1:], w, b)
        return ct.log_softmax(ct.rms_norm(h, [8]) + 1, dim=-1)

    x = randn(4, 8, 5, 5, dtype=torch.float32)
    w, b, bw = (randn(8, dtype=torch.float32) for _ in range(3))
    rm, rv = torch.zeros(8, device="cuda"), torch.ones(8, device="cuda")
    crm, crv = rm.clone(), rv.clone()
    compiled = torch.compile(fn, fullgraph=True)
    want, got = fn(x, w, b, rm, rv, bw), compiled(x, w, b, crm, crv, bw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((crm, crv), (rm, rv), rtol=1e-6, atol=1e-6)
    dy = torch.randn_like(want)
    torch.testing.assert_close(grads(got, (x, w, b, bw), dy), grads(want, (x, w, b, bw), dy),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", list(DT))
def test_channels_last_batch_norm_stays_channels_last(dtype):
    x = randn(4, 6, 5, 7, dtype=DT[dtype], channels_last=True)
    w, b = _params(6, torch.float32)
    y = ct.batch_norm(x, None, None, w, b, training=True, relu=True)
    assert y.is_contiguous(memory_format=torch.channels_last)
    (dx,) = grads(y, x, torch.randn_like(y))
    assert dx.is_contiguous(memory_format=torch.channels_last)
    ref = F.relu(F.batch_norm(x.detach().double(), None, None, w.double(), b.double(), True))
    assert rel(y, ref) < FLOOR[DT[dtype]]


def _opcheck_cases():
    x, w, b = randn(3, 7), randn(7), randn(7)
    y = torch.softmax(x.detach(), -1)
    _, mean, rstd = torch.ops.cukern.layer_norm(x.detach(), [7], None, None, 1e-5)
    _, rms_rstd = torch.ops.cukern.rms_norm(x.detach(), [7], None, 1e-5)
    xc = randn(3, 4, 2, 3, channels_last=True)
    w4, b4, z = randn(4), randn(4), randn(3, 4, 2, 3, channels_last=True)
    y4, m4, i4, mask, _, _ = torch.ops.cukern.batch_norm(
        xc.detach(), None, None, w4.detach(), None, None, True, 0.1, 1e-5, True)
    rm, rv = randn(4, grad=False), randn(4, grad=False).abs() + 0.5
    return [
        ("softmax", (x, 1)), ("log_softmax", (x, 0)),
        ("softmax_backward", (x.detach(), y, -1)), ("log_softmax_backward", (x.detach(), y, 1)),
        ("layer_norm", (x, [7], w, b, 1e-5)), ("layer_norm", (x, [3, 7], None, None, 1e-5)),
        ("layer_norm_backward", (x.detach(), x.detach(), mean, rstd, w.detach())),
        ("layer_norm_backward", (x.detach(), x.detach(), mean, rstd, w.detach(), b.detach())),
        ("layer_norm_backward", (x.detach(), x.detach(), mean, rstd, None, b.detach())),
        ("rms_norm", (x, [7], w, 1e-6)),
        ("rms_norm_backward", (x.detach(), x.detach(), rms_rstd, None)),
        ("batch_norm", (xc, rm, rv, w4, b4, z, True, 0.1, 1e-5, True)),
        ("batch_norm", (xc, rm, rv, w4, None, None, False, 0.1, 1e-5, False)),
        ("batch_norm_backward", (y4, xc.detach(), m4, i4, w4.detach(), mask, True, True)),
        ("batch_stats", (xc,)), ("permute", (xc, [0, 2, 3, 1])),
    ]


def test_opcheck():
    """Schema, fake tensors against the kernels' real outputs (shapes, dtypes, strides),
    autograd registration, AOT dispatch with static and dynamic shapes."""
    for name, args in _opcheck_cases():
        torch.library.opcheck(getattr(torch.ops.cukern, name).default, args)


def test_kernels_run_on_torch_current_stream(monkeypatch):
    import cupy

    seen = []
    real = cukern.softmax

    def spy(*args, **kwargs):
        seen.append((cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr))
        return real(*args, **kwargs)

    monkeypatch.setattr(cukern, "softmax", spy)
    x = torch.randn(256, 1000, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        big = torch.randn(4096, 1000, device="cuda") * 3  # queued just before, same stream
        y, ybig = ct.softmax(x), ct.softmax(big)
    side.synchronize()
    assert seen[-1] == (x.device.index, side.cuda_stream)
    torch.testing.assert_close(ybig, torch.softmax(big, -1), rtol=1e-5, atol=1e-6)
    ct.softmax(x)
    assert seen[-1] == (x.device.index, torch.cuda.current_stream().cuda_stream)
    torch.testing.assert_close(y, torch.softmax(x, -1), rtol=1e-5, atol=1e-6)

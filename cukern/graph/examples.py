"""Example blocks and registered ops for the layout graph, written for NumPy and CuPy alike: a
ResNet-style block (batch norm, ReLU, depthwise conv, batch norm + residual + ReLU, softmax over
channels) and a ConvNeXt-style block (depthwise conv, layer norm over channels, 1x1 conv,
ReLU, 1x1 conv, residual). Tests and ``benchmarks/bench_graph.py`` use them; the convolutions
are plain array code (shifted multiply-adds and matmuls), not tuned kernels."""

from __future__ import annotations

import numpy as np

import cukern

from . import ops as gops

__all__ = ["dwconv3x3", "conv1x1", "resnet_block", "convnext_block", "make_resnet_block",
           "make_convnext_block", "resnet_params", "convnext_params"]


def _xp(a):
    if isinstance(a, np.ndarray):
        return np
    import cupy

    return cupy


def _dwconv(x, k, spatial: tuple[int, int]):
    """Depthwise 3x3 convolution, zero padding 1; ``k`` broadcasts against the channel axis."""
    xp = _xp(x)
    h, w = (x.shape[a] for a in spatial)
    pad = [(0, 0)] * x.ndim
    for a in spatial:
        pad[a] = (1, 1)
    p = xp.pad(x, pad)
    y = xp.zeros(x.shape, x.dtype)
    for i in range(3):
        for j in range(3):
            sl = [slice(None)] * x.ndim
            sl[spatial[0]], sl[spatial[1]] = slice(i, i + h), slice(j, j + w)
            y += p[tuple(sl)] * k[i, j]
    return y


def dwconv_nchw(x, k):
    """x (N, C, H, W), k (C, 1, 3, 3)."""
    c = x.shape[1]
    return _dwconv(x, k[:, 0].transpose(1, 2, 0).reshape(3, 3, c, 1, 1), (2, 3))


def dwconv_nhwc(x, k):
    """x (N, H, W, C), k (3, 3, C) (``weight_layout`` of the op)."""
    return _dwconv(x, k, (1, 2))


def _dw_weight(k):
    return _xp(k).ascontiguousarray(k[:, 0].transpose(1, 2, 0))


def conv1x1_nchw(x, w):
    """x (N, C, H, W), w (O, C) -> (N, O, H, W), as a batched matmul."""
    n, c, h, ww = x.shape
    y = _xp(x).matmul(w.astype(x.dtype), x.reshape(n, c, h * ww))
    return y.reshape(n, w.shape[0], h, ww)


def conv1x1_nhwc(x, wt):
    """x (N, H, W, C), wt (C, O) (``weight_layout``: w transposed) -> (N, H, W, O)."""
    n, h, w, c = x.shape
    return (x.reshape(-1, c) @ wt.astype(x.dtype)).reshape(n, h, w, wt.shape[1])


def _transposed(w):
    return _xp(w).ascontiguousarray(w.T)


dwconv3x3 = gops.register(None, layouts={"NCHW": dwconv_nchw, "NHWC": dwconv_nhwc},
                          weight_layout=_dw_weight, name="dwconv3x3")
conv1x1 = gops.register(None, layouts={"NCHW": conv1x1_nchw, "NHWC": conv1x1_nhwc},
                        weight_layout=_transposed, name="conv1x1",
                        shape=lambda xs, ws: (xs[0], ws[0], xs[2], xs[3]))


def make_resnet_block(dwconv):
    """The issue's example over a depthwise conv op ``dwconv(x, k)``: BN-ReLU, dwconv,
    BN + residual + ReLU, softmax over channels."""
    def resnet_block(x, p):
        h = cukern.batch_norm(x, p["rm1"], p["rv1"], p["w1"], p["b1"], training=True)
        h = gops.relu(h)
        h = dwconv(h, p["k1"])
        h = cukern.batch_norm(h, p["rm2"], p["rv2"], p["w2"], p["b2"], training=True)
        h = gops.relu(h + x)
        return cukern.softmax(h, axis=1)
    return resnet_block


def make_convnext_block(dwconv, conv1x1):
    """Depthwise conv, layer norm over channels, 1x1 conv (C -> 4C), ReLU, 1x1 conv,
    residual, over the ops given."""
    def convnext_block(x, p):
        h = dwconv(x, p["k"])
        h = gops.layer_norm(h, p["ln_w"], p["ln_b"], axis=1)
        h = gops.relu(conv1x1(h, p["w1"]))
        return conv1x1(h, p["w2"]) + x
    return convnext_block


resnet_block = make_resnet_block(dwconv3x3)
convnext_block = make_convnext_block(dwconv3x3, conv1x1)


def resnet_params(c: int, rng, xp=np, stat_dtype=np.float32) -> dict:
    """Parameters of :func:`resnet_block` for ``c`` channels (fresh random values)."""
    def vec(lo, hi):
        return xp.asarray(rng.uniform(lo, hi, c).astype(stat_dtype))
    return {"rm1": vec(-0.1, 0.1), "rv1": vec(0.5, 1.5), "w1": vec(0.5, 1.5),
            "b1": vec(-0.5, 0.5), "k1": xp.asarray(rng.standard_normal((c, 1, 3, 3)).astype(
                stat_dtype) / 3), "rm2": vec(-0.1, 0.1), "rv2": vec(0.5, 1.5),
            "w2": vec(0.5, 1.5), "b2": vec(-0.5, 0.5)}


def convnext_params(c: int, rng, xp=np, dtype=np.float32) -> dict:
    """Parameters of :func:`convnext_block` (weights of ``dtype``, the activations')."""
    def arr(shape, scale=1.0, shift=0.0):
        return xp.asarray((rng.standard_normal(shape) * scale + shift).astype(dtype))
    return {"k": arr((c, 1, 3, 3), 1 / 3), "ln_w": arr((c,), 0.1, 1.0), "ln_b": arr((c,), 0.1),
            "w1": arr((4 * c, c), c ** -0.5), "w2": arr((c, 4 * c), (4 * c) ** -0.5)}

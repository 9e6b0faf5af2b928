"""Softmax and log-softmax, forward and backward, along any axis of a CuPy (or DLPack) array."""

from __future__ import annotations

import numpy as np

from .. import plan as _plan
from .. import runner as c

__all__ = ["softmax", "log_softmax", "softmax_backward", "log_softmax_backward"]

_launches: dict[tuple, c.Launch] = c.BoundedDict()
# The fast path: (op, axis, shape, strides, dtype, pointer alignment, device) of a CuPy input
# already validated and planned with a fresh C-contiguous output -> its Launch; a backward's
# key (_key2) has both inputs' shapes, strides, dtypes and devices. PyTorch tensors on CuPy's
# current stream take it as TensorViews (_interop.tensor_view), their results allocated by PyTorch.
_fresh: dict[tuple, c.Launch] = c.BoundedDict()
_ndarray = c.cp.ndarray if c.cp is not None else None
_get_device = c.cp.cuda.runtime.getDevice if c.cp is not None else None
_tensor_view, _torch_views, _new = c.tensor_view, c.torch_views, c.new_array


def softmax(x, axis: int = -1, *, out=None):
    """Softmax along ``axis``: ``y = exp(x - max(x)) / sum(exp(x - max(x)))``.

    Parameters
    ----------
    x : cupy.ndarray or a GPU array with ``__dlpack__`` (PyTorch, JAX)
        float16, bfloat16 (``ml_dtypes.bfloat16``), float32 or float64, any shape and strides.
        Half-precision inputs are computed in float32; float and double in their own type.
    axis : int
        The axis to normalise over (default: the last).
    out : array, optional
        Where to write the result: same shape, dtype and device as ``x``, any strides. It may
        be ``x`` itself (in place); any other overlap with ``x`` is refused.

    Returns
    -------
    An array of ``x``'s shape and dtype, of the same kind as ``x`` (CuPy in, CuPy out; a
    PyTorch tensor or JAX array comes back as one, shared through DLPack without a copy).

    Notes
    -----
    Runs on ``x``'s GPU and CuPy's current stream (so CUDA-graph capture works). A row of all
    ``-inf`` gives NaN, as in NumPy and PyTorch; a NaN anywhere in a row gives a row of NaN.
    The last axis of a contiguous array (or rows with any row stride, as in ``x[:, :k]``) is
    the fast path. Another axis, or columns that are not adjacent in memory, is read in place
    with single-element accesses: correct, but without vector loads it moves memory in 32-byte
    sectors for 2- to 8-byte elements, so expect a few times the time of the last axis. Views
    whose other dimensions cannot be described by one stride each are copied first. ``axis``
    may have at most ``cukern.plan.MAX_COLS`` (2^31 - 4096) elements (ValueError past it).
    """
    if out is None and type(axis) is int:
        y = _fast("softmax", x, axis)
        if y is not None:
            return y
    return _run("softmax", ("x",), (x,), axis, out)


def log_softmax(x, axis: int = -1, *, out=None):
    """Log-softmax along ``axis``: ``y = (x - max(x)) - log(sum(exp(x - max(x))))``.

    Same arguments, dtypes, return kind and notes as :func:`softmax`.
    """
    if out is None and type(axis) is int:
        y = _fast("log_softmax", x, axis)
        if y is not None:
            return y
    return _run("log_softmax", ("x",), (x,), axis, out)


def softmax_backward(dy, y, axis: int = -1, *, out=None):
    """Gradient of softmax with respect to its input: ``dx = (dy - sum(dy * y)) * y``.

    ``dy`` is the gradient with respect to the softmax output ``y`` (the gradient first, as in
    every cukern backward and PyTorch's ``_softmax_backward_data``); both of one shape, dtype
    and device. Returns ``dx`` like :func:`softmax` returns ``y``; ``out=`` as there (it may
    be ``dy`` or ``y`` itself).
    """
    if out is None and type(axis) is int:
        dx = _fast_backward("softmax_backward", y, dy, axis)
        if dx is not None:
            return dx
    return _run("softmax_backward", ("y", "dy"), (y, dy), axis, out)  # the kernels' order


def log_softmax_backward(dy, y, axis: int = -1, *, out=None):
    """Gradient of log-softmax with respect to its input: ``dx = dy - exp(y) * sum(dy)``.

    ``dy`` is the gradient with respect to the log-softmax output ``y``; as
    :func:`softmax_backward`.
    """
    if out is None and type(axis) is int:
        dx = _fast_backward("log_softmax_backward", y, dy, axis)
        if dx is not None:
            return dx
    return _run("log_softmax_backward", ("y", "dy"), (y, dy), axis, out)  # the kernels' order


def _fast(op: str, x, axis: int):
    """The result for a CuPy input, or a PyTorch tensor on CuPy's current stream (its result a
    new tensor), whose layout was planned before; None otherwise."""
    if type(x) is _ndarray:
        v = x
    else:
        v = _tensor_view(x)
        if v is None:
            return None
    launch = _fresh.get((op, axis, v.shape, v.strides, v.dtype, v.data.ptr & 15,
                         v.data.device_id))
    if launch is None or launch.device_id != _get_device():
        return None
    if v is x:
        y = _new(x.shape, x.dtype)
        launch(x, y)
        return y
    y = v.empty(v.shape, v.dtype)
    launch(v, y)
    return y.tensor


def _key2(op: str, axis: int, y, dy) -> tuple:
    """A backward's fast-path key: (y, dy) as CuPy arrays, each pointer's offset in its 16-byte
    word (alignment, and whether the rows share it: Plan.shifted)."""
    return (op, axis, y.shape, y.strides, y.dtype, y.data.device_id, dy.shape, dy.strides,
            dy.dtype, dy.data.device_id, y.data.ptr & 15, dy.data.ptr & 15)


def _fast_backward(op: str, y, dy, axis: int):
    """dx for (y, dy) both CuPy arrays, or both PyTorch tensors on CuPy's current stream, of a
    layout planned before with a fresh output (as :func:`_fast`); None otherwise."""
    if type(y) is _ndarray and type(dy) is _ndarray:
        tensors = False
    elif type(y).__module__ == "torch":
        views = _torch_views((y, dy))
        if views is None:
            return None
        y, dy = views
        tensors = True
    else:
        return None
    launch = _fresh.get(_key2(op, axis, y, dy))
    if launch is None or launch.device_id != _get_device():
        return None
    dx = y.empty(y.shape, y.dtype) if tensors else _new(y.shape, y.dtype)
    launch(y, dy, dx)
    return dx.tensor if tensors else dx


@c.capture_safe
def _run(op: str, names: tuple, inputs: tuple, axis, out):
    adapted = [c.adapt(op, n, a) for n, a in zip(names, inputs)]
    arrays = [a.array for a in adapted]
    first = arrays[0]
    dtype = c.dtype_name(op, names[0], first)
    for n, a in zip(names[1:], arrays[1:]):
        c.check_same(op, names[0], first, n, a)
    ax = c.normalize_axis(op, axis, first.ndim)
    if first.ndim and first.shape[ax] > _plan.MAX_COLS:
        raise ValueError(f"{op}: {names[0]} has shape {tuple(first.shape)}: rows of "
                         f"{first.shape[ax]} along axis {ax}; at most {_plan.MAX_COLS} "
                         f"(2^31 - 4096) are supported (the kernels' 32-bit column index)")
    dev = first.data.device_id
    with c.on_device(dev):  # output, plan, compile and launch on the input's GPU
        o = c.output(op, adapted[0], out)
        if out is not None:
            c.check_aliasing(op, arrays, o)
        if first.size:
            launch = _launch(op, dtype, ax, arrays, o)
            if (out is None and launch is not None and type(axis) is int
                    and all(a.kind == "cupy" or a.same_stream for a in adapted)):
                if len(arrays) == 1:
                    _fresh[(op, axis, first.shape, first.strides, first.dtype,
                            first.data.ptr & 15, dev)] = launch
                else:
                    _fresh[_key2(op, axis, first, arrays[1])] = launch
        return c.handed_back(out, o) if out is not None else adapted[0].wrap(o)


def _launch(op: str, dtype: str, axis: int, arrays: list, o) -> c.Launch | None:
    """Plan (once per layout) and launch, with the arrays' device current; returns the Launch,
    or None when copies were made."""
    dev = arrays[0].data.device_id
    # each pointer's offset in its 16-byte word: the alignment, and whether the rows share it
    key = (op, dev, axis, dtype, arrays[0].shape, tuple(a.strides for a in arrays), o.strides,
           c.pointer_offsets((*arrays, o)))
    launch = _launches.get(key)
    if launch is None:
        layouts = [c.layout(a, axis) for a in arrays]
        out_layout = c.layout(o, axis)
        if any(lay is None for lay in layouts) or out_layout is None:
            _launch_copied(op, dtype, axis, arrays, o, layouts, out_layout)
            return None
        launch = _launches[key] = _plan_launch(op, dtype, dev, arrays, o, layouts + [out_layout])
    launch(*arrays, o)
    return launch


def _launch_copied(op, dtype, axis, arrays, o, layouts, out_layout) -> None:
    """Views that no single stride per side describes: run on contiguous copies."""
    arrays = [c.cp.ascontiguousarray(a) if lay is None else a for a, lay in zip(arrays, layouts)]
    if out_layout is None:
        tmp = c.cp.empty(o.shape, o.dtype)
        _launch(op, dtype, axis, arrays, tmp)
        o[...] = tmp
    else:
        _launch(op, dtype, axis, arrays, o)


def _plan_launch(op, dtype, dev, arrays, o, views) -> c.Launch:
    first = views[0]
    strided = not all(v.contiguous_rows for v in views)
    plan = c.plan_for(op, dtype, dev, first.rows, first.cols,
                      [a.data.ptr for a in arrays] + [o.data.ptr], [v.s_outer for v in views],
                      strided=strided)
    return c.Launch(plan, dev, _tail(views))


def _tail(views) -> tuple:
    """The kernels' scalar arguments: rows, cols, inner, then each array's three strides."""
    first = views[0]
    tail = [np.int64(first.rows), np.int32(first.cols), np.int64(first.inner)]
    for v in views:
        tail += [np.int64(v.s_outer), np.int64(v.s_inner), np.int64(v.s_col)]
    return tuple(tail)


def run_plan(plan: _plan.Plan, *arrays, axis: int = -1, out=None):
    """Launch ``plan`` as given on CuPy arrays (no planning): for tests and benchmarks that pin
    a variant. The arrays are the op's, in its order (a backward's ``dy, y``); they must match
    the plan's op, dtype, rows, cols, layout and alignment, which is checked only as far as
    rows, cols and dtype."""
    if plan.op.endswith("_backward"):
        arrays = arrays[::-1]  # the kernels read (y, dy)
    ax = c.normalize_axis(plan.op, axis, arrays[0].ndim)
    dev = arrays[0].data.device_id
    with c.on_device(dev):
        o = c.cp.empty(arrays[0].shape, arrays[0].dtype) if out is None else out
        layouts = [c.layout(a, ax) for a in (*arrays, o)]
        if any(v is None for v in layouts) or layouts[0][:2] != (plan.rows, plan.cols):
            raise ValueError(f"run_plan: arrays do not match the plan's rows and cols: {plan}")
        if c.DTYPE_NAMES.get(arrays[0].dtype) != plan.dtype:
            raise TypeError(f"run_plan: dtype {arrays[0].dtype} is not the plan's {plan.dtype}")
        c.Launch(plan, dev, _tail(layouts))(*arrays, o)
    return o


def last_plan(op: str):
    """The most recently cached plan for ``op`` (for tests and debugging)."""
    for key in reversed(list(_launches)):
        if key[0] == op:
            return _launches[key].plan
    return None

"""Permute: any reordering of the axes of a CuPy (or DLPack) array, materialised, and the
NCHW <-> channels-last conversions built on it."""

from __future__ import annotations

from .. import _compile
from .. import runner as c
from .._launch import ByValue, RawLaunch
from ..families import permute as fam
from ..plan import permute as pp
from ..plan.permute import check_dtype

__all__ = ["permute", "to_nhwc", "to_nchw", "plan_for", "run_plan", "last_plan",
           "check_dtype", "nhwc_axes", "nchw_axes"]

_launches: dict[tuple, _Launch] = c.BoundedDict()
# The fast path: (shape, strides, dtype, axes, pointer alignment, device) of a CuPy input (or a
# PyTorch tensor's view, on CuPy's stream) already validated and planned with a fresh
# C-contiguous output -> (Launch, output shape).
_fresh: dict[tuple, tuple] = c.BoundedDict()
_last: list = [None]  # the plan of the latest launch
_ndarray = c.cp.ndarray if c.cp is not None else None
_get_device = c.cp.cuda.runtime.getDevice if c.cp is not None else None
_tensor_view = c.tensor_view
_DEFAULT_SMEM = 48 * 1024  # dynamic shared memory a kernel may use without opting in


def permute(x, axes=None, *, out=None):
    """``numpy.transpose(x, axes)``, materialised: ``y[i_0, ..., i_{n-1}] = x[j]`` with
    ``j[axes[k]] = i_k``.

    Parameters
    ----------
    x : cupy.ndarray or a GPU array with ``__dlpack__`` (PyTorch, JAX)
        Any dtype of 1, 2, 4, 8 or 16 bytes (bool, int8..int64, uint8..uint64, float16,
        bfloat16, float32, float64, complex64, complex128), rank 0 to 8, any strides (views,
        negative strides, any offset). Values are moved as bits: NaN payloads and -0.0 survive.
    axes : sequence of ints, or None
        A permutation of ``range(x.ndim)``; negative axes count from the end; None reverses
        the axes (NumPy's rules).
    out : array, optional
        Where to write the result: shape ``tuple(x.shape[a] for a in axes)``, x's dtype and
        device, any strides (no two elements at one address). It may not overlap ``x``.

    Returns
    -------
    The permuted array: a new C-contiguous array of ``x``'s kind (CuPy in, CuPy out; a
    PyTorch tensor comes back as a new contiguous tensor, a JAX array as a JAX array, through
    DLPack), or ``out``.

    Notes
    -----
    Runs on ``x``'s GPU and CuPy's current stream. The permutation is simplified first (size-1
    axes dropped, axes that stay adjacent merged: NCHW -> NHWC is a batched 2-D transpose,
    an identity a copy); ``cukern.explain("permute", shape, dtype, axes=...)`` shows the plan.
    An empty array launches nothing.

    Raises
    ------
    TypeError
        x or out not a GPU array, an unsupported dtype, axes not ints, out of another dtype,
        out= with a JAX array.
    ValueError
        Rank over 8, axes not a permutation (wrong length, out of range, repeated), out of
        another shape or device, out with overlapping elements or overlapping x.
    """
    if out is None:
        y = _fast(x, axes) if type(x) is _ndarray else _fast_torch(x, axes)
        if y is not None:
            return y
    return _run("permute", x, axes, out)


def to_nhwc(x, *, out=None):
    """(N, C, *spatial) -> (N, *spatial, C) for rank 3 to 5: ``permute(x, (0, 2, ..., 1))``,
    materialised (a C-contiguous channels-last array). Same dtypes, kinds and ``out`` as
    :func:`permute`."""
    return _convert("to_nhwc", x, nhwc_axes, "(N, C, *spatial)", out)


def to_nchw(x, *, out=None):
    """(N, *spatial, C) -> (N, C, *spatial) for rank 3 to 5, the inverse of :func:`to_nhwc`:
    ``permute(x, (0, n - 1, 1, ..., n - 2))``."""
    return _convert("to_nchw", x, nchw_axes, "(N, *spatial, C)", out)


def _convert(fn: str, x, axes_of, layout: str, out):
    if type(x) is _ndarray:
        nd = x.ndim
        if out is None and 3 <= nd <= 5:
            y = _fast(x, axes_of(nd))
            if y is not None:
                return y
    elif type(x).__module__ == "torch" and out is None and 3 <= x.ndim <= 5:
        y = _fast_torch(x, axes_of(x.ndim))
        if y is not None:
            return y
        nd = x.ndim
    else:
        nd = c.adapt(fn, "x", x).array.ndim
    if not 3 <= nd <= 5:
        raise ValueError(f"{fn}: x has shape {tuple(x.shape)} ({nd} dimensions), expected 3 to "
                         f"5 dimensions {layout}")
    return _run(fn, x, axes_of(nd), out)


def _fast(x, axes):
    """The result for a CuPy input (or a tensor's TensorView) whose layout and axes were
    planned before, of its kind; or None."""
    if not (axes is None or type(axes) is tuple or type(axes) is list):
        return None
    key = (x.shape, x.strides, x.dtype, axes if type(axes) is not list else tuple(axes),
           x.data.ptr & 15, x.data.device_id)
    hit = _fresh.get(key)
    # (1.0, 0) finds the entry of (1, 0): only plain ints take the fast path
    if hit is None or hit[0].device_id != _get_device() or (
            axes is not None and not all(type(a) is int for a in axes)):
        return None
    y = c.new_array(hit[1], x.dtype) if type(x) is _ndarray else x.empty(hit[1], x.dtype)
    hit[0](x, y)
    return y


def _fast_torch(x, axes):
    """:func:`_fast` for a PyTorch tensor on CuPy's current stream, the result a new tensor;
    None otherwise."""
    v = _tensor_view(x)
    y = _fast(v, axes) if v is not None else None
    return y.tensor if y is not None else None


def nhwc_axes(ndim: int) -> tuple[int, ...]:
    """The axes of NCHW -> channels last for an array of ``ndim`` dimensions."""
    return (0, *range(2, ndim), 1)


def nchw_axes(ndim: int) -> tuple[int, ...]:
    """The axes of channels last -> NCHW for an array of ``ndim`` dimensions."""
    return (0, ndim - 1, *range(1, ndim - 1))


def plan_for(x, axes=None, *, out=None) -> pp.PermutePlan | None:
    """The plan :func:`permute` runs for ``x`` (and ``out``) without launching it, or None for
    an empty array (for tests and benchmarks)."""
    fn = "permute"
    xa, axes, o, _ = _validate(fn, x, axes, out)
    if xa.size == 0:
        return None
    with c.on_device(xa.data.device_id):
        if o is None:
            o = c.cp.empty(tuple(xa.shape[a] for a in axes), xa.dtype)
        return _get_launch(xa, o, axes).plan


def run_plan(plan: pp.PermutePlan, x, y) -> None:
    """Launch ``plan`` as given on CuPy arrays x and y (no planning): for tests and benchmarks
    that pin a kernel. x and y must have the layouts and alignment the plan was made for; only
    the element size and count are checked."""
    if x.itemsize != plan.itemsize or x.size != plan.numel or y.size != x.size:
        raise ValueError(f"run_plan: arrays of {x.size} x {x.itemsize}-byte elements do not "
                         f"match the plan's {plan.numel} x {plan.itemsize}")
    dev = x.data.device_id
    with c.on_device(dev):
        _Launch(plan, dev)(x, y)


def last_plan() -> pp.PermutePlan | None:
    """The plan of the latest permute launch (for tests and debugging), or None."""
    return _last[0]


def _validate(fn: str, x, axes, out):
    """(x as CuPy, axes normalised, out as CuPy or None, x's Adapted)."""
    ax = c.adapt(fn, "x", x)
    xa = ax.array
    pp.check_dtype(fn, "x", xa.dtype)
    if xa.ndim > pp.MAX_DIMS:
        raise ValueError(f"{fn}: x has {xa.ndim} dimensions (shape {tuple(xa.shape)}); at most "
                         f"{pp.MAX_DIMS} are supported")
    axes = pp.normalize_axes(axes, xa.ndim, fn)
    if any(s % xa.itemsize for s in xa.strides):  # a reinterpreted view: copy it (on its GPU)
        with c.on_device(xa.data.device_id):
            xa = c.cp.ascontiguousarray(xa)
    o = None
    if out is not None:
        if ax.kind == "jax":
            raise TypeError(f"{fn}: out= is not supported for JAX arrays (they are immutable)")
        o = c.adapt(fn, "out", out, out=True).array
        check_out(fn, xa, axes, o)
    return xa, axes, o, ax


def check_out(fn: str, xa, axes, o) -> None:
    """``o`` must have the permuted shape, x's dtype and device, no two elements at one
    address, and no memory in common with x."""
    want = tuple(xa.shape[a] for a in axes)
    if tuple(o.shape) != want:
        raise ValueError(f"{fn}: out has shape {tuple(o.shape)}, expected {want} (x's shape "
                         f"{tuple(xa.shape)} permuted by axes {axes})")
    if o.dtype != xa.dtype:
        raise TypeError(f"{fn}: out has dtype {o.dtype}, expected {xa.dtype} (the dtype of x)")
    if o.data.device_id != xa.data.device_id:
        raise ValueError(f"{fn}: out is on GPU {o.data.device_id} but x is on GPU "
                         f"{xa.data.device_id}")
    if any(s % o.itemsize for s in o.strides):
        raise ValueError(f"{fn}: out has strides {o.strides}, not multiples of its "
                         f"{o.itemsize}-byte elements")
    if any(s == 0 and n > 1 for s, n in zip(o.strides, o.shape)):
        raise ValueError(f"{fn}: out has overlapping elements (strides {o.strides}); it must "
                         f"be writable element by element")
    if o.size and xa.size and c.cp.may_share_memory(xa, o):
        raise ValueError(f"{fn}: out overlaps x (a permute cannot run in place); pass a "
                         f"separate array")


@c.capture_safe
def _run(fn: str, x, axes, out):
    given = tuple(axes) if type(axes) is list else axes  # the fast path's key
    xa, axes, o, ax = _validate(fn, x, axes, out)
    out_shape = tuple(xa.shape[a] for a in axes)
    dev = xa.data.device_id
    with c.on_device(dev):
        y = o if o is not None else c.cp.empty(out_shape, xa.dtype)
        if xa.size:
            launch = _get_launch(xa, y, axes)
            launch(xa, y)
            _last[0] = launch.plan
            # x itself (or a same-stream tensor's view), not a copy _validate made
            if (o is None and (x is xa or ax.same_stream and xa is ax.array)
                    and _plain(given)):
                _fresh[(xa.shape, xa.strides, xa.dtype, given, xa.data.ptr & 15, dev)] = \
                    (launch, out_shape)
        if out is not None:
            return c.handed_back(out, o)
    return ax.wrap(y)


def _plain(axes) -> bool:
    """None or a tuple of ints: axes the fast path keys on."""
    return axes is None or type(axes) is tuple and all(type(a) is int for a in axes)


class _Launch(RawLaunch):
    """A planned, compiled permute kernel with its argument struct: the cached result of
    planning one layout. Call it with (x, y)."""

    __slots__ = ("plan", "device_id")

    def __init__(self, plan: pp.PermutePlan, device_id: int):
        """Compiles and configures the kernel: call it with ``device_id`` current."""
        self.plan = plan
        self.device_id = device_id
        kern = _compile.get_kernel(fam.SOURCE, plan.kernel, device_id)
        if plan.smem > _DEFAULT_SMEM and kern.max_dynamic_shared_size_bytes < plan.smem:
            kern.max_dynamic_shared_size_bytes = plan.smem
        super().__init__(kern.kernel.ptr, (plan.grid,), (plan.block[0], plan.block[1]),
                         plan.smem, (ByValue(fam.kernel_args(plan)),))


def _align(ptr: int) -> int:
    """The pointer's alignment in bytes, capped at 16."""
    low = ptr & 15
    return 16 if low == 0 else low & -low


def _get_launch(xa, y, axes) -> _Launch:
    """The cached launch for x's and y's layout (planned and compiled on first use)."""
    dev = xa.data.device_id
    key = (xa.shape, xa.strides, y.strides, axes, xa.itemsize, xa.data.ptr & 15,
           y.data.ptr & 15, dev)
    launch = _launches.get(key)
    if launch is None:
        item = xa.itemsize
        in_st = tuple(s // item for s in xa.strides)
        out_st = tuple(s // item for s in y.strides)
        _, dims = pp.output_dims(xa.shape, in_st, axes, out_st)
        simple = pp.simplify([d.size for d in dims], [d.in_stride for d in dims],
                             [d.out_stride for d in dims])
        plan = pp.plan_permute(simple, item, c.device_spec(dev), in_align=_align(xa.data.ptr),
                               out_align=_align(y.data.ptr), signature=fam.name_expression,
                               label=f"{tuple(xa.shape)} axes {axes}")
        launch = _launches[key] = _Launch(plan, dev)
    return launch

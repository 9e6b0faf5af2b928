"""``cukern.explain``: the plan the dispatcher would choose, without running anything."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import plan as _plan
from . import registry
from ._device import DeviceSpec

__all__ = ["explain", "dtype_name", "permute_dtype"]

_DTYPE_ALIASES = {"float16": "float16", "half": "float16", "f2": "float16",
                  "bfloat16": "bfloat16", "bf16": "bfloat16",
                  "float32": "float32", "float": "float32", "f4": "float32",
                  "float64": "float64", "double": "float64", "f8": "float64"}


def dtype_name(dtype) -> str:
    """Normalise a dtype given as a string, NumPy/CuPy dtype or type to cukern's name."""
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[dtype.lower()]
    try:
        name = np.dtype(dtype).name
    except TypeError:
        raise TypeError(f"explain: dtype {dtype!r} is not a dtype") from None
    if name not in _plan.ITEMSIZE:
        raise TypeError(f"explain: dtype {name} is not supported; expected float16, bfloat16, "
                        f"float32 or float64")
    return name


def explain(op: str, shape, dtype, axis: int | None = None, device=None, *,
            weight: bool = False, bias: bool = False, residual: bool = False,
            training: bool = True, layout: str = "NCHW", relu: bool = False,
            addend: bool = False, axes=None, param_dtype=None):
    """The plan ``op`` would run for a C-contiguous array of ``shape`` and ``dtype``.

    ``permute`` takes ``axes`` (a permutation of the axes, NumPy's rules: None reverses them)
    and any dtype of 1, 2, 4, 8 or 16 bytes; it returns a
    :class:`cukern.plan.permute.PermutePlan` (the simplified permutation, the kernel, its tile
    and vector widths, grid, block and index width).

    ``axis``: the reduced axis of a row-wise op (default -1), the channel axis of the batch-norm
    family (default 1). Batch norm (``batch_norm``, ``batch_norm_backward``, ``batch_stats``)
    also takes ``training``, ``layout`` ("NCHW": C order; "NHWC": channels last in memory),
    ``relu`` (forward: fused ReLU writing its mask; backward: dy masked) and ``addend``
    (forward: added before the ReLU; backward: daddend written); it returns a
    :class:`cukern.plan.batch_norm.BatchNormPlan` (layout, passes, grids, what stays on chip).

    ``device``: a :class:`DeviceSpec` or a preset's name (``"h100"``, ``"h200"``, ``"a100"``:
    :data:`cukern._device.PRESETS`; plans from its occupancy model, no GPU needed), a CUDA
    device id (the driver's occupancy for the compiled kernels), or None: the current GPU when
    one is visible, else ``DeviceSpec.h100()``. ``weight``, ``bias``, ``residual``: whether the
    call passes them (the norms; ``rms_norm`` takes no bias, the backwards no residual, and
    ``layer_norm_backward``'s bias alone plans as a weight): they choose the kernel too.
    ``param_dtype``: the norms' weight and bias dtype (None: the data's); ``"float32"`` with
    float16 or bfloat16 data plans the kernel for float32 parameters.
    ``print(plan)`` shows it readably. ``op`` is a name of ``cukern.registry.OPS``
    (``"layer_norm"``) or its command-line spelling (``"layer-norm"``).
    """
    if isinstance(op, str):
        op = op.replace("-", "_")
    if op not in registry.OPS:
        raise ValueError(f"explain: unknown op {op!r}; expected one of {sorted(registry.OPS)}")
    if registry.OPS[op].family == "permute":
        given = {"axis": axis is not None, "weight": weight, "bias": bias,
                 "residual": residual, "relu": relu, "addend": addend,
                 "training": training is not True, "layout": layout != "NCHW"}
        wrong = [name for name, on in given.items() if on]
        if wrong:
            raise ValueError(f"explain: permute takes axes, not {', '.join(wrong)}")
        return _explain_permute(shape, dtype, axes, device)
    if axes is not None:
        raise ValueError(f"explain: axes is permute's; {op} takes axis")
    if param_dtype is not None and registry.OPS[op].family != "norm":
        raise ValueError(f"explain: param_dtype is the norms'; {op} takes none")
    if not registry.OPS[op].rowwise:
        if residual:
            raise ValueError(f"explain: {op} takes no residual (pass addend=True)")
        return _explain_batch_norm(op, shape, dtype, 1 if axis is None else axis, device,
                                   training=training, layout=layout, relu=relu, addend=addend)
    axis = -1 if axis is None else axis
    flags = {"weight": weight, "bias": bias, "residual": residual}
    flags_bool = all(isinstance(v, (bool, np.bool_)) for v in flags.values())
    if op == "layer_norm_backward" and flags_bool and bias:
        flags.update(weight=True, bias=False)  # dbias alone: the kernels with a weight of ones
    switches = _switches(op, flags)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(not isinstance(n, (int, np.integer)) or n < 0 for n in shape):
        raise ValueError(f"explain: shape must be non-negative ints, got {shape}")
    name = dtype_name(dtype)
    if param_dtype is not None and dtype_name(param_dtype) != name:
        if dtype_name(param_dtype) != "float32" or name not in ("float16", "bfloat16"):
            raise ValueError(f"explain: param_dtype {dtype_name(param_dtype)} with {name} "
                             f"data; expected {name}, or float32 for float16 and bfloat16")
        if not (switches.weight or switches.bias):
            raise ValueError("explain: param_dtype needs weight=True or bias=True")
        switches = dataclasses.replace(switches, float32_params=True)
    nd = max(len(shape), 1)
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -nd <= axis < nd:
        raise ValueError(f"explain: axis {axis!r} is out of range for shape {shape}")
    axis = int(axis) % nd
    full = shape or (1,)
    cols = full[axis]
    rows = math.prod(full[:axis]) * math.prod(full[axis + 1:])
    if rows == 0 or cols == 0:
        raise ValueError(f"explain: shape {shape} is empty; no kernel runs for it")
    strided = math.prod(full[axis + 1:]) > 1
    spec, occupancy = _resolve(device)
    return _plan.plan_rowwise(op, rows, cols, name, spec, occupancy, strided=strided,
                              switches=switches)


def _explain_batch_norm(op: str, shape, dtype, axis, device, *, training, layout, relu,
                        addend):
    from .plan import batch_norm as bnplan

    for name, value in (("training", training), ("relu", relu), ("addend", addend)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"explain: {name} must be True or False, got {value!r}")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(not isinstance(n, (int, np.integer)) or n < 0 for n in shape):
        raise ValueError(f"explain: shape must be non-negative ints, got {shape}")
    if len(shape) < 2:
        raise ValueError(f"explain: {op} needs at least 2 dimensions (N, C, ...), got {shape}")
    nd = len(shape)
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -nd <= axis < nd:
        raise ValueError(f"explain: axis {axis!r} is out of range for shape {shape}")
    if not isinstance(layout, str) or layout.upper() not in ("NCHW", "NHWC"):
        raise ValueError(f"explain: layout must be 'NCHW' or 'NHWC', got {layout!r}")
    name = dtype_name(dtype)
    if math.prod(shape) == 0:
        raise ValueError(f"explain: shape {shape} is empty; no kernel runs for it")
    strides = bnplan.layout_strides(shape, int(axis), layout)
    view = bnplan.channel_view(shape, strides, int(axis) % nd)
    spec, _ = _resolve(device)
    # the ReLU mask: what a training step keeps for its backward (eval writes none)
    mask = relu and (op == "batch_norm_backward" or op == "batch_norm" and training)
    return bnplan.plan_batch_norm(op, view, name, spec, training=bool(training),
                                  relu=bool(relu) and op == "batch_norm", addend=bool(addend),
                                  mask=bool(mask), signature=registry.OPS[op].signature)


def permute_dtype(dtype) -> np.dtype:
    """A dtype the permute kernels move (any of 1, 2, 4, 8 or 16 bytes; "bfloat16" needs
    ml_dtypes), given as a name, NumPy/CuPy dtype or type."""
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        try:
            from ml_dtypes import bfloat16
        except ImportError:  # pragma: no cover
            raise TypeError("explain: bfloat16 needs the ml_dtypes package") from None
        return np.dtype(bfloat16)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"explain: dtype {dtype!r} is not a dtype") from None
    from .plan.permute import check_dtype

    return check_dtype("explain", "dtype", dt)


def _explain_permute(shape, dtype, axes, device):
    from .plan import permute as pp

    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0
           for n in shape):
        raise ValueError(f"explain: shape must be non-negative ints, got {shape}")
    if len(shape) > pp.MAX_DIMS:
        raise ValueError(f"explain: shape {shape} has {len(shape)} dimensions; permute takes "
                         f"at most {pp.MAX_DIMS}")
    dt = permute_dtype(dtype)
    axes = pp.normalize_axes(axes, len(shape), "explain")
    if math.prod(shape) == 0:
        raise ValueError(f"explain: shape {shape} is empty; no kernel runs for it")
    spec, _ = _resolve(device)
    _, dims = pp.output_dims(shape, pp.c_strides(shape), axes)
    simple = pp.simplify([d.size for d in dims], [d.in_stride for d in dims],
                         [d.out_stride for d in dims])
    return pp.plan_permute(simple, dt.itemsize, spec,
                           signature=registry.OPS["permute"].signature,
                           label=f"{dt.name} {shape} axes {axes}")


def _switches(op: str, flags: dict[str, bool]) -> _plan.Switches:
    """The planner's switches for the arguments a call passes."""
    pol = registry.policy(op)
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"explain: {name} must be True or False, got {value!r}")
    sw = _plan.Switches(**{name: bool(flags[name]) for name in pol.switches})
    for name, value in flags.items():
        if value and (name not in pol.switches or sw not in pol.switch_sets):
            raise ValueError(f"explain: {op} takes no {name}")
    return sw


def _resolve(device):
    if isinstance(device, str):  # a preset's name
        try:
            return DeviceSpec.preset(device), None
        except ValueError as err:
            raise ValueError(f"explain: device: {err}") from None
    if isinstance(device, DeviceSpec):
        if device.device_id is None:
            return device, None
        device = device.device_id
    if device is None:
        try:
            import cupy

            device = cupy.cuda.runtime.getDevice()
        except Exception:
            return DeviceSpec.h100(), None
    if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
        raise TypeError(f"explain: device must be a DeviceSpec, a preset's name, a device id "
                        f"or None, got {type(device).__name__}")
    from . import runner

    return runner.device_spec(int(device)), runner.driver_occupancy(int(device))

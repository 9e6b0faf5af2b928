"""cukern: fast CUDA kernels for CuPy arrays, with no deep-learning framework.

    >>> import cupy as cp, cukern
    >>> x = cp.random.randn(4096, 1000, dtype=cp.float32)
    >>> y = cukern.softmax(x)
    >>> print(cukern.explain("softmax", x.shape, x.dtype))
"""

from __future__ import annotations

from . import _env  # noqa: F401  first: makes CuPy's kernel-cache folder work (see _env)
from ._capture import capture_memory_bytes, release_capture_memory
from ._device import DeviceSpec, UnsupportedDeviceError
from ._explain import explain
from ._prepare import Prepared, prepare
from .ops.batch_norm import batch_norm, batch_norm_backward, batch_stats
from .ops.layer_norm import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward
from .ops.permute import permute, to_nchw, to_nhwc
from .ops.softmax import log_softmax, log_softmax_backward, softmax, softmax_backward
from .plan import Plan, Switches, Variant

__version__ = "0.1.0"

__all__ = [
    "DeviceSpec",
    "Plan",
    "Prepared",
    "Switches",
    "UnsupportedDeviceError",
    "Variant",
    "batch_norm",
    "batch_norm_backward",
    "batch_stats",
    "capture_memory_bytes",
    "explain",
    "layer_norm",
    "layer_norm_backward",
    "log_softmax",
    "log_softmax_backward",
    "permute",
    "prepare",
    "release_capture_memory",
    "rms_norm",
    "rms_norm_backward",
    "softmax",
    "softmax_backward",
    "to_nchw",
    "to_nhwc",
    "__version__",
]

"""cukern over Dask arrays: every op on arrays larger than one GPU, or spread over several.

    >>> import dask.array as da, cupy, cukern.dask as cd
    >>> x = da.from_array(big, chunks=(65536, -1)).map_blocks(cupy.asarray)
    >>> y = cd.softmax(x, axis=-1)                      # lazy; .compute() or .persist()

Each op takes the single-GPU op's arguments with Dask arrays for the full-size ones and
returns lazy Dask arrays. A CuPy block runs the cukern op on its GPU; a NumPy block runs the
float64 reference of :mod:`cukern.reference`, cast to the op's dtypes (so graphs can be built
and checked without a GPU). Row-wise ops need the reduced axes whole in a block and rechunk
along them only, with a :class:`PerformanceWarning`; reductions across blocks (dweight and
dbias, batch-norm statistics) are tree reductions. Works on any Dask scheduler: threaded on
one GPU, ``distributed`` and dask-cuda's ``LocalCUDACluster`` (one worker per GPU).

Needs the ``dask`` extra: ``pip install "cukern[dask]"``.
"""

from __future__ import annotations

try:
    import dask.array  # noqa: F401
except ImportError as err:  # pragma: no cover - tested in a subprocess
    raise ImportError(f"cukern.dask needs Dask ({err}); install it with: "
                      f'pip install "cukern[dask]"') from err

from . import _serialize
from ._batch_norm import batch_norm, batch_norm_backward, batch_stats
from ._blocks import PerformanceWarning
from ._permute import permute, to_nchw, to_nhwc
from ._rowwise import (
    layer_norm,
    layer_norm_backward,
    log_softmax,
    log_softmax_backward,
    rms_norm,
    rms_norm_backward,
    softmax,
    softmax_backward,
)

_serialize.install()  # bfloat16 CuPy blocks keep their dtype between processes

__all__ = ["PerformanceWarning", "batch_norm", "batch_norm_backward", "batch_stats",
           "layer_norm", "layer_norm_backward", "log_softmax", "log_softmax_backward",
           "permute", "rms_norm", "rms_norm_backward", "softmax", "softmax_backward",
           "to_nchw", "to_nhwc"]

"""bfloat16 CuPy blocks that cross processes keep their dtype.

``distributed`` sends a CuPy array with ``__cuda_array_interface__``'s type string, which for
``ml_dtypes.bfloat16`` is the raw ``'<V2'``: a block sent between workers, or gathered by the
client, came back as 2-byte voids. The CuPy serializers registered by ``distributed`` are
wrapped so that a bfloat16 array's header also names its dtype, and the receiver views the
array as bfloat16 again. Every process that imports :mod:`cukern.dask` (the client, and each
worker when it unpickles a task of cukern's) installs the wrappers; other dtypes pass through
unchanged.
"""

from __future__ import annotations

_KEY = "cukern-dtype"


def install() -> bool:
    """Wraps distributed's CuPy (de)serializers once; False where distributed or CuPy is
    missing (nothing crosses processes then)."""
    try:
        import cupy
        import distributed.protocol.cupy  # noqa: F401  (registers the functions we wrap)
        from distributed.protocol.cuda import cuda_deserialize, cuda_serialize
        from distributed.protocol.serialize import dask_deserialize, dask_serialize
        from ml_dtypes import bfloat16
    except ImportError:
        return False
    bf16 = cupy.dtype(bfloat16)
    for ser, de in ((cuda_serialize, cuda_deserialize), (dask_serialize, dask_deserialize)):
        inner_ser, inner_de = ser.dispatch(cupy.ndarray), de.dispatch(cupy.ndarray)
        if getattr(inner_ser, "_cukern", False):
            continue
        ser.register(cupy.ndarray)(_serializer(inner_ser, bf16))
        de.register(cupy.ndarray)(_deserializer(inner_de, bf16))
    return True


def _serializer(inner, bf16):
    def serialize(x):
        header, frames = inner(x)
        if x.dtype == bf16:
            header[_KEY] = "bfloat16"
        return header, frames

    serialize._cukern = True
    return serialize


def _deserializer(inner, bf16):
    def deserialize(header, frames):
        arr = inner(header, frames)
        return arr.view(bf16) if header.get(_KEY) == "bfloat16" else arr

    deserialize._cukern = True
    return deserialize

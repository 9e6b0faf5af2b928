"""Permute and the NCHW <-> channels-last conversions over Dask arrays: the blocks are
reordered by the index strings of one blockwise call, and each block is permuted by
:func:`cukern.permute` (a NumPy block: materialised ``numpy.transpose``)."""

from __future__ import annotations

import dask.array as da

from .. import reference
from ..ops.permute import nchw_axes, nhwc_axes
from ..plan.permute import check_dtype, normalize_axes
from . import _blocks as B

__all__ = ["permute", "to_nhwc", "to_nchw"]


def permute(x, axes=None):
    """:func:`cukern.permute` of a Dask array: ``numpy.transpose(x, axes)``, materialised.

    Block ``(i_0, .., i_n-1)`` of the result is block ``j`` of x permuted (``j[axes[k]] =
    i_k``): the chunks are permuted with the axes and no data crosses blocks. Any dtype the op
    moves; ``axes`` by NumPy's rules (None reverses). Returns a lazy Dask array."""
    return _permute("permute", x, axes)


def to_nhwc(x):
    """(N, C, *spatial) -> (N, *spatial, C) of a Dask array of rank 3 to 5
    (:func:`cukern.to_nhwc` block by block)."""
    return _convert("to_nhwc", x, nhwc_axes, "(N, C, *spatial)")


def to_nchw(x):
    """(N, *spatial, C) -> (N, C, *spatial) of a Dask array of rank 3 to 5, the inverse of
    :func:`to_nhwc`."""
    return _convert("to_nchw", x, nchw_axes, "(N, *spatial, C)")


def _convert(fn: str, x, axes_of, layout: str):
    x = B.as_dask(fn, "x", x)
    if not 3 <= x.ndim <= 5:
        raise ValueError(f"{fn}: x has shape {x.shape} ({x.ndim} dimensions), expected 3 to 5 "
                         f"dimensions {layout}")
    return _permute(fn, x, axes_of(x.ndim))


def _permute(fn: str, x, axes):
    x = B.as_dask(fn, "x", x)
    check_dtype(fn, "x", x.dtype)
    if x.ndim > 8:
        raise ValueError(f"{fn}: x has {x.ndim} dimensions; at most 8 are supported")
    axes = normalize_axes(axes, x.ndim, fn)
    ind = tuple(range(x.ndim))
    out_ind = tuple(axes)  # output axis k is x's axis axes[k]: its blocks and chunks
    return da.blockwise(_permute_block, out_ind, x, ind, axes=axes, dtype=x.dtype,
                        meta=x._meta.transpose(axes), name=B.fresh_name(fn))


def _permute_block(x, axes):
    if B.is_cupy(x):
        import cukern

        return cukern.permute(x, axes)
    return reference.permute(x, axes)

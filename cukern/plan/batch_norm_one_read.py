"""The batch-norm planner's one-read training steps: x held on chip and read once, statistics
and y in one launch, where a channel (planes: ``batch_norm_train_planes``) or a tile of
channels over its rows (columns: ``batch_norm_train_cols``, split over a cluster on sm_90)
fits shared memory; None where the two passes run."""

from __future__ import annotations

from .._device import DeviceSpec
from .batch_norm_step import _COMPUTE, MAX_ONE_READ_THREADS, Step
from .batch_norm_view import ChannelView, plane_packs
from .common import ITEMSIZE
from .policy import Tuning

__all__ = ["one_read_planes_step", "one_read_cols_step"]


def one_read_planes_step(view: ChannelView, dtype: str, pack: int, span: bool, addend: bool,
                   device: DeviceSpec, tuning: Tuning, relu: bool, mask: bool) -> Step | None:
    """The one-read training step (planes): a block a channel, its packs (and the addend's)
    in shared memory, where they fit the tuning's bn_one_read_max_bytes and the device and
    packs are at least bn_min_pack_bytes wide (bn_one_read_min_pack_bytes_addend with an
    addend) and lie in one plane; else None (the two passes)."""
    a, c, b = view
    packs = a * plane_packs(b, pack)
    smem = packs * pack * ITEMSIZE[dtype] * (2 if addend else 1)
    static = 2 * 32 * 3 * ITEMSIZE[_COMPUTE[dtype]]  # allreduce_block's partial states
    if (not tuning.bn_one_read_max_bytes or smem > tuning.bn_one_read_max_bytes
            or pack * ITEMSIZE[dtype] < tuning.bn_min_pack_bytes  # narrow packs: two passes
            or span  # packs across planes: element stores at a plane's ends (7x7 ran slower)
            or addend and pack * ITEMSIZE[dtype] < tuning.bn_one_read_min_pack_bytes_addend
            or smem + static > device.smem_per_block_optin or packs >= 2**31):
        return None
    need = max(1, packs // tuning.bn_block_min_packs_per_thread)
    if tuning.bn_one_read_max_threads > MAX_ONE_READ_THREADS:
        raise ValueError(f"plan: bn_one_read_max_threads {tuning.bn_one_read_max_threads}: the "
                         f"kernel takes at most {MAX_ONE_READ_THREADS} (kBnOneReadThreads)")
    blocks = device.smem_per_sm // (smem + static + device.reserved_smem_per_block)
    most = tuning.bn_one_read_max_threads if blocks <= 2 else tuning.bn_reduce_threads
    threads = min(most, max(64, 1 << (need - 1).bit_length()))
    what = ("x" + (" and the addend" if addend else "") + " of a channel in shared memory: "
            "statistics, mean, invstd, running stats, then y" + (" + addend" if addend else "")
            + (", ReLU" if relu else "") + (", mask (ORed words)" if mask else ""))
    return Step("train_planes", (dtype, pack, addend), (c,), (threads,), smem, what)


def one_read_cols_step(view: ChannelView, dtype: str, pack: int, addend: bool,
                        device: DeviceSpec, tuning: Tuning, relu: bool,
                        mask: bool) -> Step | None:
    """The one-read training step over columns: tiles of TX channel packs (the fewest that
    make a row's part bn_one_read_cols_row_bytes, a power of two dividing C / PACK), each
    tile's rows split over the smallest cluster (sm_90; up to bn_one_read_cols_max_cluster
    blocks, _16bit for 2-byte data) whose blocks hold at most bn_one_read_max_bytes of them
    (and the addend's, where bn_one_read_cols_addend allows one); the pack rules of the
    planes kernel; else None (the two passes)."""
    a, c, _ = view
    item = ITEMSIZE[dtype]
    if item == 2:
        pack = min(pack, tuning.bn_one_read_cols_max_pack_16bit)
    pb = pack * item
    if (not tuning.bn_one_read_max_bytes or pb < tuning.bn_min_pack_bytes
            or addend and (not tuning.bn_one_read_cols_addend
                           or pb < tuning.bn_one_read_min_pack_bytes_addend)):
        return None
    cp = c // pack
    tx = 1
    while tx * pb < tuning.bn_one_read_cols_row_bytes and tx < 32 and cp % (2 * tx) == 0:
        tx *= 2
    row = tx * pb * (2 if addend else 1)
    most = 1
    if device.has_clusters:
        most = (tuning.bn_one_read_cols_max_cluster_16bit if item == 2
                else tuning.bn_one_read_cols_max_cluster)
    k = max(1, -(-a * row // tuning.bn_one_read_max_bytes))
    if k > most:
        return None
    rows = -(-a // k)
    csize = ITEMSIZE[_COMPUTE[dtype]]
    threads = min(MAX_ONE_READ_THREADS, max(
        64, 1 << max(0, (rows * tx // tuning.bn_block_min_packs_per_thread - 1).bit_length())))
    # the warps' and the block's states and the coefficients, to a 128-byte boundary
    scratch = -(-(3 * (threads // 32) + 6) * tx * pack * csize // 128) * 128
    smem = rows * row + scratch
    if smem > device.smem_per_block_optin or rows * tx >= 2**31:
        return None
    what = (f"a tile of {tx * pack} channels' rows" + (" and addend" if addend else "")
            + " in shared memory: statistics" + (f" merged across a cluster of {k}" if k > 1
                                                 else "")
            + ", mean, invstd, running stats, then y" + (" + addend" if addend else "")
            + (", ReLU" if relu else "") + (", mask (ORed words)" if mask else ""))
    return Step("train_cols", (dtype, pack, addend), (k, cp // tx), (tx, threads // tx), smem,
                what, cluster=k)

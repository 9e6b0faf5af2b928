"""The one-read training kernel over columns (batch_norm_train_cols: channels adjacent, a block
or a cluster a tile of channels): when the planner takes it and how it shapes it, and a model of
its index arithmetic (rows split over a cluster, tiles, the ReLU mask's ORed words)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cukern
from cukern.plan import HOPPER, ITEMSIZE

from .test_batch_norm_cpu import A100, H100, TWO_PASS, plan

CSIZE = {"float16": 4, "bfloat16": 4, "float32": 4, "float64": 8}


def step_pack(dtype: str, pack: int, t=HOPPER) -> int:
    """The kernel's pack for the data's ``pack``: 16-bit threads hold at most the tuning's
    bn_one_read_cols_max_pack_16bit channels."""
    return min(pack, t.bn_one_read_cols_max_pack_16bit) if ITEMSIZE[dtype] == 2 else pack


def expected_tile(c: int, pack: int, dtype: str, t=HOPPER) -> int:
    """The fewest channel packs (a power of two dividing C / PACK, at most 32) whose row part
    reaches the tuning's bn_one_read_cols_row_bytes."""
    cp, tx = c // pack, 1
    while tx * pack * ITEMSIZE[dtype] < t.bn_one_read_cols_row_bytes and tx < 32 \
            and cp % (2 * tx) == 0:
        tx *= 2
    return tx


@pytest.mark.parametrize("shape,dtype,addend,cluster", [
    ((64, 2048, 7, 7), "float16", False, 2),     # 3136 rows x 64 bytes over 2 blocks
    ((64, 2048, 7, 7), "float32", False, 2),
    ((64, 1024, 14, 14), "float32", False, 8),   # 12544 rows: eight blocks a tile
    ((64, 1024, 14, 14), "float16", False, None),  # 16-bit data: at most two blocks
    ((256, 2048, 7, 7), "float64", False, 8),
    ((4096, 4096), "float32", False, 3),         # any cluster size up to the maximum
    ((16384, 1024), "float32", False, None),     # 16 blocks a tile: past the cluster limit
    ((8, 16, 4, 4), "float32", False, 1),        # one tile of 4 packs
    ((8, 16, 4, 4), "float16", False, 1),        # 4-channel packs: 4 a tile
    ((4, 24, 3, 5), "float16", False, 1),        # C / 4 = 6: tiles of 2 packs
    ((4, 20, 3, 5), "float16", False, 1),        # C / 4 = 5: one-pack tiles
    ((64, 64, 112, 112), "float32", False, None),
    ((8, 6, 5, 5), "float16", False, None),      # 4-byte packs: the two passes
    ((8, 16, 5, 5), "float32", True, None),      # the addend: the two passes (the tuning)
])
def test_columns_step(shape, dtype, addend, cluster):
    p = plan("batch_norm", shape, dtype, "NHWC", addend=addend, relu=True, mask=True)
    assert p.one_read == (cluster is not None), p
    if cluster is None:
        assert [s.kind for s in p.steps] == ["stats_cols", "finalize", "apply"] or \
            [s.kind for s in p.steps] == ["stats_cols", "apply"], p
        return
    (step,) = p.steps
    a, c, _ = p.view
    item = ITEMSIZE[dtype]
    pack = step_pack(dtype, p.pack)
    tx = expected_tile(c, pack, dtype)
    assert step.kind == "train_cols" and step.targs == (dtype, pack, addend)
    assert step.cluster == cluster and step.grid == (cluster, c // pack // tx)
    threads = step.block[0] * step.block[1]
    assert step.block[0] == tx and threads % 32 == 0 and 64 <= threads <= 512
    rows = -(-a // cluster)
    tile = rows * tx * pack * item * (2 if addend else 1)
    assert tile <= HOPPER.bn_one_read_max_bytes
    # the smallest cluster: one block fewer would hold more rows than the limit allows
    assert cluster == 1 or -(-a // (cluster - 1)) * (tile // rows) > \
        HOPPER.bn_one_read_max_bytes
    scratch = -(-(3 * threads // 32 + 6) * tx * pack * CSIZE[dtype] // 128) * 128
    assert step.smem == tile + scratch <= H100.smem_per_block_optin
    assert step.kernel == f"cukern::batch_norm_train_cols<{cukern.plan.CPP_TYPES[dtype]}, " \
                          f"{pack}, {'true' if addend else 'false'}>"
    text = str(p)
    assert "one read" in text and "train_cols" in text and "two-pass" not in text
    assert (f"cluster {cluster}" in text) == (cluster > 1)


def test_columns_step_limits():
    shape = (64, 1024, 14, 14)
    # no clusters before sm_90: one block a tile where it fits, else the two passes
    assert not plan("batch_norm", shape, "float32", "NHWC", device=A100).one_read
    small = plan("batch_norm", (16, 2048, 7, 7), "float32", "NHWC", device=A100)
    assert small.one_read and small.steps[0].cluster == 1
    # the tuning: no one read at all, larger clusters, other row widths, the addend
    assert not plan("batch_norm", shape, "float32", "NHWC", tuning=TWO_PASS).one_read
    wide = dataclasses.replace(HOPPER, bn_one_read_cols_max_cluster_16bit=16)
    p = plan("batch_norm", (64, 1024, 14, 14), "float16", "NHWC", tuning=wide)
    assert p.one_read and p.steps[0].cluster == 8
    rows32 = dataclasses.replace(HOPPER, bn_one_read_cols_row_bytes=32)
    assert plan("batch_norm", (64, 2048, 7, 7), "float16", "NHWC",
                tuning=rows32).steps[0].block[0] == 4  # 8-byte packs of 4 channels
    packs8 = dataclasses.replace(HOPPER, bn_one_read_cols_max_pack_16bit=8)
    p = plan("batch_norm", (64, 2048, 7, 7), "bfloat16", "NHWC", tuning=packs8)
    assert p.steps[0].targs == ("bfloat16", 8, False) and p.steps[0].block[0] == 4
    add = dataclasses.replace(HOPPER, bn_one_read_cols_addend=1)
    p = plan("batch_norm", (8, 16, 5, 5), "float32", "NHWC", addend=True, tuning=add)
    assert p.one_read and p.steps[0].targs == ("float32", 4, True)
    # eval, the backward and batch_stats never read once
    assert not plan("batch_norm", shape, "float32", "NHWC", training=False).one_read
    for op in ("batch_norm_backward", "batch_stats"):
        assert not plan(op, shape, "float32", "NHWC").one_read
    # explain: the same plan for the CLI's spelling and the layout name
    e = cukern.explain("batch-norm", shape, "float32", training=True, layout="NHWC",
                       device="h100")
    assert e.one_read and e.steps[0].cluster == 8


def _cols_model(a: int, c: int, pack: int, tx: int, ty: int, k: int, kept: np.ndarray):
    """Emulates batch_norm_train_cols' index arithmetic and mask writes: block (rank, tile)
    takes rows [a rank / k, a (rank + 1) / k) of channel packs [tx tile, tx tile + tx); thread
    (x, y) packs x of rows y, y + ty, ...; warps are 32 consecutive threads (y-major), each a
    segmented OR over lanes of one word (bn::or_mask_bits) whose last lane ORs it into memory.
    Returns (how many times each pack was written, the mask words)."""
    cp = c // pack
    written = np.zeros(a * cp, np.int64)
    words = np.zeros(-(-a * c // 32), np.uint32)
    for rank in range(k):
        r0 = a * rank // k
        rows = a * (rank + 1) // k - r0
        for tile in range(cp // tx):
            for rb in range(0, rows, ty):
                lanes = []
                for t in range(tx * ty):
                    x, y = t % tx, t // tx
                    r = rb + y
                    if r < rows:
                        gi = (r0 + r) * cp + tile * tx + x
                        written[gi] += 1
                        e = gi * pack
                        bits = sum(int(kept[e + i]) << i for i in range(pack))
                        lanes.append((True, e, (bits << (e & 31)) & 0xFFFFFFFF, e >> 5))
                    else:
                        lanes.append((False, 0, 0, -1 - t))
                for w0 in range(0, len(lanes), 32):
                    warp = lanes[w0:w0 + 32]
                    acc = [v for _, _, v, _ in warp]
                    off = 1
                    while off < 32 // pack:
                        acc = [acc[i] | (acc[i - off] if i >= off and warp[i - off][3] ==
                                         warp[i][3] else 0) for i in range(len(warp))]
                        off *= 2
                    for i, (active, e, _, wi) in enumerate(warp):
                        last = i == len(warp) - 1 or warp[i + 1][3] != wi
                        if active and last and acc[i]:
                            words[e >> 5] |= acc[i]
    return written, words


@pytest.mark.parametrize("a,c,pack,k", [
    (37, 64, 8, 1), (37, 64, 8, 3), (50, 24, 8, 2), (29, 40, 4, 5), (33, 16, 8, 4),
    (17, 8, 4, 1), (70, 48, 2, 8), (9, 96, 8, 2),
])
def test_columns_model_writes_every_pack_once_and_every_mask_bit(a, c, pack, k):
    """Every pack of x is read and written by exactly one thread, the cluster's row ranges
    cover the rows once, and the mask's words hold every element's bit (C not a multiple of
    32 included: rows share words, within a warp or across tiles and blocks), none past it."""
    rng = np.random.default_rng(a * c + k)
    tx = expected_tile(c, pack, "float16" if pack == 8 else "float32")
    if (c // pack) % tx:
        tx = 1
    ty = 64 // tx
    kept = rng.random(a * c) < 0.5
    written, words = _cols_model(a, c, pack, tx, ty, k, kept)
    assert (written == 1).all()
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    np.testing.assert_array_equal(bits[:a * c].astype(bool), kept)
    assert not bits[a * c:].any()

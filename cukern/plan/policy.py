"""Tuning as data: one printable table of planner constants per GPU architecture, and the
per-op policy each kernel family declares for its ops.

Each constant carries, in a line, what measured it; the measurements themselves are in
``docs/notes/`` under the rule's name. ``print(tuning_for(device))`` shows the table in force.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

__all__ = ["Tuning", "OpPolicy", "HOPPER", "AMPERE", "TURING", "VOLTA", "arch_tunings",
           "tuning_for"]


@dataclass(frozen=True)
class Tuning:
    """Planner constants for one architecture (``tuning_for`` picks one for a device)."""

    arch: str
    # OneFlow: a warp kernel lane holds at most 32 values, 32 lanes a row
    warp_max_cols: int = 1024
    # with column sums in registers too: past 512 columns, 76-81% of copy vs 87-93% for the
    # block kernel (H100, norm backward)
    warp_max_cols_with_sums: int = 512
    # OneFlow: 128 threads a block for the warp kernel
    warp_block_threads: int = 128
    # forward norms (OpPolicy.two_packs_a_lane): warp rows of 3 up to this many 16-byte packs
    # take two packs of one row a lane: layer norm float16 64 columns 95.0 -> 96.4% of copy;
    # from 16 packs (groups of 8 lanes) 0.4-0.6 slower (H100). The H200's in its table below
    two_packs_max_packs: int = 8
    # ... (op, element bytes) whose such rows of more than 8 packs take four packs a lane
    # instead of two. The H200's in its table below
    warp_four_packs: tuple[tuple[str, int], ...] = ()
    # block widths tried, widest first, against the 128-thread occupancy (OneFlow)
    block_sizes: tuple[int, ...] = (1024, 512, 256)
    uncached_block: int = 1024
    # cluster sizes tried, smallest first; 16 is past the portable 8 (opted in per kernel)
    cluster_sizes: tuple[int, ...] = (2, 4, 8, 16)
    # fewest packs a thread worth a wider block: 92% of copy vs 22% for float16 softmax at
    # 2048 columns with OneFlow's 1024 threads (H100)
    packs_per_thread: int = 2
    # backward cluster blocks: wider measured slower (H100, norm backward)
    cluster_max_block: int = 512
    # cluster blocks that may share an SM (plan_cluster rule 1), else the widest that launches
    cluster_shared: tuple[int, ...] = (256, 512)
    cluster_blocks: tuple[int, ...] = (1024, 512, 256)
    # OneFlow's GetNumBlocks: at most 32 waves of resident threads
    waves: int = 32
    # CUDA's gridDim.x limit (the kernels loop over rows past it)
    max_grid: int = 2**31 - 1
    # warp kernel: one row an access on grids of at most this many waves: 95-97% vs 93-95% of
    # copy, 16-bit softmax at 49152 rows, 32-128 columns (H100)
    short_grid_waves: int = 4
    # a forward with a residual overlaps its rows where OneFlow's blocks leave at most this many
    # threads an SM: float32 layer norm 8192 columns 85 -> 95% of copy (H100)
    overlap_resident: int = 1024
    # OneFlow's width holding this many threads an SM or more in this many blocks or fewer is
    # kept for the op's OpPolicy.oneflow_width_dtypes (H200, layer norm float32)
    kept_width_threads: int = 1536
    kept_width_blocks: int = 3
    # a lone block of at most this many resident threads moves to a cluster of blocks sharing
    # SMs (OpPolicy.split_lone_blocks): layer norm float16 65536 columns 88 -> 92% (H100)
    lone_block_resident: int = 1024
    # layer norm clusters over 16-bit rows with gamma or beta take two rows a pass from here:
    # float16 131072 columns 89.6 -> 92.0% of copy (H100)
    paired_min_cols: int = 131072
    # ... on clusters of at most this many blocks: 8 blocks one row a pass beat 16 paired,
    # 90.2-90.8 vs 89.2-90.4% at 262144 columns (H100)
    paired_max_cluster: int = 8
    # shared memory kept back from the opt-in limit for the kernels' static shared memory
    static_smem: int = 2048
    # norm backward over 16-bit rows in 16-byte packs wider than the given columns, with a
    # weight: (op, ways, columns), the first of the ways that fits taken before the general
    # order (plan.col_sums): "s2g" (_narrow_s2g: 128 threads, everything on chip, three blocks
    # an SM) or "r2g" (_pair_r2g from one block: the narrowest block holding its slice with
    # register sums). H100: layer norm's narrow S2g (float16 8192 columns 95.0% of copy against
    # 87.4 for one block of 1024 threads). The H200's in its table below
    norm_bwd_narrow: tuple[tuple[str, tuple[str, ...], int], ...] = (
        ("layer_norm_backward", ("s2g",), 2048),)
    # ... and over float32 rows in 16-byte packs of at least this many columns (0: never), the
    # planned way's column sums go to registers where its slice fits them (RegSums: 4 packs a
    # thread), the rest of the way kept. The H200's in its table below
    norm_bwd_regs_min_cols_32bit: int = 0
    # ... and over float32 rows, the blocks (alone or in a cluster) of more than 128 threads
    # that the planner considers hold at least this many packs a thread of their slice (1: a
    # pack each). The H200's in its table below
    norm_bwd_min_packs_32bit: int = 1
    # column-sum partial rows straight from x and dy (uncached backward): block width and waves
    partial_threads: int = 256
    partial_waves: int = 2
    # batch norm (cukern/plan/batch_norm.py); not yet measured: first choices, to be timed on
    # the H100 (docs/notes/batch_norm.md)
    # threads of a statistics / gradient-sums block (planes: one block per channel and split)
    bn_reduce_threads: int = 256
    # statistics grids: this many waves of resident blocks, split over channels
    bn_reduce_waves: int = 2
    # ... columns statistics: one wave. H100 fp16 NHWC (256, 512, 28, 28): 109.5 us at two
    # waves (528 x 2 blocks), 92.4 us at one; other shapes equal
    bn_cols_stats_waves: int = 1
    # ... columns gradient sums: two waves of resident blocks (the planes' bn_reduce_waves)
    bn_cols_grad_waves: int = 2
    # a planes split keeps at least this many packs a thread (x unroll), so short splits stay
    # busy. H100 statistics pass at 2 -> 8: fp16 (64, 512, 28, 28) 30.7 -> 23.8 us (3 splits
    # -> 1, no merge launch), bf16 (256, 1024, 14, 14) 52.6 -> 45.1, fp16 (64, 256, 56, 56)
    # 50.3 -> 44.6, (64, 1024, 14, 14) 17.6 -> 15.9; none slower
    bn_min_packs_per_thread: int = 8
    # ... a columns split: 2 (at 8, fp16 NHWC (64, 2048, 7, 7) ran fewer blocks, 21.6 -> 21.7 us)
    bn_cols_min_packs_per_thread: int = 2
    # ... a one-split planes block narrows (down to 64 threads) to give each thread this many:
    # H100 fp16 (64, 1024, 14, 14) statistics 15.9 us at 128 threads, 17.6 at 256
    bn_block_min_packs_per_thread: int = 4
    # at most this many partial states a channel: the merge folds them, 32 a warp lane
    bn_max_splits: int = 1024
    # partial states written (and merged) are at most 1/this of the bytes the reduction reads:
    # fp16 NHWC (64, 512, 28, 28) training ran 1024 splits, 6 MB of states for 25.7 MB of x
    # (38% of copy speed); (16384, 1024) fp16 512 splits (29%)
    bn_partial_fraction: int = 32
    # resident columns gradient-sum blocks an SM (the register-bound occupancy, which the
    # model of threads and shared memory misses): ptxas gives grad_cols<f16, 8> 74 registers,
    # 3 blocks of 256 threads; their grids are sized in whole waves of these
    bn_cols_reduce_blocks_per_sm: int = 3
    # ... and columns statistics blocks: stats_cols is bounded to 64 registers (4 blocks of
    # 256; ptxas gives 40-64, every dtype and pack): 4
    bn_cols_stats_blocks_per_sm: int = 4
    # the narrowest statistics / gradient-sum tile (channel packs) the planner narrows to where
    # the widest tiles leave the SMs short of blocks: 32 (no narrowing, the widest tile up to
    # 32 packs). Tiles of 8-16 packs lost 1.5-7 points in fp16 NHWC training wherever chosen
    # ((64, 2048, 7, 7) 39.6 -> 36.6%, (64, 1024, 14, 14) 53.0 -> 45.9, (64, 512, 28, 28)
    # 65.0 -> 63.5, (16384, 1024) 56.6 -> 51.6; fp32 (64, 2048, 7, 7) 71.9 -> 67.8): the
    # shared-memory fold over 32 rows and fewer rows a thread cost more than the extra blocks
    bn_cols_min_tile_packs: int = 32
    # channels a columns statistics / gradient-sum thread reduces (its pack, where the data's
    # is wider): 8 fp16 channels' shifted sums took 64 registers (4 blocks an SM) and ran at
    # 38-61% of read speed; 4 (8-byte loads) ran at 45-83%: H100 fp16 NHWC statistics
    # (64, 512, 28, 28) 43.4 -> 31.5 us, (64, 64, 112, 112) 57.9 -> 49.5, (16384, 1024) 31.2 ->
    # 25.0; training NHWC 52-77 -> 61-82% (x twice). The backward's gradient sums: (64, 2048,
    # 7, 7) 76.6 -> 80.3%, (16384, 1024) 74.9 -> 78.1, but (64, 64, 112, 112) 81.2 -> 78.4
    bn_cols_reduce_max_pack: int = 4
    # planes packs: the widest pack dividing B where it is at least this many bytes, else
    # (7x7) a 16-byte pack spanning two planes, where one reaches it: fp16 (64, 1024, 14, 14)
    # eval ran at 90.8% of copy speed in dividing 8-byte packs, 83.8% in spanning 16-byte
    # ones; (64, 2048, 7, 7) at 46.0% in dividing 2-byte packs, 87.9% in spanning 16-byte
    bn_min_pack_bytes: int = 8
    # training forward, planes: a channel whose packs (x, and the addend's) take at most this
    # many bytes is held in one block's shared memory and read once, statistics and y in one
    # launch (batch_norm_train_planes); larger channels, and 0, run the two passes. H100,
    # against the two passes: 16-bit (64, 512, 28, 28) 58.5 -> 81.2% of copy (x read once
    # counted), (256, 1024, 14, 14) 53.4 -> 70.2, float32 (64, 1024, 14, 14) 54.3 -> 78.8
    bn_one_read_max_bytes: int = 100352
    # ... with an addend, packs of at least this many bytes: fp16 add + ReLU (64, 1024, 14, 14)
    # in 8-byte packs ran at 61.4% of copy in one read, 67.7% in two passes (float32's 16-byte
    # packs: 74.9 against 66.5)
    bn_one_read_min_pack_bytes_addend: int = 16
    # ... its blocks: about bn_block_min_packs_per_thread packs a thread, 64 threads or more,
    # up to bn_reduce_threads, or this many (at most kBnOneReadThreads) where shared memory
    # leaves room for two blocks an SM or fewer. H100, 512 against 256 threads, % of copy:
    # 16-bit (64, 512, 28, 28) and (256, 1024, 14, 14) (100 KB a channel) train 75.0 -> 81.1,
    # 64.3 -> 70.5, + ReLU 66.7 -> 70.9, 53.0 -> 58.2; but 25 KB channels (8 blocks an SM):
    # fp16 (64, 1024, 14, 14) + ReLU 55.7 -> 51.8; 50 KB: float32 train 79.3 -> 78.7
    bn_one_read_max_threads: int = 512
    # training forward, columns (channels adjacent; batch_norm_train_cols): a block holds a
    # tile of channel packs at least this many bytes wide over its rows, at most
    # bn_one_read_max_bytes of them, the rows split over a cluster of up to
    # bn_one_read_cols_max_cluster blocks (sm_90; one block elsewhere), _16bit for float16 and
    # bfloat16, whose threads hold at most _max_pack_16bit channels. H100, % of copy (x once)
    # against the two passes: float32 train (64, 2048, 7, 7) 48.6 -> 70.0, (64, 1024, 14, 14)
    # 52.9 -> 60.2 (8 blocks), (4096, 4096) 52.7 -> 64.8; fp16 (64, 2048, 7, 7) 40.6 -> 56.2
    # (2 blocks, 4 channels a thread; 8: 51.1), but 4-8 blocks 9-11 points slower (fp16
    # (64, 1024, 14, 14) 47.2 -> 37.5); 32-byte rows 4-6 points slower than 64
    bn_one_read_cols_row_bytes: int = 64
    bn_one_read_cols_max_cluster: int = 8
    bn_one_read_cols_max_cluster_16bit: int = 2
    bn_one_read_cols_max_pack_16bit: int = 4
    # ... with an addend (1: allowed): add + ReLU ran 4-22 points slower in one read (fp16
    # (4096, 4096) 59.6 -> 41.5, float32 (64, 2048, 7, 7) 59.7 -> 54.8)
    bn_one_read_cols_addend: int = 0
    # elementwise passes (apply, dx): block threads and the most waves of a grid-strided grid
    bn_apply_threads: int = 256
    bn_apply_waves: int = 4
    # columns elementwise grids (apply, dx) where the waves grid would give a thread fewer than
    # PACK / bn_apply_cols_coefs_per_pack packs (many channels, small tensors): this many
    # blocks an SM, one resident wave, each thread looping over many rows of its PACK channels
    # with ~128 bytes in flight (bn::unroll_cols), so the coefficients it loads once serve them
    # all (ptxas: apply / dx<16-bit, 8, true> 100-111 registers, 2 blocks of 256 resident).
    # H100, eval fp16 NHWC: 55-80% of copy speed at 12 an SM and 32 bytes in flight, 86-96% at
    # 2 an SM; but (64, 64, 112, 112) fell from 93% (waves grid) to 70% and fp32 C = 64-1024
    # from 94-95% to 90-92% at 2 an SM, hence the waves grid where coefficients amortise
    bn_apply_blocks_per_sm_cols: int = 2
    bn_apply_cols_coefs_per_pack: int = 2
    # ... and, for 16-bit data, also where the waves grid gives a thread fewer than this many
    # packs (0: the rule above alone). H200 only (its table below; measured there): at 6-12
    # packs a thread, fp16 NHWC eval 76-84 -> 84-86% of copy, training + ReLU 44-50 -> 50-56,
    # backward 39-44 -> 45-47; at 24 (205 M elements) eval 92.7 -> 88.8; float32 lost 0.5-6
    bn_apply_cols_few_packs_16bit: int = 0
    # channel-merge kernels: channels (warps) a block
    bn_finalize_channels: int = 8
    # ... a block a channel instead (bn::Merger) where a channel has over 32 partial states and
    # the warp grid is under 1/this of the SMs: C = 64, 256 (8, 32 blocks; 528 splits were 17
    # dependent merges a lane) gained with the second round's block merges; C = 512-1024
    # (64-128 blocks, 2-5 states a lane) ran 512-1024 blocks of 256 threads where the first
    # round's warps did it, in that round's fp16 NHWC training losses (with the 8-16 pack
    # tiles, bn_cols_min_tile_packs, the part isolated at (64, 2048, 7, 7)): first round's way
    bn_block_merge_sm_fraction: int = 4
    # permute (cukern/plan/permute.py); H100 sweeps one change at a time (% of copy), the
    # rest first choices (docs/notes/permute.md)
    # threads a block of either permute kernel (at most kernels/permute_parts.cuh: perm::kThreads):
    # 128 lost 3-13 points on fp16 tiles, gained 6 on int8 (4096, 4096): 256
    perm_threads: int = 256
    # tile kernel: (element bytes, ti, to) default tile extents, 8-16 KB, rows of at least
    # 64 bytes. int8 128 x 128 -> 128 x 64: (64, 512, 28, 28) NCHW->NHWC 74.0 -> 78, (4096,
    # 4096) 81.6 -> 83; fp16 128 x 64 -> 64 x 64: (1024, 1024) 77.9 -> 79.2, (64, 256, 56, 56)
    # 95.3 -> 96.4, (64, 512, 28, 28) 89.9 -> 91.3; 128 x 128 lost 3-17 points
    perm_tiles: tuple[tuple[int, int, int], ...] = (
        (1, 128, 64), (2, 64, 64), (4, 64, 64), (8, 64, 32), (16, 32, 32))
    # bytes a tile aims at where one extent is short or held whole (the other grows up to
    # this): 16384 -> 8192: fp16 (64, 3, 224, 224) NCHW->NHWC 74.9 -> 78.0, its inverse 87.0
    # -> 91.5, (64, 2048, 7, 7) 83.9 -> 86.2, (3, 8388608) 81.8 -> 84.5; 32768 lost 2-13
    perm_tile_bytes: int = 8192
    # most shared memory a tile (a flat short dim held whole beside the other)
    perm_tile_max_bytes: int = 32768
    # longest tile extent along one dim (elements)
    perm_tile_max_extent: int = 4096
    # a tile under this many bytes runs the general kernel instead (2 x 2 transposes)
    perm_tile_min_bytes: int = 512
    # arrays of at most this many bytes that are not a plain copy run the general kernel in
    # blocks narrow enough (32 threads and up) to spread over every SM (0: never): a few tiles
    # of 256 threads leave most SMs idle. The H200's in its table below
    perm_small_max_bytes: int = 0
    # ... and up to this many where the tile would have a flat side (C = 3, 7x7 and 14x14
    # planes) or no tile fits (0: never)
    perm_small_flat_max_bytes: int = 0
    # ... each thread moving this many elements (plan.permute.SMALL_UNROLLS)
    perm_small_unroll: int = 4
    # a short dim (at most this many bytes) whose tile rows join into one run of memory is
    # held whole and moved as that flat run (HW = 49, 196; C = 3): at least 16 rows beside it
    perm_flat_max_bytes: int = 2048
    # ... on the output side at most this many, unless rows would store words under 8 bytes
    # (2-byte and wider elements): a flat output run is gathered element by element from
    # shared memory. fp16 (64, 14, 14, 1024) NHWC->NCHW (196-element runs) 53.6% of copy
    # flat, 65% as rows of 8-byte stores; (256, 14, 14, 1024) 59.2 -> 65.5; int8 45.4 -> 54.1
    # (4-byte stores); but fp32 (256, 7, 7, 2048) 95.7% flat, 61.6% as rows of 4-byte stores.
    # (The input side stays flat to 2048: (64, 1024, 14, 14) NCHW->NHWC 90.8% flat, 71% rows)
    perm_flat_out_max_bytes: int = 128
    # element sizes whose output runs (up to perm_flat_max_bytes) stay flat, gathered, where
    # their rows are not whole 32-byte sectors (row tiles split those sectors between blocks):
    # float64 (64, 7, 7, 2048) NHWC->NCHW 64.1 -> 94.9% of copy, (256, ...) 63.2 -> 98.1%;
    # float32 (N, 14, 14, 1024) 82.5 -> 77.9% and 82.4 -> 83.4% (16 KB tiles: 72.6, 76.2)
    perm_flat_split: tuple[int, ...] = (8,)
    # waves of resident blocks a grid at most (both kernels loop over their tiles; up to
    # there a block takes one tile and the block scheduler balances them)
    perm_waves: int = 32
    # element sizes (1, 2) whose tile phase 2 reads 32-bit shared-memory words and transposes
    # them in registers (__byte_perm) where both tile sides are rows and words of 4 bytes or
    # more move both ways; () gathers an element a shared-memory load everywhere (the old phase
    # 2: int8 45-83% of copy below ~50 MB). Against it in the same rounds: -0.7 to +18.2 points
    perm_byte_regs: tuple[int, ...] = (1, 2)
    # element sizes (1, 2, 4) whose tile phase 2 over a flat output run of 3-element blocks
    # (C = 3: NCHW -> NHWC of images) with 16-byte stores reads 16-byte row chunks of shared
    # memory and interleaves them in registers (one load a chunk where the gather makes one an
    # element); () gathers there. Against it in the same rounds: int8 55.3 -> 75.5% and
    # 63.4 -> 83.8% of copy, 16-bit 77.3 -> 87.3%, 85.5 -> 95.6%, float32 -0.4 to +0.8 points
    perm_flat_regs: tuple[int, ...] = (1, 2, 4)
    # element sizes (1, 2) whose tile phase 2 over a flat output run of channels of L
    # elements, L = 0, 1 or 4 (mod the 16-byte word) (7x7, 14x14 planes, int8 28x28: NHWC ->
    # NCHW), reads 32-bit shared-memory columns of 4 / E channels over rows skewed L mod VO a
    # channel and interleaves them in registers (perm::store_skew: VO + (R - 1) D loads for R
    # words, where the gather makes VO a word); those runs stay flat up to perm_flat_max_bytes
    # where their rows are not whole 32-byte sectors (row tiles split sectors between tiles:
    # int8 (N, 28, 28, 512) 61-66% of copy, fp16 rows of 196 78-82%). () keeps the gather of
    # 7x7 planes and row tiles elsewhere. Against that in the same rounds: int8 -0.3 to +22.0
    # points ((256, 28, 28, 512) 61.1 -> 83.1%), 16-bit +0.4 to +4.6 (2 words a lane)
    perm_skew_regs: tuple[int, ...] = (1, 2)
    # ... its lanes take this many consecutive words of a channel's run (1, 2, 4, 8, 16; for
    # int8, then 16-bit elements), then the next column: a store instruction writes runs of
    # this many 16-byte words; a warp's loads meet 2-way bank conflicts from 4 (the words' rows
    # 16 (int8) or 8 apart, pitches 4 (mod 8) elements), 4-way from 8. Against 2: 4 took
    # 16-bit 2.1-8.3 points over the gather where 2 took 0.4-4.6 ((256, 14, 14, 1024) 86.4 ->
    # 90.4%), int8 (256, 7, 7, 2048) 65.2 -> 61.0%
    perm_skew_words: tuple[int, int] = (2, 4)
    # tile order: blocks take at most this many tiles along i (a power of two dividing the
    # count), then the next tile along o, then the next panel; 0: all tiles along i first. The
    # H200 takes 1 (tiles along o first), against 0 in the same rounds: 2-D fp16 16384^2
    # 87.1 -> 92.8% of copy, 32768^2 81.7 -> 88.1, int8 32768^2 80.7 -> 89.2, fp32 -1 to +2.4
    # elsewhere in 2-D; 2, 4 and 8 gained less; ResNet NCHW/NHWC shapes within 0.7
    perm_panel_tiles: int = 0
    # element sizes whose tiles with a flat side (C = 3, 7x7 and 14x14 planes) of at most
    # perm_async_max_bytes copy phase 1 by cp.async: no registers hold the words (32-48
    # against 47-64 a thread), so more blocks stay resident; () loads through registers. The
    # H200 takes every size: against the register loads in the same rounds +0.9 to +11.1
    # points ((256, 224, 224, 3) fp16 NHWC->NCHW 84.7 -> 95.5%); row tiles lost up to 7.3
    # with it (int8 (256, 64, 112, 112) 95.6 -> 88.3), int8 (256, 28, 28, 512)'s 28 KB tiles 7.8
    perm_async_copy: tuple[int, ...] = ()
    perm_async_max_bytes: int = 16384
    # element sizes whose input rows of 4 (mod 8) elements (at most perm_flat_max_bytes) are
    # held whole as a flat run even where the rows take the run's vectors: float32 HW = 196 in
    # 64-wide row tiles leaves a tile of 4 (3 x 64 + 4). H200, fp32 NCHW->NHWC (256, 1024, 14,
    # 14) 78.0 -> 90.7% of copy, (64, ...) 75.7 -> 88.0 (with perm_async_copy; 88.0 and 85.1
    # without); 16-bit and int8 rows of 784 held whole (pitch 0 mod 8) fell to 28-43%
    perm_flat_rows4: tuple[int, ...] = ()


# Measured on the H100 (sm_90); every number in the comments above is from it but where a
# comment names the H200.
HOPPER = Tuning("sm_90")
# Ampere has no clusters; the rest is not separately tuned (the H100 table).
AMPERE = replace(HOPPER, arch="sm_80")
# Turing and Volta (the planner gives them no clusters either): Ampere's table, not tuned on them.
TURING = replace(AMPERE, arch="sm_75")
VOLTA = replace(AMPERE, arch="sm_70")
_TABLES = {(9, 0): HOPPER, (8, 0): AMPERE, (7, 5): TURING, (7, 0): VOLTA}
# A GPU model whose memory differs from the one its architecture's table was measured on: its
# changes to that table, matched in the device's name.
# H200: the H100's SMs with HBM3e (4.8 TB/s against 3.35): measured on it.
# bn_cols_stats_blocks_per_sm 2 (H200, statistics pass alone, CUPTI): fp16 NHWC (64, 1024, 14,
# 14) 15.9 -> 14.5 us, NC (65536, 256) 18.6 -> 17.3; (64, 64, 112, 112) and the float32 and 5-D
# shapes tried within 0.6 us. bn_cols_grad_waves 1 (gradient sums alone): fp16 NC (4096, 4096)
# 29.0 -> 26.5 us, NHWC (64, 64, 112, 112) 66.1 -> 63.8, (8, 64, 16, 56, 56) 39.4 -> 37.3;
# (64, 1024, 14, 14) and float32 (64, 2048, 7, 7) within 0.1
# norm_bwd_narrow (every way forced, norm_backward_ways_h200.json): float16 layer norm R2g from
# 2048 columns, against the H100's rules 71.7 -> 82.5% of copy (2048), 77.1 -> 80.3 (4096),
# 72.2 -> 77.6 (8192), 70.1 -> 72.2 (16384), 63.8 -> 71.1 (32768); RMS norm narrow S2g past 2048,
# 89.5 -> 99.0 (4096), 87.2 -> 94.7 (8192), 82.0 -> 91.9 (16384), 75.9 -> 86.2 (32768), and R2g
# where no S2g way fits: 69.4 -> 80.2 (131072), 60.8 -> 78.2 (262144). norm_bwd_regs_min_cols_32bit
# (A/B against the H100's plans): float32 layer norm clusters with the sums in registers 92.0 ->
# 93.0 (32768), 89.1 -> 92.7 (65536), 82.8 -> 87.6 (131072); RMS norm 94.9 -> 94.9, 94.0 ->
# 96.6, 94.7 -> 96.6; forced at 16384, layer norm -0.2. norm_bwd_min_packs_32bit (A/B against
# c28a9f2): float32 layer norm 83.5 -> 92.1 (1024 columns), 81.5 -> 91.3 (2048); forced ways of
# a pack a thread 58-94 against 85-100 at two. two_packs_max_packs 32 (forward warp shapes
# forced, H200): layer norm float16 128 columns 86.7 -> 94.7 (8 lanes of 2 packs), 256 85.4 ->
# 94.7 (16 of 2); RMS norm float16 and both ops in float32 within -0.6..+0.9. warp_four_packs
# (A/B against two packs): layer norm bfloat16 128 columns 93.1 -> 98.3, 256 92.9 -> 95.5,
# float16 95.5 -> 97.4 and 96.2 -> 95.3. perm_small_*
# (kernel us, the planned tile against the general kernel of 4 elements a thread in narrow
# blocks): (8192, 3) float16 3.17 -> 2.33, (1024, 3) int8 3.23 -> 2.45, (65536, 3) float16 3.27
# -> 2.73, (8, 14, 14, 64) NHWC->NCHW float32 4.04 -> 3.30; row tiles of 256 KB and more stay
# faster as tiles ((512, 512) int8 3.27 against 4.10)
_MODELS = {"H200": {"bn_apply_cols_few_packs_16bit": 16, "bn_cols_stats_blocks_per_sm": 2,
                    "bn_cols_grad_waves": 1, "perm_panel_tiles": 1,
                    "perm_async_copy": (1, 2, 4, 8, 16), "perm_flat_rows4": (4,),
                    "norm_bwd_narrow": (("layer_norm_backward", ("r2g",), 1024),
                                        ("rms_norm_backward", ("s2g", "r2g"), 2048)),
                    "norm_bwd_regs_min_cols_32bit": 32768, "norm_bwd_min_packs_32bit": 2,
                    "two_packs_max_packs": 32, "warp_four_packs": (("layer_norm", 2),),
                    "perm_small_max_bytes": 131072,
                    "perm_small_flat_max_bytes": 1048576}}
_MODEL_ARCH = {"H200": (9, 0)}  # the architecture (table) each model's changes apply to


def arch_tunings(device) -> list[Tuning]:
    """The table of the device's architecture and that table with the changes of each GPU
    model of the architecture: every table a device of it may plan with (reachable kernels)."""
    cc = (9, 0) if device is None else tuple(device.compute_capability)
    arch = max((k for k in _TABLES if k <= cc), default=(8, 0))
    return [_table_for(cc)] + [_table_for(cc, m) for m in _MODELS if _MODEL_ARCH[m] == arch]


def tuning_for(device) -> Tuning:
    """The table of the newest architecture at or below the device's (Hopper's for None),
    with the changes of its GPU model where :data:`_MODELS` names it."""
    if device is None:
        return HOPPER
    return _table_for(tuple(device.compute_capability), device.name)


@functools.cache  # the planner asks once a candidate plan
def _table_for(cc: tuple[int, int], name: str = "") -> Tuning:
    known = [k for k in _TABLES if k <= cc]
    table = _TABLES[max(known)] if known else AMPERE
    for model, changes in _MODELS.items():
        if model in name:
            return replace(table, **changes)
    return table


@dataclass(frozen=True)
class OpPolicy:
    """How one op maps onto its family's kernels, and the planning rules that are its own.
    Declared by the family (``cukern/families/``); read by the planner."""

    op: str
    source: str  # kernels/<source>.cuh
    kernel: str  # kernel name prefix there
    algo: int  # the kernels' ALGO template argument
    inputs: int  # row-sized inputs a cached kernel keeps on chip
    switches: tuple[str, ...] = ()  # the Switches fields the op accepts
    strided: bool = True  # has kernels for rows with strided columns
    # a backward that also sums over rows (dweight, dbias) with a weight: sums per column
    col_sums: int = 0
    # plan_cluster rule 1: resident threads an SM worth a larger cluster (norms make three
    # passes over their slice: 1536)
    cluster_threads_per_sm: int = 512
    # a block overlaps its rows itself, so clusters run in one wave looping over rows
    rows_overlap: bool = True
    # bytes a cached kernel adds to start its rows on a 128-byte boundary
    smem_align: int = 0
    # cluster kernels keep their reduction buffers at the end of the dynamic shared memory
    # (plan.rowwise.tail_scratch, kernels/memory.cuh): the block all-reduce's two states a warp
    # and the cluster merge's four, of this many compute-type words for each row of a pass
    tail_scratch_words: int = 0
    tail_merge_words: int = 0
    # dtypes whose block kernels keep their all-reduce's two states a warp there too (no merge)
    tail_in_blocks: tuple[str, ...] = ()
    # with a residual, cached kernels may overlap their rows (Plan.overlap)
    overlap_with_residual: bool = False
    # a lone block on its SM moves to a cluster of blocks sharing SMs (Tuning.lone_block_resident)
    split_lone_blocks: bool = False
    # warp rows of 3..8 full 16-byte packs: two packs of one row a lane (without a residual)
    two_packs_a_lane: bool = False
    # clusters over 16-bit rows with gamma or beta may cache two rows a pass
    pair_rows: bool = False
    # cluster plans of this many blocks or more run in one wave looping over rows (0: never)
    one_wave_cluster: int = 0
    # a cached block alone on its SM runs in one wave looping over rows (its next row's loads
    # beside this row's stores): softmax float16 65536 columns 80.5 -> 90.1% of copy, float32
    # 32768 90.5 -> 92.2; the backward's lone blocks -2.2 to +1.7 (H200, against 957e07d)
    lone_block_one_wave: bool = False
    # dtypes whose cached rows without a residual keep OneFlow's width where it holds
    # Tuning.kept_width_threads or more threads an SM in Tuning.kept_width_blocks blocks or
    # fewer (not a wider block: more threads, fewer rows in flight):
    # layer norm float32 16384 columns, 1024 threads 2 an SM ran 0.6-1.9 points of copy below
    # 512 threads 3 an SM (H200, 7920-8316 rows; RMS norm and residual rows gain 2-4 there)
    oneflow_width_dtypes: tuple[str, ...] = ()
    # packs a cached block's thread loads at once before using them (softmax_fill's U; 0: not
    # a rule): of widths with the most threads resident, and two or more blocks an SM, the
    # one whose threads load the row in the fewest such rounds: softmax 16-bit 8192 and 16384
    # columns 90.8-93.2 -> 95.8-97.1% of copy, float32 4096 95.2-96.0 -> 97.3-97.7 (H200,
    # against 6dd5f5a)
    load_round: int = 0
    # takes float32 weight and bias with 16-bit data (Switches.float32_params): planned as the
    # uncached kernel, the one instantiated for them (kernels/norm.cuh)
    float32_params: bool = False
    # cluster kernels whose packs are narrower than this many bytes take the cluster's size at
    # launch (Plan.launch_cluster): one instantiation for every size (0: never)
    cluster_at_launch_below: int = 0
    # block widths compiled into the cached block kernels (their WIDTH; others read it at launch)
    fixed_widths: tuple[int, ...] = ()
    # rows off the 16-byte grid (a length or start that is not a multiple of 16 bytes) take
    # 16-byte packs on memory's grid, their end packs masked (Plan.shifted; the kernels' SHIFT)
    shifted_rows: bool = False
    # ... in the uncached kernel too (else a row too long for the cached kernels takes narrow
    # packs), and in clusters of two rows a pass (else one)
    shifted_uncached: bool = True
    shifted_pairs: bool = True
    # warp rows whose shifted packs would span more than the warp kernel holds take them in the
    # block kernel (H200, norms at 1023 columns: 16-62% of copy in 1-value warp packs, 35-95%)
    shifted_past_warp: bool = False
    # warp rows take shifted packs wherever those fill 32 values a lane, not only where they need
    # no more slots than narrow packs (H200, 511 columns: RMS norm 30-57% -> 52-74%; layer norm
    # without a residual 36-56% -> 16-30%, so not for it)
    shifted_half_warps: bool = False
    # the family's signature: plan -> C++ name expression
    signature: Callable = field(default=None, repr=False, compare=False)
    # switch combinations this op's kernels were built for: the default first
    switch_sets: tuple = ()

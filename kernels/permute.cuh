// Permute (cukern/ops/permute.py): y = x with its axes reordered, materialised, for arrays of any
// strides. The kernels move unsigned words by size (1, 2, 4, 8 or 16 bytes), never values, so one
// instantiation serves every dtype of a size and the copy is bit-exact. The planner
// (cukern/plan/permute.py) simplifies the permutation to dims of (size, input stride, output
// stride) in elements, then launches one kernel:
//
//   permute_rows<W, IDX[, UN]>    rows along one dim: threads walk a row tile of TY rows by
//                                 TX * U words (U words a thread in flight), the other dims'
//                                 offsets decomposed once a row. A copy when the dim is
//                                 contiguous on both sides (W: a vector of elements, 16 bytes
//                                 where alignment allows, with a byte tail for one-row copies);
//                                 the general strided kernel otherwise (W: one element).
//   permute_tile<T, VI, VO, IDX, REGS, FO, SK, ASYNC>
//                                 a batched 2-D transpose through shared memory: dim i (input
//                                 stride 1) by dim o (output stride 1) in tiles of ti x to,
//                                 loaded VI elements a word along i, stored VO a word along o;
//                                 the other dims are a batch of any strides. A tile side that is
//                                 one contiguous run of memory (a short dim held whole: C = 3,
//                                 HW = 49) is moved as that flat run, in full words. REGS (1-
//                                 and 2-byte elements, output rows, tile rows 4 (mod 8)
//                                 elements apart): phase 2 reads 32-bit words of shared memory
//                                 and transposes them in registers. FO (a flat output run
//                                 of blocks of FO = 3 elements, 16-byte stores): phase 2
//                                 reads 16-byte row chunks and interleaves them in registers.
//                                 SK (1- and 2-byte elements, a flat output run of channels
//                                 of L = SK (mod VO) elements, 16-byte stores): phase 2 reads
//                                 32-bit columns over rows skewed SK a channel. ASYNC: phase 1
//                                 copies by cp.async (no registers hold the words; fallbacks
//                                 before sm_80), the next tile's copies in flight while a
//                                 block's tile is stored.
//
// IDX is int where every offset and count fits in 31 bits, long long past that. Divisions by
// run-time sizes use FastDiv (quotients of n < 2^31); 64-bit kernels divide natively only where
// a row or tile index passes 2^31. The argument structs mirror numpy dtypes of the family module
// (cukern/families/permute.py), passed by value.
#pragma once

#include "async_copy.cuh"
#include "permute_parts.cuh"

namespace cukern {

// permute_rows: rows along one dim, a copy or the general strided kernel (PermuteRowsArgs).
// UN: words a thread (0: perm::rows_unroll; 1 for small arrays, spread over more threads).
template <typename W, typename IDX, int UN = 0>
__global__ void __launch_bounds__(perm::kThreads)
    permute_rows(const W* __restrict__ x, W* __restrict__ y, const PermuteRowsArgs a) {
  constexpr int U = UN > 0 ? UN : perm::rows_unroll(sizeof(W));
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int TX = blockDim.x, TY = blockDim.y;
  const IDX len = IDX(a.len), rows = IDX(a.rows), tiles = IDX(a.tiles), segs = IDX(a.segs);
  const IDX is = IDX(a.in_step), os = IDX(a.out_step);
  const W* __restrict__ xb = x + a.in_base;
  W* __restrict__ yb = y + a.out_base;
  for (IDX t = blockIdx.x; t < tiles; t += gridDim.x) {
    const IDX rt = perm::div_index(t, a.segs, a.seg_m, a.seg_s);
    const IDX seg = t - rt * segs;
    const IDX row = rt * TY + ty;
    if (row >= rows) continue;
    IDX io = 0, oo = 0;
    perm::batch_offsets(a.batch, row, io, oo);
    const IDX c0 = seg * IDX(TX * U) + tx;
    W v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const IDX c = c0 + IDX(u * TX);
      if (c < len) v[u] = xb[io + c * is];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const IDX c = c0 + IDX(u * TX);
      if (c < len) yb[oo + c * os] = v[u];
    }
  }
  if (a.tail && blockIdx.x == 0 && ty * TX + tx < a.tail) {  // at most 15 bytes
    const long long at = a.len * (long long)sizeof(W) + ty * TX + tx;
    reinterpret_cast<unsigned char*>(yb)[at] = reinterpret_cast<const unsigned char*>(xb)[at];
  }
}

// permute_tile: a batched transpose through shared memory (PermuteTileArgs), phase 1 through
// registers or by cp.async, phase 2 gathered or in registers (permute_parts.cuh).
template <typename T, int VI, int VO, typename IDX, bool REGS = false, int FO = 0, int SK = -1,
          bool ASYNC = false>
__global__ void __launch_bounds__(perm::kThreads)
    permute_tile(const T* __restrict__ x, T* __restrict__ y, const PermuteTileArgs a) {
  constexpr int E = sizeof(T);
  // FO: rows of shared memory 16-byte aligned (pitch ti, or a flat input run of a multiple
  // of VO elements), so a loaded word goes to shared memory whole
  constexpr int SU = FO > 0 ? VI * E : perm::smem_unit(E, VI);
  constexpr int UN = perm::kTileUnroll;
  typedef perm::Vec<T, VI, SU> In;
  typedef perm::Vec<T, VO, (VO * E < 4 ? VO * E : 4)> Out;
  extern __shared__ uint4 perm_smem[];
  T* s = reinterpret_cast<T*>(perm_smem);
  const int NT = blockDim.x;
  const IDX si = IDX(a.si), so = IDX(a.so), o_in = IDX(a.o_in), i_out = IDX(a.i_out);
  const int ti = a.ti, to = a.to, pitch = a.pitch;
  const T* __restrict__ xb = x + a.in_base;
  T* __restrict__ yb = y + a.out_base;

  // Where tile t lies: i fastest inside a panel of nti tiles along i, then o, then the panels,
  // then the batch (one panel: i, then o); its offsets and extents.
  struct Tile {
    IDX i0, o0, ib, ob;
    int ti_e, to_e;
  };
  auto place = [&](IDX t) {
    Tile p;
    const unsigned r1 = perm::fdiv(unsigned(t), a.nti_m, a.nti_s);
    const unsigned r2 = perm::fdiv(r1, a.nto_m, a.nto_s);
    const unsigned tb = perm::fdiv(r2, a.npi_m, a.npi_s);
    p.i0 = IDX((r2 - tb * unsigned(a.npi)) * unsigned(a.nti) + (unsigned(t) - r1 * unsigned(a.nti))) *
           ti;
    p.o0 = IDX(r1 - r2 * unsigned(a.nto)) * to;
    p.ib = 0;
    p.ob = 0;
    perm::batch_offsets(a.batch, IDX(tb), p.ib, p.ob);
    p.ti_e = int(si - p.i0 < IDX(ti) ? si - p.i0 : IDX(ti));
    p.to_e = int(so - p.o0 < IDX(to) ? so - p.o0 : IDX(to));
    return p;
  };

  // Phase 1, word w of a tile: elements it holds, its shared-memory offset and global offset.
  auto word_in = [&](const Tile& p, int w, int& nv, int& at) {
    IDX g = 0;  // offsets are formed only for elements inside the arrays
    if (a.flat_in) {
      const int n_in = p.to_e * p.ti_e;
      const int q = w * VI;
      nv = n_in - q < VI ? n_in - q : VI;
      at = q;
      g = p.ib + p.o0 * o_in + q;
    } else {
      const int ol = int(perm::fdiv(unsigned(w), a.in_words_m, a.in_words_s));
      const int il = (w - ol * a.in_words) * VI;
      const int left = p.ti_e - il;
      nv = ol < p.to_e && left > 0 ? (left < VI ? left : VI) : 0;
      at = ol * pitch + il;
      if (nv > 0) g = p.ib + (p.o0 + ol) * o_in + p.i0 + il;
    }
    return g;
  };
  auto words_in = [&](const Tile& p) {
    return a.flat_in ? (p.to_e * p.ti_e + VI - 1) / VI : to * a.in_words;
  };

  // Phase 2: shared memory -> global, words of VO elements along o (or the flat run).
  auto store = [&](const T* sm, const Tile& p) {
    if constexpr (REGS) {  // words of shared memory, transposed in registers
      perm::store_regs<T, VO, IDX>(sm, yb, a, p.ti_e, p.to_e, p.ob + p.i0 * i_out + p.o0, i_out);
      return;
    }
    if constexpr (SK >= 0) {  // a flat run of channels: skewed 32-bit columns in registers
      perm::store_skew<T, VO, SK, IDX>(sm, yb, a, p.ti_e, p.ob + p.i0 * so);
      return;
    }
    if constexpr (FO > 0) {  // the flat run's blocks of FO interleaved in registers
      perm::store_flat<T, VO, FO, IDX>(sm, yb, a, p.ti_e, p.ob + p.i0 * so);
      return;
    }
    const int n_out = a.flat_out ? p.ti_e * p.to_e : 0;
    const int words2 = a.flat_out ? (n_out + VO - 1) / VO : ti * a.out_words;
    const int gmask = (1 << a.group) - 1;
    for (int w0 = threadIdx.x; w0 < words2; w0 += UN * NT) {
      Out v[UN];
      int nv[UN];
      IDX g[UN];
#pragma unroll
      for (int k = 0; k < UN; ++k) {
        const int w = w0 + k * NT;
        nv[k] = 0;
        g[k] = 0;
        if (w < words2) {
          if (a.flat_out) {
            const int q = w * VO;
            int il = int(perm::fdiv(unsigned(q), a.so_m, a.so_s));
            int ol = q - il * int(a.so);
            nv[k] = n_out - q < VO ? n_out - q : VO;
            g[k] = p.ob + p.i0 * so + q;
#pragma unroll
            for (int j = 0; j < VO; ++j) {
              if (j < nv[k]) {
                v[k].e[j] = sm[ol * pitch + il];
                if (++ol == int(a.so)) {
                  ol = 0;
                  ++il;
                }
              }
            }
          } else {
            const int r = w >> a.group;
            const int og = int(perm::fdiv(unsigned(r), a.ti_m, a.ti_s));
            const int il = r - og * ti;
            const int ol = (((og << a.group) | (w & gmask))) * VO;
            const int left = p.to_e - ol;
            nv[k] = il < p.ti_e && left > 0 ? (left < VO ? left : VO) : 0;
            if (nv[k] > 0) g[k] = p.ob + (p.i0 + il) * i_out + p.o0 + ol;
            const T* src = sm + ol * pitch + il;
            if (nv[k] == VO) {
#pragma unroll
              for (int j = 0; j < VO; ++j) v[k].e[j] = src[j * pitch];
            } else {
#pragma unroll
              for (int j = 0; j < VO; ++j)
                if (j < nv[k]) v[k].e[j] = src[j * pitch];
            }
          }
        }
      }
#pragma unroll
      for (int k = 0; k < UN; ++k) {
        if (nv[k] == VO) {
          *reinterpret_cast<perm::Word<VO * E>*>(yb + g[k]) = v[k].w;
        } else {
#pragma unroll
          for (int j = 0; j < VO; ++j)
            if (j < nv[k]) yb[g[k] + j] = v[k].e[j];
        }
      }
    }
  };

  if constexpr (!ASYNC) {
    for (IDX t = blockIdx.x; t < IDX(a.tiles); t += gridDim.x) {
      // the tile: i fastest inside a panel of nti tiles along i, then o, then the panels, then
      // the batch (one panel: i, then o)
      const unsigned r1 = perm::fdiv(unsigned(t), a.nti_m, a.nti_s);
      const unsigned r2 = perm::fdiv(r1, a.nto_m, a.nto_s);
      const unsigned tb = perm::fdiv(r2, a.npi_m, a.npi_s);
      const IDX i0 =
          IDX((r2 - tb * unsigned(a.npi)) * unsigned(a.nti) + (unsigned(t) - r1 * unsigned(a.nti))) *
          ti;
      const IDX o0 = IDX(r1 - r2 * unsigned(a.nto)) * to;
      IDX ib = 0, ob = 0;
      perm::batch_offsets(a.batch, IDX(tb), ib, ob);
      const int ti_e = int(si - i0 < IDX(ti) ? si - i0 : IDX(ti));  // extents of this tile
      const int to_e = int(so - o0 < IDX(to) ? so - o0 : IDX(to));

      // Phase 1: global -> shared memory, words of VI elements along i (or the flat run).
      const int n_in = a.flat_in ? to_e * ti_e : 0;  // flat run length
      const int words1 = a.flat_in ? (n_in + VI - 1) / VI : to * a.in_words;
      for (int w0 = threadIdx.x; w0 < words1; w0 += UN * NT) {
        In v[UN];
        int nv[UN], at[UN];
#pragma unroll
        for (int k = 0; k < UN; ++k) {
          const int w = w0 + k * NT;
          nv[k] = 0;
          at[k] = 0;
          if (w < words1) {
            IDX g = 0;  // offsets are formed only for elements inside the arrays
            if (a.flat_in) {
              const int q = w * VI;
              nv[k] = n_in - q < VI ? n_in - q : VI;
              at[k] = q;
              g = ib + o0 * o_in + q;
            } else {
              const int ol = int(perm::fdiv(unsigned(w), a.in_words_m, a.in_words_s));
              const int il = (w - ol * a.in_words) * VI;
              const int left = ti_e - il;
              nv[k] = ol < to_e && left > 0 ? (left < VI ? left : VI) : 0;
              at[k] = ol * pitch + il;
              if (nv[k] > 0) g = ib + (o0 + ol) * o_in + i0 + il;
            }
            if (nv[k] == VI) {
              v[k].w = *reinterpret_cast<const perm::Word<VI * E>*>(xb + g);
            } else {
#pragma unroll
              for (int j = 0; j < VI; ++j)
                if (j < nv[k]) v[k].e[j] = xb[g + j];
            }
          }
        }
#pragma unroll
        for (int k = 0; k < UN; ++k) {
          if (nv[k] == VI) {
            perm::Word<SU>* d = reinterpret_cast<perm::Word<SU>*>(s + at[k]);
#pragma unroll
            for (int j = 0; j < VI * E / SU; ++j) d[j] = v[k].u[j];
          } else {
#pragma unroll
            for (int j = 0; j < VI; ++j)
              if (j < nv[k]) s[at[k] + j] = v[k].e[j];
          }
        }
      }
      __syncthreads();

      if constexpr (REGS) {  // words of shared memory, transposed in registers
        perm::store_regs<T, VO, IDX>(s, yb, a, ti_e, to_e, ob + i0 * i_out + o0, i_out);
        __syncthreads();
        continue;
      }
      if constexpr (SK >= 0) {  // a flat run of channels: skewed 32-bit columns in registers
        perm::store_skew<T, VO, SK, IDX>(s, yb, a, ti_e, ob + i0 * so);
        __syncthreads();
        continue;
      }
      if constexpr (FO > 0) {  // the flat run's blocks of FO interleaved in registers
        perm::store_flat<T, VO, FO, IDX>(s, yb, a, ti_e, ob + i0 * so);
        __syncthreads();
        continue;
      }

      // Phase 2: shared memory -> global, words of VO elements along o (or the flat run).
      const int n_out = a.flat_out ? ti_e * to_e : 0;
      const int words2 = a.flat_out ? (n_out + VO - 1) / VO : ti * a.out_words;
      const int gmask = (1 << a.group) - 1;
      for (int w0 = threadIdx.x; w0 < words2; w0 += UN * NT) {
        Out v[UN];
        int nv[UN];
        IDX g[UN];
#pragma unroll
        for (int k = 0; k < UN; ++k) {
          const int w = w0 + k * NT;
          nv[k] = 0;
          g[k] = 0;
          if (w < words2) {
            if (a.flat_out) {
              const int q = w * VO;
              int il = int(perm::fdiv(unsigned(q), a.so_m, a.so_s));
              int ol = q - il * int(a.so);
              nv[k] = n_out - q < VO ? n_out - q : VO;
              g[k] = ob + i0 * so + q;
#pragma unroll
              for (int j = 0; j < VO; ++j) {
                if (j < nv[k]) {
                  v[k].e[j] = s[ol * pitch + il];
                  if (++ol == int(a.so)) {
                    ol = 0;
                    ++il;
                  }
                }
              }
            } else {
              const int r = w >> a.group;
              const int og = int(perm::fdiv(unsigned(r), a.ti_m, a.ti_s));
              const int il = r - og * ti;
              const int ol = (((og << a.group) | (w & gmask))) * VO;
              const int left = to_e - ol;
              nv[k] = il < ti_e && left > 0 ? (left < VO ? left : VO) : 0;
              if (nv[k] > 0) g[k] = ob + (i0 + il) * i_out + o0 + ol;
              const T* src = s + ol * pitch + il;
              if (nv[k] == VO) {
#pragma unroll
                for (int j = 0; j < VO; ++j) v[k].e[j] = src[j * pitch];
              } else {
#pragma unroll
                for (int j = 0; j < VO; ++j)
                  if (j < nv[k]) v[k].e[j] = src[j * pitch];
              }
            }
          }
        }
#pragma unroll
        for (int k = 0; k < UN; ++k) {
          if (nv[k] == VO) {
            *reinterpret_cast<perm::Word<VO * E>*>(yb + g[k]) = v[k].w;
          } else {
#pragma unroll
            for (int j = 0; j < VO; ++j)
              if (j < nv[k]) yb[g[k] + j] = v[k].e[j];
          }
        }
      }
      __syncthreads();
    }
  } else {
    // Phase 1 by cp.async: no registers hold the words in flight. A block that takes more than
    // one tile has two buffers (the planner's tile each, 16-byte aligned): its next tile is
    // copied while this one is stored.
    T* cur = s;
    T* nxt = s + ((to * pitch * E + 15) / 16 * 16) / E;
    auto copy = [&](T* sm, const Tile& p) {
      const int words1 = words_in(p);
      for (int w = threadIdx.x; w < words1; w += NT) {
        int nv, at;
        const IDX g = word_in(p, w, nv, at);
        if (SU >= 4 && nv == VI) {
#pragma unroll
          for (int j = 0; j < VI * E / SU; ++j)
            cp_async<(SU >= 4 ? SU : 4)>(sm + at + j * (SU / E), xb + g + j * (SU / E));
        } else {
          for (int j = 0; j < nv; ++j) sm[at + j] = xb[g + j];
        }
      }
      cp_async_commit();
    };
    IDX t = blockIdx.x;
    Tile p = place(t < IDX(a.tiles) ? t : IDX(0));
    if (t < IDX(a.tiles)) copy(cur, p);
    for (; t < IDX(a.tiles); t += gridDim.x) {
      const IDX tn = t + gridDim.x;
      Tile pn = p;
      if (tn < IDX(a.tiles)) {
        pn = place(tn);
        copy(nxt, pn);
      } else {
        cp_async_commit();  // an empty group keeps the count
      }
      cp_async_wait_group<1>();  // this tile's copies have landed
      __syncthreads();
      store(cur, p);
      __syncthreads();  // its buffer is the one the tile after next is copied into
      T* const done = cur;
      cur = nxt;
      nxt = done;
      p = pn;
    }
  }
}

}  // namespace cukern

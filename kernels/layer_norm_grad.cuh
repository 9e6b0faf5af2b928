// Layer norm and RMS norm backward, and the dgamma / dbeta reduction (norm.cuh: the formulas
// and what the kernels share).
//
// Variants, chosen by the planner (cukern/plan/):
//   *_warp            a group of blockDim.x lanes owns a row held in registers (cols <= 1024)
//   *_block_smem      one block per row, the row cached in shared memory in its storage type
//   *_cluster         a cluster of CLUSTER blocks per row (sm_90), each caching a slice
//   *_block_uncached  one block per row, the row read again from global memory
#pragma once
#include "cluster.cuh"
#include "norm.cuh"

namespace cukern {

// ---------------------------------------------------------------------------------------------
// Fused functors.

// g = dy * gamma (dy when there is no weight). load2 also returns dy itself, which the dgamma and
// dbeta sums need. CACHED: gamma is read from `cached`, already converted, in shared memory
// (grad_cached; laid out by cached_at), instead of from memory and converted at every use.
// P: gamma's type (T, or float for 16-bit T in the uncached kernel; see norm.cuh).
template <typename T, typename C, bool WEIGHT, bool CACHED = false, typename P = T>
struct ScaleLoad {
  Load<T, C, false> dy;
  Load<P, C, false> gamma;
  const C* cached;  // value j of the row's pack p at cached[cached_at<N>(p, j)]
  // Packs of 8 floats (from 16-bit gamma) swap their two 16-byte halves in every other group of
  // 4 packs: a warp's 16-byte reads, 32 bytes apart, then meet each bank once a wavefront (in
  // place, two threads of 8 would share banks: two wavefronts a read).
  template <int N> static __device__ __forceinline__ int cached_at(int p, int j) {
    if constexpr (sizeof(C) == 4 && N == 8) return p * 8 + ((j / 4) ^ ((p >> 2) & 1)) * 4 + j % 4;
    return p * N + j;
  }
  template <int N> __device__ __forceinline__ void scale(const C* d, C* g, int col) const {
    if (WEIGHT) {
      C w[N];
      if constexpr (CACHED) {
        load_cached<N>(w, col);
      } else {
        load_param<N>(gamma, w, col);
      }
#pragma unroll
      for (int i = 0; i < N; ++i) g[i] = d[i] * w[i];
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) g[i] = d[i];
    }
  }
  template <int N> __device__ __forceinline__ void load_cached(C* w, int col) const {
    const int p = col / N;
    if constexpr (sizeof(C) == 4 && N % 4 == 0) {  // 16-byte shared loads
#pragma unroll
      for (int j = 0; j < N; j += 4) {
        const float4 v = *reinterpret_cast<const float4*>(cached + cached_at<N>(p, j));
        w[j] = v.x;
        w[j + 1] = v.y;
        w[j + 2] = v.z;
        w[j + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) w[j] = cached[cached_at<N>(p, j)];
    }
  }
  template <int N> __device__ __forceinline__ void load2(C* d, C* g, i64 row, int col) const {
    dy.template load<N>(d, row, col);
    scale<N>(d, g, col);
  }
  template <int N> __device__ __forceinline__ void load(C* g, i64 row, int col) const {
    C d[N];
    load2<N>(d, g, row, col);
  }
};

// x and dy of one row side by side: dst[0, N) = x, dst[N, 2N) = dy.
template <typename T, typename C> struct PairLoad {
  Load<T, C, false> x, dy;
  template <int N> __device__ __forceinline__ void load(C* dst, i64 row, int col) const {
    x.template load<N>(dst, row, col);
    dy.template load<N>(dst + N, row, col);
  }
};

// ---------------------------------------------------------------------------------------------
// Backward. mean is null for RMS norm. With WEIGHT, g = dy * gamma and the kernel also sums
// dy * xhat (and dy, for layer norm) over the rows each block (cluster, for *_cluster) handles:
// one partial row of `cols` sums per block in dw (and db), in the compute type; a second kernel,
// norm_param_grad_reduce, adds the partial rows up. sdy, sx, sdx: row strides.
#define CUKERN_NORM_BWD_PARAMS(P)                                                              \
  const T *dy, const T *x, const typename Num<T>::compute *mean,                               \
      const typename Num<T>::compute *rstd, const P *gamma, T *dx,                             \
      typename Num<T>::compute *dw, typename Num<T>::compute *db, i64 rows, int cols, i64 sdy,  \
      i64 sx, i64 sdx

#define CUKERN_NORM_BWD_SETUP(P)                                                               \
  typedef typename Num<T>::compute C;                                                          \
  static_assert(ALGO == kLayerNorm || ALGO == kRMSNorm, "ALGO: 0 layer norm, 1 RMS norm");     \
  constexpr bool LAYER = ALGO == kLayerNorm;                                                   \
  constexpr int NSUM = LAYER ? 2 : 1;              /* row sums: g * xhat (and g) */            \
  constexpr int NACC = LAYER ? 2 : 1;              /* column sums: dy * xhat (and dy) */       \
  const Load<T, C, false> ld_x{x, rows_at(sx)};                                                \
  const ScaleLoad<T, C, WEIGHT, false, P> ld_g{{dy, rows_at(sdy)}, {gamma, rows_at(0)}, nullptr}; \
  const PairLoad<T, C> ld_xdy{{x, rows_at(sx)}, {dy, rows_at(sdy)}};                           \
  const Store<C, T, false> st{dx, rows_at(sdx)};                                               \
  (void)ld_x;                                                                                  \
  (void)ld_xdy;                                                                                \
  unsigned phase = 0; /* allreduce_block's buffer phase */                                     \
  (void)phase;                                                                                 \
  (void)NACC

// One element's contribution to the row sums.
template <bool LAYER, typename C, int K>
__device__ __forceinline__ void add_row_terms(Sums<C, K>& s, C g, C xhat) {
  s.v[0] += g * xhat;
  if constexpr (LAYER) s.v[1] += g;
}

// dx for one element, given the row sums: rs * (g - mean(g) - xhat * mean(g * xhat)) as two fused
// multiply-adds, rs * g + (xhat * b + a) with a = -rs * mean(g), b = -rs * mean(g * xhat). A layer
// norm over one column has dx = 0 exactly (x - mean = 0): its row takes r = 0, since the FMA
// would keep rs * g's rounding error, amplified by rs = 1 / sqrt(eps). ONE: the kernel may see
// rows of one column; the cached kernels (rows past the warp kernel's 512 or 1024 columns) skip
// the test, which sat on each row's path (without it their SASS is 60a9db0's again).
template <bool LAYER, typename C, int K, bool ONE = true> struct GradX {
  C m, rs, a, b;
  __device__ __forceinline__ GradX(const Sums<C, K>& s, C m_, C rs_, C inv_cols)
      : GradX(s, m_, ONE && LAYER && inv_cols == C(1) ? C(0) : rs_, inv_cols, 0) {}
  __device__ __forceinline__ GradX(const Sums<C, K>& s, C m_, C r, C inv_cols, int)
      : m(m_), rs(r), a(LAYER ? -r * (s.v[K - 1] * inv_cols) : C(0)),
        b(-r * (s.v[0] * inv_cols)) {}
  __device__ __forceinline__ C with_xhat(C xhat, C g) const { return rs * g + (xhat * b + a); }
  __device__ __forceinline__ C operator()(C x, C g) const { return with_xhat((x - m) * rs, g); }
};

template <typename T, int ALGO, int PACK, int CPT, int RPA, bool WEIGHT>
__global__ void __launch_bounds__(128) layer_norm_grad_warp(CUKERN_NORM_BWD_PARAMS(T)) {
  CUKERN_NORM_BWD_SETUP(T);
  static_assert(CPT % PACK == 0, "cols_per_thread must be a multiple of pack_size");
  constexpr int NP = CPT / PACK;
  const int width = blockDim.x, lane = threadIdx.x;
  const C inv_cols = C(1) / C(cols);
  C acc[NACC][CPT];  // this lane's columns, summed over every row it handles
#pragma unroll
  for (int k = 0; k < NACC; ++k) {
#pragma unroll
    for (int i = 0; i < CPT; ++i) acc[k][i] = C(0);
  }
  const i64 step = static_cast<i64>(gridDim.x) * blockDim.y * RPA;
  for (i64 base = static_cast<i64>(blockIdx.x) * blockDim.y * RPA; base < rows; base += step) {
    const i64 row0 = base + static_cast<i64>(threadIdx.y) * RPA;
    C xh[RPA][CPT], g[RPA][CPT], rs[RPA];
    Sums<C, NSUM> s[RPA];
#pragma unroll
    for (int r = 0; r < RPA; ++r) {
      const i64 row = row0 + r;
      const bool valid = row < rows;
      const C m = (LAYER && valid) ? mean[row] : C(0);
      rs[r] = valid ? rstd[row] : C(0);
      s[r] = Sums<C, NSUM>::identity();
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        const int col = (p * width + lane) * PACK;
        if (valid && col < cols) {
          C xv[PACK], d[PACK];
          ld_x.template load<PACK>(xv, row, col);
          ld_g.template load2<PACK>(d, g[r] + p * PACK, row, col);
#pragma unroll
          for (int i = 0; i < PACK; ++i) {
            const C xhat = (xv[i] - m) * rs[r];
            xh[r][p * PACK + i] = xhat;
            if (WEIGHT) {
              acc[0][p * PACK + i] += d[i] * xhat;
              if (LAYER) acc[NACC - 1][p * PACK + i] += d[i];
            }
          }
        } else {
#pragma unroll
          for (int i = 0; i < PACK; ++i) xh[r][p * PACK + i] = g[r][p * PACK + i] = C(0);
        }
      }
#pragma unroll
      for (int i = 0; i < CPT; ++i) add_row_terms<LAYER>(s[r], g[r][i], xh[r][i]);
    }
#pragma unroll
    for (int r = 0; r < RPA; ++r) s[r] = allreduce_group(s[r], width);
#pragma unroll
    for (int r = 0; r < RPA; ++r) {
      const i64 row = row0 + r;
      if (row >= rows) continue;
      const GradX<LAYER, C, NSUM> gx(s[r], C(0), rs[r], inv_cols);
      store_lane_packs<NP, PACK, C>(st, row, width, lane, cols,
                                    [&](int j) { return gx.with_xhat(xh[r][j], g[r][j]); });
    }
  }
  if constexpr (WEIGHT) {
    // Lanes l and l ^ mask (mask >= width) of a warp hold the same columns: add them up, then add
    // the warps' sums one warp after another in shared memory, and write the block's row.
    __shared__ C red[NACC][32 * CPT];
#pragma unroll
    for (int mask = 1; mask < 32; mask *= 2) {
      if (mask >= width) {
#pragma unroll
        for (int k = 0; k < NACC; ++k) {
#pragma unroll
          for (int i = 0; i < CPT; ++i) acc[k][i] += __shfl_xor_sync(0xffffffffu, acc[k][i], mask);
        }
      }
    }
    const int tid = threadIdx.y * width + lane;
    const int nthreads = blockDim.x * blockDim.y, warp = tid / 32;
    const bool first_group = tid % 32 < width;
    for (int w = 0; w < nthreads / 32; ++w) {
      if (warp == w && first_group) {
#pragma unroll
        for (int p = 0; p < NP; ++p) {
          const int col = (p * width + lane) * PACK;
          if (col >= cols) continue;
#pragma unroll
          for (int k = 0; k < NACC; ++k) {
#pragma unroll
            for (int i = 0; i < PACK; ++i) {
              red[k][col + i] = (w == 0 ? C(0) : red[k][col + i]) + acc[k][p * PACK + i];
            }
          }
        }
      }
      __syncthreads();
    }
    C* const out_w = dw + static_cast<i64>(blockIdx.x) * cols;
    C* const out_b = LAYER ? db + static_cast<i64>(blockIdx.x) * cols : nullptr;
    for (int c = tid; c < cols; c += nthreads) {
      out_w[c] = red[0][c];
      if (LAYER) out_b[c] = red[NACC - 1][c];
    }
  }
}

// Per-column sums private to one thread, in shared memory: slice-local pack q holds PACK sums,
// kept as WORDS words of W values (16 bytes, or the whole pack if smaller), word j of every pack
// side by side, so that a warp's threads (consecutive q) touch consecutive words: no bank
// conflicts, one vector access per word.
template <typename C, int PACK> struct ColSums {
  static constexpr int W = PACK < 16 / static_cast<int>(sizeof(C)) ? PACK : 16 / sizeof(C);
  static constexpr int WORDS = PACK / W;
  typedef typename Pack<C, W>::word_t word_t;
  C* base;
  int packs;  // packs in the slice
  __device__ __forceinline__ word_t& word(int j, int q) const {
    return reinterpret_cast<word_t*>(base)[j * packs + q];
  }
  __device__ __forceinline__ void zero(int q) const {
#pragma unroll
    for (int j = 0; j < WORDS; ++j) {
      Pack<C, W> z;
#pragma unroll
      for (int i = 0; i < W; ++i) z.elem[i] = C(0);
      word(j, q) = z.word;
    }
  }
  __device__ __forceinline__ void add(int q, const C* v) const {
#pragma unroll
    for (int j = 0; j < WORDS; ++j) {
      Pack<C, W> a;
      a.word = word(j, q);
#pragma unroll
      for (int i = 0; i < W; ++i) a.elem[i] += v[j * W + i];
      word(j, q) = a.word;
    }
  }
  // Writes the PACK sums of pack q to dst[0, PACK) in global memory (16-byte aligned words).
  __device__ __forceinline__ void copy_to(int q, C* dst) const {
#pragma unroll
    for (int j = 0; j < WORDS; ++j) reinterpret_cast<word_t*>(dst)[j] = word(j, q);
  }
};

// Per-column sums held in registers: a thread's packs p0 + threadIdx.x + j * blockDim.x,
// j < APT, at most REG_SUM_VALUES values of each sum (they fit beside the rest of the kernel
// in the 64 registers a 1024-thread block allows). Used when a block's slice has at most
// APT * blockDim.x packs (the planner sizes blocks for it), which frees the shared memory the
// sums would take: more blocks per SM, whose loads overlap each other's reductions.
template <typename C> struct RegSumValues { static constexpr int value = 16; };
template <> struct RegSumValues<double> { static constexpr int value = 8; };
template <typename C, int PACK> struct RegSums {
  static constexpr int APT = RegSumValues<C>::value / PACK > 0 ? RegSumValues<C>::value / PACK : 1;
  C w[APT][PACK], b[APT][PACK];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int j = 0; j < APT; ++j) {
#pragma unroll
      for (int i = 0; i < PACK; ++i) w[j][i] = b[j][i] = C(0);
    }
  }
  // Whether a slice of `packs` packs fits this block's registers.
  static __device__ __forceinline__ bool fits(int packs) {
    return packs <= APT * static_cast<int>(blockDim.x);
  }
};

// One element pack's part of a backward pass 1: its row sums, and with SUMS its column sums
// (dy * xhat, and dy for layer norm) into the registers of this thread's j-th pack (IN_REGS;
// j must then be a compile-time constant after unrolling) or into shared memory at slice-local
// pack q.
template <bool LAYER, bool SUMS, bool IN_REGS, int PACK, typename SL, typename C, int NSUM>
__device__ __forceinline__ void grad_fold(const SL& sl,
                                          const ColSums<C, PACK>& acc_w,
                                          const ColSums<C, PACK>& acc_b, RegSums<C, PACK>& regs,
                                          int p, int q, int j, const C* xv, const C* d, C m, C rs,
                                          Sums<C, NSUM>& s) {
  C g[PACK], dxh[PACK];
  sl.template scale<PACK>(d, g, p * PACK);
#pragma unroll
  for (int i = 0; i < PACK; ++i) {
    const C xhat = (xv[i] - m) * rs;
    add_row_terms<LAYER>(s, g[i], xhat);
    dxh[i] = d[i] * xhat;
  }
  if (SUMS && IN_REGS) {
#pragma unroll
    for (int i = 0; i < PACK; ++i) {
      regs.w[j][i] += dxh[i];
      if (LAYER) regs.b[j][i] += d[i];
    }
  } else if (SUMS) {
    acc_w.add(q, dxh);
    if (LAYER) acc_b.add(q, d);
  }
}

// The rows loop of the cached backward kernels (block and cluster), over packs [p0, p1) of
// each row: pass 1 (row sums, column sums), the row sums' all-reduce (`reduce`), then dx from
// the cache. With packs of at least 4 bytes, x and dy reach the cache by asynchronous copies,
// all of a thread's packs in flight at once; with TWO buffers (given the shared memory for
// them), the next row's copies are issued before this row's reduction and dx pass, so they
// overlap. Every thread reads back only packs it copied itself: no barrier guards the cache.
template <bool LAYER, bool SUMS, bool IN_REGS, int PACK, int NSUM, typename T, typename C,
          typename SL, typename Reduce>
__device__ __forceinline__ void grad_rows(const PairLoad<T, C>& ld, const SL& sl,
                                          const Store<C, T, false>& st, T* cache, int slice,
                                          bool two, const ColSums<C, PACK>& acc_w,
                                          const ColSums<C, PACK>& acc_b, RegSums<C, PACK>& regs,
                                          const C* mean, const C* rstd, i64 row0, i64 rows,
                                          i64 step, int cols, int p0, int p1, Reduce reduce) {
  constexpr bool ASYNC = PACK * sizeof(T) >= 4;
  constexpr int APT = RegSums<C, PACK>::APT;
  const C inv_cols = C(1) / C(cols);
  // buffer b: x at cache + 2 * b * slice, dy after it. Addresses: the thread's first pack in
  // each (shared memory) and in each row (global), then steps of blockDim.x packs.
  constexpr int BYTES = PACK * sizeof(T);
  const unsigned cache_at = shared_address(cache) + threadIdx.x * BYTES;
  auto issue = [&](i64 row, int b) {
    if constexpr (ASYNC) {
      unsigned cx = cache_at + 2 * b * slice * sizeof(T);
      const T* gx = ld.x.ptr + ld.x.at.offset(row, (p0 + threadIdx.x) * PACK);
      const T* gdy = ld.dy.ptr + ld.dy.at.offset(row, (p0 + threadIdx.x) * PACK);
      const int step_values = blockDim.x * PACK;
      for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
        cp_async_to<BYTES>(cx, gx);
        cp_async_to<BYTES>(cx + slice * sizeof(T), gdy);
        cx += blockDim.x * BYTES;
        gx += step_values;
        gdy += step_values;
      }
      cp_async_commit();
    }
  };
  two = two && ASYNC;
  if (two && row0 < rows) issue(row0, 0);
  int b = 0;
  for (i64 row = row0; row < rows; row += step, b ^= static_cast<int>(two)) {
    const SmemRow<T, C, PACK> cx{cache + 2 * b * slice}, cdy{cache + (2 * b + 1) * slice};
    const C m = LAYER ? mean[row] : C(0), rs = rstd[row];
    Sums<C, NSUM> s = Sums<C, NSUM>::identity();
    if (ASYNC) {
      if (two) {
        if (row + step < rows) issue(row + step, b ^ 1);
        else cp_async_commit();  // an empty group keeps the count
        cp_async_wait_group<1>();  // this row's copies are done; the next row's may not be
      } else {
        issue(row, 0);
        cp_async_wait_group<0>();
      }
    }
    if constexpr (SUMS && IN_REGS) {
#pragma unroll
      for (int j = 0; j < APT; ++j) {
        const int p = p0 + threadIdx.x + j * blockDim.x;
        if (p < p1) {
          C xv[PACK], d[PACK];
          if (ASYNC) {
            cx.get(p - p0, xv);
            cdy.get(p - p0, d);
          } else {
            C v[2 * PACK];
            ld.template load<PACK>(v, row, p * PACK);
#pragma unroll
            for (int i = 0; i < PACK; ++i) {
              xv[i] = v[i];
              d[i] = v[PACK + i];
            }
            cx.put(p - p0, xv);
            cdy.put(p - p0, d);
          }
          grad_fold<LAYER, SUMS, true>(sl, acc_w, acc_b, regs, p, p - p0, j, xv, d, m, rs, s);
        }
      }
    } else if constexpr (ASYNC) {
      for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
        C xv[PACK], d[PACK];
        cx.get(p - p0, xv);
        cdy.get(p - p0, d);
        grad_fold<LAYER, SUMS, false>(sl, acc_w, acc_b, regs, p, p - p0, 0, xv, d, m, rs, s);
      }
    } else {
      scan_packs<C, PACK, 2 * PACK, 2>(ld, row, p0, p1, [&](int p, const C* v) {
        cx.put(p - p0, v);
        cdy.put(p - p0, v + PACK);
        grad_fold<LAYER, SUMS, false>(sl, acc_w, acc_b, regs, p, p - p0, 0, v, v + PACK, m, rs,
                                      s);
      });
    }
    const GradX<LAYER, C, NSUM, false> gx(reduce(s, row + step >= rows), m, rs, inv_cols);
    for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
      C xv[PACK], d[PACK], g[PACK];
      cx.get(p - p0, xv);
      cdy.get(p - p0, d);
      sl.template scale<PACK>(d, g, p * PACK);
#pragma unroll
      for (int i = 0; i < PACK; ++i) xv[i] = gx(xv[i], g[i]);
      st.template store<PACK>(xv, row, p * PACK);
    }
  }
}

// Writes this thread's register column sums of slice [p0, p1) to partial rows dw, db (row base).
template <bool LAYER, int PACK, typename C>
__device__ __forceinline__ void store_reg_sums(const RegSums<C, PACK>& regs, C* dw, C* db,
                                               int p0, int p1) {
#pragma unroll
  for (int j = 0; j < RegSums<C, PACK>::APT; ++j) {
    const int p = p0 + threadIdx.x + j * blockDim.x;
    if (p < p1) {
#pragma unroll
      for (int i = 0; i < PACK; ++i) {
        dw[p * PACK + i] = regs.w[j][i];
        if (LAYER) db[p * PACK + i] = regs.b[j][i];
      }
    }
  }
}

// The rows loop of a cached backward with weight, and its column sums: in registers (IN_REGS,
// RegSums) or in shared memory (acc_w, acc_b), written to partial row `prow` of dw (and db) at
// the end. `sl`: gamma from memory or, cached, from shared memory.
template <bool LAYER, bool IN_REGS, int PACK, int NSUM, typename T, typename C, typename SL,
          typename Reduce>
__device__ __forceinline__ void grad_weighted(const PairLoad<T, C>& ld, const SL& sl,
                                              const Store<C, T, false>& st, T* base, int slice,
                                              bool two, const ColSums<C, PACK>& acc_w,
                                              const ColSums<C, PACK>& acc_b, const C* mean,
                                              const C* rstd, C* dw, C* db, i64 row0, i64 rows,
                                              i64 step, int cols, int p0, int p1, i64 prow,
                                              Reduce reduce) {
  RegSums<C, PACK> regs;
  if constexpr (IN_REGS) {
    regs.zero();
    grad_rows<LAYER, true, true, PACK, NSUM>(ld, sl, st, base, slice, two, acc_w, acc_b, regs,
                                             mean, rstd, row0, rows, step, cols, p0, p1, reduce);
    store_reg_sums<LAYER, PACK>(regs, dw + prow, LAYER ? db + prow : nullptr, p0, p1);
  } else {
    for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
      acc_w.zero(p - p0);
      if (LAYER) acc_b.zero(p - p0);
    }
    grad_rows<LAYER, true, false, PACK, NSUM>(ld, sl, st, base, slice, two, acc_w, acc_b, regs,
                                              mean, rstd, row0, rows, step, cols, p0, p1, reduce);
    for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
      acc_w.copy_to(p - p0, dw + prow + p * PACK);
      if (LAYER) acc_b.copy_to(p - p0, db + prow + p * PACK);
    }
  }
}

// A cached backward kernel's work on slice [p0, p1) (`slice` values, cols for the block kernel)
// of every `step`-th row from row0, given the dynamic shared memory (from `base`, which leaves
// kSmemAlign of its bytes unused or spent on alignment): one or two buffers of the slice of x
// and dy (two when there is room: see grad_rows), then, with WEIGHT and not REGS, NACC ColSums
// of the slice (REGS: the sums in registers, RegSums), then, with GAMMA, gamma over the slice in
// the compute type, converted once (not loaded and converted twice an element); the column
// sums end in partial row `prow_index` of dw (and db).
template <bool LAYER, bool WEIGHT, bool REGS, bool GAMMA, int PACK, int NSUM, int NACC,
          typename T, typename C, typename Reduce>
__device__ __forceinline__ void grad_cached(T* base, const PairLoad<T, C>& ld,
                                            const ScaleLoad<T, C, WEIGHT>& sl,
                                            const Store<C, T, false>& st, const C* mean,
                                            const C* rstd, C* dw, C* db, i64 row0, i64 rows,
                                            i64 step, int cols, int slice, int p0, int p1,
                                            i64 prow_index, Reduce reduce) {
  static_assert(WEIGHT || !GAMMA, "GAMMA caches the weight");
  const int slice_packs = slice / PACK;
  constexpr bool in_regs = WEIGHT && REGS;
  if (in_regs && !RegSums<C, PACK>::fits(slice_packs)) __trap();  // the planner sizes blocks
  const unsigned acc_bytes = WEIGHT && !in_regs ? NACC * slice * sizeof(C) : 0;
  const unsigned after = acc_bytes + (GAMMA ? slice * sizeof(C) : 0);  // after x and dy
  const bool two = dynamic_smem_bytes() >= kSmemAlign + 4u * slice * sizeof(T) + after;
  C* const acc = reinterpret_cast<C*>(base + (two ? 4 : 2) * static_cast<i64>(slice));
  const ColSums<C, PACK> acc_w{acc, slice_packs}, acc_b{acc + (NACC - 1) * slice, slice_packs};
  const i64 prow = prow_index * cols;
  if constexpr (!WEIGHT) {
    RegSums<C, PACK> regs;
    grad_rows<LAYER, false, false, PACK, NSUM>(ld, sl, st, base, slice, two, acc_w, acc_b, regs,
                                               mean, rstd, row0, rows, step, cols, p0, p1,
                                               reduce);
  } else if constexpr (GAMMA) {
    typedef ScaleLoad<T, C, true, true> Cached;
    C* const g = acc + acc_bytes / sizeof(C) - p0 * PACK;  // indexed by the row's pack
    for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
      C w[PACK];
      sl.gamma.template load<PACK>(w, 0, p * PACK);
#pragma unroll
      for (int j = 0; j < PACK; ++j) g[Cached::template cached_at<PACK>(p, j)] = w[j];
    }
    __syncthreads();
    const Cached cached{sl.dy, sl.gamma, g};
    grad_weighted<LAYER, in_regs, PACK, NSUM>(ld, cached, st, base, slice, two, acc_w, acc_b,
                                              mean, rstd, dw, db, row0, rows, step, cols, p0,
                                              p1, prow, reduce);
  } else {
    grad_weighted<LAYER, in_regs, PACK, NSUM>(ld, sl, st, base, slice, two, acc_w, acc_b, mean,
                                              rstd, dw, db, row0, rows, step, cols, p0, p1, prow,
                                              reduce);
  }
}

template <typename T, int ALGO, int PACK, bool WEIGHT, bool REGS, bool GAMMA>
__global__ void __launch_bounds__(1024) layer_norm_grad_block_smem(CUKERN_NORM_BWD_PARAMS(T)) {
  CUKERN_NORM_BWD_SETUP(T);
  auto reduce = [&](const Sums<C, NSUM>& s, bool) { return allreduce_block(s, phase); };
  grad_cached<LAYER, WEIGHT, REGS, GAMMA, PACK, NSUM, NACC>(
      dynamic_smem<T>(), ld_xdy, ld_g, st, mean, rstd, dw, db, blockIdx.x, rows, gridDim.x, cols,
      cols, 0, cols / PACK, blockIdx.x, reduce);
}

// No cache: x and dy are read twice. dx only: with WEIGHT, g = dy * gamma, and dgamma/dbeta
// come from norm_param_grad_partial (a row this long would need its column sums in memory).
// P: gamma's type (T, or float for 16-bit T).
template <typename T, int ALGO, int PACK, bool WEIGHT, typename P = T>
__global__ void __launch_bounds__(1024) layer_norm_grad_block_uncached(CUKERN_NORM_BWD_PARAMS(P)) {
  static_assert(sizeof(P) == sizeof(T) || (sizeof(T) == 2 && sizeof(P) == 4 && WEIGHT),
                "P: T, or float for 16-bit T with a weight");
  CUKERN_NORM_BWD_SETUP(P);
  const int num_packs = cols / PACK;
  const C inv_cols = C(1) / C(cols);
  const ColSums<C, PACK> no_sums{nullptr, 0};
  RegSums<C, PACK> no_regs;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const C m = LAYER ? mean[row] : C(0), rs = rstd[row];
    Sums<C, NSUM> s = Sums<C, NSUM>::identity();
    scan_packs<C, PACK, 2 * PACK, 4>(ld_xdy, row, 0, num_packs, [&](int p, const C* v) {
      grad_fold<LAYER, false, false>(ld_g, no_sums, no_sums, no_regs, p, 0, 0, v, v + PACK, m,
                                     rs, s);
    });
    const GradX<LAYER, C, NSUM> gx(allreduce_block(s, phase), m, rs, inv_cols);
    for (int p = threadIdx.x; p < num_packs; p += blockDim.x) {
      C v[2 * PACK], g[PACK];
      ld_xdy.template load<PACK>(v, row, p * PACK);
      ld_g.template scale<PACK>(v + PACK, g, p * PACK);
#pragma unroll
      for (int i = 0; i < PACK; ++i) v[i] = gx(v[i], g[i]);
      st.template store<PACK>(v, row, p * PACK);
    }
  }
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // clusters: sm_90 and newer
// Each block of the cluster caches its slice of the row (see grad_cached); the cluster's
// partial row of column sums is written by its blocks, a slice each.
template <typename T, int ALGO, int PACK, int CLUSTER, bool WEIGHT, bool REGS, bool GAMMA>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(1024)
layer_norm_grad_cluster(CUKERN_NORM_BWD_PARAMS(T)) {
  CUKERN_NORM_BWD_SETUP(T);
  const int num_packs = cols / PACK;
  const int slice = (num_packs + CLUSTER - 1) / CLUSTER * PACK;  // values per slice
  int p0, p1;
  cluster_pack_range(num_packs, CLUSTER, cluster_rank(), p0, p1);
  auto reduce = [&](const Sums<C, NSUM>& s, bool last) {
    return allreduce_cluster_async<CLUSTER>(s, phase, last);
  };
  grad_cached<LAYER, WEIGHT, REGS, GAMMA, PACK, NSUM, NACC>(
      aligned_dynamic_smem<T>(), ld_xdy, ld_g, st, mean, rstd, dw, db, blockIdx.x / CLUSTER, rows,
      gridDim.x / CLUSTER, cols, slice, p0, p1, blockIdx.x / CLUSTER, reduce);
}
#endif

// dgamma (and dbeta) partial sums straight from x and dy, for rows too long for the backward
// kernels to keep column sums on chip. Block: blockDim.x threads across columns, PACK columns
// each (grid x); grid y splits the rows into gridDim.y chunks, each writing one partial row of
// dw (and db), summed afterwards by norm_param_grad_reduce.
template <typename T, int ALGO, int PACK>
__global__ void __launch_bounds__(256)
norm_param_grad_partial(const T* dy, const T* x, const typename Num<T>::compute* mean,
                        const typename Num<T>::compute* rstd, typename Num<T>::compute* dw,
                        typename Num<T>::compute* db, i64 rows, int cols, i64 sdy, i64 sx) {
  typedef typename Num<T>::compute C;
  constexpr bool LAYER = ALGO == kLayerNorm;
  constexpr int U = 4;  // rows in flight per thread
  const int col = (blockIdx.x * blockDim.x + threadIdx.x) * PACK;
  if (col >= cols) return;
  const i64 chunk = (rows + gridDim.y - 1) / gridDim.y;
  const i64 r0 = blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
  const Load<T, C, false> ld_x{x, rows_at(sx)}, ld_dy{dy, rows_at(sdy)};
  C aw[PACK], ab[PACK];
#pragma unroll
  for (int i = 0; i < PACK; ++i) aw[i] = ab[i] = C(0);
  i64 r = r0;
  for (; r + U <= r1; r += U) {
    C xv[U][PACK], d[U][PACK], m[U], rs[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      ld_x.template load<PACK>(xv[u], r + u, col);
      ld_dy.template load<PACK>(d[u], r + u, col);
      m[u] = LAYER ? mean[r + u] : C(0);
      rs[u] = rstd[r + u];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int i = 0; i < PACK; ++i) {
        aw[i] += d[u][i] * ((xv[u][i] - m[u]) * rs[u]);
        ab[i] += d[u][i];
      }
    }
  }
  for (; r < r1; ++r) {
    C xv[PACK], d[PACK];
    ld_x.template load<PACK>(xv, r, col);
    ld_dy.template load<PACK>(d, r, col);
    const C m = LAYER ? mean[r] : C(0), rs = rstd[r];
#pragma unroll
    for (int i = 0; i < PACK; ++i) {
      aw[i] += d[i] * ((xv[i] - m) * rs);
      ab[i] += d[i];
    }
  }
  const i64 prow = static_cast<i64>(blockIdx.y) * cols + col;
#pragma unroll
  for (int i = 0; i < PACK; ++i) {
    dw[prow + i] = aw[i];
    if (LAYER) db[prow + i] = ab[i];
  }
}

// dgamma (and dbeta) from the partial rows: partial is (gridDim.y, prows, cols) in the compute
// type; blockIdx.y 0 writes dw, 1 writes db. Block (32, BY): each of 32 lanes sums W adjacent
// columns (16 bytes of C where `vec`: cols a multiple of W; else one) over rows ty, ty + BY,
// ...; the BY row lanes' sums then meet in shared memory. The planner picks vec and BY
// (param_reduce_shape) so that a few rows fall to each thread and the grid still fills the GPU
// (docs/notes/kernels.md, "Backward norms").
template <typename T>
__global__ void __launch_bounds__(1024)
norm_param_grad_reduce(const typename Num<T>::compute* partial, T* dw, T* db, i64 prows, int cols,
                       int vec) {
  typedef typename Num<T>::compute C;
  constexpr int W = 16 / sizeof(C);
  typedef typename Pack<C, W>::word_t word_t;
  __shared__ C tile[32][32 * W];  // [row lane][i * 32 + column lane]: no bank conflicts
  const int w = vec ? W : 1;
  const int tx = threadIdx.x, ty = threadIdx.y, by = blockDim.y;
  const int col = (blockIdx.x * 32 + tx) * w;
  const C* src = partial + static_cast<i64>(blockIdx.y) * prows * cols + col;
  C acc[W];
#pragma unroll
  for (int i = 0; i < W; ++i) acc[i] = C(0);
  // Four rows' loads in flight before their adds (a loop unrolled by the compiler checks its
  // bound between the loads, and each add then waits for its load).
  constexpr int U = 4;
  const i64 step = static_cast<i64>(by) * cols;
  i64 r = ty;
  if (col < cols && vec) {
    for (; r + (U - 1) * by < prows; r += U * by) {
      Pack<C, W> v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        v[u].word = *reinterpret_cast<const word_t*>(src + r * cols + u * step);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int i = 0; i < W; ++i) acc[i] += v[u].elem[i];
      }
    }
    for (; r < prows; r += by) {
      Pack<C, W> v;
      v.word = *reinterpret_cast<const word_t*>(src + r * cols);
#pragma unroll
      for (int i = 0; i < W; ++i) acc[i] += v.elem[i];
    }
  } else if (col < cols) {
    for (; r + (U - 1) * by < prows; r += U * by) {
      C v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = src[r * cols + u * step];
#pragma unroll
      for (int u = 0; u < U; ++u) acc[0] += v[u];
    }
    for (; r < prows; r += by) acc[0] += src[r * cols];
  }
#pragma unroll
  for (int i = 0; i < W; ++i) tile[ty][i * 32 + tx] = acc[i];
  __syncthreads();
  if (ty == 0 && col < cols) {
    T* out = blockIdx.y == 0 ? dw : db;
    for (int i = 0; i < w; ++i) {
      C s[U] = {};  // U independent chains (by is a power of two)
      int k = 0;
      for (; k + U <= by; k += U) {
#pragma unroll
        for (int u = 0; u < U; ++u) s[u] += tile[k + u][i * 32 + tx];
      }
      for (; k < by; ++k) s[0] += tile[k][i * 32 + tx];
      out[col + i] = Num<T>::from((s[0] + s[1]) + (s[2] + s[3]));
    }
  }
}

#undef CUKERN_NORM_BWD_PARAMS
#undef CUKERN_NORM_BWD_SETUP

}  // namespace cukern

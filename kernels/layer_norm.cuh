// Layer norm and RMS norm over the columns of a (rows, cols) view, forward and backward.
//
//   layer norm  mean = sum(x) / n, var = sum((x - mean)^2) / n, rstd = 1 / sqrt(var + eps),
//               y = (x - mean) * rstd * gamma + beta
//   RMS norm    rstd = 1 / sqrt(sum(x^2) / n + eps), y = x * rstd * gamma
//   backward    xhat = (x - mean) * rstd (RMS: x * rstd), g = dy * gamma,
//               dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMS: no mean(g) term),
//               dgamma = sum over rows of dy * xhat, dbeta = sum over rows of dy.
//
// Variants, chosen by cukern/_dispatch.py (the same cascade as softmax):
//   *_warp            a group of blockDim.x lanes owns a row held in registers (cols <= 1024)
//   *_block_smem      one block per row, the row cached in shared memory in its storage type
//   *_cluster         a cluster of CLUSTER blocks per row (sm_90), each caching a slice
//   *_block_uncached  one block per row, the row read again from global memory
//
// Statistics are exact two-pass (mean, then the sum of squared deviations) wherever the row is on
// chip; the cluster variant merges its slices' exact (count, mean, M2) with Chan's formula; the
// uncached variant keeps a Welford state per thread and merges those. Layer norm works on x - K,
// K the row's first value: for rows far from zero (x = 1e4 + noise in float32) the differences
// are exact and small, so neither the sums nor y = ((x - K) - mean') * rstd lose digits to the
// offset. RMS norm needs no mean, and a sum of squares has no cancellation. Statistics and all
// sums are in the compute type (float for half, bfloat16 and float; double for double), as are
// the dgamma/dbeta partial sums.
//
// Only what sizes a register array or changes memory traffic is a template argument: the storage
// type, ALGO (0 layer norm, 1 RMS norm), PACK, the per-lane register row (CPT values, RPA rows),
// the cluster size, and the fused-functor switches WEIGHT, BIAS, RESIDUAL. The group width
// (blockDim.x of the warp kernel), the block size and padding are read at run time.
//
// Rows are contiguous (column stride 1; any row stride): the host copies other layouts first.
// Every pointer and row stride is a multiple of PACK elements (the planner checks).
#pragma once
#include "common.cuh"

namespace cukern {

enum { kLayerNorm = 0, kRMSNorm = 1 };

// Row `row` of a view with row stride s (in elements) and contiguous columns.
__device__ __forceinline__ Layout<false> rows_at(i64 s) { return Layout<false>{s, 0, 1, 1}; }

// ---------------------------------------------------------------------------------------------
// Fused functors.

// x, or x + residual rounded to the storage type (the sum a separate add would produce), which is
// then also written to h: the "add then norm" of a transformer block in one read of each input.
template <typename T, typename C, bool RESIDUAL> struct SkipLoad {
  Load<T, C, false> x, res;
  Store<C, T, false> h;
  template <int N> __device__ __forceinline__ void load(C* dst, i64 row, int col) const {
    x.template load<N>(dst, row, col);
    if (RESIDUAL) {
      C r[N];
      res.template load<N>(r, row, col);
#pragma unroll
      for (int i = 0; i < N; ++i) dst[i] = Num<T>::to(Num<T>::from(dst[i] + r[i]));
      h.template store<N>(dst, row, col);
    }
  }
  // The value load() returns for column 0 of a row, without writing h.
  __device__ __forceinline__ C first(i64 row) const {
    C v;
    x.template load<1>(&v, row, 0);
    if (RESIDUAL) {
      C r;
      res.template load<1>(&r, row, 0);
      v = Num<T>::to(Num<T>::from(v + r));
    }
    return v;
  }
};

// y = v * gamma + beta for normalised values v, each factor optional.
template <typename C, typename T, bool WEIGHT, bool BIAS> struct AffineStore {
  Store<C, T, false> y;
  Load<T, C, false> gamma, beta;  // one row each (row 0)
  template <int N> __device__ __forceinline__ void store(const C* v, i64 row, int col) const {
    C out[N];
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = v[i];
    if (WEIGHT) {
      C w[N];
      gamma.template load<N>(w, 0, col);
#pragma unroll
      for (int i = 0; i < N; ++i) out[i] *= w[i];
    }
    if (BIAS) {
      C b[N];
      beta.template load<N>(b, 0, col);
#pragma unroll
      for (int i = 0; i < N; ++i) out[i] += b[i];
    }
    y.template store<N>(out, row, col);
  }
};

// g = dy * gamma (dy when there is no weight). load2 also returns dy itself, which the dgamma and
// dbeta sums need.
template <typename T, typename C, bool WEIGHT> struct ScaleLoad {
  Load<T, C, false> dy, gamma;
  template <int N> __device__ __forceinline__ void scale(const C* d, C* g, int col) const {
    if (WEIGHT) {
      C w[N];
      gamma.template load<N>(w, 0, col);
#pragma unroll
      for (int i = 0; i < N; ++i) g[i] = d[i] * w[i];
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) g[i] = d[i];
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

// Calls f(p, v) for the packs p of [p0, p1) that this thread owns in a block kernel
// (p0 + threadIdx.x, then steps of blockDim.x), keeping U loads in flight. `ld` writes VALS
// values per pack. Every pass of a block kernel visits the packs with this same mapping, so a
// thread reads back only what it wrote itself and needs no barrier.
template <typename C, int PACK, int VALS, int U, typename L, typename F>
__device__ __forceinline__ void scan_packs(const L& ld, i64 row, int p0, int p1, F&& f) {
  const int stride = blockDim.x;
  int p = p0 + threadIdx.x;
  for (; p + (U - 1) * stride < p1; p += U * stride) {
    C v[U][VALS];
#pragma unroll
    for (int u = 0; u < U; ++u) ld.template load<PACK>(v[u], row, (p + u * stride) * PACK);
#pragma unroll
    for (int u = 0; u < U; ++u) f(p + u * stride, v[u]);
  }
  for (; p < p1; p += stride) {
    C v[VALS];
    ld.template load<PACK>(v, row, p * PACK);
    f(p, v);
  }
}

template <typename C> __device__ __forceinline__ C block_sum(C v) {
  return allreduce_block(Sums<C, 1>{{v}}).v[0];
}

// Writes a row's statistics (RMS norm has no mean).
template <int ALGO, typename C>
__device__ __forceinline__ void put_stats(C* mean, C* rstd, i64 row, C m, C rs) {
  if (ALGO == kLayerNorm && mean != nullptr) mean[row] = m;
  if (rstd != nullptr) rstd[row] = rs;
}

// ---------------------------------------------------------------------------------------------
// Forward. mean and rstd may be null (not wanted); res, h, gamma, beta are read or written only
// when their switch is on. sx, sr, sy, sh: row strides of x, residual, y, h.
#define CUKERN_NORM_FWD_PARAMS                                                                 \
  const T *x, const T *res, const T *gamma, const T *beta, T *y, T *h,                         \
      typename Num<T>::compute *mean, typename Num<T>::compute *rstd,                          \
      typename Num<T>::compute eps, i64 rows, int cols, i64 sx, i64 sr, i64 sy, i64 sh

#define CUKERN_NORM_FWD_SETUP                                                                  \
  typedef typename Num<T>::compute C;                                                          \
  static_assert(ALGO == kLayerNorm || ALGO == kRMSNorm, "ALGO: 0 layer norm, 1 RMS norm");     \
  static_assert(ALGO == kLayerNorm || !BIAS, "RMS norm has no bias");                          \
  const SkipLoad<T, C, RESIDUAL> ld{{x, rows_at(sx)}, {res, rows_at(sr)}, {h, rows_at(sh)}};   \
  const AffineStore<C, T, WEIGHT, BIAS> st{{y, rows_at(sy)}, {gamma, rows_at(0)},              \
                                           {beta, rows_at(0)}}

// Warp kernel. Block (width, 128 / width); thread group y owns RPA rows at a time; lane l holds
// packs p at columns (p * width + l) * PACK, so a group's accesses are coalesced. Slots past the
// end of the row (padding) hold 0 and are left out of the variance. The row loop is uniform
// across the block, so every lane reaches every shuffle.
template <typename T, int ALGO, int PACK, int CPT, int RPA, bool WEIGHT, bool BIAS, bool RESIDUAL>
__global__ void __launch_bounds__(128) layer_norm_warp(CUKERN_NORM_FWD_PARAMS) {
  CUKERN_NORM_FWD_SETUP;
  static_assert(CPT % PACK == 0, "cols_per_thread must be a multiple of pack_size");
  constexpr int NP = CPT / PACK;
  const int width = blockDim.x, lane = threadIdx.x;
  const i64 step = static_cast<i64>(gridDim.x) * blockDim.y * RPA;
  for (i64 base = static_cast<i64>(blockIdx.x) * blockDim.y * RPA; base < rows; base += step) {
    const i64 row0 = base + static_cast<i64>(threadIdx.y) * RPA;
    C buf[RPA][CPT];  // layer norm: x - K; RMS norm: x
    Sums<C, 1> s[RPA];
    C k[RPA], m[RPA];  // the shift K and the mean of x - K
#pragma unroll
    for (int r = 0; r < RPA; ++r) {
      const bool valid = row0 + r < rows;
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        const int col = (p * width + lane) * PACK;
        if (valid && col < cols) {
          ld.template load<PACK>(buf[r] + p * PACK, row0 + r, col);
        } else {
#pragma unroll
          for (int i = 0; i < PACK; ++i) buf[r][p * PACK + i] = C(0);
        }
      }
      // lane 0 of the group holds column 0
      k[r] = ALGO == kLayerNorm ? __shfl_sync(0xffffffffu, buf[r][0], 0, width) : C(0);
      s[r].v[0] = C(0);
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        if ((p * width + lane) * PACK >= cols) continue;  // padding stays 0
#pragma unroll
        for (int i = 0; i < PACK; ++i) {
          C& v = buf[r][p * PACK + i];
          if (ALGO == kLayerNorm) {
            v -= k[r];
            s[r].v[0] += v;
          } else {
            s[r].v[0] += v * v;
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < RPA; ++r) s[r] = allreduce_group(s[r], width);
#pragma unroll
    for (int r = 0; r < RPA; ++r) {
      if (ALGO == kLayerNorm) {  // second pass: squared deviations from the exact mean
        m[r] = s[r].v[0] / C(cols);
        s[r].v[0] = C(0);
#pragma unroll
        for (int p = 0; p < NP; ++p) {
          if ((p * width + lane) * PACK >= cols) continue;
#pragma unroll
          for (int i = 0; i < PACK; ++i) {
            const C d = buf[r][p * PACK + i] - m[r];
            s[r].v[0] += d * d;
          }
        }
      } else {
        m[r] = C(0);
      }
    }
    if (ALGO == kLayerNorm) {
#pragma unroll
      for (int r = 0; r < RPA; ++r) s[r] = allreduce_group(s[r], width);
    }
#pragma unroll
    for (int r = 0; r < RPA; ++r) {
      const i64 row = row0 + r;
      if (row >= rows) continue;
      const C rs = Math<C>::rsqrt(s[r].v[0] / C(cols) + eps);
      if (lane == 0) put_stats<ALGO>(mean, rstd, row, k[r] + m[r], rs);
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        const int col = (p * width + lane) * PACK;
        if (col >= cols) continue;
        C out[PACK];
#pragma unroll
        for (int i = 0; i < PACK; ++i) out[i] = (buf[r][p * PACK + i] - m[r]) * rs;
        st.template store<PACK>(out, row, col);
      }
    }
  }
}

// Block kernel with the row cached in shared memory (cols values of T). One row per block at a
// time, grid-stride over rows; any block size that is a multiple of 32.
template <typename T, int ALGO, int PACK, bool WEIGHT, bool BIAS, bool RESIDUAL>
__global__ void __launch_bounds__(1024) layer_norm_block_smem(CUKERN_NORM_FWD_PARAMS) {
  CUKERN_NORM_FWD_SETUP;
  extern __shared__ uint4 smem_words[];
  const SmemRow<T, C, PACK> cache{reinterpret_cast<T*>(smem_words)};
  const int num_packs = cols / PACK;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const C k = ALGO == kLayerNorm ? ld.first(row) : C(0);  // the shift K
    C s = C(0);
    scan_packs<C, PACK, PACK, 4>(ld, row, 0, num_packs, [&](int p, const C* v) {
      cache.put(p, v);
#pragma unroll
      for (int i = 0; i < PACK; ++i) s += ALGO == kLayerNorm ? v[i] - k : v[i] * v[i];
    });
    s = block_sum(s);
    C m = C(0);  // the mean of x - K
    if (ALGO == kLayerNorm) {  // second pass over the cached row
      m = s / C(cols);
      s = C(0);
      for (int p = threadIdx.x; p < num_packs; p += blockDim.x) {
        C v[PACK];
        cache.get(p, v);
#pragma unroll
        for (int i = 0; i < PACK; ++i) s += ((v[i] - k) - m) * ((v[i] - k) - m);
      }
      s = block_sum(s);
    }
    const C rs = Math<C>::rsqrt(s / C(cols) + eps);
    if (threadIdx.x == 0) put_stats<ALGO>(mean, rstd, row, k + m, rs);
    for (int p = threadIdx.x; p < num_packs; p += blockDim.x) {
      C v[PACK];
      cache.get(p, v);
#pragma unroll
      for (int i = 0; i < PACK; ++i) v[i] = ((v[i] - k) - m) * rs;
      st.template store<PACK>(v, row, p * PACK);
    }
  }
}

// Block kernel without a cache: Welford statistics in one read, then a second read to write y.
// With a residual the second read is of h (written by this same thread in the first pass).
template <typename T, int ALGO, int PACK, bool WEIGHT, bool BIAS, bool RESIDUAL>
__global__ void __launch_bounds__(1024) layer_norm_block_uncached(CUKERN_NORM_FWD_PARAMS) {
  CUKERN_NORM_FWD_SETUP;
  const Load<T, C, false> again{RESIDUAL ? h : x, rows_at(RESIDUAL ? sh : sx)};
  const int num_packs = cols / PACK;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const C k = ALGO == kLayerNorm ? ld.first(row) : C(0);  // the shift K
    C m = C(0), var;  // m: the mean of x - K
    if (ALGO == kLayerNorm) {
      Welford<C> w = Welford<C>::identity();
      scan_packs<C, PACK, PACK, 4>(ld, row, 0, num_packs, [&](int, const C* v) {
        C d[PACK];
#pragma unroll
        for (int i = 0; i < PACK; ++i) d[i] = v[i] - k;
        w.template add<PACK>(d);
      });
      w = allreduce_block(w);
      m = w.mean;
      var = w.m2 / C(cols);
    } else {
      C s = C(0);
      scan_packs<C, PACK, PACK, 4>(ld, row, 0, num_packs, [&](int, const C* v) {
#pragma unroll
        for (int i = 0; i < PACK; ++i) s += v[i] * v[i];
      });
      var = block_sum(s) / C(cols);
    }
    const C rs = Math<C>::rsqrt(var + eps);
    if (threadIdx.x == 0) put_stats<ALGO>(mean, rstd, row, k + m, rs);
    for (int p = threadIdx.x; p < num_packs; p += blockDim.x) {
      C v[PACK];
      again.template load<PACK>(v, row, p * PACK);
#pragma unroll
      for (int i = 0; i < PACK; ++i) v[i] = ((v[i] - k) - m) * rs;
      st.template store<PACK>(v, row, p * PACK);
    }
  }
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // clusters: sm_90 and newer
// A cluster of CLUSTER blocks per row (sm_90): each block caches a slice of the row, computes its
// slice's exact (count, mean, M2) and the cluster merges them in distributed shared memory.
template <typename T, int ALGO, int PACK, int CLUSTER, bool WEIGHT, bool BIAS, bool RESIDUAL>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(1024)
layer_norm_cluster(CUKERN_NORM_FWD_PARAMS) {
  CUKERN_NORM_FWD_SETUP;
  extern __shared__ uint4 smem_words[];
  const SmemRow<T, C, PACK> cache{reinterpret_cast<T*>(smem_words)};
  const unsigned rank = cluster_rank();
  int p0, p1;
  cluster_pack_range(cols / PACK, CLUSTER, rank, p0, p1);
  const C n_mine = C((p1 - p0) * PACK);
  const i64 clusters = gridDim.x / CLUSTER;
  for (i64 row = blockIdx.x / CLUSTER; row < rows; row += clusters) {
    const C k = ALGO == kLayerNorm ? ld.first(row) : C(0);  // the shift K, the same in every block
    C s = C(0);
    scan_packs<C, PACK, PACK, 4>(ld, row, p0, p1, [&](int p, const C* v) {
      cache.put(p - p0, v);
#pragma unroll
      for (int i = 0; i < PACK; ++i) s += ALGO == kLayerNorm ? v[i] - k : v[i] * v[i];
    });
    s = block_sum(s);
    C m = C(0), var;  // m: the mean of x - K
    if (ALGO == kLayerNorm) {
      const C m_mine = n_mine > C(0) ? s / n_mine : C(0);
      C q = C(0);
      for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
        C v[PACK];
        cache.get(p - p0, v);
#pragma unroll
        for (int i = 0; i < PACK; ++i) q += ((v[i] - k) - m_mine) * ((v[i] - k) - m_mine);
      }
      q = block_sum(q);
      const Welford<C> w = allreduce_cluster<CLUSTER>(Welford<C>{n_mine, m_mine, q});
      m = w.mean;
      var = w.m2 / C(cols);
    } else {
      var = allreduce_cluster<CLUSTER>(Sums<C, 1>{{s}}).v[0] / C(cols);
    }
    const C rs = Math<C>::rsqrt(var + eps);
    if (rank == 0 && threadIdx.x == 0) put_stats<ALGO>(mean, rstd, row, k + m, rs);
    for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
      C v[PACK];
      cache.get(p - p0, v);
#pragma unroll
      for (int i = 0; i < PACK; ++i) v[i] = ((v[i] - k) - m) * rs;
      st.template store<PACK>(v, row, p * PACK);
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// Backward. mean is null for RMS norm. With WEIGHT, g = dy * gamma and the kernel also sums
// dy * xhat (and dy, for layer norm) over the rows each block (cluster, for *_cluster) handles:
// one partial row of `cols` sums per block in dw (and db), in the compute type; a second kernel,
// norm_param_grad_reduce, adds the partial rows up. sdy, sx, sdx: row strides.
#define CUKERN_NORM_BWD_PARAMS                                                                 \
  const T *dy, const T *x, const typename Num<T>::compute *mean,                               \
      const typename Num<T>::compute *rstd, const T *gamma, T *dx,                             \
      typename Num<T>::compute *dw, typename Num<T>::compute *db, i64 rows, int cols, i64 sdy,  \
      i64 sx, i64 sdx

#define CUKERN_NORM_BWD_SETUP                                                                  \
  typedef typename Num<T>::compute C;                                                          \
  static_assert(ALGO == kLayerNorm || ALGO == kRMSNorm, "ALGO: 0 layer norm, 1 RMS norm");     \
  constexpr bool LAYER = ALGO == kLayerNorm;                                                   \
  constexpr int NSUM = LAYER ? 2 : 1;              /* row sums: g * xhat (and g) */            \
  constexpr int NACC = LAYER ? 2 : 1;              /* column sums: dy * xhat (and dy) */       \
  const Load<T, C, false> ld_x{x, rows_at(sx)};                                                \
  const ScaleLoad<T, C, WEIGHT> ld_g{{dy, rows_at(sdy)}, {gamma, rows_at(0)}};                 \
  const PairLoad<T, C> ld_xdy{{x, rows_at(sx)}, {dy, rows_at(sdy)}};                           \
  const Store<C, T, false> st{dx, rows_at(sdx)};                                               \
  (void)ld_x;                                                                                  \
  (void)ld_xdy;                                                                                \
  (void)NACC

// One element's contribution to the row sums.
template <bool LAYER, typename C, int K>
__device__ __forceinline__ void add_row_terms(Sums<C, K>& s, C g, C xhat) {
  s.v[0] += g * xhat;
  if constexpr (LAYER) s.v[1] += g;
}

// dx for one element, given the row sums.
template <bool LAYER, typename C, int K>
__device__ __forceinline__ C grad_x(const Sums<C, K>& s, C g, C xhat, C rs, C inv_cols) {
  if constexpr (LAYER) return rs * (g - s.v[1] * inv_cols - xhat * (s.v[0] * inv_cols));
  return rs * (g - xhat * (s.v[0] * inv_cols));
}

template <typename T, int ALGO, int PACK, int CPT, int RPA, bool WEIGHT>
__global__ void __launch_bounds__(128) layer_norm_grad_warp(CUKERN_NORM_BWD_PARAMS) {
  CUKERN_NORM_BWD_SETUP;
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
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        const int col = (p * width + lane) * PACK;
        if (col >= cols) continue;
        C out[PACK];
#pragma unroll
        for (int i = 0; i < PACK; ++i) {
          out[i] = grad_x<LAYER>(s[r], g[r][p * PACK + i], xh[r][p * PACK + i], rs[r], inv_cols);
        }
        st.template store<PACK>(out, row, col);
      }
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

// Pass 1 of a backward block kernel over packs [p0, p1): the row sums, and with WEIGHT the
// column sums (this thread's columns only) into acc_w[(p - p0) * PACK + i] (and acc_b). With
// CACHE, x and dy go to shared memory at pack p - p0.
template <bool LAYER, bool WEIGHT, bool CACHE, int PACK, typename T, typename C, int NSUM>
__device__ __forceinline__ void grad_scan(const PairLoad<T, C>& ld,
                                          const ScaleLoad<T, C, WEIGHT>& sl,
                                          const SmemRow<T, C, PACK>& cache_x,
                                          const SmemRow<T, C, PACK>& cache_dy, C* acc_w, C* acc_b,
                                          i64 row, int p0, int p1, C m, C rs, Sums<C, NSUM>& s) {
  scan_packs<C, PACK, 2 * PACK, 2>(ld, row, p0, p1, [&](int p, const C* v) {
    const C* xv = v;
    const C* d = v + PACK;
    if (CACHE) {
      cache_x.put(p - p0, xv);
      cache_dy.put(p - p0, d);
    }
    C g[PACK];
    sl.template scale<PACK>(d, g, p * PACK);
#pragma unroll
    for (int i = 0; i < PACK; ++i) {
      const C xhat = (xv[i] - m) * rs;
      add_row_terms<LAYER>(s, g[i], xhat);
      if (WEIGHT) {
        const int a = (p - p0) * PACK + i;
        acc_w[a] += d[i] * xhat;
        if (LAYER) acc_b[a] += d[i];
      }
    }
  });
}

// Zeroes (or copies out) this thread's columns of packs [p0, p1): element (p - p0) * PACK + i of
// a slice-local array is column p * PACK + i of the row.
template <bool LAYER, int PACK, typename C>
__device__ __forceinline__ void zero_own(C* acc_w, C* acc_b, int p0, int p1) {
  for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
#pragma unroll
    for (int i = 0; i < PACK; ++i) {
      acc_w[(p - p0) * PACK + i] = C(0);
      if (LAYER) acc_b[(p - p0) * PACK + i] = C(0);
    }
  }
}
template <bool LAYER, int PACK, typename C>
__device__ __forceinline__ void copy_own(const C* acc_w, const C* acc_b, C* dw, C* db, int p0,
                                         int p1) {
  for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
#pragma unroll
    for (int i = 0; i < PACK; ++i) {
      dw[p * PACK + i] = acc_w[(p - p0) * PACK + i];
      if (LAYER) db[p * PACK + i] = acc_b[(p - p0) * PACK + i];
    }
  }
}

// Shared memory: x row, dy row (cols values of T each), then with WEIGHT NACC rows of cols
// column sums in C, each column read and written only by the thread that owns it.
template <typename T, int ALGO, int PACK, bool WEIGHT>
__global__ void __launch_bounds__(1024) layer_norm_grad_block_smem(CUKERN_NORM_BWD_PARAMS) {
  CUKERN_NORM_BWD_SETUP;
  extern __shared__ uint4 smem_words[];
  T* const base = reinterpret_cast<T*>(smem_words);
  const SmemRow<T, C, PACK> cache_x{base}, cache_dy{base + cols};
  C* const acc_w = reinterpret_cast<C*>(base + 2 * static_cast<i64>(cols));
  C* const acc_b = acc_w + (NACC - 1) * cols;
  const int num_packs = cols / PACK;
  const C inv_cols = C(1) / C(cols);
  if (WEIGHT) zero_own<LAYER, PACK>(acc_w, acc_b, 0, num_packs);
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const C m = LAYER ? mean[row] : C(0), rs = rstd[row];
    Sums<C, NSUM> s = Sums<C, NSUM>::identity();
    grad_scan<LAYER, WEIGHT, true, PACK>(ld_xdy, ld_g, cache_x, cache_dy, acc_w, acc_b, row, 0,
                                         num_packs, m, rs, s);
    s = allreduce_block(s);
    for (int p = threadIdx.x; p < num_packs; p += blockDim.x) {
      C xv[PACK], d[PACK], g[PACK];
      cache_x.get(p, xv);
      cache_dy.get(p, d);
      ld_g.template scale<PACK>(d, g, p * PACK);
#pragma unroll
      for (int i = 0; i < PACK; ++i) xv[i] = grad_x<LAYER>(s, g[i], (xv[i] - m) * rs, rs, inv_cols);
      st.template store<PACK>(xv, row, p * PACK);
    }
  }
  if (WEIGHT) {
    const i64 prow = static_cast<i64>(blockIdx.x) * cols;
    copy_own<LAYER, PACK>(acc_w, acc_b, dw + prow, LAYER ? db + prow : nullptr, 0, num_packs);
  }
}

// No cache: x and dy are read twice; with WEIGHT the column sums live in this block's partial
// rows in global memory (each column read and written by one thread only).
template <typename T, int ALGO, int PACK, bool WEIGHT>
__global__ void __launch_bounds__(1024) layer_norm_grad_block_uncached(CUKERN_NORM_BWD_PARAMS) {
  CUKERN_NORM_BWD_SETUP;
  const SmemRow<T, C, PACK> no_cache{nullptr};
  const int num_packs = cols / PACK;
  const C inv_cols = C(1) / C(cols);
  const i64 prow = static_cast<i64>(blockIdx.x) * cols;
  C* const acc_w = WEIGHT ? dw + prow : nullptr;
  C* const acc_b = WEIGHT && LAYER ? db + prow : nullptr;
  if (WEIGHT) zero_own<LAYER, PACK>(acc_w, acc_b, 0, num_packs);
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const C m = LAYER ? mean[row] : C(0), rs = rstd[row];
    Sums<C, NSUM> s = Sums<C, NSUM>::identity();
    grad_scan<LAYER, WEIGHT, false, PACK>(ld_xdy, ld_g, no_cache, no_cache, acc_w, acc_b, row, 0,
                                          num_packs, m, rs, s);
    s = allreduce_block(s);
    for (int p = threadIdx.x; p < num_packs; p += blockDim.x) {
      C v[2 * PACK], g[PACK];
      ld_xdy.template load<PACK>(v, row, p * PACK);
      ld_g.template scale<PACK>(v + PACK, g, p * PACK);
#pragma unroll
      for (int i = 0; i < PACK; ++i) v[i] = grad_x<LAYER>(s, g[i], (v[i] - m) * rs, rs, inv_cols);
      st.template store<PACK>(v, row, p * PACK);
    }
  }
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // clusters: sm_90 and newer
// Each block of the cluster caches its slice of x, then of dy (`slice` values each), then with
// WEIGHT its slice's column sums; the cluster's partial row is written by its blocks, a slice each.
template <typename T, int ALGO, int PACK, int CLUSTER, bool WEIGHT>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(1024)
layer_norm_grad_cluster(CUKERN_NORM_BWD_PARAMS) {
  CUKERN_NORM_BWD_SETUP;
  extern __shared__ uint4 smem_words[];
  const int num_packs = cols / PACK;
  const int slice = (num_packs + CLUSTER - 1) / CLUSTER * PACK;  // values per slice
  int p0, p1;
  cluster_pack_range(num_packs, CLUSTER, cluster_rank(), p0, p1);
  T* const base = reinterpret_cast<T*>(smem_words);
  const SmemRow<T, C, PACK> cache_x{base}, cache_dy{base + slice};
  C* const acc_w = reinterpret_cast<C*>(base + 2 * static_cast<i64>(slice));
  C* const acc_b = acc_w + (NACC - 1) * slice;
  const C inv_cols = C(1) / C(cols);
  if (WEIGHT) zero_own<LAYER, PACK>(acc_w, acc_b, p0, p1);
  const i64 clusters = gridDim.x / CLUSTER;
  for (i64 row = blockIdx.x / CLUSTER; row < rows; row += clusters) {
    const C m = LAYER ? mean[row] : C(0), rs = rstd[row];
    Sums<C, NSUM> s = Sums<C, NSUM>::identity();
    grad_scan<LAYER, WEIGHT, true, PACK>(ld_xdy, ld_g, cache_x, cache_dy, acc_w, acc_b, row, p0,
                                         p1, m, rs, s);
    s = allreduce_cluster<CLUSTER>(allreduce_block(s));
    for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
      C xv[PACK], d[PACK], g[PACK];
      cache_x.get(p - p0, xv);
      cache_dy.get(p - p0, d);
      ld_g.template scale<PACK>(d, g, p * PACK);
#pragma unroll
      for (int i = 0; i < PACK; ++i) xv[i] = grad_x<LAYER>(s, g[i], (xv[i] - m) * rs, rs, inv_cols);
      st.template store<PACK>(xv, row, p * PACK);
    }
  }
  if (WEIGHT) {
    const i64 prow = static_cast<i64>(blockIdx.x / CLUSTER) * cols;
    copy_own<LAYER, PACK>(acc_w, acc_b, dw + prow, LAYER ? db + prow : nullptr, p0, p1);
  }
}
#endif

// dgamma (and dbeta) from the partial rows: partial is (gridDim.y, prows, cols) in the compute
// type; blockIdx.y 0 writes dw, 1 writes db. Block (32, 32): 32 columns, 32 row lanes.
template <typename T>
__global__ void __launch_bounds__(1024)
norm_param_grad_reduce(const typename Num<T>::compute* partial, T* dw, T* db, i64 prows, int cols) {
  typedef typename Num<T>::compute C;
  __shared__ C tile[32][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int col = blockIdx.x * 32 + tx;
  const C* src = partial + static_cast<i64>(blockIdx.y) * prows * cols;
  C acc = C(0);
  if (col < cols) {
#pragma unroll 4
    for (i64 r = ty; r < prows; r += 32) acc += src[r * cols + col];
  }
  tile[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && col < cols) {
    C s = C(0);
#pragma unroll
    for (int k = 0; k < 32; ++k) s += tile[k][tx];
    (blockIdx.y == 0 ? dw : db)[col] = Num<T>::from(s);
  }
}

#undef CUKERN_NORM_FWD_PARAMS
#undef CUKERN_NORM_FWD_SETUP
#undef CUKERN_NORM_BWD_PARAMS
#undef CUKERN_NORM_BWD_SETUP

}  // namespace cukern

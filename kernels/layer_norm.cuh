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
// Statistics are exact two-pass (mean, then the sum of squared deviations) wherever the row is
// on chip; the cluster variant merges its slices' exact (count, mean, M2) with Chan's formula;
// the uncached variant keeps a Welford state per thread and merges those. Never E[x^2] -
// E[x]^2. Layer norm works on x - K, K the row's first value: for rows far from zero (x = 1e4 +
// noise in float32) the differences are exact and small, so neither the sums nor
// y = ((x - K) - mean') * rstd lose digits to the offset, and a constant row gives var = 0 and
// y = beta exactly. Half and bfloat16 rows, once summed, are normalised as x - (K + mean') in
// one operation: the rounding of K + mean' to float is far below their spacing (a representable
// deviation from a mean m is at least m * 2^-11). RMS norm needs no mean, and a sum of squares
// has no cancellation.
// Statistics and all sums are in the compute type (float for half, bfloat16 and float; double
// for double), as are the dgamma/dbeta partial sums.
//
// Only what sizes a register array or changes memory traffic is a template argument: the storage
// type, ALGO (0 layer norm, 1 RMS norm), PACK, the per-lane register row (CPT values, RPA rows),
// the cluster size, the fused-functor switches WEIGHT, BIAS, RESIDUAL, whether a cached
// forward block overlaps its rows (OVERLAP: a loop of different registers), and for a cached
// backward with WEIGHT where its column sums live (REGS) and whether gamma is copied into shared
// memory (GAMMA). The group width (blockDim.x of the warp kernel), the block size, padding and
// the number of buffers of a cached backward are read at run time.
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
  // load() in two steps: fetch() issues the loads, finish() converts, adds and writes h.
  template <int N> struct Raw {
    Pack<T, N> x, res;
  };
  template <int N> __device__ __forceinline__ Raw<N> fetch(i64 row, int col) const {
    Raw<N> r;
    r.x = x.template raw<N>(row, col);
    if (RESIDUAL) r.res = res.template raw<N>(row, col);
    return r;
  }
  template <int N>
  __device__ __forceinline__ void finish(const Raw<N>& r, C* dst, i64 row, int col) const {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      dst[i] = pack_value(r.x, i);
      if (RESIDUAL) dst[i] = Num<T>::to(Num<T>::from(dst[i] + pack_value(r.res, i)));
    }
    if (RESIDUAL) h.template store<N>(dst, row, col);
  }
  // Prefetches `count` columns of a row from `col` into L2 (prefetch_l2: 16-byte aligned, a
  // multiple of 16 bytes), of x and of the residual.
  __device__ __forceinline__ void prefetch(i64 row, int col, int count) const {
    prefetch_l2(x.ptr + x.at.offset(row, col), count * sizeof(T));
    if (RESIDUAL) prefetch_l2(res.ptr + res.at.offset(row, col), count * sizeof(T));
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
// params() and store_with() split store() for a caller that writes several rows of the same
// columns (gamma and beta loaded and converted once).
template <typename C, typename T, bool WEIGHT, bool BIAS> struct AffineStore {
  Store<C, T, false> y;
  Load<T, C, false> gamma, beta;  // one row each (row 0)
  template <int N> __device__ __forceinline__ void params(C* w, C* b, int col) const {
    if (WEIGHT) gamma.template load<N>(w, 0, col);
    if (BIAS) beta.template load<N>(b, 0, col);
  }
  template <int N>
  __device__ __forceinline__ void store_with(const C* v, const C* w, const C* b, i64 row,
                                             int col) const {
    C out[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      out[i] = v[i];
      if (WEIGHT) out[i] *= w[i];
      if (BIAS) out[i] += b[i];
    }
    y.template store<N>(out, row, col);
  }
  template <int N> __device__ __forceinline__ void store(const C* v, i64 row, int col) const {
    C w[N], b[N];
    params<N>(w, b, col);
    store_with<N>(v, w, b, row, col);
  }
  // fetch() and store_fetched() split store() the other way, for a caller that loads several
  // packs' gamma and beta before their stores: a store to y is volatile, and no load after it
  // in program order issues before it, so a loop of store() waits out the parameters' latency
  // once a pack.
  template <int N> struct Params {
    Pack<T, N> w, b;  // as loaded, unconverted
  };
  template <int N> __device__ __forceinline__ Params<N> fetch(int col) const {
    Params<N> p;
    if (WEIGHT) p.w = gamma.template raw<N>(0, col);
    if (BIAS) p.b = beta.template raw<N>(0, col);
    return p;
  }
  template <int N>
  __device__ __forceinline__ void store_fetched(const C* v, const Params<N>& p, i64 row,
                                                int col) const {
    C w[N], b[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (WEIGHT) w[i] = pack_value(p.w, i);
      if (BIAS) b[i] = pack_value(p.b, i);
    }
    store_with<N>(v, w, b, row, col);
  }
};

// g = dy * gamma (dy when there is no weight). load2 also returns dy itself, which the dgamma and
// dbeta sums need. CACHED: gamma is read from `cached`, already converted, in shared memory
// (grad_cached; laid out by cached_at), instead of from memory and converted at every use.
template <typename T, typename C, bool WEIGHT, bool CACHED = false> struct ScaleLoad {
  Load<T, C, false> dy, gamma;
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
        gamma.template load<N>(w, 0, col);
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

template <typename C> __device__ __forceinline__ C block_sum(C v, unsigned& phase) {
  return allreduce_block(Sums<C, 1>{{v}}, phase).v[0];
}

// x - K - m': in two steps (exact for float and double rows far from zero), or as x - (K + m')
// in one, where the rounding of K + m' is far below the data's own spacing (half, bfloat16).
template <typename C, bool TWO_STEP> struct Centre {
  C k, m;
  __device__ __forceinline__ C operator()(C v) const {
    if (TWO_STEP) return (v - k) - m;
    return v - (k + m);
  }
};

// The sum of squared deviations at(x) over this thread's cached packs p0 + threadIdx.x +
// j * blockDim.x of [p0, p1) (slice-local in the cache): values only this thread wrote, so no
// barrier.
template <int PACK, typename T, typename C, bool TWO_STEP>
__device__ __forceinline__ C own_squares(const SmemRow<T, C, PACK>& cache,
                                         const Centre<C, TWO_STEP>& at, int p0, int p1) {
  C q = C(0);
  for (int p = p0 + static_cast<int>(threadIdx.x); p < p1; p += blockDim.x) {
    C v[PACK];
    cache.get(p - p0, v);
#pragma unroll
    for (int i = 0; i < PACK; ++i) q += at(v[i]) * at(v[i]);
  }
  return q;
}

// One value's part of the first pass: x - K (layer norm) or x^2 (RMS norm).
template <int ALGO, typename C> __device__ __forceinline__ C norm_term(C v, C k) {
  return ALGO == kLayerNorm ? v - k : v * v;
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
  /* layer norm works on x - K; float and double data normalise (x - K) - mean' in two steps,   \
     half and bfloat16 data x - (K + mean') in one (see the top of this file) */                 \
  constexpr bool SHIFT = ALGO == kLayerNorm;                                                   \
  constexpr bool TWO_STEP = SHIFT && sizeof(T) >= 4;                                           \
  (void)TWO_STEP;                                                                              \
  unsigned phase = 0; /* allreduce_block's buffer phase */                                     \
  (void)phase;                                                                                 \
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
  const C inv_cols = C(1) / C(cols);
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
      k[r] = SHIFT ? __shfl_sync(0xffffffffu, buf[r][0], 0, width) : C(0);
      s[r].v[0] = C(0);
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        if ((p * width + lane) * PACK >= cols) continue;  // padding stays 0
#pragma unroll
        for (int i = 0; i < PACK; ++i) {
          C& v = buf[r][p * PACK + i];
          if (SHIFT) v -= k[r];
          s[r].v[0] += ALGO == kLayerNorm ? v : v * v;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < RPA; ++r) s[r] = allreduce_group(s[r], width);
#pragma unroll
    for (int r = 0; r < RPA; ++r) {
      if (ALGO == kLayerNorm) {  // second pass: squared deviations from the exact mean
        m[r] = s[r].v[0] * inv_cols;
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
    C rs[RPA];
#pragma unroll
    for (int r = 0; r < RPA; ++r) {
      rs[r] = Math<C>::rsqrt(s[r].v[0] * inv_cols + eps);
      if (lane == 0 && row0 + r < rows) put_stats<ALGO>(mean, rstd, row0 + r, k[r] + m[r], rs[r]);
    }
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      const int col = (p * width + lane) * PACK;
      if (col >= cols) continue;
      C w[PACK], b[PACK];  // gamma and beta once for the RPA rows
      st.template params<PACK>(w, b, col);
#pragma unroll
      for (int r = 0; r < RPA; ++r) {
        if (row0 + r >= rows) continue;
        C out[PACK];
#pragma unroll
        for (int i = 0; i < PACK; ++i) out[i] = (buf[r][p * PACK + i] - m[r]) * rs[r];
        st.template store_with<PACK>(out, w, b, row0 + r, col);
      }
    }
  }
}

// All-reduces for norm_rows over the block, or the cluster (generic lambdas would do, but NVRTC
// compiles their call operator as host code when many kernels share a program). `last`: the
// block's (and cluster's) final call. operator(): a state over the block or the cluster;
// block(): a state over the block; blocks(): merges the blocks' (block-uniform) states over the
// cluster, where the block kernel has nothing to merge. `meanwhile()` runs once in each call of
// operator() and blocks(), in a cluster while its barrier is pending (merge_cluster). finish():
// before the block exits, after the final call (a cluster's last wait, deferred past the
// stores).
struct BlockReduce {
  static constexpr bool kCluster = false;
  unsigned phase = 0;  // allreduce_block's buffer phase
  template <typename S, typename F>
  __device__ __forceinline__ S operator()(const S& v, bool, const F& meanwhile) {
    meanwhile();
    return allreduce_block(v, phase);
  }
  template <typename S> __device__ __forceinline__ S block(const S& v) {
    return allreduce_block(v, phase);
  }
  template <typename S, typename F>
  __device__ __forceinline__ S blocks(const S& v, bool, const F& meanwhile) {
    meanwhile();
    return v;
  }
  __device__ __forceinline__ void finish() {}
};
template <int CLUSTER> struct ClusterReduce {
  static constexpr bool kCluster = true;
  unsigned phase = 0, block_phase = 0;
  template <typename S, typename F>
  __device__ __forceinline__ S operator()(const S& v, bool last, const F& meanwhile) {
    return allreduce_cluster<CLUSTER>(v, phase, last, meanwhile);
  }
  template <typename S> __device__ __forceinline__ S block(const S& v) {
    return allreduce_block(v, block_phase);
  }
  template <typename S, typename F>
  __device__ __forceinline__ S blocks(const S& v, bool last, const F& meanwhile) {
    return merge_cluster<CLUSTER>(v, phase++ & 1u, last, meanwhile);
  }
  __device__ __forceinline__ void finish() { cluster_wait(); }
};

// The rows loop of the cached forward kernels (block and cluster): packs [p0, p1) of R rows at
// a time (rows row .. row + R - 1, then `step` rows on), each row's slice cached in shared
// memory (row r's at smem + r * slice). Each thread sums the packs it caches; the block
// all-reduces the sums (RMS norm: across the cluster too). Layer norm then takes the exact
// squared deviations of the same cached values from the block's mean (no barrier: a thread
// reads back only what it wrote) and all-reduces them over the block: two all-reduces of one
// sum, where Chan's merges of (count, mean, M2) states cost a reciprocal and some fifteen more
// instructions a shuffle (float16 at 2048 columns, 128 threads: 93% of copy with the merges,
// 98% without; bfloat16 88% -> 99%). A cluster merges its blocks' (count, mean, M2) by Chan's
// formula once, in warp 0. The R rows share each all-reduce. Then y from the cache, each pack's
// gamma and beta loaded once for the R rows. x alone, in packs of at least 4 bytes, reaches the
// cache by asynchronous copies, all of a thread's packs (of all R rows) in flight at once (the
// compiler otherwise may issue them one at a time); x + residual (written to h as it is cached)
// by loads U packs at a time.
//
// OVERLAP (the planner's choice, _plan_overlap; R = 1): each thread loads the next row U packs
// ahead into registers while it writes this row's y from the cache, and puts them in the slots
// it has just written out (its own: no barrier), summing as it goes. A block then keeps memory
// busy on its own, for some 20 more registers a thread. Measured on the H100 with a residual:
// 94-96% of copy against 85-90% where OneFlow's blocks leave 1024 threads or fewer on an SM
// (float16 at 65536 columns, float32 at 8192-32768) and for clusters; where more share an SM,
// taking turns at memory with OneFlow's waves is as fast, and for x alone the registers cost
// float16 layer norm at 131072 columns its third block per SM (89% of copy -> 70%).
// (A running Welford merge in the load loop measured 20-25% slower: its dependent chain holds
// back the next loads.)
template <int ALGO, bool SHIFT, bool TWO_STEP, bool RESIDUAL, bool OVERLAP, int PACK, int V,
          int R, typename T, typename C, typename Ld, typename St, typename Reduce>
__device__ __forceinline__ void norm_rows(T* smem, int slice, const Ld& ld, const St& st,
                                          const T* x, i64 sx, C* mean, C* rstd, C eps, i64 row,
                                          i64 rows, i64 step, int cols, int p0, int p1,
                                          bool writer, Reduce reduce) {
  static_assert(R >= 1 && (R == 1 || !OVERLAP), "R rows a pass: 1 with OVERLAP");
  constexpr bool ASYNC = !RESIDUAL && PACK * sizeof(T) >= 4;
  constexpr int U = RESIDUAL ? 2 : 4;  // packs of the next row in registers per thread
  const int stride = blockDim.x;
  if (row >= rows) return;  // uniform across the block (and the cluster)
  auto cache = [&](int r) { return SmemRow<T, C, PACK>{smem + r * slice}; };
  // whether the pass has row r (uniform across the block and the cluster)
  auto has = [&](int r) { return r == 0 || row + r < rows; };
  C k[R], s[R];  // each row's shift K (the same in every block) and this thread's sum
  auto fill = [&]() {  // the pass's rows into the cache, and s
#pragma unroll
    for (int r = 0; r < R; ++r) {
      s[r] = C(0);
      k[r] = SHIFT && has(r) ? ld.first(row + r) : C(0);
      if (!has(r)) continue;
      if constexpr (ASYNC) {
        const T* src = x + (row + r) * sx;
        for (int p = p0 + threadIdx.x; p < p1; p += stride) {
          cp_async<PACK * sizeof(T)>(cache(r).base + (p - p0) * PACK, src + p * PACK);
        }
      } else {
        scan_packs<C, PACK, PACK, 4>(ld, row + r, p0, p1, [&](int p, const C* v) {
          cache(r).put(p - p0, v);
#pragma unroll
          for (int i = 0; i < PACK; ++i) s[r] += norm_term<ALGO>(v[i], k[r]);
        });
      }
    }
    if constexpr (ASYNC) {
      cp_async_wait_all();
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (!has(r)) continue;
        for (int p = p0 + threadIdx.x; p < p1; p += stride) {
          C v[PACK];
          cache(r).get(p - p0, v);
#pragma unroll
          for (int i = 0; i < PACK; ++i) s[r] += norm_term<ALGO>(v[i], k[r]);
        }
      }
    }
  };
  if (OVERLAP) fill();  // later rows arrive during the rows before them
  // EARLY: a cluster's blocks, one row a pass, load their first V packs' gamma and beta while
  // the cluster barrier of the row's merge is pending (`early`, between its arrive and its
  // wait), which they then spend waiting; loaded after it, each pass began its stores with an
  // L2 latency (see the session-14 notes in benchmarks/results). Loaded before the block
  // all-reduces (session 14), warp 0's release fence at the barrier waited for them (session
  // 15: +0.8 to +1.2 points of copy, merge_cluster). With two rows a pass early loads spilled
  // registers (bfloat16) and did not help float16.
  //
  // Clusters that OVERLAP rows spend that wait two ways (session 16, residual layer norm, % of
  // copy, 1-4 runs each on the H100): in float32 (EARLY_OVERLAP) they load the gamma and beta
  // of the first U packs that the rows loop writes; 16-bit types, at 64 registers with them,
  // measured 0.5-1 point slower and do not. And (PREFETCH) they ask L2 for the first quarter
  // of their slice of the next row, x and the residual, which then streams in while the
  // cluster merges instead of waiting for the rows loop. Float32 at 262144 columns (clusters
  // of 8 blocks of 1024 threads, one to an SM): 87.2-88.3 -> 89.0-89.7 with the parameters,
  // 91.3 with the prefetch, 93.2-93.4 with both; at 65536 and 131072 columns +0.3 to +0.9;
  // 16-bit types and RMS norm within 0.7 either way. Prefetching 3/8 or 1/2 of the slice
  // measured 1.5-5 points slower; a quarter prefetched at the top of the pass (before the
  // block all-reduces) 0.7-2.8 points slower at 32768-131072 columns and for RMS norm; and by
  // clusters that do not overlap rows (no residual: their next row's copies start after this
  // row's stores), 2.8-5.5 points slower at 131072 (16-bit) and 262144 columns (float32).
  constexpr bool EARLY = !OVERLAP && Reduce::kCluster && R == 1;
  constexpr bool EARLY_OVERLAP = OVERLAP && Reduce::kCluster && sizeof(T) == 4;
  // (not float64: 8 more bytes of spills with the prefetch, and no measurement)
  constexpr bool PREFETCH =
      OVERLAP && Reduce::kCluster && sizeof(T) <= 4 && PACK * sizeof(T) == 16;
  typedef typename St::template Params<PACK> Par;
  const int first = p0 + static_cast<int>(threadIdx.x);  // this thread's first pack
  auto fetch_params = [&](int p, Par* par, int n) {  // gamma and beta of n packs from pack p
#pragma unroll
    for (int u = 0; u < n; ++u) {
      if (p + u * stride < p1) par[u] = st.template fetch<PACK>((p + u * stride) * PACK);
    }
  };
  // PREFETCH: the first quarter of this block's packs of row r, in spans of 4 KiB, one a
  // thread from warp 1 on (warp 0 reads the peers' states once the barrier completes)
  auto prefetch_quarter = [&](i64 r) {
    constexpr int SPAN = 4096 / (PACK * static_cast<int>(sizeof(T)));  // packs a prefetch
    const int packs = (p1 - p0) / 4;
    for (int c = static_cast<int>(threadIdx.x) - 32; c >= 0 && c * SPAN < packs; c += stride) {
      ld.prefetch(r, (p0 + c * SPAN) * PACK, min(SPAN, packs - c * SPAN) * PACK);
    }
  };
  for (;;) {
    Par par[V];
    Par ahead[EARLY_OVERLAP ? U : 1];  // EARLY_OVERLAP: the first U packs' gamma and beta
    if (!OVERLAP) fill();
    const i64 next = row + step;
    const bool more = next < rows;  // uniform across the block (and the cluster)
    auto early = [&]() {  // while the cluster barrier is pending
      if (EARLY) fetch_params(first, par, V);
      if constexpr (EARLY_OVERLAP) fetch_params(first, ahead, U);
      if (PREFETCH && more) prefetch_quarter(next);
    };
    C m[R], rs[R];  // m: the mean of x - K
    if (ALGO == kLayerNorm) {
      // the block's exact mean, then the squared deviations from it: two all-reduces; a
      // cluster merges its blocks' (count, mean, M2) by Chan's formula
      const C n = C((p1 - p0) * PACK);
      Sums<C, R> sb, q;
#pragma unroll
      for (int r = 0; r < R; ++r) sb.v[r] = s[r];
      sb = reduce.block(sb);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        sb.v[r] = n > C(0) ? sb.v[r] / n : C(0);  // the block's mean
        q.v[r] = has(r) ? own_squares<PACK>(cache(r), Centre<C, TWO_STEP>{k[r], sb.v[r]}, p0, p1)
                        : C(0);
      }
      q = reduce.block(q);
      Several<Welford<C>, R> w;
#pragma unroll
      for (int r = 0; r < R; ++r) w.s[r] = Welford<C>{n, sb.v[r], q.v[r]};
      w = reduce.blocks(w, !more, early);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        m[r] = w.s[r].mean;
        rs[r] = Math<C>::rsqrt(w.s[r].m2 / C(cols) + eps);
      }
    } else {
      Sums<C, R> t;
#pragma unroll
      for (int r = 0; r < R; ++r) t.v[r] = s[r];
      t = reduce(t, !more, early);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        m[r] = C(0);
        rs[r] = Math<C>::rsqrt(t.v[r] / C(cols) + eps);
      }
    }
    if (writer && threadIdx.x == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (has(r)) put_stats<ALGO>(mean, rstd, row + r, k[r] + m[r], rs[r]);
      }
    }
    // y of row r at pack q
    auto write = [&](int r, int q, const typename St::template Params<PACK>& par) {
      const Centre<C, TWO_STEP> at{k[r], m[r]};
      C v[PACK];
      cache(r).get(q - p0, v);
#pragma unroll
      for (int i = 0; i < PACK; ++i) v[i] = at(v[i]) * rs[r];
      st.template store_fetched<PACK>(v, par, row + r, q * PACK);
    };
    if constexpr (!OVERLAP) {
      // gamma and beta of V packs in flight at once, then their stores (see AffineStore)
      for (int p = first; p < p1; p += V * stride) {
        if (!EARLY || p != first) fetch_params(p, par, V);
#pragma unroll
        for (int u = 0; u < V; ++u) {
          if (p + u * stride >= p1) break;
#pragma unroll
          for (int r = 0; r < R; ++r) {
            if (has(r)) write(r, p + u * stride, par[u]);
          }
        }
      }
    } else {
      const C k_next = SHIFT && more ? ld.first(next) : C(0);
      s[0] = C(0);
      for (int p = p0 + threadIdx.x; p < p1; p += U * stride) {
        typename Ld::template Raw<PACK> nv[U];
        if (more) {
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (p + u * stride < p1) nv[u] = ld.template fetch<PACK>(next, (p + u * stride) * PACK);
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int q = p + u * stride;
          if (q >= p1) break;
          // the next row's loads are in flight
          write(0, q, EARLY_OVERLAP && p == first ? ahead[u] : st.template fetch<PACK>(q * PACK));
        }
        if (more) {
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int q = p + u * stride;
            if (q >= p1) break;
            C v[PACK];
            ld.template finish<PACK>(nv[u], v, next, q * PACK);
            cache(0).put(q - p0, v);
#pragma unroll
            for (int i = 0; i < PACK; ++i) s[0] += norm_term<ALGO>(v[i], k_next);
          }
        }
      }
      k[0] = k_next;
    }
    if (!more) {
      reduce.finish();  // after the stores: no block exits while a peer reads its state
      return;
    }
    row = next;
  }
}

// Block kernel with the row cached in shared memory (cols values of T; see norm_rows).
// Grid-stride over rows; any block size that is a multiple of 32.
template <typename T, int ALGO, int PACK, bool WEIGHT, bool BIAS, bool RESIDUAL, bool OVERLAP>
__global__ void __launch_bounds__(1024) layer_norm_block_smem(CUKERN_NORM_FWD_PARAMS) {
  CUKERN_NORM_FWD_SETUP;
  BlockReduce reduce;
  norm_rows<ALGO, SHIFT, TWO_STEP, RESIDUAL, OVERLAP, PACK, 1, 1>(
      dynamic_smem<T>(), 0, ld, st, x, sx, mean, rstd, eps, blockIdx.x, rows, gridDim.x, cols, 0,
      cols / PACK, true, reduce);
}

// Block kernel without a cache: Welford statistics in one read, then a second read to write y.
// With a residual the second read is of h (written by this same thread in the first pass).
template <typename T, int ALGO, int PACK, bool WEIGHT, bool BIAS, bool RESIDUAL>
__global__ void __launch_bounds__(1024) layer_norm_block_uncached(CUKERN_NORM_FWD_PARAMS) {
  CUKERN_NORM_FWD_SETUP;
  const Load<T, C, false> again{RESIDUAL ? h : x, rows_at(RESIDUAL ? sh : sx)};
  const int num_packs = cols / PACK;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const C k = SHIFT ? ld.first(row) : C(0);  // the shift K
    C m = C(0), var;  // m: the mean of x - K
    if (ALGO == kLayerNorm) {
      Welford<C> w = Welford<C>::identity();
      scan_packs<C, PACK, PACK, 4>(ld, row, 0, num_packs, [&](int, const C* v) {
        C d[PACK];
#pragma unroll
        for (int i = 0; i < PACK; ++i) d[i] = v[i] - k;
        w.template add<PACK>(d);
      });
      w = allreduce_block(w, phase);
      m = w.mean;
      var = w.m2 / C(cols);
    } else {
      C s = C(0);
      scan_packs<C, PACK, PACK, 4>(ld, row, 0, num_packs, [&](int, const C* v) {
#pragma unroll
        for (int i = 0; i < PACK; ++i) s += v[i] * v[i];
      });
      var = block_sum(s, phase) / C(cols);
    }
    const C rs = Math<C>::rsqrt(var + eps);
    if (threadIdx.x == 0) put_stats<ALGO>(mean, rstd, row, k + m, rs);
    const Centre<C, TWO_STEP> at{k, m};
    for (int p = threadIdx.x; p < num_packs; p += blockDim.x) {
      C v[PACK];
      again.template load<PACK>(v, row, p * PACK);
#pragma unroll
      for (int i = 0; i < PACK; ++i) v[i] = at(v[i]) * rs;
      st.template store<PACK>(v, row, p * PACK);
    }
  }
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // clusters: sm_90 and newer
// A cluster of CLUSTER blocks per row (sm_90): each block caches a slice of the row (see
// norm_rows), and the blocks' statistics meet in distributed shared memory. ROWS rows a pass
// (consecutive; Plan.rows_per_pass): each block's slice of gamma and beta is read once for
// them, where the slice, read from L2 for every row, would double or triple what the block
// reads besides x.
template <typename T, int ALGO, int PACK, int CLUSTER, bool WEIGHT, bool BIAS, bool RESIDUAL,
          bool OVERLAP, int MIN_BLOCKS, int ROWS>
__global__ void __cluster_dims__(CLUSTER, 1, 1)
__launch_bounds__(MIN_BLOCKS == 1 ? 1024 : 512, MIN_BLOCKS)
layer_norm_cluster(CUKERN_NORM_FWD_PARAMS) {
  static_assert(MIN_BLOCKS == 1 || MIN_BLOCKS == 3, "MIN_BLOCKS: 1, or 3 blocks of <= 512 threads");
  static_assert(ROWS == 1 || ROWS == 2, "ROWS: 1 or 2 rows a pass");
  CUKERN_NORM_FWD_SETUP;
  constexpr int V = MIN_BLOCKS == 3 && sizeof(T) <= 4 && ROWS == 1 ? 2 : 1;
  const unsigned rank = cluster_rank();
  const int num_packs = cols / PACK;
  int p0, p1;
  cluster_pack_range(num_packs, CLUSTER, rank, p0, p1);
  const int slice = (num_packs + CLUSTER - 1) / CLUSTER * PACK;  // the widest block's
  ClusterReduce<CLUSTER> reduce;
  norm_rows<ALGO, SHIFT, TWO_STEP, RESIDUAL, OVERLAP, PACK, V, ROWS>(
      aligned_dynamic_smem<T>(), slice, ld, st, x, sx, mean, rstd, eps,
      static_cast<i64>(blockIdx.x / CLUSTER) * ROWS, rows,
      static_cast<i64>(gridDim.x / CLUSTER) * ROWS, cols, p0, p1, rank == 0, reduce);
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
  const ScaleLoad<T, C, WEIGHT> ld_g{{dy, rows_at(sdy)}, {gamma, rows_at(0)}, nullptr};        \
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
// multiply-adds, rs * g + (xhat * b + a) with a = -rs * mean(g), b = -rs * mean(g * xhat).
template <bool LAYER, typename C, int K> struct GradX {
  C m, rs, a, b;
  __device__ __forceinline__ GradX(const Sums<C, K>& s, C m_, C rs_, C inv_cols)
      : m(m_), rs(rs_), a(LAYER ? -rs_ * (s.v[K - 1] * inv_cols) : C(0)),
        b(-rs_ * (s.v[0] * inv_cols)) {}
  __device__ __forceinline__ C with_xhat(C xhat, C g) const { return rs * g + (xhat * b + a); }
  __device__ __forceinline__ C operator()(C x, C g) const { return with_xhat((x - m) * rs, g); }
};

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
      const GradX<LAYER, C, NSUM> gx(s[r], C(0), rs[r], inv_cols);
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        const int col = (p * width + lane) * PACK;
        if (col >= cols) continue;
        C out[PACK];
#pragma unroll
        for (int i = 0; i < PACK; ++i) out[i] = gx.with_xhat(xh[r][p * PACK + i], g[r][p * PACK + i]);
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
    const GradX<LAYER, C, NSUM> gx(reduce(s, row + step >= rows), m, rs, inv_cols);
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
__global__ void __launch_bounds__(1024) layer_norm_grad_block_smem(CUKERN_NORM_BWD_PARAMS) {
  CUKERN_NORM_BWD_SETUP;
  auto reduce = [&](const Sums<C, NSUM>& s, bool) { return allreduce_block(s, phase); };
  grad_cached<LAYER, WEIGHT, REGS, GAMMA, PACK, NSUM, NACC>(
      dynamic_smem<T>(), ld_xdy, ld_g, st, mean, rstd, dw, db, blockIdx.x, rows, gridDim.x, cols,
      cols, 0, cols / PACK, blockIdx.x, reduce);
}

// No cache: x and dy are read twice. dx only: with WEIGHT, g = dy * gamma, and dgamma/dbeta
// come from norm_param_grad_partial (a row this long would need its column sums in memory).
template <typename T, int ALGO, int PACK, bool WEIGHT>
__global__ void __launch_bounds__(1024) layer_norm_grad_block_uncached(CUKERN_NORM_BWD_PARAMS) {
  CUKERN_NORM_BWD_SETUP;
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
layer_norm_grad_cluster(CUKERN_NORM_BWD_PARAMS) {
  CUKERN_NORM_BWD_SETUP;
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
// ...; the BY row lanes' sums then meet in shared memory. The host picks vec and BY
// (_dispatch.param_reduce_shape) so that a few rows fall to each thread and the grid still
// fills the GPU: layer norm float16 at 32768 columns (35 partial rows) 4.2 us on the H100
// where blocks of single columns and 32 row lanes, most waiting on one load each, took 10.9.
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
  // Four rows' loads in flight before their adds (a loop unrolled by the compiler checks
  // its bound between the loads, and each add then waits for its load: that cost the
  // backward 1-1.5% of its time at 32-1024 columns, where ~1000-2000 partial rows fall to a
  // few blocks; 4.6-5.0 us this way at 1056-1188 partial rows of 128-1024 columns, H100).
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

#undef CUKERN_NORM_FWD_PARAMS
#undef CUKERN_NORM_FWD_SETUP
#undef CUKERN_NORM_BWD_PARAMS
#undef CUKERN_NORM_BWD_SETUP

}  // namespace cukern

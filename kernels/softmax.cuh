// Softmax and log-softmax over the columns of a (rows, cols) view, forward and backward.
//
// Four variants, chosen by cukern/_dispatch.py:
//   *_warp            a group of WIDTH lanes owns a row held in registers (cols <= 1024)
//   *_block_smem      one block per row; the row is cached in shared memory in its storage type
//   *_cluster         a cluster of CLUSTER blocks per row (sm_90): each block caches a slice,
//                     and the partial reductions meet through distributed shared memory
//   *_block_uncached  one block per row, the row is read again from global memory
// ALGO: 0 = softmax, 1 = log-softmax. STRIDED: general (outer, col, inner) addressing, PACK == 1.
#pragma once
#include "common.cuh"

namespace cukern {

enum { kSoftmax = 0, kLogSoftmax = 1 };

// y for one value, given the row max m and the row sum s of exp(x - m).
template <int ALGO, typename C> __device__ __forceinline__ C softmax_out(C x, C m, C s) {
  if (ALGO == kSoftmax) return Math<C>::exp(x - m) / s;
  return (x - m) - Math<C>::log(s);
}

// The per-row term summed by the backward: softmax sums dy * y, log-softmax sums dy.
template <int ALGO, typename C> __device__ __forceinline__ C grad_term(C y, C dy) {
  return ALGO == kSoftmax ? dy * y : dy;
}

// dx for one value, given the row sum s of grad_term.
template <int ALGO, typename C> __device__ __forceinline__ C grad_out(C y, C dy, C s) {
  if (ALGO == kSoftmax) return (dy - s) * y;
  return dy - Math<C>::exp(y) * s;
}

#define CUKERN_LAYOUT_ARGS(p) i64 p##_outer, i64 p##_inner, i64 p##_col
#define CUKERN_LAYOUT(p) Layout<STRIDED>{p##_outer, p##_inner, p##_col, inner}

// ---------------------------------------------------------------------------------------------
// Warp kernel. Block (WIDTH, 128 / WIDTH); thread group y owns RPA rows at a time; lane l of the
// group holds packs p at columns (p * WIDTH + l) * PACK, so a group's accesses are coalesced.
// The row loop is uniform across the block, so every lane reaches every shuffle.
template <typename T, int ALGO, bool STRIDED, int PACK, int CPT, int WIDTH, int RPA, bool PADDING>
__global__ void __launch_bounds__(128)
softmax_warp(const T* x, T* y, i64 rows, int cols, i64 inner, CUKERN_LAYOUT_ARGS(xs),
             CUKERN_LAYOUT_ARGS(ys)) {
  typedef typename Num<T>::compute C;
  static_assert(CPT % PACK == 0, "cols_per_thread must be a multiple of pack_size");
  constexpr int NP = CPT / PACK;
  const Load<T, C, STRIDED> ld{x, CUKERN_LAYOUT(xs)};
  const Store<C, T, STRIDED> st{y, CUKERN_LAYOUT(ys)};
  const int lane = threadIdx.x;
  const i64 step = static_cast<i64>(gridDim.x) * blockDim.y * RPA;
  for (i64 base = static_cast<i64>(blockIdx.x) * blockDim.y * RPA; base < rows; base += step) {
    const i64 row0 = base + static_cast<i64>(threadIdx.y) * RPA;
    C buf[RPA][CPT];
    C m[RPA], s[RPA];
#pragma unroll
    for (int r = 0; r < RPA; ++r) {
      const bool valid = row0 + r < rows;
      m[r] = -Math<C>::inf();
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        const int col = (p * WIDTH + lane) * PACK;
        if (valid && (!PADDING || col < cols)) {
          ld.template load<PACK>(buf[r] + p * PACK, row0 + r, col);
        } else {
#pragma unroll
          for (int i = 0; i < PACK; ++i) buf[r][p * PACK + i] = -Math<C>::inf();
        }
      }
#pragma unroll
      for (int i = 0; i < CPT; ++i) m[r] = max_nan(m[r], buf[r][i]);
    }
#pragma unroll
    for (int r = 0; r < RPA; ++r) m[r] = group_allreduce<MaxOp, WIDTH>(m[r]);
#pragma unroll
    for (int r = 0; r < RPA; ++r) {
      s[r] = C(0);
#pragma unroll
      for (int i = 0; i < CPT; ++i) {
        if (ALGO == kSoftmax) {
          buf[r][i] = Math<C>::exp(buf[r][i] - m[r]);
          s[r] += buf[r][i];
        } else {
          buf[r][i] -= m[r];
          s[r] += Math<C>::exp(buf[r][i]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < RPA; ++r) s[r] = group_allreduce<SumOp, WIDTH>(s[r]);
#pragma unroll
    for (int r = 0; r < RPA; ++r) {
      if (row0 + r >= rows) continue;
      const C log_s = ALGO == kSoftmax ? C(0) : Math<C>::log(s[r]);
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        const int col = (p * WIDTH + lane) * PACK;
        if (PADDING && col >= cols) continue;
        C out[PACK];
#pragma unroll
        for (int i = 0; i < PACK; ++i) {
          const C v = buf[r][p * PACK + i];
          out[i] = ALGO == kSoftmax ? v / s[r] : v - log_s;
        }
        st.template store<PACK>(out, row0 + r, col);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Block kernels: one block of BLOCK threads per row (grid-stride over rows). Thread t handles
// packs t, t + BLOCK, ... in both passes, so the shared-memory cache needs no barrier of its own.
// The first pass keeps an online (max, sum) state, so the row is read from memory once.

// Pass 1 of a forward block kernel over packs [p0, p1): online max/sum, optionally caching.
template <typename T, int PACK, int BLOCK, bool STRIDED, bool CACHE>
__device__ __forceinline__ MaxSum<typename Num<T>::compute> softmax_scan(
    const Load<T, typename Num<T>::compute, STRIDED>& ld,
    const SmemRow<T, typename Num<T>::compute, PACK>& cache, i64 row, int p0, int p1) {
  typedef typename Num<T>::compute C;
  constexpr int U = 4;  // packs in flight per thread
  MaxSum<C> acc = MaxSum<C>::empty();
  int p = p0 + threadIdx.x;
  for (; p + (U - 1) * BLOCK < p1; p += U * BLOCK) {
    C v[U][PACK];
#pragma unroll
    for (int u = 0; u < U; ++u) ld.template load<PACK>(v[u], row, (p + u * BLOCK) * PACK);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (CACHE) cache.put(p - p0 + u * BLOCK, v[u]);
      acc.template add<PACK>(v[u]);
    }
  }
  for (; p < p1; p += BLOCK) {
    C v[PACK];
    ld.template load<PACK>(v, row, p * PACK);
    if (CACHE) cache.put(p - p0, v);
    acc.template add<PACK>(v);
  }
  return acc;
}

template <typename T, int ALGO, bool STRIDED, int PACK, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
softmax_block_smem(const T* x, T* y, i64 rows, int cols, i64 inner, CUKERN_LAYOUT_ARGS(xs),
                   CUKERN_LAYOUT_ARGS(ys)) {
  typedef typename Num<T>::compute C;
  extern __shared__ uint4 smem_words[];
  const SmemRow<T, C, PACK> cache{reinterpret_cast<T*>(smem_words)};
  const Load<T, C, STRIDED> ld{x, CUKERN_LAYOUT(xs)};
  const Store<C, T, STRIDED> st{y, CUKERN_LAYOUT(ys)};
  const int num_packs = cols / PACK;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const MaxSum<C> ms =
        block_allreduce<BLOCK>(softmax_scan<T, PACK, BLOCK, STRIDED, true>(ld, cache, row, 0, num_packs));
    for (int p = threadIdx.x; p < num_packs; p += BLOCK) {
      C v[PACK];
      cache.get(p, v);
#pragma unroll
      for (int i = 0; i < PACK; ++i) v[i] = softmax_out<ALGO>(v[i], ms.m, ms.d);
      st.template store<PACK>(v, row, p * PACK);
    }
  }
}

template <typename T, int ALGO, bool STRIDED, int PACK, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
softmax_block_uncached(const T* x, T* y, i64 rows, int cols, i64 inner, CUKERN_LAYOUT_ARGS(xs),
                       CUKERN_LAYOUT_ARGS(ys)) {
  typedef typename Num<T>::compute C;
  const SmemRow<T, C, PACK> no_cache{nullptr};
  const Load<T, C, STRIDED> ld{x, CUKERN_LAYOUT(xs)};
  const Store<C, T, STRIDED> st{y, CUKERN_LAYOUT(ys)};
  const int num_packs = cols / PACK;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const MaxSum<C> ms = block_allreduce<BLOCK>(
        softmax_scan<T, PACK, BLOCK, STRIDED, false>(ld, no_cache, row, 0, num_packs));
    for (int p = threadIdx.x; p < num_packs; p += BLOCK) {
      C v[PACK];
      ld.template load<PACK>(v, row, p * PACK);
#pragma unroll
      for (int i = 0; i < PACK; ++i) v[i] = softmax_out<ALGO>(v[i], ms.m, ms.d);
      st.template store<PACK>(v, row, p * PACK);
    }
  }
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // clusters: sm_90 and newer
// Packs [p0, p1) of the row that cluster rank `rank` of CLUSTER owns.
__device__ __forceinline__ void cluster_slice(int num_packs, int cluster, unsigned rank, int& p0,
                                              int& p1) {
  const int per = (num_packs + cluster - 1) / cluster;
  p0 = min(num_packs, static_cast<int>(rank) * per);
  p1 = min(num_packs, p0 + per);
}

// Merges one value per block of the cluster; every thread of every block must call it.
template <int CLUSTER, typename C, typename Merge>
__device__ __forceinline__ void cluster_exchange(C* a, C* b, Merge merge, C& out_a, C& out_b) {
  __shared__ C ra, rb;
  cluster_sync();  // every block's partial is written
  if (threadIdx.x < 32) {
    const unsigned lane = threadIdx.x;
    C va, vb;
    merge.identity(va, vb);
    if (lane < CLUSTER) {
      va = cluster_load(cluster_map(a, lane), C());
      vb = cluster_load(cluster_map(b, lane), C());
    }
#pragma unroll
    for (int mask = 16; mask > 0; mask /= 2) {
      C oa = __shfl_xor_sync(0xffffffffu, va, mask), ob = __shfl_xor_sync(0xffffffffu, vb, mask);
      merge(va, vb, oa, ob);
    }
    if (lane == 0) { ra = va; rb = vb; }
  }
  cluster_sync();  // every block has read the partials (they may be overwritten or freed after)
  out_a = ra;
  out_b = rb;
}

template <typename C> struct MergeMaxSum {
  __device__ void identity(C& m, C& d) const { m = -Math<C>::inf(); d = C(0); }
  __device__ void operator()(C& m, C& d, C om, C od) const {
    const MaxSum<C> r = MaxSum<C>::merge(MaxSum<C>{m, d}, MaxSum<C>{om, od});
    m = r.m;
    d = r.d;
  }
};

template <typename T, int ALGO, int PACK, int BLOCK, int CLUSTER>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(BLOCK)
softmax_cluster(const T* x, T* y, i64 rows, int cols, i64 inner, CUKERN_LAYOUT_ARGS(xs),
                CUKERN_LAYOUT_ARGS(ys)) {
  constexpr bool STRIDED = false;
  typedef typename Num<T>::compute C;
  extern __shared__ uint4 smem_words[];
  __shared__ C part_m, part_d;
  const SmemRow<T, C, PACK> cache{reinterpret_cast<T*>(smem_words)};
  const Load<T, C, STRIDED> ld{x, CUKERN_LAYOUT(xs)};
  const Store<C, T, STRIDED> st{y, CUKERN_LAYOUT(ys)};
  int p0, p1;
  cluster_slice(cols / PACK, CLUSTER, cluster_rank(), p0, p1);
  const i64 clusters = gridDim.x / CLUSTER;
  for (i64 row = blockIdx.x / CLUSTER; row < rows; row += clusters) {
    const MaxSum<C> mine =
        block_allreduce<BLOCK>(softmax_scan<T, PACK, BLOCK, STRIDED, true>(ld, cache, row, p0, p1));
    if (threadIdx.x == 0) { part_m = mine.m; part_d = mine.d; }
    C m, s;
    cluster_exchange<CLUSTER>(&part_m, &part_d, MergeMaxSum<C>(), m, s);
    for (int p = p0 + threadIdx.x; p < p1; p += BLOCK) {
      C v[PACK];
      cache.get(p - p0, v);
#pragma unroll
      for (int i = 0; i < PACK; ++i) v[i] = softmax_out<ALGO>(v[i], m, s);
      st.template store<PACK>(v, row, p * PACK);
    }
  }
}
#endif

// ---------------------------------------------------------------------------------------------
// Backward: dx from y and dy (softmax: dx = (dy - sum(dy * y)) * y;
// log-softmax: dx = dy - exp(y) * sum(dy)).

template <typename T, int ALGO, bool STRIDED, int PACK, int CPT, int WIDTH, int RPA, bool PADDING>
__global__ void __launch_bounds__(128)
softmax_grad_warp(const T* y, const T* dy, T* dx, i64 rows, int cols, i64 inner,
                  CUKERN_LAYOUT_ARGS(ys), CUKERN_LAYOUT_ARGS(dys), CUKERN_LAYOUT_ARGS(dxs)) {
  typedef typename Num<T>::compute C;
  constexpr int NP = CPT / PACK;
  const Load<T, C, STRIDED> ld_y{y, CUKERN_LAYOUT(ys)};
  const Load<T, C, STRIDED> ld_dy{dy, CUKERN_LAYOUT(dys)};
  const Store<C, T, STRIDED> st{dx, CUKERN_LAYOUT(dxs)};
  const int lane = threadIdx.x;
  const i64 step = static_cast<i64>(gridDim.x) * blockDim.y * RPA;
  for (i64 base = static_cast<i64>(blockIdx.x) * blockDim.y * RPA; base < rows; base += step) {
    const i64 row0 = base + static_cast<i64>(threadIdx.y) * RPA;
    C yb[RPA][CPT], db[RPA][CPT];
    C s[RPA];
#pragma unroll
    for (int r = 0; r < RPA; ++r) {
      const bool valid = row0 + r < rows;
      s[r] = C(0);
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        const int col = (p * WIDTH + lane) * PACK;
        if (valid && (!PADDING || col < cols)) {
          ld_y.template load<PACK>(yb[r] + p * PACK, row0 + r, col);
          ld_dy.template load<PACK>(db[r] + p * PACK, row0 + r, col);
        } else {
#pragma unroll
          for (int i = 0; i < PACK; ++i) yb[r][p * PACK + i] = db[r][p * PACK + i] = C(0);
        }
      }
#pragma unroll
      for (int i = 0; i < CPT; ++i) s[r] += grad_term<ALGO>(yb[r][i], db[r][i]);
    }
#pragma unroll
    for (int r = 0; r < RPA; ++r) s[r] = group_allreduce<SumOp, WIDTH>(s[r]);
#pragma unroll
    for (int r = 0; r < RPA; ++r) {
      if (row0 + r >= rows) continue;
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        const int col = (p * WIDTH + lane) * PACK;
        if (PADDING && col >= cols) continue;
        C out[PACK];
#pragma unroll
        for (int i = 0; i < PACK; ++i) {
          out[i] = grad_out<ALGO>(yb[r][p * PACK + i], db[r][p * PACK + i], s[r]);
        }
        st.template store<PACK>(out, row0 + r, col);
      }
    }
  }
}

// Pass 1 of a backward block kernel over packs [p0, p1): the sum of grad_term, optionally caching.
template <int ALGO, typename T, int PACK, int BLOCK, bool STRIDED, bool CACHE>
__device__ __forceinline__ typename Num<T>::compute softmax_grad_scan(
    const Load<T, typename Num<T>::compute, STRIDED>& ld_y,
    const Load<T, typename Num<T>::compute, STRIDED>& ld_dy,
    const SmemRow<T, typename Num<T>::compute, PACK>& cache_y,
    const SmemRow<T, typename Num<T>::compute, PACK>& cache_dy, i64 row, int p0, int p1) {
  typedef typename Num<T>::compute C;
  constexpr int U = 2;
  C acc = C(0);
  int p = p0 + threadIdx.x;
  for (; p + (U - 1) * BLOCK < p1; p += U * BLOCK) {
    C a[U][PACK], b[U][PACK];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      ld_y.template load<PACK>(a[u], row, (p + u * BLOCK) * PACK);
      ld_dy.template load<PACK>(b[u], row, (p + u * BLOCK) * PACK);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (CACHE) {
        cache_y.put(p - p0 + u * BLOCK, a[u]);
        cache_dy.put(p - p0 + u * BLOCK, b[u]);
      }
#pragma unroll
      for (int i = 0; i < PACK; ++i) acc += grad_term<ALGO>(a[u][i], b[u][i]);
    }
  }
  for (; p < p1; p += BLOCK) {
    C a[PACK], b[PACK];
    ld_y.template load<PACK>(a, row, p * PACK);
    ld_dy.template load<PACK>(b, row, p * PACK);
    if (CACHE) {
      cache_y.put(p - p0, a);
      cache_dy.put(p - p0, b);
    }
#pragma unroll
    for (int i = 0; i < PACK; ++i) acc += grad_term<ALGO>(a[i], b[i]);
  }
  return acc;
}

// Shared memory holds the y slice, then the dy slice, each `slice_packs` packs long.
template <typename T, int ALGO, bool STRIDED, int PACK, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
softmax_grad_block_smem(const T* y, const T* dy, T* dx, i64 rows, int cols, i64 inner,
                        CUKERN_LAYOUT_ARGS(ys), CUKERN_LAYOUT_ARGS(dys),
                        CUKERN_LAYOUT_ARGS(dxs)) {
  typedef typename Num<T>::compute C;
  extern __shared__ uint4 smem_words[];
  const int num_packs = cols / PACK;
  const SmemRow<T, C, PACK> cache_y{reinterpret_cast<T*>(smem_words)};
  const SmemRow<T, C, PACK> cache_dy{reinterpret_cast<T*>(smem_words) + cols};
  const Load<T, C, STRIDED> ld_y{y, CUKERN_LAYOUT(ys)};
  const Load<T, C, STRIDED> ld_dy{dy, CUKERN_LAYOUT(dys)};
  const Store<C, T, STRIDED> st{dx, CUKERN_LAYOUT(dxs)};
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const C s = block_allreduce<SumOp, BLOCK>(softmax_grad_scan<ALGO, T, PACK, BLOCK, STRIDED, true>(
        ld_y, ld_dy, cache_y, cache_dy, row, 0, num_packs));
    for (int p = threadIdx.x; p < num_packs; p += BLOCK) {
      C a[PACK], b[PACK];
      cache_y.get(p, a);
      cache_dy.get(p, b);
#pragma unroll
      for (int i = 0; i < PACK; ++i) a[i] = grad_out<ALGO>(a[i], b[i], s);
      st.template store<PACK>(a, row, p * PACK);
    }
  }
}

template <typename T, int ALGO, bool STRIDED, int PACK, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
softmax_grad_block_uncached(const T* y, const T* dy, T* dx, i64 rows, int cols, i64 inner,
                            CUKERN_LAYOUT_ARGS(ys), CUKERN_LAYOUT_ARGS(dys),
                            CUKERN_LAYOUT_ARGS(dxs)) {
  typedef typename Num<T>::compute C;
  const SmemRow<T, C, PACK> no_cache{nullptr};
  const Load<T, C, STRIDED> ld_y{y, CUKERN_LAYOUT(ys)};
  const Load<T, C, STRIDED> ld_dy{dy, CUKERN_LAYOUT(dys)};
  const Store<C, T, STRIDED> st{dx, CUKERN_LAYOUT(dxs)};
  const int num_packs = cols / PACK;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const C s = block_allreduce<SumOp, BLOCK>(softmax_grad_scan<ALGO, T, PACK, BLOCK, STRIDED, false>(
        ld_y, ld_dy, no_cache, no_cache, row, 0, num_packs));
    for (int p = threadIdx.x; p < num_packs; p += BLOCK) {
      C a[PACK], b[PACK];
      ld_y.template load<PACK>(a, row, p * PACK);
      ld_dy.template load<PACK>(b, row, p * PACK);
#pragma unroll
      for (int i = 0; i < PACK; ++i) a[i] = grad_out<ALGO>(a[i], b[i], s);
      st.template store<PACK>(a, row, p * PACK);
    }
  }
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // clusters: sm_90 and newer
template <typename C> struct MergeSum {
  __device__ void identity(C& a, C& b) const { a = C(0); b = C(0); }
  __device__ void operator()(C& a, C& b, C oa, C ob) const { a += oa; b += ob; }
};

// Each block caches its slice of y then of dy: shared memory of 2 * slice_packs packs.
template <typename T, int ALGO, int PACK, int BLOCK, int CLUSTER>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(BLOCK)
softmax_grad_cluster(const T* y, const T* dy, T* dx, i64 rows, int cols, i64 inner,
                     CUKERN_LAYOUT_ARGS(ys), CUKERN_LAYOUT_ARGS(dys), CUKERN_LAYOUT_ARGS(dxs)) {
  constexpr bool STRIDED = false;
  typedef typename Num<T>::compute C;
  extern __shared__ uint4 smem_words[];
  __shared__ C part, unused;
  const int num_packs = cols / PACK;
  int p0, p1;
  cluster_slice(num_packs, CLUSTER, cluster_rank(), p0, p1);
  const int slice = (num_packs + CLUSTER - 1) / CLUSTER;
  const SmemRow<T, C, PACK> cache_y{reinterpret_cast<T*>(smem_words)};
  const SmemRow<T, C, PACK> cache_dy{reinterpret_cast<T*>(smem_words) + slice * PACK};
  const Load<T, C, STRIDED> ld_y{y, CUKERN_LAYOUT(ys)};
  const Load<T, C, STRIDED> ld_dy{dy, CUKERN_LAYOUT(dys)};
  const Store<C, T, STRIDED> st{dx, CUKERN_LAYOUT(dxs)};
  const i64 clusters = gridDim.x / CLUSTER;
  for (i64 row = blockIdx.x / CLUSTER; row < rows; row += clusters) {
    const C mine = block_allreduce<SumOp, BLOCK>(softmax_grad_scan<ALGO, T, PACK, BLOCK, STRIDED, true>(
        ld_y, ld_dy, cache_y, cache_dy, row, p0, p1));
    if (threadIdx.x == 0) { part = mine; unused = C(0); }
    C s, ignored;
    cluster_exchange<CLUSTER>(&part, &unused, MergeSum<C>(), s, ignored);
    for (int p = p0 + threadIdx.x; p < p1; p += BLOCK) {
      C a[PACK], b[PACK];
      cache_y.get(p - p0, a);
      cache_dy.get(p - p0, b);
#pragma unroll
      for (int i = 0; i < PACK; ++i) a[i] = grad_out<ALGO>(a[i], b[i], s);
      st.template store<PACK>(a, row, p * PACK);
    }
  }
}
#endif

#undef CUKERN_LAYOUT
#undef CUKERN_LAYOUT_ARGS

}  // namespace cukern

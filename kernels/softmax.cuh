// Softmax and log-softmax over the columns of a (rows, cols) view, forward and backward.
//
// Four variants, chosen by cukern/_dispatch.py:
//   *_warp            a group of WIDTH lanes owns a row held in registers (cols <= 1024)
//   *_block_smem      one block per row; the row is cached in shared memory in its storage type
//   *_cluster         a cluster of CLUSTER blocks per row (sm_90): each block caches a slice,
//                     and the partial reductions meet through distributed shared memory
//   *_block_uncached  one block per row; an online (max, sum) pass, then the row is read again
//                     from global memory (L2 often still holds it)
// ALGO: 0 = softmax, 1 = log-softmax. STRIDED: general (outer, col, inner) addressing, PACK == 1.
#pragma once
#include "common.cuh"

namespace cukern {

enum { kSoftmax = 0, kLogSoftmax = 1 };

// The per-row constant of the output, from the row sum s of exp(x - max): 1 / s for softmax,
// log(s) for log-softmax.
template <int ALGO, typename C> __device__ __forceinline__ C row_constant(C s) {
  return ALGO == kSoftmax ? C(1) / s : Math<C>::log(s);
}

// y for one value, given the row max m and row_constant r.
template <int ALGO, typename T, typename C> __device__ __forceinline__ C softmax_out(C x, C m, C r) {
  if (ALGO == kSoftmax) return Num<T>::exp(x - m) * r;
  return (x - m) - r;
}

// The per-row term summed by the backward: softmax sums dy * y, log-softmax sums dy.
template <int ALGO, typename C> __device__ __forceinline__ C grad_term(C y, C dy) {
  return ALGO == kSoftmax ? dy * y : dy;
}

// dx for one value, given the row sum s of grad_term.
template <int ALGO, typename T, typename C> __device__ __forceinline__ C grad_out(C y, C dy, C s) {
  if (ALGO == kSoftmax) return (dy - s) * y;
  return dy - Num<T>::exp(y) * s;
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
          buf[r][i] = Num<T>::exp(buf[r][i] - m[r]);
          s[r] += buf[r][i];
        } else {
          buf[r][i] -= m[r];
          s[r] += Num<T>::exp(buf[r][i]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < RPA; ++r) s[r] = group_allreduce<SumOp, WIDTH>(s[r]);
#pragma unroll
    for (int r = 0; r < RPA; ++r) {
      if (row0 + r >= rows) continue;
      const C rc = row_constant<ALGO>(s[r]);
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        const int col = (p * WIDTH + lane) * PACK;
        if (PADDING && col >= cols) continue;
        C out[PACK];
#pragma unroll
        for (int i = 0; i < PACK; ++i) {
          const C v = buf[r][p * PACK + i];
          out[i] = ALGO == kSoftmax ? v * rc : v - rc;
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

// The online (max, sum) of packs [p0, p1) of a row, read from global memory.
template <typename T, int PACK, int BLOCK, bool STRIDED>
__device__ __forceinline__ MaxSum<T> softmax_scan(
    const Load<T, typename Num<T>::compute, STRIDED>& ld, i64 row, int p0, int p1) {
  typedef typename Num<T>::compute C;
  constexpr int U = 4;  // packs in flight per thread
  MaxSum<T> acc = MaxSum<T>::empty();
  int p = p0 + threadIdx.x;
  for (; p + (U - 1) * BLOCK < p1; p += U * BLOCK) {
    Pack<T, PACK> v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ld.template raw<PACK>(row, (p + u * BLOCK) * PACK);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      C c[PACK];
#pragma unroll
      for (int i = 0; i < PACK; ++i) c[i] = pack_value(v[u], i);
      acc.template add<PACK>(c);
    }
  }
  for (; p < p1; p += BLOCK) {
    C c[PACK];
    ld.template load<PACK>(c, row, p * PACK);
    acc.template add<PACK>(c);
  }
  return acc;
}

template <typename T, int ALGO, bool STRIDED, int PACK, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
softmax_block_uncached(const T* x, T* y, i64 rows, int cols, i64 inner, CUKERN_LAYOUT_ARGS(xs),
                       CUKERN_LAYOUT_ARGS(ys)) {
  typedef typename Num<T>::compute C;
  const Load<T, C, STRIDED> ld{x, CUKERN_LAYOUT(xs)};
  const Store<C, T, STRIDED> st{y, CUKERN_LAYOUT(ys)};
  const int num_packs = cols / PACK;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const MaxSum<T> ms = block_allreduce<BLOCK>(
        softmax_scan<T, PACK, BLOCK, STRIDED>(ld, row, 0, num_packs));
    const C rc = row_constant<ALGO>(ms.d);
    for (int p = threadIdx.x; p < num_packs; p += BLOCK) {
      C v[PACK];
      ld.template load<PACK>(v, row, p * PACK);
#pragma unroll
      for (int i = 0; i < PACK; ++i) v[i] = softmax_out<ALGO, T>(v[i], ms.m, rc);
      st.template store<PACK>(v, row, p * PACK);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Cached kernels: a block, or each block of a cluster of CLUSTER, keeps packs [p0, p1) of the row
// in shared memory in the storage type. Thread t owns packs p0 + t, p0 + t + BLOCK, ... in every
// pass, so the cache needs no barrier of its own. Each block (or cluster) loops over rows: the
// cluster grid is one wave of them, the block grid OneFlow's waves (cukern/_dispatch.py).

// The packs [p0, p1) of `num_packs` that cluster rank `rank` of `cluster` blocks owns.
__device__ __forceinline__ void cluster_slice(int num_packs, int cluster, unsigned rank, int& p0,
                                              int& p1) {
  const int per = (num_packs + cluster - 1) / cluster;
  p0 = min(num_packs, static_cast<int>(rank) * per);
  p1 = min(num_packs, p0 + per);
}

template <typename Op, int BLOCK, int CLUSTER, typename C>
__device__ __forceinline__ C row_allreduce(C v) {
  v = block_allreduce<Op, BLOCK>(v);
  if constexpr (CLUSTER > 1) v = cluster_allreduce<Op, CLUSTER>(v);
  return v;
}

// Pass 1 for one row: its packs [p0, p1) into shared memory; returns this thread's online
// (max, sum) state.
template <typename T, int PACK, int BLOCK, bool STRIDED>
__device__ __forceinline__ MaxSum<T> softmax_fill(const Load<T, typename Num<T>::compute, STRIDED>& ld,
                                                  Pack<T, PACK>* cache, i64 row, int p0, int p1) {
  typedef typename Num<T>::compute C;
  constexpr int U = 4;  // packs in flight per thread
  MaxSum<T> ms = MaxSum<T>::empty();
  // U packs a step, each guarded: a thread with fewer than U packs left still has all of them
  // in flight at once (a plain remainder loop would wait for each in turn).
  for (int p = p0 + threadIdx.x; p < p1; p += U * BLOCK) {
    Pack<T, PACK> v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (p + u * BLOCK < p1) v[u] = ld.template raw<PACK>(row, (p + u * BLOCK) * PACK);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (p + u * BLOCK >= p1) break;
      cache[p - p0 + u * BLOCK].word = v[u].word;
      C c[PACK];
#pragma unroll
      for (int i = 0; i < PACK; ++i) c[i] = pack_value(v[u], i);
      ms.template add<PACK>(c);
    }
  }
  return ms;
}

// Rows row, row + row_step, ... with packs [p0, p1) of each cached in shared memory: pass 1
// reads the row into shared memory keeping an online (max, sum); after one all-reduce, pass 2
// writes the output from shared memory. Pass 2 of one row and pass 1 of the next run as one
// loop: each thread reads its next-row packs into registers and writes out its current-row
// packs from the slots they then take over, so reads and writes stay in flight together and
// blocks that started in step do not stay in step.
template <typename T, int ALGO, bool STRIDED, int PACK, int BLOCK, int CLUSTER>
__device__ __forceinline__ void softmax_cached(const Load<T, typename Num<T>::compute, STRIDED>& ld,
                                               const Store<typename Num<T>::compute, T, STRIDED>& st,
                                               i64 rows, i64 row, i64 row_step, int p0, int p1) {
  typedef typename Num<T>::compute C;
  typedef Pack<T, PACK> P;
  constexpr int U = 4;
  extern __shared__ uint4 smem_words[];
  P* cache = reinterpret_cast<P*>(smem_words);
  if (row >= rows) return;  // uniform across the block (and the cluster)
  MaxSum<T> ms = softmax_fill<T, PACK, BLOCK, STRIDED>(ld, cache, row, p0, p1);
  for (;;) {
    ms = block_allreduce<BLOCK>(ms);
    if constexpr (CLUSTER > 1) ms = cluster_allreduce<CLUSTER>(ms);
    const C m = ms.m, rc = row_constant<ALGO>(ms.d);
    const i64 next = row + row_step;
    const bool more = next < rows;  // uniform
    MaxSum<T> ms_next = MaxSum<T>::empty();
    for (int p = p0 + threadIdx.x; p < p1; p += U * BLOCK) {
      P nv[U];
      if (more) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (p + u * BLOCK < p1) nv[u] = ld.template raw<PACK>(next, (p + u * BLOCK) * PACK);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (p + u * BLOCK >= p1) break;
        const P v = cache[p - p0 + u * BLOCK];
        C out[PACK];
#pragma unroll
        for (int i = 0; i < PACK; ++i) out[i] = softmax_out<ALGO, T>(pack_value(v, i), m, rc);
        st.template store<PACK>(out, row, (p + u * BLOCK) * PACK);
      }
      if (more) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (p + u * BLOCK >= p1) break;
          cache[p - p0 + u * BLOCK].word = nv[u].word;
          C c[PACK];
#pragma unroll
          for (int i = 0; i < PACK; ++i) c[i] = pack_value(nv[u], i);
          ms_next.template add<PACK>(c);
        }
      }
    }
    if (!more) return;
    row = next;
    ms = ms_next;
  }
}

template <typename T, int ALGO, bool STRIDED, int PACK, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
softmax_block_smem(const T* x, T* y, i64 rows, int cols, i64 inner, CUKERN_LAYOUT_ARGS(xs),
                   CUKERN_LAYOUT_ARGS(ys)) {
  typedef typename Num<T>::compute C;
  softmax_cached<T, ALGO, STRIDED, PACK, BLOCK, 1>(
      Load<T, C, STRIDED>{x, CUKERN_LAYOUT(xs)}, Store<C, T, STRIDED>{y, CUKERN_LAYOUT(ys)},
      rows, blockIdx.x, gridDim.x, 0, cols / PACK);
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // clusters: sm_90 and newer
template <typename T, int ALGO, int PACK, int BLOCK, int CLUSTER>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(BLOCK)
softmax_cluster(const T* x, T* y, i64 rows, int cols, i64 inner, CUKERN_LAYOUT_ARGS(xs),
                CUKERN_LAYOUT_ARGS(ys)) {
  constexpr bool STRIDED = false;
  typedef typename Num<T>::compute C;
  int p0, p1;
  cluster_slice(cols / PACK, CLUSTER, cluster_rank(), p0, p1);
  softmax_cached<T, ALGO, STRIDED, PACK, BLOCK, CLUSTER>(
      Load<T, C, STRIDED>{x, CUKERN_LAYOUT(xs)}, Store<C, T, STRIDED>{y, CUKERN_LAYOUT(ys)},
      rows, blockIdx.x / CLUSTER, gridDim.x / CLUSTER, p0, p1);
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
          out[i] = grad_out<ALGO, T>(yb[r][p * PACK + i], db[r][p * PACK + i], s[r]);
        }
        st.template store<PACK>(out, row0 + r, col);
      }
    }
  }
}

// Cached backward: y then dy of packs [p0, p1) in shared memory (`slice` packs apart).
//   pass 1  global -> shared memory; the row sum of grad_term(y, dy)
//   pass 2  shared memory -> global; dx
// Pass 1 for one row of the backward: y and dy packs [p0, p1) into shared memory; returns this
// thread's part of the row sum of grad_term.
template <int ALGO, typename T, int PACK, int BLOCK, bool STRIDED>
__device__ __forceinline__ typename Num<T>::compute softmax_grad_fill(
    const Load<T, typename Num<T>::compute, STRIDED>& ld_y,
    const Load<T, typename Num<T>::compute, STRIDED>& ld_dy, Pack<T, PACK>* cache_y,
    Pack<T, PACK>* cache_dy, i64 row, int p0, int p1) {
  typedef typename Num<T>::compute C;
  constexpr int U = 2;  // pairs of packs in flight per thread
  C s = C(0);
  int p = p0 + threadIdx.x;
  for (; p + (U - 1) * BLOCK < p1; p += U * BLOCK) {
    Pack<T, PACK> a[U], b[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      a[u] = ld_y.template raw<PACK>(row, (p + u * BLOCK) * PACK);
      b[u] = ld_dy.template raw<PACK>(row, (p + u * BLOCK) * PACK);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      cache_y[p - p0 + u * BLOCK].word = a[u].word;
      cache_dy[p - p0 + u * BLOCK].word = b[u].word;
#pragma unroll
      for (int i = 0; i < PACK; ++i) {
        s += grad_term<ALGO>(pack_value(a[u], i), pack_value(b[u], i));
      }
    }
  }
  for (; p < p1; p += BLOCK) {
    const Pack<T, PACK> a = ld_y.template raw<PACK>(row, p * PACK);
    const Pack<T, PACK> b = ld_dy.template raw<PACK>(row, p * PACK);
    cache_y[p - p0].word = a.word;
    cache_dy[p - p0].word = b.word;
#pragma unroll
    for (int i = 0; i < PACK; ++i) s += grad_term<ALGO>(pack_value(a, i), pack_value(b, i));
  }
  return s;
}

// Cached backward over rows row, row + row_step, ...: y then dy of packs [p0, p1) in shared
// memory (`slice` packs apart). As in the forward, writing dx of one row and reading the next
// row run as one loop.
template <typename T, int ALGO, bool STRIDED, int PACK, int BLOCK, int CLUSTER>
__device__ __forceinline__ void softmax_grad_cached(
    const Load<T, typename Num<T>::compute, STRIDED>& ld_y,
    const Load<T, typename Num<T>::compute, STRIDED>& ld_dy,
    const Store<typename Num<T>::compute, T, STRIDED>& st, i64 rows, i64 row, i64 row_step, int p0,
    int p1, int slice) {
  typedef typename Num<T>::compute C;
  typedef Pack<T, PACK> P;
  constexpr int U = 2;
  extern __shared__ uint4 smem_words[];
  P* cache_y = reinterpret_cast<P*>(smem_words);
  P* cache_dy = cache_y + slice;
  if (row >= rows) return;  // uniform across the block (and the cluster)
  C s = softmax_grad_fill<ALGO, T, PACK, BLOCK, STRIDED>(ld_y, ld_dy, cache_y, cache_dy, row, p0, p1);
  for (;;) {
    s = row_allreduce<SumOp, BLOCK, CLUSTER>(s);
    const i64 next = row + row_step;
    const bool more = next < rows;  // uniform
    C s_next = C(0);
    int p = p0 + threadIdx.x;
    for (; p + (U - 1) * BLOCK < p1; p += U * BLOCK) {
      P na[U], nb[U];
      if (more) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          na[u] = ld_y.template raw<PACK>(next, (p + u * BLOCK) * PACK);
          nb[u] = ld_dy.template raw<PACK>(next, (p + u * BLOCK) * PACK);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const P a = cache_y[p - p0 + u * BLOCK], b = cache_dy[p - p0 + u * BLOCK];
        C out[PACK];
#pragma unroll
        for (int i = 0; i < PACK; ++i) {
          out[i] = grad_out<ALGO, T>(pack_value(a, i), pack_value(b, i), s);
        }
        st.template store<PACK>(out, row, (p + u * BLOCK) * PACK);
      }
      if (more) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          cache_y[p - p0 + u * BLOCK].word = na[u].word;
          cache_dy[p - p0 + u * BLOCK].word = nb[u].word;
#pragma unroll
          for (int i = 0; i < PACK; ++i) {
            s_next += grad_term<ALGO>(pack_value(na[u], i), pack_value(nb[u], i));
          }
        }
      }
    }
    for (; p < p1; p += BLOCK) {
      P na, nb;
      if (more) {
        na = ld_y.template raw<PACK>(next, p * PACK);
        nb = ld_dy.template raw<PACK>(next, p * PACK);
      }
      const P a = cache_y[p - p0], b = cache_dy[p - p0];
      C out[PACK];
#pragma unroll
      for (int i = 0; i < PACK; ++i) {
        out[i] = grad_out<ALGO, T>(pack_value(a, i), pack_value(b, i), s);
      }
      st.template store<PACK>(out, row, p * PACK);
      if (more) {
        cache_y[p - p0].word = na.word;
        cache_dy[p - p0].word = nb.word;
#pragma unroll
        for (int i = 0; i < PACK; ++i) {
          s_next += grad_term<ALGO>(pack_value(na, i), pack_value(nb, i));
        }
      }
    }
    if (!more) return;
    row = next;
    s = s_next;
  }
}

template <typename T, int ALGO, bool STRIDED, int PACK, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
softmax_grad_block_smem(const T* y, const T* dy, T* dx, i64 rows, int cols, i64 inner,
                        CUKERN_LAYOUT_ARGS(ys), CUKERN_LAYOUT_ARGS(dys),
                        CUKERN_LAYOUT_ARGS(dxs)) {
  typedef typename Num<T>::compute C;
  softmax_grad_cached<T, ALGO, STRIDED, PACK, BLOCK, 1>(
      Load<T, C, STRIDED>{y, CUKERN_LAYOUT(ys)}, Load<T, C, STRIDED>{dy, CUKERN_LAYOUT(dys)},
      Store<C, T, STRIDED>{dx, CUKERN_LAYOUT(dxs)}, rows, blockIdx.x, gridDim.x, 0, cols / PACK,
      cols / PACK);
}

// The sum of grad_term over packs [p0, p1), read from global memory (the uncached kernel).
template <int ALGO, typename T, int PACK, int BLOCK, bool STRIDED>
__device__ __forceinline__ typename Num<T>::compute softmax_grad_scan(
    const Load<T, typename Num<T>::compute, STRIDED>& ld_y,
    const Load<T, typename Num<T>::compute, STRIDED>& ld_dy, i64 row, int p0, int p1) {
  typedef typename Num<T>::compute C;
  constexpr int U = 2;
  C acc = C(0);
  int p = p0 + threadIdx.x;
  for (; p + (U - 1) * BLOCK < p1; p += U * BLOCK) {
    Pack<T, PACK> a[U], b[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      a[u] = ld_y.template raw<PACK>(row, (p + u * BLOCK) * PACK);
      b[u] = ld_dy.template raw<PACK>(row, (p + u * BLOCK) * PACK);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int i = 0; i < PACK; ++i) {
        acc += grad_term<ALGO>(pack_value(a[u], i), pack_value(b[u], i));
      }
    }
  }
  for (; p < p1; p += BLOCK) {
    const Pack<T, PACK> a = ld_y.template raw<PACK>(row, p * PACK);
    const Pack<T, PACK> b = ld_dy.template raw<PACK>(row, p * PACK);
#pragma unroll
    for (int i = 0; i < PACK; ++i) acc += grad_term<ALGO>(pack_value(a, i), pack_value(b, i));
  }
  return acc;
}

template <typename T, int ALGO, bool STRIDED, int PACK, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
softmax_grad_block_uncached(const T* y, const T* dy, T* dx, i64 rows, int cols, i64 inner,
                            CUKERN_LAYOUT_ARGS(ys), CUKERN_LAYOUT_ARGS(dys),
                            CUKERN_LAYOUT_ARGS(dxs)) {
  typedef typename Num<T>::compute C;
  const Load<T, C, STRIDED> ld_y{y, CUKERN_LAYOUT(ys)};
  const Load<T, C, STRIDED> ld_dy{dy, CUKERN_LAYOUT(dys)};
  const Store<C, T, STRIDED> st{dx, CUKERN_LAYOUT(dxs)};
  const int num_packs = cols / PACK;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const C s = block_allreduce<SumOp, BLOCK>(
        softmax_grad_scan<ALGO, T, PACK, BLOCK, STRIDED>(ld_y, ld_dy, row, 0, num_packs));
    for (int p = threadIdx.x; p < num_packs; p += BLOCK) {
      C a[PACK], b[PACK];
      ld_y.template load<PACK>(a, row, p * PACK);
      ld_dy.template load<PACK>(b, row, p * PACK);
#pragma unroll
      for (int i = 0; i < PACK; ++i) a[i] = grad_out<ALGO, T>(a[i], b[i], s);
      st.template store<PACK>(a, row, p * PACK);
    }
  }
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // clusters: sm_90 and newer
template <typename T, int ALGO, int PACK, int BLOCK, int CLUSTER>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(BLOCK)
softmax_grad_cluster(const T* y, const T* dy, T* dx, i64 rows, int cols, i64 inner,
                     CUKERN_LAYOUT_ARGS(ys), CUKERN_LAYOUT_ARGS(dys), CUKERN_LAYOUT_ARGS(dxs)) {
  constexpr bool STRIDED = false;
  typedef typename Num<T>::compute C;
  const int num_packs = cols / PACK;
  int p0, p1;
  cluster_slice(num_packs, CLUSTER, cluster_rank(), p0, p1);
  softmax_grad_cached<T, ALGO, STRIDED, PACK, BLOCK, CLUSTER>(
      Load<T, C, STRIDED>{y, CUKERN_LAYOUT(ys)}, Load<T, C, STRIDED>{dy, CUKERN_LAYOUT(dys)},
      Store<C, T, STRIDED>{dx, CUKERN_LAYOUT(dxs)}, rows, blockIdx.x / CLUSTER,
      gridDim.x / CLUSTER, p0, p1, (num_packs + CLUSTER - 1) / CLUSTER);
}
#endif

#undef CUKERN_LAYOUT
#undef CUKERN_LAYOUT_ARGS

}  // namespace cukern

// Softmax and log-softmax over the columns of a (rows, cols) view, forward and backward.
//
// Four variants, chosen by the planner (cukern/plan/):
//   *_warp            a group of blockDim.x lanes owns a row held in registers (cols <= 1024)
//   *_block_smem      one block per row; the row is cached in shared memory in its storage type
//   *_cluster         a cluster of CLUSTER blocks per row (sm_90): each block caches a slice,
//                     and the partial reductions meet through distributed shared memory
//   *_block_uncached  one block per row; an online (max, sum) pass, then the row is read again
//                     from global memory (L2 often still holds it)
// ALGO: 0 = softmax, 1 = log-softmax. STRIDED: general (outer, col, inner) addressing, PACK == 1.
// SHIFT: rows off the 16-byte grid in 16-byte packs of memory, each row's end packs masked
// (memory.cuh, RowWindow): a row's columns count from its first 16-byte word.
// Only what sizes a register array is a template argument; the group width (blockDim.x of the
// warp kernel), the block size and padding are read at run time, except a cached block kernel's
// width where it is compiled in (WIDTH, below).
#pragma once
#include "softmax_parts.cuh"

namespace cukern {

#define CUKERN_LAYOUT_ARGS(p) i64 p##_outer, i64 p##_inner, i64 p##_col
#define CUKERN_LAYOUT(p) Layout<STRIDED>{p##_outer, p##_inner, p##_col, inner}

// ---------------------------------------------------------------------------------------------
// Warp kernel. Block (width, 128 / width); thread group y owns RPA rows at a time; lane l of the
// group holds packs p at columns (p * width + l) * PACK, so a group's accesses are coalesced.
// Every pack is guarded (col < cols); slots past the end of the row hold -inf. The row loop is
// uniform across the block, so every lane reaches every shuffle.
template <typename T, int ALGO, bool STRIDED, int PACK, int CPT, int RPA, bool SHIFT = false>
__global__ void __launch_bounds__(128)
softmax_warp(const T* x, T* y, i64 rows, int cols, i64 inner, CUKERN_LAYOUT_ARGS(xs),
             CUKERN_LAYOUT_ARGS(ys)) {
  typedef typename Num<T>::compute C;
  static_assert(CPT % PACK == 0, "cols_per_thread must be a multiple of pack_size");
  constexpr int NP = CPT / PACK;
  const auto ld = view_in<T, C, STRIDED, SHIFT>(x, CUKERN_LAYOUT(xs), cols, -Math<C>::inf());
  const auto st = view_out<C, T, STRIDED, SHIFT>(y, CUKERN_LAYOUT(ys), cols);
  const int vcols = SHIFT ? row_packs<PACK, SHIFT>(cols) * PACK : cols;  // on its packs' grid
  // a row of more than one pack a lane takes the whole warp (the planner's rule): a constant
  // width makes each pack's column offset an immediate (fewer registers)
  if (NP > 1 && blockDim.x != 32) __trap();
  const i64 step = static_cast<i64>(gridDim.x) * blockDim.y * RPA;
  const int lane = threadIdx.x;
  with_group_width<NP>([&](const int width) __attribute__((always_inline)) {
    for (i64 base = static_cast<i64>(blockIdx.x) * blockDim.y * RPA; base < rows; base += step) {
      const i64 row0 = base + static_cast<i64>(threadIdx.y) * RPA;
      C buf[RPA][CPT];
      Maxes<C, RPA> m;
      // Every pack of every row loaded before any is used, and unconditionally: a row past the
      // end reads the last row (never stored), a column past the end column 0's pack, whose
      // copies leave the row's max as it is and whose exponentials are left out of the sum one
      // pack at a time (not each value replaced by -inf: 16 selects a warp's two rows of
      // bfloat16 packs). Guarded, the loads of the log-softmax's rows compiled to branches, and
      // the first max of one row waited for its loads before the next row's were issued. One
      // row a pass keeps the guarded loads (no such wait; held raw, many small packs took up to
      // three times the registers), and so does double (spills).
      // Shifted float rows of 32 values a lane (SHIFT) take it too: their masks waited for the
      // first loads before the last ones were issued (H200, 1001 columns: 77.8 -> 98.4% of
      // copy); float at 16 values a lane and 16-bit at 32 ran 10-13 points slower with it
      // (more registers, fewer warps).
      constexpr bool CLAMPED =
          (RPA > 1 || (SHIFT && sizeof(T) == 4 && CPT == 32)) && sizeof(T) < 8;
      if constexpr (CLAMPED) {
        Pack<T, PACK> raw[RPA][NP];
#pragma unroll
        for (int r = 0; r < RPA; ++r) {
          const auto lr = ld.from_row(min(row0 + r, rows - 1));
#pragma unroll
          for (int p = 0; p < NP; ++p) {
            const int col = (p * width + lane) * PACK;
            raw[r][p] = lr.template raw<PACK, false>(0, col < vcols ? col : 0);
          }
        }
#pragma unroll
        for (int r = 0; r < RPA; ++r) {
#pragma unroll
          for (int p = 0; p < NP; ++p) {
#pragma unroll
            for (int i = 0; i < PACK; ++i) buf[r][p * PACK + i] = pack_value(raw[r][p], i);
          }
        }
      } else {
#pragma unroll
        for (int r = 0; r < RPA; ++r) {
          const auto lr = ld.from_row(row0 + r);
#pragma unroll
          for (int p = 0; p < NP; ++p) {
            const int col = (p * width + lane) * PACK;
            if (row0 + r < rows && col < vcols) {
              lr.template load<PACK, false>(buf[r] + p * PACK, 0, col);
            } else {
#pragma unroll
              for (int i = 0; i < PACK; ++i) buf[r][p * PACK + i] = -Math<C>::inf();
            }
          }
        }
      }
      if constexpr (SHIFT) {  // after every load: the other rows' elements of the end packs
#pragma unroll
        for (int r = 0; r < RPA; ++r) {
          mask_lane_packs<NP, PACK>(ld.from_row(min(row0 + r, rows - 1)).win, width, lane,
                                    -Math<C>::inf(), buf[r]);
        }
      }
#pragma unroll
      for (int r = 0; r < RPA; ++r) {
        m.v[r] = -Math<C>::inf();
#pragma unroll
        for (int i = 0; i < CPT; ++i) m.v[r] = max_nan(m.v[r], buf[r][i]);
      }
      m = allreduce_row(m, width);
      Sums<C, RPA> s;
#pragma unroll
      for (int r = 0; r < RPA; ++r) {
        s.v[r] = C(0);
#pragma unroll
        for (int p = 0; p < NP; ++p) {
          C acc = CLAMPED ? C(0) : s.v[r];  // clamped: the pack's sum, kept if in the row
#pragma unroll
          for (int i = p * PACK; i < (p + 1) * PACK; ++i) {
            if (ALGO == kSoftmax) {
              buf[r][i] = Num<T>::exp(buf[r][i] - m.v[r]);
              acc += buf[r][i];
            } else {
              buf[r][i] -= m.v[r];
              acc += Num<T>::exp(buf[r][i]);
            }
          }
          s.v[r] = !CLAMPED ? acc : (p * width + lane) * PACK < vcols ? s.v[r] + acc : s.v[r];
        }
      }
      s = allreduce_row(s, width);
#pragma unroll
      for (int r = 0; r < RPA; ++r) {
        if (row0 + r >= rows) continue;
        const C rc = row_constant<ALGO>(s.v[r]);
        store_lane_packs<NP, PACK, C>(st.from_row(row0 + r), 0, width, lane, vcols, [&](int j) {
          return ALGO == kSoftmax ? buf[r][j] * rc : buf[r][j] - rc;
        });
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Block kernels: one block per row (grid-stride over rows), any block size that is a multiple
// of 32. Thread t handles packs t, t + blockDim.x, ... in every pass, so the shared-memory cache
// needs no barrier of its own. The first pass keeps an online (max, sum) state, so the row is
// read from memory once.

// The online (max, sum) of packs [0, num_packs) of a row, read from global memory.
template <int PACK, typename T, typename C, bool STRIDED, bool SHIFT>
__device__ __forceinline__ MaxSum<C> softmax_scan(const Load<T, C, STRIDED, SHIFT>& ld, i64 row,
                                                  int num_packs) {
  constexpr int U = 4;  // packs in flight per thread
  const int stride = blockDim.x;
  const auto lr = ld.from_row(row);
  MaxSum<C> acc = MaxSum<C>::identity();
  int p = threadIdx.x;
  for (; p + (U - 1) * stride < num_packs; p += U * stride) {
    Pack<T, PACK> v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = lr.template raw<PACK, false>(0, (p + u * stride) * PACK);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      C c[PACK];
#pragma unroll
      for (int i = 0; i < PACK; ++i) c[i] = pack_value(v[u], i);
      lr.win.template mask<PACK>(c, (p + u * stride) * PACK, -Math<C>::inf());
      acc.template add<PACK>(c);
    }
  }
  for (; p < num_packs; p += stride) {
    C c[PACK];
    lr.template load<PACK>(c, 0, p * PACK);
    acc.template add<PACK>(c);
  }
  return acc;
}

template <typename T, int ALGO, bool STRIDED, int PACK, bool SHIFT = false>
__global__ void __launch_bounds__(1024)
softmax_block_uncached(const T* x, T* y, i64 rows, int cols, i64 inner, CUKERN_LAYOUT_ARGS(xs),
                       CUKERN_LAYOUT_ARGS(ys)) {
  typedef typename Num<T>::compute C;
  const auto ld = view_in<T, C, STRIDED, SHIFT>(x, CUKERN_LAYOUT(xs), cols, -Math<C>::inf());
  const auto st = view_out<C, T, STRIDED, SHIFT>(y, CUKERN_LAYOUT(ys), cols);
  const int num_packs = row_packs<PACK, SHIFT>(cols);
  unsigned phase = 0;  // allreduce_block's buffer phase
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const MaxSum<C> ms = allreduce_block(softmax_scan<PACK>(ld, row, num_packs), phase);
    const C rc = row_constant<ALGO>(ms.d);
    const auto lr = ld.from_row(row);
    const auto sr = st.from_row(row);
    for (int p = threadIdx.x; p < num_packs; p += blockDim.x) {
      C v[PACK];
      lr.template load<PACK, false>(v, 0, p * PACK);  // SHIFT: the other rows' not stored
#pragma unroll
      for (int i = 0; i < PACK; ++i) v[i] = softmax_out<ALGO, T>(v[i], ms.m, rc);
      sr.template store<PACK>(v, 0, p * PACK);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Cached kernels: a block, or each block of a cluster, keeps packs [p0, p1) of the row in shared
// memory in the storage type. Thread t owns packs p0 + t, p0 + t + blockDim.x, ... in every
// pass, so the cache needs no barrier of its own. Each block (or cluster) loops over rows.
// `reduce`: BlockReduce, or ClusterReduce over the cluster (cluster.cuh).

// Pass 1 for one row: its packs [p0, p1) into shared memory; returns this thread's online
// (max, sum) state.
template <int PACK, bool HOLD, int WIDTH, typename T, typename C, bool STRIDED, bool SHIFT>
__device__ __forceinline__ MaxSum<C> softmax_fill(const Load<T, C, STRIDED, SHIFT>& ld,
                                                  Pack<T, PACK>* cache, i64 row, int p0, int p1) {
  constexpr int U = 4;  // packs in flight per thread (the planner: OpPolicy.load_round)
  const int stride = block_width<WIDTH>();
  const auto lr = held<HOLD>(ld.from_row(row));
  MaxSum<C> ms = MaxSum<C>::identity();
  // U packs a step, each guarded: a thread with fewer than U packs left still has all of them
  // in flight at once (a plain remainder loop would wait for each in turn).
  for (int p = p0 + threadIdx.x; p < p1; p += U * stride) {
    Pack<T, PACK> v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (p + u * stride < p1) v[u] = pack_at<PACK, HOLD>(lr, p + u * stride);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (p + u * stride >= p1) break;
      cache[p - p0 + u * stride].word = v[u].word;
      C c[PACK];
#pragma unroll
      for (int i = 0; i < PACK; ++i) c[i] = pack_value(v[u], i);
      lr.win.template mask<PACK>(c, (p + u * stride) * PACK, -Math<C>::inf());
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
template <int ALGO, int PACK, bool HOLD, int WIDTH, typename T, typename C, bool STRIDED,
          bool SHIFT, typename Reduce>
__device__ __forceinline__ void softmax_cached(const Load<T, C, STRIDED, SHIFT>& ld,
                                               const Store<C, T, STRIDED, SHIFT>& st, i64 rows,
                                               i64 row,
                                               i64 row_step, int p0, int p1, Reduce reduce) {
  typedef Pack<T, PACK> P;
  constexpr int U = 4;
  const int stride = block_width<WIDTH>();
  P* const cache = dynamic_smem<P>();
  if (row >= rows) return;  // uniform across the block (and the cluster)
  MaxSum<C> ms = softmax_fill<PACK, HOLD, WIDTH>(ld, cache, row, p0, p1);
  for (;;) {
    const i64 next = row + row_step;
    const bool more = next < rows;  // uniform
    ms = reduce(ms, !more);
    const C m = ms.m, rc = row_constant<ALGO>(ms.d);
    const auto ln = held<HOLD>(ld.from_row(next));
    const auto sr = held<HOLD>(st.from_row(row));
    MaxSum<C> ms_next = MaxSum<C>::identity();
    for (int p = p0 + threadIdx.x; p < p1; p += U * stride) {
      P nv[U];
      if (more) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (p + u * stride < p1) nv[u] = pack_at<PACK, HOLD>(ln, p + u * stride);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (p + u * stride >= p1) break;
        const P v = cache[p - p0 + u * stride];
        C out[PACK];
#pragma unroll
        for (int i = 0; i < PACK; ++i) out[i] = softmax_out<ALGO, T>(pack_value(v, i), m, rc);
        store_pack<PACK, HOLD>(sr, p + u * stride, out);
      }
      if (more) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (p + u * stride >= p1) break;
          cache[p - p0 + u * stride].word = nv[u].word;
          C c[PACK];
#pragma unroll
          for (int i = 0; i < PACK; ++i) c[i] = pack_value(nv[u], i);
          ln.win.template mask<PACK>(c, (p + u * stride) * PACK, -Math<C>::inf());
          ms_next.template add<PACK>(c);
        }
      }
    }
    if (!more) {
      reduce.finish();  // after the stores: no block exits while a peer reads its state
      return;
    }
    row = next;
    ms = ms_next;
  }
}

template <typename T, int ALGO, bool STRIDED, int PACK, int WIDTH, bool SHIFT = false>
__global__ void __maxnreg__((WidthRegs<WIDTH, CachedRegs<T, PACK, false, SHIFT>::value>::value))
softmax_block_smem(const T* x, T* y, i64 rows, int cols, i64 inner, CUKERN_LAYOUT_ARGS(xs),
                   CUKERN_LAYOUT_ARGS(ys)) {
  typedef typename Num<T>::compute C;
  softmax_cached<ALGO, PACK, CachedRegs<T, PACK, false, SHIFT>::kHold, WIDTH>(
      view_in<T, C, STRIDED, SHIFT>(x, CUKERN_LAYOUT(xs), cols, -Math<C>::inf()),
      view_out<C, T, STRIDED, SHIFT>(y, CUKERN_LAYOUT(ys), cols), rows, blockIdx.x, gridDim.x,
      0, row_packs<PACK, SHIFT>(cols), BlockReduce<true>());
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // clusters: sm_90 and newer
template <typename T, int ALGO, int PACK, int CLUSTER, bool SHIFT = false>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __maxnreg__((CachedRegs<T, PACK, true>::value))
softmax_cluster(const T* x, T* y, i64 rows, int cols, i64 inner, CUKERN_LAYOUT_ARGS(xs),
                CUKERN_LAYOUT_ARGS(ys)) {
  constexpr bool STRIDED = false;
  typedef typename Num<T>::compute C;
  int p0, p1;
  cluster_pack_range(row_packs<PACK, SHIFT>(cols), CLUSTER, cluster_rank(), p0, p1);
  softmax_cached<ALGO, PACK, CachedRegs<T, PACK, true>::kHold, 0>(
      view_in<T, C, STRIDED, SHIFT>(x, CUKERN_LAYOUT(xs), cols, -Math<C>::inf()),
      view_out<C, T, STRIDED, SHIFT>(y, CUKERN_LAYOUT(ys), cols), rows, blockIdx.x / CLUSTER,
      gridDim.x / CLUSTER, p0, p1, ClusterReduce<CLUSTER, sizeof(MaxSum<C>)>());
}
#endif

// ---------------------------------------------------------------------------------------------
// Backward: dx from y and dy (softmax: dx = (dy - sum(dy * y)) * y;
// log-softmax: dx = dy - exp(y) * sum(dy)).

template <typename T, int ALGO, bool STRIDED, int PACK, int CPT, int RPA, bool SHIFT = false>
__global__ void __launch_bounds__(128)
softmax_grad_warp(const T* y, const T* dy, T* dx, i64 rows, int cols, i64 inner,
                  CUKERN_LAYOUT_ARGS(ys), CUKERN_LAYOUT_ARGS(dys), CUKERN_LAYOUT_ARGS(dxs)) {
  typedef typename Num<T>::compute C;
  static_assert(CPT % PACK == 0, "cols_per_thread must be a multiple of pack_size");
  constexpr int NP = CPT / PACK;
  const auto ld_y = view_in<T, C, STRIDED, SHIFT>(y, CUKERN_LAYOUT(ys), cols, C(0));
  const auto ld_dy = view_in<T, C, STRIDED, SHIFT>(dy, CUKERN_LAYOUT(dys), cols, C(0));
  const auto st = view_out<C, T, STRIDED, SHIFT>(dx, CUKERN_LAYOUT(dxs), cols);
  const int vcols = SHIFT ? row_packs<PACK, SHIFT>(cols) * PACK : cols;  // on its packs' grid
  // a row of more than one pack a lane takes the whole warp (the planner's rule): a constant
  // width makes each pack's column offset an immediate (fewer registers)
  if (NP > 1 && blockDim.x != 32) __trap();
  const i64 step = static_cast<i64>(gridDim.x) * blockDim.y * RPA;
  const int lane = threadIdx.x;
  with_group_width<NP>([&](const int width) __attribute__((always_inline)) {
    for (i64 base = static_cast<i64>(blockIdx.x) * blockDim.y * RPA; base < rows; base += step) {
      const i64 row0 = base + static_cast<i64>(threadIdx.y) * RPA;
      C yb[RPA][CPT], db[RPA][CPT];
      Sums<C, RPA> s;
      // Shifted 16-bit rows (SHIFT) take it too (H200, float16 1001 columns: 67.2 -> 101.8% of
      // copy; float 102.0 -> 89.9, which keeps the guarded loads).
      if constexpr ((RPA > 1 || (SHIFT && sizeof(T) == 2)) && PACK * sizeof(T) == 16 &&
                    sizeof(T) < 8) {
        // As in softmax_warp: every load issued, unconditionally, before any is used (0 past the
        // end). One row a pass, packs under 16 bytes and double keep the guarded loads: there,
        // unconditional loads of the log-softmax's y (not in its sum) were issued after the first
        // adds of dy, or sunk past the all-reduce into the stores' branch.
        Pack<T, PACK> ry[RPA][NP], rdy[RPA][NP];
#pragma unroll
        for (int r = 0; r < RPA; ++r) {
          const i64 row = min(row0 + r, rows - 1);
          const auto ly = ld_y.from_row(row), ldy = ld_dy.from_row(row);
#pragma unroll
          for (int p = 0; p < NP; ++p) {
            const int col = (p * width + lane) * PACK, c = col < vcols ? col : 0;
            ry[r][p] = ly.template raw<PACK, false>(0, c);
            rdy[r][p] = ldy.template raw<PACK, false>(0, c);
          }
        }
#pragma unroll
        for (int r = 0; r < RPA; ++r) {
#pragma unroll
          for (int p = 0; p < NP; ++p) {
            const bool ok = row0 + r < rows && (p * width + lane) * PACK < vcols;
#pragma unroll
            for (int i = 0; i < PACK; ++i) {
              yb[r][p * PACK + i] = ok ? pack_value(ry[r][p], i) : C(0);
              db[r][p * PACK + i] = ok ? pack_value(rdy[r][p], i) : C(0);
            }
          }
        }
      } else {
#pragma unroll
        for (int r = 0; r < RPA; ++r) {
          const auto ly = ld_y.from_row(row0 + r), ldy = ld_dy.from_row(row0 + r);
#pragma unroll
          for (int p = 0; p < NP; ++p) {
            const int col = (p * width + lane) * PACK;
            if (row0 + r < rows && col < vcols) {
              ly.template load<PACK, false>(yb[r] + p * PACK, 0, col);
              ldy.template load<PACK, false>(db[r] + p * PACK, 0, col);
            } else {
#pragma unroll
              for (int i = 0; i < PACK; ++i) yb[r][p * PACK + i] = db[r][p * PACK + i] = C(0);
            }
          }
        }
      }
      if constexpr (SHIFT) {  // after every load: the other rows' elements of the end packs
#pragma unroll
        for (int r = 0; r < RPA; ++r) {
          const auto w = ld_y.from_row(min(row0 + r, rows - 1)).win;
#pragma unroll
          for (int p = 0; p < NP; ++p) {
            w.template mask<PACK>(yb[r] + p * PACK, (p * width + lane) * PACK, C(0));
            w.template mask<PACK>(db[r] + p * PACK, (p * width + lane) * PACK, C(0));
          }
        }
      }
#pragma unroll
      for (int r = 0; r < RPA; ++r) {
        s.v[r] = C(0);
#pragma unroll
        for (int i = 0; i < CPT; ++i) s.v[r] += grad_term<ALGO>(yb[r][i], db[r][i]);
      }
      s = allreduce_row(s, width);
#pragma unroll
      for (int r = 0; r < RPA; ++r) {
        if (row0 + r >= rows) continue;
        store_lane_packs<NP, PACK, C>(st.from_row(row0 + r), 0, width, lane, vcols, [&](int j) {
          return grad_out<ALGO, T>(yb[r][j], db[r][j], s.v[r]);
        });
      }
    }
  });
}

// The cached backward's two steps on a pack: keep the pair (y, dy) in shared memory slot i and
// add its grad terms to s (the values of pack index q; SHIFT: those of its row, win); write dx
// of the pair held in slot i (row sum s).
template <int ALGO, int PACK, typename T, typename C, typename W>
__device__ __forceinline__ void grad_cache_pair(Pack<T, PACK>* cache_y, Pack<T, PACK>* cache_dy,
                                                int i, const Pack<T, PACK>& a,
                                                const Pack<T, PACK>& b, C& s, const W& win,
                                                int q) {
  cache_y[i].word = a.word;
  cache_dy[i].word = b.word;
  if constexpr (W::kActive) {
    C va[PACK], vb[PACK];
#pragma unroll
    for (int k = 0; k < PACK; ++k) {
      va[k] = pack_value(a, k);
      vb[k] = pack_value(b, k);
    }
    win.template mask<PACK>(va, q * PACK, C(0));
    win.template mask<PACK>(vb, q * PACK, C(0));
#pragma unroll
    for (int k = 0; k < PACK; ++k) s += grad_term<ALGO>(va[k], vb[k]);
  } else {
#pragma unroll
    for (int k = 0; k < PACK; ++k) s += grad_term<ALGO>(pack_value(a, k), pack_value(b, k));
  }
}
template <int ALGO, int PACK, bool HOLD, typename T, typename C, bool STRIDED, bool SHIFT>
__device__ __forceinline__ void grad_store_pair(const Store<C, T, STRIDED, SHIFT>& sr,
                                                const Pack<T, PACK>* cache_y,
                                                const Pack<T, PACK>* cache_dy, int i, int p, C s) {
  const Pack<T, PACK> a = cache_y[i], b = cache_dy[i];
  C out[PACK];
#pragma unroll
  for (int k = 0; k < PACK; ++k) out[k] = grad_out<ALGO, T>(pack_value(a, k), pack_value(b, k), s);
  store_pack<PACK, HOLD>(sr, p, out);
}

// Pass 1 for one row of the backward: y and dy packs [p0, p1) into shared memory; returns this
// thread's part of the row sum of grad_term.
template <int ALGO, int PACK, int WIDTH, typename T, typename C, bool STRIDED, bool SHIFT>
__device__ __forceinline__ C softmax_grad_fill(const Load<T, C, STRIDED, SHIFT>& ld_y,
                                               const Load<T, C, STRIDED, SHIFT>& ld_dy,
                                               Pack<T, PACK>* cache_y, Pack<T, PACK>* cache_dy,
                                               i64 row, int p0, int p1) {
  constexpr int U = 2;  // pairs of packs in flight per thread
  const int stride = block_width<WIDTH>();
  const auto ly = held<kGradHold<T>>(ld_y.from_row(row));
  const auto ldy = held<kGradHold<T>>(ld_dy.from_row(row));
  C s = C(0);
  int p = p0 + threadIdx.x;
  for (; p + (U - 1) * stride < p1; p += U * stride) {
    Pack<T, PACK> a[U], b[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      a[u] = pack_at<PACK, kGradHold<T>>(ly, p + u * stride);
      b[u] = pack_at<PACK, kGradHold<T>>(ldy, p + u * stride);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      grad_cache_pair<ALGO>(cache_y, cache_dy, p - p0 + u * stride, a[u], b[u], s, ly.win,
                            p + u * stride);
    }
  }
  for (; p < p1; p += stride) {
    const Pack<T, PACK> a = pack_at<PACK, kGradHold<T>>(ly, p);
    const Pack<T, PACK> b = pack_at<PACK, kGradHold<T>>(ldy, p);
    grad_cache_pair<ALGO>(cache_y, cache_dy, p - p0, a, b, s, ly.win, p);
  }
  return s;
}

// Cached backward over rows row, row + row_step, ...: y then dy of packs [p0, p1) in shared
// memory (`slice` packs apart). As in the forward, writing dx of one row and reading the next
// row run as one loop.
template <int ALGO, int PACK, int WIDTH, typename T, typename C, bool STRIDED, bool SHIFT,
          typename Reduce>
__device__ __forceinline__ void softmax_grad_cached(const Load<T, C, STRIDED, SHIFT>& ld_y,
                                                    const Load<T, C, STRIDED, SHIFT>& ld_dy,
                                                    const Store<C, T, STRIDED, SHIFT>& st, i64 rows,
                                                    i64 row, i64 row_step, int p0, int p1,
                                                    int slice, Reduce reduce) {
  typedef Pack<T, PACK> P;
  constexpr int U = 2;
  const int stride = block_width<WIDTH>();
  P* const cache_y = dynamic_smem<P>();
  P* const cache_dy = cache_y + slice;
  if (row >= rows) return;  // uniform across the block (and the cluster)
  C s = softmax_grad_fill<ALGO, PACK, WIDTH>(ld_y, ld_dy, cache_y, cache_dy, row, p0, p1);
  for (;;) {
    const i64 next = row + row_step;
    const bool more = next < rows;  // uniform
    s = reduce(Sums<C, 1>{{s}}, !more).v[0];
    const auto ny = held<kGradHold<T>>(ld_y.from_row(next));
    const auto ndy = held<kGradHold<T>>(ld_dy.from_row(next));
    const auto sr = held<kGradHold<T>>(st.from_row(row));
    C s_next = C(0);
    int p = p0 + threadIdx.x;
    for (; p + (U - 1) * stride < p1; p += U * stride) {
      P na[U], nb[U];
      if (more) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          na[u] = pack_at<PACK, kGradHold<T>>(ny, p + u * stride);
          nb[u] = pack_at<PACK, kGradHold<T>>(ndy, p + u * stride);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        grad_store_pair<ALGO, PACK, kGradHold<T>>(sr, cache_y, cache_dy, p - p0 + u * stride,
                                                  p + u * stride, s);
      }
      if (more) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          grad_cache_pair<ALGO>(cache_y, cache_dy, p - p0 + u * stride, na[u], nb[u], s_next,
                                ny.win, p + u * stride);
        }
      }
    }
    for (; p < p1; p += stride) {
      P na, nb;
      if (more) {
        na = pack_at<PACK, kGradHold<T>>(ny, p);
        nb = pack_at<PACK, kGradHold<T>>(ndy, p);
      }
      grad_store_pair<ALGO, PACK, kGradHold<T>>(sr, cache_y, cache_dy, p - p0, p, s);
      if (more) grad_cache_pair<ALGO>(cache_y, cache_dy, p - p0, na, nb, s_next, ny.win, p);
    }
    if (!more) {
      reduce.finish();  // after the stores: no block exits while a peer reads its state
      return;
    }
    row = next;
    s = s_next;
  }
}

// The all-reduce's buffers are static for float compute (at the dynamic tail they cost bfloat16
// rows of 32768 columns 1.1-1.3 points of copy), at the tail for double (plan.rowwise's tail).
template <typename T, int ALGO, bool STRIDED, int PACK, int WIDTH, bool SHIFT = false>
__global__ void __launch_bounds__(WIDTH ? WIDTH : 1024)
softmax_grad_block_smem(const T* y, const T* dy, T* dx, i64 rows, int cols, i64 inner,
                        CUKERN_LAYOUT_ARGS(ys), CUKERN_LAYOUT_ARGS(dys),
                        CUKERN_LAYOUT_ARGS(dxs)) {
  typedef typename Num<T>::compute C;
  const int num_packs = row_packs<PACK, SHIFT>(cols);
  softmax_grad_cached<ALGO, PACK, WIDTH>(
      view_in<T, C, STRIDED, SHIFT>(y, CUKERN_LAYOUT(ys), cols, C(0)),
      view_in<T, C, STRIDED, SHIFT>(dy, CUKERN_LAYOUT(dys), cols, C(0)),
      view_out<C, T, STRIDED, SHIFT>(dx, CUKERN_LAYOUT(dxs), cols), rows, blockIdx.x, gridDim.x,
      0, num_packs, num_packs, BlockReduce<(sizeof(C) > 4)>());
}

// The sum of grad_term over packs [0, num_packs), read from global memory (the uncached kernel).
template <int ALGO, int PACK, typename T, typename C, bool STRIDED, bool SHIFT>
__device__ __forceinline__ C softmax_grad_scan(const Load<T, C, STRIDED, SHIFT>& ld_y,
                                               const Load<T, C, STRIDED, SHIFT>& ld_dy, i64 row,
                                               int num_packs) {
  constexpr int U = 2;
  const int stride = blockDim.x;
  const auto ly = ld_y.from_row(row), ldy = ld_dy.from_row(row);
  C acc = C(0);
  int p = threadIdx.x;
  for (; p + (U - 1) * stride < num_packs; p += U * stride) {
    Pack<T, PACK> a[U], b[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      a[u] = ly.template raw<PACK, false>(0, (p + u * stride) * PACK);
      b[u] = ldy.template raw<PACK, false>(0, (p + u * stride) * PACK);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if constexpr (SHIFT) {
        C va[PACK], vb[PACK];
#pragma unroll
        for (int i = 0; i < PACK; ++i) {
          va[i] = pack_value(a[u], i);
          vb[i] = pack_value(b[u], i);
        }
        ly.win.template mask<PACK>(va, (p + u * stride) * PACK, C(0));
        ly.win.template mask<PACK>(vb, (p + u * stride) * PACK, C(0));
#pragma unroll
        for (int i = 0; i < PACK; ++i) acc += grad_term<ALGO>(va[i], vb[i]);
      } else {
#pragma unroll
        for (int i = 0; i < PACK; ++i) {
          acc += grad_term<ALGO>(pack_value(a[u], i), pack_value(b[u], i));
        }
      }
    }
  }
  for (; p < num_packs; p += stride) {
    const Pack<T, PACK> a = ly.template raw<PACK>(0, p * PACK);
    const Pack<T, PACK> b = ldy.template raw<PACK>(0, p * PACK);
#pragma unroll
    for (int i = 0; i < PACK; ++i) acc += grad_term<ALGO>(pack_value(a, i), pack_value(b, i));
  }
  return acc;
}

template <typename T, int ALGO, bool STRIDED, int PACK, bool SHIFT = false>
__global__ void __launch_bounds__(1024)
softmax_grad_block_uncached(const T* y, const T* dy, T* dx, i64 rows, int cols, i64 inner,
                            CUKERN_LAYOUT_ARGS(ys), CUKERN_LAYOUT_ARGS(dys),
                            CUKERN_LAYOUT_ARGS(dxs)) {
  typedef typename Num<T>::compute C;
  const auto ld_y = view_in<T, C, STRIDED, SHIFT>(y, CUKERN_LAYOUT(ys), cols, C(0));
  const auto ld_dy = view_in<T, C, STRIDED, SHIFT>(dy, CUKERN_LAYOUT(dys), cols, C(0));
  const auto st = view_out<C, T, STRIDED, SHIFT>(dx, CUKERN_LAYOUT(dxs), cols);
  const int num_packs = row_packs<PACK, SHIFT>(cols);
  unsigned phase = 0;  // allreduce_block's buffer phase
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const C s = allreduce_block(
        Sums<C, 1>{{softmax_grad_scan<ALGO, PACK>(ld_y, ld_dy, row, num_packs)}}, phase).v[0];
    const auto ly = ld_y.from_row(row), ldy = ld_dy.from_row(row);
    const auto sr = st.from_row(row);
    for (int p = threadIdx.x; p < num_packs; p += blockDim.x) {
      C a[PACK], b[PACK];
      ly.template load<PACK, false>(a, 0, p * PACK);  // SHIFT: the other rows' not stored
      ldy.template load<PACK, false>(b, 0, p * PACK);
#pragma unroll
      for (int i = 0; i < PACK; ++i) a[i] = grad_out<ALGO, T>(a[i], b[i], s);
      sr.template store<PACK>(a, 0, p * PACK);
    }
  }
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // clusters: sm_90 and newer
template <typename T, int ALGO, int PACK, int CLUSTER, bool SHIFT = false>
__global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(1024)
softmax_grad_cluster(const T* y, const T* dy, T* dx, i64 rows, int cols, i64 inner,
                     CUKERN_LAYOUT_ARGS(ys), CUKERN_LAYOUT_ARGS(dys), CUKERN_LAYOUT_ARGS(dxs)) {
  constexpr bool STRIDED = false;
  typedef typename Num<T>::compute C;
  const int num_packs = row_packs<PACK, SHIFT>(cols);
  int p0, p1;
  cluster_pack_range(num_packs, CLUSTER, cluster_rank(), p0, p1);
  softmax_grad_cached<ALGO, PACK, 0>(
      view_in<T, C, STRIDED, SHIFT>(y, CUKERN_LAYOUT(ys), cols, C(0)),
      view_in<T, C, STRIDED, SHIFT>(dy, CUKERN_LAYOUT(dys), cols, C(0)),
      view_out<C, T, STRIDED, SHIFT>(dx, CUKERN_LAYOUT(dxs), cols), rows, blockIdx.x / CLUSTER,
      gridDim.x / CLUSTER, p0, p1, (num_packs + CLUSTER - 1) / CLUSTER,
      ClusterReduce<CLUSTER, sizeof(Sums<C, 1>)>());
}
#endif

#undef CUKERN_LAYOUT
#undef CUKERN_LAYOUT_ARGS

}  // namespace cukern

// Layer norm and RMS norm forward (norm.cuh: the formulas and what the kernels share).
//
// Variants, chosen by the planner (cukern/plan/):
//   *_warp            a group of blockDim.x lanes owns a row held in registers (cols <= 1024)
//   *_block_smem      one block per row, the row cached in shared memory in its storage type
//   *_cluster         a cluster of CLUSTER blocks per row (sm_90), each caching a slice
//   *_cluster_dyn     the same with the cluster's size set at launch (packs under 16 bytes)
//   *_block_uncached  one block per row, the row read again from global memory
#pragma once
#include "layer_norm_parts.cuh"

namespace cukern {

// ---------------------------------------------------------------------------------------------
// Forward. mean and rstd may be null (not wanted); gamma and beta may be null (absent) for the
// warp and block kernels, and are read by a cluster kernel only with its WEIGHT and BIAS (see
// AffineStore); res and h are read or written only with RESIDUAL. sx, sr, sy, sh: row strides
// of x, residual, y, h.
#define CUKERN_NORM_FWD_PARAMS(P)                                                              \
  const T *x, const T *res, const P *gamma, const P *beta, T *y, T *h,                         \
      typename Num<T>::compute *mean, typename Num<T>::compute *rstd,                          \
      typename Num<T>::compute eps, i64 rows, int cols, i64 sx, i64 sr, i64 sy, i64 sh
#define CUKERN_NORM_FWD_ARGS x, res, gamma, beta, y, h, mean, rstd, eps, rows, cols, sx, sr, sy, sh

// W, B: how AffineStore has gamma and beta (kAbsent, kPresent, kRuntime); P: their type; SH:
// rows off the 16-byte grid in 16-byte packs of memory (SHIFT).
#define CUKERN_NORM_FWD_SETUP(W, B, P, SH)                                                     \
  typedef typename Num<T>::compute C;                                                          \
  static_assert(ALGO == kLayerNorm || ALGO == kRMSNorm, "ALGO: 0 layer norm, 1 RMS norm");     \
  /* layer norm works on x - K; float and double data normalise (x - K) - mean' in two steps,   \
     half and bfloat16 data x - (K + mean') in one (norm.cuh) */                               \
  constexpr bool SHIFT_K = ALGO == kLayerNorm;                                                 \
  constexpr bool TWO_STEP = SHIFT_K && sizeof(T) >= 4;                                         \
  (void)TWO_STEP;                                                                              \
  unsigned phase = 0; /* allreduce_block's buffer phase */                                     \
  (void)phase;                                                                                 \
  const auto ld = norm_input<T, C, RESIDUAL, SH>(x, sx, res, sr, h, sh, cols);                 \
  static_assert(ALGO == kLayerNorm || (B) == kAbsent, "RMS norm has no bias");                \
  const auto st = norm_output<C, T, (W), (B), P, SH>(y, sy, gamma, beta, cols)

// Warp kernel. Block (width, 128 / width); thread group y owns RPA rows at a time; lane l holds
// packs p at columns (p * width + l) * PACK, so a group's accesses are coalesced. Slots past the
// end of the row (padding) hold 0 and are left out of the variance. The row loop is uniform
// across the block, so every lane reaches every shuffle. SHIFT (one row a group): columns of
// the row's packs of memory (vcols), the other rows' values masked out of both sums.
template <typename T, int ALGO, int PACK, int CPT, int RPA, bool RESIDUAL, int W, int B,
          bool SHIFT>
__device__ __forceinline__ void layer_norm_warp_rows(CUKERN_NORM_FWD_PARAMS(T)) {
  CUKERN_NORM_FWD_SETUP(W, B, T, SHIFT);
  static_assert(CPT % PACK == 0, "cols_per_thread must be a multiple of pack_size");
  static_assert(!SHIFT || RPA == 1, "SHIFT: one row a group");
  constexpr int NP = CPT / PACK;
  const int width = blockDim.x, lane = threadIdx.x;
  const C inv_cols = C(1) / C(cols);
  const int log_width = __ffs(width) - 1;
  const int vcols = SHIFT ? row_packs<PACK, SHIFT>(cols) * PACK : cols;  // on its packs' grid
  const i64 step = static_cast<i64>(gridDim.x) * blockDim.y * RPA;
  for (i64 base = static_cast<i64>(blockIdx.x) * blockDim.y * RPA; base < rows; base += step) {
    const i64 row0 = base + static_cast<i64>(threadIdx.y) * RPA;
    C buf[RPA][CPT];  // layer norm: x - K; RMS norm: x
    Sums<C, 1> s[RPA];
    C k[RPA], m[RPA];  // the shift K and the mean of x - K
    const auto lx = row_view<SHIFT>(ld, row0);  // SHIFT: row0's window
#pragma unroll
    for (int r = 0; r < RPA; ++r) {
      const bool valid = row0 + r < rows;
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        const int col = (p * width + lane) * PACK;
        if (valid && col < vcols) {
          lx.template load<PACK>(buf[r] + p * PACK, row_in_view<SHIFT>(row0 + r), col);
        } else {
#pragma unroll
          for (int i = 0; i < PACK; ++i) buf[r][p * PACK + i] = C(0);
        }
      }
      if constexpr (SHIFT) {
        k[r] = SHIFT_K ? warp_shift<PACK, CPT, true>(buf[r], cols, width, log_width, lx.win().lo)
                       : C(0);
        // after every load: the other rows' values K (0 once K is taken) or 0
        mask_lane_packs<NP, PACK>(lx.win(), width, lane, k[r], buf[r]);
      } else {
        k[r] = SHIFT_K ? warp_shift<PACK, CPT>(buf[r], cols, width, log_width) : C(0);
      }
      s[r].v[0] = C(0);
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        if ((p * width + lane) * PACK >= vcols) continue;  // padding stays 0
#pragma unroll
        for (int i = 0; i < PACK; ++i) {
          C& v = buf[r][p * PACK + i];
          if (SHIFT_K) v -= k[r];
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
        // the other rows' values: the mean, no deviation
        if constexpr (SHIFT) mask_lane_packs<NP, PACK>(lx.win(), width, lane, m[r], buf[r]);
        s[r].v[0] = C(0);
#pragma unroll
        for (int p = 0; p < NP; ++p) {
          if ((p * width + lane) * PACK >= vcols) continue;
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
    const auto sy = row_view<SHIFT>(st, row0);  // SHIFT: row0's window, gamma and beta to it
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      const int col = (p * width + lane) * PACK;
      if (col >= vcols) continue;
      C w[PACK], b[PACK];  // gamma and beta once for the RPA rows
      sy.template params<PACK>(w, b, col);
#pragma unroll
      for (int r = 0; r < RPA; ++r) {
        if (row0 + r >= rows) continue;
        C out[PACK];
#pragma unroll
        for (int i = 0; i < PACK; ++i) out[i] = (buf[r][p * PACK + i] - m[r]) * rs[r];
        sy.template store_with<PACK>(out, w, b, row_in_view<SHIFT>(row0 + r), col);
      }
    }
  }
}
template <typename T, int ALGO, int PACK, int CPT, int RPA, bool RESIDUAL, bool AFFINE,
          bool SHIFT = false>
__global__ void __launch_bounds__(128) layer_norm_warp(CUKERN_NORM_FWD_PARAMS(T)) {
  constexpr int W = AFFINE ? kPresent : kRuntime;
  layer_norm_warp_rows<T, ALGO, PACK, CPT, RPA, RESIDUAL, W, kBias<ALGO, W>, SHIFT>(
      CUKERN_NORM_FWD_ARGS);
}

// The rows loop of the cached forward kernels (block and cluster): packs [p0, p1) of R rows at
// a time (rows row .. row + R - 1, then `step` rows on), each row's slice cached in shared
// memory (row r's at smem + r * slice). Each thread sums the packs it caches; the block
// all-reduces the sums (RMS norm: across the cluster too). Layer norm then takes the exact
// squared deviations of the same cached values from the block's mean (no barrier: a thread
// reads back only what it wrote) and all-reduces them over the block: two all-reduces of one
// sum, cheaper than merging (count, mean, M2) states a shuffle. A cluster merges its blocks'
// (count, mean, M2) by Chan's formula once, in warp 0. The R rows share each all-reduce. Then y
// from the cache, each pack's gamma and beta loaded once for the R rows. x alone, in packs of at
// least 4 bytes, reaches the cache by asynchronous copies, all of a thread's packs in flight at
// once; x + residual (written to h as it is cached) by loads a pack at a time (scan_fetched:
// h's store keeps later loads behind it), K's loads in flight beside the first pack's.
//
// OVERLAP (the planner's choice; R = 1): each thread loads the next row U packs ahead into
// registers while it writes this row's y from the cache, and puts them in the slots it has just
// written out (its own: no barrier), summing as it goes. A block then keeps memory busy on its
// own, for some 20 more registers a thread. Measurements: docs/notes/kernels.md, "Forward norms".
//
// SHIFT (R = 1; rows off the 16-byte grid): packs [p0, p1) of the row's packs of memory (its
// window), cached whole; the other rows' values of its end packs count as K (0 once K is taken)
// or 0 in the sums and 0 in the squared deviations, and the block's count is of its own
// values. SHIFT_K: layer norm's shift K (norm.cuh).
template <int ALGO, bool SHIFT_K, bool TWO_STEP, bool RESIDUAL, bool OVERLAP, int PACK, int V,
          int R, bool SHIFT, typename T, typename C, typename Ld, typename St, typename Reduce>
__device__ __forceinline__ void norm_rows(T* smem, int slice, const Ld& ld, const St& st,
                                          const T* x, i64 sx, C* mean, C* rstd, C eps, i64 row,
                                          i64 rows, i64 step, int cols, int p0, int p1,
                                          bool writer, Reduce reduce) {
  static_assert(R >= 1 && (R == 1 || !OVERLAP), "R rows a pass: 1 with OVERLAP");
  static_assert(!SHIFT || R == 1, "SHIFT: one row a pass");
  constexpr bool ASYNC = !RESIDUAL && PACK * sizeof(T) >= 4;
  constexpr int U = RESIDUAL ? 2 : 4;  // packs of the next row in registers per thread
  const int stride = blockDim.x;
  if (row >= rows) return;  // uniform across the block (and the cluster)
  auto cache = [&](int r) { return SmemRow<T, C, PACK>{smem + r * slice}; };
  // whether the pass has row r (uniform across the block and the cluster)
  auto has = [&](int r) { return r == 0 || row + r < rows; };
  C k[R], s[R];  // each row's shift K (the same in every block) and this thread's sum
  // Block kernels over packs of 4 or more values load K's three values as one 4-value word (the
  // row's first pack is aligned): one load a thread where three cost layer norm float16 3.7
  // points of copy at 2048 columns on the H200.
  constexpr bool VECTOR_K = SHIFT_K && ASYNC && !Reduce::kCluster && PACK >= 4 && !SHIFT;
  // x + residual (not OVERLAP: its later rows load ahead on their own) through scan_fetched,
  // one pack at a time (two in flight took 7-20 more registers and ran 1-5 points slower)
  constexpr bool FETCHED = RESIDUAL && !OVERLAP;
  // SHIFT: the other rows' values of a row's end packs, as its first sums count them
  auto mask = [&](const Ld& lr, C* v, int col, C kr) {
    lr.win().template mask<PACK>(v, col, ALGO == kLayerNorm ? kr : C(0));
  };
  auto fill = [&]() {  // the pass's rows into the cache, and s
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const Ld lr = row_view<SHIFT>(ld, row + r);  // SHIFT: the row's window
      const i64 rr = row_in_view<SHIFT>(row + r);
      s[r] = C(0);
      if constexpr (VECTOR_K) {
        k[r] = C(0);
        if (has(r)) {
          const Pack<T, 4> q = {
              *reinterpret_cast<const typename Pack<T, 4>::word_t*>(x + (row + r) * sx)};
          k[r] = median3(pack_value(q, 0), pack_value(q, 1), pack_value(q, 2));
        }
      } else if constexpr (FETCHED) {
        k[r] = C(0);
      } else {
        k[r] = SHIFT_K && has(r) ? ld.shift(row + r, cols) : C(0);
      }
      if (!has(r)) continue;
      if constexpr (ASYNC) {
        if constexpr (SHIFT) {  // a pack past the row's last reads the last
          for (int p = p0 + threadIdx.x; p < p1; p += stride) {
            cp_async<PACK * sizeof(T)>(cache(r).base + (p - p0) * PACK,
                                       lr.x.ptr + min(p * PACK, lr.win().last));
          }
        } else {
          const T* src = x + (row + r) * sx;
          for (int p = p0 + threadIdx.x; p < p1; p += stride) {
            cp_async<PACK * sizeof(T)>(cache(r).base + (p - p0) * PACK, src + p * PACK);
          }
        }
      } else if constexpr (FETCHED) {
        // K's loads and the first packs' are in flight together (the median waits on both)
        const auto ks = ld.shift_fetch(row + r, cols);
        scan_fetched<C, PACK, 1>(
            lr, rr, p0, p1, [&]() { k[r] = SHIFT_K ? ld.shift_of(ks) : C(0); },
            [&](int p, const C* v) {
              if constexpr (SHIFT) {
                C u[PACK];
#pragma unroll
                for (int i = 0; i < PACK; ++i) u[i] = v[i];
                mask(lr, u, p * PACK, k[r]);
                cache(r).put(p - p0, u);
                add_pack<ALGO, T, PACK>(s[r], u, k[r]);
              } else {
                cache(r).put(p - p0, v);
                add_pack<ALGO, T, PACK>(s[r], v, k[r]);
              }
            });
      } else {
        scan_packs<C, PACK, PACK, 4>(lr, rr, p0, p1, [&](int p, C* v) {
          if constexpr (SHIFT) mask(lr, v, p * PACK, k[r]);
          cache(r).put(p - p0, v);
          add_pack<ALGO, T, PACK>(s[r], v, k[r]);
        });
      }
    }
    if constexpr (ASYNC) {
      cp_async_wait_all();
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (!has(r)) continue;
        const Ld lr = row_view<SHIFT>(ld, row + r);
        for (int p = p0 + threadIdx.x; p < p1; p += stride) {
          C v[PACK];
          cache(r).get(p - p0, v);
          if constexpr (SHIFT) mask(lr, v, p * PACK, k[r]);
          add_pack<ALGO, T, PACK>(s[r], v, k[r]);
        }
      }
    }
  };
  if (OVERLAP) fill();  // later rows arrive during the rows before them
  // While the cluster barrier of a row's merge is pending (`early`, between its arrive and its
  // wait), a cluster's blocks load ahead what the rows loop needs first, instead of waiting:
  // EARLY (one row a pass): their first V packs' gamma and beta. Clusters that OVERLAP rows:
  // EARLY_OVERLAP (float32) the gamma and beta of their first U packs, and PREFETCH the first
  // quarter of their slice of the next row (x and the residual) into L2. Which types and
  // fractions, with the numbers: docs/notes/kernels.md, "Forward norms".
  constexpr bool EARLY = !OVERLAP && Reduce::kCluster && R == 1;
  constexpr bool EARLY_OVERLAP = OVERLAP && Reduce::kCluster && sizeof(T) == 4;
  // (not float64: 8 more bytes of spills with the prefetch)
  constexpr bool PREFETCH =
      OVERLAP && Reduce::kCluster && sizeof(T) <= 4 && PACK * sizeof(T) == 16;
  typedef typename St::template Params<PACK> Par;
  const int first = p0 + static_cast<int>(threadIdx.x);  // this thread's first pack
  St sr = st;  // SHIFT: the pass's row's window of y, gamma and beta shifted to it
  auto fetch_params = [&](int p, Par* par, int n) {  // gamma and beta of n packs from pack p
#pragma unroll
    for (int u = 0; u < n; ++u) {
      if (p + u * stride >= p1) continue;
      if constexpr (SHIFT) {
        par[u] = sr.template fetch<PACK>((p + u * stride) * PACK);
      } else {
        par[u] = st.template fetch<PACK>((p + u * stride) * PACK);
      }
    }
  };
  // PREFETCH: the first quarter of this block's packs of row r, in spans of 4 KiB, one a
  // thread from warp 1 on (warp 0 reads the peers' states once the barrier completes)
  auto prefetch_quarter = [&](i64 r) {
    constexpr int SPAN = 4096 / (PACK * static_cast<int>(sizeof(T)));  // packs a prefetch
    const int packs = (p1 - p0) / 4;
    const Ld lr = row_view<SHIFT>(ld, r);
    for (int c = static_cast<int>(threadIdx.x) - 32; c >= 0 && c * SPAN < packs; c += stride) {
      lr.prefetch(row_in_view<SHIFT>(r), (p0 + c * SPAN) * PACK, min(SPAN, packs - c * SPAN) * PACK);
    }
  };
  for (;;) {
    Par par[V];
    Par ahead[EARLY_OVERLAP ? U : 1];  // EARLY_OVERLAP: the first U packs' gamma and beta
    if (!OVERLAP) fill();
    if constexpr (SHIFT) sr = st.from_row(row);
    const i64 next = row + step;
    const bool more = next < rows;  // uniform across the block (and the cluster)
    auto early = [&]() {  // while the cluster barrier is pending
      if (EARLY) fetch_params(first, par, V);
      if constexpr (EARLY_OVERLAP) fetch_params(first, ahead, U);
      if (PREFETCH && more) prefetch_quarter(next);
    };
    C m[R], rs[R];  // m: the mean of x - K
    if constexpr (ALGO == kLayerNorm) {
      // the block's exact mean, then the squared deviations from it: two all-reduces; a
      // cluster merges its blocks' (count, mean, M2) by Chan's formula
      const auto win = row_view<SHIFT>(ld, row).win();
      int count = (p1 - p0) * PACK;  // the row's values in the block's packs
      if constexpr (SHIFT) count = max(0, min(win.hi, p1 * PACK) - max(win.lo, p0 * PACK));
      const C n = C(count);
      Sums<C, R> sb, q;
#pragma unroll
      for (int r = 0; r < R; ++r) sb.v[r] = s[r];
      sb = reduce.block(sb);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        sb.v[r] = n > C(0) ? sb.v[r] / n : C(0);  // the block's mean
        q.v[r] = has(r) ? own_squares<PACK>(cache(r), Centre<C, TWO_STEP>{k[r], sb.v[r]}, p0, p1,
                                            win)
                        : C(0);
      }
      if constexpr (Reduce::kOneBuffer) __syncthreads();  // every thread has read sb's partials
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
      if constexpr (SHIFT) {
        sr.template store_fetched<PACK>(v, par, 0, q * PACK);
      } else {
        st.template store_fetched<PACK>(v, par, row + r, q * PACK);
      }
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
      const C k_next = SHIFT_K && more ? ld.shift(next, cols) : C(0);
      const Ld ln = row_view<SHIFT>(ld, next);  // SHIFT: the next row's window
      const i64 rn = row_in_view<SHIFT>(next);
      s[0] = C(0);
      for (int p = p0 + threadIdx.x; p < p1; p += U * stride) {
        typename Ld::template Raw<PACK> nv[U];
        if (more) {
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (p + u * stride < p1) nv[u] = ln.template fetch<PACK>(rn, (p + u * stride) * PACK);
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int q = p + u * stride;
          if (q >= p1) break;
          // the next row's loads are in flight
          if constexpr (SHIFT) {
            write(0, q, EARLY_OVERLAP && p == first ? ahead[u] : sr.template fetch<PACK>(q * PACK));
          } else {
            write(0, q, EARLY_OVERLAP && p == first ? ahead[u] : st.template fetch<PACK>(q * PACK));
          }
        }
        if (more) {
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int q = p + u * stride;
            if (q >= p1) break;
            C v[PACK];
            ln.template finish<PACK>(nv[u], v, rn, q * PACK);
            if constexpr (SHIFT) mask(ln, v, q * PACK, k_next);
            cache(0).put(q - p0, v);
            add_pack<ALGO, T, PACK>(s[0], v, k_next);
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
template <typename T, int ALGO, int PACK, bool RESIDUAL, bool OVERLAP, int W, int B, bool SHIFT>
__device__ __forceinline__ void layer_norm_block_smem_rows(CUKERN_NORM_FWD_PARAMS(T)) {
  CUKERN_NORM_FWD_SETUP(W, B, T, SHIFT);
  BlockReduce<> reduce;
  norm_rows<ALGO, SHIFT_K, TWO_STEP, RESIDUAL, OVERLAP, PACK, 1, 1, SHIFT>(
      dynamic_smem<T>(), 0, ld, st, x, sx, mean, rstd, eps, blockIdx.x, rows, gridDim.x, cols, 0,
      row_packs<PACK, SHIFT>(cols), true, reduce);
}
template <typename T, int ALGO, int PACK, bool RESIDUAL, bool OVERLAP, bool AFFINE,
          bool SHIFT = false>
__global__ void __launch_bounds__(1024) layer_norm_block_smem(CUKERN_NORM_FWD_PARAMS(T)) {
  constexpr int W = AFFINE ? kPresent : kRuntime;
  layer_norm_block_smem_rows<T, ALGO, PACK, RESIDUAL, OVERLAP, W, kBias<ALGO, W>, SHIFT>(
      CUKERN_NORM_FWD_ARGS);
}

// Block kernel without a cache: Welford statistics in one read, then a second read to write y.
// With a residual the second read is of h (written by this same thread in the first pass).
// P: gamma and beta's type (T, or float for 16-bit T).
template <typename T, int ALGO, int PACK, bool RESIDUAL, typename P = T>
__global__ void __launch_bounds__(1024) layer_norm_block_uncached(CUKERN_NORM_FWD_PARAMS(P)) {
  static_assert(sizeof(P) == sizeof(T) || (sizeof(T) == 2 && sizeof(P) == 4),
                "P: T, or float for 16-bit T");
  CUKERN_NORM_FWD_SETUP(kRuntime, ALGO == kLayerNorm ? kRuntime : kAbsent, P, false);
  const Load<T, C, false> again{RESIDUAL ? h : x, rows_at(RESIDUAL ? sh : sx)};
  const int num_packs = cols / PACK;
  for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
    const C k = SHIFT_K ? ld.shift(row, cols) : C(0);  // the shift K
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
// A cluster of blocks per row (sm_90): each block caches a slice of the row (see norm_rows), and
// the blocks' statistics meet in distributed shared memory. ROWS rows a pass (consecutive;
// Plan.rows_per_pass): each block's slice of gamma and beta is read once for them, where the
// slice, read from L2 for every row, would double or triple what the block reads besides x.
// WEIGHT and BIAS are template switches here, not null pointers: run-time presence cost these
// kernels 1-6 points of copy speed (AffineStore). CLUSTER blocks a cluster, or with CLUSTER == 0
// the size set at launch (layer_norm_cluster_dyn, cluster.cuh). SHIFT: as norm_rows (16-byte
// packs, so never with the size set at launch).
template <typename T, int ALGO, int PACK, int CLUSTER, bool WEIGHT, bool BIAS, bool RESIDUAL,
          bool OVERLAP, int MIN_BLOCKS, int ROWS, bool SHIFT>
__device__ __forceinline__ void cluster_rows(CUKERN_NORM_FWD_PARAMS(T)) {
  static_assert(MIN_BLOCKS == 1 || MIN_BLOCKS == 3, "MIN_BLOCKS: 1, or 3 blocks of <= 512 threads");
  static_assert(ROWS == 1 || ROWS == 2, "ROWS: 1 or 2 rows a pass");
  CUKERN_NORM_FWD_SETUP(WEIGHT, BIAS, T, SHIFT);
  constexpr int V = MIN_BLOCKS == 3 && sizeof(T) <= 4 && ROWS == 1 ? 2 : 1;
  const unsigned rank = cluster_rank();
  // every reduction buffer in the tail of the dynamic shared memory (memory.cuh): no static ones
  constexpr int MERGE =
      ALGO == kLayerNorm ? sizeof(Several<Welford<C>, ROWS>) : sizeof(Sums<C, ROWS>);
  // two rows a pass: the block all-reduce's one buffer (plan.rowwise.tail_scratch), so that three
  // blocks of two 16-bit rows of 16384 columns keep the 196 KiB carveout step (kernels.md)
  ClusterReduce<CLUSTER, MERGE, ROWS == 2 ? 1 : 2> reduce;
  const int num_packs = row_packs<PACK, SHIFT>(cols), n = reduce.n;
  int p0, p1;
  cluster_pack_range(num_packs, n, rank, p0, p1);
  const int slice = (num_packs + n - 1) / n * PACK;  // the widest block's
  const i64 cluster = CLUSTER > 0 ? blockIdx.x / CLUSTER : cluster_index();
  const i64 clusters = CLUSTER > 0 ? gridDim.x / CLUSTER : cluster_count();
  norm_rows<ALGO, SHIFT_K, TWO_STEP, RESIDUAL, OVERLAP, PACK, V, ROWS, SHIFT>(
      dynamic_smem<T>(), slice, ld, st, x, sx, mean, rstd, eps, cluster * ROWS, rows,
      clusters * ROWS, cols, p0, p1, rank == 0, reduce);
}

template <typename T, int ALGO, int PACK, int CLUSTER, bool WEIGHT, bool BIAS, bool RESIDUAL,
          bool OVERLAP, int MIN_BLOCKS, int ROWS, bool SHIFT = false>
__global__ void __cluster_dims__(CLUSTER, 1, 1)
__launch_bounds__(MIN_BLOCKS == 1 ? 1024 : 512, MIN_BLOCKS)
layer_norm_cluster(CUKERN_NORM_FWD_PARAMS(T)) {
  cluster_rows<T, ALGO, PACK, CLUSTER, WEIGHT, BIAS, RESIDUAL, OVERLAP, MIN_BLOCKS, ROWS, SHIFT>(
      CUKERN_NORM_FWD_ARGS);
}

template <typename T, int ALGO, int PACK, bool WEIGHT, bool BIAS, bool RESIDUAL, bool OVERLAP,
          int MIN_BLOCKS, int ROWS>
__global__ void __launch_bounds__(MIN_BLOCKS == 1 ? 1024 : 512, MIN_BLOCKS)
layer_norm_cluster_dyn(CUKERN_NORM_FWD_PARAMS(T)) {
  cluster_rows<T, ALGO, PACK, 0, WEIGHT, BIAS, RESIDUAL, OVERLAP, MIN_BLOCKS, ROWS, false>(
      CUKERN_NORM_FWD_ARGS);
}
#endif

#undef CUKERN_NORM_FWD_PARAMS
#undef CUKERN_NORM_FWD_ARGS
#undef CUKERN_NORM_FWD_SETUP

}  // namespace cukern

// What the layer norm and RMS norm kernels share, forward (layer_norm.cuh) and backward
// (layer_norm_grad.cuh), over the columns of a (rows, cols) view:
//
//   layer norm  mean = sum(x) / n, var = sum((x - mean)^2) / n, rstd = 1 / sqrt(var + eps),
//               y = (x - mean) * rstd * gamma + beta
//   RMS norm    rstd = 1 / sqrt(sum(x^2) / n + eps), y = x * rstd * gamma
//   backward    xhat = (x - mean) * rstd (RMS: x * rstd), g = dy * gamma,
//               dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (RMS: no mean(g) term),
//               dgamma = sum over rows of dy * xhat, dbeta = sum over rows of dy.
//
// Statistics are exact two-pass (mean, then the sum of squared deviations) wherever the row is
// on chip; the cluster variant merges its slices' exact (count, mean, M2) with Chan's formula;
// the uncached variant keeps a Welford state per thread and merges those. Never E[x^2] -
// E[x]^2. Layer norm works on x - K, K a value of the row: for rows far from zero (x = 1e4 +
// noise in float32) the differences are exact and small, so neither the sums nor
// y = ((x - K) - mean') * rstd lose digits to the offset, and a constant row gives var = 0 and
// y = beta exactly. K is the median of the row's first three values (median3; columns clamped
// to the row): the warp kernel takes them from lane 0's first pack (or the lanes holding them),
// the block and cluster kernels load them (block kernels over packs of 4 or more values as one
// word), one sector the row's first loads read anyway and the same three in every block of a
// row. The first value alone is not enough: an outlier there (1e4 among values of 1e-3) made
// x - K round the rest of the row to the outlier's spacing (1e-3 in float32), and mean, rstd
// and y lost the bulk's digits. One outlier among the three is never their median (two still
// make K one). Values from the middle and end of the row would be as good a sample but cost a
// row a memory latency before its sums can start (1-2 points of copy speed at 2048-32768
// columns); a sample's mean would cost a reduction and is no value of the row (a constant row
// would no longer give var = 0 exactly). Half and bfloat16 rows, once summed, are normalised
// as x - (K + mean') in one operation: the rounding of K + mean' to float is far below their
// spacing (a representable deviation from a mean m is at least m * 2^-11); their first pass
// sums a pack's values, then subtracts PACK * K (layer_norm.cuh, add_pack). RMS norm needs no
// mean, and a sum of squares has no cancellation.
// Statistics and all sums are in the compute type (float for half, bfloat16 and float; double
// for double), as are the dgamma/dbeta partial sums.
//
// Only what sizes a register array or changes memory traffic is a template argument: the storage
// type, ALGO (0 layer norm, 1 RMS norm), PACK, the per-lane register row (CPT values, RPA rows),
// the cluster size (the forward's packs under 16 bytes: layer_norm_cluster_dyn reads it at run
// time, one instantiation for every size), the forward's fused RESIDUAL (a read and a write more),
// the forward cluster kernels' WEIGHT and BIAS (run-time presence cost them 1-6 points), whether a
// cached forward block overlaps its rows (OVERLAP: a loop of different registers), the backward's
// WEIGHT, and for a cached backward with WEIGHT where its column sums live (REGS) and whether gamma
// is copied into shared memory (GAMMA), and for the uncached kernels the parameters' type P (T, or
// float for 16-bit T: float32 weight and bias with half or bfloat16 data, a separate instantiation
// so that the others' code stays as it is; a run-time flag changed ptxas's register allocation of
// many of them). The group width (blockDim.x of the warp kernel), the block size, padding, the
// number of buffers of a cached backward and whether the forward warp and block kernels have gamma
// and beta, where the call does not give every parameter the norm has (AFFINE false; null
// pointers where absent: layer_norm.cuh, AffineStore), are read at run time.
//
// Rows are contiguous (column stride 1; any row stride): the host copies other layouts first.
// Every pointer and row stride is a multiple of PACK elements (the planner checks).
#pragma once
#include "memory.cuh"

namespace cukern {

enum { kLayerNorm = 0, kRMSNorm = 1 };

// The median of three values, max(min(a, b), min(max(a, b), c)): one of them (a NaN among
// them is passed over unless all are NaN), robust to one outlier (norm.cuh's shift K).
__device__ __forceinline__ float median3(float a, float b, float c) {
  return fmaxf(fminf(a, b), fminf(fmaxf(a, b), c));
}
__device__ __forceinline__ double median3(double a, double b, double c) {
  return fmax(fmin(a, b), fmin(fmax(a, b), c));
}

// Row `row` of a view with row stride s (in elements) and contiguous columns.
__device__ __forceinline__ Layout<false> rows_at(i64 s) { return Layout<false>{s, 0, 1, 1}; }

// N parameters (gamma or beta) from column col of row 0 of `ld`, converted to the compute type:
// in the storage type T, or (P = float for 16-bit T: the mixed-precision setup, the uncached
// kernels only) in float32, by loads of at most 16 bytes (the host aligns such a row to 16
// bytes; col is a multiple of N).
template <int N, typename P, typename C>
__device__ __forceinline__ void load_param(const Load<P, C, false>& ld, C* dst, int col) {
  if constexpr (N * sizeof(P) <= 16) {
    ld.template load<N>(dst, 0, col);
  } else {
#pragma unroll
    for (int j = 0; j < N; j += 4) ld.template load<4>(dst + j, 0, col + j);
  }
}

// Rows off the 16-byte grid (SHIFT; memory.cuh's RowWindow) meet their parameters at another
// offset: window column col of a row whose first element sits `lo` elements into its 16-byte
// word takes parameter element col - lo. raw() reads them: a pack whole in the row (`whole`) in
// the 4-byte words they span (4, or 5 for 2-byte elements at an odd place; funnel shifts join
// them), and the row's end packs in the two 16-byte words they span (clamped to the parameter's
// own words: what would come from outside them belongs to no column of the row, and is never
// stored), shifted in registers by two selects a word. (Every pack that way took layer norm
// float16 48 registers and ~60% more instructions than on the grid: issue-bound at 45-73% of
// copy, 2047-262143 columns, H200.)
template <typename T> struct ShiftedParam {
  static constexpr int N = 16 / sizeof(T);
  const T* base;  // the parameter's first 16-byte word
  int delta;      // its element 0's place in that word, less the row's lo
  int last;       // the first element (from base) of its last 16-byte word
  __device__ __forceinline__ static ShiftedParam of(const T* p, int cols) {
    const int g = static_cast<int>(reinterpret_cast<unsigned long long>(p) & 15) /
                  static_cast<int>(sizeof(T));
    return ShiftedParam{p - g, g, (g + cols - 1) & -N};
  }
  // the same parameter for a row whose window starts `lo` into its word (from of())
  __device__ __forceinline__ ShiftedParam at_row(int lo) const {
    return ShiftedParam{base, delta - lo, last};
  }
  __device__ __forceinline__ Pack<T, N> raw(int col, bool whole) const {
    const int t = col + delta, a = t & -N;  // t: the first element wanted, from base
    Pack<T, N> p;
    if (whole) {  // t >= 0: every word read holds an element of the pack
      const unsigned* q = reinterpret_cast<const unsigned*>(base) + t * sizeof(T) / 4;
      if constexpr (sizeof(T) == 2) {
        const int bits = (t & 1) * 16;
        const unsigned w4 = bits ? q[4] : 0u;
        p.word = make_uint4(__funnelshift_r(q[0], q[1], bits), __funnelshift_r(q[1], q[2], bits),
                            __funnelshift_r(q[2], q[3], bits), __funnelshift_r(q[3], w4, bits));
      } else {
        p.word = make_uint4(q[0], q[1], q[2], q[3]);
      }
      return p;
    }
    const uint4 lo = *reinterpret_cast<const uint4*>(base + min(max(a, 0), last));
    const uint4 hi = *reinterpret_cast<const uint4*>(base + min(a + N, last));
    const unsigned w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    const int bytes = (t - a) * static_cast<int>(sizeof(T));  // 0..15
    unsigned u[6], v[5];
#pragma unroll
    for (int k = 0; k < 6; ++k) u[k] = (bytes & 8) ? w[k + 2] : w[k];
#pragma unroll
    for (int k = 0; k < 5; ++k) v[k] = (bytes & 4) ? u[k + 1] : u[k];
    unsigned o[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      o[k] = sizeof(T) == 2 ? __funnelshift_r(v[k], v[k + 1], (bytes & 2) * 8) : v[k];
    }
    p.word = make_uint4(o[0], o[1], o[2], o[3]);
    return p;
  }
};

// A view for one row's accesses: SHIFT, the row's window (memory.cuh, from_row), whose row 0 is
// the row; else the view itself, indexed by the row (row_in_view).
template <bool SHIFT, typename V> __device__ __forceinline__ V row_view(const V& v, i64 row) {
  if constexpr (SHIFT) {
    return v.from_row(row);
  } else {
    return v;
  }
}
template <bool SHIFT> __device__ __forceinline__ i64 row_in_view(i64 row) { return SHIFT ? 0 : row; }

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

// scan_packs over a loader with fetch() and finish() (x + residual, written to h): U packs'
// loads issued before any is finished, since h's store (a volatile asm with a memory clobber)
// keeps every later load behind it. `first()` runs once, after the first packs' loads are
// issued (and for a thread with no pack): a value those packs' sums need whose loads went
// before them.
template <typename C, int PACK, int U, typename L, typename G, typename F>
__device__ __forceinline__ void scan_fetched(const L& ld, i64 row, int p0, int p1, G&& first,
                                             F&& f) {
  typedef typename L::template Raw<PACK> Raw;
  const int stride = blockDim.x;
  int p = p0 + threadIdx.x;
  bool started = false;
  for (; p + (U - 1) * stride < p1; p += U * stride) {
    Raw raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u) raw[u] = ld.template fetch<PACK>(row, (p + u * stride) * PACK);
    if (!started) first();
    started = true;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      C v[PACK];
      ld.template finish<PACK>(raw[u], v, row, (p + u * stride) * PACK);
      f(p + u * stride, v);
    }
  }
  for (; p < p1; p += stride) {
    const Raw raw = ld.template fetch<PACK>(row, p * PACK);
    if (!started) first();
    started = true;
    C v[PACK];
    ld.template finish<PACK>(raw, v, row, p * PACK);
    f(p, v);
  }
  if (!started) first();
}

}  // namespace cukern

// The norm family's forward device helpers (kernels/layer_norm.cuh has the kernels): the fused
// loads (x + residual, written to h) and stores (y = v * gamma + beta, gamma and beta shifted
// to rows off the 16-byte grid), the per-value parts of the sums, and the warp kernel's shift K.
#pragma once
#include "cluster.cuh"
#include "norm.cuh"

namespace cukern {

// ---------------------------------------------------------------------------------------------
// Fused functors.

// x, or x + residual rounded to the storage type (the sum a separate add would produce), which is
// then also written to h: the "add then norm" of a transformer block in one read of each input.
// SHIFT (rows off the 16-byte grid): from_row() gives a row's window (memory.cuh, RowWindow),
// whose loads leave the other rows' elements of its end packs as read, for the kernel to mask
// (win()); the view itself reads in row coordinates (its window never clamps: shift()).
template <typename T, typename C, bool RESIDUAL, bool SHIFT = false> struct SkipLoad {
  Load<T, C, false, SHIFT> x, res;
  Store<C, T, false, SHIFT> h;
  template <int N> __device__ __forceinline__ void load(C* dst, i64 row, int col) const {
    x.template load<N, false>(dst, row, col);
    if (RESIDUAL) {
      C r[N];
      res.template load<N, false>(r, row, col);
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
    r.x = x.template raw<N, false>(row, col);
    if (RESIDUAL) r.res = res.template raw<N, false>(row, col);
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
  // multiple of 16 bytes), of x and of the residual (SHIFT: up to the row's last pack).
  __device__ __forceinline__ void prefetch(i64 row, int col, int count) const {
    if constexpr (SHIFT) {
      count = min(count, x.win.last + 16 / static_cast<int>(sizeof(T)) - col);
      if (count <= 0) return;
    }
    prefetch_l2(x.ptr + x.at.offset(row, col), count * sizeof(T));
    if (RESIDUAL) prefetch_l2(res.ptr + res.at.offset(row, col), count * sizeof(T));
  }
  // A row's shift K (norm.cuh): the median of its first three values (columns clamped to the
  // row), loads of one sector that the row's own first loads read anyway; the same in every
  // block of a cluster. In two steps as load(): shift_fetch() issues the loads, shift_of()
  // takes the median once the caller has issued its own loads behind them.
  struct Shift {
    Raw<1> v[3];
  };
  __device__ __forceinline__ Shift shift_fetch(i64 row, int cols) const {
    return Shift{{fetch<1>(row, 0), fetch<1>(row, min(1, cols - 1)),
                  fetch<1>(row, min(2, cols - 1))}};
  }
  __device__ __forceinline__ C shift_of(const Shift& s) const {
    return median3(sum_of(s.v[0]), sum_of(s.v[1]), sum_of(s.v[2]));
  }
  __device__ __forceinline__ C shift(i64 row, int cols) const {
    return median3(value(row, 0), value(row, min(1, cols - 1)), value(row, min(2, cols - 1)));
  }
  // The value load() returns for column `col` of a row, without writing h.
  __device__ __forceinline__ C value(i64 row, int col) const {
    C v;
    x.template load<1>(&v, row, col);
    if (RESIDUAL) {
      C r;
      res.template load<1>(&r, row, col);
      v = Num<T>::to(Num<T>::from(v + r));
    }
    return v;
  }
  // SHIFT: row `row`'s window, and the window of its elements among its packs
  __device__ __forceinline__ SkipLoad from_row(i64 row) const {
    return SkipLoad{x.from_row(row), res.from_row(row), h.from_row(row)};
  }
  __device__ __forceinline__ const RowWindow<T, SHIFT>& win() const { return x.win; }

 private:
  // x (+ residual, rounded to T) of a fetched column, without writing h
  __device__ __forceinline__ C sum_of(const Raw<1>& r) const {
    C v = pack_value(r.x, 0);
    if (RESIDUAL) v = Num<T>::to(Num<T>::from(v + pack_value(r.res, 0)));
    return v;
  }
};

// 1 in a storage type, as bits (no conversion instruction).
template <typename T> __device__ __forceinline__ T storage_one() { return T(1); }
template <> __device__ __forceinline__ f16 storage_one<f16>() { return f16{0x3c00}; }
template <> __device__ __forceinline__ bf16 storage_one<bf16>() { return bf16{0x3f80}; }

// How AffineStore has gamma or beta (its W and B): kAbsent, never read (gamma = 1, beta = 0);
// kPresent, always read; kRuntime, read where the pointer is not null (null: absent).
enum : int { kAbsent = 0, kPresent = 1, kRuntime = 2 };
// beta's presence beside gamma's W: the same for layer norm; RMS norm has no beta
template <int ALGO, int W> constexpr int kBias = ALGO == kLayerNorm ? W : kAbsent;

// y = v * gamma + beta for normalised values v, each factor optional. The warp and block
// kernels have two instantiations (AFFINE): one for calls that give every parameter the norm
// has (W = kPresent; B = kPresent for layer norm, kAbsent for RMS norm), one that serves every
// other combination at run time (W = kRuntime, B = kRuntime or kAbsent): an absent one is never
// read and stands for gamma = 1 or beta = 0, and the per-value math is one multiply-add either
// way (v * 1 + 0 is v, v * gamma + 0 is v * gamma, rounded once), with the loads predicated
// once a pack. Run-time presence alone cost 16-bit layer norm 2-10 points of copy on the H200.
// The cluster kernels take them as template switches (kAbsent or kPresent each: the code the
// WEIGHT and BIAS switches gave), where run-time presence cost 1-6 points
// (docs/notes/layer-norm-forward.md).
// params() and store_with() split store() for a caller that writes several rows of the same
// columns (gamma and beta loaded and converted once).
// P: the parameters' type (T, or float for 16-bit T in the uncached kernel; see norm.cuh).
// SHIFT (rows off the 16-byte grid): from_row() gives a row's window of y, and gamma and beta
// shifted to it (ShiftedParam, in `shifted`).
template <typename T, bool SHIFT> struct ShiftedParams {};
template <typename T> struct ShiftedParams<T, true> {
  ShiftedParam<T> gamma, beta;
};
template <typename C, typename T, int W, int B, typename P = T, bool SHIFT = false>
struct AffineStore {
  static_assert(W >= kAbsent && W <= kRuntime && B >= kAbsent && B <= kRuntime, "W, B: 0-2");
  static_assert((W == kRuntime) == (B == kRuntime) || (W == kRuntime && B == kAbsent),
                "run-time presence: both, or gamma alone (RMS norm)");
  static_assert(!SHIFT || sizeof(P) == sizeof(T), "SHIFT: parameters of the data's type");
  Store<C, T, false, SHIFT> y;
  Load<P, C, false> gamma, beta;  // one row each (row 0); with kRuntime, ptr null where absent
  ShiftedParams<T, SHIFT> shifted;
  __device__ __forceinline__ AffineStore from_row(i64 row) const {
    const Store<C, T, false, SHIFT> yr = y.from_row(row);
    return AffineStore{yr, gamma, beta,
                       {shifted.gamma.at_row(yr.win.lo), shifted.beta.at_row(yr.win.lo)}};
  }
  __device__ __forceinline__ bool weight() const {
    return W == kPresent || (W == kRuntime && gamma.ptr != nullptr);
  }
  __device__ __forceinline__ bool bias() const {
    return B == kPresent || (B == kRuntime && beta.ptr != nullptr);
  }
  // N values of gamma (GAMMA) or beta from column col as stored (SHIFT: shifted to the row)
  template <int N, bool GAMMA> __device__ __forceinline__ Pack<T, N> raw_param(int col) const {
    if constexpr (SHIFT) {
      return (GAMMA ? shifted.gamma : shifted.beta).raw(col, !y.win.partial(col, N));
    } else {
      return (GAMMA ? gamma : beta).template raw<N>(0, col);
    }
  }
  // ... converted (any P: load_param)
  template <int N, bool GAMMA> __device__ __forceinline__ void param(C* dst, int col) const {
    if constexpr (SHIFT) {
      const Pack<T, N> q = raw_param<N, GAMMA>(col);
#pragma unroll
      for (int i = 0; i < N; ++i) dst[i] = pack_value(q, i);
    } else {
      load_param<N>(GAMMA ? gamma : beta, dst, col);
    }
  }
  template <int N> __device__ __forceinline__ void params(C* w, C* b, int col) const {
    if (weight()) {
      param<N, true>(w, col);
    } else if (W == kRuntime) {
#pragma unroll
      for (int i = 0; i < N; ++i) w[i] = C(1);
    }
    if (bias()) {
      param<N, false>(b, col);
    } else if (B == kRuntime) {
#pragma unroll
      for (int i = 0; i < N; ++i) b[i] = C(0);
    }
  }
  template <int N>
  __device__ __forceinline__ void store_with(const C* v, const C* w, const C* b, i64 row,
                                             int col) const {
    C out[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (W == kRuntime) {  // the multiply-add above
        out[i] = B != kAbsent ? v[i] * w[i] + b[i] : v[i] * w[i];
      } else {
        out[i] = v[i];
        if (W) out[i] *= w[i];
        if (B) out[i] += b[i];
      }
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
  // once a pack. An absent gamma or beta read at run time is a pack of ones or zeros in the
  // storage type.
  template <int N> struct Params {
    Pack<T, N> w, b;  // as loaded, unconverted
  };
  template <int N> __device__ __forceinline__ Params<N> fetch(int col) const {
    Params<N> p;
    if (weight()) {
      p.w = raw_param<N, true>(col);
    } else if (W == kRuntime) {
#pragma unroll
      for (int i = 0; i < N; ++i) p.w.elem[i] = storage_one<T>();
    }
    if (bias()) {
      p.b = raw_param<N, false>(col);
    } else if (B == kRuntime) {
      p.b.word = typename Pack<T, N>::word_t{};  // +0 in every storage type
    }
    return p;
  }
  template <int N>
  __device__ __forceinline__ void store_fetched(const C* v, const Params<N>& p, i64 row,
                                                int col) const {
    C w[N], b[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (W) w[i] = pack_value(p.w, i);
      if (B) b[i] = pack_value(p.b, i);
    }
    store_with<N>(v, w, b, row, col);
  }
};

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
// barrier. `win` (SHIFT): the other rows' values of the row's end packs count 0.
template <int PACK, typename T, typename C, bool TWO_STEP, bool SHIFT>
__device__ __forceinline__ C own_squares(const SmemRow<T, C, PACK>& cache,
                                         const Centre<C, TWO_STEP>& at, int p0, int p1,
                                         const RowWindow<T, SHIFT>& win) {
  C q = C(0);
  for (int p = p0 + static_cast<int>(threadIdx.x); p < p1; p += blockDim.x) {
    C v[PACK];
    cache.get(p - p0, v);
    if constexpr (SHIFT) {
#pragma unroll
      for (int i = 0; i < PACK; ++i) v[i] = at(v[i]);
      win.template mask<PACK>(v, p * PACK, C(0));
#pragma unroll
      for (int i = 0; i < PACK; ++i) q += v[i] * v[i];
    } else {
#pragma unroll
      for (int i = 0; i < PACK; ++i) q += at(v[i]) * at(v[i]);
    }
  }
  return q;
}

// One value's part of the first pass: x - K (layer norm) or x^2 (RMS norm).
template <int ALGO, typename C> __device__ __forceinline__ C norm_term(C v, C k) {
  return ALGO == kLayerNorm ? v - k : v * v;
}

// Adds a pack of PACK values of storage type T to the first pass's sum s. Layer norm of 16-bit
// data sums the pack, then takes PACK * K once (one subtraction a pack, not one a value; 16-bit
// rows are instruction-bound): the values' float sum is exact while they lie within a factor
// 2^10 of each other (bfloat16: 2^13), else it rounds off less than 2^-18 of the largest, below
// the data's own spacing (2^-11 of a value in float16, 2^-8 in bfloat16).
template <int ALGO, typename T, int PACK, typename C>
__device__ __forceinline__ void add_pack(C& s, const C* v, C k) {
  if constexpr (ALGO == kLayerNorm && sizeof(T) == 2 && PACK > 1) {
    C t = v[0];
#pragma unroll
    for (int i = 1; i < PACK; ++i) t += v[i];
    s += t - C(PACK) * k;
  } else {
#pragma unroll
    for (int i = 0; i < PACK; ++i) s += norm_term<ALGO>(v[i], k);
  }
}

// Writes a row's statistics (RMS norm has no mean).
template <int ALGO, typename C>
__device__ __forceinline__ void put_stats(C* mean, C* rstd, i64 row, C m, C rs) {
  if (ALGO == kLayerNorm && mean != nullptr) mean[row] = m;
  if (rstd != nullptr) rstd[row] = rs;
}

// The forward's views of x (+ residual, h) and of y (+ gamma, beta). SHIFT: views in row
// coordinates (a window that never clamps), rows' windows through from_row().
template <typename T, typename C, bool RESIDUAL, bool SHIFT>
__device__ __forceinline__ SkipLoad<T, C, RESIDUAL, SHIFT> norm_input(const T* x, i64 sx,
                                                                      const T* res, i64 sr, T* h,
                                                                      i64 sh, int cols) {
  if constexpr (SHIFT) {
    const RowWindow<T, true> w{0, cols, 0x7fffffff, T{}};
    return {{x, rows_at(sx), w}, {res, rows_at(sr), w}, {h, rows_at(sh), w}};
  } else {
    return {{x, rows_at(sx)}, {res, rows_at(sr)}, {h, rows_at(sh)}};
  }
}
template <typename C, typename T, int W, int B, typename P, bool SHIFT>
__device__ __forceinline__ AffineStore<C, T, W, B, P, SHIFT> norm_output(T* y, i64 sy,
                                                                         const P* gamma,
                                                                         const P* beta, int cols) {
  if constexpr (SHIFT) {
    return {{y, rows_at(sy), {0, cols, 0x7fffffff, T{}}},
            {gamma, rows_at(0)},
            {beta, rows_at(0)},
            {ShiftedParam<T>::of(gamma, cols), ShiftedParam<T>::of(beta, cols)}};
  } else {
    return {{y, rows_at(sy)}, {gamma, rows_at(0)}, {beta, rows_at(0)}};
  }
}

// The warp kernel's shift K of a row (norm.cuh): the median of its first three values (columns
// clamped to the row), from lane 0's first pack when it holds them (one shuffle), else
// shuffled from the lanes that do (`buf`: this lane's registers of the row, pack p * width +
// lane in slot p). SHIFT: a row of 4 packs or more whose values begin at column lo of its
// packs, in lane 0's and lane 1's first pack.
template <int PACK, int CPT, bool SHIFT = false, typename C>
__device__ __forceinline__ C warp_shift(const C* buf, int cols, int width, int log_width,
                                        int lo = 0) {
  if constexpr (SHIFT) {
    C v[3];
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const int c = lo + i;
      C mine = buf[0];
#pragma unroll
      for (int j = 1; j < PACK; ++j) mine = j == (c & (PACK - 1)) ? buf[j] : mine;
      v[i] = __shfl_sync(0xffffffffu, mine, c / PACK, width);
    }
    return median3(v[0], v[1], v[2]);
  } else if constexpr (PACK >= 3) {
    return __shfl_sync(0xffffffffu, median3(buf[0], buf[1], buf[2]), 0, width);
  } else {
    constexpr int REGS = CPT < 3 * PACK ? CPT : 3 * PACK;  // registers that can hold them
    C v[3];
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const int c = min(i, cols - 1), pc = c / PACK;
      const int reg = (pc >> log_width) * PACK + c % PACK;
      C mine = buf[0];
#pragma unroll
      for (int j = 1; j < REGS; ++j) mine = j == reg ? buf[j] : mine;
      v[i] = __shfl_sync(0xffffffffu, mine, pc & (width - 1), width);
    }
    return median3(v[0], v[1], v[2]);
  }
}

}  // namespace cukern

// Batch norm over the channel axis of an (A, C, B) = (outer, channels, inner) dense tensor, with
// fused add and ReLU, its ReLU bit mask, and the backward (cukern/ops/batch_norm.py: formulas).
//
// Memory is read as flat packs of PACK elements (16 bytes where alignment allows) in memory order;
// the element at flat index e belongs to channel (e / B) % C. Two layouts:
//   planes   (B > 1: NCHW)                   a pack lies in one channel's plane, or (SPAN:
//                                            B not a multiple of PACK, 7x7 in 16-byte packs:
//                                            C * B % PACK == 0, B >= PACK) spans two:
//                                            reductions skip the other plane's elements
//                                            (bn::plane_bits), elementwise passes take both
//                                            channels' coefficients (bn::plane_span); SPAN is
//                                            a template argument, so whole-pack planes run the
//                                            plain loops
//   columns  (B == 1, C % PACK == 0: NHWC)   a pack holds PACK consecutive channels
//
// Kernels (the planner, cukern/plan/batch_norm.py, shapes every launch at run time):
//   batch_norm_stats_planes<T, PACK, SPAN>        partial Welford states per (channel, split);
//   batch_norm_stats_cols<T, PACK>                with one split, the finished channels
//   batch_norm_finalize<C>                        fixed-order merge -> mean, invstd, running
//                                                 stats, per-channel coefficients (or eval's)
//   batch_norm_apply<T, PACK, COLS, ADD, SPAN>    y = relu?((x - mean) * scale + shift [+ z]),
//                                                 the ReLU mask by __ballot_sync
//   batch_norm_grad_planes<T, PACK, SPAN>         partial (sum g, sum g * (x - mean)); with
//   batch_norm_grad_cols<T, PACK>                 one split, dweight, dbias, dx coefficients
//   batch_norm_grad_finalize<C>                   dweight, dbias, the dx coefficients
//   batch_norm_dx<T, PACK, COLS, SPAN>            dx (and daddend = the masked dy)
// Every merge runs in a fixed order (no atomics): results are bitwise reproducible.
#pragma once
#include "memory.cuh"
#include "reduce.cuh"

// The arguments of bn::Finish, in its field order (statistics and finalize kernels).
#define CUKERN_BN_FINISH_PARAMS(C)                                                            \
  C count, int training, C *running_mean, C *running_var, const C *weight, const C *bias,     \
      C momentum, C eps, C *mean_out, C *invstd_out, C *var_out, bn::Coef<C> *coef
#define CUKERN_BN_FINISH_ARGS                                                                 \
  count, training, running_mean, running_var, weight, bias, momentum, eps, mean_out,          \
      invstd_out, var_out, coef

// The arguments of bn::GradFinish (gradient-sum and grad-finalize kernels).
#define CUKERN_BN_GRAD_FINISH_PARAMS(C)                                                       \
  C count, int training, const C *invstd, const C *weight, C *dweight, C *dbias,              \
      bn::Coef<C> *coef
#define CUKERN_BN_GRAD_FINISH_ARGS count, training, mean, invstd, weight, dweight, dbias, coef

namespace cukern {
// The most threads a statistics or gradient-sum block has (the planner's bn_reduce_threads):
// 64 registers a thread at 1024 would spill the 16-bit columns kernels.
constexpr int kBnReduceThreads = 256;

namespace bn {

// Quotient of n < 2^31 by a run-time divisor d >= 1: (umulhi(n, m) + n) >> s, with
// s = ceil(log2 d) and m = floor(2^32 (2^s - d) / d) + 1 computed on the host.
struct FastDiv {
  unsigned d, m, s;
  __device__ __forceinline__ unsigned div(unsigned n) const { return (__umulhi(n, m) + n) >> s; }
};

// Packs a thread of an elementwise pass keeps in flight: about 32 bytes, at most 8 packs.
__host__ __device__ constexpr int unroll_for(int bytes) {
  return bytes >= 32 ? 1 : (32 / bytes > 8 ? 8 : 32 / bytes);
}

// Packs a thread of a columns elementwise pass keeps in flight, given the bytes a pack index
// reads (PACK * sizeof(T) per tensor: x, and the addend or dy): about 128 bytes, at most 8
// packs. Its PACK channels' coefficients stay in registers for the whole grid-strided loop,
// so the planner sizes the grid to about one resident wave and every load a thread issues
// serves the same coefficients (at 32 bytes and 12 blocks an SM a thread did ~2 packs).
__host__ __device__ constexpr int unroll_cols(int bytes) {
  return bytes >= 128 ? 1 : (128 / bytes > 8 ? 8 : 128 / bytes);
}

// Packs a thread of a reduction keeps in flight: about 64 bytes (4 packs of 16 bytes), at most
// 16 packs. Reductions run fewer blocks than the elementwise passes (few partial states), so
// each thread loads more at a time.
__host__ __device__ constexpr int unroll_reduce(int bytes) {
  return bytes >= 64 ? 1 : (64 / bytes > 16 ? 16 : 64 / bytes);
}

template <typename T, int N> __device__ __forceinline__ Pack<T, N> load_pack(const T* p, i64 i) {
  Pack<T, N> pack;
  pack.word = reinterpret_cast<const typename Pack<T, N>::word_t*>(p)[i];
  return pack;
}

template <typename T, int N, typename C>
__device__ __forceinline__ void store_pack(T* p, i64 i, const C* v) {
  T e[N];
#pragma unroll
  for (int k = 0; k < N; ++k) e[k] = Num<T>::from(v[k]);
  store_global(reinterpret_cast<typename Pack<T, N>::word_t*>(p) + i, WordOf<T, N>::make(e));
}

// Per-channel coefficients the elementwise passes read: forward {mean, scale, shift, -}
// (y = (x - mean) * scale + shift), backward {mean, k1, k2, k3}
// (dx = k1 * g + k2 * (x - mean) + k3).
template <typename C> struct alignas(4 * sizeof(C)) Coef {
  C mean, a, b, c;
};

// Welford's (count, mean, M2) with Chan's merge in the form that keeps the mean accurate far
// from 0: n = na + nb, d = mb - ma, m = ma + d * nb / n, M2 = M2a + M2b + d^2 na nb / n. The
// operands are put in a canonical order first (more values first, then by mean and M2), so
// merge(a, b) == merge(b, a) bit for bit; an empty state merges to the other one exactly.
template <typename C> struct Stats {
  C n, mean, m2;
  static __device__ __forceinline__ Stats identity() { return Stats{C(0), C(0), C(0)}; }
  static __device__ __forceinline__ Stats merge(const Stats& x, const Stats& y) {
    if (y.n == C(0)) return x;
    if (x.n == C(0)) return y;
    const bool swap = y.n > x.n || (y.n == x.n && (y.mean < x.mean ||
                                                   (y.mean == x.mean && y.m2 < x.m2)));
    const Stats& a = swap ? y : x;
    const Stats& b = swap ? x : y;
    const C n = a.n + b.n;
    const C d = b.mean - a.mean;
    const C f = b.n / n;
    return Stats{n, a.mean + d * f, a.m2 + b.m2 + d * d * a.n * f};
  }
  __device__ __forceinline__ Stats shfl_xor(int mask) const {
    return Stats{__shfl_xor_sync(0xffffffffu, n, mask), __shfl_xor_sync(0xffffffffu, mean, mask),
                 __shfl_xor_sync(0xffffffffu, m2, mask)};
  }
};

// Sums of one thread's values shifted by k, a value of the data near them (the channel's first
// value in the block's split, seeded before the loop): exact enough wherever k is within a few
// standard deviations of the mean (a value of the data always is, in practice), and 3
// instructions a value, no branch; the count is kept by the caller (one a pack, not a value).
// stats(n) hands them to Chan's merges.
template <typename C> struct Shifted {
  C k, s1, s2;
  __device__ __forceinline__ void add(C v) {
    const C d = v - k;
    s1 += d;
    s2 += d * d;
  }
  __device__ __forceinline__ Stats<C> stats(int n) const {
    if (n == 0) return Stats<C>::identity();
    const C cnt = static_cast<C>(n);
    const C m = s1 / cnt;
    const C m2 = s2 - s1 * m;
    return Stats<C>{cnt, k + m, m2 > C(0) ? m2 : C(0)};
  }
};

// Shifted sums folded into a Chan state every kFoldValues values and re-centred on the running
// mean, for threads that sum many values (planes splits of long planes): plain float32 shifted
// sums of ~4000 values a thread, shifted by a first value 3 standard deviations out, put invstd
// 1e-5 off at (2, 8, 2^27 + 3).
constexpr int kFoldValues = 1024;
template <typename C> struct Running {
  Stats<C> done;
  Shifted<C> cur;
  int n;  // values in cur
  __device__ __forceinline__ void fold() {
    done = Stats<C>::merge(done, cur.stats(n));
    cur = Shifted<C>{done.mean, C(0), C(0)};
    n = 0;
  }
  __device__ __forceinline__ Stats<C> stats() const { return Stats<C>::merge(done, cur.stats(n)); }
};

// The ReLU mask of 32 * N consecutive elements (one pack a lane, the warp's first pack
// `first`, a multiple of 32): bit i of word w is element 32 w + i, 1 where kept (y > 0).
// Lane L's pack is bits N (L % G) .. of word L / G (G = 32 / N lanes a word), so a word is
// the OR of its G lanes' N-bit fields, shifted into place: log2(G) shuffles. (A ballot per
// element and a bit-by-bit interleave took ~4x the instructions: fp16 NCHW training + ReLU
// at (64, 1024, 14, 14) spent 27 us in the apply pass against 17 without the mask.)
template <int N, typename C>
__device__ __forceinline__ void write_mask(unsigned* mask, i64 first, const C* v, bool ok,
                                           i64 nwords) {
  const int lane = static_cast<int>(lane_id());
  const i64 word0 = first * N / 32;
  if (N == 1) {
    const unsigned b = __ballot_sync(0xffffffffu, ok && v[0] > C(0));
    if (lane == 0 && word0 < nwords) mask[word0] = b;
    return;
  }
  constexpr int G = 32 / N;  // lanes a word
  unsigned bits = 0;
#pragma unroll
  for (int k = 0; k < N; ++k) bits |= (ok && v[k] > C(0) ? 1u : 0u) << k;
  unsigned word = bits << ((lane % G) * N);
#pragma unroll
  for (int off = G / 2; off > 0; off >>= 1) word |= __shfl_xor_sync(0xffffffffu, word, off);
  if (lane % G == 0 && word0 + lane / G < nwords) mask[word0 + lane / G] = word;
}

// The N mask bits of the pack at flat pack index i (all in one word: 32 % N == 0).
template <int N> __device__ __forceinline__ unsigned mask_bits(const unsigned* mask, i64 i) {
  const i64 e = i * N;
  return (__ldg(mask + (e >> 5)) >> (e & 31)) & ((N == 32 ? 0u : (1u << N)) - 1u);
}

// What a channel's merged statistics become (batch_norm_finalize, or a statistics kernel with
// one split): training takes mean and the biased variance from the state, writes mean, invstd
// (and the variance) and updates the running statistics with the unbiased variance; eval takes
// them from the running statistics. Both write the apply pass's coefficients
// {mean, weight * invstd, bias}. Null pointers are skipped.
template <typename C> struct Finish {
  C count;
  int training;
  C *running_mean, *running_var;
  const C *weight, *bias;
  C momentum, eps;
  C *mean_out, *invstd_out, *var_out;
  Coef<C>* coef;
  __device__ __forceinline__ void operator()(int c, const Stats<C>& st) const {
    C mean, var;
    if (training) {
      mean = st.mean;
      var = st.m2 / count;
    } else {
      mean = running_mean[c];
      var = running_var[c];
    }
    const C invstd = C(1) / sqrt(var + eps);
    if (training) {
      if (running_mean != nullptr)
        running_mean[c] = (C(1) - momentum) * running_mean[c] + momentum * mean;
      if (running_var != nullptr)
        running_var[c] = (C(1) - momentum) * running_var[c] + momentum * (st.m2 / (count - C(1)));
    }
    if (mean_out != nullptr) mean_out[c] = mean;
    if (invstd_out != nullptr) invstd_out[c] = invstd;
    if (var_out != nullptr) var_out[c] = var;
    if (coef != nullptr) {
      const C w = weight != nullptr ? weight[c] : C(1);
      coef[c] = Coef<C>{mean, w * invstd, bias != nullptr ? bias[c] : C(0), C(0)};
    }
  }
};

// A channel's forward coefficients: the finalize kernel's, or (coef null: eval without
// statistics outputs) computed here from the running statistics, as batch_norm_finalize does.
template <typename C> struct EvalParams {
  const C *mean, *var, *weight, *bias;
  C eps;
  __device__ __forceinline__ Coef<C> operator()(const Coef<C>* coef, unsigned c) const {
    if (coef != nullptr) return coef[c];
    const C invstd = C(1) / sqrt(__ldg(var + c) + eps);
    return Coef<C>{__ldg(mean + c), (weight != nullptr ? __ldg(weight + c) : C(1)) * invstd,
                   bias != nullptr ? __ldg(bias + c) : C(0), C(0)};
  }
};

// Where a planes pack of an elementwise pass lies: j (the pack's index within its sample)
// times upp units, d units a plane (div.d). !SPAN: upp = 1, units are packs (B % PACK == 0,
// d = B / PACK), the whole pack in channel c0; SPAN: upp = PACK, units are elements (d = B >=
// PACK, B not a multiple of PACK, C * B < 2^31), the first n0 elements in c0, the rest in c0 + 1.
struct PlaneSpan {
  unsigned c0;
  int n0;
};
template <bool SPAN, int PACK>
__device__ __forceinline__ PlaneSpan plane_span(const FastDiv& div, unsigned j, unsigned upp) {
  if (!SPAN) return PlaneSpan{div.div(j), PACK};
  const unsigned e = j * upp;
  const unsigned c0 = div.div(e);
  const unsigned left = div.d - (e - c0 * div.d);
  return PlaneSpan{c0, left < static_cast<unsigned>(PACK) ? static_cast<int>(left) : PACK};
}

// The planes reductions read a channel's plane of B elements (from flat element `start`) as the
// W packs from start / PACK on: W = B / PACK where PACK divides B (start is then a multiple of
// PACK), else W = (B + 2 PACK - 2) / PACK, enough wherever the plane starts within its first
// pack. The bits of pack w's elements that lie in the plane, given off = w PACK - start % PACK
// (the pack's first element relative to the plane's): all PACK bits inside it, some at its
// ends (the neighbouring planes' elements are skipped), 0 past it (the pack is not read).
template <int PACK> __device__ __forceinline__ unsigned plane_bits(int off, int B) {
  const int lo = off < 0 ? -off : 0;
  const int hi = B - off < PACK ? B - off : PACK;
  if (hi <= lo) return 0u;
  return ((1u << hi) - 1u) & ~((1u << lo) - 1u);
}
template <int PACK> constexpr unsigned kFullPack = PACK >= 32 ? ~0u : (1u << PACK) - 1u;

// Reduction states of the backward: (sum g, sum g * (x - mean)).
template <typename C> using GradSums = Sums<C, 2>;

// A channel's merged gradient sums: dbias = sum g, dweight = invstd * sum g (x - mean), and the
// dx coefficients k1 = weight * invstd, in training k2 = -k1 * invstd * dweight / n and
// k3 = -k1 * dbias / n (eval: 0), so that dx = k1 * g + k2 * (x - mean) + k3
// = weight * invstd * (g - dbias / n - xhat * dweight / n).
template <typename C> struct GradFinish {
  C count;
  int training;
  const C *mean, *invstd, *weight;
  C *dweight, *dbias;
  Coef<C>* coef;
  __device__ __forceinline__ void operator()(int c, const GradSums<C>& st) const {
    const C is = invstd[c];
    const C db = st.v[0], dw = st.v[1] * is;
    if (dweight != nullptr) dweight[c] = dw;
    if (dbias != nullptr) dbias[c] = db;
    const C k1 = (weight != nullptr ? weight[c] : C(1)) * is;
    const C k2 = training ? -k1 * is * dw / count : C(0);
    const C k3 = training ? -k1 * db / count : C(0);
    coef[c] = Coef<C>{mean[c], k1, k2, k3};
  }
};

// One channel's S partial states merged in a fixed order by nt threads (a warp, or a whole
// block: bn::Merger): thread t folds t, t + nt, ... (8 loads in flight), then a butterfly in
// each warp and, for a block, the warps' states in warp order; every thread ends with the same
// bits.
template <typename S>
__device__ __forceinline__ S fold_partials(const S* __restrict__ p, int n, int t, int nt,
                                           bool block) {
  S st = S::identity();
  for (int s0 = t; s0 < n; s0 += nt * 8) {
    S v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = s0 + nt * k < n ? p[s0 + nt * k] : S::identity();
#pragma unroll
    for (int k = 0; k < 8; ++k) st = S::merge(st, v[k]);  // identities merge exactly
  }
  if (!block) return allreduce_group(st, 32);
  unsigned phase = 0;
  return allreduce_block(st, phase);
}

// Who merges a channel's partial states in the merge kernels (block (32, Y)): a warp each
// (grid ceil(Cn / Y)), or, where the grid has one block a channel (few channels, many splits:
// the planner's choice), the whole block, so that the merge is not a few latency-bound warps.
struct Merger {
  bool block;
  int c, t, nt;
  __device__ __forceinline__ explicit Merger(int Cn)
      : block(gridDim.x == static_cast<unsigned>(Cn)),
        c(static_cast<int>(block ? blockIdx.x : blockIdx.x * blockDim.y + threadIdx.y)),
        t(static_cast<int>(block ? threadIdx.y * 32 + threadIdx.x : threadIdx.x)),
        nt(block ? static_cast<int>(blockDim.y) * 32 : 32) {}
};

// Folds a thread's column states (ROWS x cols x N in shared memory, ROWS a power of two) over
// its rows in a fixed tree order; row 0 ends with the block's states.
template <typename S>
__device__ __forceinline__ void tree_over_rows(S* sm, int per_row, int row, int col, int n) {
  for (int h = blockDim.y / 2; h > 0; h /= 2) {
    __syncthreads();
    if (row < h) {
      for (int k = 0; k < n; ++k) {
        S* a = sm + (row * per_row + col) * n + k;
        *a = S::merge(*a, sm[((row + h) * per_row + col) * n + k]);
      }
    }
  }
  __syncthreads();
}

// The columns kernels' end: the block's PACK-channel states (in shared memory, a row of threads
// each) folded over its rows; row 0 finishes its channels where the split is the whole channel
// (S == 1: no merge launch) or stores the split's partial states for the merge kernel.
template <int PACK, typename St, typename Finish>
__device__ __forceinline__ void cols_finish_or_store(St* sm, St* part, int S, int s, int cp,
                                                     bool valid, const Finish& finish) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  tree_over_rows(sm, blockDim.x, ty, tx, PACK);
  if (ty == 0 && valid) {
#pragma unroll
    for (int k = 0; k < PACK; ++k) {
      if (S == 1) {
        finish(cp * PACK + k, sm[tx * PACK + k]);
      } else {
        part[static_cast<i64>(cp * PACK + k) * S + s] = sm[tx * PACK + k];
      }
    }
  }
}

}  // namespace bn

// ---------------------------------------------------------------------------------------------
// Statistics, planes layout: block (channel c = blockIdx.x, split s = blockIdx.y) reads the
// packs [A W s / S, A W (s + 1) / S) of its channel's flat run of A planes of W packs (a split
// may start or end inside a plane: a few large planes still fill the GPU).
// SPAN (B not a multiple of PACK, bn::plane_bits): W = plane_packs, the packs at a plane's ends
// hold other channels' elements, skipped; else W = B / PACK, every pack whole, and the loop is
// the plain one (no per-pack bit test, 32 bytes in flight a thread: bn::unroll_for).
template <typename T, int PACK, bool SPAN>
__global__ void __launch_bounds__(kBnReduceThreads)
    batch_norm_stats_planes(const T* __restrict__ x, bn::Stats<typename Num<T>::compute>* part,
                            i64 A, int Cn, int B, int W, unsigned w_m, unsigned w_s, int S,
                            CUKERN_BN_FINISH_PARAMS(typename Num<T>::compute)) {
  typedef typename Num<T>::compute C;
  constexpr int U = SPAN ? bn::unroll_reduce(PACK * sizeof(T)) : bn::unroll_for(PACK * sizeof(T));
  const int c = blockIdx.x, s = blockIdx.y;
  // the split's packs [f0, f1) of the channel's A * W, as plane a0 and offsets in its run
  const i64 f0 = A * W * s / S, f1 = A * W * (s + 1) / S, a0 = f0 / W;
  const unsigned j_lo = static_cast<unsigned>(f0 - a0 * W), L = static_cast<unsigned>(f1 - a0 * W);
  const bn::FastDiv div{static_cast<unsigned>(W), w_m, w_s};
  const i64 plane_stride = static_cast<i64>(Cn) * B;
  const i64 first = (a0 * Cn + c) * B;  // the split's first plane's first element
  // every thread shifts by the split's first value of the channel (one broadcast load)
  bn::Running<C> run{bn::Stats<C>::identity(), {Num<T>::to(x[first]), C(0), C(0)}, 0};
  bn::Shifted<C>& acc = run.cur;
  int& n = run.n;
  const unsigned nt = blockDim.x;
  for (unsigned j0 = j_lo + threadIdx.x; j0 < L; j0 += nt * U) {
    if (n >= bn::kFoldValues) run.fold();
    Pack<T, PACK> p[U];
    unsigned in[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const unsigned j = j0 + u * nt;
      in[u] = 0;
      if (j < L) {
        const unsigned a = div.div(j), w = j - a * W;
        if (SPAN) {
          const i64 start = first + a * plane_stride;
          in[u] = bn::plane_bits<PACK>(static_cast<int>(w) * PACK -
                                       static_cast<int>(start % PACK), B);
          if (in[u] != 0u) p[u] = bn::load_pack<T, PACK>(x, start / PACK + w);
        } else {
          in[u] = bn::kFullPack<PACK>;
          p[u] = bn::load_pack<T, PACK>(x, (first + a * plane_stride) / PACK + w);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (in[u] == bn::kFullPack<PACK>) {
        n += PACK;
#pragma unroll
        for (int k = 0; k < PACK; ++k) acc.add(pack_value(p[u], k));
      } else if (SPAN && in[u] != 0u) {  // a plane's end packs
        n += __popc(in[u]);
#pragma unroll
        for (int k = 0; k < PACK; ++k)
          if ((in[u] >> k) & 1u) acc.add(pack_value(p[u], k));
      }
    }
  }
  unsigned phase = 0;
  const bn::Stats<C> w = allreduce_block(run.stats(), phase);
  if (threadIdx.x != 0) return;
  if (S == 1) {  // the whole channel: finish it here, no merge launch
    bn::Finish<C>{CUKERN_BN_FINISH_ARGS}(c, w);
  } else {
    part[static_cast<i64>(c) * S + s] = w;
  }
}

// Statistics, columns layout: block (TX, TY) covers channel packs [TX blockIdx.x, +TX) over the
// rows [A s / S, A (s + 1) / S), s = blockIdx.y; a thread keeps PACK channels' states, the block
// folds its rows in shared memory (blockDim.x * blockDim.y * PACK states).
template <typename T, int PACK>
__global__ void __launch_bounds__(kBnReduceThreads)
    batch_norm_stats_cols(const T* __restrict__ x, bn::Stats<typename Num<T>::compute>* part,
                          i64 A, int Cp, int S, CUKERN_BN_FINISH_PARAMS(typename Num<T>::compute)) {
  typedef typename Num<T>::compute C;
  constexpr int U = bn::unroll_reduce(PACK * sizeof(T));
  const int s = blockIdx.y, tx = threadIdx.x, ty = threadIdx.y, ny = blockDim.y;
  const int cp = blockIdx.x * blockDim.x + tx;
  const bool valid = cp < Cp;
  const i64 r0 = A * s / S, r1 = A * (s + 1) / S;
  // every thread of a column shifts by the split's first row (one pack, the same for all rows)
  bn::Shifted<C> acc[PACK] = {};
  int n = 0;
  if (valid) {
    const Pack<T, PACK> k0 = bn::load_pack<T, PACK>(x, r0 * Cp + cp);
#pragma unroll
    for (int k = 0; k < PACK; ++k) acc[k] = bn::Shifted<C>{pack_value(k0, k), C(0), C(0)};
    for (i64 r = r0 + ty; r < r1; r += static_cast<i64>(ny) * U) {
      Pack<T, PACK> p[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const i64 ru = r + static_cast<i64>(u) * ny;
        if (ru < r1) p[u] = bn::load_pack<T, PACK>(x, ru * Cp + cp);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (r + static_cast<i64>(u) * ny < r1) {
          n += 1;
#pragma unroll
          for (int k = 0; k < PACK; ++k) acc[k].add(pack_value(p[u], k));
        }
      }
    }
  }
  bn::Stats<C>* sm = dynamic_smem<bn::Stats<C>>();
#pragma unroll
  for (int k = 0; k < PACK; ++k) sm[(ty * blockDim.x + tx) * PACK + k] = acc[k].stats(n);
  bn::cols_finish_or_store<PACK>(sm, part, S, s, cp, valid,
                                 bn::Finish<C>{CUKERN_BN_FINISH_ARGS});
}

// Per channel (a warp or a block each: bn::Merger; blockDim (32, Y)): training merges the S
// partial states in a fixed order, writes mean, invstd (and the biased variance), updates the
// running statistics with the unbiased variance; eval takes mean and variance from the running
// statistics. Both write the coefficients {mean, weight * invstd, bias} of the apply pass.
template <typename C>
__global__ void __launch_bounds__(256)
    batch_norm_finalize(const bn::Stats<C>* __restrict__ part, int S, int Cn,
                        CUKERN_BN_FINISH_PARAMS(C)) {
  const bn::Merger g(Cn);
  if (g.c >= Cn) return;  // a whole warp (of a warp-a-channel block)
  bn::Stats<C> st = bn::Stats<C>::identity();
  if (training) st = bn::fold_partials(part + static_cast<i64>(g.c) * S, S, g.t, g.nt, g.block);
  if (g.t == 0) bn::Finish<C>{CUKERN_BN_FINISH_ARGS}(g.c, st);
}

// y = relu?((x - mean) * scale + shift [+ addend]) over the flat packs of the tensor (coef
// null: eval, the coefficients computed from running_mean, running_var, weight, bias and eps
// as the finalize kernel would, saving its launch), grid-strided: each thread takes U packs
// G = gridDim.x * blockDim.x apart (planes: bn::unroll_for, ~32 bytes; columns:
// bn::unroll_cols, ~128 bytes of x and addend), so each warp covers 32 consecutive packs at a
// time (the mask's ballots); the grid is about one wave, so a thread loops over many packs.
// j = the pack's index within one (C, B) sample (CBp packs); its channels are bn::plane_span(j)
// (planes: one, or two where B is not a multiple of PACK) or PACK j.. (columns, where the host
// makes G a multiple of CBp, so a thread's channels never change and their coefficients,
// loaded once, stay in registers). mask (or null): ceil(numel / 32) words.
template <typename T, int PACK, bool COLS, bool ADD, bool SPAN>
__global__ void __launch_bounds__(256)
    batch_norm_apply(const T* __restrict__ x, const T* __restrict__ addend,
                     const bn::Coef<typename Num<T>::compute>* __restrict__ coef,
                     T* __restrict__ y, unsigned* __restrict__ mask, i64 total, int CBp, int d,
                     unsigned d_m, unsigned d_s, unsigned upp, int relu,
                     const typename Num<T>::compute* running_mean,
                     const typename Num<T>::compute* running_var,
                     const typename Num<T>::compute* weight,
                     const typename Num<T>::compute* bias, typename Num<T>::compute eps) {
  typedef typename Num<T>::compute C;
  constexpr int U = COLS ? bn::unroll_cols((ADD ? 2 : 1) * PACK * static_cast<int>(sizeof(T)))
                         : bn::unroll_for(PACK * sizeof(T));
  const i64 G = static_cast<i64>(gridDim.x) * blockDim.x;
  const int lane = static_cast<int>(lane_id());
  const i64 warp0 = static_cast<i64>(blockIdx.x) * blockDim.x + (threadIdx.x - lane);
  const bn::FastDiv div{static_cast<unsigned>(d), d_m, d_s};
  const unsigned rG = static_cast<unsigned>(G % CBp);
  unsigned j = static_cast<unsigned>((warp0 + lane) % CBp);
  const i64 nwords = (total * PACK + 31) / 32;
  const bn::EvalParams<C> params{running_mean, running_var, weight, bias, eps};
  bn::Coef<C> fixed[COLS ? PACK : 1];
  if (COLS) {
#pragma unroll
    for (int k = 0; k < (COLS ? PACK : 1); ++k) fixed[k] = params(coef, j * PACK + k);
  }
  for (i64 wb = warp0; wb < total; wb += G * U) {
    Pack<T, PACK> xv[U], av[U];
    unsigned ju[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 t = wb + u * G + lane;
      ju[u] = j;
      if (t < total) {
        xv[u] = bn::load_pack<T, PACK>(x, t);
        if (ADD) av[u] = bn::load_pack<T, PACK>(addend, t);
      }
      j += rG;
      if (j >= static_cast<unsigned>(CBp)) j -= CBp;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 wbu = wb + u * G;
      if (wbu >= total) break;  // the whole warp
      const i64 t = wbu + lane;
      const bool ok = t < total;
      bn::Coef<C> q0, q1;
      int n0 = PACK;
      if (!COLS) {
        const bn::PlaneSpan sp = bn::plane_span<SPAN, PACK>(div, ju[u], upp);
        n0 = sp.n0;
        q0 = params(coef, sp.c0);
        q1 = SPAN && n0 < PACK ? params(coef, sp.c0 + 1) : q0;
      }
      C v[PACK];
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        const bn::Coef<C> qk = COLS ? fixed[COLS ? k : 0] : (!SPAN || k < n0 ? q0 : q1);
        v[k] = (pack_value(xv[u], k) - qk.mean) * qk.a + qk.b;
        if (ADD) v[k] += pack_value(av[u], k);
        if (relu) v[k] = v[k] < C(0) ? C(0) : v[k];
      }
      if (ok) bn::store_pack<T, PACK>(y, t, v);
      if (mask != nullptr) bn::write_mask<PACK>(mask, wbu, v, ok, nwords);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward. g = dy where the mask keeps it (dy without a mask); per channel the partial sums
// (sum g, sum g * (x - mean)), shaped as the statistics kernels.
template <typename T, int PACK, bool SPAN>
__global__ void __launch_bounds__(kBnReduceThreads)
    batch_norm_grad_planes(const T* __restrict__ dy, const T* __restrict__ x,
                           const unsigned* __restrict__ mask,
                           const typename Num<T>::compute* __restrict__ mean,
                           bn::GradSums<typename Num<T>::compute>* part, i64 A, int Cn, int B,
                           int W, unsigned w_m, unsigned w_s, int S,
                           CUKERN_BN_GRAD_FINISH_PARAMS(typename Num<T>::compute)) {
  typedef typename Num<T>::compute C;
  constexpr int U = SPAN ? bn::unroll_reduce(PACK * sizeof(T)) : bn::unroll_for(PACK * sizeof(T));
  const int c = blockIdx.x, s = blockIdx.y;
  // the split's packs [f0, f1) of the channel's A * W, as plane a0 and offsets in its run
  const i64 f0 = A * W * s / S, f1 = A * W * (s + 1) / S, a0 = f0 / W;
  const unsigned j_lo = static_cast<unsigned>(f0 - a0 * W), L = static_cast<unsigned>(f1 - a0 * W);
  const bn::FastDiv div{static_cast<unsigned>(W), w_m, w_s};
  const i64 plane_stride = static_cast<i64>(Cn) * B;
  const i64 first = (a0 * Cn + c) * B;  // the split's first plane's first element
  const C m = mean[c];
  C sg = C(0), sgx = C(0);
  const unsigned nt = blockDim.x;
  for (unsigned j0 = j_lo + threadIdx.x; j0 < L; j0 += nt * U) {
    Pack<T, PACK> pd[U], px[U];
    unsigned bits[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const unsigned j = j0 + u * nt;
      bits[u] = 0;
      if (j < L) {
        const unsigned a = div.div(j), w = j - a * W;
        const i64 start = first + a * plane_stride;
        const unsigned in = SPAN ? bn::plane_bits<PACK>(static_cast<int>(w) * PACK -
                                                        static_cast<int>(start % PACK), B)
                                 : bn::kFullPack<PACK>;
        if (in != 0u) {
          const i64 i = start / PACK + w;
          pd[u] = bn::load_pack<T, PACK>(dy, i);
          px[u] = bn::load_pack<T, PACK>(x, i);
          bits[u] = in & (mask != nullptr ? bn::mask_bits<PACK>(mask, i) : ~0u);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {  // bits[u] == 0 past the split or the plane: nothing added
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        const bool keep = (bits[u] >> k) & 1u;
        const C g = pack_value(pd[u], k);
        sg += keep ? g : C(0);
        sgx += keep ? g * (pack_value(px[u], k) - m) : C(0);
      }
    }
  }
  unsigned phase = 0;
  const bn::GradSums<C> r = allreduce_block(bn::GradSums<C>{{sg, sgx}}, phase);
  if (threadIdx.x != 0) return;
  if (S == 1) {  // the whole channel: finish it here, no merge launch
    bn::GradFinish<C>{CUKERN_BN_GRAD_FINISH_ARGS}(c, r);
  } else {
    part[static_cast<i64>(c) * S + s] = r;
  }
}

// At least 3 blocks an SM (the planner's bn_cols_reduce_blocks_per_sm): ptxas gave
// grad_cols<bf16, 8> 128 registers (2 blocks) unbounded, 79 with no spill bounded.
template <typename T, int PACK>
__global__ void __launch_bounds__(kBnReduceThreads, 3)
    batch_norm_grad_cols(const T* __restrict__ dy, const T* __restrict__ x,
                         const unsigned* __restrict__ mask,
                         const typename Num<T>::compute* __restrict__ mean,
                         bn::GradSums<typename Num<T>::compute>* part, i64 A, int Cp, int S,
                         CUKERN_BN_GRAD_FINISH_PARAMS(typename Num<T>::compute)) {
  typedef typename Num<T>::compute C;
  constexpr int U = bn::unroll_reduce(PACK * sizeof(T));
  const int s = blockIdx.y, tx = threadIdx.x, ty = threadIdx.y, ny = blockDim.y;
  const int cp = blockIdx.x * blockDim.x + tx;
  const bool valid = cp < Cp;
  const i64 r0 = A * s / S, r1 = A * (s + 1) / S;
  C m[PACK], sg[PACK], sgx[PACK];
#pragma unroll
  for (int k = 0; k < PACK; ++k) {
    m[k] = valid ? mean[cp * PACK + k] : C(0);
    sg[k] = sgx[k] = C(0);
  }
  if (valid) {
    for (i64 r = r0 + ty; r < r1; r += static_cast<i64>(ny) * U) {
      Pack<T, PACK> pd[U], px[U];
      unsigned bits[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const i64 ru = r + static_cast<i64>(u) * ny;
        bits[u] = 0;
        if (ru < r1) {
          const i64 i = ru * Cp + cp;
          pd[u] = bn::load_pack<T, PACK>(dy, i);
          px[u] = bn::load_pack<T, PACK>(x, i);
          bits[u] = mask != nullptr ? bn::mask_bits<PACK>(mask, i) : ~0u;
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {  // bits[u] == 0 past the split: nothing added
#pragma unroll
        for (int k = 0; k < PACK; ++k) {
          const bool keep = (bits[u] >> k) & 1u;
          const C g = pack_value(pd[u], k);
          sg[k] += keep ? g : C(0);
          sgx[k] += keep ? g * (pack_value(px[u], k) - m[k]) : C(0);
        }
      }
    }
  }
  bn::GradSums<C>* sm = dynamic_smem<bn::GradSums<C>>();
#pragma unroll
  for (int k = 0; k < PACK; ++k)
    sm[(ty * blockDim.x + tx) * PACK + k] = bn::GradSums<C>{{sg[k], sgx[k]}};
  bn::cols_finish_or_store<PACK>(sm, part, S, s, cp, valid,
                                 bn::GradFinish<C>{CUKERN_BN_GRAD_FINISH_ARGS});
}

// Per channel (a warp or a block each: bn::Merger): the S partial sums merged in a fixed order,
// then bn::GradFinish.
template <typename C>
__global__ void __launch_bounds__(256)
    batch_norm_grad_finalize(const bn::GradSums<C>* __restrict__ part, int S, int Cn,
                             const C* __restrict__ mean, CUKERN_BN_GRAD_FINISH_PARAMS(C)) {
  const bn::Merger g(Cn);
  if (g.c >= Cn) return;  // a whole warp (of a warp-a-channel block)
  const bn::GradSums<C> st =
      bn::fold_partials(part + static_cast<i64>(g.c) * S, S, g.t, g.nt, g.block);
  if (g.t == 0) bn::GradFinish<C>{CUKERN_BN_GRAD_FINISH_ARGS}(g.c, st);
}

// dx = k1 * g + k2 * (x - mean) + k3 over the flat packs (as batch_norm_apply; columns:
// bn::unroll_cols of dy and x); x is not read when it is null (eval: k2 = 0). daddend (or
// null) = g.
template <typename T, int PACK, bool COLS, bool SPAN>
__global__ void __launch_bounds__(256)
    batch_norm_dx(const T* __restrict__ dy, const T* __restrict__ x,
                  const unsigned* __restrict__ mask,
                  const bn::Coef<typename Num<T>::compute>* __restrict__ coef,
                  T* __restrict__ dx, T* __restrict__ daddend, i64 total, int CBp, int d,
                  unsigned d_m, unsigned d_s, unsigned upp) {
  typedef typename Num<T>::compute C;
  constexpr int U = COLS ? bn::unroll_cols(2 * PACK * static_cast<int>(sizeof(T)))
                         : bn::unroll_for(PACK * sizeof(T));
  const i64 G = static_cast<i64>(gridDim.x) * blockDim.x;
  const int lane = static_cast<int>(lane_id());
  const i64 warp0 = static_cast<i64>(blockIdx.x) * blockDim.x + (threadIdx.x - lane);
  const bn::FastDiv div{static_cast<unsigned>(d), d_m, d_s};
  const unsigned rG = static_cast<unsigned>(G % CBp);
  unsigned j = static_cast<unsigned>((warp0 + lane) % CBp);
  bn::Coef<C> fixed[COLS ? PACK : 1];
  if (COLS) {
#pragma unroll
    for (int k = 0; k < (COLS ? PACK : 1); ++k) fixed[k] = coef[j * PACK + k];
  }
  for (i64 t0 = warp0 + lane; t0 - lane < total; t0 += G * U) {
    Pack<T, PACK> pd[U], px[U];
    unsigned bits[U], ju[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 t = t0 + u * G;
      ju[u] = j;
      bits[u] = 0;
      if (t < total) {
        pd[u] = bn::load_pack<T, PACK>(dy, t);
        if (x != nullptr) px[u] = bn::load_pack<T, PACK>(x, t);
        bits[u] = mask != nullptr ? bn::mask_bits<PACK>(mask, t) : ~0u;
      }
      j += rG;
      if (j >= static_cast<unsigned>(CBp)) j -= CBp;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 t = t0 + u * G;
      if (t >= total) continue;
      bn::Coef<C> q0, q1;
      int n0 = PACK;
      if (!COLS) {
        const bn::PlaneSpan sp = bn::plane_span<SPAN, PACK>(div, ju[u], upp);
        n0 = sp.n0;
        q0 = coef[sp.c0];
        q1 = SPAN && n0 < PACK ? coef[sp.c0 + 1] : q0;
      }
      C g[PACK], r[PACK];
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        const bn::Coef<C> qk = COLS ? fixed[COLS ? k : 0] : (!SPAN || k < n0 ? q0 : q1);
        g[k] = (bits[u] >> k) & 1u ? pack_value(pd[u], k) : C(0);
        r[k] = qk.a * g[k] + qk.c;
        if (x != nullptr) r[k] += qk.b * (pack_value(px[u], k) - qk.mean);
      }
      bn::store_pack<T, PACK>(dx, t, r);
      if (daddend != nullptr) bn::store_pack<T, PACK>(daddend, t, g);
    }
  }
}

}  // namespace cukern

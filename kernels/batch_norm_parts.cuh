// Batch norm's device helpers (kernels/batch_norm.cuh has the kernels): the launch-argument
// macros, Welford/Chan states and their merges, the ReLU mask's words, where a pack lies in the
// planes layout, the per-channel finishers and the fixed-order partial-state merges.
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
// ... and a one-read training block (the planner's bn_one_read_max_threads)
constexpr int kBnOneReadThreads = 512;

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

// ... and a thread of the columns statistics: about 128 bytes (16 packs of 8 bytes in 64
// registers), so that two blocks an SM (the H200's bn_cols_stats_blocks_per_sm) keep 64 KB of
// x in flight an SM; at four blocks 64 and 128 bytes ran alike.
__host__ __device__ constexpr int unroll_cols_stats(int bytes) {
  return bytes >= 128 ? 1 : (128 / bytes > 16 ? 16 : 128 / bytes);
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

// The ReLU bits of a pack at flat element e (a multiple of N) ORed into its mask word, for
// kernels whose warps do not cover whole words (the one-read planes kernel: a plane's end words
// are shared with the neighbouring planes' blocks). The mask is zeroed first; OR commutes, so
// the words are the same bits whatever order the blocks run in. Lanes whose packs share a word
// are consecutive: a segmented OR over up to 32 / N lanes (shuffles up, taken from lanes of the
// same word) leaves the word's bits in its last lane, which issues one atomic. Every lane of
// the warp must call it.
template <int N>
__device__ __forceinline__ void or_mask_bits(unsigned* mask, i64 e, unsigned bits, bool active) {
  const int lane = static_cast<int>(lane_id());
  unsigned word = active ? bits << (e & 31) : 0u;
  // word indices in 32 bits: a warp's packs lie within 2^37 elements (inactive lanes: indices
  // no mask of GPU memory reaches)
  const unsigned wi = active ? static_cast<unsigned>(e >> 5) : ~0u - lane;
#pragma unroll
  for (int off = 1; off < 32 / N; off *= 2) {
    const unsigned v = __shfl_up_sync(0xffffffffu, word, off);
    const unsigned w = __shfl_up_sync(0xffffffffu, wi, off);
    if (lane >= off && w == wi) word |= v;
  }
  const unsigned next = __shfl_down_sync(0xffffffffu, wi, 1);
  if (active && (lane == 31 || next != wi) && word != 0u) atomicOr(mask + (e >> 5), word);
}

// A pack copied from global to shared memory without registers (cp.async) where it is 4 bytes
// or more, else through a register; the thread that copies it is the one that reads it back.
template <typename W> __device__ __forceinline__ void pack_to_smem(W* dst, const W* src) {
  if constexpr (sizeof(W) >= 4) {
    cp_async<static_cast<int>(sizeof(W))>(dst, src);
  } else {
    *dst = *src;
  }
}

// A thread's `mine` packs copied to shared memory in kCopyGroups groups (copy(i) issues the
// i-th's cp.async), each handed to use(i) once its group has landed: the columns one-read
// kernel sums the first packs while the later ones are still in flight.
constexpr int kCopyGroups = 4;
template <typename Copy, typename Use>
__device__ __forceinline__ void copy_then_use(int mine, const Copy& copy, const Use& use) {
#pragma unroll
  for (int g = 0; g < kCopyGroups; ++g) {
    for (int i = mine * g / kCopyGroups; i < mine * (g + 1) / kCopyGroups; ++i) copy(i);
    cp_async_commit();
  }
#pragma unroll
  for (int g = 0; g < kCopyGroups; ++g) {
    if (g == 0) cp_async_wait_group<kCopyGroups - 1>();
    if (g == 1) cp_async_wait_group<kCopyGroups - 2>();
    if (g == 2) cp_async_wait_group<kCopyGroups - 3>();
    if (g == 3) cp_async_wait_group<0>();
    for (int i = mine * g / kCopyGroups; i < mine * (g + 1) / kCopyGroups; ++i) use(i);
  }
}

// Element k of a pack in the compute type, for the columns reductions: float16 values come
// out of their 32-bit word by a half selector of the conversion (pack_value goes through the
// 16-bit element: a shift or move first, 1.5 instructions a value more).
template <typename T, int N>
__device__ __forceinline__ typename Num<T>::compute value(const Pack<T, N>& p, int k) {
  return pack_value(p, k);
}
template <int N> __device__ __forceinline__ float value(const Pack<f16, N>& p, int k) {
  if constexpr (N >= 2) {
    const unsigned w = reinterpret_cast<const unsigned*>(&p.word)[k / 2];
    float f;
    if (k % 2) {
      asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, h;}" : "=f"(f) : "r"(w));
    } else {
      asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; cvt.f32.f16 %0, l;}" : "=f"(f) : "r"(w));
    }
    return f;
  } else {
    return pack_value(p, k);
  }
}

// The rows of a columns reduction's thread: `count` rows `step` packs apart from pack index
// `i`, U at a time. load(i) issues one row's loads and returns them; use(item) consumes them.
// Whole groups of U take no bounds tests (a pointer step a row); the last part group loads
// its rows at once under a predicate, so no row waits for another's load.
template <int U, typename Item, typename Load, typename Use>
__device__ __forceinline__ void for_rows(i64 i, i64 step, unsigned count, const Load& load,
                                         const Use& use) {
  unsigned done = 0;
  for (; done + U <= count; done += U) {
    Item v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = load(i + u * step);
    i += U * step;
#pragma unroll
    for (int u = 0; u < U; ++u) use(v[u]);
  }
  const unsigned rest = count - done;
  if (rest != 0u) {
    Item v[U];
#pragma unroll
    for (int u = 0; u < U - 1; ++u)
      if (u < rest) v[u] = load(i + u * step);
#pragma unroll
    for (int u = 0; u < U - 1; ++u)
      if (u < rest) use(v[u]);
  }
}

// How many of the rows first, first + step, ... lie below `end` (first >= 0).
__device__ __forceinline__ unsigned rows_below(i64 first, i64 end, int step) {
  return first < end ? static_cast<unsigned>((end - 1 - first) / step) + 1u : 0u;
}

// The N mask bits of the pack at flat pack index i (all in one word: 32 % N == 0).
template <int N> __device__ __forceinline__ unsigned mask_bits(const unsigned* mask, i64 i) {
  const i64 e = i * N;
  return (__ldg(mask + (e >> 5)) >> (e & 31)) & ((N == 32 ? 0u : (1u << N)) - 1u);
}

// Eval's 1 / sqrt(running_var + eps). The planes apply pass computes it a pack at a time (the
// pack's channel changes from one to the next), so float takes rsqrtf (one MUFU.RSQ, within 2
// ulp) instead of an IEEE square root and division; double keeps those. batch_norm_finalize
// uses it too in eval. !FAST (float32 planes whose packs lie in one channel): a rounded square
// root and a fast division (within 2 ulp), whose branch keeps the kernel at 32 registers, 8
// blocks an SM (rsqrtf's took 37: eval (64, 1024, 14, 14) -1.5 points of copy on the H200);
// there y may differ in the last bit with return_stats, whose coefficients are rsqrtf's.
template <bool FAST = true> __device__ __forceinline__ float eval_invstd(float v) {
  return FAST ? rsqrtf(v) : __fdividef(1.0f, __fsqrt_rn(v));
}
template <bool FAST = true> __device__ __forceinline__ double eval_invstd(double v) {
  return 1.0 / sqrt(v);
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
  // The channel's values it reads (running statistics, weight, bias): read where used
  // (Direct), or loaded ahead (Inputs, from load(c)) by the merge kernel, whose merge then
  // overlaps their latency.
  struct Direct {
    const Finish& f;
    int c;
    __device__ __forceinline__ C rm() const { return f.running_mean[c]; }
    __device__ __forceinline__ C rv() const { return f.running_var[c]; }
    __device__ __forceinline__ C w() const { return f.weight != nullptr ? f.weight[c] : C(1); }
    __device__ __forceinline__ C b() const { return f.bias != nullptr ? f.bias[c] : C(0); }
  };
  struct Inputs {
    C rm_, rv_, w_, b_;
    __device__ __forceinline__ C rm() const { return rm_; }
    __device__ __forceinline__ C rv() const { return rv_; }
    __device__ __forceinline__ C w() const { return w_; }
    __device__ __forceinline__ C b() const { return b_; }
  };
  __device__ __forceinline__ Inputs load(int c) const {
    const Direct d{*this, c};
    return Inputs{running_mean != nullptr ? d.rm() : C(0),
                  running_var != nullptr ? d.rv() : C(0), d.w(), d.b()};
  }
  __device__ __forceinline__ void operator()(int c, const Stats<C>& st) const {
    (*this)(c, st, Direct{*this, c});
  }
  template <typename In>
  __device__ __forceinline__ void operator()(int c, const Stats<C>& st, const In& in) const {
    C mean, var;
    if (training) {
      mean = st.mean;
      var = st.m2 / count;
    } else {
      mean = in.rm();
      var = in.rv();
    }
    const C invstd = training ? C(1) / sqrt(var + eps) : eval_invstd(var + eps);
    if (training) {
      if (running_mean != nullptr)
        running_mean[c] = (C(1) - momentum) * in.rm() + momentum * mean;
      if (running_var != nullptr)
        running_var[c] = (C(1) - momentum) * in.rv() + momentum * (st.m2 / (count - C(1)));
    }
    if (mean_out != nullptr) mean_out[c] = mean;
    if (invstd_out != nullptr) invstd_out[c] = invstd;
    if (var_out != nullptr) var_out[c] = var;
    if (coef != nullptr) coef[c] = Coef<C>{mean, in.w() * invstd, in.b(), C(0)};
  }
};

// A channel's forward coefficients: the finalize kernel's, or (coef null: eval without
// statistics outputs) computed here from the running statistics, as batch_norm_finalize does.
template <typename C, bool FAST = true> struct EvalParams {
  const C *mean, *var, *weight, *bias;
  C eps;
  __device__ __forceinline__ Coef<C> operator()(const Coef<C>* coef, unsigned c) const {
    if (coef != nullptr) return coef[c];
    const C invstd = eval_invstd<FAST>(__ldg(var + c) + eps);
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

// Where pack j of a channel's run of A planes of W = B / PACK packs lies (the planes
// reductions' order: plane a = j / W, pack w = j % W of it; B a multiple of PACK): its flat
// pack index.
struct PlaneWalk {
  FastDiv div;
  int W;
  i64 first, plane_stride;  // the channel's first pack; packs between its planes
  __device__ __forceinline__ i64 at(unsigned j) const {
    const unsigned a = div.div(j);
    return first + a * plane_stride + (j - a * W);
  }
};

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

}  // namespace cukern

// All-reduces over reduction states, with the shape read from the launch: a group of
// blockDim.x lanes (allreduce_group), or the block of blockDim.x * blockDim.y threads, a multiple
// of 32 up to 1024 (allreduce_block). cluster.cuh reduces the same states across a cluster.
//
// A state S is a trivial struct with
//   static S identity();  static S merge(const S& a, const S& b);
//   S shfl_xor(int mask) const;          (every lane of the warp calls it)
//   static S remote(unsigned addr);      (clusters: reads a state from another block's shared
//       memory; defined in cluster.cuh)
//   void put_remote(unsigned addr, unsigned bar) const;  (allreduce_cluster_async only: stores
//       every field to another block's shared memory with cluster_store_async, sizeof(S) bytes
//       counted off `bar` there; defined in cluster.cuh)
// merge must be commutative bit for bit (merge(a, b) == merge(b, a) exactly), so that both
// lanes of a butterfly step, and every warp reducing the same partials, end with bit-identical
// results with no lane-dependent operand order (which would diverge the warp).
#pragma once
#include "memory.cuh"
#include "types.cuh"

namespace cukern {

__device__ __forceinline__ unsigned lane_id() {
  unsigned l;
  asm("mov.u32 %0, %%laneid;" : "=r"(l));
  return l;
}

// K values of one reduction carried together (one shuffle round for all of them). Op gives the
// identity and a combination that is commutative bit for bit.
template <typename C, int K, typename Op> struct Lanes {
  C v[K];
  static __device__ __forceinline__ Lanes identity() {
    Lanes s;
#pragma unroll
    for (int k = 0; k < K; ++k) s.v[k] = Op::template identity<C>();
    return s;
  }
  static __device__ __forceinline__ Lanes merge(const Lanes& a, const Lanes& b) {
    Lanes s;
#pragma unroll
    for (int k = 0; k < K; ++k) s.v[k] = Op::apply(a.v[k], b.v[k]);
    return s;
  }
  __device__ __forceinline__ Lanes shfl_xor(int mask) const {
    Lanes s;
#pragma unroll
    for (int k = 0; k < K; ++k) s.v[k] = __shfl_xor_sync(0xffffffffu, v[k], mask);
    return s;
  }
  static __device__ Lanes remote(unsigned addr);
  __device__ void put_remote(unsigned addr, unsigned bar) const;
};

struct AddOp {
  template <typename C> static __device__ __forceinline__ C identity() { return C(0); }
  template <typename C> static __device__ __forceinline__ C apply(C a, C b) { return a + b; }
};
// NaN wins (max_nan_commutative).
struct MaxOp {
  template <typename C> static __device__ __forceinline__ C identity() { return -Math<C>::inf(); }
  template <typename C> static __device__ __forceinline__ C apply(C a, C b) {
    return max_nan_commutative(a, b);
  }
};

template <typename C, int K> using Sums = Lanes<C, K, AddOp>;
template <typename C, int K> using Maxes = Lanes<C, K, MaxOp>;

// Welford's running (count, mean, sum of squared deviations). merge is Chan et al.'s pairwise
// update in a symmetric form: n = na + nb, m = (na * ma + nb * mb) / n,
// M2 = M2a + M2b + (mb - ma)^2 * na * nb / n. Every operation is commutative and the products
// are not contracted into fused multiply-adds, so merge(a, b) == merge(b, a) exactly. Empty
// states (n = 0) merge to the other state; the 1 / n is the fast reciprocal (2 ulp), far below
// what it scales.
template <typename C> struct Welford {
  C n, mean, m2;
  static __device__ __forceinline__ Welford identity() { return Welford{C(0), C(0), C(0)}; }
  static __device__ __forceinline__ Welford merge(const Welford& a, const Welford& b) {
    const C n = a.n + b.n;
    const C inv = n > C(0) ? Math<C>::div_fast(C(1), n) : C(0);
    const C d = b.mean - a.mean;
    const C mean = mul_rn(add_rn(mul_rn(a.n, a.mean), mul_rn(b.n, b.mean)), inv);
    const C m2 = add_rn(add_rn(a.m2, b.m2), mul_rn(mul_rn(mul_rn(d, d), mul_rn(a.n, b.n)), inv));
    return Welford{n, mean, m2};
  }
  // Folds N values into a thread's own state: their exact two-pass mean m and M2 q, then a
  // merge that moves the mean by its change, mean + (m - mean) * N / n, rounded relative to
  // the change. merge's symmetric form rounds relative to the mean itself (and by the fast
  // reciprocal's error): over a thread's few hundred folds, with a large value first (1e4
  // among values of 1e-3), that drifts a float32 mean by up to 3e-5 in a NumPy model with a
  // reciprocal 1 ulp off, 1.6e-6 this way. Where the change is NaN (an infinity met), merge's
  // form gives the mean IEEE arithmetic does.
  template <int N> __device__ __forceinline__ void add(const C* v) {
    C s = C(0);
#pragma unroll
    for (int i = 0; i < N; ++i) s += v[i];
    const C m = s / C(N);
    C q = C(0);
#pragma unroll
    for (int i = 0; i < N; ++i) q += (v[i] - m) * (v[i] - m);
    const C n1 = n + C(N);
    const C f = Math<C>::div_fast(C(N), n1);  // N / n1
    const C d = m - mean;
    C next = mean + d * f;
    if (next != next) next = (n * mean + s) * Math<C>::div_fast(C(1), n1);
    m2 += q + d * d * (n * f);
    mean = next;
    n = n1;
  }
  __device__ __forceinline__ Welford shfl_xor(int mask) const {
    return Welford{__shfl_xor_sync(0xffffffffu, n, mask), __shfl_xor_sync(0xffffffffu, mean, mask),
                   __shfl_xor_sync(0xffffffffu, m2, mask)};
  }
  static __device__ Welford remote(unsigned addr);
};

// Online softmax state: the running max m and the sum d of exp(x - m) seen so far (exp_fast:
// 2 ulp on a sum of positive terms). Empty (m = -inf, d = 0) until a finite value arrives. A NaN
// makes m NaN, and d with it; merge is commutative bit for bit (max_nan_commutative, then one
// addition).
template <typename C> struct MaxSum {
  C m, d;
  static __device__ __forceinline__ MaxSum identity() { return MaxSum{-Math<C>::inf(), C(0)}; }
  // A partial sum rescaled to a new max; an empty part (m == -inf) contributes nothing.
  __device__ __forceinline__ C sum_at(C new_m) const {
    return m == -Math<C>::inf() ? C(0) : d * Math<C>::exp_fast(m - new_m);
  }
  static __device__ __forceinline__ MaxSum merge(const MaxSum& a, const MaxSum& b) {
    const C m = max_nan_commutative(a.m, b.m);
    return MaxSum{m, a.sum_at(m) + b.sum_at(m)};
  }
  // Folds N values into the state with one rescale.
  template <int N> __device__ __forceinline__ void add(const C* v) {
    C pm = m;
#pragma unroll
    for (int i = 0; i < N; ++i) pm = max_nan(pm, v[i]);
    if (pm == -Math<C>::inf()) return;  // nothing but -inf so far: the state stays empty
    C s = sum_at(pm);
#pragma unroll
    for (int i = 0; i < N; ++i) s += Math<C>::exp_fast(v[i] - pm);
    m = pm;
    d = s;
  }
  __device__ __forceinline__ MaxSum shfl_xor(int mask) const {
    return MaxSum{__shfl_xor_sync(0xffffffffu, m, mask), __shfl_xor_sync(0xffffffffu, d, mask)};
  }
  static __device__ MaxSum remote(unsigned addr);
};

// R states side by side (a pass's rows), all-reduced together: one barrier for all of them.
// remote() reads them where merge_cluster's slot holds them, R structs in a row.
template <typename S, int R> struct Several {
  S s[R];
  static __device__ __forceinline__ Several identity() {
    Several t;
#pragma unroll
    for (int r = 0; r < R; ++r) t.s[r] = S::identity();
    return t;
  }
  static __device__ __forceinline__ Several merge(const Several& a, const Several& b) {
    Several t;
#pragma unroll
    for (int r = 0; r < R; ++r) t.s[r] = S::merge(a.s[r], b.s[r]);
    return t;
  }
  __device__ __forceinline__ Several shfl_xor(int mask) const {
    Several t;
#pragma unroll
    for (int r = 0; r < R; ++r) t.s[r] = s[r].shfl_xor(mask);
    return t;
  }
  static __device__ __forceinline__ Several remote(unsigned addr) {
    Several t;
#pragma unroll
    for (int r = 0; r < R; ++r) t.s[r] = S::remote(addr + r * static_cast<unsigned>(sizeof(S)));
    return t;
  }
};

// All-reduce inside groups of `width` consecutive lanes (a power of two <= 32, the same for the
// whole warp). Every lane of the warp must call it.
template <typename S> __device__ __forceinline__ S allreduce_group(S v, int width) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) {
    if (mask < width) v = S::merge(v, v.shfl_xor(mask));
  }
  return v;
}

// MaxSum's all-reduce in two cheap passes instead of merges (two exponentials each, in every
// lane of every warp): the max over the group, then the sum of each lane's d rescaled to it. Every
// lane ends with the same bits (a max, then a butterfly of additions).
template <typename C> __device__ __forceinline__ MaxSum<C> allreduce_group(MaxSum<C> v, int width) {
  const C m = allreduce_group(Maxes<C, 1>{{v.m}}, width).v[0];
  return MaxSum<C>{m, allreduce_group(Sums<C, 1>{{v.sum_at(m)}}, width).v[0]};
}

// All-reduce over the whole block, with one barrier. Every thread must call it, with the same
// `phase` (a counter each thread keeps, starting at 0, that the call advances): it picks one of
// two buffers for the warps' partial states, so a call never overwrites partials that threads
// may still be reading from the previous call (a thread reaching the call after that has passed
// the barrier of the one between). Every warp reduces the partials itself: no broadcast.
// allreduce_block_into: the all-reduce given this call's buffer of one state a warp, `slots`.
// allreduce_block picks its static buffer by a constant stride: a run-time stride changed the
// register allocation of its callers (docs/notes/layer-norm-backward.md).
template <typename S> __device__ __forceinline__ S allreduce_block_into(S v, S* slots) {
  const int tid = threadIdx.x + blockDim.x * threadIdx.y;
  const int warp = tid / 32, nwarps = (blockDim.x * blockDim.y + 31) / 32;
  const unsigned lane = lane_id();
  v = allreduce_group(v, 32);
  if (lane == 0) slots[warp] = v;
  __syncthreads();
  return allreduce_group(static_cast<int>(lane) < nwarps ? slots[lane] : S::identity(), 32);
}
template <typename S> __device__ __forceinline__ S allreduce_block(S v, unsigned& phase) {
  __shared__ S partial[2][32];
  return allreduce_block_into(v, partial[phase++ & 1u]);
}
// allreduce_block with its buffers static, or (TAIL) at the end of the dynamic shared memory,
// before a cluster merge's four slots of MERGE bytes (memory.cuh's tail_scratch). BUFFERS = 1
// (TAIL only): one buffer, which the caller must not write again before a barrier that every
// thread reaches after reading it (a cluster merge's, or its own __syncthreads).
template <bool TAIL, int MERGE = 0, int BUFFERS = 2, typename S>
__device__ __forceinline__ S allreduce_block_in(S v, unsigned& phase) {
  static_assert(BUFFERS == 2 || (TAIL && BUFFERS == 1), "BUFFERS: 2, or 1 in the tail");
  if constexpr (TAIL) {
    const unsigned nwarps = (blockDim.x * blockDim.y + 31) / 32;
    const unsigned b = phase++ & 1u;  // counted with one buffer too: a cluster merge's phase
    return allreduce_block_into(v, tail_scratch<S, MERGE, BUFFERS>() + (BUFFERS - 1) * b * nwarps);
  } else {
    return allreduce_block(v, phase);
  }
}

// A kernel's all-reduces over one block, behind the interface that ClusterReduce (cluster.cuh)
// gives them over a cluster, so a rows loop is written once for both. `last`: the block's final
// call. operator(): a state over the block (or cluster); block(): over the block alone; blocks():
// merges block-uniform states over the cluster (here: nothing to merge). `meanwhile()` runs once
// in each call of operator() and blocks() (in a cluster, while its barrier is pending).
// finish(): before the block exits, after the final call. (Functors, not generic lambdas: NVRTC
// compiles a generic lambda's call operator as host code when many kernels share a program.)
// TAIL: the all-reduce's buffers at the end of the dynamic shared memory (memory.cuh's
// tail_scratch, where the planner adds them), not static.
template <bool TAIL = false> struct BlockReduce {
  static constexpr bool kCluster = false;
  static constexpr bool kOneBuffer = false;  // two all-reduce buffers (allreduce_block_in)
  unsigned phase = 0;  // allreduce_block's buffer phase
  template <typename S, typename F>
  __device__ __forceinline__ S operator()(const S& v, bool, const F& meanwhile) {
    meanwhile();
    return block(v);
  }
  template <typename S> __device__ __forceinline__ S operator()(const S& v, bool last) {
    return (*this)(v, last, [] {});
  }
  template <typename S> __device__ __forceinline__ S block(const S& v) {
    return allreduce_block_in<TAIL>(v, phase);
  }
  template <typename S, typename F>
  __device__ __forceinline__ S blocks(const S& v, bool, const F& meanwhile) {
    meanwhile();
    return v;
  }
  __device__ __forceinline__ void finish() {}
};

}  // namespace cukern

// Thread-block clusters (sm_90): cluster barriers, distributed shared memory, mbarriers, and the
// all-reduces of reduce.cuh's states across the blocks of a cluster.
#pragma once
#include "memory.cuh"
#include "reduce.cuh"

namespace cukern {

// The two halves of cluster_sync, for a caller with work to do between them. `release` (the
// same across a warp: .aligned) makes the warp's earlier writes visible to every block past
// the wait; it costs a GPU-wide fence (MEMBAR.ALL.GPU + ERRBAR in SASS) that waits for all of
// the warp's loads and stores in flight. A warp whose writes no other block reads arrives
// relaxed. The wait always acquires (and invalidates L1: CCTL.IVALL).
__device__ __forceinline__ void cluster_arrive(bool release) {
  if (release) {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  } else {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  }
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Every thread's earlier writes are visible to every block of the cluster past it.
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive(true);
  cluster_wait();
}
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Cluster kernels take their size as a template argument CLUSTER (with __cluster_dims__), or,
// with CLUSTER == 0, as a launch attribute (cuLaunchKernelEx): one instantiation for every size,
// which the forward norms use for packs narrower than 16 bytes (cukern/families/norm.py).
// This block's cluster's size, its index along the grid, and the number of clusters.
__device__ __forceinline__ int cluster_size() {
  unsigned n;
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return static_cast<int>(n);
}
__device__ __forceinline__ unsigned cluster_index() {
  unsigned i;
  asm("mov.u32 %0, %%clusterid.x;" : "=r"(i));
  return i;
}
__device__ __forceinline__ unsigned cluster_count() {
  unsigned n;
  asm("mov.u32 %0, %%nclusterid.x;" : "=r"(n));
  return n;
}
// The shared-memory address of `p` in the block of cluster rank `rank`.
__device__ __forceinline__ unsigned cluster_map(const void* p, unsigned rank) {
  unsigned local, remote;
  asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
               : "=r"(local) : "l"(p));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
__device__ __forceinline__ float cluster_load(unsigned addr, float) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ double cluster_load(unsigned addr, double) {
  double v;
  asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(addr) : "memory");
  return v;
}
// Asynchronous store into another block's shared memory (`addr`, from cluster_map) that, once
// done, counts its bytes off that block's mbarrier (`bar`, from cluster_map): the receiver's wait
// on the barrier sees the value, and the sender neither waits nor fences.
__device__ __forceinline__ void cluster_store_async(unsigned addr, float v, unsigned bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
               ::"r"(addr), "f"(v), "r"(bar) : "memory");
}
__device__ __forceinline__ void cluster_store_async(unsigned addr, double v, unsigned bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f64 [%0], %1, [%2];"
               ::"r"(addr), "d"(v), "r"(bar) : "memory");
}

// Shared-memory barriers (mbarrier, sm_90) that count the bytes other blocks of the cluster
// store into this block's shared memory: a block learns that its peers' stores are done
// without a cluster barrier. Phase p of a barrier completes once its one expected arrival
// (mbarrier_arrive_expect, by this block) has come and every byte it announced has landed.
__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count)
               : "memory");
}
// Makes this thread's mbarrier_init visible to the cluster's other blocks (before a cluster_sync).
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// This thread's arrival on this block's barrier, announcing `bytes` more to come this phase.
__device__ __forceinline__ void mbarrier_arrive_expect(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               ::"r"(shared_address(bar)), "r"(bytes) : "memory");
}
// Waits until the phase of parity `parity` of this block's barrier completes. The stores it
// counted landed in this block's own shared memory and are visible once the phase completes (as
// for a TMA load), so the wait acquires at block scope: at cluster scope it would also
// invalidate L1 on every wait (CCTL.IVALL in SASS), where the backward norms read gamma on every
// row (docs/notes/kernels.md, "Cluster reductions").
__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity) {
  const unsigned addr = shared_address(bar);
  unsigned done = 0;
  while (!done) {
    asm volatile(
        "{ .reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(done) : "r"(addr), "r"(parity) : "memory");
  }
}

// ---------------------------------------------------------------------------------------------
// The states' (reduce.cuh) reads from, and stores to, another block's shared memory.
template <typename C, int K, typename Op>
__device__ __forceinline__ Lanes<C, K, Op> Lanes<C, K, Op>::remote(unsigned addr) {
  Lanes s;
#pragma unroll
  for (int k = 0; k < K; ++k) s.v[k] = cluster_load(addr + k * sizeof(C), C());
  return s;
}
template <typename C, int K, typename Op>
__device__ __forceinline__ void Lanes<C, K, Op>::put_remote(unsigned addr, unsigned bar) const {
#pragma unroll
  for (int k = 0; k < K; ++k) cluster_store_async(addr + k * sizeof(C), v[k], bar);
}
template <typename C> __device__ __forceinline__ Welford<C> Welford<C>::remote(unsigned addr) {
  return Welford{cluster_load(addr, C()), cluster_load(addr + sizeof(C), C()),
                 cluster_load(addr + 2 * sizeof(C), C())};
}
template <typename C> __device__ __forceinline__ MaxSum<C> MaxSum<C>::remote(unsigned addr) {
  return MaxSum{cluster_load(addr, C()), cluster_load(addr + sizeof(C), C())};
}

// ---------------------------------------------------------------------------------------------
// All-reduces across the blocks of a cluster.

// The merge of the cluster's N blocks' states (`slot` in each block's shared memory) over groups
// of N lanes of a warp (N its size): the first group holds every rank's state.
template <int N, typename S>
__device__ __forceinline__ S merge_ranks(const S* slot, unsigned lane) {
  const S ranks = lane < N ? S::remote(cluster_map(slot, lane)) : S::identity();
  return allreduce_group(ranks, N);
}

// Merges the blocks' states over a whole cluster (sm_90), given each block's state (the same in
// every thread of the block): warp 0 of each block merges them from distributed shared memory
// in rank order (every block gets bit-identical results) and hands the result to its block.
// Two buffers, picked by `b` (alternating from call to call, from 0): a block rewrites a buffer
// two calls later, past a cluster barrier that every warp 0 reading it in the earlier call
// reached after its reads, so one cluster barrier a call is enough. Only warp 0 writes (the
// slot) or reads (the peers' slots) across blocks: it alone arrives with release; the other
// warps arrive relaxed, with no fence. `meanwhile()` runs in every thread between the arrive
// and the wait (loads that the fence must not wait for). The final call (`last`, the same in
// every block) arrives once more after its reads and returns without waiting: the caller
// must call cluster_wait() before the block exits, so that no block exits while another still
// reads its state, and may store its results first. Every thread of every block must call it,
// with `n` the cluster's size (CLUSTER, or cluster_size() where CLUSTER is 0). MERGE > 0: the
// buffers are merge_tail's four slots of MERGE bytes (memory.cuh), at the same offsets for every
// state type a kernel merges; else static. Measurements: docs/notes/kernels.md, "Cluster
// reductions".
template <int CLUSTER, int MERGE = 0, typename S, typename F>
__device__ __forceinline__ S merge_cluster(const S& v, int n, unsigned b, bool last,
                                           const F& meanwhile) {
  static_assert(MERGE == 0 || (sizeof(S) <= MERGE && MERGE % alignof(S) == 0),
                "MERGE: bytes of the largest state a kernel merges");
  S* slot;
  S* result;
  if constexpr (MERGE > 0) {
    slot = reinterpret_cast<S*>(merge_tail<MERGE>() + b * MERGE);
    result = reinterpret_cast<S*>(merge_tail<MERGE>() + (2 + b) * MERGE);
  } else {
    __shared__ S slots[2], results[2];
    slot = &slots[b];
    result = &results[b];
  }
  const int tid = threadIdx.x + blockDim.x * threadIdx.y;
  const bool reader = tid < 32;  // warp 0
  if (tid == 0) *slot = v;
  cluster_arrive(reader);
  meanwhile();
  cluster_wait();  // every block's state is written
  if (reader) {
    const unsigned lane = tid;
    S w;
    if constexpr (CLUSTER > 0) {
      w = merge_ranks<CLUSTER>(slot, lane);
    } else {  // the reduction's width at compile time: the planner's sizes (any other traps)
      switch (n) {
        case 2: w = merge_ranks<2>(slot, lane); break;
        case 4: w = merge_ranks<4>(slot, lane); break;
        case 8: w = merge_ranks<8>(slot, lane); break;
        case 16: w = merge_ranks<16>(slot, lane); break;
        default: __trap();
      }
    }
    if (lane == 0) *result = w;
  }
  if (last) cluster_arrive(reader);  // this block's reads are done; cluster_wait() before exit
  __syncthreads();  // the result written
  return *result;
}

// All-reduce over a whole cluster: the block's state (allreduce_block), then merge_cluster (its
// `meanwhile` and `last` as there), each call with its buffer picked by `phase` (as in
// allreduce_block). Every thread of every block must call it, with the same `phase`.
// MERGE > 0: every buffer in the tail of the dynamic shared memory (memory.cuh), none static.
template <int CLUSTER, int MERGE = 0, int BUFFERS = 2, typename S, typename F>
__device__ __forceinline__ S allreduce_cluster(S v, int n, unsigned& phase, bool last,
                                               const F& meanwhile) {
  const unsigned b = phase & 1u;
  return merge_cluster<CLUSTER, MERGE>(allreduce_block_in<(MERGE > 0), MERGE, BUFFERS>(v, phase),
                                       n, b, last, meanwhile);
}

// The same all-reduce with no cluster barrier a call: threads 0..CLUSTER-1 send the block's state
// to every block (its inbox slot `rank`) with cluster_store_async, counted off that block's
// mbarrier; each block waits on its own mbarrier for the CLUSTER states, and every warp merges
// them from its own shared memory (the same states in the same butterfly: bit-identical results
// in every block). A cluster barrier only on the first call (every block's mbarriers initialised
// before anyone sends) and the last (`last`: no block exits while a store to it may be on its
// way). A peer's bytes may land before this block announces them (mbarrier_arrive_expect): the
// barrier's transaction count then runs below zero, and the phase still waits for the arrival.
// Two inboxes, each with its mbarrier, picked by `phase`: a peer sends to inbox b again two
// calls later, once its own wait has seen this block's state of the call between, which this
// block sends past the block barrier in allreduce_block, which each of its warps reaches after
// reading inbox b. `phase` must count only this function's calls (from 0), the same in every
// thread of every block, all of which must call it. It avoids the cluster barrier's fence and
// L1 invalidation, which nothing hides where a block is alone on its SM (the norms' backward);
// where blocks share an SM, allreduce_cluster is faster (docs/notes/kernels.md).
template <int CLUSTER, typename S>
__device__ __forceinline__ S allreduce_cluster_async(S v, unsigned& phase, bool last) {
  static_assert(CLUSTER > 0, "the cluster's size compiled in");
  static_assert(sizeof(S) % 4 == 0, "a state is whole 4-byte words");
  __shared__ S inbox[2][CLUSTER];
  __shared__ unsigned long long arrived[2];
  const unsigned call = phase, b = call & 1u;
  const int tid = threadIdx.x + blockDim.x * threadIdx.y;
  if (call == 0) {
    if (tid == 0) {
      mbarrier_init(&arrived[0], 1);
      mbarrier_init(&arrived[1], 1);
      mbarrier_init_fence();
    }
    cluster_sync();
  }
  if (tid == 0) mbarrier_arrive_expect(&arrived[b], CLUSTER * sizeof(S));
  v = allreduce_block(v, phase);
  if (tid < CLUSTER) {
    v.put_remote(cluster_map(&inbox[b][cluster_rank()], tid), cluster_map(&arrived[b], tid));
  }
  mbarrier_wait(&arrived[b], (call >> 1) & 1u);
  const int lane = static_cast<int>(lane_id());
  // every group of CLUSTER lanes merges all the states, in the same order
  const S w = allreduce_group(inbox[b][lane % CLUSTER], CLUSTER);
  if (last) cluster_sync();
  return w;
}

// The packs [p0, p1) of `num_packs` that cluster rank `rank` of `cluster` blocks owns.
__device__ __forceinline__ void cluster_pack_range(int num_packs, int cluster, unsigned rank,
                                                   int& p0, int& p1) {
  const int per = (num_packs + cluster - 1) / cluster;
  p0 = min(num_packs, static_cast<int>(rank) * per);
  p1 = min(num_packs, p0 + per);
}

// The cluster's size n: CLUSTER, or where CLUSTER is 0 the size set at launch (read once).
template <int CLUSTER> struct ClusterSize {
  static constexpr int n = CLUSTER;
};
template <> struct ClusterSize<0> {
  int n;
  __device__ __forceinline__ ClusterSize() : n(cluster_size()) {}
};

// BlockReduce's interface (reduce.cuh) over a cluster of n blocks (ClusterSize): operator() is
// allreduce_cluster, blocks() merge_cluster, finish() the cluster wait that a `last` call owes.
// MERGE > 0: every buffer in the tail of the dynamic shared memory, the merge's slots of MERGE
// bytes (the largest state the kernel merges; the planner's tail_scratch). BUFFERS = 1 (MERGE >
// 0): the block all-reduce's one buffer (allreduce_block_in), safe from one operator() or
// blocks() call to the next (their cluster barrier); two block() calls in a row need a
// __syncthreads() between them (kOneBuffer).
template <int CLUSTER, int MERGE = 0, int BUFFERS = 2> struct ClusterReduce : ClusterSize<CLUSTER> {
  using ClusterSize<CLUSTER>::n;
  static constexpr bool kCluster = true;
  static constexpr bool kOneBuffer = BUFFERS == 1;
  unsigned phase = 0, block_phase = 0;
  template <typename S, typename F>
  __device__ __forceinline__ S operator()(const S& v, bool last, const F& meanwhile) {
    return allreduce_cluster<CLUSTER, MERGE, BUFFERS>(v, n, phase, last, meanwhile);
  }
  template <typename S> __device__ __forceinline__ S operator()(const S& v, bool last) {
    return (*this)(v, last, [] {});
  }
  template <typename S> __device__ __forceinline__ S block(const S& v) {
    return allreduce_block_in<(MERGE > 0), MERGE, BUFFERS>(v, block_phase);
  }
  template <typename S, typename F>
  __device__ __forceinline__ S blocks(const S& v, bool last, const F& meanwhile) {
    return merge_cluster<CLUSTER, MERGE>(v, n, phase++ & 1u, last, meanwhile);
  }
  __device__ __forceinline__ void finish() { cluster_wait(); }
};

}  // namespace cukern

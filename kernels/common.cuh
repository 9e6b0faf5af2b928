// Shared device code for every cukern kernel family: storage types, numeric conversion,
// vector packs, Load/Store functors, warp/block reductions and small math helpers.
// Compiled through NVRTC with no CUDA headers: half and bfloat16 are plain 16-bit storage
// types converted with PTX instructions, so the compile check needs nothing but NVRTC itself.
#pragma once

namespace cukern {

typedef long long i64;

// ---------------------------------------------------------------------------------------------
// Storage types and conversion to/from the compute type.
struct f16 { unsigned short bits; };
struct bf16 { unsigned short bits; };

// exp through exp2 on the special-function unit: about 2 ulp. Used where its error is far
// below what follows: results stored in 16 bits, and the row sums of an online softmax.
__device__ __forceinline__ float exp_approx(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v * 1.4426950408889634f));
  return r;
}

template <typename T> struct Num;

// Num<T>::exp is the exponential an op on T-typed data uses: exact for float and double, the
// fast approximation for half and bfloat16, whose rounding (2^-11, 2^-8) dwarfs its error.
template <> struct Num<float> {
  typedef float compute;
  static __device__ __forceinline__ float exp(float v) { return expf(v); }
  static __device__ __forceinline__ float to(float v) { return v; }
  static __device__ __forceinline__ float from(float v) { return v; }
};

template <> struct Num<double> {
  typedef double compute;
  static __device__ __forceinline__ double exp(double v) { return ::exp(v); }
  static __device__ __forceinline__ double to(double v) { return v; }
  static __device__ __forceinline__ double from(double v) { return v; }
};

template <> struct Num<f16> {
  typedef float compute;
  static __device__ __forceinline__ float exp(float v) { return exp_approx(v); }
  static __device__ __forceinline__ float to(f16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
  }
  static __device__ __forceinline__ f16 from(float v) {
    f16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));
    return h;
  }
};

template <> struct Num<bf16> {
  typedef float compute;
  static __device__ __forceinline__ float exp(float v) { return exp_approx(v); }
  static __device__ __forceinline__ float to(bf16 v) {
    return __uint_as_float(static_cast<unsigned>(v.bits) << 16);
  }
  static __device__ __forceinline__ bf16 from(float v) {
    bf16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));  // sm_80 and newer
    return h;
  }
};

// ---------------------------------------------------------------------------------------------
// Math in the compute type (float or double).

template <typename C> struct Math;

template <> struct Math<float> {
  static __device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }
  static __device__ __forceinline__ float exp(float v) { return expf(v); }
  static __device__ __forceinline__ float exp_fast(float v) { return exp_approx(v); }
  static __device__ __forceinline__ float log(float v) { return logf(v); }
  static __device__ __forceinline__ float rsqrt(float v) { return rsqrtf(v); }
  static __device__ __forceinline__ float div(float a, float b) { return a / b; }
  // About 2 ulp, no slow path (|b| < 2^126): for weights and means whose last bits do not matter.
  static __device__ __forceinline__ float div_fast(float a, float b) { return __fdividef(a, b); }
};

template <> struct Math<double> {
  static __device__ __forceinline__ double inf() { return __longlong_as_double(0x7ff0000000000000LL); }
  static __device__ __forceinline__ double exp(double v) { return ::exp(v); }
  static __device__ __forceinline__ double exp_fast(double v) { return ::exp(v); }
  static __device__ __forceinline__ double log(double v) { return ::log(v); }
  static __device__ __forceinline__ double rsqrt(double v) { return ::rsqrt(v); }
  static __device__ __forceinline__ double div(double a, double b) { return a / b; }
  static __device__ __forceinline__ double div_fast(double a, double b) { return a / b; }
};

// A max that keeps NaN, so a NaN anywhere in a row reaches every output of that row. In
// float, one instruction (sm_80 and newer) where the generic form takes a compare, a NaN test
// and a select.
template <typename C> __device__ __forceinline__ C max_nan(C a, C b) {
  return (a > b || a != a) ? a : b;
}
template <> __device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// ---------------------------------------------------------------------------------------------
// Vector packs: N elements of T moved by one load or store instruction.
template <int BYTES> struct Word;
template <> struct Word<2> { typedef unsigned short type; };
template <> struct Word<4> { typedef unsigned int type; };
template <> struct Word<8> { typedef uint2 type; };
template <> struct Word<16> { typedef uint4 type; };

template <typename T, int N> union Pack {
  typedef typename Word<sizeof(T) * N>::type word_t;
  word_t word;
  T elem[N];
};

// Element i of a pack in the compute type. bfloat16 is the top half of a float: each value
// comes out of its 32-bit word with one shift or mask (per-element conversion costs about two
// instructions: extract, then shift).
template <typename T, int N>
__device__ __forceinline__ typename Num<T>::compute pack_value(const Pack<T, N>& p, int i) {
  return Num<T>::to(p.elem[i]);
}
template <int N> __device__ __forceinline__ float pack_value(const Pack<bf16, N>& p, int i) {
  if constexpr (N >= 2) {
    const unsigned w = reinterpret_cast<const unsigned*>(&p.word)[i / 2];
    return __uint_as_float(i % 2 ? (w & 0xffff0000u) : (w << 16));
  } else {
    return Num<bf16>::to(p.elem[i]);
  }
}

// The vector word of N values, assembled with integer ops, and stored with one instruction.
// (Through the union, the compiler takes the word apart again and stores it in 2- to 4-byte
// pieces: four or more store instructions a pack.)
template <typename T, int N> struct WordOf;
template <typename H> __device__ __forceinline__ unsigned pair16(const H* e) {
  return static_cast<unsigned>(e[0].bits) | (static_cast<unsigned>(e[1].bits) << 16);
}
#define CUKERN_HALF_WORDS(H)                                                              \
  template <> struct WordOf<H, 1> {                                                       \
    static __device__ __forceinline__ unsigned short make(const H* e) { return e[0].bits; } \
  };                                                                                      \
  template <> struct WordOf<H, 2> {                                                       \
    static __device__ __forceinline__ unsigned make(const H* e) { return pair16(e); }    \
  };                                                                                      \
  template <> struct WordOf<H, 4> {                                                       \
    static __device__ __forceinline__ uint2 make(const H* e) {                           \
      return make_uint2(pair16(e), pair16(e + 2));                                        \
    }                                                                                     \
  };                                                                                      \
  template <> struct WordOf<H, 8> {                                                       \
    static __device__ __forceinline__ uint4 make(const H* e) {                           \
      return make_uint4(pair16(e), pair16(e + 2), pair16(e + 4), pair16(e + 6));          \
    }                                                                                     \
  };
CUKERN_HALF_WORDS(f16)
CUKERN_HALF_WORDS(bf16)
#undef CUKERN_HALF_WORDS
template <> struct WordOf<float, 1> {
  static __device__ __forceinline__ unsigned make(const float* e) { return __float_as_uint(e[0]); }
};
template <> struct WordOf<float, 2> {
  static __device__ __forceinline__ uint2 make(const float* e) {
    return make_uint2(__float_as_uint(e[0]), __float_as_uint(e[1]));
  }
};
template <> struct WordOf<float, 4> {
  static __device__ __forceinline__ uint4 make(const float* e) {
    return make_uint4(__float_as_uint(e[0]), __float_as_uint(e[1]), __float_as_uint(e[2]),
                      __float_as_uint(e[3]));
  }
};
__device__ __forceinline__ uint2 double_bits(double v) {
  const unsigned long long b = static_cast<unsigned long long>(__double_as_longlong(v));
  return make_uint2(static_cast<unsigned>(b), static_cast<unsigned>(b >> 32));
}
template <> struct WordOf<double, 1> {
  static __device__ __forceinline__ uint2 make(const double* e) { return double_bits(e[0]); }
};
template <> struct WordOf<double, 2> {
  static __device__ __forceinline__ uint4 make(const double* e) {
    const uint2 a = double_bits(e[0]), b = double_bits(e[1]);
    return make_uint4(a.x, a.y, b.x, b.y);
  }
};

// One store instruction of a whole word to global memory.
__device__ __forceinline__ void store_global(unsigned short* p, unsigned short w) { *p = w; }
__device__ __forceinline__ void store_global(unsigned* p, unsigned w) {
  asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(w) : "memory");
}
__device__ __forceinline__ void store_global(uint2* p, uint2 w) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(w.x), "r"(w.y) : "memory");
}
__device__ __forceinline__ void store_global(uint4* p, uint4 w) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w.x), "r"(w.y),
               "r"(w.z), "r"(w.w)
               : "memory");
}

// ---------------------------------------------------------------------------------------------
// Where row `row`, column `col` of a (rows, cols) view lives. The host collapses any array to
// rows = outer * inner: element (o, c, i) sits at o * s_outer + c * s_col + i * s_inner.
// Contiguous rows (STRIDED == false) need inner == 1 and s_col == 1, and allow vector packs.
template <bool STRIDED> struct Layout {
  i64 s_outer, s_inner, s_col, inner;
  __device__ __forceinline__ i64 offset(i64 row, int col) const {
    if (STRIDED) {
      return (row / inner) * s_outer + (row % inner) * s_inner + static_cast<i64>(col) * s_col;
    }
    return row * s_outer + col;
  }
};

// Reads N consecutive columns of one row and converts them to the compute type; `raw` reads
// them in the storage type.
template <typename T, typename C, bool STRIDED> struct Load {
  const T* ptr;
  Layout<STRIDED> at;
  template <int N> __device__ __forceinline__ Pack<T, N> raw(i64 row, int col) const {
    Pack<T, N> pack;
    if (STRIDED) {
#pragma unroll
      for (int i = 0; i < N; ++i) pack.elem[i] = ptr[at.offset(row, col + i)];
    } else {
      pack.word = *reinterpret_cast<const typename Pack<T, N>::word_t*>(ptr + at.offset(row, col));
    }
    return pack;
  }
  template <int N> __device__ __forceinline__ void load(C* dst, i64 row, int col) const {
    const Pack<T, N> pack = raw<N>(row, col);
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = pack_value(pack, i);
  }
};

// Converts N compute values to T and writes them to N consecutive columns of one row.
template <typename C, typename T, bool STRIDED> struct Store {
  T* ptr;
  Layout<STRIDED> at;
  template <int N> __device__ __forceinline__ void store(const C* src, i64 row, int col) const {
    if (STRIDED) {
#pragma unroll
      for (int i = 0; i < N; ++i) ptr[at.offset(row, col + i)] = Num<T>::from(src[i]);
    } else {
      T e[N];
#pragma unroll
      for (int i = 0; i < N; ++i) e[i] = Num<T>::from(src[i]);
      store_global(reinterpret_cast<typename Pack<T, N>::word_t*>(ptr + at.offset(row, col)),
                   WordOf<T, N>::make(e));
    }
  }
};

// A row cached on chip in the storage type: packs of N elements in shared memory.
template <typename T, typename C, int N> struct SmemRow {
  T* base;
  __device__ __forceinline__ void put(int pack_id, const C* v) const {
    T e[N];
#pragma unroll
    for (int i = 0; i < N; ++i) e[i] = Num<T>::from(v[i]);
    reinterpret_cast<typename Pack<T, N>::word_t*>(base)[pack_id] = WordOf<T, N>::make(e);
  }
  __device__ __forceinline__ void get(int pack_id, C* v) const {
    Pack<T, N> pack;
    pack.word = reinterpret_cast<const typename Pack<T, N>::word_t*>(base)[pack_id];
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = pack_value(pack, i);
  }
};

// ---------------------------------------------------------------------------------------------
// Asynchronous copies from global to shared memory (sm_80+): a thread can have every pack it
// owns in flight at once, whatever the compiler's register budget, and waits once.
__device__ __forceinline__ unsigned shared_address(const void* p) {
  unsigned a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
// dst: a shared-memory address (shared_address), which a loop can compute once.
template <int BYTES> __device__ __forceinline__ void cp_async_to(unsigned dst, const void* src) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async moves 4, 8 or 16 bytes");
  if (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(src), "n"(BYTES)
                 : "memory");
  }
}
template <int BYTES> __device__ __forceinline__ void cp_async(void* dst, const void* src) {
  cp_async_to<BYTES>(shared_address(dst), src);
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}
// Closes the group of copies issued since the last commit; wait_group<N> waits until at most
// the N most recent groups are still in flight.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N> __device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// Asks L2 to fetch `bytes` (a multiple of 16) of global memory from `src` (16-byte aligned) in
// the background: one instruction for a whole span, no registers, nothing to wait for (sm_90;
// elsewhere a no-op).
__device__ __forceinline__ void prefetch_l2(const void* src, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
#endif
}
// The dynamic shared memory this launch was given.
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
  unsigned n;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}

// The dynamic shared memory. It begins where the kernel's static shared memory (reduction
// buffers) ends, which ptxas aligns to 16 bytes only, whatever the declaration asks.
// Asynchronous copies into a row cache 16 or 48 bytes past a 128-byte boundary measured up to
// 12 points of copy bandwidth slower on the H100 (RMS norm, float32, 262144 columns over
// clusters of 16 blocks: 75% of copy, 87% aligned). The norms' plans ask for kSmemAlign bytes
// more (OpInfo.smem_align in cukern/_dispatch.py): their cluster kernels, whose static buffers
// end anywhere, take the dynamic memory from its first kSmemAlign-byte boundary; their block
// kernels, whose only static buffers are allreduce_block's 64 states (a multiple of 256 bytes,
// after the 1 KiB the hardware reserves), start on one already and take it as it is (computing
// the offset measured 1-2 points slower for the instruction-bound float16 layer norm at 2048
// columns).
constexpr unsigned kSmemAlign = 128;
template <typename T> __device__ __forceinline__ T* dynamic_smem() {
  extern __shared__ uint4 smem_words[];
  return reinterpret_cast<T*>(smem_words);
}
template <typename T> __device__ __forceinline__ T* aligned_dynamic_smem() {
  extern __shared__ uint4 smem_words[];
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(smem_words));
  return reinterpret_cast<T*>(reinterpret_cast<char*>(smem_words) +
                              (kSmemAlign - at % kSmemAlign) % kSmemAlign);
}

// ---------------------------------------------------------------------------------------------
// Reductions.
struct SumOp {
  template <typename C> static __device__ __forceinline__ C apply(C a, C b) { return a + b; }
  template <typename C> static __device__ __forceinline__ C identity() { return C(0); }
};
struct MaxOp {
  template <typename C> static __device__ __forceinline__ C apply(C a, C b) { return max_nan(a, b); }
  template <typename C> static __device__ __forceinline__ C identity() { return -Math<C>::inf(); }
};

// Butterfly all-reduce inside groups of WIDTH consecutive lanes (WIDTH a power of two <= 32).
// Every lane of the warp must call it.
template <typename Op, int WIDTH, typename C> __device__ __forceinline__ C group_allreduce(C v) {
#pragma unroll
  for (int mask = WIDTH / 2; mask > 0; mask /= 2) {
    v = Op::apply(v, __shfl_xor_sync(0xffffffffu, v, mask, WIDTH));
  }
  return v;
}

// All-reduce over a block of BLOCK threads (a multiple of 32). Every thread must call it;
// it ends with a barrier, so calls may follow each other.
template <typename Op, int BLOCK, typename C> __device__ __forceinline__ C block_allreduce(C v) {
  constexpr int WARPS = BLOCK / 32;
  __shared__ C partial[WARPS];
  __shared__ C result;
  v = group_allreduce<Op, 32>(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    C w = lane < WARPS ? partial[lane] : Op::template identity<C>();
    w = group_allreduce<Op, 32>(w);
    if (lane == 0) result = w;
  }
  __syncthreads();
  v = result;
  __syncthreads();
  return v;
}

// ---------------------------------------------------------------------------------------------
// Online softmax state: the running max m and the sum d of exp(x - m) seen so far (exp_fast:
// 2 ulp on a sum of positive terms). Empty (m = -inf, d = 0) until a finite value arrives.
template <typename T, typename C = typename Num<T>::compute> struct MaxSum {
  C m, d;
  static __device__ __forceinline__ MaxSum empty() { return MaxSum{-Math<C>::inf(), C(0)}; }
  // Rescale a partial sum to a new max; an empty part (m == -inf) contributes nothing.
  __device__ __forceinline__ C sum_at(C new_m) const {
    return m == -Math<C>::inf() ? C(0) : d * Math<C>::exp_fast(m - new_m);
  }
  static __device__ __forceinline__ MaxSum merge(const MaxSum& a, const MaxSum& b) {
    const C m = max_nan(a.m, b.m);
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
};

template <int WIDTH, typename T, typename C>
__device__ __forceinline__ MaxSum<T, C> group_allreduce(MaxSum<T, C> v) {
#pragma unroll
  for (int mask = WIDTH / 2; mask > 0; mask /= 2) {
    MaxSum<T, C> o{__shfl_xor_sync(0xffffffffu, v.m, mask, WIDTH),
                   __shfl_xor_sync(0xffffffffu, v.d, mask, WIDTH)};
    v = MaxSum<T, C>::merge(v, o);
  }
  return v;
}

template <int BLOCK, typename T, typename C>
__device__ __forceinline__ MaxSum<T, C> block_allreduce(MaxSum<T, C> v) {
  constexpr int WARPS = BLOCK / 32;
  __shared__ C pm[WARPS], pd[WARPS];
  __shared__ C rm, rd;
  v = group_allreduce<32>(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) { pm[warp] = v.m; pd[warp] = v.d; }
  __syncthreads();
  if (warp == 0) {
    MaxSum<T, C> w = lane < WARPS ? MaxSum<T, C>{pm[lane], pd[lane]} : MaxSum<T, C>::empty();
    w = group_allreduce<32>(w);
    if (lane == 0) { rm = w.m; rd = w.d; }
  }
  __syncthreads();
  v = MaxSum<T, C>{rm, rd};
  __syncthreads();
  return v;
}

// ---------------------------------------------------------------------------------------------
// Thread-block clusters (sm_90): barriers and reads of another block's shared memory.
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
// invalidate L1 on every wait (CCTL.IVALL in SASS), which cost the backward norms 1-4 points of
// copy on the H100 (gamma is read through L1 on every row).
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

// All-reduce of one value per block across the CLUSTER blocks of a cluster (sm_90). `v` must
// be the same in every thread of a block; every thread of every block must call it.
template <typename Op, int CLUSTER, typename C> __device__ __forceinline__ C cluster_allreduce(C v) {
  __shared__ C slot, result;
  if (threadIdx.x == 0) slot = v;
  cluster_sync();  // every block's value is written
  if (threadIdx.x < 32) {
    const unsigned lane = threadIdx.x;
    C w = lane < CLUSTER ? cluster_load(cluster_map(&slot, lane), C()) : Op::template identity<C>();
    w = group_allreduce<Op, 32>(w);
    if (lane == 0) result = w;
  }
  cluster_sync();  // every remote read is done: slots may be rewritten or freed after this
  return result;
}

// The same for an online softmax state: every block of the cluster gets the merged state.
template <int CLUSTER, typename T, typename C>
__device__ __forceinline__ MaxSum<T, C> cluster_allreduce(MaxSum<T, C> v) {
  __shared__ C slot_m, slot_d, result_m, result_d;
  if (threadIdx.x == 0) { slot_m = v.m; slot_d = v.d; }
  cluster_sync();
  if (threadIdx.x < 32) {
    const unsigned lane = threadIdx.x;
    MaxSum<T, C> w = MaxSum<T, C>::empty();
    if (lane < CLUSTER) {
      w = MaxSum<T, C>{cluster_load(cluster_map(&slot_m, lane), C()),
                       cluster_load(cluster_map(&slot_d, lane), C())};
    }
    w = group_allreduce<32>(w);
    if (lane == 0) { result_m = w.m; result_d = w.d; }
  }
  cluster_sync();
  return MaxSum<T, C>{result_m, result_d};
}

// ---------------------------------------------------------------------------------------------
// All-reduces whose shape is known only at run time, over reduction states.
//
// group_allreduce / block_allreduce above take the group width and block size as template
// arguments. The versions below read them from the launch (group width = blockDim.x, block =
// blockDim.x * blockDim.y threads, a multiple of 32 up to 1024), so a kernel need not be
// instantiated once per shape; they also reduce across the blocks of a cluster.
//
// A state S is a trivial struct with
//   static S identity();  static S merge(const S& a, const S& b);
//   S shfl_xor(int mask) const;          (every lane of the warp calls it)
//   static S remote(unsigned addr);      (reads a state from another block's shared memory)
//   void put_remote(unsigned addr, unsigned bar) const;  (allreduce_cluster_async only: stores
//       every field to another block's shared memory with cluster_store_async, sizeof(S) bytes
//       counted off `bar` there)
// merge must be commutative bit for bit (merge(a, b) == merge(b, a) exactly), so that both
// lanes of a butterfly step, and every warp reducing the same partials, end with bit-identical
// results with no lane-dependent operand order (which would diverge the warp).

__device__ __forceinline__ unsigned lane_id() {
  unsigned l;
  asm("mov.u32 %0, %%laneid;" : "=r"(l));
  return l;
}

// K sums carried together (one shuffle round for all of them).
template <typename C, int K> struct Sums {
  C v[K];
  static __device__ __forceinline__ Sums identity() {
    Sums s;
#pragma unroll
    for (int k = 0; k < K; ++k) s.v[k] = C(0);
    return s;
  }
  static __device__ __forceinline__ Sums merge(const Sums& a, const Sums& b) {
    Sums s;
#pragma unroll
    for (int k = 0; k < K; ++k) s.v[k] = a.v[k] + b.v[k];
    return s;
  }
  __device__ __forceinline__ Sums shfl_xor(int mask) const {
    Sums s;
#pragma unroll
    for (int k = 0; k < K; ++k) s.v[k] = __shfl_xor_sync(0xffffffffu, v[k], mask);
    return s;
  }
  static __device__ __forceinline__ Sums remote(unsigned addr) {
    Sums s;
#pragma unroll
    for (int k = 0; k < K; ++k) s.v[k] = cluster_load(addr + k * sizeof(C), C());
    return s;
  }
  __device__ __forceinline__ void put_remote(unsigned addr, unsigned bar) const {
#pragma unroll
    for (int k = 0; k < K; ++k) cluster_store_async(addr + k * sizeof(C), v[k], bar);
  }
};

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

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
  // Folds N values in: their exact two-pass mean and M2, then one merge.
  template <int N> __device__ __forceinline__ void add(const C* v) {
    C s = C(0);
#pragma unroll
    for (int i = 0; i < N; ++i) s += v[i];
    const C m = s / C(N);
    C q = C(0);
#pragma unroll
    for (int i = 0; i < N; ++i) q += (v[i] - m) * (v[i] - m);
    *this = merge(*this, Welford{C(N), m, q});
  }
  __device__ __forceinline__ Welford shfl_xor(int mask) const {
    return Welford{__shfl_xor_sync(0xffffffffu, n, mask), __shfl_xor_sync(0xffffffffu, mean, mask),
                   __shfl_xor_sync(0xffffffffu, m2, mask)};
  }
  static __device__ __forceinline__ Welford remote(unsigned addr) {
    return Welford{cluster_load(addr, C()), cluster_load(addr + sizeof(C), C()),
                   cluster_load(addr + 2 * sizeof(C), C())};
  }
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

// All-reduce over the whole block, with one barrier. Every thread must call it, with the same
// `phase` (a counter each thread keeps, starting at 0, that the call advances): it picks one of
// two buffers for the warps' partial states, so a call never overwrites partials that threads
// may still be reading from the previous call (a thread reaching the call after that has passed
// the barrier of the one between). Every warp reduces the partials itself: no broadcast.
template <typename S> __device__ __forceinline__ S allreduce_block(S v, unsigned& phase) {
  __shared__ S partial[2][32];
  const int tid = threadIdx.x + blockDim.x * threadIdx.y;
  const int warp = tid / 32, nwarps = (blockDim.x * blockDim.y + 31) / 32;
  const unsigned lane = lane_id();
  S* const slots = partial[phase & 1u];
  phase += 1;
  v = allreduce_group(v, 32);
  if (lane == 0) slots[warp] = v;
  __syncthreads();
  return allreduce_group(static_cast<int>(lane) < nwarps ? slots[lane] : S::identity(), 32);
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
// reads its state, and may store its results first. Every thread of every block must call it.
// Measured on the H100 (forward norms, % of copy, means of three runs; two A/B runs): relaxed
// arrives for warps 1.., layer norm at 262144 columns float32 88.4 -> 89.9, float16 89.2 ->
// 89.6, bfloat16 89.2 -> 89.8, RMS float32 94.2 -> 95.7; then the last wait deferred and
// layer norm's first gamma and beta loaded in `meanwhile` (the fence had waited for them):
// float32 90.0 -> 90.8, float16 90.0 -> 91.1, bfloat16 90.5 -> 91.6, float32 at 131072
// columns 94.7 -> 96.0; 16-bit layer norm at 65536 columns 94.2 -> 93.2-93.5 (92.4 before).
template <int CLUSTER, typename S, typename F>
__device__ __forceinline__ S merge_cluster(const S& v, unsigned b, bool last,
                                           const F& meanwhile) {
  __shared__ S slot[2], result[2];
  const int tid = threadIdx.x + blockDim.x * threadIdx.y;
  const bool reader = tid < 32;  // warp 0
  if (tid == 0) slot[b] = v;
  cluster_arrive(reader);
  meanwhile();
  cluster_wait();  // every block's state is written
  if (reader) {
    const unsigned lane = tid;
    // groups of CLUSTER lanes: the first holds every rank's state
    const S ranks = lane < CLUSTER ? S::remote(cluster_map(&slot[b], lane)) : S::identity();
    const S w = allreduce_group(ranks, CLUSTER);
    if (lane == 0) result[b] = w;
  }
  if (last) cluster_arrive(reader);  // this block's reads are done; cluster_wait() before exit
  __syncthreads();  // result[b] written
  return result[b];
}

// All-reduce over a whole cluster: the block's state (allreduce_block), then merge_cluster (its
// `meanwhile` and `last` as there), each call with its buffer picked by `phase` (as in
// allreduce_block). Every thread of every block must call it, with the same `phase`.
template <int CLUSTER, typename S, typename F>
__device__ __forceinline__ S allreduce_cluster(S v, unsigned& phase, bool last,
                                               const F& meanwhile) {
  const unsigned b = phase & 1u;
  return merge_cluster<CLUSTER>(allreduce_block(v, phase), b, last, meanwhile);
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
// thread of every block, all of which must call it.
// The cluster barrier's release fences every thread's earlier global stores (a MEMBAR.GPU in
// SASS) and its acquire invalidates L1: where a block is alone on its SM (the backward's 1024
// threads), nothing hides that. Measured on the H100 (cukern's backward with column sums, % of
// copy): layer norm float16 32768 columns 73 -> 79, RMS 77 -> 87, float32 65536 88 -> 91. The
// forward norms' blocks, three to an SM, measured 0.5-2.5 points slower with it than with
// allreduce_cluster (before its relaxed arrives), also with warp 0 alone waiting, and they
// keep that one.
template <int CLUSTER, typename S>
__device__ __forceinline__ S allreduce_cluster_async(S v, unsigned& phase, bool last) {
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


}  // namespace cukern
